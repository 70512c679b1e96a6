"""Precision policy: amp picks bf16 or fp16 by device; fp16 gets a real GradScaler, others a pass-through.

The CPU amp probe: both formats timed on a copy of the model, within a budget, and its advice. The trainer's
device switches: CUDA-only ones refused elsewhere, channels_last refused for the MLP and warned about without amp.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

from pipeline import precision
from pipeline.config import ConfigError, PrecisionConfig, load
from pipeline.precision import (
    AmpProbe,
    Timing,
    amp_advice,
    configure_backends,
    measure,
    probe_batch,
    probe_cpu_amp,
    resolve_precision,
)
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


# --- the CPU amp probe: a float32 and an autocast step of the run's own model, before training ---


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3)
    )


def conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


class Sleepy(nn.Module):
    """A linear layer that sleeps ``fp32_s`` per forward, or ``amp_s`` under CPU autocast, and counts its calls."""

    def __init__(self, fp32_s: float, amp_s: float) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 3)
        self.fp32_s, self.amp_s = fp32_s, amp_s
        self.calls = {"fp32": 0, "amp": 0}  # a plain dict: the probe's deep copy shares it by reference

    def __deepcopy__(self, memo: dict) -> Sleepy:
        twin = Sleepy(self.fp32_s, self.amp_s)
        twin.layer.load_state_dict(self.layer.state_dict())
        twin.calls = self.calls
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amp = torch.is_autocast_enabled("cpu")
        self.calls["amp" if amp else "fp32"] += 1
        time.sleep(self.amp_s if amp else self.fp32_s)
        return self.layer(x.flatten(1))


def batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 4, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)


@pytest.mark.parametrize("make", [mlp, conv_net], ids=["mlp", "conv-batchnorm"])
def test_the_probe_times_both_formats_and_leaves_the_model_and_the_random_stream_untouched(make) -> None:
    torch.manual_seed(0)
    model = make().eval()  # the probe trains a copy; the real model keeps its mode
    images, labels = batch(16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    probe = probe_cpu_amp(model, images, labels, dtype=torch.bfloat16)
    assert probe.fp32_s > 0 and probe.amp_s > 0 and probe.speed > 0
    assert 2 <= probe.batch <= 16 and probe.dtype == "bf16" and not probe.partial
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BatchNorm running stats
    assert any("running_mean" in k for k in before) and any(k.endswith("num_batches_tracked") for k in before)
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_probe_runs_without_the_models_hooks() -> None:
    """Hooks count or record the run's own steps (profilers, tests): the probe's copy must not trigger them."""
    model = mlp()
    calls: list[str] = []
    model.register_forward_pre_hook(lambda m, i: calls.append("pre"))
    model[1].register_forward_hook(lambda m, i, o: calls.append("forward"))
    model[1].register_full_backward_hook(lambda m, gi, go: calls.append("backward"))
    probe = probe_cpu_amp(model, *batch(16), dtype=torch.bfloat16)
    assert probe.speed > 0 and calls == []
    model(batch(4)[0])
    assert calls == ["pre", "forward"]  # the real model keeps its hooks


def test_a_model_much_slower_under_autocast_is_measured_slower_in_a_few_steps() -> None:
    model = Sleepy(fp32_s=0.001, amp_s=0.1)  # a hundredfold: a busy machine's late wake-ups cannot close that gap
    images, labels = batch(16)
    probe = probe_cpu_amp(model, images, labels, dtype=torch.bfloat16, budget_s=2.0)
    assert probe.speed < 1 and not probe.partial and 2 <= probe.batch <= 16
    # a float32 step at batch 2 sizes the probe; then a warm-up and at most three timed steps per format
    assert model.calls["fp32"] <= 2 + 4 and 2 <= model.calls["amp"] <= 4
    advice = amp_advice(probe)
    assert advice is not None and "amp=false is faster" in advice and f"{probe.speed:.2f}x the speed" in advice
    assert f"at batch {probe.batch} " in advice and "bf16 autocast" in advice


def test_an_amp_step_longer_than_the_budget_marks_the_probe_partial_and_stops_there() -> None:
    model = Sleepy(fp32_s=0.001, amp_s=0.6)
    images, labels = batch(16)
    probe = probe_cpu_amp(model, images, labels, dtype=torch.bfloat16, budget_s=0.3)
    assert probe.partial and model.calls["amp"] == 1  # the warm-up alone blew the budget: no second amp step
    assert probe.amp_s >= 0.6 and probe.speed < 1
    advice = amp_advice(probe)
    assert advice is not None and "its first step" in advice and "amp=false" in advice


def test_a_float32_step_longer_than_the_budget_skips_amp_altogether() -> None:
    model = Sleepy(fp32_s=0.3, amp_s=3.0)
    images, labels = batch(16)
    probe = probe_cpu_amp(model, images, labels, dtype=torch.float16, budget_s=0.1)
    assert probe.partial and probe.batch == 2 and probe.dtype == "fp16"
    assert model.calls == {"fp32": 1, "amp": 0} and math.isnan(probe.amp_s)
    assert amp_advice(probe) is None  # amp never ran: nothing to advise


def test_amp_advice_names_the_ratio_and_the_faster_override() -> None:
    advice = amp_advice(AmpProbe(fp32_s=1.7, amp_s=17.0, batch=4, dtype="bf16", partial=False))
    assert advice == (
        "amp=true (bf16 autocast) runs 0.10x the speed of float32 on this CPU: one training step took 17.0 s "
        "vs 1.7 s at batch 4 (measured before training). amp=false is faster here; bfloat16 needs AMX "
        "(or a GPU) to pay off on the CPU."
    )
    assert "120 ms vs 60 ms" in amp_advice(AmpProbe(0.06, 0.12, 2, "fp16", partial=False))


@pytest.mark.parametrize("amp_s", [1.0, 1.05, 0.5])
def test_amp_advice_is_silent_when_amp_is_about_as_fast_or_faster(amp_s: float) -> None:
    assert amp_advice(AmpProbe(fp32_s=1.0, amp_s=amp_s, batch=8, dtype="bf16", partial=False)) is None


def test_the_probe_batch_is_the_largest_that_fits_if_amp_is_ten_times_slower() -> None:
    # (warm-up + step) x (float32 + amp at 10x float32's time) x 10 ms = 0.22 s per sample of batch
    assert probe_batch(0.01, n=64, left_s=4.5) == 20
    assert probe_batch(0.0001, n=64, left_s=4.5) == 64
    assert probe_batch(1.0, n=64, left_s=0.5) == 1


class Clock:
    """A fake ``time.perf_counter`` that moves only when the measured function runs."""

    def __init__(self, durations: list[float]) -> None:
        self.now, self.durations, self.calls = 0.0, durations, 0

    def __call__(self) -> float:
        return self.now

    def run(self) -> None:
        self.now += self.durations[self.calls]
        self.calls += 1


def test_measure_takes_the_median_of_the_calls_after_an_untimed_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock([5.0, 1.0, 3.0, 2.0])
    monkeypatch.setattr(precision.time, "perf_counter", clock)
    assert measure(clock.run, until=100.0, repeats=3) == Timing(2.0, warm=True)
    assert clock.calls == 4


def test_measure_does_not_start_a_call_expected_to_end_past_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock([1.0, 1.0, 1.0, 1.0])
    monkeypatch.setattr(precision.time, "perf_counter", clock)
    assert measure(clock.run, until=2.5, repeats=3) == Timing(1.0, warm=True)
    assert clock.calls == 2  # warm-up ends at 1, a step at 2; the next would end at 3


def test_a_warm_up_past_the_deadline_is_returned_as_a_cold_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock([4.0, 1.0])
    monkeypatch.setattr(precision.time, "perf_counter", clock)
    assert measure(clock.run, until=3.0) == Timing(4.0, warm=False)
    assert clock.calls == 1


# --- trainer switches that only some devices or models act on: refused, or warned about, at start-up ---

CUDA_ONLY = [
    (["trainer.cudnn_benchmark=true"], r"trainer\.cudnn_benchmark=True is not allowed: expected false on {device}: "),
    (
        ["trainer.compile=true", "trainer.compile_mode=reduce-overhead"],
        r"trainer\.compile_mode='reduce-overhead' is not allowed: expected default, max-autotune or "
        r"max-autotune-no-cudagraphs on {device}: reduce-overhead adds CUDA graphs",
    ),
]


@pytest.mark.parametrize("device", ["cpu", "mps"])
@pytest.mark.parametrize(("overrides", "match"), CUDA_ONLY, ids=["cudnn_benchmark", "reduce-overhead"])
def test_a_cuda_only_switch_is_refused_on_an_explicit_other_device(
    device: str, overrides: list[str], match: str
) -> None:
    with pytest.raises(ConfigError, match="^" + match.format(device=device)):
        load([f"device={device}", *overrides])


@pytest.mark.parametrize(("overrides", "match"), CUDA_ONLY, ids=["cudnn_benchmark", "reduce-overhead"])
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


def test_channels_last_is_refused_for_the_mlp_which_has_no_convolutions() -> None:
    with pytest.raises(
        ConfigError, match=r"^trainer\.channels_last=True is not allowed: expected false with model=mlp"
    ):
        load(["trainer.channels_last=true"])
    assert load(["model=resnet18", "trainer.channels_last=true"]).trainer.channels_last


def channels_last_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "pipeline.precision" and r.levelno == logging.WARNING and "channels_last" in r.getMessage()
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
