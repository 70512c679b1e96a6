"""The verdict from evidence: a run that wastes its step in one operator group is told which, with its share, by a
profile it takes by itself; the auto profile's own gates (low MFU, 2% of the run) and the CPU's hints."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient

import pipeline.engine.observe.profiling as profiling
from helpers import machine, split
from pipeline.config import RunConfig
from pipeline.engine.hot.timing import WallTimer
from pipeline.engine.observe.profile_report import Operator, ProfileReport
from pipeline.engine.observe.profiling import AUTO_STEPS, AutoProfiler
from pipeline.report.operators import operator_groups
from pipeline.report.verdict import Mfu, Profiled, RunFacts, judge
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]

WASTEFUL = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def words(n=512, width=16, classes=1000):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, width, generator=g), torch.arange(n) % classes
    return TensorDataset(x[:448], y[:448]), TensorDataset(x[448:], y[448:])


def grids(n=256, side=48, classes=4):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, side, side, generator=g), torch.arange(n) % classes
    return TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])


class LogProbabilities(nn.Module):
    """Returns log-probabilities, as published language models do; the default task's loss applies log_softmax
    to them once more."""

    def __init__(self, num_classes):
        super().__init__()
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        return F.log_softmax(self.fc(x), dim=-1)


class Transposer(nn.Module):
    """Works on its inputs transposed, and transposes back, each made contiguous: two copies a step and their
    backward's."""

    def __init__(self, num_classes, side=48):
        super().__init__()
        self.mix, self.head = nn.Linear(side, side), nn.Linear(side, num_classes)

    def forward(self, x):
        h = self.mix(x.transpose(1, 2).contiguous())
        return self.head(h.transpose(1, 2).contiguous().mean(1))
