"""A team MLflow server: runs logged over HTTP and read back through its REST API, credentials from MLflow's own
environment variables, and a server that is down at the start (the run is refused before any data is loaded) or
drops mid-run (training finishes; what was not delivered goes to unsent_metrics/ and ``python -m pipeline.outbox``
restores it). One real ``mlflow server`` per module (``tests/servers.py``); runs are ``train(cfg)`` in-process.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import http.server
import importlib.util
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import requests
from mlflow.exceptions import MlflowException

import pipeline.engine.session as session_module
from pipeline.config import RunConfig
from pipeline.record import outbox
from pipeline.record.reachability import check_reachable
from pipeline.record.store import TrackingUnavailable
from pipeline.record.tracking import MlflowTracker
from pipeline.train import train
from servers import MlflowServer, free_port, mlflow_server

MakeCfg = Callable[..., RunConfig]
PASSWORD = "Sw0rdfish-9dQ2-team"  # what a user exports as MLFLOW_TRACKING_PASSWORD; must never be recorded
# Two epochs of 6 steps (the digits' 1,437 training images in batches of 256), train/loss at every step.
TWO_EPOCHS = ["trainer.epochs=2", "trainer.max_steps=-1", "loader.batch_size=256", "trainer.log_every_n_steps=1"]
STEPS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One server for the module, without authentication (it ignores credentials, as such a server does), that
    answers API calls addressed to 127.0.0.1:<port> only (--allowed-hosts)."""
    port = free_port()
    with mlflow_server(
        tmp_path_factory.mktemp("server"), extra=["--allowed-hosts", f"127.0.0.1:{port}"], port=port
    ) as started:
        yield started


@pytest.fixture
def fail_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's own default (two quick retries, about 3 s a write; see the test below) would still add tens of
    seconds to a test whose server is down for several writes: here a dead server fails at once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def test_a_down_server_costs_seconds_per_write_not_mlflows_minutes_unless_you_chose(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pipeline.config import TrackingConfig
    from pipeline.record.lifecycle import open_tracker
    from pipeline.record.outage import HTTP_RETRIES

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    cfg = TrackingConfig(enabled=True, uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="unit")
    with open_tracker(cfg, run_name="r"):
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == str(HTTP_RETRIES) == "2"
        assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"  # pauses of 1 s and 2 s
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "10"  # a hung server: 10 s a try, not MLflow's 120
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "9")
    with open_tracker(cfg, run_name="r"):
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "9"  # a user's own setting is kept


def steps(history: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in history]


@pytest.mark.slow
def test_a_run_logged_over_http_reads_back_through_the_rest_api(server: MlflowServer, make_cfg: MakeCfg) -> None:
    result = train(make_cfg(f"tracking.uri={server.uri}", *TWO_EPOCHS, tiny=False), echo=False)
    run = server.rest("runs/get", run_id=result.run_id)["run"]
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["loader.batch_size"] == "256" and params["tracking.uri"] == server.uri
    assert result.steps == STEPS and steps(server.metric_history(result.run_id, "train/loss")) == list(range(1, 13))
    assert steps(server.metric_history(result.run_id, "val/acc")) == [1, 2]
    artifacts = {f["path"] for f in server.rest("artifacts/list", run_id=result.run_id)["files"]}
    assert {"config.yaml", "overrides.txt", "environment.json", "plots"} <= artifacts
    assert (server.folder / "artifacts").is_dir()  # uploaded through the server (--artifacts-destination)
    assert not Path("mlruns").exists() and not Path("mlflow.db").exists()  # nothing was written beside the run


