"""One training epoch and one evaluation pass, written like the guides' pseudo-code.

The hot loop never reads a value back from the device except at logging points: losses are
summed on the device and ``.item()`` (a host sync on GPUs) runs every ``log_every`` steps and at
the end of the epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.precision import PrecisionPolicy
from pipeline.timing import Breakdown, CudaEventTimer, WallTimer

StepTimer = WallTimer | CudaEventTimer

LogFn = Callable[[dict[str, float], int], None]


@dataclass
class TrainState:
    """What an epoch advances: the model, its optimizer and scaler, and the global step count."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    step: int = 0


@dataclass(frozen=True)
class EpochStats:
    loss: float  # mean training loss over the epoch's samples
    samples: int
    steps: int
    seconds: float  # wall clock, first step included
    reached_max_steps: bool
    breakdown: Breakdown

    @property
    def samples_per_s(self) -> float:
        """Steady-state throughput (the first step, with its warm-up, left out)."""
        return self.breakdown.samples_per_s


@dataclass(frozen=True)
class EvalStats:
    loss: float
    accuracy: float
    samples: int


def train_epoch(
    state: TrainState,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    policy: PrecisionPolicy,
    prepare: Callable[[torch.Tensor], torch.Tensor],
    log_every: int,
    max_steps: int,
    log: LogFn,
    timer: StepTimer,
    on_step: Callable[[int], None] = lambda samples: None,
) -> EpochStats:
    """Train over ``batches`` once (or until ``max_steps`` optimizer steps in total; -1 = no limit).

    ``timer`` is marked three times a step (batch in hand, batch on the device, step done);
    ``on_step`` (e.g. a progress bar) gets each step's sample count and must not touch the device.
    """
    model, optimizer, scaler = state.model, state.optimizer, state.scaler
    model.train()
    epoch_loss = torch.zeros((), device=device)
    window_loss = torch.zeros((), device=device)  # sum of loss x samples since the last logging point
    window_samples, samples, steps = 0, 0, 0
    start = time.perf_counter()
    timer.start()
    for images, labels in batches:
        timer.ready()
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        timer.copied()
        with policy.autocast():
            loss = F.cross_entropy(model(prepare(images)), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        n = labels.shape[0]
        window_loss.add_(loss.detach(), alpha=n)  # one small device op per step, no sync
        samples, steps, window_samples = samples + n, steps + 1, window_samples + n
        state.step += 1
        timer.done(n)
        on_step(n)
        if state.step % log_every == 0:
            log({"train/loss": (window_loss / window_samples).item()}, state.step)  # host sync point
            epoch_loss += window_loss
            window_loss.zero_()
            window_samples = 0
        if state.step == max_steps:
            break
    breakdown = timer.finish()  # waits for the device (CUDA: the epoch's one event sync)
    mean_loss = ((epoch_loss + window_loss) / max(samples, 1)).item()
    seconds = time.perf_counter() - start
    return EpochStats(mean_loss, samples, steps, seconds, state.step == max_steps, breakdown)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    policy: PrecisionPolicy,
    prepare: Callable[[torch.Tensor], torch.Tensor],
) -> EvalStats:
    """Mean loss and accuracy over ``batches``; one host sync at the end."""
    model.eval()
    total_loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    samples = 0
    for images, labels in batches:
        images = prepare(images.to(device, non_blocking=True))
        labels = labels.to(device, non_blocking=True)
        with policy.autocast():
            logits = model(images)
        total_loss += F.cross_entropy(logits.float(), labels, reduction="sum")
        correct += (logits.argmax(dim=1) == labels).sum()
        samples += labels.shape[0]
    if samples == 0:
        return EvalStats(float("nan"), float("nan"), 0)
    return EvalStats(total_loss.item() / samples, correct.item() / samples, samples)
