"""The optimizer, its learning-rate schedule and gradient clipping, made from their groups and keys.

    python -m pipeline optimizer=adamw optimizer.lr=3e-4 scheduler=warmup_cosine scheduler.warmup_steps=100
    python -m pipeline optimizer=custom optimizer._target_=LBFGS optimizer.lr=0.8   # gets a closure
    python -m pipeline scheduler=plateau scheduler.factor=0.25 trainer.clip_grad_norm=0.25

The optimizer is the target called with the model's parameters and the group's keywords (``_partial_``: completed
with the parameters here). One whose ``step`` needs a closure (L-BFGS) gets one (``needs_closure``): the step's
forward and backward again, over the whole batch. The schedule is the target called with the optimizer and its
keywords, plus ``total_steps`` (the times it will be stepped) where its signature names it. ``Schedule`` steps it
once per optimizer step (never per micro-batch, so the out-of-memory fallback cannot change it) or, with
``scheduler.interval=epoch``, once per epoch after its evaluation; a schedule whose ``step`` takes a metric
(``ReduceLROnPlateau``) is stepped after each evaluation with ``scheduler.monitor``. Its state is checkpointed.
``scheduler=none`` is a ``Schedule`` of nothing: the loop calls it as any other, and nothing happens.
``trainer.clip_grad_norm`` / ``clip_grad_value`` (``Clipping``) act after amp's GradScaler unscales the gradients
and, under DDP, after they are averaged (every rank clips the same gradients).

The built-in schedules below are the ``scheduler`` group's options; each is a torch scheduler whose state is plain
values (``torch.load(weights_only=True)`` reads it).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LRScheduler, OneCycleLR, StepLR

from pipeline.common.errors import ConfigError
from pipeline.common.metric_names import VAL_LOSS
from pipeline.common.targets import TargetError, instantiate

if TYPE_CHECKING:  # the config is read, never imported: building the run hands it in
    from pipeline.config import OptimizerConfig, SchedulerConfig, TrainerConfig

LOWER_IS_BETTER = ("loss", "perplexity", "mae", "rmse")  # metric names whose best value is the lowest


class Schedule:
    """The run's learning-rate schedule as the loop drives it: ``after_step()`` after every optimizer step,
    ``after_evaluation(metrics)`` after every epoch's evaluation; each steps the torch scheduler (``inner``) when the
    schedule's cadence is its own (``None``: ``scheduler=none``, nothing ever happens)."""

    def __init__(self, inner: Any = None, *, per_step: bool = True, monitor: str | None = None) -> None:
        self.inner, self.monitor = inner, monitor
        self.per_step = inner is not None and per_step and monitor is None

    def after_step(self) -> None:
        if self.per_step:
            self.inner.step()

    def after_evaluation(self, metrics: Mapping[str, float]) -> None:
        if self.inner is None or self.per_step:
            return
        if self.monitor is None:
            self.inner.step()
        else:
            self.inner.step(metrics[self.monitor])

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)


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
    needs = [name for name in _required(made.step) if name != "closure"]
    if needs:
        raise ConfigError(
            "optimizer._target_",
            cfg._target_,
            f"an optimizer whose step() takes nothing or a closure: {type(made).__name__}.step needs "
            f"{', '.join(needs)}, which the pipeline cannot give",
        )
    return made


