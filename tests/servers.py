"""A real ``mlflow server`` for tests, on 127.0.0.1 and a free port, with its own store in a folder.

    with mlflow_server(tmp_path / "server") as server:
        train(make_cfg(f"tracking.uri={server.uri}"))
        server.rest("runs/get", run_id=...)

One start costs about 5 s on two CPU cores (most of it the server's imports and, on a new store, MLflow's schema
migration), so modules share one server through a module-scoped fixture. ``stop()`` and ``start()`` take it down and
bring it back on the same port and the same store, as a team server that restarts would.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
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


def server_command(folder: Path, port: int, *extra: str) -> list[str]:
    """The command the README shows for one person's server: SQLite store, artifacts served by the server itself
    (``--artifacts-destination``, uploaded over HTTP), bound to 127.0.0.1."""
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
        f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--workers",
        "1",
        *extra,
    ]


class MlflowServer:
    """One ``mlflow server`` process group; ``folder`` holds its store, its artifacts and its log (``server.log``)."""

    def __init__(
        self,
        folder: Path,
        *,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        credentials: tuple[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.folder, self.extra, self.credentials = folder, list(extra), credentials
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
                server_command(self.folder, self.port, *self.extra),
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
        if process is None:
            return
        group = process.pid  # start_new_session: the group's id is the leader's pid
        _signal_group(group, signal.SIGTERM)
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
) -> Iterator[MlflowServer]:
    """A started server with its store in ``folder`` (on ``port``, else a free one); stopped on exit, whatever
    happened. ``env`` adds to the server's environment (MLFLOW_TRACKING_* variables are never passed on);
    ``credentials`` are sent by ``rest()``."""
    server = MlflowServer(folder, extra=extra, env=env, credentials=credentials, port=port)
    try:
        yield server.start()
    finally:
        server.stop()


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
