"""One training epoch and one evaluation pass, written like the set-up recipe's pseudo-code.

One step's hard parts (the out-of-memory replay, DDP, the stop protocol) are ``pipeline.engine.hot.step.run_step``'s.
The hot loop never reads a value back from the device except at logging points: losses are
summed on the device and ``.item()`` (a host sync on GPUs) runs every ``log_every`` steps and at
the end of the epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from pipeline.common.metric_names import AMP_SKIPPED_STEPS, TRAIN_GRAD_NORM, TRAIN_LOSS, TRAIN_LR, VAL_ACC, VAL_LOSS
from pipeline.data.structures import count, move, split
from pipeline.engine.hot.compilation import hit_recompile_limit, recompile_limit_error
from pipeline.engine.hot.hooks import Computed, Step, StepContext
from pipeline.engine.hot.losses import LossWindow
from pipeline.engine.hot.memory import MicroBatcher
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.hot.step import (
    ALONE,
    SOLO,
    Inputs,
    LogFn,
    Peers,
    SkippedSteps,
    Splitter,
    StepOutcome,
    TrainState,
    run_step,
)
from pipeline.engine.hot.tasks import Task
from pipeline.engine.hot.timing import Breakdown, EventTimer, WallTimer
from pipeline.engine.optim import current_lr
from pipeline.parallel.distributed import Group, Solo

if TYPE_CHECKING:  # the profiler's timer wraps the step timer; the loop only marks it
    from pipeline.engine.observe.profiling import ProfiledTimer

    StepTimer = WallTimer | EventTimer | ProfiledTimer  # the last: trainer.profile=true (observe/profiling.py)


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
    scaled: bool = False  # the GradScaler was on (float16): skipped_steps is a figure to log

    @property
    def samples_per_s(self) -> float:
        """Steady-state throughput (the first step, with its warm-up, left out)."""
        return self.breakdown.samples_per_s

    def metrics(self) -> dict[str, float]:
        """What the epoch's end logs of these beyond the step times: ``amp/skipped_steps`` (float16 runs)."""
        return {AMP_SKIPPED_STEPS: self.skipped_steps} if self.scaled else {}


@dataclass(frozen=True)
class EvalStats:
    metrics: dict[str, float]  # val/loss and the task's metrics (pipeline.engine.hot.tasks)
    samples: int

    @property
    def loss(self) -> float:
        return self.metrics.get(VAL_LOSS, float("nan"))

    @property
    def accuracy(self) -> float:
        return self.metrics.get(VAL_ACC, float("nan"))


class StepMetrics:
    """The loop's metrics writer, which knows its own steps: every ``every``-th (``trainer.log_every_n_steps``), the
    interval's ``train/loss``, and ``train/lr`` when it changed since the writer's last point (one writer per
    epoch: a constant rate is logged once an epoch, a schedule every interval)."""

    def __init__(self, write: LogFn = lambda metrics, step: None, every: int = 50) -> None:
        self.write, self.every = write, every
        self.lr: float | None = None  # the rate last logged

    def should_log(self, step: int) -> bool:
        return step % self.every == 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.write(metrics, step)

    def window(self, device: torch.device, scaler: torch.amp.GradScaler, group: Solo | Group) -> LossWindow:
        """The losses of one logging interval, summed on the device (mean over the ranks under DDP)."""
        return LossWindow(self.every, device, skipped_steps_expected=scaler.is_enabled(), reduce=group.mean)

    def log_training(
        self,
        loss: float,
        step: int,
        *,
        optimizer: torch.optim.Optimizer,
        group: Solo | Group = SOLO,
        grad_norm: torch.Tensor | None = None,
    ) -> None:
        """A logging point: the interval's loss, the rate when it changed, the gradients' norm before clipping (with
        ``trainer.clip_grad_*``) and DDP's ``time/allreduce_ms``."""
        logged = {TRAIN_LOSS: loss}
        if (lr := current_lr(optimizer)) != self.lr:
            logged[TRAIN_LR] = self.lr = lr
        if grad_norm is not None:
            logged[TRAIN_GRAD_NORM] = float(grad_norm)  # this step's; the logging point syncs already
        self.write({**logged, **group.step_metrics()}, step)


