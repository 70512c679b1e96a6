"""``trainer.profile=true``: torch.profiler over a few steady training steps, a trace to open and the operators that
took the time.

    python -m pipeline trainer.profile=true                                        # 3 steps after warm-up
    python -m pipeline model=resnet50 trainer.profile=true trainer.profile_steps=10 trainer.max_steps=30

The profiler rides on the step timer (``StepProfiler.wrap``). It starts at the end of the epoch's first step that did
not compile (an eager run's first step, its warm-up; a compiled run's first step after those that compiled), runs over
``trainer.profile_steps`` steps, each a ``step N`` range in the trace (N the run's step) with the loop's wait for its
batch a ``data wait`` range, and stops just before the last one's end is marked. So the profiler's start, its stop
and whatever it slows down land in the profiled steps, which the timer keeps out of the steady state
(``Breakdown.profiled_steps``) as it keeps out the steps that compiled. On CUDA the device is synchronised at the
window's two ends, so the window holds its own steps' kernels and no others. An epoch that ends first profiles what
it had (a warning and the summary say so); one that ends before any step was profiled leaves it to the next epoch.
Once per run.

``record()`` (by ``pipeline.report.logbook.conclude``, or as the run ends early) writes it to the run:

- ``profile/trace.json.gz``: the Chrome trace, gzipped, which https://ui.perfetto.dev and chrome://tracing open;
- ``profile/operators.md``: the top operators by self time (CPU self time on the CPU; on CUDA, the time of the
  kernels each launched) and their share of the profiled steps' time; the summary shows the first five;
- metrics ``profile/steps``, ``profile/step_ms`` and, on CUDA, ``perf/gpu_busy_pct``, ``perf/gpu_idle_host_pct``
  and ``perf/gpu_idle_data_pct`` (``pipeline.engine.observe.profile_report``, which reads the profiler).

With ``trainer.profile=false`` a run has ``NO_PROFILER``, whose ``wrap`` hands the timer back as it is: no profiler
object and nothing added to any step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pipeline.common.messages import brief
from pipeline.engine.hot.timing import Breakdown, EventTimer, WallTimer
from pipeline.engine.observe.profile_report import WAIT, ProfileReport, analyse

LOW_MFU_PCT = 30.0  # MFU (% of the peak) under which the loop, not the arithmetic, limits: profiled, and said

if TYPE_CHECKING:
    from pipeline.record.lifecycle import Tracker

log = logging.getLogger("pipeline.engine.profiling")  # the name its lines have always shown

T = TypeVar("T")

TRACE = "profile/trace.json.gz"
TABLE = "profile/operators.md"
_END = object()
_IDLE = contextlib.nullcontext()


def _pass() -> None:
    pass


def write_trace(profiler: Any, folder: Path) -> Path:
    """The profiler's Chrome trace (JSON), gzipped, in ``folder``."""
    raw, packed = folder / "trace.json", folder / "trace.json.gz"
    profiler.export_chrome_trace(str(raw))
    with raw.open("rb") as source, gzip.open(packed, "wb", compresslevel=6) as target:
        shutil.copyfileobj(source, target)
    return packed


