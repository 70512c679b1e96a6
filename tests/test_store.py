"""The MLflow store under concurrency and failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.secrets import mask_text
from pipeline.store import TrackingUnavailable, check_reachable, retrying, sqlite_path, store_lock
from test_cli import run_main


def test_sqlite_paths_are_read_from_the_uri() -> None:
    assert sqlite_path("sqlite:///mlflow.db") == Path("mlflow.db")
    assert sqlite_path("sqlite:////tmp/runs/mlflow.db") == Path("/tmp/runs/mlflow.db")
    assert sqlite_path("http://127.0.0.1:5000") is None and sqlite_path("sqlite:///:memory:") is None


def test_database_is_locked_is_retried_and_other_errors_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.store.time.sleep", lambda s: None)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "written"

    assert retrying(flaky) == "written" and len(calls) == 3
    calls.clear()

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("no such table: runs")

    with pytest.raises(RuntimeError, match="no such table"):
        retrying(broken)
    assert len(calls) == 1


def test_a_store_that_stays_locked_gives_up_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.store.time.sleep", lambda s: None)

    def locked() -> None:
        raise RuntimeError("database is locked")

    with pytest.raises(RuntimeError, match="database is locked"):
        retrying(locked)


def test_an_unreachable_server_fails_fast_with_the_remedy() -> None:
    with pytest.raises(TrackingUnavailable, match=r"tracking.uri=http://127.0.0.1:9 cannot be reached .*mlflow server"):
        check_reachable("http://127.0.0.1:9", timeout_s=2)


def test_a_sqlite_store_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TrackingUnavailable, match="does not exist"):
        check_reachable(f"sqlite:///{tmp_path / 'nowhere' / 'mlflow.db'}")
    check_reachable(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the file itself may be missing


def test_the_cli_refuses_an_unreachable_tracking_uri_before_loading_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(monkeypatch, "device=cpu", "tracking.uri=http://user:secret@127.0.0.1:9") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tracking.uri=http://user:***@127.0.0.1:9 cannot be reached") and "secret" not in err


def test_credentials_in_uris_are_redacted() -> None:
    assert mask_text("https://alice:s3cr3t@mlflow.example.org") == "https://alice:***@mlflow.example.org"
    assert mask_text("sqlite:///mlflow.db") == "sqlite:///mlflow.db"


def test_the_store_lock_sits_beside_the_database(tmp_path: Path) -> None:
    with store_lock(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        assert (tmp_path / "mlflow.db.lock").exists()


@pytest.mark.slow
def test_four_processes_starting_together_on_a_fresh_store_all_land_their_runs(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    args = [
        "trainer.epochs=1",
        "trainer.max_steps=2",
        "device=cpu",
        "tracking.experiment=together",
        "monitor.plots=false",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args, f"tracking.run_name=job{i}", f"hydra.run.dir=outputs/{i}"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert [code for code, _ in results] == [0, 0, 0, 0], [err[-2000:] for _, err in results]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("together")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["job0", "job1", "job2", "job3"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert len(client.search_experiments()) == 2  # Default and "together": no duplicate experiments
