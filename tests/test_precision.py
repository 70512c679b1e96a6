"""Precision policy: amp picks bf16 or fp16 by device; fp16 gets a real GradScaler, others a pass-through.

The trainer's device switches: CUDA-only ones refused elsewhere, channels_last refused for the MLP and warned about
without amp. (The CPU amp check: ``test_amp_check``.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from pipeline.config import ConfigError, PrecisionConfig, load
from pipeline.engine.building.precision_setup import configure_backends, resolve_precision
from pipeline.train import train

AUTO = PrecisionConfig("auto", tf32=True)


def test_amp_off_is_plain_float32_without_a_scaler() -> None:
    policy = resolve_precision(AUTO, amp=False, device=torch.device("cpu"))
    assert policy.dtype is None and policy.label == "fp32"
    assert not policy.make_scaler().is_enabled()
    with policy.autocast():
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.float32


def test_amp_auto_on_the_cpu_is_bfloat16_and_autocast_really_applies() -> None:
    policy = resolve_precision(AUTO, amp=True, device=torch.device("cpu"))
    assert policy.dtype == torch.bfloat16 and policy.label == "amp-bf16" and not policy.uses_scaler
    layer = torch.nn.Linear(4, 3)
    with policy.autocast():
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16


def test_forced_fp16_uses_an_enabled_grad_scaler() -> None:
    policy = resolve_precision(PrecisionConfig("fp16", tf32=True), amp=True, device=torch.device("cpu"))
    assert policy.dtype == torch.float16 and policy.label == "amp-fp16"
    assert policy.make_scaler().is_enabled()


@pytest.mark.parametrize(("capability", "expected"), [((7, 5), torch.float16), ((8, 0), torch.bfloat16)])
def test_amp_auto_on_cuda_follows_bf16_support(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    policy = resolve_precision(AUTO, amp=True, device=torch.device("cuda", 0))
    assert policy.dtype == expected
    assert policy.uses_scaler == (expected == torch.float16)


# --- trainer switches that only some devices or models act on: refused, or warned about, at start-up ---

CUDA_ONLY = [
    (["trainer.cudnn_benchmark=true"], r"trainer\.cudnn_benchmark=True is not allowed: expected false on {device}: "),
    (
        ["trainer.compile=true", "trainer.compile_mode=reduce-overhead"],
        r"trainer\.compile_mode='reduce-overhead' is not allowed: expected default, max-autotune or "
        r"max-autotune-no-cudagraphs on {device}: reduce-overhead adds CUDA graphs",
    ),
    (
        ["trainer.memory_snapshot=on_oom"],
        r"trainer\.memory_snapshot='on_oom' is not allowed: expected off on {device}: the allocator's history is "
        r"recorded only on CUDA GPUs",
    ),
]
CUDA_ONLY_IDS = ["cudnn_benchmark", "reduce-overhead", "memory_snapshot"]


@pytest.mark.parametrize("device", ["cpu", "mps"])
@pytest.mark.parametrize(("overrides", "match"), CUDA_ONLY, ids=CUDA_ONLY_IDS)
def test_a_cuda_only_switch_is_refused_on_an_explicit_other_device(
    device: str, overrides: list[str], match: str
) -> None:
    with pytest.raises(ConfigError, match="^" + match.format(device=device)):
        load([f"device={device}", *overrides])


@pytest.mark.parametrize(("overrides", "match"), CUDA_ONLY, ids=CUDA_ONLY_IDS)
def test_a_cuda_only_switch_is_refused_once_device_auto_chose_the_cpu_before_any_run_exists(
    make_cfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, overrides: list[str], match: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # auto chooses the CPU on any machine
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    cfg = make_cfg("device=auto", *overrides)  # valid as composed: auto may yet find a GPU
    with pytest.raises(ConfigError, match="^" + match.format(device="cpu") + r".*\(device=cpu was chosen\)$"):
        train(cfg, echo=False)
    assert not Path("mlflow.db").exists() or not MlflowClient(store_uri).search_runs(experiment_ids=["0", "1"])


@pytest.fixture
def cuda_switches():
    """The process-wide CUDA switches, put back afterwards (monkeypatch cannot: torch's cuBLAS module proxies them)."""
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_cuda_only_switches_are_set_on_cuda(cuda_switches) -> None:
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    trainer = load(["trainer.cudnn_benchmark=true", "trainer.compile=true"]).trainer
    backends = configure_backends(PrecisionConfig("auto", tf32=False), trainer, torch.device("cuda", 0), amp=True)
    assert backends == {"tf32": "false", "cudnn_benchmark": "true"}
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cuda.matmul.allow_tf32


def test_channels_last_is_refused_for_the_mlp_which_has_no_convolutions(make_cfg) -> None:
    from pipeline.engine.building.build import build

    with pytest.raises(
        ConfigError, match=r"^trainer\.channels_last=True is not allowed: expected false for Sequential: .* no Conv2d"
    ):
        build(make_cfg("trainer.channels_last=true"))
    assert load(["model=resnet18", "trainer.channels_last=true"]).trainer.channels_last


def channels_last_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "pipeline.engine.precision" and r.levelno == logging.WARNING and "channels_last" in r.getMessage()
    ]


@pytest.mark.parametrize(("amp", "warned"), [(False, 1), (True, 0)])
def test_channels_last_without_amp_is_warned_about_and_with_amp_is_not(
    caplog: pytest.LogCaptureFixture, amp: bool, warned: int
) -> None:
    trainer = load(["model=resnet18", "trainer.channels_last=true"]).trainer
    with caplog.at_level(logging.WARNING):
        assert configure_backends(AUTO, trainer, torch.device("cpu"), amp=amp) == {
            "tf32": "n/a",
            "cudnn_benchmark": "n/a",
        }
    messages = channels_last_warnings(caplog)
    assert len(messages) == warned
    if warned:
        assert "often slower in float32" in messages[0] and "add amp=true" in messages[0]


def test_a_channels_last_run_without_amp_warns_once_at_build(make_cfg, caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_cfg(
        "model=resnet18",
        "tracking=none",
        "data=synthetic",
        "data.shape=[3,16,16]",
        "data.num_samples=8",
        "data.val_samples=4",
        "loader.batch_size=4",
        "trainer.channels_last=true",
        "trainer.epochs=2",
    )
    with caplog.at_level(logging.WARNING):
        result = train(cfg, echo=False)
    assert len(result.epochs) == 2 and len(channels_last_warnings(caplog)) == 1  # at build, not per epoch or step
