"""Runs left RUNNING by a process that is gone are found and closed: ``python -m pipeline.stale``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from pipeline import outbox
from pipeline.config import RunConfig
from pipeline.stale import main, process_gone
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_whose_process_is_gone_is_listed_and_closed_and_live_ones_are_left(
    make_cfg: MakeCfg, store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(store_uri)
    ids = [train(make_cfg(f"tracking.run_name=r{i}"), echo=False).run_id for i in range(3)]
    me = psutil.Process()
    process = {  # what a SIGKILLed process, this live one, and another host's would have left
        ids[0]: {"process.pid": str(dead_pid()), "process.started": "1.00"},
        ids[1]: {"process.pid": str(me.pid), "process.started": f"{me.create_time():.2f}"},
        ids[2]: {"process.host": "elsewhere", "process.pid": "1"},
    }
    for run_id, tags in process.items():
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        client.update_run(run_id, status="RUNNING")
    assert main(["--uri", store_uri]) == 0
    out = capsys.readouterr().out
    assert "3 RUNNING run(s)" in out and "1 whose process is gone" in out and "--close" in out
    assert f"gone    {ids[0]}  r0" in out and f"alive   {ids[1]}  r1" in out and f"unknown {ids[2]}  r2" in out
    assert main(["--uri", store_uri, "--close"]) == 0
    assert "marked 1 run(s) KILLED" in capsys.readouterr().out
    statuses = [client.get_run(i).info.status for i in ids]
    assert statuses == ["KILLED", "RUNNING", "RUNNING"]
    assert client.get_run(ids[0]).data.tags["closed_by"].startswith("python -m pipeline.stale: pid ")


def test_a_reused_pid_is_a_gone_process() -> None:
    me = psutil.Process()
    tags = {"process.host": os.uname().nodename, "process.pid": str(me.pid), "process.started": "12.00"}
    assert process_gone(tags, host=os.uname().nodename)[0] == "gone"
    assert process_gone({}, host="x") == ("unknown", "no process tags (recorded by an older pipeline)")


def test_a_store_that_cannot_be_reached_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--uri", f"sqlite:///{tmp_path}/missing/mlflow.db"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow
def test_a_sigkilled_training_process_leaves_a_run_that_stale_closes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "device=cpu", "trainer.epochs=500", "monitor.plots=false"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("checkpoints/*/run.lock")):  # the run is open and training has started
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    (run,) = MlflowClient(uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "RUNNING"  # what SIGKILL leaves behind
    assert main(["--uri", uri, "--close"]) == 0
    assert MlflowClient(uri).get_run(run.info.run_id).info.status == "KILLED"


def test_close_leaves_a_run_with_a_pending_outbox_file_to_its_import_and_names_it(
    make_cfg: MakeCfg, store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(store_uri)
    run_id = train(make_cfg(), echo=False).run_id
    client.set_tag(run_id, "process.pid", str(dead_pid()))
    client.update_run(run_id, status="RUNNING")  # the store was down at its end: the outbox file holds FINISHED
    run = client.get_run(run_id)
    box = outbox.Outbox(run_id, run.info.experiment_id, store_uri, "FINISHED", run.info.end_time, {}, [])
    path = outbox.save(box, outbox.fresh_path(run_id))
    assert main(["--uri", store_uri, "--close"]) == 0
    out = capsys.readouterr().out
    assert f"{run_id}: not closed: {path} holds how it ended; import it with: python -m pipeline.outbox {path}" in out
    assert "marked 0 run(s) KILLED" in out
    assert client.get_run(run_id).info.status == "RUNNING"


def test_stale_in_a_folder_without_a_store_creates_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no MLflow store at sqlite:///") and err.count("\n") == 1, err
    assert not Path("mlflow.db").exists()
