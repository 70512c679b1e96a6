"""One training epoch and one evaluation pass, written like the set-up recipe's pseudo-code.

The hot loop never reads a value back from the device except at logging points: losses are
summed on the device and ``.item()`` (a host sync on GPUs) runs every ``log_every`` steps and at
the end of the epoch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeline.data.structures import call_model, count, move, split
from pipeline.engine.compilation import NO_COMPILE, CompileWatch, NoCompile, hit_recompile_limit, recompile_limit_error
from pipeline.engine.losses import LossWindow
from pipeline.engine.memory import MicroBatcher, OomFailure, discard_attempt, memory_at_failure_mb
from pipeline.engine.optim import NoSchedule, Schedule, current_lr
from pipeline.engine.precision import PrecisionPolicy
from pipeline.engine.profiling import ProfiledTimer
from pipeline.engine.tasks import Classification, Task
from pipeline.engine.timing import Breakdown, EventTimer, WallTimer
from pipeline.parallel.distributed import Group, Solo

logger = logging.getLogger(__name__)

StepTimer = WallTimer | EventTimer | ProfiledTimer  # the last: trainer.profile=true (pipeline.engine.profiling)
SOLO = Solo()  # a plain run: every collective is free

LogFn = Callable[[dict[str, float], int], None]


Splitter = Callable[[Any, int], list[Any]]  # (batch, pieces) -> micro-batches


@dataclass
class TrainState:
    """What an epoch advances: the model, its optimizer, schedule and scaler, the micro-batch, the global step, and
    what torch.compile has compiled (an eager run's watch never changes); with the task that scores a batch and how
    a batch is cut into micro-batches (``data.split_batch``, or ``pipeline.data.structures.split``)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    micro: MicroBatcher
    step: int = 0
    compiles: CompileWatch | NoCompile = NO_COMPILE
    scheduler: Schedule = field(default_factory=NoSchedule)
    task: Task = field(default_factory=Classification)
    split: Splitter = split


@dataclass(frozen=True)
class EpochStats:
    loss: float  # mean training loss over the epoch's samples
    samples: int
    steps: int
    seconds: float  # wall clock, first step included
    reached_max_steps: bool
    breakdown: Breakdown
    stopped: bool = False  # a stop was requested (SIGTERM, Ctrl-C): the epoch ended at a step boundary
    stop_signal: int = 0  # the signal behind the stop (under DDP, maybe another rank's)
    skipped_steps: int = 0  # float16 steps the GradScaler skipped (inf/NaN gradients), a normal event

    @property
    def samples_per_s(self) -> float:
        """Steady-state throughput (the first step, with its warm-up, left out)."""
        return self.breakdown.samples_per_s


@dataclass(frozen=True)
class EvalStats:
    metrics: dict[str, float]  # val/loss and the task's metrics (pipeline.engine.tasks)
    samples: int

    @property
    def loss(self) -> float:
        return self.metrics.get("val/loss", float("nan"))

    @property
    def accuracy(self) -> float:
        return self.metrics.get("val/acc", float("nan"))


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
    augment: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    on_step: Callable[[int], None] = lambda samples: None,
    stop_signal: Callable[[], int] = lambda: 0,
    checkpoint_every: int = 0,
    save_checkpoint: Callable[[], None] = lambda: None,
    group: Solo | Group = SOLO,
) -> EpochStats:
    """Train over ``batches`` once (or until ``max_steps`` optimizer steps in total; -1 = no limit).

    Training's input path: ``augment(images, step)`` (None = none) once per batch on the device, after the copy
    and before the out-of-memory replay, so a replay trains the same augmented pixels; then ``prepare``
    (uint8 -> normalised float) per micro-batch, inside the replay.

    ``timer`` is marked four times a step (batch asked for, in hand, on the device, step done), and told when a
    step compiled (torch.compile met a new input shape): that step is kept out of the steady state;
    ``on_step`` (e.g. a progress bar) gets each step's sample count and must not touch the device.
    ``stop_signal`` (the signal of a stop request, 0 = none) is asked every step; a request ends the
    epoch after that step, or before it when the step ran out of memory: no smaller retry starts, the step
    is abandoned (not counted, its partial gradients dropped) and a resume replays it. Every
    ``checkpoint_every`` steps (0 = never) the losses since the last check are verified finite, then
    ``save_checkpoint`` runs: a checkpoint never holds weights from unchecked steps.

    Under DDP (``group``), each step's out-of-memory and stop decisions are taken by all ranks together
    (``group.agree``, one small collective): while the micro-batch size is being found, before any gradient is
    all-reduced, then by hand; later, during the last micro-batch's backward, which all-reduces the gradients
    (``pipeline.parallel.overlap``; on the CPU the agreement travels with the gradients). Each logging interval records
    ``time/allreduce_ms``.
    """
    model, optimizer, scaler = state.model, state.optimizer, state.scaler
    model.train()
    window = LossWindow(log_every, device, skipped_steps_expected=scaler.is_enabled(), reduce=group.mean)
    samples, steps, skipped = 0, 0, 0
    scale = scaler.get_scale() if scaler.is_enabled() else 0.0
    start = time.perf_counter()
    timer.start()
    stopped = 0
    logged_lr = None  # train/lr is logged when it changed: a constant rate once an epoch, a schedule every interval
    for images, labels in timer.batches(batches):
        compiled_before = state.compiles.count  # a Python int: reading it costs nothing
        images = move(images, device)  # a tensor (built-in sources) or the user's structure of them
        labels = move(labels, device)
        timer.copied()
        if augment is not None:  # once per batch, before the replay below (off: not even a call)
            images = augment(images, state.step + 1)
        n = count(labels)
        while True:  # replays the same batch in smaller micro-batches after an out-of-memory error
            # DDP, once a step has fit: the last micro-batch's backward is held back and runs after the agreement,
            # with the all-reduce inside it; until then (and in one process) every backward runs here
            overlap = group.can_overlap and state.micro.found
            failure, last, carried = None, None, None
            try:
                with group.no_sync(model):  # no collective before the agreement: a failed rank strands no other
                    loss, last = forward_backward(
                        state, images, labels, policy=policy, prepare=prepare, hold_last=overlap
                    )
            except Exception as err:
                failure = state.micro.diagnose(err, device)  # here, while the failed step's memory is held
                if failure is None:
                    if hit_recompile_limit(err):
                        raise recompile_limit_error(state.step + 1) from err
                    raise
            # outside the except block: the traceback, and the failed step's tensors with it, are gone
            if overlap:  # the agreement is taken during the backward that all-reduces, its cost hidden there; a
                # rank that failed sends zero gradients, so every rank meets the same collectives in the same order,
                # and the agreement then discards the step everywhere
                held = scaler.scale(last) if last is not None and failure is None else None
                # a logging step's interval losses ride along (on the CPU): a logging point needs no collective
                logging = held is not None and (state.step + 1) % log_every == 0
                failed_somewhere, stopped, carried = group.reduce_in_backward(
                    model,
                    held,
                    step=state.step + 1,
                    micro=state.micro.micro_batch,
                    failed=failure is not None,
                    stop=stop_signal(),
                    carry=window.pending(loss) if logging else None,
                )
            else:
                failed_somewhere, stopped = group.agree(failed=failure is not None, stop=stop_signal())
            if not failed_somewhere:
                break
            last = None  # the held micro-batch's activations are freed with the rest of the attempt
            if stopped:  # a smaller retry could take minutes: the step is abandoned, a resume replays it
                logger.warning(
                    "step %d abandoned: out of memory with micro-batch %d and a stop was requested; stopping after "
                    "step %d instead of retrying smaller",
                    state.step + 1,
                    state.micro.micro_batch,
                    state.step,
                )
                discard_attempt(optimizer=optimizer, scaler=scaler, device=device)
                break
            if failure is None:  # another rank ran out of memory: every rank shrinks, so steps stay in lockstep
                logger.warning("step %d: out of memory on another rank; this rank shrinks too", state.step + 1)
                failure = OomFailure("out of memory on another rank", memory_at_failure_mb(device))
            event = state.micro.recover(failure, step=state.step + 1, optimizer=optimizer, scaler=scaler, device=device)
            oom = {"oom/events": len(state.micro.events), "oom/micro_batch_size": state.micro.micro_batch}
            log({**oom, "oom/memory_mb": event.memory_mb}, state.step + 1)
        if failed_somewhere:  # abandoned (above): not counted, nothing applied, the epoch ends at the last step
            break
        if not overlap:  # the micro-batch is being found: averaged by hand, after the agreement
            group.average_gradients(model)
        state.micro.found = True
        scaler.step(optimizer)
        scaler.update()
        state.scheduler.step()  # once per optimizer step, whatever the micro-batches (scheduler=none: nothing)
        if scaler.is_enabled():  # float16: the scaler already synced this step; a lower scale = a skipped step
            new_scale = scaler.get_scale()
            skipped, scale = skipped + (new_scale < scale), new_scale

        state.step += 1
        window.add(loss, n, state.step)  # one small device copy per step, no sync
        samples, steps = samples + n, steps + 1
        timer.done(n, compiled=state.compiles.count != compiled_before)  # a compiling step is no steady step
        on_step(n)
        if state.step % log_every == 0:
            logged = {"train/loss": window.close(carried)}  # host sync; NaN/inf raise
            if (lr := current_lr(optimizer)) != logged_lr:
                logged["train/lr"] = logged_lr = lr
            log({**logged, **group.step_metrics()}, state.step)
        if checkpoint_every and state.step % checkpoint_every == 0:
            window.verify()  # host sync point; raises on NaN/inf before anything is written
            save_checkpoint()
        if 0 < max_steps <= state.step:
            break
        if stopped:
            break
    window.close()  # the epoch's last, unlogged steps are checked and counted too
    breakdown = timer.finish()  # waits for the device (CUDA, MPS: the epoch's one event sync)
    mean_loss = window.epoch_mean()
    seconds = time.perf_counter() - start
    reached = 0 < max_steps <= state.step
    return EpochStats(
        mean_loss,
        samples,
        steps,
        seconds,
        reached,
        breakdown,
        stopped=bool(stopped),
        stop_signal=stopped,
        skipped_steps=skipped,
    )


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

    Each micro-batch's loss is weighted by its share of what the loss averages over (``task.weight``: samples,
    elements or counted tokens), so the gradients equal the whole batch's (up to float rounding) and the optimizer
    step is unchanged. With ``hold_last``, the last micro-batch's backward is not run: its weighted loss is returned
    second (else None), for DDP to run it with the all-reduce overlapped once the ranks have agreed that the step
    goes on. The forward and the loss run under autocast (``amp=true``).
    """
    state.optimizer.zero_grad(set_to_none=True)
    task = state.task
    pieces = state.micro.pieces(count(labels))
    if pieces == 1:  # the common case: no accumulation, no extra ops
        with policy.autocast():
            loss = task.loss(call_model(state.model, prepare(images)), labels)
        if hold_last:
            return loss.detach(), loss
        state.scaler.scale(loss).backward()
        return loss.detach(), None
    parts = state.split((images, labels), pieces)
    whole = task.weight(labels)
    total = torch.zeros((), device=_device_of(labels))
    for index, (part, part_labels) in enumerate(parts):
        with policy.autocast():
            loss = task.loss(call_model(state.model, prepare(part)), part_labels) * (task.weight(part_labels) / whole)
        total += loss.detach()
        if hold_last and index == pieces - 1:
            return total, loss
        state.scaler.scale(loss).backward()
    return total, None


def _device_of(batch: Any) -> torch.device:
    from pipeline.data.structures import leaves

    found = leaves(batch)
    return found[0].device if found else torch.device("cpu")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    device: torch.device,
    policy: PrecisionPolicy,
    prepare: Callable[[Any], Any],
    micro: MicroBatcher | None = None,
    group: Solo | Group = SOLO,
    task: Task | None = None,
    split_batch: Splitter = split,
) -> EvalStats:
    """``val/loss`` and the task's metrics over ``batches``; one host sync at the end.

    With ``micro`` (evaluation's own, never training's), batches run in its micro-batches and an
    out-of-memory error shrinks them and replays the batch (no accumulation needed: evaluation only sums).
    Under DDP each rank evaluates its share and the sums are reduced before they become numbers.
    """
    task = task or Classification()
    model.eval()
    task.reset()
    exact = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    totals = torch.zeros(task.width, device=device, dtype=exact)  # a rank without batches sends these zeros
    samples = 0
    for images, labels in batches:
        images, labels = move(images, device), move(labels, device)
        n = count(labels)
        while True:
            try:
                pieces = micro.pieces(n) if micro else 1
                batch_sums = _evaluate_batch(
                    model, split_batch((images, labels), pieces), task=task, policy=policy, prepare=prepare
                )
                break
            except Exception as err:
                failure = micro.diagnose(err, device) if micro else None  # while the failed pass's memory is held
                if failure is None:
                    if hit_recompile_limit(err):  # evaluation's own shapes and mode count towards the limit too
                        raise recompile_limit_error(None) from err
                    raise
            micro.recover(failure, step=-1, optimizer=None, scaler=None, device=device)
        totals += batch_sums.to(exact)
        samples += n
    counted = torch.tensor([float(samples)], device=device, dtype=exact)
    reduced = group.sum(torch.cat([totals, counted])).tolist()  # the pass's one host sync
    count_all = int(reduced[-1])
    if count_all == 0:
        return EvalStats({name: float("nan") for name in task.metric_names}, 0)
    return EvalStats(task.finish(reduced[:-1]), count_all)


def _evaluate_batch(
    model: nn.Module, parts: list[Any], *, task: Task, policy: PrecisionPolicy, prepare: Callable[[Any], Any]
) -> torch.Tensor:
    sums = None
    for inputs, targets in parts:
        with policy.autocast():
            outputs = call_model(model, prepare(inputs))
        batch = task.sums(outputs, targets)
        sums = batch if sums is None else sums + batch
    assert sums is not None
    return sums
