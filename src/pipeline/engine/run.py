"""A run's training: ``fit(run, start)`` trains the epochs from ``start`` to the last (or ``trainer.max_steps``), each
trained, evaluated, logged and checkpointed. ``Run`` holds what stays the same for all of them.

``pipeline.train`` builds the run and opens its record, its sampler and its checkpointer; this trains it; the
record's end (``pipeline.report.logbook.conclude``) reads what ``fit`` returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.common.heap import collector_running
from pipeline.common.metric_names import (
    OOM_EVAL_MICRO_BATCH_SIZE,
    RANK_DATA_WAIT_PCT,
    RANK_GPU_UTIL_MEAN_PCT,
    RANK_SAMPLES_PER_S,
    THROUGHPUT_GLOBAL_SAMPLES_PER_S,
    TIME_DATA_WAIT_PCT_SLOWEST_RANK,
    TIME_LAUNCH_TO_FIRST_STEP_S,
    TIME_SLOWEST_RANK,
    rank_metric,
)
from pipeline.config import TrainerConfig
from pipeline.data.workers import worker_faults
from pipeline.engine.building.build import Setup
from pipeline.engine.checkpointing.checkpoint import Checkpointer, Position
from pipeline.engine.checkpointing.continuation import MidwayCheckpoints
from pipeline.engine.hot.loop import EpochHooks, EpochStats, EvalStats, StepMetrics, evaluate, train_epoch
from pipeline.engine.hot.step import Peers
from pipeline.engine.hot.timing import launch_metrics, make_timer
from pipeline.engine.observe.progress import (
    EpochSteps,
    NoProgress,
    ProgressBar,
    RunProgress,
    amp_reference,
    steps_to_train,
)
from pipeline.engine.results import EpochResult
from pipeline.engine.stopping import Stopped, StopRequests, workers_stopped_too
from pipeline.monitor import allocator_metrics
from pipeline.record.lifecycle import Tracker

if TYPE_CHECKING:
    from pipeline.engine.hot.loop import StepTimer

log = logging.getLogger("pipeline.train")  # the name its lines have always carried (a log config may filter by it)


class EpochModels(Protocol):
    """What happens to the model at each epoch's checkpoint (``tracking.log_model=checkpoints`` logs it; ``last``
    says where the newest went, None when none was logged)."""

    @property
    def last(self) -> Any: ...

    def checkpointed(self, epoch: int) -> None: ...


class NoEpochModels:
    """Nothing happens to the model at the checkpoints (``tracking.log_model`` final or false)."""

    last = None

    def checkpointed(self, epoch: int) -> None:
        pass


@dataclass(frozen=True)
class Run:
    """What stays the same for all of a run's epochs: what was built, the trainer's settings, and where the run's
    metrics, utilisation, checkpoints and stop requests go. ``started``: when the run started (``time.perf_counter``),
    the origin of the auto profile's and the replay check's budgets. ``progress``: ``bar``, ``lines`` or ``none``
    (``pipeline.engine.observe.progress.progress_mode``). ``evaluated``: told each evaluation pass's seconds (the GPU
    check times them; evaluation ends with a host sync, so its wall clock is the device's time too)."""

    setup: Setup
    trainer: TrainerConfig
    tracker: Tracker
    sampler: Any  # pipeline.monitor's Sampler or NullSampler
    saver: Checkpointer
    stop: StopRequests
    started: float
    progress: str = "bar"
    models: EpochModels = field(default_factory=NoEpochModels)
    evaluated: Callable[[float], None] = lambda seconds: None


@dataclass(frozen=True)
class Fitted:
    """What ``fit`` trained: the epochs' records, and when each began on the sampler's clock (the timeline's marks)."""

    epochs: list[EpochResult]
    starts: list[float]


def fit(run: Run, start: Position) -> Fitted:
    """Train from ``start`` to the last epoch or ``trainer.max_steps``, checkpointing as configured.

    Raises ``Stopped`` after writing a checkpoint when a stop request ended an epoch; a loader worker's death while a
    stop is pending is that stop (``workers_stopped_too``), anywhere else a ``LoaderError`` (``worker_faults``)."""
    # the collector's one pass over start-up's objects, then on while training (pipeline.common.heap)
    with workers_stopped_too(run.stop), collector_running(), worker_faults():
        return _Epochs(run, start).train()


