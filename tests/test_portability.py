"""What Windows and macOS users hit and Linux CI does not: spawned loader workers, drive letters and backslashes in
SQLite URIs, Ctrl-Break. Windows paths are tested as ``PureWindowsPath`` values and other platforms' signals
through a patched ``signal`` module, so these run, and mean the same, on whatever OS runs the suite."""

from __future__ import annotations

import multiprocessing
import ntpath
import nturl2path
import signal
import sqlite3
import sys
import types
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest
import torch
from sqlalchemy.engine import make_url

from pipeline.autotune.candidates import Machine, candidates
from pipeline.common.errors import ConfigError
from pipeline.common.uris import absolute, sqlite_database, sqlite_file_uri, sqlite_uri, uri_scheme
from pipeline.config import RunConfig, flatten, load
from pipeline.engine.checkpointing.resume import check_resumable, config_changes
from pipeline.engine.stopping import Stopped, StopRequests, stop_signals
from pipeline.record.reachability import check_reachable
from pipeline.record.store import TrackingUnavailable
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]
WORKERS = ["loader=workers", "loader.num_workers=1"]


# loader.multiprocessing_context


def test_the_start_method_is_auto_by_default_and_any_the_platform_has_can_be_named() -> None:
    assert load().loader.multiprocessing_context == "auto" and load(WORKERS).loader.multiprocessing_context == "auto"
    for method in multiprocessing.get_all_start_methods():
        assert load([*WORKERS, f"loader.multiprocessing_context={method}"]).loader.multiprocessing_context == method


def test_a_named_start_method_without_workers_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"^loader\.multiprocessing_context='spawn' .* auto with loader\.num_workers=0"
    ):
        load(["loader.multiprocessing_context=spawn"])
    with pytest.raises(ConfigError, match=r"^loader\.multiprocessing_context='spawn' .* auto with loader\.num_workers"):
        load(["loader=resident", "loader.multiprocessing_context=spawn"])


def test_a_start_method_that_is_no_start_method_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"'threads' .* one of 'auto', 'fork', 'spawn', 'forkserver'"):
        load([*WORKERS, "loader.multiprocessing_context=threads"])


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_start_method_windows_lacks_is_refused_there_listing_the_ones_it_has(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # what Windows lists
    monkeypatch.setattr("pipeline.config.schema.sys.platform", "win32")
    with pytest.raises(
        ConfigError,
        match=rf"^loader\.multiprocessing_context='{method}' is not allowed: expected auto or a start method this "
        rf"platform \(win32\) has: spawn$",
    ):
        load([*WORKERS, f"loader.multiprocessing_context={method}"])
    assert load([*WORKERS, "loader.multiprocessing_context=spawn"]).loader.multiprocessing_context == "spawn"


def test_the_start_method_is_recorded_and_a_resume_may_change_it() -> None:
    cfg = load([*WORKERS, "loader.multiprocessing_context=spawn"])
    assert flatten(cfg.to_dict())["loader.multiprocessing_context"] == "spawn"  # what record.py logs as params
    check_resumable({"loader.multiprocessing_context": ("auto", "spawn")}, fork=False, run="r1")  # no raise
    # a checkpoint written before the key existed compares as auto: no change reported
    before = {k: v for k, v in flatten(load(WORKERS).to_dict()).items() if k != "loader.multiprocessing_context"}
    assert config_changes(before, flatten(load(WORKERS).to_dict())) == {}
    assert config_changes(before, flatten(cfg.to_dict())) == {"loader.multiprocessing_context": ("auto", "spawn")}


def test_autotune_keeps_a_named_start_method_for_its_worker_candidates_only() -> None:
    current = load([*WORKERS, "loader.multiprocessing_context=spawn"]).loader
    found = candidates(current, Machine(device_type="cpu", max_workers=2, resident_fits=True))  # each one check()ed
    methods = {(c.loader.resident, c.loader.num_workers): c.loader.multiprocessing_context for c in found}
    assert methods == {(False, 1): "spawn", (True, 0): "auto", (False, 0): "auto", (False, 2): "spawn"}


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()])