'''


@pytest.fixture
def wasteful(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "wasteful.py").write_text(WASTEFUL.lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wasteful", raising=False)
    return __import__("wasteful")


@pytest.fixture
def profiles_short_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The auto profile looks at these short runs whatever their MFU and length: the gates have their own tests
    below, and a test run long enough for 2% to cover three profiled steps would take a minute."""
    monkeypatch.setattr(profiling, "AUTO_BUDGET", 1.0)
    monkeypatch.setattr(profiling, "LOW_MFU_PCT", 101.0)


def test_a_model_whose_loss_applies_log_softmax_again_is_told_so_with_its_share(
    make_cfg: MakeCfg, wasteful: Any, profiles_short_runs: None, quiet_machine: None, store_uri: str
) -> None:
    model = [
        "model=custom",
        "model._target_=wasteful.LogProbabilities",
        "data=custom",
        "data._target_=wasteful.words",
        "data.num_classes=1000",
    ]
    run = ["trainer.max_steps=-1", "trainer.epochs=2", "loader=resident", "loader.batch_size=32"]
    result = train(make_cfg(*model, *run), echo=False)
    assert result.profile is not None and result.profile.auto and result.profile.steps == AUTO_STEPS
    assert result.profile.first > 14  # the second half of the run's 28 steps: never its first epoch's first steps
    assert "log_softmax on log-probabilities" in result.verdict and "2 calls a step" in result.verdict
    assert "set task.outputs=log_probs" in result.verdict
    tags = MlflowClient(store_uri).get_run(result.run_id).data.tags
    assert tags["verdict.top_ops"].startswith("log_softmax on log-probabilities ") or (
        "log_softmax on log-probabilities " in tags["verdict.top_ops"]
    )
    share = float(tags["verdict.top_ops"].split("log_softmax on log-probabilities ")[1].split("%")[0])
    assert share >= 5  # named only from NAMED_PCT on; its share of the profiled steps' time
    # the class follows the measured shares, which a busy machine moves (its data wait is timed too): not pinned here
    assert tags["verdict.class"] in ("input", "overhead", "compute")
    assert tags["verdict.confidence"] in ("high", "medium", "low")
    metrics = MlflowClient(store_uri).get_run(result.run_id).data.metrics
    assert metrics["profile/steps"] == AUTO_STEPS and metrics["profile/cost_s"] > 0
    assert "profile/trace.json.gz" not in {
        a.path for a in MlflowClient(store_uri).list_artifacts(result.run_id, "profile")
    }


def test_a_model_that_transposes_and_copies_every_step_is_told_its_copies_share(
    make_cfg: MakeCfg, wasteful: Any, profiles_short_runs: None, quiet_machine: None
) -> None:
    model = [
        "model=custom",
        "model._target_=wasteful.Transposer",
        "data=custom",
        "data._target_=wasteful.grids",
        "data.num_classes=4",
    ]
    run = ["trainer.max_steps=-1", "trainer.epochs=2", "tracking=none", "loader=resident"]  # no loader to wait for
    result = train(make_cfg(*model, *run), echo=False)
    assert result.profile is not None and result.profile.auto
    assert "copies and layout changes" in result.verdict and "keep one layout through the step" in result.verdict
    copies = [g for g in operator_groups(result.profile, outputs="logits", device_type="cpu") if "copies" in g.name]
    assert copies and copies[0].share_pct >= 5 and "copy_" in copies[0].detail


def test_the_default_mlp_on_a_cpu_gets_the_cpus_own_hints_before_a_gpu(make_cfg: MakeCfg, quiet_machine: None) -> None:
    result = train(make_cfg("tracking=none", "trainer.max_steps=-1", "trainer.epochs=1", tiny=False), echo=False)
    hint = result.verdict.split(" — ", 1)[1]
    assert result.bottleneck != "input" or "moderately" in result.verdict  # the MLP's loader: 15-20% of its step
    for cpu_first in ("loader.batch_size=128", "trainer.compile=true"):
        assert hint.index(cpu_first) < hint.index("no GPU that torch can use"), hint
    assert "train on a GPU (device=cuda)" not in result.verdict


# --- the auto profile's gates, on a fake clock ---


class Ticks:
    """A wall clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drive(profiler: AutoProfiler, ticks: Ticks, *, steps: int, step_s: float, total: int) -> list[int]:
    """``steps`` steps of ``step_s`` each through the profiler's marks; the steps at which it started."""
    done = [0]
    profiler.wrap(WallTimer(), step=lambda: done[0], total=total, began=ticks.now)
    started = []
    for _ in range(steps):
        ticks.now += step_s
        done[0] += 1
        was = profiler._stage
        profiler.step_ended()
        profiler.step_marked(False, samples=32)
        if was == "waiting" and profiler._stage == "active":
            started.append(done[0])
    return started


class FakeTorchProfiler:
    def start(self) -> None: ...

    def stop(self) -> None: ...


def test_the_auto_profile_starts_in_the_runs_second_half_when_it_fits_in_two_percent() -> None:
    ticks = Ticks()
    profiler = AutoProfiler(torch.device("cpu"), mfu_pct=lambda speed: 4.0, make=FakeTorchProfiler, clock=ticks)
    assert drive(profiler, ticks, steps=1000, step_s=0.05, total=1000) == [500]  # 50 s of run: 1 s of budget
    assert profiler.skipped == ""


def test_a_run_too_short_for_two_percent_is_not_profiled_and_says_why() -> None:
    ticks = Ticks()
    profiler = AutoProfiler(torch.device("cpu"), mfu_pct=lambda speed: 4.0, make=FakeTorchProfiler, clock=ticks)
    assert drive(profiler, ticks, steps=40, step_s=0.05, total=40) == []  # 2 s of run: 40 ms cannot hold the window
    assert profiler.skipped.startswith(f"not profiled: {AUTO_STEPS} profiled steps would cost about 0.") is True
    assert "over 2% of the run's 2.0 s" in profiler.skipped


def test_a_run_at_high_mfu_is_not_profiled_and_says_why() -> None:
    ticks = Ticks()
    profiler = AutoProfiler(torch.device("cpu"), mfu_pct=lambda speed: 45.0, make=FakeTorchProfiler, clock=ticks)
    assert drive(profiler, ticks, steps=400, step_s=0.05, total=400) == []
    assert profiler.skipped == "not profiled: MFU 45% (from 30% the arithmetic is the time)"


# --- the groups, on a made-up profile ---


def test_a_profile_mostly_outside_operators_with_low_mfu_is_overhead_bound(make_cfg: MakeCfg) -> None:
    ops = [Operator("aten::addmm", 30, 3.0, 20.0), Operator("aten::add_", 600, 2.4, 16.0)]
    report = ProfileReport(3, 3, 40, 5.0, "CPU", ops, None, optimizer_pct=3.0)
    groups = operator_groups(report, outputs="logits", device_type="cpu")
    assert [g.name for g in groups] == ["outside operators", "many small operators"]
    assert groups[0].share_pct == pytest.approx(64.0) and groups[1].detail == "200 calls a step under 10 µs each"
    profile = Profiled(groups, "profile of steps 40-42")
    verdict = judge(make_cfg(), RunFacts("cpu", "fp32", mfu=None), split(1), machine(), profile=profile)
    assert verdict.bottleneck == "compute"  # no MFU, so the idle rule cannot apply
    low = judge(make_cfg(), RunFacts("cpu", "fp32", mfu=Mfu(2, "fp32")), split(1), machine(), profile=profile)
    assert low.bottleneck == "overhead"
    assert "decided by MFU with the device mostly idle in the profile" in low.message
    assert low.top_ops == "outside operators 64% · many small operators 16%"
    assert "trainer.compile=true fuses small operators" in low.message