class StepProfiler:
    """torch.profiler over ``steps`` steady steps of a run, once (``trainer.profile=true``).

    Args:
        steps: how many steps to profile (``trainer.profile_steps``).
        device: the training device; on CUDA kernels are traced too and the device is synchronised at the window's
            two ends.
        make: makes the profiler (default ``torch.profiler.profile`` for the device's activities).
    """

    def __init__(self, steps: int, device: torch.device, *, make: Callable[[], Any] | None = None) -> None:
        self.steps, self.device = steps, device
        self._make = make or (lambda: _torch_profiler(device))
        self._sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else _pass
        self._stage = "waiting"  # -> active -> stopped -> recorded
        self._profiler: Any = None
        self._range: Any = None  # the open ``step N`` range
        self.labels: list[str] = []  # the ranges of the steps profiled so far: "step N"
        self._first = self._last = 0  # the first and last profiled steps' numbers
        self._step: Callable[[], int] = lambda: 0
        self._total = self._began_at = 0  # the steps this process trains, and the step it started after
        self.created = time.perf_counter()  # the run's start (``wrap``'s ``began``): the auto profile's budget origin
        self._tracker: Tracker | None = None
        self.report: ProfileReport | None = None

    keeps_trace = True  # the Chrome trace is written to the run (the auto profile keeps only the table)

    def _analysed(self, report: ProfileReport, *, analysis_s: float) -> ProfileReport:
        """The report as recorded (the auto profile adds its cost, ``analysis_s`` the analysis's part)."""
        return report

    def _nothing_profiled(self) -> None:
        log.warning(
            "trainer.profile=true, but no step was profiled: profiling starts after an epoch's first step and any "
            "that compiled, and no epoch of this run had a step after those (raise trainer.max_steps)"
        )

    def wrap(
        self,
        timer: WallTimer | EventTimer,
        *,
        step: Callable[[], int],
        apart: Callable[[], None] = _pass,
        total: int = 0,
        began: float | None = None,
    ) -> ProfiledTimer:
        """``timer`` with the profiler on its marks; ``step()`` is the run's number of the step last done, and
        ``apart()`` hears of each profiled step (the run's time estimate leaves them out too); ``total``: the steps
        this process will train; ``began``: when the run started (``time.perf_counter``)."""
        self._step, self._total, self._began_at = step, total, step()
        if began is not None:
            self.created = began
        return ProfiledTimer(timer, self, apart)

    @contextlib.contextmanager
    def recording(self, tracker: Tracker) -> Iterator[None]:
        """The run's stretch in which ``record`` writes to ``tracker``; a run that ends early (a stop, an error)
        still records a window that was complete, and never leaves the profiler running."""
        self._tracker = tracker
        try:
            yield
        finally:
            if self._stage == "active":  # an error ended the epoch inside the window: its steps may be half done
                if self._range is not None:
                    self._close_range(kept=False)
                self._profiler.stop()
                self._profiler, self._stage = None, "recorded"
            if self._stage == "stopped":  # the run ended (a stop, an error) before recording a complete window
                try:
                    self.record()
                except Exception as err:  # the run's own outcome wins: a trace is never worth its error
                    log.warning("the profile was not recorded: %s", brief(err))
            self._tracker = None

    def record(self) -> ProfileReport | None:
        """Write the profiled steps to the run (once): the trace, the table and the metrics; returns the report
        (None when nothing was profiled)."""
        if self._stage == "waiting":  # the run ends with no step profiled
            self._stage = "recorded"
            self._nothing_profiled()
        if self._stage != "stopped":
            return self.report
        profiler, self._profiler, self._stage = self._profiler, None, "recorded"
        tracker = self._tracker
        began = time.perf_counter()
        report = analyse(
            profiler, labels=self.labels, asked=self.steps, first=self._first, on_device=self.device.type == "cuda"
        )
        report = self._analysed(report, analysis_s=time.perf_counter() - began)
        if tracker is not None and tracker.run_id is not None and self.keeps_trace:
            try:
                with tempfile.TemporaryDirectory(prefix="pipeline-profile-") as folder:
                    tracker.log_file(write_trace(profiler, Path(folder)), "profile")
                report = dataclasses.replace(report, trace=TRACE)
            except OSError as err:  # a full disk costs the trace, not the run
                log.warning("the profile's trace was not kept: %s", brief(err))
                report = dataclasses.replace(report, why_no_trace=f"it could not be written: {err.strerror or err}")
        self.report = report
        if tracker is not None:
            tracker.log_text(report.table(), TABLE)
            tracker.log_metrics(report.metrics(), step=self._last)
        return report

    # what the timer calls

    def waiting_for_data(self) -> contextlib.AbstractContextManager[Any]:
        return torch.profiler.record_function(WAIT) if self._stage == "active" else _IDLE

    def step_ended(self) -> bool:
        """Before a step's end is marked: whether it ran under the profiler. The window's last step stops it here,
        its device work finished first, so the stop is that step's cost."""
        if self._stage != "active":
            return False
        done = len(self.labels) + 1 == self.steps
        if done:
            self._sync()
        self._close_range(kept=True)
        self._last = self._step()
        if done:
            self._stop()
        return True

    def step_marked(self, compiled: bool, samples: int = 0) -> None:
        """After a step's end is marked: the profiler starts once a step has not compiled (its start is the next
        step's cost, and that step is profiled), and each profiled step's range opens."""
        if self._stage == "waiting" and self._starts_now(compiled, samples):
            self._sync()  # the window starts with nothing queued: its kernels are its steps' own
            self._profiler = self._make()
            self._profiler.start()
            self._stage = "active"
        if self._stage == "active":
            self._range = torch.profiler.record_function(f"step {self._step() + 1}")
            self._range.__enter__()

    def _starts_now(self, compiled: bool, samples: int) -> bool:
        """Whether the profiler starts after the step just marked (``samples`` in it): after any step that did not
        compile."""
        return not compiled

    def epoch_ended(self) -> None:
        """The epoch ended in the window: what was profiled is kept (none: the next epoch tries again)."""
        if self._stage != "active":
            return
        self._close_range(kept=False)  # opened for a step that never came
        if self.labels:
            self._stop()
            log.warning(
                "trainer.profile_steps=%d, but the epoch ended after %d profiled step(s): those are kept",
                self.steps,
                len(self.labels),
            )
            return
        self._profiler.stop()
        self._profiler, self._stage = None, "waiting"

    def _close_range(self, *, kept: bool) -> None:
        self._range.__exit__(None, None, None)
        if kept:
            if not self.labels:
                self._first = int(self._range.name.split()[-1])
            self.labels.append(self._range.name)
        self._range = None

    def _stop(self) -> None:
        self._profiler.stop()
        self._stage = "stopped"