@pytest.mark.slow
def test_credentials_from_mlflows_variables_appear_nowhere_in_the_store_or_the_output(
    server: MlflowServer,
    make_cfg: MakeCfg,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    with caplog.at_level(logging.DEBUG):
        result = train(make_cfg(f"tracking.uri={server.uri}"), echo=True)
    out, err = capsys.readouterr()
    assert f"MLflow run {result.run_id} in experiment 'pipeline' ({server.uri})" in out
    assert server.rest("runs/get", run_id=result.run_id)["run"]["info"]["status"] == "FINISHED"
    assert PASSWORD not in out + err + caplog.text
    assert server.files_containing(PASSWORD) == []  # mlflow.db and every artifact (environment.json included)


@pytest.mark.slow
def test_an_address_the_servers_allowed_hosts_does_not_list_is_refused_before_any_data_is_loaded(
    server: MlflowServer, make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_module, "build", lambda cfg, *a, **k: pytest.fail("data and model were built"))
    uri = f"http://localhost:{server.port}"  # the same server, by a name its --allowed-hosts leaves out
    with pytest.raises(TrackingUnavailable) as err:
        train(make_cfg(f"tracking.uri={uri}"), echo=False)
    assert str(err.value) == (
        f"tracking.uri={uri} refused the request (HTTP 403: Invalid Host header - possible DNS rebinding attack "
        f"detected): the server's --allowed-hosts must list localhost:{server.port}, the address this run uses, and "
        f"the account must be allowed to read experiments"
    )


def test_a_server_nobody_listens_on_refuses_the_run_before_any_data_is_loaded(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setattr(session_module, "build", lambda cfg, *a, **k: pytest.fail("data and model were built"))
    with pytest.raises(TrackingUnavailable) as err:
        train(make_cfg(f"tracking.uri=http://127.0.0.1:{port}"), echo=False)
    message = str(err.value)
    assert message.startswith(f"tracking.uri=http://127.0.0.1:{port} cannot be reached (")
    assert f"start the server (mlflow server --port {port})" in message and "\n" not in message
    assert not Path("unsent_metrics").exists() and not Path("mlruns").exists()


class Outage:
    """Stops ``server`` when the loop logs the first ``train/loss`` of epoch 2 (after epoch 1's metrics were
    written by the flush that ends it): the step where the outage begins, deterministically, with no sleeping."""

    def __init__(self, server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.server, self.step = server, None
        log_metrics = MlflowTracker.log_metrics
        epoch_ended = False

        def log_and_maybe_stop(tracker: MlflowTracker, metrics: Mapping[str, float], step: int) -> None:
            nonlocal epoch_ended
            epoch_ended = epoch_ended or "val/acc" in metrics
            if epoch_ended and "train/loss" in metrics and self.step is None:
                self.step = step
                server.stop()
            log_metrics(tracker, metrics, step)

        monkeypatch.setattr(MlflowTracker, "log_metrics", log_and_maybe_stop)


@pytest.mark.slow
@pytest.mark.usefixtures("fail_fast")
def test_a_server_that_drops_mid_run_loses_no_training_and_the_outbox_restores_every_metric(
    server: MlflowServer,
    make_cfg: MakeCfg,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = Outage(server, monkeypatch)
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline.record.tracking"):
            result = train(make_cfg(f"tracking.uri={server.uri}", *TWO_EPOCHS, tiny=False), echo=False)
        assert outage.step == STEPS // 2 + 1 and result.steps == STEPS and len(result.epochs) == 2  # trained to the end

        path = Path("unsent_metrics") / f"{result.run_id}.jsonl"
        command = f"python -m pipeline.outbox {path}"
        assert f"import the unsent metrics into MLflow with: {command}\n" in capsys.readouterr().err
        assert f"are kept in {path} until they are imported" in caplog.text
        assert "artifact plots/step_time.png could not be written" in caplog.text  # a warning, not a failed run
        header, *points = (json.loads(line) for line in path.read_text().splitlines())
        assert header["tracking_uri"] == server.uri and header["status"] == "FINISHED"
        assert {"bottleneck", "mlflow.note.content"} <= set(header["tags"])  # set while the server was down
        unsent = [p["step"] for p in points if p["key"] == "train/loss"]
        assert unsent == list(range(outage.step, STEPS + 1))
        assert [p["step"] for p in points if p["key"] == "val/acc"] == [2]

        server.start()  # the same port and store: the URI in the file's header works as it is
        run_id = result.run_id
        assert server.rest("runs/get", run_id=run_id)["run"]["info"]["status"] == "RUNNING"  # until imported
        assert steps(server.metric_history(run_id, "train/loss")) == list(range(1, outage.step))
    finally:
        if not server.healthy():
            server.start()  # the next tests share this server

    assert outbox.main([str(path)]) == 0
    assert f"sent {len(points)} metrics to their run" in capsys.readouterr().out
    run = server.rest("runs/get", run_id=run_id)["run"]
    assert run["info"]["status"] == "FINISHED" and int(run["info"]["end_time"]) == header["end_time"]
    assert steps(server.metric_history(run_id, "train/loss")) == list(range(1, STEPS + 1))  # each step once
    assert server.metric_history(run_id, "val/acc") == [(1, result.epochs[0].val_acc), (2, result.epochs[1].val_acc)]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["bottleneck"] == result.bottleneck and f"run {result.run_name}:" in tags["mlflow.note.content"]


class DownClient:
    """An ``MlflowClient`` whose server is down for every write (``fatal``: a different, real failure instead)."""

    def __init__(self, fatal: Exception | None = None) -> None:
        self.error = fatal or requests.exceptions.ConnectionError("Failed to establish a new connection")

    def __getattr__(self, name: str) -> Callable[..., None]:
        def down(*args: Any, **kwargs: Any) -> None:
            raise MlflowException(f"API request failed with exception {self.error}") from self.error

        return down


def test_tags_and_artifacts_written_while_the_server_is_down_do_not_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from matplotlib.figure import Figure

    tracker = MlflowTracker(DownClient(), uri="http://127.0.0.1:1", experiment_id="1", experiment="e", run_id="r1")
    with caplog.at_level(logging.WARNING, logger="pipeline.record.tracking"):
        tracker.set_tags({"bottleneck": "compute"})
        tracker.log_text("a: 1\n", "config.yaml")
        tracker.log_figure(Figure, "plots/step_time.png")
        path = tracker.end("FINISHED", tags={"mlflow.note.content": "the summary"})
    assert path is not None and outbox.load(path).tags == {
        "bottleneck": "compute",
        "mlflow.note.content": "the summary",
    }
    assert (
        "config.yaml could not be written" in caplog.text and "plots/step_time.png could not be written" in caplog.text
    )


@pytest.mark.parametrize("write", ["set_tags", "log_text"])
def test_a_write_that_fails_for_another_reason_than_a_down_server_still_raises(write: str) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    tracker = MlflowTracker(DownClient(fatal=full), uri="sqlite:///x.db", experiment_id="1", experiment="e", run_id="r")
    with pytest.raises(MlflowException, match="No space left"):
        tracker.set_tags({"a": "b"}) if write == "set_tags" else tracker.log_text("x", "x.txt")


class AuthServer(http.server.BaseHTTPRequestHandler):
    """Answers like ``mlflow server --app-name basic-auth``: /health to anyone, the API to alice:PASSWORD only."""

    def do_GET(self) -> None:
        accepted = ("Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode(), f"Bearer {PASSWORD}")
        if self.path == "/health" or self.headers.get("Authorization") in accepted:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}" if self.path != "/health" else b"OK")
        else:
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b"You are not authenticated. Please see https://www.mlflow.org/docs/latest/auth/")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def auth_stub() -> Iterator[str]:
    """The URI of an in-process stand-in for an authenticating MLflow server (milliseconds, no Flask-WTF needed)."""
    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AuthServer)
    thread = threading.Thread(target=stub.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{stub.server_address[1]}"
    finally:
        stub.shutdown()
        stub.server_close()


@pytest.mark.parametrize(
    ("username", "password"), [(None, None), ("alice", "wrong-password"), ("mallory", PASSWORD)], ids=str
)
def test_credentials_the_server_refuses_fail_at_the_start_in_one_line(
    auth_stub: str, monkeypatch: pytest.MonkeyPatch, username: str | None, password: str | None
) -> None:
    for name, value in (("MLFLOW_TRACKING_USERNAME", username), ("MLFLOW_TRACKING_PASSWORD", password)):
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name, raising=False)
    with pytest.raises(TrackingUnavailable) as err:
        check_reachable(auth_stub)
    message = str(err.value)
    assert message.startswith(f"tracking.uri={auth_stub} refused the credentials (HTTP 401: You are not authenticated")
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in message and "\n" not in message
    assert PASSWORD not in message


def test_credentials_the_server_takes_pass_the_start_check(auth_stub: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    check_reachable(auth_stub)
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    check_reachable(auth_stub.replace("http://", f"http://alice:{PASSWORD}@"))  # or in the URI, as MLflow allows
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", PASSWORD)
    check_reachable(auth_stub)  # or a token, sent as a Bearer token


needs_auth_app = pytest.mark.skipif(
    importlib.util.find_spec("flask_wtf") is None,
    reason="mlflow server --app-name basic-auth needs Flask-WTF (pip install 'mlflow[auth]')",
)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A server with MLflow's basic-auth app, whose first start makes the account admin / PASSWORD."""
    folder = tmp_path_factory.mktemp("auth-server")
    env = {"MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD, "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-only-csrf-key"}
    with mlflow_server(folder, extra=["--app-name", "basic-auth"], env=env, credentials=("admin", PASSWORD)) as started:
        yield started


@pytest.mark.slow
@needs_auth_app
def test_a_basic_auth_server_takes_the_runs_credentials_from_the_environment_and_refuses_wrong_ones(
    auth_server: MlflowServer,
    make_cfg: MakeCfg,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with monkeypatch.context() as wrong:
        wrong.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        wrong.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
        wrong.setattr(session_module, "build", lambda cfg, *a, **k: pytest.fail("data and model were built"))
        with pytest.raises(TrackingUnavailable, match=r"refused the credentials \(HTTP 401: You are not authentic"):
            train(make_cfg(f"tracking.uri={auth_server.uri}"), echo=False)

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    result = train(make_cfg(f"tracking.uri={auth_server.uri}"), echo=True)
    assert auth_server.rest("runs/get", run_id=result.run_id)["run"]["info"]["status"] == "FINISHED"
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err
    assert auth_server.files_containing(PASSWORD) == []  # basic_auth.db holds a salted hash, not the password


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HungServer:
    """A server that stopped answering: every call costs ``CALL_BOUND_S`` on the fake clock (MLflow's tries, each to
    its timeout) and fails as a down server does."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.calls = clock, 0

    def __getattr__(self, name: str) -> Callable[..., None]:
        from pipeline.record.outage import CALL_BOUND_S

        def hung(*args: Any, **kwargs: Any) -> None:
            self.clock.now += CALL_BOUND_S
            self.calls += 1
            error = requests.exceptions.ReadTimeout("Read timed out. (read timeout=10)")
            raise MlflowException(f"API request failed with exception {error}") from error

        return hung


def test_a_server_that_stops_answering_costs_the_run_at_most_the_deadline_and_the_outbox_keeps_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Twenty epochs after the server hung, each with its flush, tags and a plot, then the run's end: the training
    thread's waiting is bounded by the clock (at most 60 s), not by MLflow's retries of every write (the run used
    to pay each write's retries: 45 s on a quiet machine, 379 s on a busy one)."""
    from pipeline.record.outage import CALL_BOUND_S, DEADLINE_S, Outage

    monkeypatch.chdir(tmp_path)
    clock = FakeClock()
    server = HungServer(clock)
    tracker = MlflowTracker(server, uri="http://127.0.0.1:1", experiment_id="1", experiment="e", run_id="r1")
    tracker._outage = Outage(clock=clock)
    started = clock.now
    with caplog.at_level(logging.WARNING, logger="pipeline.record.tracking"):
        for epoch in range(1, 21):
            tracker.log_metrics({"train/loss": 1.0 / epoch}, step=epoch)
            tracker.flush()
            tracker.set_tags({"epoch": str(epoch)})
            tracker.log_text("a: 1\n", f"epoch{epoch}.txt")
        path = tracker.end("FINISHED", tags={"mlflow.note.content": "the summary"})
    assert DEADLINE_S + CALL_BOUND_S <= 60
    assert clock.now - started <= DEADLINE_S + CALL_BOUND_S, f"{server.calls} calls"
    assert path is not None
    kept = outbox.load(path)
    assert [p.step for p in kept.points] == list(range(1, 21)) and kept.status == "FINISHED"
    assert kept.tags == {"epoch": "20", "mlflow.note.content": "the summary"}


@contextlib.contextmanager
def silent_server() -> Iterator[tuple[str, list[socket.socket]]]:
    """A local socket that accepts every connection and never answers: a hung server. Yields its URI and the
    connections it took (one per request MLflow made)."""
    listener = socket.create_server(("127.0.0.1", 0))
    taken: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end
            while True:
                taken.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", taken
    finally:
        listener.close()
        for conn in taken:
            conn.close()


@pytest.mark.slow
def test_a_hung_real_server_is_asked_no_more_once_the_deadline_has_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real MlflowClient against a socket that never answers (1 s a request, no retries, a 2.5 s deadline): ten
    flushes make a few requests, not ten, and the outbox holds every point."""
    from mlflow import MlflowClient

    from pipeline.record.outage import Outage

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with silent_server() as (uri, taken):
        tracker = MlflowTracker(MlflowClient(uri), uri=uri, experiment_id="1", experiment="e", run_id="r1")
        tracker._outage = Outage(deadline_s=2.5)
        for step in range(1, 11):
            tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
            tracker.flush()
        path = tracker.end("FINISHED", tags={"mlflow.note.content": "the summary"})
        asked = len(taken)
    assert 1 <= asked < 10
    assert path is not None and [p.step for p in outbox.load(path).points] == list(range(1, 11))
