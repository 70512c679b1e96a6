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
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.common.heap import collector_paused, collector_running
from pipeline.common.secrets import env_values, mask_overrides, mask_tree
from pipeline.config import RunConfig
from pipeline.data.workers import LoaderError, deaths_expected_while, worker_faults
from pipeline.diagnostics import doctor
from pipeline.engine import checkpoint, compilation, continuation, resume
from pipeline.engine.build import Setup, build
from pipeline.engine.loop import evaluate, train_epoch
from pipeline.engine.memory import out_of_memory_is_an_error
from pipeline.engine.progress import NoProgress, ProgressBar, RunProgress, amp_reference, progress_mode, steps_to_train
from pipeline.engine.provenance import run_tags, sweep_run_name, with_overrides
from pipeline.engine.restore import restore
from pipeline.engine.stopping import Stopped, StopRequests, signal_name
from pipeline.engine.timing import launch_metrics, make_timer
from pipeline.monitor import CLOCK_KEY, allocator_metrics, open_sampler
from pipeline.parallel import distributed
from pipeline.record.lifecycle import Tracker, open_tracker
from pipeline.record.reachability import check_reachable
from pipeline.report import run_record
from pipeline.report.run_record import rank_metrics, rank_view
from pipeline.report.summary import EpochRecord, RunResult, format_summary

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
    # torchrun: this rank's place in the job; else a plain run. Memory running out ends the run in one line. No
    # collector passes over what start-up and close import (pipeline.common.heap); training has them (run_epochs).
    with collector_paused(freeze=False), out_of_memory_is_an_error(), distributed.joined(cfg.device) as group:
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
    main = group.is_main  # rank 0 alone records the run and writes checkpoints
    if cfg.tracking.enabled and main:
        check_reachable(cfg.tracking.uri)  # before any data is loaded: a dead server fails in seconds
    checkpoint.check_dir(cfg.checkpoint)
    if cfg.trainer.compile:
        compilation.fresh()  # a sweep's earlier jobs' graphs must not count towards this run's recompile limit
    recorded = mask_tree(cfg.to_dict(), cfg.env_keys)  # the record never holds a secret
    hidden = env_values(cfg)  # masked wherever they land in the record; refuses an experiment named from one
    resumed = resume.shared_point(cfg, recorded, group) if cfg.resume else None
    with resumed or contextlib.nullcontext():  # a resumed run stays locked to this process until it ends
        setup = build(cfg, group, explain_missing_gpu=doctor.main_finding)
        typed = mask_overrides(overrides, cfg.env_keys)
        if not cfg.tracking.run_name:  # runs whose configurations differ never share a name
            swept = sweep.values if sweep is not None else {}
            name = sweep_run_name(setup.run_name, swept) if sweep is not None else setup.run_name
            setup = dataclasses.replace(setup, run_name=with_overrides(name, typed, list(swept)))
        if resumed is not None:
            restore(setup.state, resumed, setup.device, cfg.optimizer)
        tags = {**recorded["tracking"]["tags"], **run_tags(setup.choice, setup.policy, typed, setup.backends)}
        if sweep is not None:
            tags.update(sweep.tags())  # mlflow.parentRunId nests the run under the sweep's parent in the UI
        if resumed is not None and not resumed.fork:
            del tags["overrides"]  # the run keeps the overrides it started with; resume.overrides holds these
        with (
            StopRequests(checkpoints=cfg.checkpoint.enabled) as stop,
            deaths_expected_while(stop.requested),  # workers killed by the same stop signal, up to the run's close
            open_tracker(
                cfg.tracking if main else dataclasses.replace(cfg.tracking, enabled=False),
                run_name=setup.run_name,
                tags=tags,
                run_id=resumed.run_id if resumed else None,
                secret_values=hidden,
            ) as tracker,
            setup.profiler.recording(tracker),  # trainer.profile: where the profiled steps are recorded
            setup.snapshot.recording(tracker),  # trainer.memory_snapshot=on_oom: the allocator history, kept at an OOM
        ):
            if resumed is not None and not resumed.fork:
                tracker.log_only_new_steps()  # steps trained again after the checkpoint keep their first points
            if main:
                run_record.start(tracker, setup, recorded, typed, resumed)
            with (
                checkpoint.Checkpointer.for_run(
                    cfg,
                    run_id=group.share(lambda: tracker.run_id),  # every rank knows the run's checkpoint folder
                    write=main,
                    world_size=group.world_size,
                    run_name=setup.run_name,
                    state=setup.state,
                    device=setup.device,
                    config=recorded,
                    lock=resumed.lock if resumed else None,
                    classes=list(setup.spec.classes) if setup.spec.classes else None,
                    overrides=mask_overrides(own, cfg.env_keys),
                ) as saver,
                stop_says_how_to_continue(saver, own, resumed=resumed is not None),
            ):
                sampler = open_sampler(
                    cfg.monitor,
                    device=setup.device,
                    log_metrics=tracker.log_metrics,
                    children=cfg.loader.num_workers > 0,
                    after_step=(tracker.last_step(CLOCK_KEY) or 0) if resumed is not None and not resumed.fork else 0,
                )
                try:
                    epochs, epoch_starts = workers_stopped_too(stop, run_epochs)(
                        setup,
                        resumed.position if resumed else checkpoint.Position(1, 0, 0),
                        tracker=tracker,
                        sampler=sampler,
                        saver=saver,
                        stop=stop,
                        show_progress=progress_mode(cfg.trainer.progress, quiet=quiet),
                    )
                finally:
                    sampler.stop()
                saver.mark("finished")
            result = run_record.conclude(
                setup,
                epochs,
                tracker=tracker,
                sampler=sampler,
                epoch_starts=epoch_starts,
                total_s=time.perf_counter() - started,
            )
            summary = format_summary(result)
            tracker.set_tags({"mlflow.note.content": f"```\n{summary}\n```"})
    if echo and main:
        print(summary, flush=True)
    return result