class _Epochs:
    """The epochs of one ``fit``: the run, where it starts, its progress lines and its step timer."""

    def __init__(self, run: Run, start: Position) -> None:
        setup, trainer = run.setup, run.trainer
        self.run, self.start = run, start
        total = steps_to_train(
            epochs=trainer.epochs,
            per_epoch=len(setup.train_batches),
            max_steps=trainer.max_steps,
            epoch=start.epoch,
            batch=start.batch,
            step=start.step,
        )
        self.progress = RunProgress(
            total_steps=total,
            periodic=run.progress == "lines",
            reference=amp_reference(setup.amp_probe),
            speak=setup.group.is_main,
        )
        step, apart = (lambda: setup.state.step), self.progress.set_apart  # profile=false: the timer as it is
        self.timer: StepTimer = setup.profiler.wrap(
            make_timer(setup.device), step=step, apart=apart, total=total, began=run.started
        )

    def train(self) -> Fitted:
        run, setup, start = self.run, self.run.setup, self.start
        fitted = Fitted([], [])
        for epoch in range(start.epoch, run.trainer.epochs + 1):
            skip = start.batch if epoch == start.epoch else 0
            setup.train_batches.set_epoch(epoch, skip=skip)  # the epoch's order, minus the batches done before
            setup.state.context.begin(epoch, keep=skip > 0)  # a step hook's state: empty, or the checkpoint's
            fitted.starts.append(run.sampler.now())
            record, done = self.epoch(epoch, skip)
            position = Position(epoch, skip + done, setup.state.step)
            if record is None:  # stopped mid-epoch at a step boundary
                _stopped_at(setup, run.saver.write(position, status="stopped"))
                raise Stopped(run.stop.signum or 0, checkpoints=run.stop.checkpoints)
            fitted.epochs.append(record)
            complete = done == len(setup.train_batches)
            run.saver.write(Position(epoch + 1, 0, setup.state.step) if complete else position)
            run.models.checkpointed(epoch)  # tracking.log_model=checkpoints: the model here, its metrics linked
            if 0 < run.trainer.max_steps <= setup.state.step:
                log.info("trainer.max_steps=%d reached", run.trainer.max_steps)
                break
        return fitted

    def epoch(self, epoch: int, skip: int) -> tuple[EpochResult | None, int]:
        """Train one epoch (its batches after ``skip``), evaluate, log the epoch's metrics and write them.
        Returns the epoch's record (None when a stop request ended it early) and the batches trained."""
        run, setup = self.run, self.run.setup
        since = run.sampler.now()  # the sampler's clock, for this epoch's utilisation summary
        started_at = time.time()
        with run.stop.interruptible():  # a second Ctrl-C or SIGTERM in here stops at once
            stats, steps = self._train(epoch, skip)
            if stats.stopped:
                run.stop.adopt(stats.stop_signal)  # under DDP the signal may have reached another rank only
                run.tracker.flush()
                return None, steps.done
            val = self._evaluate(epoch, stats)
        utilisation = run.sampler.summary(since=since)
        ranks = rank_metrics(setup.group.gather(rank_view(stats.breakdown, utilisation)))
        launch = launch_metrics(started_at, stats.breakdown) if epoch == 1 and not skip else {}
        record = EpochResult(epoch, stats.loss, val.metrics, stats.seconds, stats.samples_per_s, stats.breakdown,
                             ranks, launch_s=launch.get(TIME_LAUNCH_TO_FIRST_STEP_S))  # fmt: skip
        run.tracker.log_metrics(epoch_metrics(setup, record, stats, utilisation, launch), step=epoch)
        run.tracker.flush()
        _log_epoch(record, run.trainer.epochs, setup.task.primary)
        return record, steps.done

    def _train(self, epoch: int, skip: int) -> tuple[EpochStats, EpochSteps]:
        """The epoch's training steps, with its progress bar, step metrics and mid-epoch checkpoints."""
        run, setup, trainer = self.run, self.run.setup, self.run.trainer
        batches_left = len(setup.train_batches)
        left = batches_left if trainer.max_steps < 0 else min(batches_left, trainer.max_steps - setup.state.step)
        bar = ProgressBar(total=left, epoch=epoch, epochs=trainer.epochs) if run.progress == "bar" else NoProgress()
        self.progress.start_epoch(epoch, trainer.epochs)
        steps = EpochSteps(bar, self.progress)

        def position(step: int) -> Position:  # a mid-epoch checkpoint's place
            return Position(epoch, skip + steps.done, step)

        hooks = EpochHooks(
            metrics=StepMetrics(steps.logging_to(run.tracker), every=trainer.log_every_n_steps),
            checkpoints=MidwayCheckpoints(run.saver, run.tracker, position),
            on_step=steps.step,
            keep=setup.replay.keep,
        )
        peers = Peers(setup.group, run.stop)
        stats = train_epoch(
            setup.state, setup.train_batches, inputs=setup.inputs, timer=self.timer, peers=peers, hooks=hooks,
            max_steps=trainer.max_steps,
        )  # fmt: skip
        bar.close()
        return stats, steps

    def _evaluate(self, epoch: int, stats: EpochStats) -> EvalStats:
        """The replay check (once), the ranks' BatchNorm statistics made one, and the evaluation pass; a schedule fed
        by it steps."""
        run, setup = self.run, self.run.setup
        state = setup.state
        # perf/replay_speedup: once, a few steps on one batch, the state put back (pipeline.engine.observe.replay)
        setup.replay.after_epoch(
            state,
            stats.breakdown,
            inputs=setup.inputs,
            group=setup.group,
            steps_left=self.progress.total - self.progress.done,
            started=run.started,
        )
        setup.group.broadcast_buffers(state.model)  # BatchNorm's running statistics: rank 0's, on every rank
        setup.scoring.context.epoch = epoch
        began = time.perf_counter()
        val = evaluate(
            state.model, setup.val_batches, inputs=setup.inputs, scoring=setup.scoring, micro=setup.eval_micro,
            group=setup.group,
        )  # fmt: skip
        run.evaluated(time.perf_counter() - began)
        state.scheduler.after_evaluation(val.metrics)  # scheduler.interval=epoch, or a schedule fed a val metric
        return val


