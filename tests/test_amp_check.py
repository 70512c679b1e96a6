"""The CPU amp check: the run's model timed in both formats on a copy, at a batch fixed by arithmetic, in
interleaved pairs; a verdict with a dead band; advice and hints that follow the measurement and the CPU's flags."""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import machine, split
from pipeline.config import load
from pipeline.engine.building import amp_check
from pipeline.engine.building.amp_check import AmpProbe, amp_advice, cpu_flags, probe_batch, probe_cpu_amp
from pipeline.report.verdict import RunFacts, judge


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


def batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 4, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)


class Machine:
    """The probe's clock: it moves only when the model below computes, by a step's cost times some noise."""

    def __init__(self, seed: int, noise: float, burst_every: int = 0) -> None:
        self.now, self.rng, self.noise, self.burst_every, self.steps = 0.0, random.Random(seed), noise, burst_every, 0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.steps += 1
        burst = 3.0 if self.burst_every and self.steps % self.burst_every == 0 else 1.0  # a neighbour's job
        self.now += seconds * burst * (1 + self.rng.uniform(-self.noise, self.noise))


class Costed(nn.Module):
    """A linear layer whose every forward costs ``fp32_s`` on the machine's clock, or ``amp_s`` under autocast."""

    def __init__(self, machine: Machine, fp32_s: float, amp_s: float) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 3)
        self.machine, self.fp32_s, self.amp_s = machine, fp32_s, amp_s
        self.calls = {"fp32": 0, "amp": 0}

    def __deepcopy__(self, memo: dict) -> Costed:  # the probe's copy runs on the same machine, counted alike
        twin = Costed(self.machine, self.fp32_s, self.amp_s)
        twin.layer = copy.deepcopy(self.layer, memo)
        twin.calls = self.calls
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amp = torch.is_autocast_enabled("cpu")
        if torch.is_grad_enabled():  # the FLOP count's no-grad forward costs nothing here
            self.calls["amp" if amp else "fp32"] += 1
            self.machine.spend(self.amp_s if amp else self.fp32_s)
        return self.layer(x.flatten(1))


