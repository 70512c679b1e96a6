"""``train(cfg)``: build everything the config names, train, evaluate, record. Returns a ``RunResult``.

Order matters: the device, the data and the model are built before the MLflow run is opened,
so a missing GPU or dataset fails fast and leaves no half-made run behind.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from pipeline import checkpoint, doctor
from pipeline.config import RunConfig, flatten
from pipeline.data import DataSpec, Normalize, load_data, make_loader
from pipeline.devices import DeviceChoice, resolve_device
from pipeline.loop import TrainState, evaluate, train_epoch
from pipeline.memory import MicroBatcher
from pipeline.models import build_model, build_optimizer, count_parameters
from pipeline.monitor import allocator_metrics, open_sampler
from pipeline.plots import step_breakdown, utilisation_timeline
from pipeline.precision import PrecisionPolicy, configure_backends, resolve_precision
from pipeline.progress import NoProgress, ProgressBar, progress_enabled
from pipeline.provenance import run_tags
from pipeline.secrets import mask_overrides, mask_tree
from pipeline.stopping import Stopped, StopRequests
from pipeline.store import check_reachable
from pipeline.summary import EpochRecord, RunResult, format_summary
from pipeline.timing import Breakdown, combine, make_timer
from pipeline.tracking import Tracker, open_tracker
from pipeline.verdict import judge

log = logging.getLogger(__name__)


@dataclass
class Setup:
    """Everything a run needs, built before its MLflow run is opened."""

    cfg: RunConfig
    choice: DeviceChoice
    policy: PrecisionPolicy
    backends: dict[str, str]
    spec: DataSpec
    state: TrainState
    parameters: int
    train_batches: Any
    val_batches: Any
    prepare: Normalize
    run_name: str

    @property
    def device(self) -> torch.device:
        return self.choice.device


def build(cfg: RunConfig) -> Setup:
    """Device, precision, data, model, optimizer and batches, in the order that fails fastest."""
    choice = resolve_device(cfg.device)
    device = choice.device
    log.info("device: %s (%s) - %s", device, choice.name, choice.reason)
    policy = resolve_precision(cfg.precision, amp=cfg.amp, device=device)
    backends = configure_backends(cfg.precision, cfg.trainer, device)
    t = cfg.trainer
    torch.manual_seed(t.seed)

    data = load_data(cfg.data)
    spec = data.spec
    model = build_model(cfg.model, in_shape=spec.in_shape, num_classes=spec.num_classes).to(device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    parameters = count_parameters(model)
    if t.compile:
        model = torch.compile(model)
    optimizer = build_optimizer(
        t.optimizer, model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
    )
    setup = Setup(
        cfg=cfg,
        choice=choice,
        policy=policy,
        backends=backends,
        spec=spec,
        state=TrainState(model=model, optimizer=optimizer, scaler=policy.make_scaler(), micro=micro_batcher(cfg)),
        parameters=parameters,
        train_batches=make_loader(data.train, cfg.loader, device=device, train=True, seed=t.seed),
        val_batches=make_loader(data.val, cfg.loader, device=device, train=False, seed=t.seed),
        prepare=Normalize(spec.mean, spec.std, device=device, channels_last=t.channels_last),
        run_name=cfg.tracking.run_name or derive_run_name(cfg, device_type=device.type, precision=policy.label),
    )
    log.info(
        "run %s: %s on %s, %d train / %d val samples, %s parameters",
        setup.run_name,
        cfg.model.name,
        spec.name,
        spec.train_size,
        spec.val_size,
        f"{parameters:,}",
    )
    return setup


def train(cfg: RunConfig, *, overrides: Sequence[str] = (), echo: bool = True, quiet: bool = False) -> RunResult:
    """Train and evaluate the configured model and record the run.

    Args:
        cfg: a validated config (``pipeline.config.from_dictconfig``).
        overrides: the command-line overrides as typed, for the record.
        echo: print the summary at the end.
        quiet: no progress bar (sweep jobs).

    Raises:
        Stopped: SIGTERM or Ctrl-C arrived; a checkpoint was written and the run marked KILLED.
    """
    started = time.perf_counter()
    if cfg.tracking.enabled:
        check_reachable(cfg.tracking.uri)  # before any data is loaded: a dead server fails in seconds
    resumed = checkpoint.load(checkpoint.find(cfg.resume, folder=Path(cfg.checkpoint.dir))) if cfg.resume else None
    setup = build(cfg)
    if resumed is not None:
        restore(setup, resumed)
    typed = mask_overrides(overrides, cfg.env_keys)  # the record never holds a secret
    recorded = mask_tree(cfg.to_dict(), cfg.env_keys)
    tags = {**recorded["tracking"]["tags"], **run_tags(setup.choice, setup.policy, typed, setup.backends)}
    run_id = resumed["run_id"] if resumed else None
    if resumed:
        del tags["overrides"]  # the run keeps the overrides it started with; resume.overrides holds these
    with (
        StopRequests() as stop,
        open_tracker(cfg.tracking, run_name=setup.run_name, tags=tags, run_id=run_id) as tracker,
    ):
        if resumed is None:
            tracker.log_params(flatten(recorded))
            tracker.log_dataset(setup.spec, context="train")
            tracker.log_text(yaml.safe_dump(recorded, sort_keys=False), "config.yaml")
            tracker.log_text("\n".join(typed) + "\n", "overrides.txt")
            environment = doctor.report(smoke=False)  # the doctor's findings, kept with the run
            tracker.log_text(json.dumps(environment, indent=2), "environment.json")
            tracker.set_tags(environment_tags(environment, setup.device))
        else:  # MLflow keeps a run's params fixed: the resumed part is described by tags
            tracker.set_tags({"resumed_at_step": resumed["position"].step, "resume.overrides": " ".join(typed)})
        saver = checkpointer(setup, tracker.run_id, recorded)
        sampler = open_sampler(
            cfg.monitor, device=setup.device, log_metrics=tracker.log_metrics, children=cfg.loader.num_workers > 0
        )
        timer = make_timer(setup.device)
        show_progress = progress_enabled(cfg.trainer.progress, quiet=quiet)
        epochs: list[EpochRecord] = []
        epoch_starts: list[float] = []
        first = resumed["position"].epoch if resumed else 1
        try:
            for epoch in range(first, cfg.trainer.epochs + 1):
                epoch_starts.append(sampler.now())  # for the timeline's epoch marks
                skip = resumed["position"].batch if resumed and epoch == first else 0
                saver.epoch_started()
                record, done = run_epoch(
                    setup,
                    epoch,
                    tracker=tracker,
                    sampler=sampler,
                    timer=timer,
                    show_progress=show_progress,
                    saver=saver,
                    stop=stop,
                    skip=skip,
                )
                if record is None:  # stopped mid-epoch at a step boundary
                    path = saver.write(checkpoint.Position(epoch, skip + done, setup.state.step))
                    log.warning(
                        "stopped at step %d; checkpoint %s; continue with resume=%s",
                        setup.state.step,
                        path,
                        tracker.run_id or "latest",
                    )
                    raise Stopped(stop.signum or 0)
                epochs.append(record)
                saver.write(checkpoint.Position(epoch + 1, 0, setup.state.step))
                if setup.state.step == cfg.trainer.max_steps:
                    log.info("trainer.max_steps=%d reached", cfg.trainer.max_steps)
                    break
        finally:
            sampler.stop()
        result = conclude(
            setup,
            epochs,
            tracker=tracker,
            sampler=sampler,
            epoch_starts=epoch_starts,
            total_s=time.perf_counter() - started,
        )
        summary = format_summary(result)
        tracker.set_tags({"mlflow.note.content": f"```\n{summary}\n```"})
    if echo:
        print(summary, flush=True)
    return result


def environment_tags(environment: dict[str, Any], device: torch.device) -> dict[str, str]:
    """The key facts of environment.json as tags: driver, its CUDA, cuDNN, the device's compute capability."""
    facts = environment["facts"]
    tags = {"driver.version": facts["driver_version"] or "none", "driver.cuda": facts["driver_cuda"] or "none"}
    if device.type == "cuda":
        gpu = next(g for g in facts["torch_gpus"] if g["index"] == (device.index or 0))
        tags["device.capability"] = "sm_{}{}".format(*gpu["capability"])
        tags["torch.cudnn"] = str(facts["cudnn"])
    return tags


