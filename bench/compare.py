"""``python -m pipeline.compare`` against MLflow's own ``search_runs`` for the same runs, each in a fresh process
(``python -m bench --only compare``): 1,000 runs of 250 configurations (4 seeds each), with the params,
tags and metrics a pipeline run records, in a SQLite store. The two commands alternate (A B, B A, ...), the ratio is
the median of per-round ratios with its spread: the machine's drift cancels. The goal: compare at most 1.2x
``search_runs``, imports, reading and the table included. compare pauses Python's cyclic collector
(``pipeline.common.heap``), which a bare ``search_runs`` pays for; a second row times ``search_runs`` paused
the same way, so that what compare itself adds (the table, the chart, its imports) is shown apart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from pipeline.common.stats import paired_ratio
from pipeline.gpucheck.harness import QUICK, Row, Sizes, interleaved

GOAL = 1.2  # compare / search_runs, fresh processes
CONFIGS, SEEDS = 250, 4
EXPERIMENT = "bench-compare"
# what the baseline does: the one query compare makes, in a process of its own
SEARCH = (
    "import sys; from mlflow import MlflowClient; c = MlflowClient(sys.argv[1]); "
    "e = c.get_experiment_by_name(sys.argv[2]).experiment_id; "
    "print(len(c.search_runs([e], '', max_results=50000, order_by=['attributes.start_time ASC'])))"
)
PAUSED = "import gc; gc.disable(); " + SEARCH  # the same, with the collector paused as compare pauses it


def run_like(config: int, seed: int) -> tuple[dict[str, str], dict[str, str], dict[str, float]]:
    """Params, tags and final metrics shaped like one pipeline run's (``config`` sets batch, lr and workers)."""
    params = {f"model.layer{i}": str(64 * (i + 1)) for i in range(20)}
    params |= {f"optimizer.opt{i}": "0.9" for i in range(15)} | {f"data.key{i}": "digits" for i in range(10)}
    params |= {
        "loader.batch_size": str(2 ** (4 + config % 5)),
        "optimizer.lr": f"{1e-4 * (1 + config // 5):.4g}",
        "loader.num_workers": str(config % 3),
        "trainer.seed": str(seed),
        "tracking.run_name": f"c{config}-s{seed}",
    }
    tags = {f"process.t{i}": "x" * 30 for i in range(10)} | {
        "mlflow.source.git.commit": "0" * 40,
        "git.dirty": "false",
        "pipeline.version": "0.1.0",
        "torch.version": "2.14.1",
        "device.type": "cpu",
        "task.primary": "val/acc",
    }
    metrics = {f"system/m{i}": float(i) for i in range(15)} | {f"time/{k}_pct": 25.0 for k in ("data_wait", "h2d")}
    metrics |= {"time/compute_pct": 40.0, "time/overhead_pct": 10.0, "time/step_ms": 2.0 + config / 100}
    metrics |= {"time/epoch_s": 1.0 + seed / 100, "throughput/samples_per_s": 1000.0 + config + seed, "val/acc": 0.9}
    return params, tags, metrics


def make_store(path: Path, *, configs: int = CONFIGS, seeds: int = SEEDS) -> str:
    """A SQLite store at ``path`` holding ``configs * seeds`` runs in experiment ``EXPERIMENT``; its URI."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    uri = f"sqlite:///{path}"
    client = MlflowClient(uri)
    experiment = client.create_experiment(EXPERIMENT)
    now = int(time.time() * 1000)
    for config in range(configs):
        for seed in range(1, seeds + 1):
            params, tags, metrics = run_like(config, seed)
            run = client.create_run(experiment, run_name=params["tracking.run_name"], start_time=now)
            client.log_batch(
                run.info.run_id,
                metrics=[Metric(k, v, now, 2) for k, v in metrics.items()],
                params=[Param(k, v) for k, v in params.items()],
                tags=[RunTag(k, v) for k, v in tags.items()],
            )
            client.set_terminated(run.info.run_id, "FINISHED")
            now += 1
    return uri


def fresh_process(args: list[str], cwd: Path) -> float:
    """Seconds a fresh ``python`` with ``args`` takes, start to exit (its output discarded)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - start


def bench_compare(sizes: Sizes, work: Path) -> list[Row]:
    """``python -m pipeline.compare`` against ``search_runs`` of the same runs, fresh processes, interleaved."""
    configs = 10 if sizes is QUICK else CONFIGS
    folder = work / "compare"
    folder.mkdir(exist_ok=True)
    uri = make_store(folder / "mlflow.db", configs=configs)
    env_uri = os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        compare = ["-m", "pipeline.compare", "--uri", uri, "--experiment", EXPERIMENT, "--out", str(folder / "out")]
        seconds = interleaved(
            {
                "search_runs": lambda: fresh_process(["-c", SEARCH, uri, EXPERIMENT], folder),
                "paused": lambda: fresh_process(["-c", PAUSED, uri, EXPERIMENT], folder),
                "compare": lambda: fresh_process(compare, folder),
            },
            sizes,
        )
    finally:
        if env_uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = env_uri
    runs = f"{configs * SEEDS:,} runs ({configs} rows), fresh processes"
    ratio = paired_ratio(seconds["compare"], seconds["search_runs"])  # compare's time over search_runs' time, per round
    own = paired_ratio(seconds["compare"], seconds["paused"])
    return [
        Row(
            f"compare / search_runs, {runs} (<= {GOAL}x)",
            f"{ratio:.2f}x",
            f"<= {GOAL}x",
            ratio <= GOAL,
            _spread(seconds, "search_runs"),
        ),
        Row(
            f"compare / search_runs with the collector paused, {runs}",
            f"{own:.2f}x",
            "-",
            None,
            _spread(seconds, "paused"),
        ),
    ]


def _spread(seconds: dict[str, list[float]], baseline: str) -> str:
    ratios = sorted(c / s for c, s in zip(seconds["compare"], seconds[baseline], strict=True))
    return (
        f"per-round ratios {ratios[0]:.2f}–{ratios[-1]:.2f} over {len(ratios)} rounds; median "
        f"{median(seconds['compare']):.2f} s against {median(seconds[baseline]):.2f} s"
    )