@pytest.mark.parametrize("make", [mlp, conv_net], ids=["mlp", "conv-batchnorm"])
def test_the_probe_times_both_formats_and_leaves_the_model_and_the_random_stream_untouched(make) -> None:
    torch.manual_seed(0)
    model = make().eval()  # the probe trains a copy; the real model keeps its mode
    images, labels = batch(16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    probe = probe_cpu_amp(model, (images, labels), dtype=torch.bfloat16)
    assert probe.fp32_s > 0 and probe.amp_s > 0 and probe.speed > 0 and probe.measured
    assert probe.batch == 16 and probe.dtype == "bf16" and 1 <= probe.pairs <= amp_check.PAIRS
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
    probe = probe_cpu_amp(model, batch(16), dtype=torch.bfloat16)
    assert probe.speed > 0 and calls == []
    model(batch(4)[0])
    assert calls == ["pre", "forward"]  # the real model keeps its hooks


def test_the_probe_batch_is_the_runs_own_capped_by_arithmetic_not_by_how_busy_the_machine_is() -> None:
    images = torch.randn(256, 1, 4, 4)
    assert probe_batch(mlp(), images, 64) == 64  # a small model: the run's own batch
    with torch.device("meta"):  # FLOPs are counted by shape: the large models' weights need not exist
        wide = nn.Sequential(nn.Flatten(), nn.Linear(16, 400_000), nn.Linear(400_000, 3))  # 2 x 7.6 MFLOP a sample
        huge = nn.Sequential(nn.Flatten(), nn.Linear(16, 40_000_000))
    shapes = images.to("meta")
    flops = 3 * 2 * (16 * 400_000 + 400_000 * 3)
    assert probe_batch(wide, shapes, 256) == int(amp_check.PROBE_FLOPS // flops) == 175  # fixed by the model
    assert probe_batch(huge, shapes, 256) == amp_check.PROBE_MIN_BATCH


def test_identical_configurations_get_the_same_verdict_on_a_noisy_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten runs of the same config: steps vary ±20% and every third step meets a burst of load three times as
    slow; the median of interleaved pairs keeps a clear verdict where it belongs, at one batch."""
    for true_speed, verdict in ((0.5, "slower"), (4.27, "faster")):
        batches = set()
        for seed in range(10):
            machine = Machine(seed, noise=0.2, burst_every=3)
            monkeypatch.setattr(amp_check, "time", machine)
            probe = probe_cpu_amp(Costed(machine, fp32_s=0.1, amp_s=0.1 / true_speed), batch(16), dtype=torch.bfloat16)
            assert probe.verdict == verdict, (true_speed, seed, probe.speed)
            batches.add(probe.batch)
        assert batches == {16}


def test_on_a_quiet_machine_identical_configurations_agree_within_15_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    for true_speed, verdict in ((0.5, "slower"), (1.0, "same"), (1.5, "faster")):
        for seed in range(10):
            machine = Machine(seed, noise=0.05)  # a quiet machine: ±5% from step to step
            monkeypatch.setattr(amp_check, "time", machine)
            probe = probe_cpu_amp(Costed(machine, 0.1, 0.1 / true_speed), batch(16), dtype=torch.bfloat16)
            assert true_speed / 1.15 <= probe.speed <= true_speed * 1.15 and probe.verdict == verdict


def test_no_pair_starts_past_the_budget_and_a_probe_without_one_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = Machine(0, noise=0.0)
    monkeypatch.setattr(amp_check, "time", machine)
    model = Costed(machine, fp32_s=0.5, amp_s=5.0)
    probe = probe_cpu_amp(model, batch(16), dtype=torch.bfloat16, budget_s=1.0)
    assert model.calls == {"fp32": 2, "amp": 2} and probe.pairs == 0  # warm-up and calibration used the budget
    assert not probe.measured and probe.verdict == "unknown" and math.isnan(probe.speed)
    assert amp_advice(probe) is None
    said = probe.describe()
    assert "was not measured" in said and "nan" not in said and "0.00 s" not in said
    enough = probe_cpu_amp(Costed(machine, 0.5, 5.0), batch(16), dtype=torch.bfloat16, budget_s=17.5)
    assert enough.pairs == 1 and enough.speed == pytest.approx(0.1)  # 11 s of warm-up and calibration, one pair


def test_the_advice_names_the_measured_ratio_and_what_the_cpu_has() -> None:
    slow = AmpProbe(fp32_s=1.7, amp_s=17.0, speed=0.1, batch=4, pairs=5, dtype="bf16", amx=False)
    assert amp_advice(slow) == (
        "amp=true: bf16 autocast ran at 0.10x float32's speed on this CPU (median of 5 interleaved pair(s) at batch "
        "4: 17.0 s vs 1.7 s a step, before training): amp=false is faster here; this CPU has no AMX (no amx_bf16 in "
        "its flags), so bfloat16 is not computed natively. Train with amp=false, or on a GPU."
    )
    with_amx = AmpProbe(0.06, 0.12, 0.5, 2, 3, "bf16", amx=True)
    assert "this CPU has AMX (amx_bf16), yet this model's bfloat16 steps are slower" in amp_advice(with_amx)
    assert "120 ms vs 60 ms" in amp_advice(with_amx)
    for speed in (1.0, 1.05, 0.95, 4.27):  # faster, or within the dead band: nothing to warn about
        assert amp_advice(AmpProbe(1.0, 1.0 / speed, speed, 8, 5, "bf16", amx=False)) is None


def test_a_check_timed_below_the_runs_batch_says_which_question_it_answered() -> None:
    """bf16's gain grows with the batch (the weights are cast every step): a check capped at batch 2 for a run at
    batch 128 must say so, or its '0.56x' reads as a claim about the run's own epochs."""
    capped = AmpProbe(1.0, 1.8, 0.56, 2, 5, "bf16", amx=True, run_batch=128).describe()
    assert "at batch 2" in capped and "the run's batch is 128" in capped and "may gain more" in capped
    whole = AmpProbe(1.0, 1.8, 0.56, 64, 5, "bf16", amx=True, run_batch=64).describe()
    assert "the run's batch" not in whole


def test_the_doctors_bf16_figure_says_it_is_one_large_op_not_the_model() -> None:
    from pipeline.machine.facts import Facts
    from pipeline.machine.host_checks import cpu_bf16_check

    evidence = cpu_bf16_check(Facts(cpu_bf16_matmul_speed=2.31, cpu_bf16_conv_speed=1.5)).evidence
    assert "2.31x float32 for a single 1024x1024 matmul" in evidence and "times the run's own model" in evidence


def test_every_later_hint_follows_the_measurement() -> None:
    cfg = load(["device=cpu", "amp=true", "model=resnet50"])
    fast = AmpProbe(1.0, 0.234, 4.27, 2, 5, "bf16", amx=True)
    hint = judge(cfg, RunFacts("cpu", "amp-bf16", amp_check=fast), split(), machine()).message
    assert "amp pays off here (4.27x float32 measured at start): keep amp=true" in hint and "usually" not in hint
    slow = AmpProbe(1.0, 2.0, 0.5, 2, 5, "bf16", amx=False)
    hint = judge(cfg, RunFacts("cpu", "amp-bf16", amp_check=slow), split(), machine()).message
    assert "amp=false is faster here (0.50x float32 measured at start)" in hint
    assert fast.describe().endswith("before training): amp pays off here")


def test_a_step_too_short_to_time_is_repeated_within_each_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = Machine(0, noise=0.0)
    monkeypatch.setattr(amp_check, "time", machine)
    model = Costed(machine, fp32_s=0.002, amp_s=0.004)  # a small MLP's milliseconds
    probe = probe_cpu_amp(model, batch(16), dtype=torch.bfloat16)
    assert probe.fp32_s == pytest.approx(0.002) and probe.speed == pytest.approx(0.5)  # seconds per step
    per_pair = (model.calls["fp32"] - 2) / probe.pairs
    assert per_pair == math.ceil(amp_check.MIN_CALL_S / 0.002)  # 25 steps a measurement: 50 ms of work


def test_the_cpu_flags_are_read_not_assumed(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile\n\n")
    assert cpu_flags(str(info)) >= {"amx_bf16", "avx512_bf16"}
    other = tmp_path / "cpuinfo-amd"
    other.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert "amx_bf16" not in cpu_flags(str(other))
    assert cpu_flags(str(tmp_path / "missing")) is None
