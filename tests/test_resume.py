"""Clean stops, atomic checkpoints and resume: nothing lost, same weights as an uninterrupted run."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

import pipeline.engine.building.build as build_module
import pipeline.engine.checkpointing.checkpoint as checkpoint
import pipeline.engine.checkpointing.resume as resume_module
from helpers import at_training_step, cli, run_main, sigterm_at_step, without_replay_check
from pipeline.config import RunConfig
from pipeline.engine.checkpointing.checkpoint import CheckpointError, Position
from pipeline.engine.stopping import Stopped
from pipeline.record import outbox
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]
BASE = ["trainer.epochs=2", "trainer.max_steps=-1", "loader.batch_size=64"]  # 23 steps an epoch on digits


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()])


def test_sigterm_stops_at_a_step_boundary_and_resume_ends_with_the_same_weights(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, tmp_path: Path
) -> None:
    uninterrupted = train(make_cfg(*BASE, "tracking.experiment=whole"), echo=False)

    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 30)
        with pytest.raises(Stopped) as stopped:
            train(make_cfg(*BASE), echo=False)
    assert stopped.value.exit_code == 143
    client = MlflowClient(store_uri)
    (killed,) = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])
    assert killed.info.status == "KILLED"
    saved = checkpoint.load(tmp_path / "checkpoints" / killed.info.run_id / "last.pt")
    assert saved["position"] == Position(epoch=2, batch=7, step=30) and saved["run_id"] == killed.info.run_id
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back

    resumed = train(make_cfg(*BASE, "resume=latest"), echo=False)
    assert resumed.run_id == killed.info.run_id and resumed.steps == 46
    assert torch.equal(weights(resumed.model), weights(uninterrupted.model))
    run = client.get_run(resumed.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(resumed.run_id, "train/loss")] == [10, 20, 30, 40]
    assert [m.step for m in client.get_metric_history(resumed.run_id, "val/acc")] == [1, 2]


def find(resume: str, folder: Path, experiment: str = "pipeline", store: str = "") -> Path:
    return resume_module.find(resume, folder=folder, experiment=experiment, store=store)


def test_resume_by_run_id_and_by_path(
    make_cfg: MakeCfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    first = train(make_cfg("trainer.epochs=1", "trainer.max_steps=-1"), echo=False)
    path = tmp_path / "checkpoints" / first.run_id / "last.pt"
    assert find(first.run_id, tmp_path / "checkpoints") == path
    assert find(str(path), tmp_path / "elsewhere") == path
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 20)
        with pytest.raises(Stopped):
            train(make_cfg("trainer.epochs=2", "trainer.max_steps=-1", "tracking.experiment=b"), echo=False)
    stopped = (
        MlflowClient(store_uri).search_runs([MlflowClient(store_uri).get_experiment_by_name("b").experiment_id])[0].info
    )
    more = train(
        make_cfg("trainer.epochs=2", "trainer.max_steps=-1", "tracking.experiment=b", f"resume={stopped.run_id}"),
        echo=False,
    )
    assert more.run_id == stopped.run_id and more.steps == 2 * 45 and [e.epoch for e in more.epochs] == [1, 2]
    with pytest.raises(CheckpointError, match=r"finished, and a finished run is never changed: nothing to do"):
        train(
            make_cfg("trainer.epochs=3", "trainer.max_steps=-1", "tracking.experiment=b", f"resume={stopped.run_id}"),
            echo=False,
        )


def test_resume_without_a_checkpoint_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(monkeypatch, "device=cpu", "resume=latest") == 2
    assert "error: resume=latest: no checkpoint under checkpoints/*/last.pt" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="resume=abc: neither a checkpoint file nor a run id"):
        find("abc", Path("checkpoints"))


def crash_at_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Raise an unrelated error in the forward pass of training step ``step`` (a crash, not a stop)."""

    def fall_over() -> None:
        raise RuntimeError("the machine fell over")

    at_training_step(monkeypatch, step, fall_over)


def test_every_n_steps_checkpoints_let_a_crashed_run_resume_to_the_same_weights(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, tmp_path: Path
) -> None:
    uninterrupted = train(make_cfg(*BASE, "tracking.experiment=whole"), echo=False)
    with monkeypatch.context() as patch:
        crash_at_step(patch, 36)
        with pytest.raises(RuntimeError, match="fell over"):
            train(make_cfg(*BASE, "checkpoint.every_n_steps=10"), echo=False)
    client = MlflowClient(store_uri)
    (failed,) = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])
    saved = checkpoint.load(tmp_path / "checkpoints" / failed.info.run_id / "last.pt")
    assert failed.info.status == "FAILED" and saved["position"] == Position(epoch=2, batch=7, step=30)
    resumed = train(make_cfg(*BASE, "checkpoint.every_n_steps=10", "resume=latest"), echo=False)
    assert resumed.run_id == failed.info.run_id and resumed.steps == 46
    assert torch.equal(weights(resumed.model), weights(uninterrupted.model))


