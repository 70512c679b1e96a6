"""The benchmark suite: what the pipeline costs, measured side by side in one process.

    python -m bench                 # everything, 7 repeats (about 5 minutes on 2 CPUs)
    python -m bench --quick         # a smoke run with tiny sizes (numbers meaningless)
    python -m bench --only overhead,resident --repeats 7

Variants of one comparison are interleaved (A B, B A, ...), one warm-up round is discarded,
ratios are medians of per-round ratios (``pipeline.common.stats.paired_ratio``: a round's variants run
back to back, so the machine's slow drifts cancel), and torch's thread count is fixed. The markdown table
it prints is what BENCHMARKS.md records. Nothing here is asserted in tests: timing claims live
here, not in the test suite.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.common.cli import Parser, command
from pipeline.common.stats import paired_ratio
from pipeline.config import DataConfig
from pipeline.data.sources import load_data
from pipeline.gpucheck.harness import (
    FULL,
    QUICK,
    Row,
    Sizes,
    bare_epoch,
    interleaved,
    machine,
    mlp,
    pipeline_epoch,
    quiet_logs,
    sampler_readings,
    table,
)
from pipeline.record.store import experiment_id
from pipeline.record.tracking import MlflowTracker

# ---------------------------------------------------------------------------------------------
# What is compared


def recipe_epoch(root: Path, *, batch: int) -> float:
    """The set-up recipe's loader: torchvision MNIST + ToTensor + DataLoader, one training epoch."""
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    dataset = datasets.MNIST(str(root), train=True, download=False, transform=transforms.ToTensor())
    loader = DataLoader(dataset, batch_size=batch, shuffle=True)
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = time.perf_counter()
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    loss.item()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# The benchmarks


def bench_overhead(sizes: Sizes, work: Path) -> list[Row]:
    """Pipeline (tracking, sampler, timing) vs a bare loop; sampler on/off; tracking cost."""
    data = ["data=synthetic", f"data.num_samples={sizes.samples}", "data.val_samples=500", "loader=resident"]
    bundle = load_data(
        DataConfig("synthetic", shape=[1, 28, 28], num_classes=10, num_samples=sizes.samples, val_samples=500)
    )
    images, labels = bundle.train.tensors
    rows = []
    for batch in (64, 512):
        store = work / f"overhead{batch}.db"
        writes: list[float] = []
        base = [*data, f"loader.batch_size={batch}"]
        variants = {
            "bare": lambda batch=batch: bare_epoch(images, labels, batch=batch),
            "full": lambda base=base, store=store, writes=writes: pipeline_epoch(base, store, writes),
        }
        if batch == 64:
            variants["no_sampler"] = lambda base=base, store=store: pipeline_epoch(
                [*base, "monitor.enabled=false"], store
            )
            variants["no_tracking"] = lambda base=base, store=store: pipeline_epoch([*base, "tracking=none"], store)
        epoch_s = interleaved(variants, sizes)
        ratio = paired_ratio(epoch_s["bare"], epoch_s["full"])
        rows.append(
            Row(
                f"pipeline / bare loop, MLP, batch {batch}",
                f"{ratio:.3f}",
                ">= 0.98",
                ratio >= 0.98,
                f"median epoch {median(epoch_s['full']):.2f} s vs {median(epoch_s['bare']):.2f} s "
                f"({sizes.samples:,} samples, resident)",
            )
        )
        if batch == 64:
            on_off = paired_ratio(epoch_s["no_sampler"], epoch_s["full"])
            rows.append(
                Row(
                    "sampler on / off (speed ratio)",
                    f"{on_off:.3f}",
                    ">= 0.99",
                    on_off >= 0.99,
                    f"median epoch {median(epoch_s['full']):.2f} s with, {median(epoch_s['no_sampler']):.2f} s without "
                    "(interval 0.5 s)",
                )
            )
            on_off = 100 * (paired_ratio(epoch_s["full"], epoch_s["no_tracking"]) - 1)
            direct = 100 * median(writes[sizes.warmup :] or writes)
            rows.append(
                Row(
                    "tracking cost, % of step time",
                    f"{direct:.2f}%",
                    "<= 1%",
                    direct <= 1.0,
                    f"time spent writing metrics / epoch time; on vs off by wall clock {on_off:+.2f}% "
                    f"(median epoch {median(epoch_s['full']):.2f} s tracked, "
                    f"{median(epoch_s['no_tracking']):.2f} s untracked)",
                )
            )
    rows.append(tracking_call_cost(work / "calls.db"))
    return rows