@pytest.mark.slow
def test_a_run_with_spawned_workers_finishes_records_the_method_and_trains_what_the_main_process_trains(
    make_cfg: MakeCfg, store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What every Windows and macOS user runs with loader.num_workers > 0. Costs two worker starts (train and
    val), each importing torch afresh: ~10 s on 2 CPUs with the in-process run to compare with."""
    from mlflow import MlflowClient

    started: list[str] = []
    start = SpawnProcess.start
    monkeypatch.setattr(SpawnProcess, "start", lambda self: (started.append(self.name), start(self))[1])
    spawned = train(make_cfg(*WORKERS, "loader.multiprocessing_context=spawn"), echo=False)
    assert len(started) == 2  # one worker for the training batches, one for validation: spawned, not forked
    run = MlflowClient(store_uri).get_run(spawned.run_id)
    assert run.info.status == "FINISHED" and spawned.steps == 3
    assert run.data.params["loader.multiprocessing_context"] == "spawn" and run.data.params["loader.num_workers"] == "1"
    in_process = train(make_cfg("tracking=none"), echo=False)
    assert torch.equal(weights(spawned.model), weights(in_process.model))  # the same batches, in the same order


# SQLite URIs on Windows

WINDOWS_PROJECT = PureWindowsPath(r"C:\Users\me\proj")


def mlflow_windows_sqlite_uri(path: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """MLflow's own ``path_to_local_sqlite_uri`` as it runs on Windows (its os.path, url functions and platform)."""
    from mlflow.utils import file_utils

    monkeypatch.setattr(file_utils, "os", types.SimpleNamespace(path=ntpath))
    monkeypatch.setattr(file_utils, "pathname2url", nturl2path.pathname2url)
    monkeypatch.setattr(file_utils, "sys", types.SimpleNamespace(platform="win32"))
    return file_utils.path_to_local_sqlite_uri(path)


@pytest.mark.parametrize(
    ("uri", "database"),
    [
        ("sqlite:///mlflow.db", r"C:\Users\me\proj\mlflow.db"),
        ("sqlite:///runs/mlflow.db", r"C:\Users\me\proj\runs\mlflow.db"),
        (r"sqlite:///runs\mlflow.db", r"C:\Users\me\proj\runs\mlflow.db"),  # typed with a backslash
        ("sqlite:////mlflow.db", r"C:\mlflow.db"),  # rooted but no drive: the current drive's root
    ],
)
def test_a_relative_sqlite_uri_on_windows_becomes_the_uri_mlflow_writes_and_reads_back_as_the_path(
    uri: str, database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = absolute(uri, cwd=WINDOWS_PROJECT)
    assert made == "sqlite:///" + database.replace("\\", "/")  # sqlite:///C:/Users/me/proj/mlflow.db
    assert made == mlflow_windows_sqlite_uri(database, monkeypatch)
    assert PureWindowsPath(sqlite_database(made)) == PureWindowsPath(database)  # store.sqlite_path's reading
    assert PureWindowsPath(make_url(made).database) == PureWindowsPath(database)  # what SQLAlchemy opens
    assert absolute(made, cwd=WINDOWS_PROJECT) == made  # already absolute: kept as it is


@pytest.mark.parametrize("uri", ["sqlite:///C:/data/mlflow.db", r"sqlite:///D:\data\mlflow.db"])
def test_an_absolute_windows_sqlite_uri_is_kept_as_typed(uri: str) -> None:
    assert absolute(uri, cwd=WINDOWS_PROJECT) == uri
    assert PureWindowsPath(sqlite_database(uri)).is_absolute()


def test_a_database_on_a_windows_share_keeps_its_server_in_the_uri() -> None:
    share = PureWindowsPath(r"\\server\share\runs\mlflow.db")
    uri = sqlite_uri(share)
    assert uri == "sqlite://///server/share/runs/mlflow.db"
    assert PureWindowsPath(sqlite_database(uri)) == share and PureWindowsPath(make_url(uri).database) == share
    assert sqlite_file_uri(share) == "file:////server/share/runs/mlflow.db?mode=ro"  # no host in the authority


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX paths")
def test_sqlite_uris_on_posix_are_what_they_were() -> None:
    """The form checkpoints recorded their store in (state.json) before Windows paths were handled: unchanged."""
    assert absolute("sqlite:///mlflow.db", cwd=PurePosixPath("/home/me/proj")) == "sqlite:////home/me/proj/mlflow.db"
    assert absolute("sqlite:///mlflow.db") == f"sqlite:///{Path('mlflow.db').resolve()}"


def test_sqlite_file_uris_put_a_windows_drive_after_the_empty_authority() -> None:
    assert sqlite_file_uri(PureWindowsPath(r"C:\Users\me\mlflow.db")) == "file:///C:/Users/me/mlflow.db?mode=ro"
    assert sqlite_file_uri(PurePosixPath("/home/me/my runs/mlflow.db")) == "file:///home/me/my%20runs/mlflow.db?mode=ro"


@pytest.mark.parametrize(
    "name",
    [
        "jo smith/mlflow.db",
        "100%/mlflow.db",
        "runs#1/mlflow.db",
        pytest.param("what?/mlflow.db", marks=pytest.mark.skipif(sys.platform == "win32", reason="no ? in names")),
    ],
)
def test_unusual_characters_in_a_database_path_survive_the_round_trip(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.parent.mkdir()
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x)")
    uri = sqlite_uri(path)
    assert Path(sqlite_database(uri) or "") == path == Path(make_url(uri).database or "")
    with sqlite3.connect(sqlite_file_uri(path), uri=True) as db:  # the read-only look store.py takes
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("t",)]


def test_a_windows_path_as_tracking_uri_is_a_plain_path_not_a_scheme_named_c(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert uri_scheme(r"C:\Users\me\mlruns") == "" and uri_scheme("sqlite:///C:/x.db") == "sqlite"
    with pytest.raises(TrackingUnavailable, match=r"is a plain path, not a URI: MLflow's file store"):
        check_reachable(r"C:\Users\me\mlruns")


# Stop signals


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        pytest.param({"SIGTERM": 15, "SIGINT": 2}, [15, 2], id="linux-macos"),
        pytest.param({"SIGTERM": 15, "SIGINT": 2, "SIGBREAK": 21}, [15, 2, 21], id="windows"),  # 21: Ctrl-Break
    ],
)
def test_stop_requests_handle_the_stop_signals_the_platform_has(
    present: dict[str, int], expected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SIGTERM", "SIGINT", "SIGBREAK"):
        if name in present:
            monkeypatch.setattr(signal, name, present[name], raising=False)
        else:
            monkeypatch.delattr(signal, name, raising=False)
    installed: list[int] = []
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.append(signum) or signal.SIG_DFL)
    assert list(stop_signals()) == expected
    with StopRequests():
        assert installed == expected
    assert installed == expected * 2  # each one's previous handler put back


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="Windows has no SIGUSR1 to play SIGBREAK")
def test_ctrl_break_is_a_stop_request_and_exits_128_plus_its_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGBREAK played by SIGUSR1, a signal Linux delivers: the handler is really installed, fired and removed."""
    monkeypatch.setattr(signal, "SIGBREAK", signal.SIGUSR1, raising=False)
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequests() as stop:
        signal.raise_signal(signal.SIGUSR1)
        assert stop.requested() and stop.signum == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before
    assert Stopped(21).exit_code == 149 and Stopped(signal.SIGTERM).exit_code == 143  # 21: SIGBREAK on Windows
    assert str(Stopped(99)) == "stopped by signal 99 at a step boundary"  # a number this platform has no name for
