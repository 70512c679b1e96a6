"""Clean stops, atomic checkpoints and resume: nothing lost, same weights as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

import pipeline.checkpoint as checkpoint
import pipeline.train as train_module
from pipeline.checkpoint import CheckpointError, Position
from pipeline.config import RunConfig
from pipeline.stopping import Stopped
from pipeline.train import train
from test_cli import cli, run_main

MakeCfg = Callable[..., RunConfig]
BASE = ["trainer.epochs=2", "trainer.max_steps=-1", "loader.batch_size=64"]  # 23 steps an epoch on digits


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()])


def at_training_step(monkeypatch: pytest.MonkeyPatch, step: int, action: Callable[[], None]) -> None:
    """Run ``action`` during the forward pass of training step ``step`` of the model ``train()`` builds."""
    original = train_module.build_model
    calls = {"n": 0}

    def build(*args, **kwargs):
        model = original(*args, **kwargs)

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if module.training:
                calls["n"] += 1
                if calls["n"] == step:
                    action()

        model.register_forward_pre_hook(hook)
        return model

    monkeypatch.setattr(train_module, "build_model", build)


def sigterm_at_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Send this process SIGTERM during the forward pass of training step ``step``."""
    at_training_step(monkeypatch, step, lambda: os.kill(os.getpid(), signal.SIGTERM))


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
    return checkpoint.find(resume, folder=folder, experiment=experiment, store=store)


def test_resume_by_run_id_and_by_path(make_cfg: MakeCfg, tmp_path: Path) -> None:
    first = train(make_cfg("trainer.epochs=1", "trainer.max_steps=-1"), echo=False)
    path = tmp_path / "checkpoints" / first.run_id / "last.pt"
    assert find(first.run_id, tmp_path / "checkpoints") == path
    assert find(str(path), tmp_path / "elsewhere") == path
    more = train(make_cfg("trainer.epochs=2", "trainer.max_steps=-1", f"resume={first.run_id}"), echo=False)
    assert more.run_id == first.run_id and more.steps == 2 * 45 and [e.epoch for e in more.epochs] == [2]


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
    make_cfg: MakeCfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    three = ["trainer.epochs=3", "loader.batch_size=64"]
    whole = train(make_cfg(*three, "trainer.max_steps=-1", "tracking=none"), echo=False)
    first = train(make_cfg(*three, "trainer.max_steps=30"), echo=False)
    saved = checkpoint.load(tmp_path / "checkpoints" / first.run_id / "last.pt")
    assert saved["position"] == Position(epoch=2, batch=7, step=30)  # not "epoch 2 done"

    # at (or past) max_steps there is nothing to train: refused before anything is opened
    assert run_main(monkeypatch, "device=cpu", *three, "trainer.max_steps=30", f"resume={first.run_id}") == 2
    assert "has trained 30 steps (epoch 2 done in part); nothing to do" in capsys.readouterr().err
    assert run_main(monkeypatch, "device=cpu", *three, "trainer.max_steps=20", f"resume={first.run_id}") == 2

    more = train(make_cfg(*three, "trainer.max_steps=-1", f"resume={first.run_id}"), echo=False)
    assert more.steps == 3 * 23 and [e.epoch for e in more.epochs] == [2, 3]
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
    resumed = train(make_cfg(*BASE, "trainer.lr=0.02", "resume=latest"), echo=False)
    tags = MlflowClient(store_uri).get_run(resumed.run_id).data.tags
    assert tags["resume.changed"] == "trainer.lr: 0.01 -> 0.02"


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
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(path, {"format": checkpoint.FORMAT, "version": 2})
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt"]  # no temporary file left behind
    monkeypatch.undo()
    assert checkpoint.load(path)["version"] == 1


def test_ctrl_c_in_the_cli_exits_130_with_the_run_killed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = train_module.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        model.register_forward_pre_hook(lambda m, i: os.kill(os.getpid(), signal.SIGINT) if m.training else None)
        return model

    monkeypatch.setattr(train_module, "build_model", build)
    assert run_main(monkeypatch, "device=cpu") == 130
    assert "stopped by SIGINT at a step boundary; resume with resume=latest" in capsys.readouterr().err
    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
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
