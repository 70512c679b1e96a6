"""``train(cfg)``: build everything the config names, train, evaluate, record. Returns a ``RunResult``.

Order matters: the device, the data and the model are built before the MLflow run is opened,
so a missing GPU or dataset fails fast and leaves no half-made run behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import yaml

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
    """
    started = time.perf_counter()
    if cfg.tracking.enabled:
        check_reachable(cfg.tracking.uri)  # before any data is loaded: a dead server fails in seconds
    setup = build(cfg)
    typed = mask_overrides(overrides, cfg.env_keys)  # the record never holds a secret
    recorded = mask_tree(cfg.to_dict(), cfg.env_keys)
    tags = {**recorded["tracking"]["tags"], **run_tags(setup.choice, setup.policy, typed, setup.backends)}
    with open_tracker(cfg.tracking, run_name=setup.run_name, tags=tags) as tracker:
        tracker.log_params(flatten(recorded))
        tracker.log_dataset(setup.spec, context="train")
        tracker.log_text(yaml.safe_dump(recorded, sort_keys=False), "config.yaml")
        tracker.log_text("\n".join(typed) + "\n", "overrides.txt")
        sampler = open_sampler(
            cfg.monitor, device=setup.device, log_metrics=tracker.log_metrics, children=cfg.loader.num_workers > 0
        )
        timer = make_timer(setup.device)
        show_progress = progress_enabled(cfg.trainer.progress, quiet=quiet)
        epochs: list[EpochRecord] = []
        epoch_starts: list[float] = []
        try:
            for epoch in range(1, cfg.trainer.epochs + 1):
                epoch_starts.append(sampler.now())  # for the timeline's epoch marks
                record = run_epoch(
                    setup, epoch, tracker=tracker, sampler=sampler, timer=timer, show_progress=show_progress
                )
                epochs.append(record)
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


def run_epoch(
    setup: Setup, epoch: int, *, tracker: Tracker, sampler: Any, timer: Any, show_progress: bool
) -> EpochRecord:
    """Train one epoch, evaluate, log the epoch's metrics and write them."""
    t, device = setup.cfg.trainer, setup.device
    since = sampler.now()  # the sampler's clock, for this epoch's utilisation summary
    started_at = time.time()
    steps_left = len(setup.train_batches) if t.max_steps < 0 else t.max_steps - setup.state.step
    bar = (
        ProgressBar(total=min(len(setup.train_batches), steps_left), epoch=epoch, epochs=t.epochs)
        if show_progress
        else NoProgress()
    )

    def log_step(metrics: dict[str, float], step: int) -> None:
        tracker.log_metrics(metrics, step)
        if "train/loss" in metrics:
            bar.set_loss(metrics["train/loss"])

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
        on_step=bar.step,
    )
    bar.close()
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
            **(launch_metrics(started_at, stats.breakdown) if epoch == 1 else {}),
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
    return record


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
