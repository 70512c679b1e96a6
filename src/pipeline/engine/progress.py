"""A one-line progress bar per epoch (loss, samples/s, ETA), drawn by tqdm only on a terminal.

It never reads the device: the loss it shows is the one read at the last logging point. A step
costs a counter increment and one clock read; the line is formatted only when tqdm redraws it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from tqdm import tqdm

REDRAW_S = 0.1  # at most ten redraws a second, whatever the step rate
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