def checkpointer(setup: Setup, run_id: str | None, recorded: dict[str, Any]) -> checkpoint.Checkpointer:
    """Where this run's checkpoints go (``checkpoint.dir/<run id>/last.pt``) and what they hold."""
    cfg, state = setup.cfg, setup.state
    folder = Path(cfg.checkpoint.dir) / (run_id or f"{setup.run_name}-{time.strftime('%Y%m%d-%H%M%S')}")

    def contents() -> dict[str, Any]:
        return {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scaler": state.scaler.state_dict(),
            "micro_batch": state.micro.micro_batch,
            "run_id": run_id,
            "run_name": setup.run_name,
            "config": recorded,
        }

    return checkpoint.Checkpointer(
        folder=folder,
        every_n_steps=cfg.checkpoint.every_n_steps,
        enabled=cfg.checkpoint.enabled,
        order=setup.train_batches.generator,
        contents=contents,
    )


def restore(setup: Setup, payload: dict[str, Any]) -> None:
    """Put a checkpoint's states back: weights, optimizer, scaler, micro-batch, counters, RNG, data order."""
    state = setup.state
    state.model.load_state_dict(payload["model"])
    state.optimizer.load_state_dict(payload["optimizer"])
    state.scaler.load_state_dict(payload["scaler"])
    state.micro.micro_batch = payload["micro_batch"]
    state.step = payload["position"].step
    checkpoint.set_rng_state(payload["rng"])
    setup.train_batches.generator.set_state(payload["order"])
    log.info(
        "resuming run %s at epoch %d, batch %d (step %d)",
        payload["run_id"] or payload["run_name"],
        payload["position"].epoch,
        payload["position"].batch,
        state.step,
    )


