"""The MLflow store under concurrency and failure: safe start, retries, reachability.

Several processes starting at once on a fresh SQLite store race through MLflow's schema
migration (``duplicate column name: step``) and through experiment creation. ``connect`` holds
a file lock beside the database while the store is created, migrated and the experiment looked
up or made, so every process lands its run. ``retrying`` repeats a write that SQLite refused
with "database is locked". ``check_reachable`` fails fast, before any data is loaded, when the
tracking URI cannot work.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

from pipeline.errors import PipelineError
from pipeline.secrets import mask_text

log = logging.getLogger(__name__)
T = TypeVar("T")

LOCK_TIMEOUT_S = 300.0  # a migration takes seconds; waiting minutes means something else is wrong
RETRIES = 8  # "database is locked" retries, with doubling back-off from 50 ms (about 13 s in all)


class TrackingUnavailable(PipelineError):
    """The tracking URI cannot be used; nothing was trained."""


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other stores and in-memory SQLite)."""
    parsed = urlparse(uri)
    if parsed.scheme != "sqlite" or not parsed.path or parsed.path == "/:memory:":
        return None
    return Path(unquote(parsed.path[1:] if uri.startswith("sqlite:///") else parsed.path))


def absolute(uri: str) -> str:
    """A relative ``sqlite:///mlflow.db`` made absolute, so it names one file whatever the working directory
    (MLflow also caches stores by URI: a relative one would follow the first directory it was used in)."""
    path = sqlite_path(uri)
    if path is None or path.is_absolute():
        return uri
    return f"sqlite:///{path.resolve()}"


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

    with store_lock(uri):
        client = MlflowClient(tracking_uri=uri)
        return client, retrying(lambda: experiment_id(client, experiment))


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


def retrying(call: Callable[[], T], *, what: str = "MLflow write") -> T:
    """Run ``call``, repeating it while SQLite says the database is locked."""
    delay = 0.05
    for attempt in range(RETRIES + 1):
        try:
            return call()
        except Exception as err:
            if "database is locked" not in str(err) or attempt == RETRIES:
                raise
        log.info("%s: database is locked, retrying in %.2f s", what, delay)
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def check_reachable(uri: str, *, timeout_s: float = 5.0) -> None:
    """Fail now, not after an hour of training, if runs cannot be recorded at ``uri``.

    Raises:
        TrackingUnavailable: a server that does not answer, or a SQLite/file store whose folder is missing.
    """
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        host = parsed.hostname or ""
        netloc = (f"[{host}]" if ":" in host else host) + (f":{parsed.port}" if parsed.port else "")
        health = urllib.request.Request(parsed._replace(netloc=netloc).geturl().rstrip("/") + "/health")
        if parsed.username:  # urllib does not read user:password@ from the URL; MLflow sends it as basic auth
            token = base64.b64encode(f"{unquote(parsed.username)}:{unquote(parsed.password or '')}".encode())
            health.add_header("Authorization", "Basic " + token.decode())
        try:
            with urllib.request.urlopen(health, timeout=timeout_s) as response:
                if response.status == 200:
                    return
                problem = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as err:
            problem = str(getattr(err, "reason", err))
        raise TrackingUnavailable(
            f"tracking.uri={mask_text(uri)} cannot be reached ({problem}): start the server "
            f"(mlflow server --port {parsed.port or 5000}), fix the URI, or record locally with "
            f"tracking.uri=sqlite:///mlflow.db"
        )
    path = sqlite_path(uri)
    folder = path.parent if path is not None else (Path(parsed.path) if parsed.scheme in ("", "file") else None)
    if folder is not None and not folder.exists() and path is not None:
        raise TrackingUnavailable(
            f"tracking.uri={uri}: the folder {folder} does not exist (SQLite creates the database file, not its "
            f"folder); create it or choose another path"
        )
