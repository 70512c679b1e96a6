"""The optimizer and its learning-rate schedule, made from their groups' ``_target_``.

    python -m pipeline optimizer=adamw optimizer.lr=3e-4 scheduler=warmup_cosine scheduler.warmup_steps=100
    python -m pipeline optimizer=custom optimizer._target_=RMSprop +optimizer.lr=1e-3

The optimizer is the target called with the model's parameters and the group's keywords (``_partial_``: completed
with the parameters here). The schedule is the target called with the optimizer and its keywords, plus
``total_steps`` (the run's optimizer steps) where its signature names it; it is stepped once per optimizer step,
never per micro-batch, so the out-of-memory fallback cannot change it, and its state is checkpointed.
``scheduler=none`` is ``NoSchedule``: the loop calls ``step()`` on it as on any other, and nothing happens.

The built-in schedules below are the ``scheduler`` group's options; each is a torch scheduler whose state is plain
values (``torch.load(weights_only=True)`` reads it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LRScheduler, OneCycleLR, StepLR

from pipeline.common.targets import TargetError, instantiate
from pipeline.config import OptimizerConfig, SchedulerConfig


class NoSchedule:
    """``scheduler=none``: a constant learning rate; stepping it does nothing."""

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


Schedule = LRScheduler | NoSchedule


def build_optimizer(cfg: OptimizerConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``optimizer._target_(params, **keywords)``; a bare name is a ``torch.optim`` class (``SGD``).

    Raises:
        TargetError: no such optimizer, a keyword it does not take, or it made no ``torch.optim.Optimizer``.
    """
    made = instantiate(
        cfg._target_, cfg.keywords, key="optimizer", positional=(list(params),), namespaces=("torch.optim",)
    )
    if not isinstance(made, torch.optim.Optimizer):
        raise TargetError(
            f"optimizer._target_={cfg._target_} made a {type(made).__name__}, not a torch.optim.Optimizer"
        )
    return made


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, *, total_steps: int) -> Schedule:
    """``scheduler._target_(optimizer, **keywords)`` (with ``total_steps`` where it takes one), or ``NoSchedule``.

    Raises:
        TargetError: no such schedule, a keyword it does not take, or it made no scheduler.
    """
    if cfg._target_ is None:
        return NoSchedule()
    made = instantiate(
        cfg._target_,
        cfg.keywords,
        key="scheduler",
        positional=(optimizer,),
        supplied={"total_steps": total_steps},
        namespaces=("torch.optim.lr_scheduler",),
    )
    if not callable(getattr(made, "step", None)) or not callable(getattr(made, "state_dict", None)):
        raise TargetError(f"scheduler._target_={cfg._target_} made a {type(made).__name__}, not a scheduler")
    return made


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The first parameter group's learning rate (``train/lr``): a Python float, no device sync."""
    return float(optimizer.param_groups[0]["lr"])


def cosine(optimizer: torch.optim.Optimizer, *, total_steps: int, min_lr: float = 0.0) -> LRScheduler:
    """Cosine decay from the optimizer's learning rate to ``min_lr`` over ``total_steps``."""
    return CosineAnnealingLR(optimizer, T_max=max(total_steps, 1), eta_min=min_lr)


def step(
    optimizer: torch.optim.Optimizer, *, total_steps: int, step_size: int | None = None, gamma: float = 0.1
) -> LRScheduler:
    """The learning rate times ``gamma`` every ``step_size`` optimizer steps (None: a third of the run's)."""
    return StepLR(optimizer, step_size=step_size or max(1, total_steps // 3), gamma=gamma)


def onecycle(
    optimizer: torch.optim.Optimizer, *, total_steps: int, max_lr: float | None = None, pct_start: float = 0.3
) -> LRScheduler:
    """The one-cycle policy up to ``max_lr`` (None: the optimizer's learning rate), momentum left as configured."""
    peak = max_lr if max_lr is not None else [group["lr"] for group in optimizer.param_groups]
    return OneCycleLR(
        optimizer, max_lr=peak, total_steps=max(total_steps, 2), pct_start=pct_start, cycle_momentum=False
    )


@dataclass
class WarmupCosineFactor:
    """The factor on the base learning rate at optimizer step ``k``: linear from 0 over ``warmup`` steps, then a
    cosine down to ``floor``. An object of plain fields: ``LambdaLR`` checkpoints it as values, not code."""

    warmup: int
    total: int
    floor: float  # min_lr over the base learning rate

    def __call__(self, k: int) -> float:
        if k < self.warmup:
            return (k + 1) / (self.warmup + 1)
        progress = min(1.0, (k - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int | None = None,
    warmup_fraction: float = 0.05,
    min_lr: float = 0.0,
) -> LRScheduler:
    """Linear warm-up to the optimizer's learning rate, then cosine decay to ``min_lr``."""
    warmup = warmup_steps if warmup_steps is not None else round(warmup_fraction * total_steps)
    base = optimizer.param_groups[0]["lr"]
    return LambdaLR(optimizer, WarmupCosineFactor(warmup, total_steps, min_lr / base if base else 0.0))
