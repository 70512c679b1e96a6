"""Sweeps (``python -m pipeline -m ...``) are validated job by job before the first job starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers import run_main
from pipeline.common.errors import OverrideError
from pipeline.config import sweep_jobs

TINY = ["device=cpu", "trainer.max_steps=1", "trainer.epochs=1"]


def test_a_sweep_is_expanded_as_hydras_basic_sweeper_does() -> None:
    jobs = sweep_jobs(["loader.batch_size=16,32", "optimizer.lr=range(1,3)", "device=cpu", "hydra.job.chdir=false"])
    assert jobs == [
        ["loader.batch_size=16", "optimizer.lr=1", "device=cpu"],
        ["loader.batch_size=16", "optimizer.lr=2", "device=cpu"],
        ["loader.batch_size=32", "optimizer.lr=1", "device=cpu"],
        ["loader.batch_size=32", "optimizer.lr=2", "device=cpu"],
    ]
    assert sweep_jobs(["model=glob(resnet*)"]) == [["model=resnet18"], ["model=resnet50"]]
    assert sweep_jobs(["loader.batch_size=choice(8,16)"]) == [["loader.batch_size=8"], ["loader.batch_size=16"]]


@pytest.mark.parametrize(
    "overrides",
    [
        ["optimizer.lr=interval(0.001,0.1)"],  # a continuous search space (Optuna's): no list of jobs to check
        ["hydra/sweeper=other", "loader.batch_size=16,0"],  # another sweeper chooses the jobs
    ],
)
def test_sweeps_the_basic_sweeper_cannot_list_are_left_to_hydra(overrides: list[str]) -> None:
    assert sweep_jobs(overrides) is None


def test_an_unparsable_sweep_is_a_one_line_override_error() -> None:
    with pytest.raises(OverrideError, match=r"^cannot parse the overrides 'loader\.batch_size=\[1'") as info:
        sweep_jobs(["loader.batch_size=[1"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("sweep", "job", "problem"),
    [
        (["loader.batch_size=32,0,64"], "loader.batch_size=0", "loader.batch_size=0 is not allowed"),
        (["loader.batch_size=range(0,64,32)"], "loader.batch_size=0", "loader.batch_size=0 is not allowed"),
        (["optimizer.lr=choice(0.1,inf)"], "optimizer.lr=inf", "optimizer.lr=inf is not allowed"),
        (["data=glob([digits,image*])"], "data=imagefolder", "data.root is required"),
        (["loader.batch_size=16,32", "optimizer.lr=0"], "loader.batch_size=16 optimizer.lr=0", "optimizer.lr=0 "),
    ],
)
def test_a_sweep_with_a_bad_job_exits_2_before_any_job_runs(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    sweep: list[str],
    job: str,
    problem: str,
) -> None:
    assert run_main(monkeypatch, "-m", *sweep, *TINY) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: sweep job ")
    assert f"({job} " in captured.err and problem in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no mlflow.db, no mlruns/, no multirun/
    assert "Launching" not in captured.out


def test_the_bad_job_is_named_with_its_place_in_the_sweep(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(monkeypatch, "-m", "loader.batch_size=32,0,64", *TINY) == 2
    assert capsys.readouterr().err == (
        "error: sweep job 2 of 3 (loader.batch_size=0 device=cpu trainer.max_steps=1 trainer.epochs=1): "
        "loader.batch_size=0 is not allowed: expected an integer >= 1; no job was started\n"
    )


def test_a_good_sweep_runs_every_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert run_main(monkeypatch, "-m", "loader.batch_size=16,32", *TINY, "monitor.plots=false") == 0
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    jobs = [r for r in runs if r.data.tags.get("sweep.role") != "parent"]  # the sweep's parent run has no params
    assert sorted(r.data.params["loader.batch_size"] for r in jobs) == ["16", "32"]
    assert {r.info.status for r in runs} == {"FINISHED"}


@pytest.mark.parametrize("args", [["-m", "--help", "loader.batch_size=0"], ["--cfg", "job", "loader.batch_size=16"]])
def test_help_and_cfg_are_left_to_hydra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    assert run_main(monkeypatch, *args) == 0
    assert "batch_size: " in capsys.readouterr().out


@pytest.mark.slow
def test_a_bad_sweep_in_a_real_process_is_refused_without_importing_torch(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pipeline", "-m", "loader.batch_size=32,0", "device=cpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1 and "loader.batch_size=0" in errors[0], errors
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "mlflow" not in imported
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sweeper", [[], ["hydra/sweeper=basic"]])
def test_an_interval_without_an_optuna_search_is_one_line_naming_hparams_search(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sweeper: list[str]
) -> None:
    assert run_main(monkeypatch, "-m", *sweeper, "optimizer.lr=interval(0.1,0.2)", *TINY) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: optimizer.lr=interval(0.1,0.2) needs an Optuna search: add hparams_search=")
    assert err.count("\n") == 1 and not (tmp_path / "mlflow.db").exists()


def test_an_interval_in_an_optuna_search_is_left_to_optuna() -> None:
    from pipeline.config import check_search_space

    check_search_space(["hparams_search=accuracy_optuna", "optimizer.lr=interval(0.1,0.2)"])  # raises nothing