class Checkpoints(Protocol):
    """Mid-epoch checkpoints, which know their own steps (``checkpoint.every_n_steps``)."""

    def due(self, step: int) -> bool: ...

    def save(self, step: int) -> None: ...


class NoCheckpoints:
    def due(self, step: int) -> bool:
        return False

    def save(self, step: int) -> None:
        raise AssertionError("NoCheckpoints is never due")


@dataclass(frozen=True)
class EpochHooks:
    """What an epoch tells as it goes: its step ``metrics`` and mid-epoch ``checkpoints`` (each knows its own steps),
    each step's samples (``on_step``: a progress bar, never touching the device), and each trained batch as the step
    had it (``keep``: ``pipeline.engine.observe.replay``; a reference, no copy)."""

    metrics: StepMetrics = field(default_factory=lambda: StepMetrics())
    checkpoints: Checkpoints = field(default_factory=lambda: NoCheckpoints())
    on_step: Callable[[int], None] = lambda samples: None
    keep: Callable[[Any, Any, int], None] = lambda images, labels, samples: None


def train_epoch(
    state: TrainState,
    batches: Iterable[Any],
    *,
    inputs: Inputs,
    timer: StepTimer,
    peers: Peers = ALONE,
    hooks: EpochHooks | None = None,
    max_steps: int = -1,
) -> EpochStats:
    """Train over ``batches`` once (or until ``max_steps`` optimizer steps in total; -1 = no limit). Each batch is
    moved and augmented once (``inputs``), then ``run_step`` trains on it, answering to ``peers`` (DDP's group, stop
    requests). ``timer`` is marked four times a step and told when a step compiled; ``hooks`` hear of each step (a
    checkpoint holds no unchecked weights). A stop ends it after a step, an abandon before."""
    hooks = hooks or EpochHooks()
    metrics, checkpoints, group = hooks.metrics, hooks.checkpoints, peers.group
    state.model.train()
    state.context.training = True
    window = metrics.window(inputs.device, state.scaler, group)
    tally, outcome = _Tally(state.scaler), StepOutcome(None)
    timer.start()
    for images, labels in timer.batches(batches):
        compiled_before = state.compiles.count  # a Python int: reading it costs nothing
        images, labels = inputs.move(images), inputs.move(labels)
        timer.copied()
        images, n = inputs.augmented(images, state.step + 1), count(labels, state.batch_dim)
        carry = window.pending if metrics.should_log(state.step + 1) else None
        outcome = run_step(state, images, labels, inputs=inputs, peers=peers, log=metrics.log, carry=carry)
        if outcome.loss is None:  # abandoned: not counted, nothing applied, the epoch ends at the last step
            break
        state.step += 1
        tally.add(n)
        hooks.keep(images, labels, n)  # a reference, no copy
        window.add(outcome.loss, n, state.step)  # one small device copy per step, no sync
        timer.done(n, compiled=state.compiles.count != compiled_before)  # a compiling step is no steady step
        hooks.on_step(n)
        if metrics.should_log(state.step):  # window.close: a host sync; NaN/inf raise
            loss = window.close(outcome.carried)
            metrics.log_training(loss, state.step, optimizer=state.optimizer, group=group, grad_norm=state.clip.norm)
        if checkpoints.due(state.step):
            window.verify()  # host sync point; raises on NaN/inf before anything is written
            checkpoints.save(state.step)
        if 0 < max_steps <= state.step or outcome.stopped:
            break
    window.close()  # the epoch's last, unlogged steps are checked and counted too
    return tally.stats(window, timer.finish(), outcome, reached=0 < max_steps <= state.step)


