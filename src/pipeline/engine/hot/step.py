"""One training step: ``run_step(state, images, labels, ...) -> StepOutcome``.

Behind it are the step's hard parts, in one place: the out-of-memory replay (the same batch in smaller micro-batches,
the effective batch kept), DDP's overlapped all-reduce and the agreement of all ranks on each step, the stop
protocol (a stop met by an out-of-memory error abandons the step instead of retrying smaller), the recompile check,
and the optimizer step: clipping after unscaling, a closure for an optimizer that re-evaluates (L-BFGS), the
schedule, and the step hook's state detached (``pipeline.engine.hot.hooks``). The epoch loop
(``pipeline.engine.hot.loop``) calls it once per batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from pipeline.common.metric_names import OOM_EVENTS, OOM_MEMORY_MB, OOM_MICRO_BATCH_SIZE
from pipeline.data.structures import count, leaves, move, split
from pipeline.engine.hot.compilation import (
    NO_COMPILE,
    CompileWatch,
    NoCompile,
    hit_recompile_limit,
    recompile_limit_error,
)
from pipeline.engine.hot.hooks import Step, StepContext, TaskStep
from pipeline.engine.hot.memory import MicroBatcher, OomFailure, discard_attempt, memory_at_failure_mb
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.hot.tasks import Classification, Task
from pipeline.engine.optim import Clipping, NoClipping, Schedule
from pipeline.parallel.distributed import Group, Solo

Closure = Callable[[], torch.Tensor]

logger = logging.getLogger("pipeline.engine.step")  # the name its lines have always shown

Splitter = Callable[[Any, int], list[Any]]  # (batch, pieces) -> micro-batches


@dataclass
class TrainState:
    """What an epoch advances: the model, its optimizer, schedule and scaler, the micro-batch, the global step, and
    what torch.compile has compiled (an eager run's watch never changes); with the task that scores a batch, the step
    that turns a batch into a loss (``pipeline.engine.hot.hooks``) and its context, how a batch is cut into
    micro-batches (``data.split_batch``, or ``pipeline.data.structures.split``) and along which dimension its samples
    count, gradient clipping, and whether the optimizer's step takes a closure (L-BFGS)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    micro: MicroBatcher
    step: int = 0
    compiles: CompileWatch | NoCompile = NO_COMPILE
    scheduler: Schedule = field(default_factory=Schedule)
    task: Task = field(default_factory=Classification)
    split: Splitter = split
    # None when made: the task's own step, and a context made for the model and task (__post_init__); never None after
    compute: Step = None  # type: ignore[assignment]
    context: StepContext = None  # type: ignore[assignment]
    batch_dim: int = 0
    clip: Clipping | NoClipping = field(default_factory=NoClipping)
    closure: bool = False

    def __post_init__(self) -> None:
        if self.compute is None:
            self.compute = TaskStep(self.task)
        if self.context is None:
            self.context = StepContext(self.task.loss, _device(self.model), self.model)


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


SOLO = Solo()  # a plain run: every collective is free

LogFn = Callable[[dict[str, float], int], None]


class StopSource(Protocol):
    """Where a stop request shows (``pipeline.engine.stopping.StopRequests``): its signal, None or 0 = none."""

    signum: int | None


class NoStop:
    """Nothing ever asks this run to stop (autotune's trials, the benchmarks)."""

    signum: int | None = None


NO_STOP = NoStop()


@dataclass(frozen=True)
class Inputs:
    """How a batch reaches the model: moved to ``device`` as a whole, ``augment(images, step)`` (None = none) once per
    batch before the out-of-memory replay, so a replay trains the same augmented pixels; then ``prepare`` (uint8 ->
    normalised float) per micro-batch, inside the replay, with the forward under ``policy``'s autocast."""

    device: torch.device
    policy: PrecisionPolicy
    prepare: Callable[[Any], Any]
    augment: Callable[[Any, int], Any] | None = None

    def move(self, batch: Any) -> Any:
        return move(batch, self.device)  # a tensor (built-in sources) or the user's structure of them

    def augmented(self, images: Any, step: int) -> Any:
        return images if self.augment is None else self.augment(images, step)  # off: not even a call


@dataclass(frozen=True)
class StepOutcome:
    """What became of one step.

    ``loss`` is the batch's mean loss (detached) when the step fit and was applied; None when it was abandoned (out of
    memory while a stop was requested: nothing applied, its partial gradients dropped, a resume replays it).
    ``stop_signal`` is the signal of a stop request any rank received (0 = none): the epoch ends after this step.
    ``carried``: the logging interval's losses that rode along with DDP's all-reduce on the CPU (else None).
    """

    loss: torch.Tensor | None
    stop_signal: int = 0
    carried: Any = None

    @property
    def fit(self) -> bool:
        return self.loss is not None

    @property
    def abandoned(self) -> bool:
        return self.loss is None

    @property
    def stopped(self) -> bool:
        return self.stop_signal != 0


@dataclass(frozen=True)
class Peers:
    """Whom a step answers to besides itself: the DDP ``group`` whose ranks take its out-of-memory and stop decisions
    together (one process: ``SOLO``), and the ``stop`` requests it checks."""

    group: Solo | Group = SOLO
    stop: StopSource = NO_STOP


ALONE = Peers()


def run_step(
    state: TrainState,
    images: Any,
    labels: Any,
    *,
    inputs: Inputs,
    peers: Peers = ALONE,
    log: LogFn = lambda metrics, step: None,
    carry: Callable[[torch.Tensor], Any] | None = None,
) -> StepOutcome:
    """Train one optimizer step on a batch already on the device, replaying it smaller after an out-of-memory error.

    Under DDP (``peers.group``), the step's out-of-memory and stop decisions are taken by all ranks together
    (``group.agree``, one small collective): while the micro-batch size is being found, before any gradient is
    all-reduced, then by hand; later, during the last micro-batch's backward, which all-reduces the gradients
    (``pipeline.parallel.overlap``; on the CPU the agreement travels with the gradients, and so do the logging
    interval's losses, ``carry(loss)``, when this step is a logging point). Each shrink logs ``oom/*`` (``log``).
    """
    group, stop = peers.group, peers.stop
    step = state.step + 1
    state.context.step = state.step  # what a step hook reads as ctx.step: the optimizer steps done
    while True:  # replays the same batch in smaller micro-batches after an out-of-memory error
        # DDP, once a step has fit: the last micro-batch's backward is held back and runs after the agreement,
        # with the all-reduce inside it; until then (and in one process) every backward runs here
        overlap = group.can_overlap and state.micro.found
        loss, last, failure = _attempt(state, images, labels, inputs=inputs, group=group, hold_last=overlap)
        # outside the except block: the traceback, and the failed step's tensors with it, are gone
        carried = None
        if overlap:  # the agreement is taken during the backward that all-reduces, its cost hidden there; a
            # rank that failed sends zero gradients, so every rank meets the same collectives in the same order,
            # and the agreement then discards the step everywhere
            held = state.scaler.scale(last) if last is not None and failure is None else None
            failed_somewhere, stop_signal, carried = group.reduce_in_backward(
                state.model,
                held,
                step=step,
                micro=state.micro.micro_batch,
                failed=failure is not None,
                stop=stop.signum or 0,
                carry=carry(loss) if held is not None and carry is not None else None,  # a logging point's losses
            )
        else:
            failed_somewhere, stop_signal = group.agree(failed=failure is not None, stop=stop.signum or 0)
        if not failed_somewhere:
            again = _closure(state, loss, images, labels, inputs=inputs, group=group) if state.closure else None
            _apply(state, group, averaged=overlap, closure=again)
            return StepOutcome(loss, stop_signal, carried)
        last = held = None  # the held micro-batch's activations are freed with the rest of the attempt
        if stop_signal:  # a smaller retry could take minutes: the step is abandoned, a resume replays it
            logger.warning(
                "step %d abandoned: out of memory with micro-batch %d and a stop was requested; stopping after "
                "step %d instead of retrying smaller",
                step,
                state.micro.micro_batch,
                state.step,
            )
            discard_attempt(optimizer=state.optimizer, scaler=state.scaler, device=inputs.device)
            return StepOutcome(None, stop_signal)
        _shrink(state, failure, device=inputs.device, log=log)


def _attempt(
    state: TrainState, images: Any, labels: Any, *, inputs: Inputs, group: Solo | Group, hold_last: bool
) -> tuple[Any, torch.Tensor | None, OomFailure | None]:
    """One try at the step's forward and backward: (loss, the held last micro-batch's loss, None) or, out of memory,
    (None, None, the failure) diagnosed while the failed step's memory is still held. Anything else is raised (a
    hit recompile limit as the error that says which setting to change)."""
    try:
        with group.no_sync(state.model):  # no collective before the agreement: a failed rank strands no other
            loss, last = forward_backward(
                state, images, labels, policy=inputs.policy, prepare=inputs.prepare, hold_last=hold_last
            )
        return loss, last, None
    except Exception as err:
        failure = state.micro.diagnose(err, inputs.device)  # here, while the failed step's memory is held
        if failure is None:
            if hit_recompile_limit(err):
                raise recompile_limit_error(state.step + 1) from err
            raise
    return None, None, failure


def _apply(state: TrainState, group: Solo | Group, *, averaged: bool, closure: Closure | None = None) -> None:
    """The optimizer step, once every rank's step fit: the gradients averaged (by hand while the micro-batch is being
    found), clipped, stepped (with ``closure`` for an optimizer that re-evaluates), the schedule and the hook's state
    moved on."""
    if not averaged:  # the micro-batch is being found: averaged by hand, after the agreement
        group.average_gradients(state.model)
    state.micro.found = True
    state.clip(state.optimizer, state.scaler)  # after unscaling (trainer.clip_grad_*; else nothing)
    if closure is None:
        state.scaler.step(state.optimizer)
    else:
        # float16's scaler is refused with a closure optimizer at build; torch's stub wants a float, its optimizers take
        # the loss tensor a closure returns
        state.optimizer.step(closure)  # type: ignore[arg-type]
    state.scaler.update()
    state.scheduler.after_step()  # once per optimizer step, whatever the micro-batches (scheduler=none: nothing)
    state.compute.after_step(state.context)  # a hook's state detached: the next step's graph starts here


def _closure(
    state: TrainState, first: torch.Tensor, images: Any, labels: Any, *, inputs: Inputs, group: Solo | Group
) -> Closure:
    """What an optimizer that re-evaluates (L-BFGS) calls for the loss: the step's forward and backward over the
    whole batch, averaged and clipped as the step's own; its first call returns the evaluation just made (its
    gradients are in place). Under DDP every call returns the ranks' mean, so all ranks take the same decisions."""
    calls = [group.mean(first.detach().reshape(1)).reshape(())]

    def closure() -> torch.Tensor:
        if calls:
            return calls.pop()
        with torch.enable_grad(), group.no_sync(state.model):
            loss, _ = forward_backward(state, images, labels, policy=inputs.policy, prepare=inputs.prepare)
        group.average_gradients(state.model)
        state.clip(state.optimizer, state.scaler)
        return group.mean(loss.reshape(1)).reshape(())

    return closure


def _shrink(state: TrainState, failure: OomFailure | None, *, device: torch.device, log: LogFn) -> None:
    """Halve the micro-batch after an out-of-memory error on this rank or another, and log the event."""
    step = state.step + 1
    if failure is None:  # another rank ran out of memory: every rank shrinks, so steps stay in lockstep
        logger.warning("step %d: out of memory on another rank; this rank shrinks too", step)
        failure = OomFailure("out of memory on another rank", memory_at_failure_mb(device))
    event = state.micro.recover(failure, step=step, optimizer=state.optimizer, scaler=state.scaler, device=device)
    oom = {OOM_EVENTS: len(state.micro.events), OOM_MICRO_BATCH_SIZE: state.micro.micro_batch}
    log({**oom, OOM_MEMORY_MB: event.memory_mb}, step)


class SkippedSteps:
    """float16 steps the GradScaler skipped (inf/NaN gradients: a normal event), seen as a lower scale after a step.
    The scaler synced in its step already, so reading the scale costs no further host sync."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler, self.count = scaler, 0
        self.scale = scaler.get_scale() if scaler.is_enabled() else 0.0

    def check(self) -> None:
        if self.scaler.is_enabled():
            new_scale = self.scaler.get_scale()
            self.count, self.scale = self.count + (new_scale < self.scale), new_scale


def forward_backward(
    state: TrainState,
    images: Any,
    labels: Any,
    *,
    policy: PrecisionPolicy,
    prepare: Callable[[Any], Any],
    hold_last: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the batch's mean loss, summed over micro-batches; returns that loss, detached.

    The loss is the step's (``state.compute``: the task's loss of the model's output, or the user's hook). Each
    micro-batch's loss is weighted by its share of what the loss averages over (``task.weight``: samples, elements or
    counted tokens), so the gradients equal the whole batch's (up to float rounding) and the optimizer step is
    unchanged; a micro-batch with nothing to average over (every target ignored) is left out, since its mean loss is
    NaN and NaN times 0 stays NaN. With ``hold_last``, the last micro-batch's backward is not run: its weighted loss
    is returned second (else None), for DDP to run it with the all-reduce overlapped once the ranks have agreed that
    the step goes on. The forward and the loss run under autocast (``amp=true``).
    """
    state.optimizer.zero_grad(set_to_none=True)
    step, context = state.compute, state.context
    pieces = state.micro.pieces(count(labels, state.batch_dim))
    if pieces == 1:  # the common case: no accumulation, no extra ops
        with policy.autocast():
            loss = step.loss(state.model, prepare(images), labels, context)
        if hold_last:
            return loss.detach(), loss
        state.scaler.scale(loss).backward()
        return loss.detach(), None
    task = state.task
    whole = task.weight(labels)
    cuts = state.split((images, labels), pieces)
    parts = [(part, cut) for part, cut in cuts if _counts(task.weight(cut))] or cuts[-1:]  # none counts: as it was
    total = torch.zeros((), device=_device_of(labels))
    for index, (part, part_labels) in enumerate(parts):
        step.check_split(context)  # a hook's state (set by the micro-batch before, too) cannot be cut: refused
        with policy.autocast():
            loss = step.loss(state.model, prepare(part), part_labels, context) * (task.weight(part_labels) / whole)
        total += loss.detach()
        if hold_last and index == len(parts) - 1:
            return total, loss
        state.scaler.scale(loss).backward()
    return total, None


def _counts(weight: int | torch.Tensor) -> bool:
    """Whether a micro-batch has anything its loss averages over (a token count on the device is read: a sync, on
    the out-of-memory fallback's path only)."""
    return bool(weight)


def _device_of(batch: Any) -> torch.device:
    found = leaves(batch)
    return found[0].device if found else torch.device("cpu")
