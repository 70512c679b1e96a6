"""The MLflow store under concurrency and failure: safe start, retries, a full disk, a server that went away.

Several processes starting at once on a fresh SQLite store race through MLflow's schema
migration (``duplicate column name: step``) and through experiment creation. ``connect`` holds
a file lock beside the database while the store is created, migrated and the experiment looked
up or made, so every process lands its run; a new store is built under another name and published
whole (``create_sqlite``), so a plain MLflow client, which takes no lock of ours, never migrates it
at the same moment. ``retrying`` repeats a write that SQLite refused with "database is locked".
``disk_full`` tells a write that failed for want of space (mid-run) from other errors, and
``DiskFull.explain`` names where; ``server_down`` tells a server that stopped answering from a write it
refused. Whether a URI can work at all, before a run starts, is ``pipeline.record.reachability``'s
question.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pipeline.common.errors import PipelineError
from pipeline.common.secrets import mask_text
from pipeline.common.uris import sqlite_path, sqlite_uri

log = logging.getLogger(__name__)
T = TypeVar("T")

LOCK_TIMEOUT_S = 300.0  # a migration takes seconds; waiting minutes means something else is wrong
RETRIES = 8  # "database is locked" retries, with doubling back-off from 50 ms (about 13 s in all)
FIRST_RETRY_S = 0.05
ARTIFACTS = "mlruns"  # MLflow's default artifact root for a database store, relative to where the run starts
NO_SPACE = ("database or disk is full", "no space left on device", "disk quota exceeded")


class TrackingUnavailable(PipelineError):
    """The tracking URI cannot be used; nothing was trained."""


class DiskFull(TrackingUnavailable):
    """A write of the run (store, artifacts, checkpoints) failed for want of space."""

    @classmethod
    def explain(cls, err: BaseException, *, uri: str | None, also: Sequence[Path] = ()) -> DiskFull:
        """The one-line error for ``err`` (``disk_full(err)`` is true): the file the OS named, else the SQLite
        store when SQLite said so, else every place the run writes to (the store, ``./mlruns``, ``also`` and the
        temporary folder MLflow stages artifacts in), each with its free space, so the full one stands out."""
        named = next((Path(e.filename) for e in _chain(err) if isinstance(e, OSError) and e.filename), None)
        database = sqlite_path(uri) if uri else None
        if named is not None:
            where = f"while writing {named.absolute()}{_free_note(named)}"
        elif database is not None and any("database or disk is full" in str(e) for e in _chain(err)):
            where = f"while writing {database.absolute()}{_free_note(database)}"
        else:
            places = [p for p in (database, Path(ARTIFACTS), *also, Path(tempfile.gettempdir())) if p is not None]
            where = "on one of " + ", ".join(f"{p.absolute()}{_free_note(p)}" for p in places)
        return cls(
            f"no space left on the device {where}: free some space there, or move tracking.uri, checkpoint.dir or "
            f"the folder you launch from (artifacts go to ./{ARTIFACTS}) to a disk with room"
        )


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Serialise store creation across processes (SQLite only; servers serialise themselves)."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    from filelock import FileLock

    with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
        yield


def connect(uri: str, experiment: str) -> tuple[Any, str]:
    """An ``MlflowClient`` on a created, migrated store, and the experiment's id (made if missing)."""
    from mlflow import MlflowClient

    # a new store's tables are no news: two INFO lines on stderr at every first run in a folder
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)

    with store_lock(uri):
        try:
            create_sqlite(uri)
            client = retrying(
                lambda: MlflowClient(tracking_uri=uri), what="opening the MLflow store", races=RACES + MIGRATION_RACES
            )
            return client, retrying(lambda: experiment_id(client, experiment))
        except Exception as err:
            path = sqlite_path(uri)
            if path is None or "database is locked" not in str(err):
                raise
            raise TrackingUnavailable(locked_message(uri, path)) from err


