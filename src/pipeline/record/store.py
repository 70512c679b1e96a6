"""The MLflow store under concurrency and failure: safe start, retries, reachability.

Several processes starting at once on a fresh SQLite store race through MLflow's schema
migration (``duplicate column name: step``) and through experiment creation. ``connect`` holds
a file lock beside the database while the store is created, migrated and the experiment looked
up or made, so every process lands its run. ``retrying`` repeats a write that SQLite refused
with "database is locked". ``check_reachable`` fails fast, before any data is loaded, when the
tracking URI cannot work: a server that does not answer, an unknown scheme, MLflow's retired
file store, a SQLite path that is a folder, not a database, read-only, locked by another process,
on a nearly full disk or on a network filesystem (``pipeline.record.filesystems``), and an artifact
folder (``./mlruns``) that cannot be written. Its local checks are a few file-system calls, a
read of the mount table and one read-only look at the database's first page, cheap enough for
every start; a server gets two requests (``/health``, then one API call with the
credentials MLflow will send, which ``/health`` does not check). ``disk_full`` tells a write that
failed for want of space (mid-run) from other errors, and ``DiskFull.explain`` names where;
``server_down`` tells a server that stopped answering from a write it refused.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import logging
import os
import shutil
import sqlite3
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import ParseResult, unquote, urlparse
from urllib.request import url2pathname

from pipeline.common.errors import PipelineError
from pipeline.common.secrets import mask_text
from pipeline.common.uris import sqlite_file_uri, sqlite_path, sqlite_uri
from pipeline.record.filesystems import sqlite_refusal

log = logging.getLogger(__name__)
T = TypeVar("T")

LOCK_TIMEOUT_S = 300.0  # a migration takes seconds; waiting minutes means something else is wrong
RETRIES = 8  # "database is locked" retries, with doubling back-off from 50 ms (about 13 s in all)
FIRST_RETRY_S = 0.05
MIN_FREE_MB = 50  # below this the metrics, artifacts and SQLite's journal of one run may not fit
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
ARTIFACTS = "mlruns"  # MLflow's default artifact root for a database store, relative to where the run starts
DATABASES = frozenset({"sqlite", "postgresql", "mysql", "mssql"})  # SQLAlchemy stores: artifacts go to ./mlruns
OTHER_SCHEMES = frozenset({"http", "https", "databricks"})
NO_SPACE = ("database or disk is full", "no space left on device", "disk quota exceeded")


CREDENTIALS_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"  # any account may list; one small query


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
            client = retrying(lambda: MlflowClient(tracking_uri=uri), what="opening the MLflow store")
            return client, retrying(lambda: experiment_id(client, experiment))
        except Exception as err:
            path = sqlite_path(uri)
            if path is None or "database is locked" not in str(err):
                raise
            raise TrackingUnavailable(_locked(uri, path)) from err


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


def retrying(call: Callable[[], T], *, what: str = "MLflow write") -> T:
    """Run ``call``, repeating it while another writer holds the store or won a race for the same row (``RACES``;
    ``lock_wait_s`` in all): the repeat waits for the lock, or finds the row the other writer made."""
    delay = FIRST_RETRY_S
    for attempt in range(RETRIES + 1):
        try:
            return call()
        except Exception as err:
            if not any(race in str(err) for race in RACES) or attempt == RETRIES:
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


def check_reachable(uri: str, *, timeout_s: float = 5.0) -> None:
    """Fail now, not after an hour of training, if runs cannot be recorded at ``uri``.

    Raises:
        TrackingUnavailable: one line naming the URI (credentials masked) and the fix.
    """
    parsed = parse(uri)
    scheme = uri_scheme(uri)
    if scheme in ("http", "https"):
        _check_server(uri, timeout_s=timeout_s)
    elif scheme == "sqlite":
        _check_sqlite(uri)
        _check_artifacts(uri)
    elif scheme in ("", "file"):
        _check_file_store(uri)
    elif scheme.partition("+")[0] in DATABASES:  # postgresql+psycopg2://...: the server is MLflow's to reach
        _check_driver(uri)
        _check_artifacts(uri)
    elif scheme not in OTHER_SCHEMES and not _plugin_scheme(scheme):
        server = f"http://{uri}" if parsed.path.isdigit() else "http://host:5000"  # localhost:5000 parses as a scheme
        raise TrackingUnavailable(
            f"{_named(uri)} has an unknown scheme {scheme!r}: use sqlite:///path/to/mlflow.db (a local file), "
            f"{server} (an MLflow server) or postgresql://, mysql://, mssql:// (a database)"
        )


def check_exists(uri: str) -> None:
    """For commands that only read or amend a store (``stale``, ``outbox``): a ``sqlite:///`` file that is not
    there is refused, since opening it would create an empty store (MLflow makes the file and its tables).

    Raises:
        TrackingUnavailable: one line naming the URI.
    """
    path = sqlite_path(uri)
    if path is not None and not path.is_file():
        raise TrackingUnavailable(
            f"no MLflow store at {mask_text(uri)}: run this in the folder you trained in, or pass --uri with the "
            f"store's URI"
        )


def parse(uri: str) -> ParseResult:
    """``uri`` parsed, its port included.

    Raises:
        TrackingUnavailable: a URI no store can be at (``http://[::1``, a port that is no number or over 65535).
    """
    try:
        parsed = urlparse(uri)
        parsed.port  # noqa: B018 - read to validate: urlparse checks the port only when asked for it
    except ValueError as err:
        raise TrackingUnavailable(
            f"{_named(uri)} is not a valid URI ({err}): e.g. sqlite:///mlflow.db or http://127.0.0.1:5000"
        ) from None
    return parsed


def uri_scheme(uri: str) -> str:
    """``uri``'s scheme in lower case; "" for a plain path, a Windows one included: ``C:\\runs`` parses as scheme
    ``c``, which MLflow also takes for a drive letter.

    Raises:
        TrackingUnavailable: ``uri`` is not a valid URI (``parse``).
    """
    scheme = parse(uri).scheme.lower()
    return "" if len(scheme) == 1 else scheme


# the Python module each database driver needs, and the package that holds it
DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]", "MySQLdb": "mysqlclient"}


def _check_driver(uri: str) -> None:
    """A database URI whose driver is not installed fails in MLflow after the data has loaded: say it now.
    SQLAlchemy's ``create_engine`` imports the driver and connects to nothing."""
    import sqlalchemy

    try:
        sqlalchemy.create_engine(uri)
    except ModuleNotFoundError as err:
        package = DRIVER_PACKAGES.get(err.name or "", err.name)
        raise TrackingUnavailable(
            f"{_named(uri)} needs the database driver {err.name!r}, which is not installed: pip install {package}"
        ) from None
    except (sqlalchemy.exc.ArgumentError, ValueError) as err:
        raise TrackingUnavailable(f"{_named(uri)} is not a valid database URI ({err})") from None


def _check_server(uri: str, *, timeout_s: float) -> None:
    parsed = urlparse(uri)
    host = parsed.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parsed.port}" if parsed.port else "")
    base = parsed._replace(netloc=netloc).geturl().rstrip("/")
    try:  # credentials in the URI only: a server that is down fails before MLflow's import (2 s) reads the others
        with urllib.request.urlopen(_request(f"{base}/health", _uri_authorization(uri)), timeout=timeout_s) as response:
            problem = "" if response.status == 200 else f"HTTP {response.status}"
    except (urllib.error.URLError, OSError) as err:
        problem = str(getattr(err, "reason", err))
    if problem:
        raise TrackingUnavailable(
            f"{_named(uri)} cannot be reached ({problem}): start the server "
            f"(mlflow server --port {parsed.port or 5000}), fix the URI, or record locally with "
            f"tracking.uri=sqlite:///mlflow.db"
        )
    # /health answers anyone, whatever the Host header: bad credentials (--app-name basic-auth) and an address the
    # server's --allowed-hosts does not list show only on an API call
    try:
        with urllib.request.urlopen(_request(f"{base}{CREDENTIALS_PROBE}", _authorization(uri)), timeout=timeout_s):
            return
    except urllib.error.HTTPError as err:
        code = err.code
        if code not in (401, 403):
            return  # not a question of access: MLflow's own call says what is wrong, in the run's words
        said = err.read(300).decode(errors="replace").strip().splitlines()
        problem = f"HTTP {code}" + (f": {mask_text(said[0])}" if said else "")
    except (urllib.error.URLError, OSError):
        return  # it answered /health a moment ago; a blip here is MLflow's to retry
    if code == 401:
        raise TrackingUnavailable(
            f"{_named(uri)} refused the credentials ({problem}): set MLFLOW_TRACKING_USERNAME and "
            f"MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to an account on the server"
        )
    raise TrackingUnavailable(  # MLflow's --allowed-hosts check answers 403 too, and /health is exempt from it
        f"{_named(uri)} refused the request ({problem}): the server's --allowed-hosts must list {netloc}, the "
        f"address this run uses, and the account must be allowed to read experiments"
    )


