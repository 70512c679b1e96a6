"""What a team's tracking server costs a run: ``.venv/bin/python scripts/bench_team_server.py [--repeats 7]``.

Starts a throwaway PostgreSQL and ``mlflow server --backend-store-uri postgresql://... --artifacts-destination ...``
on 127.0.0.1 (``tests/servers.py``: needs ``apt-get install -y postgresql`` and ``pip install -e '.[dev]'``), plus
the same server with SQLite behind it for reference, then measures from this process:

- **metric points per second one run logs through the server**: the pipeline's own tracker (``MlflowTracker``)
  buffers ``--points`` values of ``train/loss`` and writes them with ``flush()`` (``log_batch`` calls of 1,000, as a
  run does between epochs); median and min–max of the repeats. Then ``--writers`` runs at once, each from its own
  thread: the points per second the server takes from all of them together (where SQLite's one writer at a time
  shows);
- **training slowdown, tracking to the server vs off**: interleaved rounds (on, off; off, on; ...) of the same
  in-process run (``pipeline.train``: MLP on 60,000 synthetic samples, resident, batch 64, 2 epochs, train/loss
  every 10 steps, the utilisation sampler on), one warm-up round dropped; the speed is samples over the epochs'
  seconds plus the writes between them, and the ratio is the paired estimate with its 95% interval
  (``pipeline.common.stats.compare``). The whole run's wall clock (start-up and end included) is reported beside it, and
  the tracker's own accounting of the seconds it spent writing, which the machine's noise does not blur.

It prints rows in BENCHMARKS.md's format. Timing claims live here, never in the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the servers the tests use

from pipeline.common.stats import compare, summarize
from pipeline.gpucheck.harness import Row, machine, quiet_logs, table
from servers import mlflow_server, postgres, postgres_missing

SAMPLES, BATCH, EPOCHS = 60_000, 64, 2  # epochs of about 1.3 s on 2 CPUs
RUN = [
    "device=cpu",
    "data=synthetic",
    f"data.num_samples={SAMPLES}",
    "data.val_samples=500",
    "loader=resident",
    f"loader.batch_size={BATCH}",
    f"trainer.epochs={EPOCHS}",
    "trainer.progress=false",
    "monitor.plots=false",
    "checkpoint.enabled=false",  # nothing left in the folder it runs from (a checkpoints/ of 70 runs, before)
]


def points_per_s(uri: str, points: int, *, writers: int = 1) -> float:
    """Points per second the server takes from ``writers`` runs at once, each run's tracker buffering ``points`` and
    writing them with one ``flush()`` on its own thread; all of them counted, from the first start to the last end."""
    from mlflow import MlflowClient

    from pipeline.record.store import experiment_id
    from pipeline.record.tracking import MlflowTracker

    client = MlflowClient(uri)
    experiment = experiment_id(client, "points")
    trackers = []
    for _ in range(writers):
        run_id = client.create_run(experiment).info.run_id
        tracker = MlflowTracker(client, uri=uri, experiment_id=experiment, experiment="points", run_id=run_id)
        for step in range(points):
            tracker.log_metrics({"train/loss": 1.0 / (step + 1)}, step)
        trackers.append(tracker)
    start = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(lambda tracker: tracker.flush(), trackers))
    seconds = time.perf_counter() - start
    for tracker in trackers:
        client.set_terminated(tracker.run_id)
        stored = len(client.get_metric_history(tracker.run_id, "train/loss"))
        if stored != points:
            raise RuntimeError(f"the server holds {stored} of the {points} points written")
    return writers * points / seconds


def train_once(uri: str | None) -> tuple[float, float, float]:
    """One in-process run, tracking to ``uri`` (None: off): its training samples/s, the share of its training time
    spent writing metrics (the tracker's own accounting), and the whole run's seconds."""
    from pipeline.config import load
    from pipeline.train import train

    tracking = [f"tracking.uri={uri}", "tracking.experiment=slowdown"] if uri else ["tracking=none"]
    cfg = load([*RUN, *tracking])
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(cfg, echo=False, quiet=True)
    wall = time.perf_counter() - start
    seconds = sum(e.seconds for e in result.epochs) + result.tracking_write_s  # writes between epochs count
    writing = (result.tracking_write_s + result.tracking_background_write_s) / seconds
    return SAMPLES * EPOCHS / seconds, writing, wall


def bench_points(uris: dict[str, str], *, points: int, writers: int, repeats: int) -> list[Row]:
    rows = []
    for backend, uri in uris.items():
        points_per_s(uri, points)  # warm-up: the server's first requests, the experiment's creation
        for n in (1, writers):
            share = points // n  # the same points in all, split between the runs
            rates = summarize(points_per_s(uri, share, writers=n) for _ in range(repeats))
            assert rates is not None
            who = "one run logs" if n == 1 else f"{n} runs log at once"
            rows.append(
                Row(
                    f"metric points/s {who} through the server ({backend} behind it)",
                    f"{rates.median:,.0f}/s",
                    "(info)",
                    None,
                    f"min–max {rates.low:,.0f}–{rates.high:,.0f}/s over {rates.n} repeats; {n} × {share:,} buffered "
                    f"points written by the tracker's flush() (log_batch calls of 1,000) over HTTP to 127.0.0.1",
                )
            )
    return rows


def bench_slowdown(uri: str, *, repeats: int) -> list[Row]:
    speeds: dict[str, list[float]] = {"on": [], "off": []}
    walls: dict[str, list[float]] = {"on": [], "off": []}
    writing: list[float] = []
    for round_ in range(1 + repeats):  # round 0 warms up (imports, caches) and is dropped
        for variant in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            speed, share, wall = train_once(uri if variant == "on" else None)
            if round_ > 0:
                speeds[variant].append(speed)
                walls[variant].append(wall)
                if variant == "on":
                    writing.append(share)
    ratio = compare(speeds["off"], speeds["on"], pairs=list(zip(speeds["off"], speeds["on"], strict=True)))
    assert ratio is not None
    per_round = [on / off for on, off in zip(speeds["on"], speeds["off"], strict=True)]
    run = f"MLP, {SAMPLES:,} synthetic samples, batch {BATCH}, {EPOCHS} epochs, train/loss every 10 steps"
    return [
        Row(
            "training speed, tracking to the PostgreSQL-backed server / tracking off",
            f"{ratio.ratio:.3f} [{ratio.low:.3f}–{ratio.high:.3f}]",
            "(info)",
            None,
            f"per-round ratios {min(per_round):.3f}–{max(per_round):.3f} ({ratio.test}, {len(per_round)} interleaved "
            f"rounds, p={ratio.p:.3f}); median {median(speeds['on']):,.0f} vs {median(speeds['off']):,.0f} samples/s "
            f"({run}, writes between epochs included); whole run {median(walls['on']):.2f} s vs "
            f"{median(walls['off']):.2f} s (start-up and end included)",
        ),
        Row(
            "tracking to the PostgreSQL-backed server, % of training time",
            f"{100 * median(writing):.2f}%",
            "<= 1%",
            median(writing) <= 0.01,
            f"seconds spent writing metrics (between epochs and by the writer thread) / training time, median of "
            f"{len(writing)} runs, min–max {100 * min(writing):.2f}–{100 * max(writing):.2f}% ({run})",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench_team_server.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="measured repeats (rounds) per measurement")
    parser.add_argument("--points", type=int, default=20_000, help="metric points per write measurement")
    parser.add_argument("--writers", type=int, default=8, help="runs writing at once in the concurrent measurement")
    parser.add_argument("--only", choices=["points", "slowdown"], help="one of the two measurements (default: both)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # MLflow's "View run ..." per run
    missing = postgres_missing()
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    print(f"# team server benchmarks\n\n{datetime.date.today()} · `{' '.join(sys.argv)}`\n\n{machine()}\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-team-") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        db = stack.enter_context(postgres(folder / "db"))
        server = stack.enter_context(mlflow_server(folder / "server", backend=db.uri, env=db.env))
        lite = stack.enter_context(mlflow_server(folder / "sqlite-server"))
        with quiet_logs():
            rows = []
            if args.only in (None, "points"):
                backends = {"PostgreSQL": server.uri, "SQLite": lite.uri}
                rows += bench_points(backends, points=args.points, writers=args.writers, repeats=args.repeats)
            if args.only in (None, "slowdown"):
                rows += bench_slowdown(server.uri, repeats=args.repeats)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