def _stopped_at(setup: Setup, path: Any) -> None:
    where = (
        f"checkpoint {path}"
        if path
        else "rank 0 writes the checkpoint"
        if not setup.group.is_main
        else "no checkpoint (checkpoint.enabled=false): a new run starts from scratch"
    )
    log.warning("stopped at step %d; %s", setup.state.step, where)


def _log_epoch(record: EpochResult, epochs: int, primary: str) -> None:
    log.info(
        "epoch %d/%d: train/loss %.4f val/loss %.4f %s %.4f %.2fs %.0f samples/s",
        record.epoch,
        epochs,
        record.train_loss,
        record.val_loss,
        primary,
        record.val_metrics.get(primary, float("nan")),
        record.seconds,
        record.job_samples_per_s,
    )


def rank_view(breakdown: Any, utilisation: Any) -> dict[str, float]:
    """What rank 0 records of each rank's epoch: its data-wait share, its throughput and its GPU's utilisation."""
    view = {RANK_DATA_WAIT_PCT: breakdown.data_wait_pct, RANK_SAMPLES_PER_S: breakdown.samples_per_s}
    if utilisation.gpu_util_mean_pct is not None:
        view[RANK_GPU_UTIL_MEAN_PCT] = utilisation.gpu_util_mean_pct
    return view


def rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rank 0's record of every rank's epoch: ``ranks/<r>/<name>`` for each, the slowest rank's data wait, and
    the job's throughput (the sum of the ranks')."""
    if len(per_rank) <= 1:
        return {}
    metrics = {rank_metric(r, name): value for r, values in enumerate(per_rank) for name, value in values.items()}
    waits = [values.get(RANK_DATA_WAIT_PCT, 0.0) for values in per_rank]
    metrics[TIME_DATA_WAIT_PCT_SLOWEST_RANK] = max(waits)
    metrics[TIME_SLOWEST_RANK] = float(waits.index(max(waits)))
    metrics[THROUGHPUT_GLOBAL_SAMPLES_PER_S] = sum(values.get(RANK_SAMPLES_PER_S, 0.0) for values in per_rank)
    return metrics


def epoch_metrics(
    setup: Setup, record: EpochResult, stats: EpochStats, utilisation: Any, launch: dict[str, float]
) -> dict[str, float]:
    """What an epoch logs at its end, each part from the record that holds it (``launch``: the run's first epoch's
    start-up figures, else empty)."""
    eval_micro = setup.eval_micro
    return {
        **record.metrics(),  # train/epoch_loss, val/*, time/epoch_s
        **stats.breakdown.metrics(),
        **setup.model_flops.metrics(stats.samples_per_s),  # perf/tflops, perf/mfu_pct: this rank's device
        **utilisation.metrics(),
        **record.ranks,
        **allocator_metrics(setup.device),
        **stats.metrics(),  # amp/skipped_steps (float16)
        **({OOM_EVAL_MICRO_BATCH_SIZE: eval_micro.micro_batch} if eval_micro.events else {}),
        **launch,
    }
