"""Import metrics a run could not write: ``python -m pipeline.outbox unsent_metrics/<run_id>.jsonl [--uri URI]``.

When the tracking store is still unreachable at the end of a run, the tracker writes what it could
not send to ``./unsent_metrics/<run_id>.jsonl`` and prints this command. The file is JSON lines: a
header (run id, experiment id, tracking URI with credentials masked, the status the run earned, its
end time and tags still to set), then one line per metric (key, value, timestamp in ms, step).

The command writes the metrics to their run in batches of 1,000, sets the tags and the status, and
renames the file to ``<file>.sent``, so running it twice does not duplicate points. If the store
fails part-way, the file is rewritten with only what is left, so a rerun sends the rest. ``--uri``
overrides the header's URI; it is required when that URI had credentials (they are masked in the
file), or set MLflow's MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD instead.

A run may have moved on since its file was written: resumed and finished, or being trained again. Its
status, end time and tags then stay as they are, and only the file's points at steps the store does not
hold are added (``send``). ``resume=<run id>`` imports the run's pending files itself before it continues,
and ``python -m pipeline.stale --close`` leaves a run with one to its import.
Exit status: 0 sent (or already sent), 1 the store refused (a rerun sends the rest), 2 a missing or
malformed file, a deleted run, or no store at the URI.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.common import cli
from pipeline.common.atomic import write_text_atomic
from pipeline.common.errors import PipelineError
from pipeline.common.messages import brief
from pipeline.common.secrets import MASK, mask_text
from pipeline.common.uris import absolute
from pipeline.record.reachability import check_exists, check_reachable
from pipeline.record.store import retrying

log = logging.getLogger(__name__)

FOLDER = "unsent_metrics"  # relative to the working directory, like mlflow.db and mlruns/
FORMAT = 1  # the header's "outbox" field; bump when the line layout changes
BATCH = 1000  # MLflow's limit of metrics per log_batch call
SENT = ".sent"  # suffix of a file whose metrics are in the store
# tags that say a run ended badly: FAILED's error (tracking), the KILLED of pipeline.record.stale --close; a later,
# better
# end of the run removes them, and an import never adds them to a run that moved on
FAILURE_TAGS = ("error", "closed_by")


class OutboxError(PipelineError):
    """The file is missing, malformed or names no usable store; the message says which and what to do."""


@dataclass(frozen=True)
class Point:
    """One metric value as MLflow records it."""

    key: str
    value: float
    timestamp: int  # ms since the epoch, when it was logged (not when it was sent)
    step: int


@dataclass(frozen=True)
class Outbox:
    """A run's unsent record: where it belongs, how it ended, and its metrics in logging order."""

    run_id: str
    experiment_id: str | None
    tracking_uri: str  # credentials masked
    status: str  # FINISHED, FAILED or KILLED
    end_time: int  # ms since the epoch
    tags: dict[str, str] = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)

    def header(self) -> dict[str, Any]:
        return {
            "outbox": FORMAT,
            "run_id": self.run_id,
            "experiment_id": self.experiment_id,
            "tracking_uri": mask_text(self.tracking_uri),  # a last guard: the file is plain text on disk
            "status": self.status,
            "end_time": self.end_time,
            "tags": self.tags,
        }


def fresh_path(run_id: str, folder: Path | str = FOLDER) -> Path:
    """``folder/<run_id>.jsonl``, or ``<run_id>-2.jsonl``, ... when a resumed run left one already."""
    folder = Path(folder)
    candidate, n = folder / f"{run_id}.jsonl", 1
    while candidate.exists() or _sent(candidate).exists():
        n += 1
        candidate = folder / f"{run_id}-{n}.jsonl"
    return candidate


def command(path: Path) -> str:
    """The one command that imports ``path`` (relative paths stay relative: it runs from the same folder)."""
    return f"python -m pipeline.outbox {path}"


def save(outbox: Outbox, path: Path) -> Path:
    """Write ``outbox`` to ``path`` (folder created), atomically: a crash leaves the old file or the new one."""
    lines = [json.dumps(outbox.header())]
    for p in outbox.points:
        lines.append(json.dumps({"key": p.key, "value": p.value, "timestamp": p.timestamp, "step": p.step}))
    return write_text_atomic(path, "\n".join(lines) + "\n")


