"""The training losses between logging points, kept on the device: one host sync per logging point, a NaN or infinite
loss named with its step (``NonFiniteLoss``), every rank's mean under DDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pipeline.common.errors import PipelineError


class NonFiniteLoss(PipelineError):
    """The training loss became NaN or infinite."""

    def __init__(self, step: int, value: float) -> None:
        self.step, self.value = step, value
        super().__init__(
            f"training loss became {value} at step {step}: lower optimizer.lr, with amp=true try precision=bf16 "
            f"(float16 overflows easily), and check the data for NaN or infinite values"
        )


class LossWindow:
    """The per-step losses since the last logging point, kept on the device until ``close()``.

    ``close()`` is the host sync: it returns the window's sample-weighted mean and raises
    ``NonFiniteLoss`` naming the first bad step, except under float16's GradScaler, whose skipped
    steps (inf/NaN) are normal: those are left out of the mean. ``reduce`` turns this rank's losses
    into every rank's mean (DDP), so all ranks log the same loss and meet a NaN at the same step.
    """

    def __init__(
        self,
        size: int,
        device: torch.device,
        *,
        skipped_steps_expected: bool,
        reduce: Callable[[torch.Tensor], torch.Tensor] = lambda losses: losses,
    ) -> None:
        self.reduce = reduce
        self.losses = torch.zeros(size, device=device)
        self.sizes: list[int] = []
        self.first_step = 0
        self.tolerate = skipped_steps_expected
        self.total = 0.0
        self.samples = 0

    def add(self, loss: torch.Tensor, samples: int, step: int) -> None:
        if not self.sizes:
            self.first_step = step
        self.losses[len(self.sizes)] = loss
        self.sizes.append(samples)

    def pending(self, loss: torch.Tensor) -> torch.Tensor:
        """The losses ``close`` would reduce once ``loss`` (the step about to be added) is in: for a caller that
        reduces them over ranks itself and hands the result to ``close``."""
        return torch.cat([self.losses[: len(self.sizes)], loss.reshape(1).to(self.losses.dtype)])

    def verify(self) -> None:
        """Raise ``NonFiniteLoss`` if a step since the last ``close`` had a non-finite loss (host sync);
        the window stays open."""
        self._values()

    def close(self, reduced: torch.Tensor | None = None) -> float:
        """The window's mean (a host sync); ``reduced``: its losses reduced over ranks already (``pending``)."""
        if not self.sizes:
            return float("nan")
        values = self._values(reduced)
        total = samples = 0.0
        for value, n in zip(values, self.sizes, strict=True):
            if math.isfinite(value):
                total, samples = total + value * n, samples + n
        self.sizes.clear()
        self.total, self.samples = self.total + total, self.samples + int(samples)
        return total / samples if samples else float("nan")

    def _values(self, reduced: torch.Tensor | None = None) -> list[float]:
        if reduced is None:
            reduced = self.reduce(self.losses[: len(self.sizes)].clone())
        values = reduced.tolist()  # host sync point
        if not self.tolerate:
            for offset, value in enumerate(values):
                if not math.isfinite(value):
                    raise NonFiniteLoss(self.first_step + offset, value)
        return values

    def epoch_mean(self) -> float:
        return self.total / self.samples if self.samples else float("nan")