class _Tally:
    """What an epoch counts as it goes: samples, steps, float16 steps skipped, and its wall clock."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.samples, self.steps, self.skipped = 0, 0, SkippedSteps(scaler)
        self.start = time.perf_counter()

    def add(self, samples: int) -> None:
        self.skipped.check()
        self.samples, self.steps = self.samples + samples, self.steps + 1

    def stats(self, window: LossWindow, breakdown: Breakdown, last: StepOutcome, *, reached: bool) -> EpochStats:
        """``breakdown``: the timer's, finished (CUDA, MPS: the epoch's one event sync)."""
        mean_loss, seconds = window.epoch_mean(), time.perf_counter() - self.start
        return EpochStats(
            mean_loss,
            self.samples,
            self.steps,
            seconds,
            reached,
            breakdown,
            last.stopped,
            last.stop_signal,
            self.skipped.count,
            self.skipped.scaler.is_enabled(),
        )


@dataclass
class Scoring:
    """How evaluation scores a batch: the task's sums of what the step computed, in evaluation's own step context
    (``ctx.state`` of its own, emptied before each pass), cut into micro-batches by ``split`` along ``batch_dim``."""

    task: Task
    compute: Step
    context: StepContext
    split: Splitter = split
    batch_dim: int = 0
    outputs: bool = True  # the step returns outputs for the task's metrics (a hook that returns a loss alone: not)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return self.task.metric_names if self.outputs else (VAL_LOSS,)

    def sums(self, done: Computed, targets: Any) -> torch.Tensor:
        """One micro-batch's running sums: the task's of the step's outputs (``val/loss`` the step's own loss, weighted
        by what it averages over), or, for a step that returns only its loss, that loss and its weight."""
        targets = done.targets if done.targets is not None else targets
        if not self.compute.custom:
            return self.task.sums(done.outputs, targets)
        weight = torch.as_tensor(self.task.weight(targets), dtype=torch.float32, device=done.loss.device)
        loss = done.loss.detach().float().reshape(()) * weight
        if not self.outputs:
            return torch.stack([loss, weight])
        sums = self.task.sums(done.outputs, targets)
        return torch.cat([loss.to(sums.dtype).reshape(1), sums[1:]])

    @property
    def width(self) -> int:
        return self.task.width if self.outputs else 2

    def finish(self, totals: list[float]) -> dict[str, float]:
        if self.outputs:
            return self.task.finish(totals)
        loss, weight = totals
        return {VAL_LOSS: loss / weight if weight else float("nan")}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    inputs: Inputs,
    scoring: Scoring,
    micro: MicroBatcher | None = None,
    group: Solo | Group = SOLO,
) -> EvalStats:
    """``val/loss`` and the task's metrics over ``batches``, moved to ``inputs.device`` and prepared as training's
    (``inputs.prepare``, under ``inputs.policy``'s autocast; never augmented); one host sync at the end.

    With ``micro`` (evaluation's own, never training's), batches run in its micro-batches and an
    out-of-memory error shrinks them and replays the batch (no accumulation needed: evaluation only sums).
    Under DDP each rank evaluates its share and the sums are reduced before they become numbers.
    """
    device, policy, prepare = inputs.device, inputs.policy, inputs.prepare
    task, context = scoring.task, scoring.context
    model.eval()
    task.reset()
    context.begin(context.epoch)
    context.training = False
    exact = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    totals = torch.zeros(scoring.width, device=device, dtype=exact)  # a rank without batches sends these zeros
    samples = 0
    for images, labels in batches:
        images, labels = move(images, device), move(labels, device)
        n = count(labels, scoring.batch_dim)
        while True:
            try:
                pieces = micro.pieces(n) if micro else 1
                if pieces > 1:
                    scoring.compute.check_split(context)
                parts = scoring.split((images, labels), pieces)
                batch_sums = _evaluate_batch(model, parts, scoring=scoring, policy=policy, prepare=prepare)
                break
            except Exception as err:
                # diagnosed while the failed pass's memory is held
                if micro is None or (failure := micro.diagnose(err, device)) is None:
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
        return EvalStats({name: float("nan") for name in scoring.metric_names}, 0)
    return EvalStats(scoring.finish(reduced[:-1]), count_all)


def _evaluate_batch(
    model: nn.Module, parts: list[Any], *, scoring: Scoring, policy: PrecisionPolicy, prepare: Callable[[Any], Any]
) -> torch.Tensor:
    sums = None
    for inputs, targets in parts:
        with policy.autocast():
            done = scoring.compute.compute(model, prepare(inputs), targets, scoring.context)
        batch = scoring.sums(done, targets)
        sums = batch if sums is None else sums + batch
    assert sums is not None
    return sums
