"""Whether a tracking URI can work, asked before anything is loaded or trained (``check_reachable``): a server that
does not answer (or refuses the credentials MLflow will send), an unknown scheme, MLflow's retired file store, a
missing database driver, a SQLite path that is a folder, not a database, read-only, locked by another process,
on a nearly full disk or on a network filesystem (``pipeline.record.filesystems``), and an artifact folder
(``./mlruns``) that cannot be written. The local checks are a few file-system calls, a read of the mount table
and one read-only look at the database's first page, cheap enough for every start; a server gets two requests
(``/health``, then one API call with the credentials).
"""

from __future__ import annotations

import base64
import contextlib
import os
import sqlite3
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import ParseResult, unquote, urlparse
from urllib.request import url2pathname

from pipeline.common.secrets import mask_text
from pipeline.common.uris import sqlite_file_uri, sqlite_path, sqlite_uri, uri_scheme
from pipeline.record.filesystems import sqlite_refusal
from pipeline.record.store import (
    ARTIFACTS,
    TrackingUnavailable,
    free_mb,
    from_environment,
    lock_wait_s,
    locked_message,
    named,
)

MIN_FREE_MB = 50  # below this the metrics, artifacts and SQLite's journal of one run may not fit


SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


DATABASES = frozenset({"sqlite", "postgresql", "mysql", "mssql"})  # SQLAlchemy stores: artifacts go to ./mlruns


OTHER_SCHEMES = frozenset({"http", "https", "databricks"})


CREDENTIALS_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"  # any account may list; one small query


def check_reachable(uri: str, *, timeout_s: float = 5.0) -> None:
    """Fail now, not after an hour of training, if runs cannot be recorded at ``uri``.

    Raises:
        TrackingUnavailable: one line naming the URI (credentials masked) and the fix.
    """
    parsed = parse(uri)  # first: a URI no store can be at is refused as one, naming it
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
            f"{named(uri)} has an unknown scheme {scheme!r}: use sqlite:///path/to/mlflow.db (a local file), "
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
            f"{named(uri)} is not a valid URI ({err}): e.g. sqlite:///mlflow.db or http://127.0.0.1:5000"
        ) from None
    return parsed


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
            f"{named(uri)} needs the database driver {err.name!r}, which is not installed: pip install {package}"
        ) from None
    except (sqlalchemy.exc.ArgumentError, ValueError) as err:
        raise TrackingUnavailable(f"{named(uri)} is not a valid database URI ({err})") from None


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
            f"{named(uri)} cannot be reached ({problem}): start the server "
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
            f"{named(uri)} refused the credentials ({problem}): set MLFLOW_TRACKING_USERNAME and "
            f"MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to an account on the server"
        )
    raise TrackingUnavailable(  # MLflow's --allowed-hosts check answers 403 too, and /health is exempt from it
        f"{named(uri)} refused the request ({problem}): the server's --allowed-hosts must list {netloc}, the "
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
        raise TrackingUnavailable(f"{named(uri)}: {refused}")
    folder = path.parent
    if path.is_dir():
        raise TrackingUnavailable(
            f"{named(uri)} names the folder {path}, not a database file: use tracking.uri="
            f"{sqlite_uri(path.absolute() / 'mlflow.db')}"
        )
    if not folder.is_dir():
        raise TrackingUnavailable(
            f"{named(uri)}: the folder {folder} does not exist (SQLite creates the database file, not its "
            f"folder); create it or choose another path"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise TrackingUnavailable(
            f"{named(uri)}: the folder {folder.absolute()} is read-only, and SQLite writes {path.name} and its "
            f"journal ({path.name}-journal or -wal) there: choose a writable folder, e.g. "
            f"tracking.uri={sqlite_uri(Path.home() / 'mlflow.db')}"
        )
    if path.exists():
        if not os.access(path, os.R_OK | os.W_OK):
            raise TrackingUnavailable(
                f"{named(uri)}: the database {path.absolute()} is read-only: make it writable "
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
                raise TrackingUnavailable(locked_message(uri, path)) from None
            if "readonly" not in str(err):  # a hot journal a read-only look cannot roll back: MLflow will
                problem = str(err)
        except sqlite3.DatabaseError as err:  # "file is not a database", "database disk image is malformed"
            problem = str(err)
    if problem:
        raise TrackingUnavailable(
            f"{named(uri)}: {path.absolute()} is not an SQLite database ({problem}): point tracking.uri at a new "
            f"file, e.g. {sqlite_uri(path.absolute().parent / 'mlflow.db')}"
        )


def _check_file_store(uri: str) -> None:
    """A plain path or ``file:`` URI is MLflow's file store, retired in MLflow 3 unless explicitly allowed."""
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    if not allowed:
        kind = "a file: URI" if uri_scheme(uri) else "a plain path, not a URI"
        setting = "MLFLOW_TRACKING_URI" if from_environment(uri) else "tracking.uri"
        raise TrackingUnavailable(
            f"{named(uri)} is {kind}: MLflow's file store, which MLflow 3 no longer opens: set "
            f"{setting}=sqlite:///mlflow.db (a file) or http://host:5000 (a server), or MLFLOW_ALLOW_FILE_STORE=true "
            f"to open an old file store"
        )
    # a file: URI's path as MLflow reads it: file:///C:/runs is C:\runs on Windows, /C:/runs to Path
    folder = Path(url2pathname(urlparse(uri).path)) if uri_scheme(uri) else Path(uri)
    target = folder if folder.exists() else folder.parent
    if not target.is_dir() or not os.access(target, os.W_OK | os.X_OK):
        raise TrackingUnavailable(
            f"{named(uri)}: MLflow's file store needs the folder {target.absolute()} to exist and be writable: "
            f"create it or choose another"
        )
    _check_free_space(uri, target, "the file store")


def _check_artifacts(uri: str) -> None:
    """MLflow writes a database store's artifacts under ./mlruns (it makes the folder when missing)."""
    root = Path(ARTIFACTS)
    target = root if root.exists() else root.absolute().parent
    if root.exists() and not root.is_dir():
        raise TrackingUnavailable(
            f"{named(uri)}: MLflow writes the run's artifacts to {root.absolute()}, which is a file: move it away "
            f"or launch from another folder"
        )
    if not os.access(target, os.W_OK | os.X_OK):
        raise TrackingUnavailable(
            f"{named(uri)}: MLflow writes the run's artifacts to {root.absolute()}, and {target} is read-only: "
            f"launch from a writable folder"
        )
    _check_free_space(uri, target, "the artifacts")


def _check_free_space(uri: str, folder: Path, what: str) -> None:
    free = free_mb(folder)
    if free < MIN_FREE_MB:
        raise TrackingUnavailable(
            f"{named(uri)}: only {free:.0f} MB free on the disk holding {what} ({folder.absolute()}); a run needs "
            f"at least {MIN_FREE_MB} MB: free some space or choose a folder on another disk"
        )


def _plugin_scheme(scheme: str) -> bool:
    """A scheme a package registers as an MLflow tracking store (read only for schemes we do not know)."""
    from importlib.metadata import entry_points

    return any(e.name == scheme for e in entry_points(group="mlflow.tracking_store"))


def _make_writable(path: Path) -> str:
    return f"attrib -r {path}" if sys.platform == "win32" else f"chmod u+w {path}"
