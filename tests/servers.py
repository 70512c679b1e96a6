"""A real ``mlflow server`` for tests, on 127.0.0.1 and a free port, with its own store in a folder.

    with mlflow_server(tmp_path / "server") as server:
        train(make_cfg(f"tracking.uri={server.uri}"))
        server.rest("runs/get", run_id=...)

One start costs about 5 s on two CPU cores (most of it the server's imports and, on a new store, MLflow's schema
migration), so modules share one server through a module-scoped fixture. ``stop()`` and ``start()`` take it down and
bring it back on the same port and the same store, as a team server that restarts would; ``kill()`` is a crash
(SIGKILL: requests in flight get no answer).

A team's server keeps its runs in PostgreSQL, and so can a test's: ``postgres(folder)`` runs a throwaway cluster
(initdb, then ``postgres`` on 127.0.0.1 and a free port, as the user ``postgres`` when the tests run as root, which
PostgreSQL refuses), and ``mlflow_server(folder, backend=db.uri)`` stores in it:

    reason = postgres_missing()   # None, or why not and how to install it: skip the test with it
    with postgres(tmp_path / "db") as db, mlflow_server(tmp_path / "server", backend=db.uri, env=db.env) as server:
        ...
"""

from __future__ import annotations

import base64
import contextlib
import glob
import http.server
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

START_WITHIN_S = 90.0  # a cold start on a busy two-core machine; a healthy one answers in about 5 s
STOP_WITHIN_S = 30.0


def free_port() -> int:
    """A port nobody listens on now: the one the OS picks for port 0 (free again once the socket closes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(folder: Path, port: int, *extra: str, backend: str | None = None) -> list[str]:
    """The command docs/team-server.md shows for one person's server: SQLite store (or ``backend``, e.g. a
    PostgreSQL URI), artifacts served by the server itself (``--artifacts-destination``, uploaded over HTTP),
    bound to 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        backend or f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--workers",
        "1",
        *extra,
    ]


