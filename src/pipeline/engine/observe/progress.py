"""How far the run is and how long it will take: a bar per epoch on a terminal, lines off one, an estimate up front.

- On a terminal, tqdm draws a one-line bar per epoch (loss, samples/s, ETA). It never reads the device: the loss
  it shows is the one read at the last logging point. A step costs a counter increment and one clock read; the
  line is formatted only when tqdm redraws it.
- ``RunProgress`` (every run) says once, after the first steady steps, how long the run's training will take, and
  warns when a step takes far longer than a reference measured on this device says it needs (``Reference``: the
  amp check's float32 step, ``amp_reference``). Without a bar it logs a line every ``LOG_EVERY_S`` seconds: the
  step, samples/s since the last line, and the time left. Its clock is host time: on a GPU, the rate at which the
  host enqueues steps, which the device's queue holds to the device's own rate after the first steps.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TextIO

from tqdm import tqdm

from pipeline.common.metric_names import TRAIN_LOSS
from pipeline.engine.hot.timing import seconds

if TYPE_CHECKING:
    from pipeline.engine.building.amp_check import AmpProbe

log = logging.getLogger("pipeline.engine.progress")  # the name its lines have always shown

REDRAW_S = 0.1  # at most ten redraws a second, whatever the step rate
LOG_EVERY_S = 30.0  # without a bar, a progress line at most this often (a step longer than this: one a step)
ESTIMATE_STEPS = 3  # steady steps (after an epoch's first, which warms up) the estimate is the mean of
FAR = 2.0  # a step this many times what the reference needs is far above it: the optimizer step and the loader
# add to the reference's forward and backward, which stays under 2x for runs that are fine
CLOCK: Callable[[], float] = time.monotonic  # host time; tests replace it
LINE = "{desc} {bar} {n_fmt}/{total_fmt}{loss} · {samples_per_s} samples/s · ETA {remaining}"


class _EpochBar(tqdm):
    """tqdm counting steps, plus the samples seen and the last loss, formatted only at a redraw."""

    # No monitor thread: miniters=1 below already reads the clock every step, so a slow step
    # (an evaluation, a checkpoint) cannot leave the bar stale, which is what that thread is for.
    monitor_interval = 0
    # tqdm's default lock also creates a multiprocessing lock, which fixes the process's start
    # method (and, where that is not fork, starts a resource-tracker process); one bar needs neither.
    _lock = threading.RLock()

    samples = 0
    loss: float | None = None

    @property
    def format_dict(self) -> dict[str, Any]:
        fields = super().format_dict
        elapsed = fields["elapsed"]
        fields["samples_per_s"] = f"{self.samples / elapsed:,.0f}" if elapsed else "?"
        fields["loss"] = f" · loss {self.loss:.4f}" if self.loss is not None else ""
        return fields


class ProgressBar:
    """One epoch's bar: ``epoch 2/5 ▕██▌  ▏ 120/200 · loss 0.4321 · 5,120 samples/s · ETA 00:03``.

    Args:
        total: the steps this epoch will train.
        epoch: this epoch's number, from 1.
        epochs: the run's number of epochs.
        stream: where to draw (default: stderr).
    """

    def __init__(self, *, total: int, epoch: int, epochs: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self._bar = _EpochBar(
            total=total,
            desc=f"epoch {epoch}/{epochs}",
            file=self.stream,
            bar_format=LINE,
            unit="step",
            mininterval=REDRAW_S,
            miniters=1,
            leave=True,  # the finished bar stays, one line per epoch
        )

    def step(self, samples: int) -> None:
        """Count one training step of ``samples`` samples (called every step: no formatting here)."""
        self._bar.samples += samples
        self._bar.update(1)

    def set_loss(self, loss: float) -> None:
        """The loss read at a logging point, shown from the next redraw on."""
        self._bar.loss = loss

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._bar.close()


class NoProgress:
    """Stands in off a terminal and in sweeps."""

    def step(self, samples: int) -> None:
        pass

    def set_loss(self, loss: float) -> None:
        pass

    def close(self) -> None:
        pass


def progress_enabled(setting: bool | str, *, quiet: bool, stream: TextIO | None = None) -> bool:
    """``auto`` = on a terminal and not in a sweep (``quiet``); ``true``/``false`` force it."""
    if setting == "auto":
        return not quiet and (stream or sys.stderr).isatty()
    return bool(setting)


def progress_mode(setting: bool | str, *, quiet: bool, stream: TextIO | None = None) -> Literal["bar", "lines", "none"]:
    """A bar where ``progress_enabled`` says so; else, unless ``trainer.progress=false``, a line every 30 s."""
    if progress_enabled(setting, quiet=quiet, stream=stream):
        return "bar"
    return "none" if setting is False else "lines"


@dataclass(frozen=True)
class Reference:
    """What a training step should need on this device, measured on it, and how to get there."""

    per_sample_s: float  # seconds a sample
    what: str  # where the figure comes from, in words: "the amp check's float32 step (...)"
    remedy: str  # the override that runs at the reference's speed: "amp=false"


def amp_reference(probe: AmpProbe | None) -> Reference | None:
    """The amp check's float32 step of the run's own model, per sample (None: no check, or only warm-up steps).

    Scaling the check's small batch to the run's per sample overstates what a bigger batch needs (a bigger batch
    computes more efficiently), so a step called slow against it is at least that slow."""
    if probe is None or not probe.measured:
        return None
    what = f"the amp check's float32 step ({seconds(probe.fp32_s)} at batch {probe.batch}, timed before training)"
    return Reference(probe.fp32_s / probe.batch, what, "amp=false")


def steps_to_train(*, epochs: int, per_epoch: int, max_steps: int, epoch: int, batch: int, step: int) -> int:
    """The optimizer steps this process will train from ``epoch`` (1-based), ``batch`` batches into it, at global
    ``step``: the epochs' batches left, or what ``trainer.max_steps`` (-1 = no limit) leaves, whichever is fewer."""
    left = per_epoch * (epochs - epoch + 1) - batch
    return min(left, max_steps - step) if max_steps > 0 else left


