"""``python -m pipeline`` as users type it: in-process through the real entry point, plus a few real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from helpers import cli, run_main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["model=nope"],
            "error: model=nope is not an option: expected one of custom, mlp, resnet18, resnet50, timm, torchvision",
        ),
        (["loader.batch_size=abc"], "error: loader.batch_size='abc' is not allowed: expected an integer"),
        (["loader.batch_size=0"], "error: loader.batch_size=0 is not allowed: expected an integer >= 1"),
        (["optimizer.lr=0"], "error: optimizer.lr=0 is not allowed: expected a learning rate > 0"),
        (["loader.num_workers=-2"], "error: loader.num_workers=-2 is not allowed"),
        (["data=imagefolder"], "error: data.root is required: add data.root=... to the command line"),
        (["loader.bogus=1"], "error: loader.bogus is not a config key of loader"),
        (["precision=bf16"], "error: precision.dtype='bf16' is not allowed: expected auto while amp=false"),
        # Hydra's own groups and flags: one line too, not Hydra's listing of its search path and exit 1
        (["hydra/launcher=nope"], "error: hydra/launcher=nope is not an option: expected one of basic, "),
        (
            ["hydra.nope=1"],
            "error: hydra.nope is not a config key of hydra: check the spelling (python -m pipeline --cfg hydra shows",
        ),
        (["-m", "hydra/sweeper=nope", "trainer.seed=1,2"], "error: hydra/sweeper=nope is not an option: expected"),
        (["--config-dir", "no/such/folder", "model=mlp"], "error: --config-dir no/such/folder: no such folder"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], message: str
) -> None:
    touched: list[str] = []  # any query of CUDA, even "is it there?", would mean the run got that far
    for name in ("is_available", "device_count", "init", "_lazy_init", "set_device"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name, **k: touched.append(name))
    assert run_main(monkeypatch, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no mlflow.db, no mlruns/, no outputs/
    assert touched == []


def test_missing_gpu_exits_2_before_any_run_is_created(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_main(monkeypatch, "device=cuda") == 2
    assert capsys.readouterr().err.startswith("error: device=cuda requested, but CUDA is not usable")
    assert not (tmp_path / "mlflow.db").exists()


def test_missing_dataset_exits_2_before_any_run_is_created(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run_main(monkeypatch, "data=mnist", "data.download=false", "device=cpu") == 2
    assert "files missing under data/MNIST/raw" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()


def test_a_good_run_through_the_entry_point_records_the_overrides_as_typed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["device=cpu", "trainer.epochs=1", "trainer.max_steps=2", "loader.batch_size=16"]
    assert run_main(monkeypatch, *args) == 0
    out = capsys.readouterr().out
    assert "run mlp-digits-cpu-bs16-w0: 1 epoch(s), 2 steps" in out
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert f"mlflow ui --backend-store-uri {store}" in out and "workflowType=machine_learning" in out
    (run,) = MlflowClient(store).search_runs(experiment_ids=["1"])
    assert run.data.tags["overrides"] == " ".join(args) and run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith(str(tmp_path / "mlruns"))


@pytest.mark.slow
def test_the_default_command_trains_and_prints_a_summary(tmp_path: Path) -> None:
    proc = cli("trainer.epochs=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "run mlp-digits-cpu-bs64-w0: 2 epoch(s), 46 steps" in proc.stdout
    assert "this run:     http://127.0.0.1:5000/#/experiments/1/runs/" in proc.stdout
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "mlruns").is_dir()


@pytest.mark.slow
def test_bad_input_in_a_real_process_exits_2_fast_without_importing_torch(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pipeline", "loader.batch_size=abc"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert errors == ["error: loader.batch_size='abc' is not allowed: expected an integer"]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "mlflow" not in imported


@pytest.mark.slow
def test_a_sweep_records_one_run_per_combination(tmp_path: Path) -> None:
    proc = cli("-m", "loader.batch_size=32,64", "trainer.epochs=1", "trainer.max_steps=2", "device=cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    (parent,) = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]  # the sweep's, holding the jobs
    jobs = [r for r in runs if r is not parent]
    assert sorted(r.data.params["loader.batch_size"] for r in jobs) == ["32", "64"]
    assert {r.data.tags["mlflow.parentRunId"] for r in jobs} == {parent.info.run_id}
    assert {r.info.status for r in runs} == {"FINISHED"}


def test_a_stop_with_checkpoints_off_says_no_checkpoint_and_gives_no_resume_advice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import signal

    from helpers import at_training_step
    from pipeline.engine.stopping import StopRequests

    with StopRequests(checkpoints=False):
        os.kill(os.getpid(), signal.SIGTERM)
    warned = " ".join(r.getMessage() for r in caplog.records if r.name == "pipeline.engine.stopping")
    assert "SIGTERM received" in warned and "writing a checkpoint" not in warned
    at_training_step(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    args = ["device=cpu", "trainer.epochs=1", "trainer.max_steps=5", "checkpoint.enabled=false"]
    assert run_main(monkeypatch, *args) == 143
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "stopped by SIGTERM at a step boundary; no checkpoint was written (checkpoint.enabled=false): "
        "the run cannot be resumed"
    )


@pytest.mark.parametrize(
    "override", ["tracking.experiment=${oc.env:PIPELINE_NOT_SET}", "+tracking.tags.owner=${oc.env:PIPELINE_NOT_SET}"]
)
def test_an_unset_environment_variable_is_one_line_naming_it_and_how_to_set_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], override: str
) -> None:
    monkeypatch.delenv("PIPELINE_NOT_SET", raising=False)
    args = [override]
    assert run_main(monkeypatch, *args, "device=cpu") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PIPELINE_NOT_SET is not set" in err
    assert "export PIPELINE_NOT_SET=" in err and "${oc.env:PIPELINE_NOT_SET,<default>}" in err