@pytest.mark.slow
def test_resume_with_persistent_loader_workers_across_an_epoch_boundary_ends_with_the_same_weights(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DataLoader draws its workers' seed when it makes an iterator: once per process with persistent workers,
    so a resumed process used to shuffle epochs >= 2 differently. The order is now the epoch's alone."""
    workers = [
        "loader=workers",
        "loader.num_workers=2",
        "loader.batch_size=64",
        "trainer.epochs=3",
        "trainer.max_steps=-1",
    ]
    uninterrupted = train(make_cfg(*workers, "tracking=none"), echo=False)
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 30)  # epoch 2, batch 7
        with pytest.raises(Stopped):
            train(make_cfg(*workers), echo=False)
    resumed = train(make_cfg(*workers, "resume=latest"), echo=False)
    assert resumed.steps == 3 * 23 and [e.epoch for e in resumed.epochs] == [2, 3]
    assert torch.equal(weights(resumed.model), weights(uninterrupted.model))


def test_an_epoch_cut_short_by_max_steps_is_checkpointed_where_it_stopped(
    make_cfg: MakeCfg,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    store_uri: str,
) -> None:
    three = ["trainer.epochs=3", "loader.batch_size=64"]
    whole = train(make_cfg(*three, "trainer.max_steps=-1", "tracking=none"), echo=False)
    first = train(make_cfg(*three, "trainer.max_steps=30"), echo=False)
    saved = checkpoint.load(tmp_path / "checkpoints" / first.run_id / "last.pt")
    assert saved["position"] == Position(epoch=2, batch=7, step=30)  # not "epoch 2 done"

    # at (or past) max_steps there is nothing to train: refused before anything is opened
    store = f"tracking.uri={store_uri}"
    assert run_main(monkeypatch, "device=cpu", store, *three, "trainer.max_steps=30", f"resume={first.run_id}") == 2
    assert "has trained 30 steps (epoch 2 done in part); nothing to do" in capsys.readouterr().err
    assert run_main(monkeypatch, "device=cpu", store, *three, "trainer.max_steps=20", f"resume={first.run_id}") == 2

    more = train(make_cfg(*three, "trainer.max_steps=-1", f"resume={first.run_id}", "fork=true"), echo=False)
    assert more.run_id != first.run_id and more.steps == 3 * 23 and [e.epoch for e in more.epochs] == [2, 3]
    assert torch.equal(weights(more.model), weights(whole.model))


def test_resume_latest_takes_the_newest_unfinished_run_of_this_experiment(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 5)
        with pytest.raises(Stopped):
            train(make_cfg(*BASE), echo=False)
    (stopped_id,) = [p.name for p in Path("checkpoints").iterdir()]
    finished = train(make_cfg(*BASE), echo=False)  # newer, but finished
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 5)
        with pytest.raises(Stopped):
            train(make_cfg(*BASE, "tracking.experiment=other"), echo=False)  # newer, but another experiment
    found = find("latest", Path("checkpoints"), store=checkpoint.store_id(make_cfg().tracking))
    assert found == Path("checkpoints") / stopped_id / "last.pt"
    assert f"resume=latest: continuing run {stopped_id} (stopped at epoch 1, batch 5, step 5" in caplog.text
    resumed = train(make_cfg(*BASE, "resume=latest"), echo=False)
    assert resumed.run_id == stopped_id != finished.run_id
    with pytest.raises(CheckpointError, match=rf"no unfinished run .*finished: ({stopped_id}|{finished.run_id})"):
        find("latest", Path("checkpoints"), store=checkpoint.store_id(make_cfg().tracking))


def test_resume_refuses_a_different_model_and_records_other_changes(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 5)
        with pytest.raises(Stopped):
            train(make_cfg(*BASE), echo=False)
    with pytest.raises(CheckpointError, match=r"model.hidden_sizes: \[512\] in the checkpoint, \[256\] now"):
        train(make_cfg(*BASE, "model.hidden_sizes=[256]", "resume=latest"), echo=False)
    with pytest.raises(CheckpointError, match=r"loader.batch_size: 64 in the checkpoint, 32 now"):
        train(make_cfg(*BASE, "loader.batch_size=32", "resume=latest"), echo=False)
    with pytest.raises(CheckpointError, match=r"optimizer.lr: 0.01 in the checkpoint, 0.02 now. .*add fork=true"):
        train(make_cfg(*BASE, "optimizer.lr=0.02", "resume=latest"), echo=False)
    with pytest.raises(CheckpointError, match=r"data.name: 'digits' in the checkpoint, 'synthetic' now"):
        train(make_cfg(*BASE, "data=synthetic", "resume=latest"), echo=False)
    resumed = train(make_cfg(*BASE, "trainer.log_every_n_steps=5", "resume=latest"), echo=False)
    tags = MlflowClient(store_uri).get_run(resumed.run_id).data.tags
    assert tags["resume.changed"] == "trainer.log_every_n_steps: 10 -> 5"
    params = MlflowClient(store_uri).get_run(resumed.run_id).data.params
    assert params["optimizer.lr"] == "0.01" and params["data.name"] == "digits"  # still what ran