def run_epoch(
    setup: Setup,
    epoch: int,
    *,
    tracker: Tracker,
    sampler: Any,
    timer: Any,
    show_progress: bool,
    saver: checkpoint.Checkpointer,
    stop: StopRequests,
    skip: int = 0,
) -> tuple[EpochRecord | None, int]:
    """Train one epoch, evaluate, log the epoch's metrics and write them.

    Returns the epoch's record (None when a stop request ended it early) and the batches trained.
    """
    t, device = setup.cfg.trainer, setup.device
    since = sampler.now()  # the sampler's clock, for this epoch's utilisation summary
    started_at = time.time()
    batches_left = len(setup.train_batches) - skip
    steps_left = batches_left if t.max_steps < 0 else min(batches_left, t.max_steps - setup.state.step)
    bar = ProgressBar(total=steps_left, epoch=epoch, epochs=t.epochs) if show_progress else NoProgress()
    done = 0

    def log_step(metrics: dict[str, float], step: int) -> None:
        tracker.log_metrics(metrics, step)
        if "train/loss" in metrics:
            bar.set_loss(metrics["train/loss"])

    def on_step(samples: int) -> None:
        nonlocal done
        done += 1
        bar.step(samples)
        saver.step_done(checkpoint.Position(epoch, skip + done, setup.state.step))

    stats = train_epoch(
        setup.state,
        setup.train_batches,
        device=device,
        policy=setup.policy,
        prepare=setup.prepare,
        log_every=t.log_every_n_steps,
        max_steps=t.max_steps,
        log=log_step,
        timer=timer,
        on_step=on_step,
        should_stop=stop.requested,
        skip=skip,
    )
    bar.close()
    if stats.stopped:
        tracker.flush()
        return None, done
    val = evaluate(
        setup.state.model,
        setup.val_batches,
        device=device,
        policy=setup.policy,
        prepare=setup.prepare,
        micro=setup.state.micro,
    )
    record = EpochRecord(epoch, stats.loss, val.loss, val.accuracy, stats.seconds, stats.samples_per_s, stats.breakdown)
    tracker.log_metrics(
        {
            "train/epoch_loss": record.train_loss,
            "val/loss": record.val_loss,
            "val/acc": record.val_acc,
            "time/epoch_s": record.seconds,
            **stats.breakdown.metrics(),
            **sampler.summary(since=since).metrics(),
            **allocator_metrics(device),
            **({"amp/skipped_steps": stats.skipped_steps} if setup.state.scaler.is_enabled() else {}),
            **(launch_metrics(started_at, stats.breakdown) if epoch == 1 and not skip else {}),
        },
        step=epoch,
    )
    tracker.flush()
    log.info(
        "epoch %d/%d: train/loss %.4f val/loss %.4f val/acc %.4f %.2fs %.0f samples/s",
        epoch,
        t.epochs,
        record.train_loss,
        record.val_loss,
        record.val_acc,
        record.seconds,
        record.samples_per_s,
    )
    return record, done