@contextlib.contextmanager
def stop_says_how_to_continue(saver: checkpoint.Checkpointer, own: list[str], *, resumed: bool) -> Iterator[None]:
    """A stop leaves the command that continues the run on ``Stopped.command``, once a checkpoint of it exists
    (written now, or the one this resume started from)."""
    try:
        yield
    except Stopped as stop:
        if saver.enabled and (saver.last is not None or resumed):
            stop.command = continuation.continue_command(saver.path.parent.name, own)
        raise


def workers_stopped_too(stop: StopRequests, fn: Any) -> Any:
    """``fn``, with a loader fault while a stop request is pending taken for the stop: a SIGTERM sent to the whole
    process group (SLURM's time limit, ``kill -- -PGID``) kills the workers too, and their deaths can surface
    anywhere in a step. The run ends KILLED, as stopped, but writes no checkpoint from a step that may be half done:
    the last checkpoint stands, and a resume replays from it."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LoaderError as err:
            if not stop.requested():
                raise
            log.warning(
                "the loader's workers ended with the %s sent to the whole process group; stopping without a new "
                "checkpoint (the last one stands)",
                signal_name(stop.signum or 0),
            )
            raise Stopped(stop.signum or 0, checkpoints=stop.checkpoints) from err

    return run


@collector_running()  # the collector's one pass over start-up's objects, then on while training
@worker_faults()  # a loader worker's death noticed mid-step (PyTorch's SIGCHLD handler) fails the run cleanly
def run_epochs(
    setup: Setup,
    start: checkpoint.Position,
    *,
    tracker: Tracker,
    sampler: Any,
    saver: checkpoint.Checkpointer,
    stop: StopRequests,
    show_progress: str,
) -> tuple[list[EpochRecord], list[float]]:
    """Train from ``start`` to the last epoch or ``trainer.max_steps``, checkpointing as configured.

    Returns the epochs' records and their start times on the sampler's clock (the timeline's
    epoch marks). Raises ``Stopped`` after writing a checkpoint when a stop request ended an epoch.
    ``show_progress``: ``bar``, ``lines`` or ``none`` (``pipeline.engine.progress.progress_mode``).
    """
    cfg = setup.cfg
    t = cfg.trainer
    total = steps_to_train(
        epochs=t.epochs,
        per_epoch=len(setup.train_batches),
        max_steps=t.max_steps,
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
    timer = setup.profiler.wrap(make_timer(setup.device), step=step, apart=apart)
    epochs: list[EpochRecord] = []
    epoch_starts: list[float] = []
    for epoch in range(start.epoch, cfg.trainer.epochs + 1):
        skip = start.batch if epoch == start.epoch else 0
        setup.train_batches.set_epoch(epoch, skip=skip)  # the epoch's order, minus the batches done before
        epoch_starts.append(sampler.now())
        record, done = run_epoch(
            setup,
            epoch,
            tracker=tracker,
            sampler=sampler,
            timer=timer,
            saver=saver,
            stop=stop,
            skip=skip,
            progress=run_progress,
            show_bar=show_progress == "bar",
        )
        position = checkpoint.Position(epoch, skip + done, setup.state.step)
        if record is None:  # stopped mid-epoch at a step boundary
            path = saver.write(position, status="stopped")
            where = (
                f"checkpoint {path}"
                if path
                else "rank 0 writes the checkpoint"
                if not setup.group.is_main
                else "no checkpoint (checkpoint.enabled=false): a new run starts from scratch"
            )
            log.warning("stopped at step %d; %s", setup.state.step, where)
            raise Stopped(stop.signum or 0, checkpoints=stop.checkpoints)
        epochs.append(record)
        complete = done == len(setup.train_batches)
        saver.write(checkpoint.Position(epoch + 1, 0, setup.state.step) if complete else position)
        if 0 < cfg.trainer.max_steps <= setup.state.step:
            log.info("trainer.max_steps=%d reached", cfg.trainer.max_steps)
            break
    return epochs, epoch_starts


def run_epoch(
    setup: Setup,
    epoch: int,
    *,
    tracker: Tracker,
    sampler: Any,
    timer: Any,
    progress: RunProgress,
    show_bar: bool,
    saver: checkpoint.Checkpointer,
    stop: StopRequests,
    skip: int = 0,
) -> tuple[EpochRecord | None, int]:
    """Train one epoch (its batches after ``skip``), evaluate, log the epoch's metrics and write them.

    Returns the epoch's record (None when a stop request ended it early) and the batches trained.
    """
    t, device, state = setup.cfg.trainer, setup.device, setup.state
    since = sampler.now()  # the sampler's clock, for this epoch's utilisation summary
    started_at = time.time()
    batches_left = len(setup.train_batches)
    steps_left = batches_left if t.max_steps < 0 else min(batches_left, t.max_steps - state.step)
    bar = ProgressBar(total=steps_left, epoch=epoch, epochs=t.epochs) if show_bar else NoProgress()
    progress.start_epoch(epoch, t.epochs)
    done = 0

    def log_step(metrics: dict[str, float], step: int) -> None:
        tracker.log_metrics(metrics, step)
        if "train/loss" in metrics:
            bar.set_loss(metrics["train/loss"])

    def on_step(samples: int) -> None:
        nonlocal done
        done += 1
        bar.step(samples)
        progress.step(samples)

    with stop.interruptible():  # a second Ctrl-C or SIGTERM in here stops at once
        stats = train_epoch(
            state,
            setup.train_batches,
            device=device,
            policy=setup.policy,
            prepare=setup.prepare,
            augment=setup.augment,
            log_every=t.log_every_n_steps,
            max_steps=t.max_steps,
            log=log_step,
            timer=timer,
            on_step=on_step,
            stop_signal=lambda: stop.signum or 0,
            group=setup.group,
            checkpoint_every=setup.cfg.checkpoint.every_n_steps,
            save_checkpoint=lambda: save_midway(tracker, saver, checkpoint.Position(epoch, skip + done, state.step)),
        )
        bar.close()
        if stats.stopped:
            stop.adopt(stats.stop_signal)  # under DDP the signal may have reached another rank only
            tracker.flush()
            return None, done
        setup.group.broadcast_buffers(state.model)  # BatchNorm's running statistics: rank 0's, on every rank
        val = evaluate(
            state.model,
            setup.val_batches,
            device=device,
            policy=setup.policy,
            prepare=setup.prepare,
            micro=setup.eval_micro,
            group=setup.group,
            task=setup.task,
            split_batch=state.split,
        )
    utilisation = sampler.summary(since=since)
    ranks = rank_metrics(setup.group.gather(rank_view(stats.breakdown, utilisation)))
    record = EpochRecord(epoch, stats.loss, val.metrics, stats.seconds, stats.samples_per_s, stats.breakdown, ranks)
    eval_micro = setup.eval_micro
    tracker.log_metrics(
        {
            "train/epoch_loss": record.train_loss,
            **record.val_metrics,
            "time/epoch_s": record.seconds,
            **stats.breakdown.metrics(),
            **setup.model_flops.metrics(stats.samples_per_s),  # perf/tflops, perf/mfu_pct: this rank's device
            **utilisation.metrics(),
            **ranks,
            **allocator_metrics(device),
            **({"amp/skipped_steps": stats.skipped_steps} if state.scaler.is_enabled() else {}),
            **({"oom/eval_micro_batch_size": eval_micro.micro_batch} if eval_micro.events else {}),
            **(launch_metrics(started_at, stats.breakdown) if epoch == 1 and not skip else {}),
        },
        step=epoch,
    )
    tracker.flush()
    primary = setup.task.primary
    log.info(
        "epoch %d/%d: train/loss %.4f val/loss %.4f %s %.4f %.2fs %.0f samples/s",
        epoch,
        t.epochs,
        record.train_loss,
        record.val_loss,
        primary,
        record.val_metrics.get(primary, float("nan")),
        record.seconds,
        record.job_samples_per_s,
    )
    return record, done


def save_midway(tracker: Tracker, saver: checkpoint.Checkpointer, position: checkpoint.Position) -> None:
    """A mid-epoch checkpoint, after the metrics up to it are written: if the process dies now, a resume
    continues from a step whose metrics are all in the record (a write that fails is kept for later)."""
    tracker.flush()
    saver.write(position)