class MlflowServer:
    """One ``mlflow server`` process group; ``folder`` holds its store (unless ``backend`` names another), its
    artifacts and its log (``server.log``)."""

    def __init__(
        self,
        folder: Path,
        *,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        credentials: tuple[str, str] | None = None,
        port: int | None = None,
        backend: str | None = None,
    ) -> None:
        self.folder, self.extra, self.credentials, self.backend = folder, list(extra), credentials, backend
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
        self.env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job runner process: runs need none
        self.env.update(env or {})
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.folder / "server.log"

    def start(self) -> MlflowServer:
        """Start the server (same port and store as before, if it ran) and wait until ``/health`` answers."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                server_command(self.folder, self.port, *self.extra, backend=self.backend),
                cwd=self.folder,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: `mlflow server` runs uvicorn as a child
            )
        deadline = time.monotonic() + START_WITHIN_S
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not start on port {self.port}:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """Stop the whole process group and wait until it is gone, so the port can be taken again at once."""
        process, self.process = self.process, None
        if process is not None:
            _end_group(process, signal.SIGTERM)

    def kill(self) -> None:
        """Crash the server: SIGKILL to every process of it, so a request in flight gets no answer."""
        process, self.process = self.process, None
        if process is not None:
            _end_group(process, signal.SIGKILL)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def rest(self, endpoint: str, **params: Any) -> dict[str, Any]:
        """``GET /api/2.0/mlflow/<endpoint>?params`` with plain urllib (and the server's credentials, if any)."""
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url)
        if self.credentials is not None:
            token = base64.b64encode(":".join(self.credentials).encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """A metric's (step, value) pairs as the server returns them, sorted by step."""
        metrics = self.rest("metrics/get-history", run_id=run_id, metric_key=key).get("metrics", [])
        return sorted((int(m["step"]), float(m["value"])) for m in metrics)

    def files_containing(self, needle: str) -> list[Path]:
        """Every file of the server's folder (the SQLite store, artifacts) whose bytes hold ``needle``; the server's
        own log is left out (it is not part of the store)."""
        files = (p for p in self.folder.rglob("*") if p.is_file() and p != self.log)
        return [p for p in files if needle.encode() in p.read_bytes()]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"


@contextlib.contextmanager
def mlflow_server(
    folder: Path,
    *,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    credentials: tuple[str, str] | None = None,
    port: int | None = None,
    backend: str | None = None,
) -> Iterator[MlflowServer]:
    """A started server with its store in ``folder``, or in ``backend`` (a database URI), on ``port``, else a free
    one; stopped on exit, whatever happened. ``env`` adds to the server's environment (MLFLOW_TRACKING_* variables are
    never passed on); ``credentials`` are sent by ``rest()``."""
    server = MlflowServer(folder, extra=extra, env=env, credentials=credentials, port=port, backend=backend)
    try:
        yield server.start()
    finally:
        server.stop()


def _end_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``process`` leads and wait until every member is gone (SIGKILL after
    ``STOP_WITHIN_S``), so its port can be taken again at once."""
    group = process.pid  # start_new_session: the group's id is the leader's pid
    _signal_group(group, sig)
    try:
        process.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        _signal_group(group, signal.SIGKILL)
        process.wait(timeout=STOP_WITHIN_S)
    deadline = time.monotonic() + STOP_WITHIN_S
    while _group_alive(group):  # the children outlive their parent for a moment
        if time.monotonic() > deadline:
            _signal_group(group, signal.SIGKILL)
            deadline = time.monotonic() + STOP_WITHIN_S
        time.sleep(0.05)


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


POSTGRES_ACCOUNT = "postgres"  # the account Debian's package makes: PostgreSQL refuses to run as root
INSTALL = "apt-get install -y postgresql (as root; .ci/run does it) and pip install -e '.[dev]' (its drivers)"


def postgres_bindir() -> Path | None:
    """The folder holding ``initdb`` and ``postgres``: ``pg_config --bindir``, else the newest
    ``/usr/lib/postgresql/<version>/bin`` (Debian keeps the server's programs off the PATH)."""
    candidates = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        candidates.append(Path(found))
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted((Path(p) for p in versions), key=lambda p: _version(p.parent.name), reverse=True)
    return next((p for p in candidates if (p / "initdb").is_file() and (p / "postgres").is_file()), None)


def postgres_missing() -> str | None:
    """Why a real PostgreSQL cannot back a server here, with how to install it; None when it can."""
    if postgres_bindir() is None:
        return f"PostgreSQL is not installed (no initdb in pg_config --bindir nor /usr/lib/postgresql/*/bin): {INSTALL}"
    from sqlalchemy.engine import make_url

    try:  # the driver SQLAlchemy picks for postgresql:// (psycopg from SQLAlchemy 2.1, psycopg2 before)
        make_url("postgresql://").get_dialect().import_dbapi()
    except ImportError as err:
        return f"MLflow's driver for PostgreSQL is missing ({err}): pip install -e '.[dev]'"
    if os.geteuid() == 0 and (shutil.which("runuser") is None or not _account_exists(POSTGRES_ACCOUNT)):
        return (
            f"the tests run as root, which PostgreSQL refuses, and there is no account {POSTGRES_ACCOUNT!r} to run it "
            f"as with runuser: {INSTALL}"
        )
    return None


class Postgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 and a free port, with a database ``mlflow`` owned by the
    account ``mlflow``, whose password the server reads from ``PGPASSWORD`` (``env``) rather than from its URI.

    Its data folder is made by ``start()`` and removed by ``stop()``; ``folder`` keeps its log (``postgres.log``).
    As root it runs as the account ``postgres`` (``runuser``), with the data in a folder of /tmp that account owns:
    pytest's own folders are closed to other accounts.
    """

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.bindir = postgres_bindir()
        self.password = secrets.token_hex(16)
        self.process: subprocess.Popen[bytes] | None = None
        self.root: Path | None = None  # holds data/ and the password file initdb reads

    @property
    def uri(self) -> str:
        """The URI for ``mlflow server --backend-store-uri``: no password in it (``env`` holds it)."""
        return f"postgresql://mlflow@127.0.0.1:{self.port}/mlflow"

    @property
    def env(self) -> dict[str, str]:
        """What the server's environment needs: libpq (and so both drivers) reads the password from PGPASSWORD."""
        return {"PGPASSWORD": self.password}

    @property
    def log(self) -> Path:
        return self.folder / "postgres.log"

    def start(self) -> Postgres:
        """initdb, start ``postgres`` in its own process group, and make the account and the database."""
        assert self.bindir is not None, postgres_missing()
        self.folder.mkdir(parents=True, exist_ok=True)
        as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="pipeline-postgres-")) if as_root else self.folder / "cluster"
        self.root.mkdir(exist_ok=True)
        secret = self.root / "superuser-password"
        secret.write_text(self.password)
        if as_root:
            for path in (self.root, secret):
                shutil.chown(path, POSTGRES_ACCOUNT)
        run_as = ["runuser", "-u", POSTGRES_ACCOUNT, "--"] if as_root else []
        data = str(self.root / "data")
        logins = ["--auth-host=scram-sha-256", "--auth-local=reject", f"--pwfile={secret}"]  # passwords, over TCP
        subprocess.run(
            [*run_as, str(self.bindir / "initdb"), "-D", data, "-U", "postgres", "-E", "UTF8", *logins, "--no-sync"],
            check=True,
            capture_output=True,
        )
        # TCP only (no socket folder to own); no fsync: the test's data need not survive a power cut
        settings = ["unix_socket_directories=", "fsync=off", "synchronous_commit=off", "full_page_writes=off"]
        options = [arg for setting in settings for arg in ("-c", setting)]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [*run_as, str(self.bindir / "postgres"), "-D", data, "-h", "127.0.0.1", "-p", str(self.port), *options],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_WITHIN_S
        while self.sql("SELECT 1").returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"PostgreSQL did not start on port {self.port}:\n{self.log_tail()}")
            time.sleep(0.1)
        for statement in (
            f"CREATE ROLE mlflow LOGIN PASSWORD '{self.password}'",
            "CREATE DATABASE mlflow OWNER mlflow",  # MLflow's schema migrations run as the database's owner
        ):
            done = self.sql(statement)
            if done.returncode != 0:
                raise RuntimeError(f"{statement.split(' PASSWORD')[0]}: {done.stderr.strip()}")
        return self

    def sql(self, statement: str, *, database: str = "postgres") -> subprocess.CompletedProcess[str]:
        """Run ``statement`` with ``psql`` as the superuser (over TCP, with the password)."""
        assert self.bindir is not None
        command = [str(self.bindir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"]
        return subprocess.run(
            [*command, "-d", database, "-XAtqc", statement],
            env={**os.environ, "PGPASSWORD": self.password, "PGCONNECT_TIMEOUT": "2"},
            capture_output=True,
            text=True,
            check=False,
        )

    def stop(self) -> None:
        """A fast shutdown (SIGINT: clients are disconnected), then the data folder goes."""
        process, self.process = self.process, None
        if process is not None:
            _end_group(process, signal.SIGINT)
        root, self.root = self.root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)  # a cluster folder is the test's own: nothing to keep

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"


@contextlib.contextmanager
def postgres(folder: Path) -> Iterator[Postgres]:
    """A started ``Postgres`` (its log in ``folder``), stopped and removed on exit, whatever happened."""
    db = Postgres(folder)
    try:
        yield db.start()
    finally:
        db.stop()


def _version(name: str) -> int:
    return int(name) if name.isdigit() else -1


def _account_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


class _Relay(http.server.BaseHTTPRequestHandler):
    """Passes every request on to ``upstream`` and its answer back, except that the first request whose path holds
    ``drop`` is passed on and its answer is then dropped: the connection closes, as when a server dies (or a proxy
    gives up) after the work was done and before it was reported."""

    upstream: str
    drop: str
    dropped: list[str]
    protocol_version = "HTTP/1.1"

    def _relay(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        request = urllib.request.Request(self.upstream + self.path, data=body or None, method=self.command)
        for key, value in headers.items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, answer, reply_headers = response.status, response.read(), response.getheaders()
        except urllib.error.HTTPError as refused:
            status, answer, reply_headers = refused.code, refused.read(), refused.headers.items()
        if self.drop in self.path and not self.dropped:
            self.dropped.append(self.path)
            self.close_connection = True  # done upstream, never answered here
            return
        self.send_response(status)
        for key, value in reply_headers:
            if key.lower() not in ("content-length", "connection", "transfer-encoding", "date", "server"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _relay

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def answer_lost(upstream: str, drop: str) -> Iterator[tuple[str, list[str]]]:
    """An in-process relay in front of ``upstream`` that drops the answer to the first request whose path holds
    ``drop``; yields the relay's URI and the list of what it dropped (empty until it has)."""
    handler = type("Relay", (_Relay,), {"upstream": upstream, "drop": drop, "dropped": []})
    relay = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=relay.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{relay.server_address[1]}", handler.dropped
    finally:
        relay.shutdown()
        relay.server_close()
