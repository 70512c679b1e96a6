"""The record a run returns, and the short summary printed (and stored as the run's description)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EpochRecord:
    epoch: int
    train_loss: float
    val_loss: float
    val_acc: float
    seconds: float
    samples_per_s: float


@dataclass(frozen=True)
class RunResult:
    """What ``train`` returns: enough to compare runs in code (sweeps, benchmarks, tests)."""

    run_name: str
    run_id: str | None
    device: str
    device_name: str
    precision: str
    loader: str
    parameters: int
    steps: int
    total_s: float
    epochs: list[EpochRecord] = field(default_factory=list)
    tracking: list[str] = field(default_factory=list)
    model: Any = field(default=None, repr=False, compare=False)  # the trained torch module

    @property
    def val_acc(self) -> float:
        return self.epochs[-1].val_acc if self.epochs else float("nan")

    @property
    def val_loss(self) -> float:
        return self.epochs[-1].val_loss if self.epochs else float("nan")


def format_summary(result: RunResult) -> str:
    """A few lines: what ran where, how well, how fast, and where the record is."""
    last = result.epochs[-1] if result.epochs else None
    lines = [
        f"run {result.run_name}: {len(result.epochs)} epoch(s), {result.steps} steps in {result.total_s:.1f} s",
        f"  device     {result.device} ({result.device_name})",
        f"  model      {result.parameters:,} parameters · precision {result.precision} · loader {result.loader}",
    ]
    if last is not None:
        lines += [
            f"  accuracy   val/acc {last.val_acc:.4f} · val/loss {last.val_loss:.4f} · "
            f"train/epoch_loss {last.train_loss:.4f}",
            f"  speed      {last.samples_per_s:,.0f} samples/s in the last epoch ({last.seconds:.2f} s)",
        ]
    lines += ["  " + line for line in result.tracking]
    return "\n".join(lines)
