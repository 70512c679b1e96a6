"""Tracking URIs as MLflow reads them: a SQLite store's database file, made absolute, and the UI's address.

Pure functions of a string (no store is opened, nothing is imported from MLflow), used by the store, the
tracker, checkpoints, comparisons and the masking of secrets alike.
"""

from __future__ import annotations

from pathlib import Path, PurePath
from urllib.parse import quote, unquote, urlparse

UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` serves
TRAINING_VIEW = "workflowType=machine_learning"  # MLflow 3 opens in its GenAI view without it


def ui_base(uri: str) -> str:
    """The UI address for a run's links: a tracking server's own, without ``user:password@`` (the browser asks
    for credentials itself), else where ``mlflow ui`` serves a local store."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return UI_URL
    return parsed._replace(netloc=parsed.netloc.rpartition("@")[2]).geturl().rstrip("/")


def run_page(experiment_id: str, run_id: str | None = None) -> str:
    """The UI page of a run (or, without ``run_id``, of an experiment's runs) in the model-training view, relative to
    the UI's address (``ui_base(uri) + "/" + run_page(...)``)."""
    runs = f"runs/{run_id}" if run_id else "runs"
    return f"#/experiments/{experiment_id}/{runs}?{TRAINING_VIEW}"


def sqlite_database(uri: str) -> str | None:
    """The database of a ``sqlite://`` URI as SQLAlchemy, and so MLflow, reads it: what follows the third slash up
    to a ``?``, percent-decoded; None for other stores and in-memory SQLite. ``sqlite:///mlflow.db`` is
    ``mlflow.db`` (relative), ``sqlite:////home/me/mlflow.db`` is ``/home/me/mlflow.db``, and
    ``sqlite:///C:/Users/me/mlflow.db`` is ``C:/Users/me/mlflow.db``, a Windows path in forward slashes (which
    Windows accepts). Not ``urlparse``: it would cut a file name at a ``#``."""
    scheme, sep, rest = uri.partition("://")
    if scheme.lower() != "sqlite" or not sep:
        return None
    _host, slash, database = rest.partition("/")
    database = unquote(database.partition("?")[0])
    return database if slash and database not in ("", ":memory:") else None


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other stores and in-memory SQLite)."""
    database = sqlite_database(uri)
    return None if database is None else Path(database)


def sqlite_uri(path: PurePath) -> str:
    """The ``sqlite:///`` URI of an absolute database path, as MLflow writes it on each platform: in forward
    slashes, since a backslash is no URI character. ``/home/me/mlflow.db`` gives ``sqlite:////home/me/mlflow.db``,
    Windows' ``C:`` drive path ``sqlite:///C:/Users/me/mlflow.db`` and a share (two leading backslashes)
    ``sqlite://///server/share/mlflow.db``. Only ``%`` and ``?`` are escaped, the two characters SQLAlchemy would
    read otherwise: spaces stay as typed, so the URI (and the checkpoints' record of it) reads as the path does."""
    return "sqlite:///" + path.as_posix().replace("%", "%25").replace("?", "%3F")


def absolute(uri: str, *, cwd: PurePath | None = None) -> str:
    """A relative ``sqlite:///mlflow.db`` made absolute, so it names one file whatever the working directory
    (MLflow also caches stores by URI: a relative one would follow the first directory it was used in).

    Args:
        uri: any tracking URI; only relative SQLite ones change.
        cwd: the folder a relative path starts from; by default the working directory, symbolic links resolved.
            A ``PureWindowsPath`` reads the URI as Windows would, on any system.
    """
    database = sqlite_database(uri)
    if database is None:
        return uri
    path = (type(cwd) if cwd is not None else Path)(database)
    if path.is_absolute():  # on Windows, a drive and a root: /mlflow.db is relative to the current drive
        return uri
    return sqlite_uri(cwd / path if cwd is not None else Path(database).resolve())


def sqlite_file_uri(path: PurePath) -> str:
    """SQLite's own read-only ``file:`` URI for an absolute path (``sqlite3.connect(..., uri=True)``).

    Not ``Path.as_uri()``: for a Windows share that puts the server in the authority
    (``file://server/share/mlflow.db``), which SQLite refuses; here it is ``file:////server/share/mlflow.db``,
    ``file:///C:/Users/me/mlflow.db`` for a drive and ``file:///home/me/mlflow.db`` on POSIX.
    """
    posix = path.as_posix()
    return f"file://{'' if posix.startswith('/') else '/'}{quote(posix, safe='/:')}?mode=ro"


def uri_scheme(uri: str) -> str:
    """``uri``'s scheme in lower case; "" for a plain path, a Windows one included: ``C:\\runs`` parses as scheme
    ``c``, which MLflow also takes for a drive letter.

    Raises:
        ValueError: ``uri`` is not a valid URI (urlparse's message: ``Invalid IPv6 URL``, a port that is no number or
            over 65535); ``pipeline.record.reachability.parse`` names it with the fix.
    """
    parsed = urlparse(uri)
    parsed.port  # noqa: B018 - read to validate: urlparse checks the port only when asked for it
    scheme = parsed.scheme.lower()
    return "" if len(scheme) == 1 else scheme