def create_sqlite(uri: str) -> None:
    """Create and migrate a new SQLite store in a file of its own beside the database, then publish it whole.

    A plain MLflow client takes no lock of ours: opening a store that another process is migrating, it migrates it
    too, and one of the two dies (``duplicate column name``). Built under another name, the store is either absent
    or whole to every other client. ``os.link`` publishes it only where no file is: a client that made its own
    meanwhile keeps it (then ``connect``'s open retries its migration races, ``MIGRATION_RACES``). Where the file
    system has no hard links, MLflow creates the store in place, as before, under ``store_lock``."""
    path = sqlite_path(uri)
    if path is None or path.exists():
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    fresh = path.with_name(f".{path.name}.{os.getpid()}.new")
    fresh_uri = sqlite_uri(fresh.absolute())
    try:
        store = SqlAlchemyStore(fresh_uri, ARTIFACTS)  # as MlflowClient makes it: tables, migrations, Default
        store.engine.dispose()  # every connection closed: the file holds all, with no journal beside it
        SqlAlchemyStore._engine_map.pop(fresh_uri, None)
        os.link(fresh, path)
    except FileExistsError:
        pass  # another client made the store meanwhile: it is its to finish
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        log.debug("no hard links where %s is (%s): MLflow creates the store in place", path, err)
    finally:
        fresh.unlink(missing_ok=True)


def experiment_id(client: Any, name: str) -> str:
    """Look the experiment up, restoring or creating it; tolerates another process creating it first."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
            log.warning("MLflow experiment %r was deleted; restored it", name)
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        experiment = client.get_experiment_by_name(name)  # another process won the race
        if experiment is None:
            raise
        return experiment.experiment_id


# another writer won a race for the same row: SQLite's lock, or two runs' get-or-create of one row (MLflow's
# datasets, logged by every run of a sweep at once) that the store's unique key refused the loser of
RACES = ("database is locked", "duplicate key value violates unique constraint", "UNIQUE constraint failed")


# another client migrating the same new store (a plain MLflow client, which takes no lock of ours): the repeat
# finds its tables, or goes on from the revision it reached
MIGRATION_RACES = ("duplicate column name", "already exists")


def retrying(call: Callable[[], T], *, what: str = "MLflow write", races: tuple[str, ...] = RACES) -> T:
    """Run ``call``, repeating it while another writer holds the store or won a race for the same row (``races``;
    ``lock_wait_s`` in all): the repeat waits for the lock, or finds the row the other writer made."""
    delay = FIRST_RETRY_S
    for attempt in range(RETRIES + 1):
        try:
            return call()
        except Exception as err:
            if not any(race in str(err) for race in races) or attempt == RETRIES:
                raise
        log.info("%s: another writer holds the store or won a race for a row, retrying in %.2f s", what, delay)
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def lock_wait_s() -> float:
    """How long ``retrying`` sleeps in all before it gives up on a locked database."""
    return FIRST_RETRY_S * (2**RETRIES - 1)


def disk_full(err: BaseException) -> bool:
    """Whether ``err``, or an error it was raised from, says a disk is full (ENOSPC, a quota, SQLite's "database
    or disk is full"; MLflow wraps the latter in its own exception, so the text is read too)."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(e).lower() for words in NO_SPACE):
            return True
    return False


def server_down(err: BaseException) -> bool:
    """Whether ``err``, or an error it was raised from or while handling, says a tracking server did not answer:
    a refused or dropped connection, a timeout, a proxy's 5xx retried to the end. MLflow wraps requests' errors in
    its own exception (the original in ``__context__``), so the chain is read. A write the server refused (bad
    request, permission) or a full disk is not this."""
    import requests

    down = (ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout, requests.exceptions.RetryError)
    return any(isinstance(e, down) for e in _chain(err))


def free_mb(path: Path) -> float:
    """Free space where ``path`` is or would be (its nearest existing folder); inf when that cannot be read."""
    for folder in (path, *path.absolute().parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free / 2**20
            except OSError:
                return float("inf")
    return float("inf")


def _free_note(path: Path) -> str:
    free = free_mb(path)
    return f" ({free:.0f} MB free)" if free != float("inf") else ""


def locked_message(uri: str, path: Path) -> str:
    return (
        f"{named(uri)}: the database {path.absolute()} is locked by another process (waited "
        f"{lock_wait_s():.1f} s, as long as MLflow's retries): find it with {_find_holder(path.absolute())}, let "
        f"it finish or stop it, or choose another tracking.uri"
    )


def _find_holder(path: Path) -> str:
    """How to find the process that holds ``path`` open, with the tools this platform has."""
    if sys.platform == "win32":
        return f"Resource Monitor (resmon: CPU, Associated Handles, search {path.name})"
    return f"`{'lsof' if sys.platform == 'darwin' else 'fuser'} {path}`"


def named(uri: str) -> str:
    """``tracking.uri=...`` with credentials masked, saying so when the value came from the environment."""
    return f"tracking.uri={mask_text(uri)}{' (from MLFLOW_TRACKING_URI)' if from_environment(uri) else ''}"


def from_environment(uri: str) -> bool:
    return os.environ.get("MLFLOW_TRACKING_URI") == uri


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the errors it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
