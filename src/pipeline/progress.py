"""A one-line progress bar per epoch (loss, samples/s, ETA), drawn only on a terminal.

It never reads the device: the loss it shows is the one read at the last logging point.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_S = 0.1  # at most ten redraws a second, whatever the step rate


class ProgressBar:
    def __init__(self, *, total: int, epoch: int, epochs: int, stream: TextIO | None = None) -> None:
        self.total, self.epoch, self.epochs = total, epoch, epochs
        self.stream = stream or sys.stderr
        self.steps = self.samples = 0
        self.loss: float | None = None
        self._start = self._drawn = time.perf_counter()

    def step(self, samples: int) -> None:
        self.steps += 1
        self.samples += samples
        now = time.perf_counter()
        if now - self._drawn >= REDRAW_S:
            self._drawn = now
            self._draw(now)

    def set_loss(self, loss: float) -> None:
        self.loss = loss

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        done = min(self.steps / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(24 * done) + "." * (24 - int(24 * done))
        eta = (self.total - self.steps) * elapsed / self.steps if self.steps else 0.0
        loss = f" · loss {self.loss:.4f}" if self.loss is not None else ""
        self.stream.write(
            f"\repoch {self.epoch}/{self.epochs} [{bar}] {self.steps}/{self.total}{loss}"
            f" · {self.samples / elapsed:,.0f} samples/s · ETA {eta:.0f}s "
        )
        self.stream.flush()


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