def _authorization(uri: str) -> str | None:
    """The Authorization header MLflow sends to ``uri``: ``user:password@`` in the URI (requests puts it over any
    other), else MLFLOW_TRACKING_USERNAME and _PASSWORD (or ~/.mlflow/credentials), else MLFLOW_TRACKING_TOKEN."""
    in_uri = _uri_authorization(uri)
    if in_uri:
        return in_uri
    from mlflow.utils.credentials import get_default_host_creds  # MLflow's own reading of its variables

    creds = get_default_host_creds(uri)
    if creds.username and creds.password:
        return _basic(creds.username, creds.password)
    return f"Bearer {creds.token}" if creds.token else None


def _uri_authorization(uri: str) -> str | None:
    """Basic authentication from ``user:password@`` in the URI (urllib does not read it from the URL itself)."""
    parsed = urlparse(uri)
    return _basic(unquote(parsed.username), unquote(parsed.password or "")) if parsed.username else None


def _basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def _request(url: str, authorization: str | None) -> urllib.request.Request:
    return urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})


def _check_sqlite(uri: str) -> None:
    path = sqlite_path(uri)
    if path is None:
        return  # in-memory: nothing on disk
    refused = sqlite_refusal(path.absolute())  # before the folder checks: a folder made there would not help
    if refused:
        raise TrackingUnavailable(f"{_named(uri)}: {refused}")
    folder = path.parent
    if path.is_dir():
        raise TrackingUnavailable(
            f"{_named(uri)} names the folder {path}, not a database file: use tracking.uri="
            f"{sqlite_uri(path.absolute() / 'mlflow.db')}"
        )
    if not folder.is_dir():
        raise TrackingUnavailable(
            f"{_named(uri)}: the folder {folder} does not exist (SQLite creates the database file, not its "
            f"folder); create it or choose another path"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise TrackingUnavailable(
            f"{_named(uri)}: the folder {folder.absolute()} is read-only, and SQLite writes {path.name} and its "
            f"journal ({path.name}-journal or -wal) there: choose a writable folder, e.g. "
            f"tracking.uri={sqlite_uri(Path.home() / 'mlflow.db')}"
        )
    if path.exists():
        if not os.access(path, os.R_OK | os.W_OK):
            raise TrackingUnavailable(
                f"{_named(uri)}: the database {path.absolute()} is read-only: make it writable "
                f"({_make_writable(path)}) or choose another file"
            )
        _check_database(uri, path)
    _check_free_space(uri, folder, "the tracking store")


def _check_database(uri: str, path: Path) -> None:
    """The file is a SQLite database that no other process holds locked (a read-only look at its first page)."""
    with path.open("rb") as file:
        header = file.read(len(SQLITE_HEADER))
    problem = "" if header in (b"", SQLITE_HEADER) else "it does not start with SQLite's header"
    if not problem:
        try:  # waits while another process writes, as long as MLflow's retries would (timeout=)
            with contextlib.closing(
                sqlite3.connect(sqlite_file_uri(path.absolute()), uri=True, timeout=lock_wait_s())
            ) as db:
                db.execute("PRAGMA schema_version").fetchone()
        except sqlite3.OperationalError as err:
            if "locked" in str(err):
                raise TrackingUnavailable(_locked(uri, path)) from None
            if "readonly" not in str(err):  # a hot journal a read-only look cannot roll back: MLflow will
                problem = str(err)
        except sqlite3.DatabaseError as err:  # "file is not a database", "database disk image is malformed"
            problem = str(err)
    if problem:
        raise TrackingUnavailable(
            f"{_named(uri)}: {path.absolute()} is not an SQLite database ({problem}): point tracking.uri at a new "
            f"file, e.g. {sqlite_uri(path.absolute().parent / 'mlflow.db')}"
        )


def _check_file_store(uri: str) -> None:
    """A plain path or ``file:`` URI is MLflow's file store, retired in MLflow 3 unless explicitly allowed."""
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    if not allowed:
        kind = "a file: URI" if uri_scheme(uri) else "a plain path, not a URI"
        setting = "MLFLOW_TRACKING_URI" if _from_environment(uri) else "tracking.uri"
        raise TrackingUnavailable(
            f"{_named(uri)} is {kind}: MLflow's file store, which MLflow 3 no longer opens: set "
            f"{setting}=sqlite:///mlflow.db (a file) or http://host:5000 (a server), or MLFLOW_ALLOW_FILE_STORE=true "
            f"to open an old file store"
        )
    # a file: URI's path as MLflow reads it: file:///C:/runs is C:\runs on Windows, /C:/runs to Path
    folder = Path(url2pathname(urlparse(uri).path)) if uri_scheme(uri) else Path(uri)
    target = folder if folder.exists() else folder.parent
    if not target.is_dir() or not os.access(target, os.W_OK | os.X_OK):
        raise TrackingUnavailable(
            f"{_named(uri)}: MLflow's file store needs the folder {target.absolute()} to exist and be writable: "
            f"create it or choose another"
        )
    _check_free_space(uri, target, "the file store")


def _check_artifacts(uri: str) -> None:
    """MLflow writes a database store's artifacts under ./mlruns (it makes the folder when missing)."""
    root = Path(ARTIFACTS)
    target = root if root.exists() else root.absolute().parent
    if root.exists() and not root.is_dir():
        raise TrackingUnavailable(
            f"{_named(uri)}: MLflow writes the run's artifacts to {root.absolute()}, which is a file: move it away "
            f"or launch from another folder"
        )
    if not os.access(target, os.W_OK | os.X_OK):
        raise TrackingUnavailable(
            f"{_named(uri)}: MLflow writes the run's artifacts to {root.absolute()}, and {target} is read-only: "
            f"launch from a writable folder"
        )
    _check_free_space(uri, target, "the artifacts")


def _check_free_space(uri: str, folder: Path, what: str) -> None:
    free = _free_mb(folder)
    if free < MIN_FREE_MB:
        raise TrackingUnavailable(
            f"{_named(uri)}: only {free:.0f} MB free on the disk holding {what} ({folder.absolute()}); a run needs "
            f"at least {MIN_FREE_MB} MB: free some space or choose a folder on another disk"
        )


def _free_mb(path: Path) -> float:
    """Free space where ``path`` is or would be (its nearest existing folder); inf when that cannot be read."""
    for folder in (path, *path.absolute().parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free / 2**20
            except OSError:
                return float("inf")
    return float("inf")


def _free_note(path: Path) -> str:
    free = _free_mb(path)
    return f" ({free:.0f} MB free)" if free != float("inf") else ""


def _plugin_scheme(scheme: str) -> bool:
    """A scheme a package registers as an MLflow tracking store (read only for schemes we do not know)."""
    from importlib.metadata import entry_points

    return any(e.name == scheme for e in entry_points(group="mlflow.tracking_store"))


def _locked(uri: str, path: Path) -> str:
    return (
        f"{_named(uri)}: the database {path.absolute()} is locked by another process (waited "
        f"{lock_wait_s():.1f} s, as long as MLflow's retries): find it with {_find_holder(path.absolute())}, let "
        f"it finish or stop it, or choose another tracking.uri"
    )


def _find_holder(path: Path) -> str:
    """How to find the process that holds ``path`` open, with the tools this platform has."""
    if sys.platform == "win32":
        return f"Resource Monitor (resmon: CPU, Associated Handles, search {path.name})"
    return f"`{'lsof' if sys.platform == 'darwin' else 'fuser'} {path}`"


def _make_writable(path: Path) -> str:
    return f"attrib -r {path}" if sys.platform == "win32" else f"chmod u+w {path}"


def _named(uri: str) -> str:
    """``tracking.uri=...`` with credentials masked, saying so when the value came from the environment."""
    return f"tracking.uri={mask_text(uri)}{' (from MLFLOW_TRACKING_URI)' if _from_environment(uri) else ''}"


def _from_environment(uri: str) -> bool:
    return os.environ.get("MLFLOW_TRACKING_URI") == uri


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the errors it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
