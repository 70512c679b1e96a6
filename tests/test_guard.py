"""The NaN/inf guard: a non-finite loss stops the run naming the step; float16's skipped steps are counted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

import pipeline.engine.building.build as build_module
import pipeline.engine.checkpointing.checkpoint as checkpoint
from helpers import run_main
from pipeline.config import RunConfig
from pipeline.engine.hot.losses import NonFiniteLoss
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


def poison_step(monkeypatch: pytest.MonkeyPatch, step: int, value: float) -> None:
    """Make the model's output ``value`` (NaN or inf) in training step ``step``."""
    original = build_module.build_model
    calls = {"n": 0}

    def build(*args, **kwargs):
        model = original(*args, **kwargs)

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
            if module.training:
                calls["n"] += 1
                if calls["n"] == step:
                    return output * value
            return None

        model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(build_module, "build_model", build)


def test_a_nan_loss_stops_the_run_naming_the_step(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    poison_step(monkeypatch, 7, float("nan"))
    with pytest.raises(NonFiniteLoss, match=r"training loss became nan at step 7: lower optimizer.lr") as info:
        train(make_cfg("trainer.max_steps=-1", "trainer.log_every_n_steps=5"), echo=False)
    assert info.value.step == 7
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "FAILED" and "NonFiniteLoss" in run.data.tags["error"]
    assert [m.step for m in MlflowClient(store_uri).get_metric_history(run.info.run_id, "train/loss")] == [5]


def test_a_nan_never_overwrites_the_last_good_checkpoint(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, tmp_path: Path
) -> None:
    """With checkpoints every 5 steps and losses read every 100, the step-10 checkpoint would hold NaN weights."""
    poison_step(monkeypatch, 7, float("nan"))
    with pytest.raises(NonFiniteLoss, match="at step 7"):
        train(
            make_cfg("trainer.max_steps=-1", "trainer.log_every_n_steps=100", "checkpoint.every_n_steps=5"), echo=False
        )
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    saved = checkpoint.load(tmp_path / "checkpoints" / run.info.run_id / "last.pt")
    assert saved["position"].step == 5
    assert all(torch.isfinite(v).all() for v in saved["model"].values() if v.is_floating_point())


def test_an_infinite_loss_in_the_last_unlogged_steps_is_caught_too(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison_step(monkeypatch, 3, float("inf"))
    with pytest.raises(NonFiniteLoss, match=r"became (nan|inf) at step 3"):
        train(make_cfg("tracking=none", "trainer.log_every_n_steps=100"), echo=False)


def test_the_cli_reports_it_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    poison_step(monkeypatch, 2, float("nan"))
    assert run_main(monkeypatch, "device=cpu", "tracking=none") == 2
    assert capsys.readouterr().err.startswith("error: training loss became nan at step 2")


def test_float16_skipped_steps_are_counted_not_fatal(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    base = ["amp=true", "precision=fp16", "trainer.max_steps=12"]  # float16 on a CPU is emulated: a few steps
    clean = train(make_cfg(*base, "tracking=none"), echo=False)
    poison_step(monkeypatch, 4, float("inf"))
    result = train(make_cfg(*base), echo=False)  # the GradScaler skips that step; training goes on
    assert result.steps == clean.steps == 12
    client = MlflowClient(store_uri)
    (run,) = client.search_runs(experiment_ids=["1"])
    assert run.info.status == "FINISHED"
    skipped = client.get_metric_history(run.info.run_id, "amp/skipped_steps")[0].value
    assert skipped >= 1
