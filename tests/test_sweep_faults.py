"""Sweeps that meet a fault outside any one job: a launcher that loses its worker processes, a sweep folder that
cannot be made, a sweeper or launcher that cannot work here. Each ends in one line and no run left RUNNING."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from helpers import run_main

TINY = ["trainer.epochs=1", "trainer.max_steps=2", "monitor.plots=false", "device=cpu"]


def all_runs(tmp_path: Path) -> tuple[Any, list[Any]]:
    """The one sweep's parent run and its jobs' runs, by job number."""
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    (parent,) = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    children = [r for r in runs if r is not parent]
    return parent, sorted(children, key=lambda r: int(r.data.tags["sweep.job"]))


def outcomes(tmp_path: Path) -> dict[int, dict[str, Any]]:
    (folder,) = tmp_path.glob("multirun/*/*")
    return {int(p.stem): json.loads(p.read_text()) for p in (folder / "jobs").glob("*.json")}


def lose_two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """joblib's launch as it ends when loky loses a worker: the first two jobs had started (each made its run and
    its marker), loky killed both processes, jobs 3 and 4 never started, and Parallel raised."""
    from hydra_plugins.hydra_joblib_launcher import _core
    from joblib.externals.loky.process_executor import TerminatedWorkerError

    from pipeline.experiments import sweep

    def launch(launcher: Any, job_overrides: Any, initial_job_idx: int) -> Any:
        folder = Path(str(launcher.config.hydra.runtime.cwd), str(launcher.config.hydra.sweep.dir))
        info = sweep.Sweep.load(folder)
        assert info is not None and info.parent_run_id
        client = MlflowClient(info.uri)
        for number in (0, 1):
            job = sweep.SweepJob(info, number, tuple(job_overrides[number]), folder)
            sweep.started(job)
            client.create_run(info.experiment_id, run_name=f"job{number}", tags=job.tags())  # left RUNNING
        raise TerminatedWorkerError(
            "A worker process managed by the executor was unexpectedly terminated. This could be caused by a "
            "segmentation fault while calling the function or by an excessive memory usage causing the Operating "
            "System to kill the worker.\n\nThe exit codes of the workers are {SIGKILL(-9)}"
        )

    monkeypatch.setattr(_core, "launch", launch)


def test_a_lost_worker_ends_every_run_and_lists_lost_and_unstarted_jobs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lose_two_workers(monkeypatch)
    assert run_main(monkeypatch, "-m", "hydra/launcher=parallel", "trainer.seed=1,2,3,4", *TINY) == 1
    parent, children = all_runs(tmp_path)
    assert [(r.info.run_name, r.info.status) for r in children] == [("job0", "FAILED"), ("job1", "FAILED")]
    assert all("a worker process of the parallel launcher died" in r.data.tags["error"] for r in children)
    assert parent.info.status == "FAILED"
    assert (parent.data.tags["sweep.failed"], parent.data.tags["sweep.not_run"]) == ("2", "2")
    assert parent.data.tags["sweep.failures"].startswith("job #0 (trainer.seed=1 ")
    assert [(o["status"], o["exit_code"]) for _, o in sorted(outcomes(tmp_path).items())] == [
        ("FAILED", 1),
        ("FAILED", 1),
        ("NOT_RUN", 0),
        ("NOT_RUN", 0),
    ]
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "TerminatedWorkerError" not in captured.err
    assert "4 job(s), 0 finished, 2 failed, 2 not run" in captured.out
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors == ["error: 2 of 4 sweep job(s) failed and 2 did not run:"]
    assert "  not run: job #2 (trainer.seed=3 " in captured.err


@pytest.mark.slow
def test_killing_one_parallel_worker_leaves_no_run_running(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "CUDA_VISIBLE_DEVICES")}
    args = ["-m", "hydra/launcher=parallel", "trainer.seed=1,2,3,4", "data=synthetic", "data.num_samples=4000"]
    args += ["trainer.epochs=50", "monitor.plots=false", "device=cpu"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    pids: set[str] = set()
    try:
        while len(pids) < 2 and proc.poll() is None:  # both workers have a run: kill one of them
            time.sleep(1)
            if (tmp_path / "mlflow.db").exists():
                runs = [r for r in client.search_runs(experiment_ids=["1"]) if "sweep.job" in r.data.tags]
                pids = {r.data.tags.get("process.pid", "") for r in runs} - {""}
        assert len(pids) == 2, proc.communicate()[1][-3000:]
        os.kill(int(min(pids)), signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    parent, children = all_runs(tmp_path)
    assert [r.info.status for r in children] == ["FAILED", "FAILED"] and parent.info.status == "FAILED"
    assert (parent.data.tags["sweep.failed"], parent.data.tags["sweep.not_run"]) == ("2", "2")
    assert b"Traceback" not in err and b"4 job(s), 0 finished, 2 failed, 2 not run" in out


@pytest.mark.parametrize(
    ("mode", "key"), [(["-m", "optimizer.lr=0.01,0.02"], "hydra.sweep.dir"), ([], "hydra.run.dir")]
)
def test_an_output_folder_through_a_file_is_one_line_and_leaves_no_run_open(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, mode: list[str], key: str
) -> None:
    (tmp_path / "afile").write_text("not a folder")
    assert run_main(monkeypatch, *mode, f"{key}=afile/sub", *TINY) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}='afile/sub' is not allowed: expected a folder that can be made and written")
    assert "Not a directory" in err and err.count("\n") == 1
    if (tmp_path / "mlflow.db").exists():  # the store may exist; no run in it may be left RUNNING
        runs = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["0", "1"])
        assert [r.info.status for r in runs if r.info.status == "RUNNING"] == []


def test_an_output_folder_that_cannot_be_written_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:  # a read-only working folder (root ignores chmod)
        if self.is_relative_to(tmp_path / "outputs") or self == tmp_path / "outputs":
            raise PermissionError(13, "Permission denied", "outputs")
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert run_main(monkeypatch, "hydra.job.chdir=false", *TINY) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hydra.run.dir='outputs/") and "(Permission denied: outputs); launch from" in err
    assert err.count("\n") == 1


def test_a_stopped_sequential_sweep_lists_the_jobs_it_never_started_as_not_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from helpers import sigterm_at_step

    sigterm_at_step(monkeypatch, 1)  # during job 0's first step
    args = ["trainer.epochs=1", "trainer.max_steps=3", "monitor.plots=false", "device=cpu"]
    assert run_main(monkeypatch, "-m", "trainer.seed=1,2", *args) == 143
    parent, children = all_runs(tmp_path)
    assert [(r.data.tags["sweep.job"], r.info.status) for r in children] == [("0", "KILLED")]
    assert parent.info.status == "KILLED"
    assert parent.data.tags["sweep.not_run"] == "1"
    assert parent.data.tags["sweep.not_run_jobs"].startswith("job #1 (trainer.seed=2 ")
    assert [(o["status"], o["exit_code"]) for _, o in sorted(outcomes(tmp_path).items())] == [
        ("KILLED", 143),
        ("NOT_RUN", 0),
    ]
    captured = capsys.readouterr()
    assert "2 job(s), 0 finished, 0 failed, 1 stopped, 1 not run" in captured.out
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors == ["error: the sweep was stopped: 1 of 2 sweep job(s) stopped and 1 did not run:"]
    assert "  not run: job #1 (trainer.seed=2 " in captured.err


@pytest.mark.slow
def test_sigterm_to_a_parallel_sweep_stops_its_workers_and_ends_every_run_killed(tmp_path: Path) -> None:
    import psutil

    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "CUDA_VISIBLE_DEVICES")}
    args = ["-m", "hydra/launcher=parallel", "trainer.seed=1,2,3", "data=synthetic", "data.num_samples=2000"]
    args += ["trainer.epochs=50", "monitor.plots=false", "device=cpu"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    workers: list[psutil.Process] = []
    try:
        running: list[Any] = []
        while len(running) < 2 and proc.poll() is None:  # both workers train: stop the launching process only
            time.sleep(1)
            if (tmp_path / "mlflow.db").exists():
                runs = [r for r in client.search_runs(experiment_ids=["1"]) if "sweep.job" in r.data.tags]
                running = [r for r in runs if r.info.status == "RUNNING"]
        assert len(running) == 2, proc.communicate()[1][-3000:]
        workers = [psutil.Process(int(r.data.tags["process.pid"])) for r in running]
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    parent, children = all_runs(tmp_path)
    assert [(r.data.tags["sweep.job"], r.info.status) for r in children] == [("0", "KILLED"), ("1", "KILLED")]
    assert parent.info.status == "KILLED" and parent.data.tags["sweep.not_run"] == "1"
    assert parent.data.tags["sweep.not_run_jobs"].startswith("job #2 (trainer.seed=3 ")
    assert [o["status"] for _, o in sorted(outcomes(tmp_path).items())] == ["KILLED", "KILLED", "NOT_RUN"]
    assert [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE] == []
    assert b"Traceback" not in err and b"3 job(s), 0 finished, 0 failed, 2 stopped, 1 not run" in out
