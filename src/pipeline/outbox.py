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
Exit status: 0 sent (or already sent), 1 the store refused, 2 a missing or malformed file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.secrets import MASK, mask_text
from pipeline.store import absolute, retrying

log = logging.getLogger(__name__)

FOLDER = "unsent_metrics"  # relative to the working directory, like mlflow.db and mlruns/
FORMAT = 1  # the header's "outbox" field; bump when the line layout changes
BATCH = 1000  # MLflow's limit of metrics per log_batch call
SENT = ".sent"  # suffix of a file whose metrics are in the store


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
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        out.write(json.dumps(outbox.header()) + "\n")
        for p in outbox.points:
            out.write(json.dumps({"key": p.key, "value": p.value, "timestamp": p.timestamp, "step": p.step}) + "\n")
    os.replace(partial, path)
    return path


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


def send(path: Path, *, uri: str | None = None) -> int:
    """Write the file's metrics, tags and status to its run, then rename it to ``<path>.sent``.

    Returns the number of metrics written.

    Raises:
        OutboxError: the file cannot be used, the URI is masked and no ``uri`` was given, or the run is not there.
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
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=target)
    try:
        client.get_run(outbox.run_id)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise  # the store is down or refuses us: a rerun may work
        raise OutboxError(f"run {outbox.run_id} is not in {mask_text(target)}; pass --uri with its store") from None
    points = outbox.points
    for i in range(0, len(points), BATCH):
        batch = [Metric(p.key, p.value, p.timestamp, p.step) for p in points[i : i + BATCH]]
        try:
            retrying(lambda batch=batch: client.log_batch(outbox.run_id, metrics=batch), what="outbox import")
        except Exception:
            save(replace(outbox, points=points[i:]), path)  # a rerun sends only the rest
            raise
    if outbox.tags:
        tags = [RunTag(k, v) for k, v in outbox.tags.items()]
        retrying(lambda: client.log_batch(outbox.run_id, tags=tags), what="outbox import")
    retrying(lambda: client.set_terminated(outbox.run_id, outbox.status, end_time=outbox.end_time))
    os.replace(path, _sent(path))
    return len(points)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.outbox", description="Import metrics a run could not write into its MLflow run."
    )
    parser.add_argument("file", type=Path, help="an outbox file, e.g. unsent_metrics/<run_id>.jsonl")
    parser.add_argument("--uri", help="the tracking URI to write to (default: the one in the file's header)")
    args = parser.parse_args(argv)
    path: Path = args.file
    if not path.exists() and _sent(path).exists():
        print(f"{path}: already sent ({_sent(path)} exists); nothing to do")
        return 0
    try:
        sent = send(path, uri=args.uri)
    except OutboxError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the store refused: say so in one line, the file keeps what is left
        print(
            f"error: the store refused the import ({type(err).__name__}: {mask_text(str(err))[:500]}); "
            f"{path} keeps the unsent metrics, run the command again",
            file=sys.stderr,
        )
        return 1
    print(f"sent {sent} metrics to their run; {path} renamed to {_sent(path)}")
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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