def conclude(
    setup: Setup,
    epochs: list[EpochRecord],
    *,
    tracker: Tracker,
    sampler: Any,
    epoch_starts: list[float],
    total_s: float,
) -> RunResult:
    """The run's verdict, pictures and record, once the sampler has stopped."""
    breakdown = combine([e.breakdown for e in epochs])
    utilisation = sampler.summary()
    verdict = judge(
        setup.cfg,
        device_type=setup.device.type,
        data_wait_pct=breakdown.data_wait_pct,
        h2d_pct=breakdown.h2d_pct,
        gpu_util_pct=utilisation.gpu_util_mean_pct,
        precision=setup.policy.label,
    )
    tracker.set_tags({"bottleneck": verdict.bottleneck, "bottleneck.hint": verdict.message})
    if setup.cfg.monitor.plots:
        title = setup.run_name
        tracker.log_figure(
            lambda: utilisation_timeline(sampler.samples, epoch_starts, title=title), "plots/utilisation.png"
        )
        tracker.log_figure(lambda: step_breakdown([e.breakdown for e in epochs], title=title), "plots/step_time.png")
    tracker.log_metrics({"time/total_s": total_s, "time/tracking_write_s": tracker.write_s}, step=len(epochs))
    return RunResult(
        run_name=setup.run_name,
        run_id=tracker.run_id,
        device=str(setup.device),
        device_name=setup.choice.name,
        precision=setup.policy.label,
        loader=describe_loader(setup.cfg),
        parameters=setup.parameters,
        steps=setup.state.step,
        total_s=total_s,
        epochs=epochs,
        breakdown=breakdown,
        utilisation=utilisation,
        tracking_write_s=tracker.write_s,
        oom_events=list(setup.state.micro.events),
        micro_batch=setup.state.micro.micro_batch,
        bottleneck=verdict.bottleneck,
        verdict=verdict.message,
        tracking=tracker.describe(),
        model=setup.state.model,
    )


def micro_batcher(cfg: RunConfig) -> MicroBatcher:
    batch = cfg.loader.batch_size
    return MicroBatcher(
        batch_size=batch,
        micro_batch=cfg.oom.micro_batch_size or batch,
        min_micro_batch=cfg.oom.min_micro_batch,
        enabled=cfg.oom.enabled,
    )


def launch_metrics(first_epoch_started_at: float, breakdown: Breakdown) -> dict[str, float]:
    """Seconds from the process's start (as the OS records it) to the end of the first training step."""
    import psutil

    return {
        "time/launch_to_first_step_s": first_epoch_started_at - psutil.Process().create_time() + breakdown.first_step_s
    }


def derive_run_name(cfg: RunConfig, *, device_type: str, precision: str) -> str:
    """A readable name that differs wherever comparable runs differ: ``resnet50-cifar10-cuda-amp-bf16-bs128-w4``."""
    parts = [cfg.model.name, cfg.data.name, device_type]
    if precision != "fp32":
        parts.append(precision)
    parts.append(f"bs{cfg.loader.batch_size}")
    parts.append("resident" if cfg.loader.resident else f"w{cfg.loader.num_workers}")
    return "-".join(parts)


def describe_loader(cfg: RunConfig) -> str:
    if cfg.loader.resident:
        return f"resident, batch {cfg.loader.batch_size}"
    return f"DataLoader, {cfg.loader.num_workers} worker(s), batch {cfg.loader.batch_size}"