def load(path: Path) -> Outbox:
    """Read an outbox file.

    Raises:
        OutboxError: the file is missing, or a line is not what ``save`` writes (the message names the line).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise OutboxError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise OutboxError(f"{path}: cannot be read ({err})") from None
    if not lines:
        raise OutboxError(f"{path}: empty; expected a header line and one line per metric")
    header = _record(path, 1, lines[0])
    if header.get("outbox") != FORMAT or not isinstance(header.get("run_id"), str) or not header["run_id"]:
        raise OutboxError(f"{path} line 1: not an outbox header (needs outbox={FORMAT} and a run_id)")
    if header.get("status") not in ("FINISHED", "FAILED", "KILLED") or not isinstance(header.get("end_time"), int):
        raise OutboxError(f"{path} line 1: the header needs status FINISHED, FAILED or KILLED and an end_time in ms")
    points = [_point(path, n, line) for n, line in enumerate(lines[1:], start=2) if line.strip()]
    return Outbox(
        run_id=header["run_id"],
        experiment_id=header.get("experiment_id"),
        tracking_uri=str(header.get("tracking_uri") or ""),
        status=header["status"],
        end_time=header["end_time"],
        tags={str(k): str(v) for k, v in (header.get("tags") or {}).items()},
        points=points,
    )


@dataclass(frozen=True)
class Sent:
    """What an import did."""

    run_id: str
    status: str  # the file's
    points: int  # metrics written
    skipped: int  # metrics the store already held (a write that landed after all, or a later process's steps)
    moved_on: str  # why the run's status and end were kept ("" when the file's were set)


def send(path: Path, *, uri: str | None = None) -> Sent:
    """Write the file's metrics, tags and status to its run, then rename it to ``<path>.sent``.

    A run that moved on since the file was written (it ended after the file's end time, a later process trains or
    trained it, or the store holds metrics logged after it) keeps its status, end time and tags: the file adds only
    its metrics at steps the store does not hold, and tags the run lacks (never ``FAILURE_TAGS``). A point the
    store already holds is never written twice.

    Raises:
        OutboxError: the file cannot be used, the URI is masked and no ``uri`` was given, the run is not there or
            was deleted.
        TrackingUnavailable: no store at a ``sqlite:///`` path (none is created).
        Exception: whatever the store raised part-way (the file then holds only what is left).
    """
    outbox = load(path)
    target = absolute(uri or outbox.tracking_uri)
    if not target:
        raise OutboxError(f"{path}: the header names no tracking URI; pass --uri URI")
    if f":{MASK}@" in target:
        raise OutboxError(
            f"{path}: the recorded URI {target} had credentials, masked in the file; pass --uri with the real one, "
            f"or --uri without them plus MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
        )
    check_exists(target)
    check_reachable(target)  # a server that is down: one line in seconds, not MLflow's minutes of retries
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    client = MlflowClient(tracking_uri=target)
    run = _run(client, outbox, path, target)
    stored = {
        key: retrying(lambda key=key: client.get_metric_history(outbox.run_id, key), what="outbox import")
        for key in dict.fromkeys(p.key for p in outbox.points)
    }
    moved_on = _moved_on(run, outbox, stored)
    held = {(m.key, m.step, m.timestamp, m.value) for history in stored.values() for m in history}
    steps = {(m.key, m.step) for history in stored.values() for m in history}
    points = [
        p
        for p in outbox.points
        if (p.key, p.step, p.timestamp, p.value) not in held and not (moved_on and (p.key, p.step) in steps)
    ]
    for i in range(0, len(points), BATCH):
        batch = [Metric(p.key, p.value, p.timestamp, p.step) for p in points[i : i + BATCH]]
        try:
            retrying(lambda batch=batch: client.log_batch(outbox.run_id, metrics=batch), what="outbox import")
        except Exception:
            save(replace(outbox, points=points[i:]), path)  # a rerun sends only the rest
            raise
    tags = outbox.tags
    if moved_on:  # the later process's record stands; the file only fills in what it lacks
        tags = {k: v for k, v in tags.items() if k not in run.data.tags and k not in FAILURE_TAGS}
    if tags:
        records = [RunTag(k, v) for k, v in tags.items()]
        retrying(lambda: client.log_batch(outbox.run_id, tags=records), what="outbox import")
    if not moved_on:
        if "closed_by" in run.data.tags:  # pipeline.record.stale closed it KILLED for want of this file: it says how
            retrying(lambda: client.delete_tag(outbox.run_id, "closed_by"), what="outbox import")
        retrying(lambda: client.set_terminated(outbox.run_id, outbox.status, end_time=outbox.end_time))
    os.replace(path, _sent(path))
    return Sent(outbox.run_id, outbox.status, len(points), len(outbox.points) - len(points), moved_on)


def pending(run_id: str, folder: Path | str = FOLDER) -> list[Path]:
    """The outbox files of ``run_id`` not yet imported (``<run_id>.jsonl``, ``<run_id>-2.jsonl``, ...), oldest
    first."""
    found = [*Path(folder).glob(f"{run_id}.jsonl"), *Path(folder).glob(f"{run_id}-*.jsonl")]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def import_pending(run_id: str, uri: str) -> None:
    """Import the run's outbox files (what its last process could not write) before a resume continues it: their
    points come before what this process logs, and imported later they would find a run that
    moved on and could add only part of it.

    Raises:
        OutboxError: a file cannot be imported (malformed, another store), with the file and the remedy.
    """
    for path in pending(run_id):
        try:
            sent = send(path, uri=uri)
        except PipelineError as err:
            raise OutboxError(
                f"run {run_id} has an outbox file that cannot be imported ({err}): import it with "
                f"{command(path)} --uri URI, or move it away, then resume"
            ) from None
        ended = f"the run {sent.moved_on}, its end kept" if sent.moved_on else f"its earlier part's end, {sent.status}"
        log.warning("resume: imported %s first (%d metrics; %s); renamed to %s.sent", path, sent.points, ended, path)


def _run(client: Any, outbox: Outbox, path: Path, target: str) -> Any:
    """The file's run in the store, which must exist and not be deleted."""
    from mlflow.exceptions import MlflowException

    try:
        run = retrying(lambda: client.get_run(outbox.run_id), what="outbox import")
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise  # the store is down or refuses us: a rerun may work
        raise OutboxError(f"run {outbox.run_id} is not in {mask_text(target)}; pass --uri with its store") from None
    if run.info.lifecycle_stage == "deleted":  # MLflow refuses writes to it: no rerun can work until it is restored
        raise OutboxError(
            f"run {outbox.run_id} was deleted from {mask_text(target)}: restore it (the UI's deleted runs, or "
            f"mlflow runs restore --run-id {outbox.run_id}) and import the file then, or delete {path} if the run "
            f"is gone for good (mlflow gc)"
        )
    return run