def test_fork_continues_a_checkpoint_in_a_new_run_with_new_hyper_parameters(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    lrs: list[float] = []
    original = build_module.build_optimizer

    def watched(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        optimizer.register_step_pre_hook(lambda opt, a, k: lrs.append(opt.param_groups[0]["lr"]))
        return optimizer

    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 5)
        with pytest.raises(Stopped):
            train(make_cfg(*BASE), echo=False)
    (source_id,) = [p.name for p in Path("checkpoints").iterdir()]
    monkeypatch.setattr(build_module, "build_optimizer", watched)
    without_replay_check(monkeypatch)  # its optimizer steps would count: whether it runs follows the machine's speed
    fork = train(make_cfg(*BASE, "optimizer.lr=0.02", f"resume={source_id}", "fork=true"), echo=False)
    client = MlflowClient(store_uri)
    run, before = client.get_run(fork.run_id), client.get_run(source_id)
    assert fork.run_id != source_id and fork.steps == 46 and set(lrs) == {0.02} and len(lrs) == 41
    assert run.data.params["optimizer.lr"] == "0.02" and run.data.params["fork"] == "true"
    assert run.data.tags["forked_from"] == source_id and run.data.tags["forked_at_step"] == "5"
    assert run.data.tags["fork.changed"] == "fork: False -> True; optimizer.lr: 0.01 -> 0.02"
    assert before.info.status == "KILLED" and before.data.params["optimizer.lr"] == "0.01"  # the source is untouched
    assert [m.step for m in client.get_metric_history(fork.run_id, "train/loss")] == [10, 20, 30, 40]


def test_a_stop_without_checkpoints_says_that_none_exists(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sigterm_at_step(monkeypatch, 3)
    with pytest.raises(Stopped):
        train(make_cfg(*BASE, "checkpoint.enabled=false"), echo=False)
    assert "no checkpoint (checkpoint.enabled=false)" in caplog.text and "checkpoint None" not in caplog.text


def test_a_checkpoint_write_that_fails_midway_leaves_the_previous_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run" / "last.pt"
    checkpoint.save(path, {"format": checkpoint.FORMAT, "version": 1, "weights": torch.arange(4)})

    def broken_save(obj, f) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(CheckpointError, match=rf"writing {path} failed: the disk is full \(.* MB free in "):
        checkpoint.save(path, {"format": checkpoint.FORMAT, "version": 2})
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt"]  # no temporary file left behind
    monkeypatch.undo()
    assert checkpoint.load(path)["version"] == 1


def test_ctrl_c_in_the_cli_exits_130_with_the_run_killed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = build_module.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        model.register_forward_pre_hook(lambda m, i: os.kill(os.getpid(), signal.SIGINT) if m.training else None)
        return model

    monkeypatch.setattr(build_module, "build_model", build)
    assert run_main(monkeypatch, "device=cpu") == 130
    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    assert (
        f"stopped by SIGINT at a step boundary; continue it with: python -m pipeline resume={run.info.run_id}"
        in capsys.readouterr().err
    )
    assert run.info.status == "KILLED"
    assert (tmp_path / "checkpoints" / run.info.run_id / "last.pt").exists()


@pytest.mark.slow
def test_sigterm_to_a_real_training_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    args = [
        sys.executable,
        "-m",
        "pipeline",
        "device=cpu",
        "trainer.epochs=200",
        "loader.batch_size=16",
        "monitor.plots=false",
    ]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "checkpoints").glob("*/last.pt")):  # the first epoch is done: mid-training now
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(experiment_ids=["1"])
    assert run.info.status == "KILLED"
    saved = checkpoint.load(tmp_path / "checkpoints" / run.info.run_id / "last.pt")
    epochs = saved["position"].epoch  # finish the epoch that was interrupted
    resumed = cli(
        "device=cpu",
        f"trainer.epochs={epochs}",
        "loader.batch_size=16",
        "monitor.plots=false",
        "resume=latest",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == steps[0] + 10 * (len(steps) - 1)  # continuous, no repeats


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_stops_a_run_with_loader_workers_cleanly(tmp_path: Path) -> None:
    """As SLURM's time limit, `kill -- -PGID` or a terminal's Ctrl-C do: the workers get the signal too."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    args = [sys.executable, "-m", "pipeline", "device=cpu", "trainer.epochs=200", "loader.batch_size=16"]
    args += ["loader.num_workers=2", "loader.persistent_workers=true", "monitor.plots=false"]
    proc = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while not list((tmp_path / "checkpoints").glob("*/last.pt")):  # the first epoch is done: mid-training now
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert "LoaderError" not in err and "exited unexpectedly" not in err and "Traceback" not in err
    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    assert run.info.status == "KILLED"


def stopped_run(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, *overrides: str, step: int = 5) -> str:
    """A run of BASE stopped by SIGTERM at ``step``; returns its run id."""
    before = set(Path("checkpoints").iterdir()) if Path("checkpoints").exists() else set()
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, step)
        with pytest.raises(Stopped):
            train(make_cfg(*BASE, *overrides), echo=False)
    (folder,) = set(Path("checkpoints").iterdir()) - before
    return folder.name


def record_of(client: MlflowClient, run_id: str) -> tuple:
    run = client.get_run(run_id)
    artifacts = [a.path for a in client.list_artifacts(run_id)] + [
        a.path for a in client.list_artifacts(run_id, "plots")
    ]
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
    return run.info.status, run.info.end_time, run.data.tags, run.data.metrics, run.data.params, artifacts, history


def test_a_finished_run_is_never_changed_by_a_resume(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], store_uri: str
) -> None:
    done = train(make_cfg(*BASE), echo=False)
    client = MlflowClient(store_uri)
    before = record_of(client, done.run_id)
    cases = {
        "trainer.epochs=2": "has trained 46 steps (epoch 2 done); nothing to do",
        "trainer.epochs=3": "finished, and a finished run is never changed: nothing to do. To train it further, add "
        "fork=true",
    }
    for epochs, message in cases.items():
        args = ["device=cpu", f"tracking.uri={store_uri}", *BASE, epochs, f"resume={done.run_id}"]
        assert run_main(monkeypatch, *args) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: ") and message in last
    assert record_of(client, done.run_id) == before


def test_a_run_of_another_experiment_is_never_continued(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    beta = stopped_run(make_cfg, monkeypatch, "tracking.experiment=beta")
    client = MlflowClient(store_uri)
    before = record_of(client, beta)
    with pytest.raises(CheckpointError, match=r"no checkpoint under checkpoints/\*/last.pt for experiment 'alpha'"):
        train(make_cfg(*BASE, "tracking.experiment=alpha", "resume=latest"), echo=False)
    with pytest.raises(CheckpointError, match=r"recorded elsewhere \(tracking.experiment: 'beta' in the checkpoint"):
        train(make_cfg(*BASE, "tracking.experiment=alpha", f"resume={beta}"), echo=False)
    assert record_of(client, beta) == before
    assert client.get_experiment_by_name("alpha") is None  # not even created


def test_a_run_being_trained_cannot_be_resumed_a_second_time(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    run_id = stopped_run(make_cfg, monkeypatch)
    client = MlflowClient(store_uri)
    before = record_of(client, run_id)
    other = checkpoint.RunLock(Path("checkpoints") / run_id).acquire()  # what a first resume holds while it trains
    try:
        with pytest.raises(CheckpointError, match=rf"run {run_id} is being trained by another process right now"):
            train(make_cfg(*BASE, f"resume={run_id}"), echo=False)
        with pytest.raises(CheckpointError, match=r"every unfinished run .* is being trained right now"):
            train(make_cfg(*BASE, "resume=latest"), echo=False)
    finally:
        other.release()
    assert record_of(client, run_id) == before  # not reopened, no metric points twice
    assert train(make_cfg(*BASE, f"resume={run_id}"), echo=False).steps == 46  # free again


def test_two_quick_ctrl_c_still_end_the_run_killed_with_a_closing_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], store_uri: str
) -> None:
    def twice() -> None:  # a user mashing Ctrl-C: the second arrives mid-step, before any step boundary
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    at_training_step(monkeypatch, 5, twice)
    before = signal.getsignal(signal.SIGINT)  # pytest's; an earlier test's library may have changed it
    assert run_main(monkeypatch, "device=cpu", f"tracking.uri={store_uri}", *BASE) == 130
    assert "stopped by SIGINT at once (asked twice), mid-step: the last checkpoint stays" in capsys.readouterr().err
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "KILLED" and signal.getsignal(signal.SIGINT) is before  # the handler given back


def test_a_second_request_while_the_stop_checkpoint_is_written_does_not_cut_it_short(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    original = checkpoint.Checkpointer.write

    def interrupted(self, position, *, status="running"):
        if status == "stopped":
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the checkpoint is being written
        return original(self, position, status=status)

    monkeypatch.setattr(checkpoint.Checkpointer, "write", interrupted)
    sigterm_at_step(monkeypatch, 5)
    with pytest.raises(Stopped) as stopped:
        train(make_cfg(*BASE), echo=False)
    assert not stopped.value.at_once and "already stopping" in caplog.text
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    saved = checkpoint.load(tmp_path / "checkpoints" / run.info.run_id / "last.pt")
    assert run.info.status == "KILLED" and saved["position"] == Position(epoch=1, batch=5, step=5)


def test_a_batch_larger_than_the_data_with_drop_last_is_a_config_error_before_any_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run_main(monkeypatch, "device=cpu", "loader.batch_size=2000", "loader.drop_last=true") == 2
    err = capsys.readouterr().err
    assert err == (
        "error: loader.batch_size=2000 is not allowed: expected at most the 1438 training samples with "
        "loader.drop_last=true (or loader.drop_last=false)\n"
    )
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_checkpoint_dir_that_cannot_be_written_fails_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str
) -> None:
    (tmp_path / "taken").write_text("not a folder")
    folder = "taken" if where == "a file" else "taken/checkpoints"
    assert run_main(monkeypatch, "device=cpu", f"checkpoint.dir={folder}") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint.dir={folder}: cannot write checkpoints there (") and err.count("\n") == 1
    assert not (tmp_path / "mlflow.db").exists()  # nothing was opened


def test_unusable_checkpoints_are_one_line_naming_the_file(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, tmp_path: Path
) -> None:
    run_id = stopped_run(make_cfg, monkeypatch)
    path = tmp_path / "checkpoints" / run_id / "last.pt"
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # a copy cut short
    with pytest.raises(CheckpointError, match=rf"checkpoints/{run_id}/last.pt is not a readable checkpoint \(.*\): it"):
        train(make_cfg(*BASE, f"resume={run_id}"), echo=False)
    path.write_bytes(whole)
    with pytest.raises(
        CheckpointError,
        match=r"^cannot resume run \w+: model._target_: 'pipeline.engine.models.mlp' in the checkpoint, "
        r"'pipeline.engine.models.resnet' now; model.arch: None in the checkpoint, 'resnet18'",
    ):
        train(make_cfg(*BASE, "model=resnet18", f"resume={path}"), echo=False)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    with pytest.raises(CheckpointError, match=rf"run {run_id} is recorded elsewhere \(tracking.uri: "):
        train(make_cfg(*BASE, f"tracking.uri={other}", f"resume={run_id}"), echo=False)
    MlflowClient(store_uri).delete_run(run_id)
    with pytest.raises(CheckpointError, match=rf"run {run_id} no longer exists in the tracking store \(deleted\?\)"):
        train(make_cfg(*BASE, f"resume={run_id}"), echo=False)
    forked = train(make_cfg(*BASE, f"resume={run_id}", "fork=true"), echo=False)  # its weights live on
    assert forked.steps == 46 and forked.run_id != run_id


@pytest.mark.slow
def test_after_a_sigkill_mid_epoch_the_resumed_runs_metrics_have_no_gap(tmp_path: Path) -> None:
    """Checkpoints every 20 steps; the process is killed in epoch 2, far from a between-epochs write."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    common = [
        "device=cpu",
        "model.hidden_sizes=[2048,2048]",
        "loader.batch_size=8",  # 180 steps an epoch on digits
        "trainer.log_every_n_steps=5",
        "checkpoint.every_n_steps=20",
        "monitor.plots=false",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *common, "trainer.epochs=50"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    step = 0
    while step < 200:  # epoch 2 is steps 181-360
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
        state = checkpoint.read_state(next(iter((tmp_path / "checkpoints").glob("*")), tmp_path / "none"))
        step = state["position"]["step"] if state else 0
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    resumed = cli(*common, "trainer.epochs=2", "resume=latest", cwd=tmp_path)  # epochs may change on resume
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(experiment_ids=["1"])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    # no gap, and no step twice: points written after the last checkpoint are not logged again by the replay
    assert run.info.status == "FINISHED" and sorted(steps) == list(range(5, 2 * 180 + 1, 5))


def test_a_checkpoint_from_before_a_key_existed_compares_as_that_keys_old_behaviour() -> None:
    from pipeline.engine.checkpointing.resume import config_changes

    older = {"loader.batch_size": 64}
    now = {"loader.batch_size": 64, "data.augment": "none", "data.augment_padding": 4}
    now["loader.prefetch_to_device"] = "auto"
    now.update({"trainer.profile": False, "trainer.profile_steps": 3, "trainer.memory_snapshot": "off"})
    assert config_changes(older, now) == {}
    assert config_changes(older, {**now, "data.augment": "crop_flip"}) == {"data.augment": ("none", "crop_flip")}


def test_a_resume_may_profile_or_keep_a_memory_snapshot_where_the_run_did_not() -> None:
    from pipeline.engine.checkpointing.resume import check_resumable, config_changes

    before = {"trainer.profile": False, "trainer.profile_steps": 3, "trainer.memory_snapshot": "off"}
    now = {"trainer.profile": True, "trainer.profile_steps": 10, "trainer.memory_snapshot": "on_oom"}
    changes = config_changes(before, now)
    assert len(changes) == 3
    check_resumable(changes, fork=False, run="r1")  # how the run is measured, not what it computes: allowed


class _WritesAMarker:
    """Unpickling this opens (so creates) ``marker``: code a crafted checkpoint runs if it is fully unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


def test_a_crafted_checkpoint_is_refused_in_one_line_without_running_its_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    marker, crafted = tmp_path / "ran", tmp_path / "crafted.pt"
    torch.save({"format": checkpoint.FORMAT, "model": {}, "position": _WritesAMarker(marker)}, crafted)
    with pytest.raises(CheckpointError, match=r"crafted.pt holds io.open, which no checkpoint holds: refused"):
        checkpoint.load(crafted)
    assert not marker.exists()
    assert run_main(monkeypatch, "device=cpu", f"resume={crafted}") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {crafted} holds io.open") and err.count("\n") == 1, err
    assert not marker.exists()
    plain = tmp_path / "plain.pkl"  # pickle.dump's file, not torch.save's: torch warns before refusing it
    plain.write_bytes(pickle.dumps({"position": _WritesAMarker(marker)}, protocol=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning escapes: the refusal is the one line
        with pytest.raises(CheckpointError, match=r"plain.pkl (holds io.open|is not a readable checkpoint)"):
            checkpoint.load(plain)
    assert not marker.exists()


def test_checkpoints_load_without_unpickling_anything_but_tensors_and_plain_values(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_id = stopped_run(make_cfg, monkeypatch)
    loads: list[object] = []
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("weights_only")) or original(*a, **k))
    saved = checkpoint.load(tmp_path / "checkpoints" / run_id / "last.pt")
    assert loads == [True]
    assert saved["position"] == Position(epoch=1, batch=5, step=5) and saved["rng"]["torch"].dtype == torch.uint8


def test_resume_imports_the_runs_pending_outbox_file_first(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_id = stopped_run(make_cfg, monkeypatch)
    client = MlflowClient(store_uri)
    killed = client.get_run(run_id).info
    client.update_run(run_id, status="RUNNING")  # the store was down when it stopped: its end is in the file
    unsent = [outbox.Point("train/unsent", 1.0, killed.end_time - 1, 5)]
    box = outbox.Outbox(run_id, killed.experiment_id, store_uri, "KILLED", killed.end_time, {}, unsent)
    path = outbox.save(box, outbox.fresh_path(run_id))
    resumed = train(make_cfg(*BASE, f"resume={run_id}"), echo=False)
    assert f"resume: imported {path} first (1 metrics; its earlier part's end, KILLED)" in caplog.text
    assert not path.exists() and Path(f"{path}.sent").exists()
    run = client.get_run(resumed.run_id)
    assert run.info.status == "FINISHED" and run.info.end_time > killed.end_time
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/unsent")] == [(5, 1.0)]


def test_a_resumed_runs_system_metrics_continue_after_the_steps_already_recorded(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    run_id = stopped_run(make_cfg, monkeypatch)
    client = MlflowClient(store_uri)
    key = "system/cpu_utilization_percentage"
    before = [m.step for m in client.get_metric_history(run_id, key)]
    train(make_cfg(*BASE, f"resume={run_id}"), echo=False)
    after = [m.step for m in client.get_metric_history(run_id, key)][len(before) :]
    assert before and after and min(after) > max(before)  # every reading is stored; the second part follows
    steps = sorted(m.step for m in client.get_metric_history(run_id, key))
    assert len(set(steps)) == len(steps)  # one point per step


def test_two_untracked_runs_of_one_name_started_together_get_their_own_checkpoint_folders(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_cfg("tracking=none", "tracking.run_name=same")
    monkeypatch.setattr(checkpoint.time, "strftime", lambda *a: "20250101-120000")  # the same second
    runs = [
        checkpoint.Checkpointer.for_run(
            cfg.checkpoint, cfg.tracking, checkpoint.Kept(None, "same", {}), state=None, device=torch.device("cpu")
        )
        for _ in range(2)
    ]
    first, second = (saver.path.parent for saver in runs)
    assert first != second and first.name.startswith("same-20250101-120000-")
    for saver in runs:
        saver.__exit__(None, None, None)


def test_a_run_locked_before_its_first_checkpoint_names_the_process_that_holds_it(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints" / "r1"
    holder = checkpoint.RunLock(folder).acquire()  # no state.json yet: the run has only started
    try:
        with pytest.raises(CheckpointError) as err:
            checkpoint.RunLock(folder).acquire()
    finally:
        holder.release()
    assert f"(pid {os.getpid()} on {socket.gethostname()})" in str(err.value) and "?" not in str(err.value)
    checkpoint.RunLock(folder).acquire().release()  # free again


def test_resume_latest_passes_over_a_deleted_run_to_the_newest_one_left(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    older = stopped_run(make_cfg, monkeypatch)
    newer = stopped_run(make_cfg, monkeypatch)
    MlflowClient(store_uri).delete_run(newer)
    resumed = train(make_cfg(*BASE, "resume=latest"), echo=False)
    assert resumed.run_id == older
    assert f"resume=latest: passed over run {newer}: deleted from the tracking store" in caplog.text
    with pytest.raises(
        CheckpointError, match=rf"no unfinished run .* is left \(1 deleted from the tracking store: {newer}\)"
    ):
        train(make_cfg(*BASE, "resume=latest"), echo=False)


def test_a_failed_run_that_a_resume_finishes_keeps_no_failure_tags(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    with monkeypatch.context() as patch:
        crash_at_step(patch, 5)
        with pytest.raises(RuntimeError, match="fell over"):
            train(make_cfg(*BASE, "checkpoint.every_n_steps=2"), echo=False)
    (run_id,) = [p.name for p in Path("checkpoints").iterdir()]
    client = MlflowClient(store_uri)
    client.set_tag(run_id, "closed_by", "python -m pipeline.stale: pid 1 on here: no such process")
    assert client.get_run(run_id).data.tags["error"] == "RuntimeError: the machine fell over"
    train(make_cfg(*BASE, "checkpoint.every_n_steps=2", f"resume={run_id}"), echo=False)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "error" not in run.data.tags and "closed_by" not in run.data.tags


def test_a_run_resumed_after_a_crash_records_each_replayed_step_once(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    """Checkpoint at step 10, train/loss logged at 12 and 15, then a crash at 16: the resume trains 11-16 again
    but logs only what the store lacks, so every metric has one point a step, as in an uninterrupted run."""
    common = [*BASE, "trainer.log_every_n_steps=3", "checkpoint.every_n_steps=10"]
    uninterrupted = train(make_cfg(*common, "tracking.experiment=whole"), echo=False)
    with monkeypatch.context() as patch:
        crash_at_step(patch, 16)
        with pytest.raises(RuntimeError, match="fell over"):
            train(make_cfg(*common), echo=False)
    resumed = train(make_cfg(*common, "resume=latest"), echo=False)
    client = MlflowClient(store_uri)
    run = client.get_run(resumed.run_id)
    assert run.info.status == "FINISHED"
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(resumed.run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
    whole = [(m.step, m.value) for m in client.get_metric_history(uninterrupted.run_id, "train/loss")]
    assert sorted((m.step, m.value) for m in client.get_metric_history(resumed.run_id, "train/loss")) == whole
    assert run.data.tags["resume.replayed_steps"] == (
        "11-15: trained again after resuming, not logged again (the points logged before stand)"
    )


def test_the_printed_command_continues_the_run_with_its_own_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26: the hint `resume=latest` used to finish a 7-epoch run at the default 5 epochs, for good."""
    started = ["device=cpu", "trainer.epochs=7", "trainer.max_steps=-1", "loader.batch_size=256"]  # 6 steps an epoch
    with monkeypatch.context() as patch:
        at_training_step(patch, 3, lambda: os.kill(os.getpid(), signal.SIGINT))
        assert run_main(monkeypatch, *started) == 130
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stopped by SIGINT")]
    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    command = f"python -m pipeline resume={run.info.run_id}"
    assert line == f"stopped by SIGINT at a step boundary; continue it with: {command}"
    assert run_main(monkeypatch, *command.split()[3:]) == 0  # exactly as printed
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    done = client.get_run(run.info.run_id)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")]
    assert done.info.status == "FINISHED" and done.data.params["trainer.epochs"] == "7" and steps == list(range(1, 8))
    assert done.data.tags["resume.overrides"] == f"resume={run.info.run_id}" and "->" not in done.data.tags.get(
        "resume.changed", ""
    )


def test_a_resume_keeps_the_runs_length_unless_a_shorter_one_is_typed(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    """A checkpoint without its overrides (an in-process run, or one from before they were kept) falls to the
    defaults: a default that would end the run earlier is refused; typed by name, it is taken."""
    import pipeline.engine.checkpointing.continuation as continuation

    run_id = stopped_run(make_cfg, monkeypatch, "trainer.epochs=7")
    now = ["device=cpu", f"tracking.uri={store_uri}", f"resume={run_id}"]
    with pytest.raises(CheckpointError, match=r"earlier than it was started to \(trainer\.epochs=7 when it started, 5"):
        continuation.continued(now)
    merged, own = continuation.continued([*now, "trainer.epochs=2"])
    assert merged == [*now, "trainer.epochs=2"]
    assert own == ["device=cpu", f"tracking.uri={store_uri}", "trainer.epochs=2"]


def test_the_overrides_typed_now_replace_the_runs_own_key_by_key() -> None:
    from pipeline.engine.checkpointing.continuation import merged, own_overrides

    started = ["model=resnet18", "trainer.epochs=30", "+model.width=2", "tracking.tags.arm=a"]
    assert merged(started, ["trainer.epochs=40", "resume=latest", "~model.width"]) == [
        "model=resnet18",
        "tracking.tags.arm=a",
        "trainer.epochs=40",
        "resume=latest",
        "~model.width",
    ]
    assert own_overrides(["resume=x", "fork=true", "optimizer.lr=0.1"]) == ["optimizer.lr=0.1"]


HOLDS = Path(__file__).parent / "holds"  # sitecustomize.py: holds a real process in one phase until signalled
NOTHING = "interrupted before the first step: nothing was recorded, nothing to resume"


def ctrl_c_as_in_a_terminal() -> None:
    """SIGINT back to its default in the child, whatever the suite was started from: a shell's background job
    ignores SIGINT, the ignore is inherited, and Python then never raises KeyboardInterrupt (the test would hang)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "line"),
    [
        ("imports", NOTHING),
        ("compose", NOTHING),
        ("build", NOTHING),
        ("memory", NOTHING),
        ("first_step", "stopped by SIGINT at a step boundary; continue it with: python -m pipeline resume="),
        ("teardown", "interrupted while exiting: the run had finished and is recorded"),
    ],
)
def test_ctrl_c_in_any_phase_is_one_line_and_exit_130(tmp_path: Path, phase: str, line: str) -> None:
    """Issue 26: Ctrl-C in the first seconds printed a ~100-line KeyboardInterrupt traceback (through torch._dynamo)."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PIPELINE_HOLD=phase, PYTHONPATH=os.pathsep.join([str(HOLDS), env.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "pipeline", "device=cpu", "trainer.epochs=1", "trainer.max_steps=3"]
    proc = subprocess.Popen(
        args,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    assert proc.stderr is not None
    try:
        # Blocks until the process is held in the phase, has written something else, or has ended (the hold's
        # faulthandler ends a process stuck on its way after PIPELINE_HOLD_LIMIT_S, printing its stacks).
        first = proc.stderr.readline()
        if first != f"holding at {phase}\n":  # the process goes on to its hold: stopped first, then read
            proc.kill()
            pytest.fail(
                f"expected 'holding at {phase}' first on stderr, got:\n{first}{proc.communicate(timeout=60)[1]}"
            )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # a lost signal fails the test, never hangs the suite
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.splitlines()[-1].startswith(line), err


def test_ctrl_c_while_a_resume_builds_leaves_the_run_as_it_was_in_one_line(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], store_uri: str
) -> None:
    run_id = stopped_run(make_cfg, monkeypatch)
    capsys.readouterr()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(build_module, "check_training", interrupted)  # the memory estimate
        assert run_main(monkeypatch, "device=cpu", f"tracking.uri={store_uri}", *BASE, f"resume={run_id}") == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "interrupted before the first step: the run is as it was; continue it with the same command"
    )
    assert checkpoint.RunLock(Path("checkpoints") / run_id).free()
    assert checkpoint.read_state(Path("checkpoints") / run_id)["status"] == "stopped"


def _stopped_run(monkeypatch: pytest.MonkeyPatch, *overrides: str) -> str:
    """A run of ``overrides`` stopped by Ctrl-C at its third step, through the entry point: its run id."""
    with monkeypatch.context() as patch:
        at_training_step(patch, 3, lambda: os.kill(os.getpid(), signal.SIGINT))
        assert run_main(monkeypatch, "device=cpu", "trainer.epochs=2", "loader.batch_size=256", *overrides) == 130
    (run,) = MlflowClient(f"sqlite:///{Path.cwd() / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    return run.info.run_id


def test_a_refused_resume_names_the_changed_model_key_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36 (15): the refusal used to lead with every possible cause; it names the key that changed, first."""
    run = _stopped_run(monkeypatch)
    capsys.readouterr()
    assert run_main(monkeypatch, f"resume={run}", "model.hidden_sizes=[64]") == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: cannot resume run {run}: model.hidden_sizes: [512] in the checkpoint, [64] now")
    assert "optimizer" not in line and "batch size" not in line and "schedule" not in line


def test_a_resume_that_chooses_another_data_group_is_refused_for_the_changed_data(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36 (15): the run's own data.num_samples used to be applied onto data=digits and refused as a new key."""
    run = _stopped_run(monkeypatch, "data=synthetic", "data.num_samples=4000", "tracking.log_model=false")
    capsys.readouterr()
    assert run_main(monkeypatch, f"resume={run}", "data=digits") == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: cannot resume run {run}: data.")  # the changed data keys, first
    assert "data.name: 'synthetic' in the checkpoint, 'digits' now" in line and "is not a key of data" not in line


def test_a_group_chosen_now_replaces_the_runs_own_keys_of_that_group() -> None:
    from pipeline.engine.checkpointing.continuation import merged

    started = ["data=synthetic", "data.num_samples=4000", "+model.width=2", "optimizer.lr=0.1"]
    assert merged(started, ["resume=x", "data=digits"]) == [
        "+model.width=2",
        "optimizer.lr=0.1",
        "resume=x",
        "data=digits",
    ]


def test_an_error_in_the_records_end_leaves_the_finished_trainings_checkpoint_finished(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    """The record's end (verdict, plots, the logged model) runs inside the checkpointer, one ExitStack holding the
    whole run: an error there fails the run but must not mark the checkpoint of a training that finished ``failed``
    (before, the checkpointer had closed by then)."""
    from pipeline.report import logbook

    def broken(*args, **kwargs):
        raise RuntimeError("the record's end failed")

    monkeypatch.setattr(logbook, "conclude", broken)
    with pytest.raises(RuntimeError, match="the record's end failed"):
        train(make_cfg(), echo=False)
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "FAILED"
    assert checkpoint.read_state(Path("checkpoints") / run.info.run_id)["status"] == "finished"
