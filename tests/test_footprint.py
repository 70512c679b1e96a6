"""A model or input too large for the machine is refused before it is allocated, with the estimate and the free
memory; memory that still runs out ends the run in one line, recorded FAILED. Free memory is faked: nothing big is
ever allocated here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

import pipeline.common.device_memory as device_memory
import pipeline.engine.building.build as build_module
import pipeline.engine.building.footprint as footprint
from helpers import run_main, without_first_batch_check
from pipeline import autotune
from pipeline.common.device_memory import DoesNotFit, Free
from pipeline.config import DataConfig, RunConfig
from pipeline.data import load_data
from pipeline.engine.building.footprint import estimate
from pipeline.engine.hot.memory import OutOfMemory
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]
GB = 10**9


@pytest.fixture
def free_gb(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """``free_gb(2)``: the host (and any device) has 2 GB free, whatever this machine has."""

    def fake(gb: float) -> None:
        for module in (device_memory, footprint):  # the data's check and the training state's
            monkeypatch.setattr(module, "free_memory", lambda device: Free(int(gb * GB), "available host memory"))

    return fake


def test_the_estimate_counts_parameters_gradients_optimizer_state_and_the_micro_batch(make_cfg: MakeCfg) -> None:
    cfg = make_cfg("model.hidden_sizes=[100]", "optimizer=adamw")
    got = estimate(cfg, in_shape=(1, 28, 28), num_classes=10, samples=4)
    parameters = 784 * 100 + 100 + 100 * 10 + 10
    assert got.parameters == parameters
    assert got.state_bytes == parameters * 4 * 4  # weights, gradients, AdamW's two moments: float32 each
    assert got.batch_bytes == 4 * (784 + 100 + 10) * 4  # the input and both linear layers' outputs, float32
    sgd = estimate(make_cfg("model.hidden_sizes=[100]"), in_shape=(1, 28, 28), num_classes=10, samples=4)
    assert sgd.state_bytes == parameters * 4 * 3  # SGD keeps one momentum buffer


def test_a_model_too_large_for_the_free_memory_is_refused_with_the_estimate(
    make_cfg: MakeCfg, free_gb: Callable[[float], None], store_uri: str
) -> None:
    free_gb(2)
    with pytest.raises(DoesNotFit) as info:
        train(make_cfg("model.hidden_sizes=[100000000]"), echo=False)
    message = str(info.value)
    assert message.startswith(
        "model=mlp model.hidden_sizes=[100000000] on 1x28x28 inputs needs at least 954.4 GB to train (954.0 GB for "
        "79,500,000,010 parameters, their gradients and the optimizer's state; 400 MB for a micro-batch of 1)"
    )
    assert "the available host memory is 2.0 GB" in message
    assert not Path(store_uri.removeprefix("sqlite:///")).exists()  # refused before any run was opened


def test_an_input_too_large_for_the_model_is_refused_with_the_activations_it_needs(
    make_cfg: MakeCfg, free_gb: Callable[[float], None]
) -> None:
    free_gb(2)
    cfg = make_cfg("model=resnet18")
    with pytest.raises(DoesNotFit) as info:
        footprint.check_training(cfg, in_shape=(3, 20000, 20000), num_classes=10, device=torch.device("cpu"))
    message = str(info.value)
    assert message.startswith("model=resnet18 on 3x20000x20000 inputs needs at least ")
    parts = estimate(cfg, in_shape=(3, 20000, 20000), num_classes=10, samples=1)
    assert parts.batch_bytes > 100 * parts.state_bytes  # the activations of one image, not the 11.7 M parameters
    assert f"{device_memory.size(parts.batch_bytes)} for a micro-batch of 1" in message


@pytest.mark.parametrize(
    ("config", "start"),
    [
        (DataConfig("digits", image_size=100000), "data=digits at data.image_size=100000 needs at least 89,850.0 GB"),
        (
            DataConfig("synthetic", val_samples=1_000_000_000),
            "data=synthetic with 1,000,010,000 samples of [1, 28, 28] needs at least 784.0 GB",
        ),
    ],
    ids=["digits upsampled", "synthetic samples"],
)
def test_data_too_large_for_the_host_is_refused_before_it_is_made(
    free_gb: Callable[[float], None], config: DataConfig, start: str
) -> None:
    free_gb(2)
    with pytest.raises(DoesNotFit) as info:
        load_data(config)
    assert str(info.value).startswith(start) and "the available host memory is 2.0 GB: use " in str(info.value)


def test_an_ordinary_run_fits(make_cfg: MakeCfg, free_gb: Callable[[float], None]) -> None:
    free_gb(0.2)
    assert train(make_cfg("tracking=none", "trainer.max_steps=1"), echo=False).steps == 1


def test_the_cli_and_autotune_refuse_it_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], free_gb: Callable[[float], None]
) -> None:
    free_gb(2)
    assert run_main(monkeypatch, "device=cpu", "model.hidden_sizes=[100000000]") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model=mlp model.hidden_sizes=[100000000] on 1x28x28") and err.count("\n") == 1
    assert autotune.main(["device=cpu", "tracking=none", "data=synthetic", "data.val_samples=1000000000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data=synthetic with 1,000,010,000 samples") and err.count("\n") == 1, err


def _cpu_out_of_memory_in_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    original = build_module.build_model
    without_first_batch_check(monkeypatch)  # faults in the run only

    def build(*args, **kwargs):
        model = original(*args, **kwargs)

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if not module.training:  # evaluation: its own fallback shrinks, then gives up at the minimum
                raise RuntimeError(
                    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                    "to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"
                )

        model.register_forward_pre_hook(hook)
        return model

    monkeypatch.setattr(build_module, "build_model", build)


def test_a_real_cpu_out_of_memory_ends_the_run_failed_in_one_line(
    monkeypatch: pytest.MonkeyPatch, make_cfg: MakeCfg, store_uri: str
) -> None:
    _cpu_out_of_memory_in_evaluation(monkeypatch)
    with pytest.raises(OutOfMemory, match=r"^out of memory \(\[enforce fail .* DefaultCPUAllocator: can't allocate"):
        train(make_cfg("oom.enabled=false"), echo=False)
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "FAILED" and "DefaultCPUAllocator: can't allocate memory" in run.data.tags["error"]


def test_the_cli_reports_a_real_out_of_memory_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cpu_out_of_memory_in_evaluation(monkeypatch)
    assert run_main(monkeypatch, "device=cpu", "tracking=none", "trainer.max_steps=2", "oom.enabled=false") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory ([enforce fail") and err.count("\n") == 1, err


class _ReadsValues(nn.Module):
    """A user's forward that fails in its own way on the meta device: a lookup keyed by the input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = {"cpu": 1.0, "cuda": 1.0}[x.device.type]  # KeyError on meta, not one of torch's errors
        return self.linear(x) * scale


def test_a_user_forward_that_fails_on_meta_leaves_the_state_floor_and_the_model_in_training_mode(
    make_cfg: MakeCfg,
) -> None:
    model = _ReadsValues().train()
    made = estimate(make_cfg(), in_shape=(4,), num_classes=2, samples=8, model=model)
    assert made.parameters == 10 and made.state_bytes == 10 * 4 * 3  # weights, gradients, SGD momentum
    assert made.batch_bytes == 8 * 4 * 4  # the input alone: no activations could be measured
    assert model.training  # the estimate's eval() is undone