def _moved_on(run: Any, outbox: Outbox, stored: dict[str, list[Any]]) -> str:
    """Why the run is past what the file says ("" when it is not): the file's status and end would be false."""
    info, tags = run.info, run.data.tags
    if info.status != "RUNNING" and (info.end_time or 0) > outbox.end_time and "closed_by" not in tags:
        return f"ended {info.status} after this file was written"
    try:
        started = float(tags.get("process.started", "nan")) * 1000
    except ValueError:
        started = float("nan")
    if started > outbox.end_time:
        return f"is trained again by a process started after this file was written (pid {tags.get('process.pid')})"
    if any(m.timestamp > outbox.end_time for history in stored.values() for m in history):
        return "holds metrics logged after this file was written"
    return ""


@cli.command("python -m pipeline.outbox")
def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.Parser(
        prog="python -m pipeline.outbox", description="Import metrics a run could not write into its MLflow run."
    )
    parser.add_argument("file", type=Path, help="an outbox file, e.g. unsent_metrics/<run_id>.jsonl")
    parser.add_argument("--uri", help="the tracking URI to write to (default: the one in the file's header)")
    args = parser.parse_args(argv)
    path: Path = args.file
    if path.name.endswith(SENT):
        parser.error(f"{path} was already imported (a {SENT} file is a record of what was sent): nothing to do")
    if not path.exists() and _sent(path).exists():
        print(f"{path}: already sent ({_sent(path)} exists); nothing to do")
        return 0
    try:
        sent = send(path, uri=args.uri)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the store refused: say so in one line, the file keeps what is left
        print(
            f"error: the store refused the import ({brief(err, limit=500)}); "
            f"{path} keeps the unsent metrics, run the command again",
            file=sys.stderr,
        )
        return 1
    skipped = f" ({sent.skipped} the store already held left out)" if sent.skipped else ""
    if sent.moved_on:
        print(f"run {sent.run_id} {sent.moved_on}: its status and end time were kept, not this file's {sent.status}")
    print(f"sent {sent.points} metrics to their run{skipped}; {path} renamed to {_sent(path)}")
    return 0


def _sent(path: Path) -> Path:
    return path.with_name(path.name + SENT)


def _record(path: Path, n: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise OutboxError(f"{path} line {n}: not JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise OutboxError(f"{path} line {n}: expected a JSON object")
    return record


def _point(path: Path, n: int, line: str) -> Point:
    record = _record(path, n, line)
    key, value, timestamp, step = (record.get(k) for k in ("key", "value", "timestamp", "step"))
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (isinstance(key, str) and key and number and isinstance(timestamp, int) and isinstance(step, int)):
        raise OutboxError(f"{path} line {n}: a metric needs a key, a numeric value, an int timestamp and an int step")
    return Point(key, float(value), timestamp, step)