AUTO_STEPS = 3  # steps the auto profile records
AUTO_BUDGET = 0.02  # of the run's time, at most
# What the profiler's start, stop and analysis of three steps cost (15 ms for a bare MLP step on a quiet 2-core EPYC;
# 0.1 s inside a run on a busy one, the analysis most of it), and how much slower a profiled step runs than a plain
# one (each operator recorded): the estimate the budget is checked against before the window starts. The window's
# real cost is measured and recorded (``profile/cost_s``).
AUTO_FIXED_S = 0.1
PROFILED_SLOWDOWN = 2.0
RECENT_STEPS = 20  # the steps whose times estimate a step's time and the run's speed


class AutoProfiler(StepProfiler):
    """``trainer.auto_profile``: torch.profiler over ``AUTO_STEPS`` steps in the middle of the run, when its MFU so
    far is under ``LOW_MFU_PCT`` (or unknown) and the window fits in ``AUTO_BUDGET`` of the run's time; the verdict
    then names where the time went (``pipeline.report.operators``). Never in the first half of the run's steps, so
    never in the first epoch's first steps; no trace is written (``trainer.profile=true`` keeps one).

    Args:
        device: the training device.
        mfu_pct: the MFU at a speed in samples/s (``ModelFlops.mfu_pct``), None when it cannot be told.
        make: makes the profiler (default ``torch.profiler.profile``).
        clock: the wall clock (a test's fake one).
    """

    keeps_trace = False

    def __init__(
        self,
        device: torch.device,
        *,
        mfu_pct: Callable[[float], float | None],
        make: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(AUTO_STEPS, device, make=make)
        self.mfu_pct, self.clock = mfu_pct, clock
        self.skipped = ""  # why no step was profiled
        self._recent: list[tuple[float, int]] = []  # the last steps' (seconds, samples)
        self._last_end: float | None = None
        self._window: tuple[float, float] = (0.0, 0.0)  # (wall time the window took, a plain step's seconds)

    def _starts_now(self, compiled: bool, samples: int) -> bool:
        now = self.clock()
        if self._last_end is not None and not compiled:
            self._recent = [*self._recent[-RECENT_STEPS + 1 :], (now - self._last_end, samples)]
        self._last_end = now
        if compiled or self.skipped or len(self._recent) < 2:
            return False
        if self._step() - self._began_at < max(self._total // 2, 2):
            return False
        return self._affordable(now)

    def _affordable(self, now: float) -> bool:
        """MFU low enough to look, and the window within budget; otherwise ``skipped`` says why."""
        seconds = sorted(s for s, _ in self._recent)[len(self._recent) // 2]
        speed = sum(n for _, n in self._recent) / max(sum(s for s, _ in self._recent), 1e-9)
        mfu = self.mfu_pct(speed)
        if mfu is not None and mfu >= LOW_MFU_PCT:
            self.skipped = f"not profiled: MFU {mfu:.0f}% (from {LOW_MFU_PCT:.0f}% the arithmetic is the time)"
            return False
        remaining = self._total - (self._step() - self._began_at)
        expected = now - self.created + remaining * seconds
        cost = AUTO_STEPS * seconds * PROFILED_SLOWDOWN + AUTO_FIXED_S
        if cost > AUTO_BUDGET * expected:
            self.skipped = (
                f"not profiled: {AUTO_STEPS} profiled steps would cost about {cost:.2f} s, over "
                f"{AUTO_BUDGET:.0%} of the run's {expected:.1f} s"
            )
            return False
        self._window = (now, seconds)
        return True

    def epoch_ended(self) -> None:
        super().epoch_ended()
        self._last_end = None  # the evaluation between epochs is no step's time

    def _stop(self) -> None:
        super()._stop()
        started, seconds = self._window
        self._window = (self.clock() - started, seconds)

    def _analysed(self, report: ProfileReport, *, analysis_s: float) -> ProfileReport:
        window_s, seconds = self._window
        extra = max(0.0, window_s - report.steps * seconds)  # what the window cost beyond its steps' own time
        why = "trainer.profile=true keeps one"
        return dataclasses.replace(report, auto=True, cost_s=extra + analysis_s, why_no_trace=why)

    def _nothing_profiled(self) -> None:
        if not self.skipped:
            self.skipped = "not profiled: the run ended before its middle step, or every step compiled"


class NoProfiler:
    """``trainer.profile=false``: the timer as it is, nothing recorded."""

    report: ProfileReport | None = None

    def wrap(
        self,
        timer: WallTimer | EventTimer,
        *,
        step: Callable[[], int],
        apart: Callable[[], None] = _pass,
        total: int = 0,
        began: float | None = None,
    ) -> WallTimer | EventTimer:
        return timer

    def recording(self, tracker: Tracker) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record(self) -> None:
        return None


NO_PROFILER = NoProfiler()


class ProfiledTimer:
    """A step timer with the profiler on its marks (``StepProfiler.wrap``): the loop uses it as any timer."""

    def __init__(self, timer: WallTimer | EventTimer, profiler: StepProfiler, apart: Callable[[], None]) -> None:
        self.timer, self.profiler, self.apart = timer, profiler, apart

    def start(self) -> None:
        self.timer.start()

    def batches(self, iterable: Iterable[T]) -> Iterator[T]:
        """The timer's batches, each wait for one a ``data wait`` range while profiling."""
        items = self.timer.batches(iterable)
        try:
            while True:
                with self.profiler.waiting_for_data():
                    item = next(items, _END)
                if item is _END:
                    return
                yield item  # type: ignore[misc]
        finally:
            items.close()

    def copied(self) -> None:
        self.timer.copied()

    def done(self, samples: int, *, compiled: bool = False) -> None:
        profiled = self.profiler.step_ended()
        self.timer.done(samples, compiled=compiled)
        if profiled:
            self.timer.profiled()
            self.apart()
        self.profiler.step_marked(compiled, samples)

    def finish(self) -> Breakdown:
        self.profiler.epoch_ended()
        return self.timer.finish()


def make_profiler(
    trainer: Any, device: torch.device, *, mfu_pct: Callable[[float], float | None]
) -> StepProfiler | NoProfiler:
    """The run's profiler: ``trainer.profile`` over ``trainer.profile_steps`` steps, else ``trainer.auto_profile``'s
    (``mfu_pct``: the MFU at a speed), or none."""
    if trainer.profile:
        return StepProfiler(trainer.profile_steps, device)
    return AutoProfiler(device, mfu_pct=mfu_pct) if trainer.auto_profile else NO_PROFILER


def _torch_profiler(device: torch.device) -> Any:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    else:  # kineto writes to the terminal itself: on the CPU, "USDT: ... profiler_start" and "profiler_stop" at every
        # profile (the automatic one included) and, with a CUDA build of torch, "ERROR ... gpuGetDeviceCount failed":
        # all noise here. Level 6 hides its every level; it is read when the first profiler starts. GPU runs keep it.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return torch.profiler.profile(activities=activities)  # no shapes or stacks: they cost more than the ops
