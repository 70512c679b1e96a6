"""Slow runs are said up front: the run's estimate after its first steady steps, a warning when a step takes far
longer than this device needs, and a line every 30 s when no progress bar is drawn. Clocks are faked: no test waits."""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable

import pytest

import pipeline.engine.observe.progress as progress_module
from pipeline.config import RunConfig
from pipeline.engine.building.amp_check import AmpProbe
from pipeline.engine.observe.progress import (
    LOG_EVERY_S,
    Reference,
    RunProgress,
    about,
    amp_reference,
    progress_mode,
    steps_to_train,
)
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


class FakeClock:
    """A clock that moves only when the test says a step took time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_steps(progress: RunProgress, clock: FakeClock, durations: list[float], samples: int = 64) -> None:
    for seconds in durations:
        clock.now += seconds
        progress.step(samples)


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress_module.log.name and r.levelno == level]


def test_about_says_a_duration_in_the_unit_a_person_reads() -> None:
    assert [about(s) for s in (0.34, 4.2, 59.4, 90, 1610, 3 * 3600 + 600)] == [
        "under 1 s",  # the README's MLP run: not "about 0 s"
        "about 4 s",
        "about 59 s",
        "about 2 min",
        "about 27 min",
        "about 3.2 h",
    ]


def test_the_estimate_is_one_line_after_the_first_steady_steps(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = RunProgress(total_steps=115, clock=clock, periodic=False)
    progress.start_epoch(1, 5)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        run_steps(progress, clock, [60.0, 14.0, 14.0])  # the first step warms up: it is left out
        assert messages(caplog, logging.INFO) == []
        run_steps(progress, clock, [14.0] * 10)
    assert messages(caplog, logging.INFO) == [
        "this run: about 27 min of training: 14.0 s a step × 115 steps (evaluation not included)"
    ]
    assert messages(caplog, logging.WARNING) == []  # no reference: nothing to call slow


def test_steps_run_under_the_profiler_are_left_out_of_the_estimate(caplog: pytest.LogCaptureFixture) -> None:
    """trainer.profile=true: steps 2-4 run 10x slower under the profiler, which tells the estimate so
    (``set_apart`` before each is counted): the estimate is of steps 5-7, not of the profiled ones."""
    clock = FakeClock()
    progress = RunProgress(total_steps=115, clock=clock, periodic=False)
    progress.start_epoch(1, 5)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        run_steps(progress, clock, [60.0])
        for _ in range(3):
            progress.set_apart()
            run_steps(progress, clock, [140.0])
        run_steps(progress, clock, [14.0] * 3)
    assert messages(caplog, logging.INFO) == [
        "this run: about 27 min of training: 14.0 s a step × 115 steps (evaluation not included)"
    ]


def test_an_epoch_boundary_starts_the_steady_span_again(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = RunProgress(total_steps=20, clock=clock, periodic=False)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        progress.start_epoch(1, 10)
        run_steps(progress, clock, [5.0, 1.0])  # a 2-step epoch, then evaluation
        clock.now += 100.0
        progress.start_epoch(2, 10)
        run_steps(progress, clock, [5.0, 2.0, 2.0, 2.0])
    assert messages(caplog, logging.INFO) == [
        "this run: about 40 s of training: 2.0 s a step × 20 steps (evaluation not included)"
    ]


def test_a_step_far_above_what_the_device_needs_is_a_warning_naming_the_reference(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    reference = Reference(per_sample_s=3.2 / 64, what="the amp check's float32 step", remedy="amp=false")
    progress = RunProgress(total_steps=115, clock=clock, periodic=False, reference=reference)
    progress.start_epoch(1, 5)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        run_steps(progress, clock, [60.0, 14.0, 14.0, 14.0])
    (warning,) = messages(caplog, logging.WARNING)
    assert warning == (
        "slow run: 14.0 s a step, 4.4x the 3.2 s that the amp check's float32 step says this device needs at "
        "64 samples a step; with amp=false the run would train in about 6 min instead of about 27 min"
    )


def test_a_step_within_twice_the_reference_is_not_called_slow(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    reference = Reference(per_sample_s=8.0 / 64, what="the amp check's float32 step", remedy="amp=false")
    progress = RunProgress(total_steps=50, clock=clock, periodic=False, reference=reference)
    progress.start_epoch(1, 1)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        run_steps(progress, clock, [30.0, 14.0, 14.0, 14.0])
    assert messages(caplog, logging.WARNING) == [] and len(messages(caplog, logging.INFO)) == 1


def test_without_a_bar_a_line_every_30_s_gives_step_rate_and_time_left(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = RunProgress(total_steps=115, clock=clock, periodic=True)
    progress.start_epoch(1, 5)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        run_steps(progress, clock, [7.0] * 10)  # lines at 35 s (step 5) and 70 s (step 10), not at 63 s
    lines = [m for m in messages(caplog, logging.INFO) if m.startswith("step ")]
    assert lines == [
        "step 5/115 (epoch 1/5) · 9 samples/s · about 13 min left",
        "step 10/115 (epoch 1/5) · 9 samples/s · about 12 min left",
    ]
    assert LOG_EVERY_S == 30.0


def test_the_periodic_line_reports_the_rate_since_the_last_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = RunProgress(total_steps=100, clock=clock, periodic=True)
    progress.start_epoch(1, 1)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        run_steps(progress, clock, [31.0])  # 64 samples in 31 s
        run_steps(progress, clock, [1.0] * 30, samples=32)  # then 32 samples a second
    lines = [m for m in messages(caplog, logging.INFO) if m.startswith("step ")]
    assert lines == [
        "step 1/100 (epoch 1/1) · 2 samples/s · about 51 min left",
        "step 31/100 (epoch 1/1) · 32 samples/s · about 1 min left",
    ]


def test_a_silent_progress_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    reference = Reference(per_sample_s=0.001, what="x", remedy="amp=false")
    progress = RunProgress(total_steps=10, clock=clock, periodic=True, reference=reference, speak=False)
    progress.start_epoch(1, 1)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        run_steps(progress, clock, [40.0] * 6)
    assert messages(caplog, logging.INFO) == messages(caplog, logging.WARNING) == []


def test_progress_mode_is_a_bar_on_a_terminal_else_lines_unless_turned_off() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_mode("auto", quiet=False, stream=Terminal()) == "bar"
    assert progress_mode("auto", quiet=False, stream=io.StringIO()) == "lines"
    assert progress_mode("auto", quiet=True, stream=Terminal()) == "lines"  # a sweep's jobs: lines, no bars
    assert progress_mode(True, quiet=True, stream=io.StringIO()) == "bar"
    assert progress_mode(False, quiet=False, stream=Terminal()) == "none"


def test_the_amp_reference_is_the_checks_float32_step_per_sample() -> None:
    probe = AmpProbe(fp32_s=0.2, amp_s=0.9, speed=0.22, batch=2, pairs=3, dtype="bf16", amx=False)
    reference = amp_reference(probe)
    assert reference is not None and reference.per_sample_s == pytest.approx(0.1)
    assert "amp check" in reference.what and "batch 2" in reference.what and reference.remedy == "amp=false"
    assert amp_reference(None) is None
    unmeasured = AmpProbe(fp32_s=0.2, amp_s=0.9, speed=math.nan, batch=2, pairs=0, dtype="bf16")
    assert amp_reference(unmeasured) is None  # only warm-up steps: first steps are no reference


def test_steps_to_train_counts_what_this_process_will_train() -> None:
    assert steps_to_train(epochs=5, per_epoch=23, max_steps=-1, epoch=1, batch=0, step=0) == 115
    assert steps_to_train(epochs=5, per_epoch=23, max_steps=-1, epoch=2, batch=10, step=33) == 82  # resumed
    assert steps_to_train(epochs=5, per_epoch=23, max_steps=40, epoch=2, batch=10, step=33) == 7


def test_a_run_without_a_terminal_logs_its_estimate_and_progress_lines(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wired into training: off a terminal (pytest's stderr) the run says its estimate and, every 30 s of the
    faked clock, where it is."""
    ticks = iter(range(0, 10_000, 31))  # every clock read is 31 s after the last
    monkeypatch.setattr(progress_module, "CLOCK", lambda: float(next(ticks)))
    cfg = make_cfg("tracking=none", "trainer.max_steps=6", "loader.batch_size=16", "checkpoint.enabled=false")
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        train(cfg, echo=False)
    said = messages(caplog, logging.INFO)
    assert said[0] == "step 1/6 (epoch 1/1) · 1 samples/s · about 3 min left"
    assert "this run: about 3 min of training: 31.0 s a step × 6 steps (evaluation not included)" in said
    assert said[-1] == "step 6/6 (epoch 1/1) · 1 samples/s · under 1 s left"