def tracking_call_cost(store: Path) -> Row:
    """The tracker's own price on the training thread: buffered calls and the per-epoch hand-off."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    experiment = experiment_id(client, "calls")
    run = client.create_run(experiment)
    tracker = MlflowTracker(
        client, uri=f"sqlite:///{store}", experiment_id=experiment, experiment="calls", run_id=run.info.run_id
    )
    calls = 200
    start = time.perf_counter()
    for step in range(calls):
        tracker.log_metrics({"train/loss": 1.0 / (step + 1)}, step)
    buffered_us = 1e6 * (time.perf_counter() - start) / calls
    start = time.perf_counter()
    tracker.flush()
    write_ms = 1e3 * (time.perf_counter() - start)
    start = time.perf_counter()
    client.log_metric(run.info.run_id, "sync", 1.0)
    sync_ms = 1e3 * (time.perf_counter() - start)
    client.set_terminated(run.info.run_id)
    return Row(
        "tracking, per buffered call",
        f"{buffered_us:.1f} µs",
        "(info)",
        None,
        f"a buffered log_metrics call; writing {calls} buffered metrics in one batch {write_ms:.1f} ms; "
        f"one unbuffered log_metric {sync_ms:.1f} ms",
    )


def bench_resident(sizes: Sizes, work: Path) -> list[Row]:
    """loader.resident=true vs the set-up recipe's torchvision + ToTensor + DataLoader recipe, batch 64."""
    import numpy as np

    root = work / "mnist"
    write_idx_mnist(root / "MNIST" / "raw", sizes.samples, np.random.default_rng(0))
    variants = {
        "recipe": lambda: recipe_epoch(root, batch=64),
        "resident": lambda: pipeline_epoch(
            ["data=mnist", f"data.root={root}", "data.download=false", "loader=resident", "loader.batch_size=64"],
            work / "resident.db",
        ),
    }
    epoch_s = interleaved(variants, sizes)
    speedup = paired_ratio(epoch_s["recipe"], epoch_s["resident"])
    return [
        Row(
            "loader.resident=true vs the set-up recipe's DataLoader, batch 64",
            f"{speedup:.2f}x faster",
            ">= 3x",
            speedup >= 3.0,
            f"median epoch {median(epoch_s['resident']):.2f} s vs {median(epoch_s['recipe']):.2f} s "
            f"({sizes.samples:,} samples)",
        )
    ]


def write_idx_mnist(raw: Path, n: int, rng) -> None:
    import numpy as np

    raw.mkdir(parents=True, exist_ok=True)

    def idx(array: np.ndarray) -> bytes:
        header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
        return header + array.astype(np.uint8).tobytes()

    for prefix, count in (("train", n), ("t10k", max(n // 6, 100))):
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(idx(rng.integers(0, 256, (count, 28, 28))))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(idx(rng.integers(0, 10, count)))


def bench_launch(sizes: Sizes, work: Path) -> list[Row]:
    """Process start to the end of the first training step, vs the bare imports every such run pays."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}

    def imports() -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, torchvision, mlflow, hydra"], check=True, env=env)
        return time.perf_counter() - start

    def first_step() -> float:
        from mlflow import MlflowClient

        store = work / "launch.db"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "trainer.epochs=1",
                "trainer.max_steps=1",
                "device=cpu",
                f"tracking.uri=sqlite:///{store}",
                "tracking.experiment=launch",
                "monitor.plots=false",
                f"hydra.run.dir={work / 'outputs'}",
            ],
            check=True,
            env=env,
            capture_output=True,
            cwd=work,
        )
        client = MlflowClient(f"sqlite:///{store}")
        run = client.search_runs(
            [client.get_experiment_by_name("launch").experiment_id],
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )[0]
        return run.data.metrics["time/launch_to_first_step_s"]

    if sizes.warmup:  # a run first creates the store, so its one-off migration is not counted (--quick: smoke only)
        first_step()
    seconds = interleaved({"imports": imports, "first_step": first_step}, sizes)
    return [
        Row(
            "launch to first training step",
            f"{median(seconds['first_step']):.2f} s",
            "(info)",
            None,
            f"bare `import torch, torchvision, mlflow, hydra` {median(seconds['imports']):.2f} s; the rest is "
            f"composing the config, loading the data, building the model and opening the MLflow run",
        )
    ]


BENCHES = {
    "overhead": lambda sizes, work: bench_overhead(sizes, work),
    "sampler": lambda sizes, work: sampler_readings(sizes),
    "resident": lambda sizes, work: bench_resident(sizes, work),
    "launch": lambda sizes, work: bench_launch(sizes, work),
    "amp": lambda sizes, work: _module("amp").bench_amp(sizes, work),
    "amp_check": lambda sizes, work: _module("claims").bench_amp_check(sizes),
    "compile": lambda sizes, work: _module("claims").bench_compile(sizes),
    "profile": lambda sizes, work: _module("claims").bench_profile(sizes, work),
    "autotune": lambda sizes, work: _module("claims").bench_autotune(sizes, work),
    "ddp": lambda sizes, work: _module("ddp").bench_ddp(sizes, work),
    "compare": lambda sizes, work: _module("compare").bench_compare(sizes, work),
    "mfu": lambda sizes, work: _module("mfu").bench_mfu(sizes, work),
    "tune": lambda sizes, work: _module("tune").bench_tune(sizes, work),
}


def _module(name: str) -> Any:
    """A benchmark module that builds on this one (``amp``, ``claims``, ``ddp``, ``compare``, ``mfu``, ``tune``),
    imported when its rows are asked for."""
    import importlib

    return importlib.import_module(f"bench.{name}")


@command("python -m bench")
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test, not a measurement")
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {', '.join(BENCHES)}")
    parser.add_argument("--repeats", type=int, default=None, help="measured rounds per comparison (default 5)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (fixed for every variant)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be >= 1")
        sizes = Sizes(sizes.samples, args.repeats, sizes.warmup)
    if args.threads < 1:  # torch.set_num_threads would raise a RuntimeError with a traceback
        parser.error("--threads must be >= 1")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    torch.set_num_threads(args.threads)
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# pipeline benchmarks\n\n{datetime.date.today()} · `{command.strip()}`\n\n{machine()}\n", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as tmp, quiet_logs():
        for name in names:
            started = time.perf_counter()
            rows += BENCHES[name](sizes, Path(tmp))
            print(f"<!-- {name}: {time.perf_counter() - started:.0f} s -->", file=sys.stderr, flush=True)
    print(table(rows))
    return 0
