"""Runs left RUNNING by a process that stopped: ``python -m pipeline.stale [--close] [--after MINUTES]``.

    python -m pipeline.stale                      # list them (the store of tracking.uri's default)
    python -m pipeline.stale --close              # and mark those whose heartbeat stopped KILLED
    python -m pipeline.stale --uri http://host:5000 --experiment sweep --after 30

Every orderly end closes a run (FINISHED, FAILED, KILLED), but a process killed by SIGKILL, the
OOM killer or a power cut cannot: its run stays RUNNING. While a run trains, its process sets the
tag ``process.heartbeat`` every minute (``pipeline.record.heartbeat``). A RUNNING run whose heartbeat is
older than ``--after`` minutes (default 10: several missed beats) is stale, whichever machine it
ran on; elsewhere a run whose heartbeat is fresh is never closed. The process tags (``process.host``,
``process.pid``, ``process.started``, ``process.boot_id``, ``process.pid_ns``) are extra evidence,
read only when the run's process ran under this machine's current boot and in this pid namespace
(a host name alone is not a machine: cloned VMs share one, and a container has pids of its own):
there a live pid keeps a run with an old heartbeat open (its store may have been down), and a gone
pid makes the run stale at once, however fresh its heartbeat (a run SIGKILLed before its next beat,
a run recorded before heartbeats existed, a sweep's parent run). Runs without a heartbeat on
another machine or namespace are listed as unknown and never closed. A stale run with an outbox file in
./unsent_metrics (its store was down when it ended) is not closed either: the file holds how it really
ended, and the command that imports it is printed instead. Clocks of the machines must agree within
minutes (NTP).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from pipeline.common.cli import Parser, command
from pipeline.common.messages import brief
from pipeline.common.secrets import mask_text
from pipeline.common.uris import absolute
from pipeline.record import outbox
from pipeline.record.heartbeat import BEAT_EVERY_S, last_beat, same_pid_space
from pipeline.record.reachability import check_exists, check_reachable
from pipeline.record.store import TrackingUnavailable

DEFAULT_URI = "sqlite:///mlflow.db"
AFTER_MIN = 10.0  # default threshold: ten missed beats
MIN_BEATS = 2  # --after must span at least this many beats: one late beat is no death


@dataclass(frozen=True)
class RunningRun:
    run_id: str
    name: str
    experiment: str
    started: float  # seconds since the epoch
    verdict: str  # gone (closed by --close) | alive | unknown
    why: str


def pid_evidence(tags: dict[str, str]) -> tuple[str | None, str]:
    """What the run's pid says: ``alive``, ``gone`` or None (not ours to look up, or no answer), and why.

    Looked up only when the run's boot id and pid namespace are this process's (``heartbeat.same_pid_space``).
    """
    import psutil

    if "process.pid" not in tags:
        return None, "no process tags (recorded by an older pipeline)"
    where = f"pid {tags['process.pid']} on {tags.get('process.host', '?')}"
    if not same_pid_space(tags):
        if "process.boot_id" not in tags:
            return None, f"{where}: no boot id recorded (an older pipeline), cannot check it"
        return None, f"{where}: another machine, boot or pid namespace, cannot check it from here"
    try:
        started = psutil.Process(int(tags["process.pid"])).create_time()
    except (psutil.NoSuchProcess, ValueError):
        return "gone", f"{where}: no such process"
    except psutil.Error as err:
        return None, f"{where}: {brief(err)}"
    if abs(started - float(tags.get("process.started", "nan"))) >= 1.0:
        return "gone", f"{where}: that pid is now another, newer process"
    return "alive", f"{where}: still running"


def judge(tags: dict[str, str], *, after_s: float, now: float | None = None) -> tuple[str, str]:
    """``(verdict, why)`` for a RUNNING run with ``tags``: ``gone`` (stale: closed by ``--close``), ``alive`` or
    ``unknown``; only ``gone`` is closed. A pid gone under this boot and pid namespace is gone at once, whatever its
    heartbeat's age (SIGKILLed before its next beat); elsewhere only a heartbeat older than ``after_s`` is."""
    beat = last_beat(tags)
    pid, said = pid_evidence(tags)
    if beat is None:
        if pid is None and "process.pid" not in tags:
            return "unknown", "no heartbeat and no process tags (recorded by an older pipeline)"
        return pid or "unknown", f"no heartbeat; {said}"
    age = (time.time() if now is None else now) - beat
    if pid == "gone":  # looked up under this boot and pid namespace: no need to wait for the heartbeat to age
        return "gone", f"{'last heartbeat' if age >= after_s else 'heartbeat'} {_ago(age)} ago; {said}"
    if age < after_s:
        return "alive", f"heartbeat {_ago(age)} ago"
    if pid == "alive":
        return "alive", f"last heartbeat {_ago(age)} ago, but {said} (same boot and pid namespace)"
    return "gone", f"last heartbeat {_ago(age)} ago; {said}"


