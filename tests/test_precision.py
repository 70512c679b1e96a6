"""Precision policy: amp picks bf16 or fp16 by device; fp16 gets a real GradScaler, others a pass-through."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import PrecisionConfig
from pipeline.precision import resolve_precision

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