def about(value: float) -> str:
    """``under 1 s``, ``about 40 s``, ``about 27 min``, ``about 3.2 h``."""
    if value < 0.5:
        return "under 1 s"
    if value < 59.5:
        return f"about {value:.0f} s"
    if value < 90 * 60:
        return f"about {value / 60:.0f} min"
    return f"about {value / 3600:.1f} h"


class RunProgress:
    """The run's estimate after its first steady steps, a warning when steps are far slower than ``reference``
    says this device needs, and (``periodic``) a line every ``LOG_EVERY_S`` s. ``step`` is called every step and
    reads the clock once; nothing touches the device.

    Args:
        total_steps: the steps this process will train (``steps_to_train``).
        periodic: log the progress lines (no bar is drawn).
        reference: what a step should need here (None: no warning).
        speak: False on a DDP job's other ranks: rank 0 speaks for the job.
        clock: seconds, monotonic (default ``CLOCK``).
    """

    def __init__(
        self,
        *,
        total_steps: int,
        periodic: bool,
        reference: Reference | None = None,
        speak: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.total, self.periodic, self.reference, self.speak = total_steps, periodic, reference, speak
        self._clock = clock or CLOCK
        self.done = 0
        self._epoch, self._epochs, self._in_epoch = 1, 1, 0
        self._anchor = 1  # the step of the epoch after which the steady span starts
        self._estimated = False
        self._span_start, self._span_samples = 0.0, 0
        self._line_at, self._line_done, self._line_samples = self._clock(), 0, 0

    def start_epoch(self, epoch: int, epochs: int) -> None:
        """An epoch begins: its first step warms up again (workers, evaluation before it), so the steady span
        restarts after it."""
        self._epoch, self._epochs, self._in_epoch, self._anchor = epoch, epochs, 0, 1

    def step(self, samples: int) -> None:
        """One training step of ``samples`` samples has ended."""
        now = self._clock()
        self.done, self._in_epoch, self._line_samples = self.done + 1, self._in_epoch + 1, self._line_samples + samples
        if self._in_epoch == self._anchor:
            self._span_start, self._span_samples = now, 0
        else:
            self._span_samples += samples
            if self._in_epoch == self._anchor + ESTIMATE_STEPS and not self._estimated:
                self._estimated = True
                self._estimate((now - self._span_start) / ESTIMATE_STEPS, self._span_samples / ESTIMATE_STEPS)
        if self.periodic and now - self._line_at >= LOG_EVERY_S:
            self._line(now)

    def set_apart(self) -> None:
        """The step about to be counted is no steady one (it ran under the profiler): the estimate's steady span
        starts after it."""
        self._anchor = self._in_epoch + 1

    def _estimate(self, step_s: float, samples: float) -> None:
        if not self.speak:
            return
        run = about(step_s * self.total)
        log.info(
            "this run: %s of training: %s a step × %d steps (evaluation not included)", run, seconds(step_s), self.total
        )
        if self.reference is None:
            return
        need = self.reference.per_sample_s * samples
        if step_s > FAR * need:
            log.warning(
                "slow run: %s a step, %.1fx the %s that %s says this device needs at %.0f samples a step; with %s the "
                "run would train in %s instead of %s",
                seconds(step_s),
                step_s / need,
                seconds(need),
                self.reference.what,
                samples,
                self.reference.remedy,
                about(need * self.total),
                run,
            )

    def _line(self, now: float) -> None:
        elapsed, steps = now - self._line_at, self.done - self._line_done
        if self.speak:
            log.info(
                "step %d/%d (epoch %d/%d) · %s samples/s · %s left",
                self.done,
                self.total,
                self._epoch,
                self._epochs,
                f"{self._line_samples / elapsed:,.0f}",
                about(max(self.total - self.done, 0) * elapsed / steps),
            )
        self._line_at, self._line_done, self._line_samples = now, self.done, 0


class EpochSteps:
    """An epoch's progress: the batches trained so far, shown on its bar and in the run's progress lines."""

    def __init__(self, bar: ProgressBar | NoProgress, run: RunProgress) -> None:
        self.bar, self.run, self.done = bar, run, 0

    def step(self, samples: int) -> None:
        self.done += 1
        self.bar.step(samples)
        self.run.step(samples)

    def logging_to(self, tracker: Any) -> Callable[[dict[str, float], int], None]:
        """Where the loop's step metrics go: the tracker, and the bar's loss."""

        def log_step(metrics: dict[str, float], step: int) -> None:
            tracker.log_metrics(metrics, step)
            if TRAIN_LOSS in metrics:
                self.bar.set_loss(metrics[TRAIN_LOSS])

        return log_step