def _ago(seconds: float) -> str:
    """``45 s``, ``11 min``, ``3.5 h``, ``2.0 days``."""
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} days"


def running_runs(client: Any, experiment: str | None = None, *, after_s: float = AFTER_MIN * 60) -> list[RunningRun]:
    """Every RUNNING run of the store (or of one experiment), judged (``judge``) with the threshold ``after_s``."""
    experiments = client.search_experiments()
    if experiment is not None:
        experiments = [e for e in experiments if e.name == experiment]
    by_id = {e.experiment_id: e.name for e in experiments}
    if not by_id:
        return []
    runs = client.search_runs(list(by_id), filter_string="attributes.status = 'RUNNING'", max_results=10_000)
    found = []
    for run in runs:
        verdict, why = judge(run.data.tags, after_s=after_s)
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
    parts = __doc__.replace("``", "").split("\n\n")  # the title, the examples, how runs are judged
    parser = Parser(prog="python -m pipeline.stale", description=parts[0], epilog=" ".join(parts[2].split()))
    parser.add_argument(
        "--uri", default=os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_URI), help="tracking store (tracking.uri)"
    )
    parser.add_argument("--experiment", help="only this experiment")
    parser.add_argument("--close", action="store_true", help="mark the stale runs KILLED (tag closed_by says why)")
    parser.add_argument(
        "--after",
        type=float,
        default=AFTER_MIN,
        metavar="MINUTES",
        help=f"a run whose last heartbeat is older than this is stale (default {AFTER_MIN:g}; a run beats every "
        f"{BEAT_EVERY_S:.0f} s); a fresh heartbeat is never closed",
    )
    args = parser.parse_args(argv)
    after_s = args.after * 60
    if not math.isfinite(after_s) or after_s <= 0:  # nan compares false with everything: it would close any run
        parser.error(f"--after {args.after:g} is not a number of minutes: give one like {AFTER_MIN:g}")
    if after_s < MIN_BEATS * BEAT_EVERY_S:
        parser.error(
            f"--after {args.after:g} is shorter than {MIN_BEATS} heartbeats (a run beats every {BEAT_EVERY_S:.0f} s): "
            f"a live run would look stale; use {MIN_BEATS * BEAT_EVERY_S / 60:g} or more"
        )
    from mlflow import MlflowClient

    uri = absolute(args.uri)
    try:
        check_exists(uri)  # a read-only look: never create an empty store
        check_reachable(uri)
    except TrackingUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    client = MlflowClient(uri)
    runs = running_runs(client, args.experiment, after_s=after_s)
    stale = [r for r in runs if r.verdict == "gone"]
    print(
        f"{len(runs)} RUNNING run(s) in {mask_text(uri)}; {len(stale)} stale (no heartbeat for over {_ago(after_s)}, "
        f"--after; without a heartbeat, a process gone from this machine)"
    )
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
    if args.close:
        for run in stale:
            close(client, run)
        print(f"marked {len(stale)} run(s) KILLED")
    elif stale:
        print(
            "mark them KILLED with: python -m pipeline.stale --close"
            + (f" --uri {mask_text(uri)}" if args.uri != DEFAULT_URI else "")
        )
    return 0
