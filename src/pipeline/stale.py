"""Runs left RUNNING by a process that is gone: ``python -m pipeline.stale [--close]``.

    python -m pipeline.stale                      # list them (the store of tracking.uri's default)
    python -m pipeline.stale --close              # and mark them KILLED
    python -m pipeline.stale --uri sqlite:///runs/mlflow.db --experiment sweep

Every orderly end closes a run (FINISHED, FAILED, KILLED), but a process killed by SIGKILL, the
OOM killer or a power cut cannot: its run stays RUNNING. Each run records the process that
trains it (tags ``process.host``, ``process.pid``, ``process.started``); a RUNNING run whose
process on this host is gone (no such pid, or a pid reused by a newer process) is stale. Runs
recorded on another host, or before these tags existed, are listed as unknown and never closed.
A stale run with an outbox file in ./unsent_metrics (its store was down when it ended) is not closed
either: the file holds how it really ended, and the command that imports it is printed instead.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from pipeline import outbox
from pipeline.cli import Parser, command
from pipeline.secrets import mask_text
from pipeline.store import absolute

DEFAULT_URI = "sqlite:///mlflow.db"


@dataclass(frozen=True)
class RunningRun:
    run_id: str
    name: str
    experiment: str
    started: float  # seconds since the epoch
    verdict: str  # gone | alive | unknown
    why: str


def process_gone(tags: dict[str, str], *, host: str | None = None) -> tuple[str, str]:
    """``(verdict, why)`` for the process a run's tags name: ``gone``, ``alive`` or ``unknown``."""
    import psutil

    host = host or socket.gethostname()
    if "process.pid" not in tags:
        return "unknown", "no process tags (recorded by an older pipeline)"
    where = f"pid {tags['process.pid']} on {tags.get('process.host', '?')}"
    if tags.get("process.host") != host:
        return "unknown", f"{where}: another host, cannot check from here"
    try:
        started = psutil.Process(int(tags["process.pid"])).create_time()
    except (psutil.NoSuchProcess, ValueError):
        return "gone", f"{where}: no such process"
    except psutil.Error as err:
        return "unknown", f"{where}: {type(err).__name__}"
    if abs(started - float(tags.get("process.started", "nan"))) >= 1.0:
        return "gone", f"{where}: that pid is now another, newer process"
    return "alive", f"{where}: still running"


def running_runs(client: Any, experiment: str | None = None) -> list[RunningRun]:
    """Every RUNNING run of the store (or of one experiment), with the state of its process."""
    experiments = client.search_experiments()
    if experiment is not None:
        experiments = [e for e in experiments if e.name == experiment]
    by_id = {e.experiment_id: e.name for e in experiments}
    if not by_id:
        return []
    runs = client.search_runs(list(by_id), filter_string="attributes.status = 'RUNNING'", max_results=10_000)
    found = []
    for run in runs:
        verdict, why = process_gone(run.data.tags)
        name = run.data.tags.get("mlflow.runName", "")
        found.append(
            RunningRun(run.info.run_id, name, by_id[run.info.experiment_id], run.info.start_time / 1000, verdict, why)
        )
    return found


def close(client: Any, run: RunningRun) -> None:
    """Mark a stale run KILLED, saying who closed it and why."""
    client.set_tag(run.run_id, "closed_by", f"python -m pipeline.stale: {run.why}")
    client.set_terminated(run.run_id, "KILLED")


@command("python -m pipeline.stale")
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m pipeline.stale", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--uri", default=os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_URI), help="tracking store (tracking.uri)"
    )
    parser.add_argument("--experiment", help="only this experiment")
    parser.add_argument("--close", action="store_true", help="mark the runs whose process is gone KILLED")
    args = parser.parse_args(argv)
    from mlflow import MlflowClient

    from pipeline.store import TrackingUnavailable, check_exists, check_reachable

    uri = absolute(args.uri)
    try:
        check_exists(uri)  # a read-only look: never create an empty store
        check_reachable(uri)
    except TrackingUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    client = MlflowClient(uri)
    runs = running_runs(client, args.experiment)
    stale = [r for r in runs if r.verdict == "gone"]
    print(f"{len(runs)} RUNNING run(s) in {mask_text(uri)}; {len(stale)} whose process is gone")
    for run in runs:
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(run.started))
        print(
            f"  {run.verdict:<7} {run.run_id}  {run.name or '-'}  (experiment '{run.experiment}', since {since}): "
            f"{run.why}"
        )
    for run in stale:
        for path in outbox.pending(run.run_id):  # its true end is in the file: KILLED would be false
            print(f"  {run.run_id}: not closed: {path} holds how it ended; import it with: {outbox.command(path)}")
    boxed = [r for r in stale if outbox.pending(r.run_id)]
    stale = [r for r in stale if r not in boxed]
    if args.close and (stale or boxed):
        for run in stale:
            close(client, run)
        print(f"marked {len(stale)} run(s) KILLED")
    elif stale:
        print(
            "mark them KILLED with: python -m pipeline.stale --close"
            + (f" --uri {mask_text(uri)}" if args.uri != DEFAULT_URI else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