def _required(method: Callable[..., Any]) -> list[str]:
    """The parameters a bound method must be given (no default, not * or **)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind not in kinds]


def build_scheduler(
    cfg: SchedulerConfig,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    epochs: int,
    metrics: tuple[str, ...] = (VAL_LOSS,),
) -> Schedule:
    """``scheduler._target_(optimizer, **keywords)`` (with ``total_steps`` where it takes one: ``steps`` optimizer
    steps, or ``epochs`` for a schedule stepped per epoch), as a ``Schedule``; ``metrics``: what evaluation reports,
    for a schedule fed one.

    Raises:
        TargetError: no such schedule, a keyword it does not take, or it made no scheduler.
        ConfigError: ``scheduler.monitor`` names no metric of the task, or is set for a schedule that takes none;
            ``interval=step`` for a schedule fed a metric; a ``mode`` that would seek the metric's worst value.
    """
    if cfg._target_ is None:
        return Schedule()
    made = instantiate(
        cfg._target_,
        cfg.keywords,
        key="scheduler",
        positional=(optimizer,),
        supplied={"total_steps": steps if cfg.every == "step" else epochs},
        namespaces=("torch.optim.lr_scheduler",),
    )
    if not callable(getattr(made, "step", None)) or not callable(getattr(made, "state_dict", None)):
        raise TargetError(f"scheduler._target_={cfg._target_} made a {type(made).__name__}, not a scheduler")
    if len(_required(made.step)) > 1:
        raise ConfigError(
            "scheduler._target_",
            cfg._target_,
            f"a schedule whose step() takes nothing or one metric: {type(made).__name__}.step needs "
            f"{', '.join(_required(made.step))}",
        )
    monitor = _monitored(cfg, made, metrics) if takes_metric(made) else None
    if monitor is None and cfg.monitor is not None:
        raise ConfigError(
            "scheduler.monitor",
            cfg.monitor,
            f"null for {cfg._target_}, whose step takes no metric (ReduceLROnPlateau does)",
        )
    return Schedule(made, per_step=cfg.every == "step", monitor=monitor)


def takes_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` needs a value (``ReduceLROnPlateau.step(metrics)``)."""
    return len(_required(scheduler.step)) == 1


def _monitored(cfg: SchedulerConfig, scheduler: Any, metrics: tuple[str, ...]) -> str:
    """The metric a metric-fed schedule is stepped with after each evaluation, checked against what the task reports
    and against the schedule's ``mode``."""
    monitor = cfg.monitor or VAL_LOSS
    if cfg.interval == "step":
        raise ConfigError(
            "scheduler.interval", "step", f"epoch or null for {cfg._target_}: it is fed {monitor} after each evaluation"
        )
    if monitor not in metrics:
        raise ConfigError("scheduler.monitor", monitor, f"a metric the task reports: {', '.join(metrics)}")
    lower = monitor.rsplit("/", 1)[-1].startswith(LOWER_IS_BETTER)
    mode = getattr(scheduler, "mode", None)
    if mode in ("min", "max") and (mode == "min") != lower:
        better = "min (lower is better)" if lower else "max (higher is better)"
        raise ConfigError("scheduler.mode", mode, f"{better} for scheduler.monitor={monitor}")
    return monitor


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` must be given a closure (L-BFGS: it evaluates the loss several times a step)."""
    return "closure" in _required(optimizer.step)


class Clipping:
    """``trainer.clip_grad_norm`` or ``clip_grad_value``: the gradients clipped after ``scaler`` unscales them;
    ``norm`` keeps the total norm before clipping (a device tensor, read at logging points: ``train/grad_norm``)."""

    def __init__(self, parameters: list[torch.nn.Parameter], *, max_norm: float | None, value: float | None) -> None:
        self.parameters, self.max_norm, self.value = parameters, max_norm, value
        self.norm: torch.Tensor | None = None

    def __call__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        scaler.unscale_(optimizer)  # a no-op without float16's scaler; the scaler's step then skips its own
        if self.max_norm is not None:
            self.norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.max_norm)
            return
        grads = [p.grad for p in self.parameters if p.grad is not None]
        self.norm = torch.nn.utils.get_total_norm(grads)
        assert self.value is not None  # one of the two: without either the run has NoClipping
        torch.nn.utils.clip_grad_value_(self.parameters, self.value)


class NoClipping:
    """No ``trainer.clip_grad_*``: nothing done, no norm to log."""

    norm = None

    def __call__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        pass


def make_clipping(trainer: TrainerConfig, parameters: Iterable[torch.nn.Parameter]) -> Clipping | NoClipping:
    if trainer.clip_grad_norm is None and trainer.clip_grad_value is None:
        return NoClipping()
    return Clipping(list(parameters), max_norm=trainer.clip_grad_norm, value=trainer.clip_grad_value)


Closure = Callable[[], torch.Tensor]


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
