"""``train(cfg)``: build everything the config names, train, evaluate, record. Returns a ``RunResult``.

Order matters: the checkpoint to resume (if any), the device, the data and the model are all
settled before the MLflow run is opened, so a bad ``resume=``, a missing GPU or dataset fails
fast and leaves no half-made or modified run behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.common import usercode
from pipeline.common.heap import collector_paused, collector_running
from pipeline.common.metric_names import TIME_LAUNCH_TO_FIRST_STEP_S
from pipeline.common.secrets import env_values, mask_overrides, mask_tree
from pipeline.common.usercode import user_errors
from pipeline.config import RunConfig, TrainerConfig
from pipeline.data.workers import deaths_expected_while, worker_faults
from pipeline.engine import checkpoint, compilation, continuation, resume
from pipeline.engine.build import Setup, announce, build
from pipeline.engine.continuation import MidwayCheckpoints, stop_says_how_to_continue
from pipeline.engine.loop import StepMetrics, evaluate, train_epoch
from pipeline.engine.memory import out_of_memory_is_an_error
from pipeline.engine.progress import (
    EpochSteps,
    NoProgress,
    ProgressBar,
    RunProgress,
    amp_reference,
    progress_mode,
    steps_to_train,
)
from pipeline.engine.provenance import run_tags, sweep_run_name, with_overrides
from pipeline.engine.start import FreshStart, Resumed
from pipeline.engine.stopping import Stopped, StopRequests, workers_stopped_too
from pipeline.engine.timing import launch_metrics, make_timer
from pipeline.machine import doctor
from pipeline.monitor import open_sampler
from pipeline.parallel import distributed
from pipeline.record.lifecycle import Tracker, open_tracker
from pipeline.record.reachability import check_reachable
from pipeline.report import logbook
from pipeline.report.logbook import epoch_metrics, rank_metrics, rank_view
from pipeline.report.summary import EpochResult, RunResult, format_summary

if TYPE_CHECKING:
    from pipeline.experiments.sweep import SweepJob

log = logging.getLogger(__name__)


def train(
    cfg: RunConfig,
    *,
    overrides: Sequence[str] = (),
    echo: bool = True,
    quiet: bool = False,
    sweep: SweepJob | None = None,
    own_overrides: Sequence[str] | None = None,
) -> RunResult:
    """Train and evaluate the configured model and record the run.

    Args:
        cfg: a validated config (``pipeline.config.from_dictconfig``).
        overrides: the command-line overrides as typed, for the record.
        echo: print the summary at the end.
        quiet: no progress bar (sweep jobs).
        sweep: the sweep job this run is (``pipeline.experiments.sweep.current_job``): the run is nested under the
        sweep's
            parent run, tagged with the sweep, and named after its swept values unless ``tracking.run_name`` is set.
        own_overrides: the run's own configuration as overrides, kept in its checkpoints for a resume to restore
            (``pipeline.engine.continuation``); default ``overrides`` without ``resume=``/``fork=``.

    Raises:
        Stopped: SIGTERM or Ctrl-C arrived; a checkpoint was written and the run marked KILLED.
    """
    started = time.perf_counter()
    usercode.forget()  # where the user's code lives is this run's targets' to say, not an earlier run's
    # torchrun: this rank's place in the job; else a plain run. Memory running out ends the run in one line. No
    # collector passes over what start-up and close import (pipeline.common.heap); training has them (run_epochs).
    with (
        collector_paused(freeze=False),
        user_errors(),  # an exception raised in the user's code: one line naming their file, line and key
        out_of_memory_is_an_error(),
        distributed.joined(cfg.device) as group,
    ):
        own = continuation.own_overrides(overrides if own_overrides is None else own_overrides)
        return _train(cfg, group, started, overrides=overrides, own=own, echo=echo, quiet=quiet, sweep=sweep)


def _train(
    cfg: RunConfig,
    group: distributed.Solo | distributed.Group,
    started: float,
    *,
    overrides: Sequence[str],
    own: list[str],
    echo: bool,
    quiet: bool,
    sweep: SweepJob | None,
) -> RunResult:
    is_main = group.is_main  # rank 0 alone records the run and writes checkpoints
    _fail_fast(cfg, is_main)
    masked_config = mask_tree(cfg.to_dict(), cfg.env_keys)  # the record never holds a secret
    secret_values = env_values(cfg)  # masked wherever they land in the record; refuses an experiment named from one
    start = resume.start_point(cfg, masked_config, group)  # a resumed run stays locked to this process until it ends
    stop = StopRequests(checkpoints=cfg.checkpoint.enabled)  # entered once the run is built (_open_session)
    with start, contextlib.ExitStack() as session:
        # loader workers killed by the same stop signal are no fault, up to and while their loaders end: on a loaded
        # machine they can die of it only as the run ends them
        session.enter_context(deaths_expected_while(stop.requested))
        setup = build(cfg, group, explain_missing_gpu=doctor.main_finding)
        session.callback(setup.end_loaders)  # its loader workers end with it, whichever way it ends
        typed_overrides = mask_overrides(overrides, cfg.env_keys)
        setup = _named(setup, typed_overrides, sweep) if not cfg.tracking.run_name else setup
        announce(setup, cfg)  # under the name the summary and MLflow show
        start.restore(setup.state, setup.device, cfg.optimizer)
        tags = start.run_tags(_tags(masked_config, setup, typed_overrides, sweep))
        logbook.check_model_format(setup, cfg)  # tracking.model_format=pt2 for a model it cannot take: refused now
        tracker = _open_session(session, cfg, setup, start, stop, tags=tags, secret_values=secret_values)
        if is_main:
            logbook.start(tracker, setup, cfg, masked_config, typed_overrides, start)
        models = logbook.epoch_models(cfg, tracker, setup)  # tracking.log_model=checkpoints: one at each epoch's
        epochs, starts, sampler = _fit(
            cfg, setup, start, masked_config, tracker=tracker, stop=stop, own=own, quiet=quiet, models=models,
            started=started,
        )  # fmt: skip
        total_s = time.perf_counter() - started
        result = logbook.conclude(
            setup, cfg, epochs, tracker=tracker, sampler=sampler, epoch_starts=starts, total_s=total_s, models=models
        )
        summary = format_summary(result)
        tracker.set_tags({"mlflow.note.content": f"```\n{summary}\n```"})
    if echo and is_main:
        print(summary, flush=True)
    return result


def _open_session(
    session: contextlib.ExitStack,
    cfg: RunConfig,
    setup: Setup,
    start: FreshStart | Resumed,
    stop: StopRequests,
    *,
    tags: dict[str, Any],
    secret_values: frozenset[str],
) -> Tracker:
    """Open, in this order and on ``session``, what the run's training and record need: stop handling, the tracker
    (rank 0's records; the others' record nothing), and the profiler's and the memory snapshot's recording into it."""
    session.enter_context(stop)
    tracker = session.enter_context(
        open_tracker(
            cfg.tracking if setup.group.is_main else dataclasses.replace(cfg.tracking, enabled=False),
            run_name=setup.run_name,
            tags=tags,
            run_id=start.run_id,
            secret_values=secret_values,
        )
    )
    session.enter_context(user_errors())  # inside the tracker: the run's FAILED record says it as the user's too
    session.enter_context(setup.profiler.recording(tracker))  # trainer.profile: where the profiled steps are kept
    session.enter_context(setup.snapshot.recording(tracker))  # trainer.memory_snapshot=on_oom: kept at an OOM
    start.continue_record(tracker)  # the same run: steps trained again keep their first points
    return tracker


def _fail_fast(cfg: RunConfig, main: bool) -> None:
    """What can refuse the run before any data is loaded: a dead tracking server (in seconds), an unusable
    checkpoint folder; and a fresh recompile budget (a sweep's earlier jobs' graphs must not count towards it)."""
    if cfg.tracking.enabled and main:
        check_reachable(cfg.tracking.uri)
    checkpoint.check_dir(cfg.checkpoint)
    if cfg.trainer.compile:
        compilation.fresh()


def _named(setup: Setup, typed_overrides: list[str], sweep: SweepJob | None) -> Setup:
    """``setup`` under a name of its own: runs whose configurations differ never share one (``tracking.run_name``
    unset)."""
    swept = sweep.values if sweep is not None else {}
    name = sweep_run_name(setup.run_name, swept) if sweep is not None else setup.run_name
    return dataclasses.replace(setup, run_name=with_overrides(name, typed_overrides, list(swept)))


def _tags(
    masked_config: dict[str, Any], setup: Setup, typed_overrides: list[str], sweep: SweepJob | None
) -> dict[str, Any]:
    """The run's tags: the configured ones, what ran it, and the sweep's (``mlflow.parentRunId`` nests the run under
    the sweep's parent in the UI)."""
    tags = {
        **masked_config["tracking"]["tags"],
        **run_tags(setup.choice, setup.policy, typed_overrides, setup.backends),
    }
    return {**tags, **sweep.tags()} if sweep is not None else tags


def _fit(
    cfg: RunConfig,
    setup: Setup,
    start: FreshStart | Resumed,
    masked_config: dict[str, Any],
    *,
    tracker: Tracker,
    stop: StopRequests,
    own: list[str],
    quiet: bool,
    models: Any,
    started: float,
) -> tuple[list[EpochResult], list[float], Any]:
    """Train from ``start`` with the checkpointer (holding ``masked_config``) and the utilisation sampler open.
    Returns the epochs' results, their start times on the sampler's clock, and the sampler (stopped); the last
    checkpoint is marked finished."""
    saver = checkpoint.Checkpointer.for_run(
        cfg.checkpoint,
        cfg.tracking,
        run_id=setup.group.share(lambda: tracker.run_id),  # every rank knows the run's checkpoint folder
        write=setup.group.is_main,
        world_size=setup.group.world_size,
        run_name=setup.run_name,
        state=setup.state,
        device=setup.device,
        config=masked_config,
        lock=start.lock,
        classes=list(setup.spec.classes) if setup.spec.classes else None,
        overrides=mask_overrides(own, cfg.env_keys),
        code=setup.code.files,
    )
    with saver, stop_says_how_to_continue(saver, own, resumed=start.from_checkpoint):
        sampler = open_sampler(
            cfg.monitor,
            device=setup.device,
            log_metrics=tracker.log_metrics,
            children=cfg.loader.num_workers > 0,
            after_step=start.sampler_after(tracker),
        )
        try:
            epochs, epoch_starts = workers_stopped_too(stop, run_epochs)(
                setup,
                start.position,
                trainer=cfg.trainer,
                tracker=tracker,
                sampler=sampler,
                saver=saver,
                stop=stop,
                show_progress=progress_mode(cfg.trainer.progress, quiet=quiet),
                models=models,
                started=started,
            )
        finally:
            sampler.stop()
        saver.mark("finished")
    return epochs, epoch_starts, sampler


@collector_running()  # the collector's one pass over start-up's objects, then on while training
@worker_faults()  # a loader worker's death noticed mid-step (PyTorch's SIGCHLD handler) fails the run cleanly
def run_epochs(
    setup: Setup,
    start: checkpoint.Position,
    *,
    trainer: TrainerConfig,
    tracker: Tracker,
    sampler: Any,
    saver: checkpoint.Checkpointer,
    stop: StopRequests,
    show_progress: str,
    models: Any,
    started: float,
) -> tuple[list[EpochResult], list[float]]:
    """Train from ``start`` to the last epoch or ``trainer.max_steps``, checkpointing as configured.

    Returns the epochs' records and their start times on the sampler's clock (the timeline's
    epoch marks). Raises ``Stopped`` after writing a checkpoint when a stop request ended an epoch.
    ``show_progress``: ``bar``, ``lines`` or ``none`` (``pipeline.engine.progress.progress_mode``); ``started``:
    when the run started (``time.perf_counter``), the origin of the auto profile's budget.
    """
    total = steps_to_train(
        epochs=trainer.epochs,
        per_epoch=len(setup.train_batches),
        max_steps=trainer.max_steps,
        epoch=start.epoch,
        batch=start.batch,
        step=start.step,
    )
    run_progress = RunProgress(
        total_steps=total,
        periodic=show_progress == "lines",
        reference=amp_reference(setup.amp_probe),
        speak=setup.group.is_main,
    )
    step, apart = (lambda: setup.state.step), run_progress.set_apart  # profile=false: the timer as it is
    timer = setup.profiler.wrap(make_timer(setup.device), step=step, apart=apart, total=total, began=started)
    epochs: list[EpochResult] = []
    epoch_starts: list[float] = []
    for epoch in range(start.epoch, trainer.epochs + 1):
        skip = start.batch if epoch == start.epoch else 0
        setup.train_batches.set_epoch(epoch, skip=skip)  # the epoch's order, minus the batches done before
        setup.state.context.begin(epoch, keep=skip > 0)  # a step hook's state: empty, or the checkpoint's mid-epoch
        epoch_starts.append(sampler.now())
        record, done = run_epoch(
            setup,
            epoch,
            trainer=trainer,
            tracker=tracker,
            sampler=sampler,
            timer=timer,
            saver=saver,
            stop=stop,
            started=started,
            skip=skip,
            progress=run_progress,
            show_bar=show_progress == "bar",
        )
        position = checkpoint.Position(epoch, skip + done, setup.state.step)
        if record is None:  # stopped mid-epoch at a step boundary
            _stopped_at(setup, saver.write(position, status="stopped"))
            raise Stopped(stop.signum or 0, checkpoints=stop.checkpoints)
        epochs.append(record)
        complete = done == len(setup.train_batches)
        saver.write(checkpoint.Position(epoch + 1, 0, setup.state.step) if complete else position)
        models.checkpointed(epoch)  # tracking.log_model=checkpoints: the model at this checkpoint, its metrics linked
        if 0 < trainer.max_steps <= setup.state.step:
            log.info("trainer.max_steps=%d reached", trainer.max_steps)
            break
    return epochs, epoch_starts


def _stopped_at(setup: Setup, path: Path | None) -> None:
    where = (
        f"checkpoint {path}"
        if path
        else "rank 0 writes the checkpoint"
        if not setup.group.is_main
        else "no checkpoint (checkpoint.enabled=false): a new run starts from scratch"
    )
    log.warning("stopped at step %d; %s", setup.state.step, where)


def run_epoch(
    setup: Setup,
    epoch: int,
    *,
    trainer: TrainerConfig,
    tracker: Tracker,
    sampler: Any,
    timer: Any,
    progress: RunProgress,
    show_bar: bool,
    saver: checkpoint.Checkpointer,
    stop: StopRequests,
    started: float,
    skip: int = 0,
) -> tuple[EpochResult | None, int]:
    """Train one epoch (its batches after ``skip``), evaluate, log the epoch's metrics and write them.
    ``started``: when the run started (``time.perf_counter``), the origin of the replay check's budget.

    Returns the epoch's record (None when a stop request ended it early) and the batches trained.
    """
    state = setup.state
    since = sampler.now()  # the sampler's clock, for this epoch's utilisation summary
    started_at = time.time()
    batches_left = len(setup.train_batches)
    steps_left = batches_left if trainer.max_steps < 0 else min(batches_left, trainer.max_steps - state.step)
    bar = ProgressBar(total=steps_left, epoch=epoch, epochs=trainer.epochs) if show_bar else NoProgress()
    progress.start_epoch(epoch, trainer.epochs)
    steps = EpochSteps(bar, progress)
    with stop.interruptible():  # a second Ctrl-C or SIGTERM in here stops at once
        stats = train_epoch(
            state,
            setup.train_batches,
            inputs=setup.inputs,
            timer=timer,
            metrics=StepMetrics(steps.logging_to(tracker), every=trainer.log_every_n_steps),
            max_steps=trainer.max_steps,
            group=setup.group,
            stop=stop,
            checkpoints=MidwayCheckpoints(saver, tracker, lambda at: checkpoint.Position(epoch, skip + steps.done, at)),
            on_step=steps.step,
            keep=setup.replay.keep,
        )
        bar.close()
        if stats.stopped:
            stop.adopt(stats.stop_signal)  # under DDP the signal may have reached another rank only
            tracker.flush()
            return None, steps.done
        # perf/replay_speedup: once, a few steps on one batch, the state put back (pipeline.engine.replay)
        setup.replay.after_epoch(
            state,
            stats.breakdown,
            inputs=setup.inputs,
            group=setup.group,
            steps_left=progress.total - progress.done,
            started=started,
        )
        setup.group.broadcast_buffers(state.model)  # BatchNorm's running statistics: rank 0's, on every rank
        setup.scoring.context.epoch = epoch
        val = evaluate(
            state.model,
            setup.val_batches,
            device=setup.device,
            policy=setup.policy,
            prepare=setup.prepare,
            scoring=setup.scoring,
            micro=setup.eval_micro,
            group=setup.group,
        )
        state.scheduler.after_evaluation(val.metrics)  # scheduler.interval=epoch, or a schedule fed a val metric
    utilisation = sampler.summary(since=since)
    ranks = rank_metrics(setup.group.gather(rank_view(stats.breakdown, utilisation)))
    launch = launch_metrics(started_at, stats.breakdown) if epoch == 1 and not skip else {}
    record = EpochResult(epoch, stats.loss, val.metrics, stats.seconds, stats.samples_per_s, stats.breakdown, ranks,
                         launch_s=launch.get(TIME_LAUNCH_TO_FIRST_STEP_S))  # fmt: skip
    tracker.log_metrics(epoch_metrics(setup, record, stats, utilisation, launch), step=epoch)
    tracker.flush()
    _log_epoch(record, trainer.epochs, setup.task.primary)
    return record, steps.done


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
