"""What a run writes to its record besides metrics: at the start its config, data and environment (or, resumed,
what changed); at the end its verdict, pictures, last figures and the ``RunResult``.

In a DDP job only rank 0 records its start; every rank concludes (the other ranks' trackers record nothing).
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import yaml

from pipeline.common.metric_names import (
    AMP_CPU_SPEED_VS_FP32,
    PERF_FLOPS_PER_SAMPLE,
    TIME_COMPILE_S,
    TIME_LOG_MODEL_S,
    TIME_TOTAL_S,
    TIME_TRACKING_BACKGROUND_WRITE_S,
    TIME_TRACKING_WRITE_S,
    TRAIN_EPOCH_LOSS,
)
from pipeline.config import RunConfig, flatten
from pipeline.data.structures import move
from pipeline.engine.building.build import Setup
from pipeline.engine.building.provenance import code_tags, describe_loader, environment_tags
from pipeline.engine.checkpointing.start import FreshStart, Resumed
from pipeline.engine.hot.memory import batchnorm_note
from pipeline.engine.hot.timing import Breakdown
from pipeline.engine.models import has_convolutions
from pipeline.engine.results import EpochResult, RunResult, run_breakdown
from pipeline.engine.run import Fitted, NoEpochModels, Run
from pipeline.machine import doctor
from pipeline.monitor import UtilSummary, job_summary, rank_cpu
from pipeline.record.lifecycle import Tracker
from pipeline.record.logged_model import Logged, ModelCard, check_format
from pipeline.report.operators import operator_groups
from pipeline.report.plots import step_breakdown, utilisation_timeline
from pipeline.report.summary import device_speed
from pipeline.report.verdict import Mfu, Profiled, RunFacts, Verdict, judge


def start(
    tracker: Tracker,
    setup: Setup,
    cfg: RunConfig,
    masked_config: dict[str, Any],
    typed_overrides: list[str],
    point: FreshStart | Resumed,
) -> None:
    """What a run records before training: its config, data and environment; or, resumed, what changed."""
    model_flops = setup.model_flops  # a resumed run may continue on another device: its peak is said again
    tracker.set_tags(model_flops.tags())
    if model_flops.per_sample is not None:
        tracker.log_metrics({PERF_FLOPS_PER_SAMPLE: model_flops.per_sample}, step=0)
    probe = setup.amp_probe
    if probe is not None:
        tracker.set_tags({"amp.cpu_check": probe.describe()})
        if probe.measured:
            tracker.log_metrics({AMP_CPU_SPEED_VS_FP32: probe.speed}, step=0)
    if said := point.record_tags(tracker, typed_overrides):  # resumed: where it continued and what changed
        tracker.set_tags(said)
    if point.same_run:
        return  # its params are fixed, and the tags describe the resumed part
    tracker.log_params({**flatten(masked_config), **setup.group.record(cfg.loader.batch_size)})
    tracker.log_dataset(setup.spec, context="train")
    tracker.log_text(yaml.safe_dump(masked_config, sort_keys=False), "config.yaml")
    tracker.log_text("\n".join(typed_overrides) + "\n", "overrides.txt")
    environment = doctor.report(smoke=False)  # the doctor's findings, kept with the run
    tracker.log_text(json.dumps(environment, indent=2), "environment.json")
    tracker.set_tags(environment_tags(environment, setup.device))
    spec = setup.spec
    if spec.classes:
        tracker.log_text(
            json.dumps({"classes": spec.classes, "class_to_idx": spec.class_to_idx}, indent=1), "classes.json"
        )
    code = {
        **setup.code.tags(),  # code.sha256 and code.file.<path>: every user module the run imported
        "task.primary": setup.task.primary,
        **code_tags("model", setup.group.unwrap(setup.state.model), target=cfg.model._target_),
    }
    if cfg.data._target_ is not None:
        code.update(code_tags("data", None, target=cfg.data._target_))
    tracker.set_tags(code)


def conclude(run: Run, cfg: RunConfig, fitted: Fitted, *, total_s: float) -> RunResult:
    """The run's verdict, pictures and record, once its training is over and the sampler has stopped."""
    setup, tracker, sampler, models, epochs = run.setup, run.tracker, run.sampler, run.models, fitted.epochs
    breakdown = run_breakdown(epochs)
    utilisation = sampler.summary()
    # Every rank concludes, so every rank takes part in this gather; it makes the job's other ranks on this machine
    # count as the run's own CPU use, not as other processes keeping the machine busy.
    utilisation = job_summary(utilisation, setup.group.gather(rank_cpu(utilisation)))
    profile = setup.profiler.record()  # the trace and the top operators (None when not profiled)
    verdict = _verdict(setup, cfg, epochs, breakdown, utilisation, profile)
    note = batchnorm_note(setup.state.model, setup.state.micro)
    tags = {**verdict.tags(), **utilisation.tags()}
    tracker.set_tags({**tags, "oom.batchnorm": note} if note else tags)
    if cfg.monitor.plots:
        _plots(tracker, setup.run_name, sampler, epochs, fitted.starts)
    model = setup.group.unwrap(setup.state.model)  # the job's wrapper must not outlive its process group
    once = {TIME_TOTAL_S: total_s}
    logged = models.last  # tracking.log_model=checkpoints: the last epoch's
    if cfg.tracking.models == "final" and tracker.run_id is not None and epochs:
        logged = _log_model(tracker, setup, model, once, form=cfg.tracking.model_format)
    if logged is not None:
        tracker.set_tags({"model.format": logged.form})
    compile_s = compile_seconds([e.breakdown for e in epochs]) if cfg.trainer.compile else None
    once.update(setup.state.compiles.metrics())  # compile/graphs, compile/recompiles (compiled runs only)
    replay = setup.replay.outcome(breakdown)  # perf/replay_speedup, or the tag perf.replay says why not
    once.update(replay.metrics())
    tracker.set_tags(replay.tags())
    notes = [note] if note else []
    if compile_s is not None:
        once[TIME_COMPILE_S] = compile_s
        notes.append(compile_note(compile_s, breakdown, setup.state.compiles, mode=cfg.trainer.compile_mode))
    times = {TIME_TRACKING_WRITE_S: tracker.write_s, TIME_TRACKING_BACKGROUND_WRITE_S: tracker.background_write_s}
    tracker.log_metrics({**once, **times}, step=len(epochs))
    return RunResult(
        **_setup_facts(setup, cfg),
        run_id=tracker.run_id,
        total_s=total_s,
        epochs=epochs,
        breakdown=breakdown,
        utilisation=utilisation,
        tracking_write_s=tracker.write_s,
        tracking_background_write_s=tracker.background_write_s,
        bottleneck=verdict.bottleneck,
        verdict=verdict.message,
        tracking=tracker.describe(),
        model=model,
        logged_model=f"mlflow.pytorch.load_model('{logged.uri}')" + (" (pt2)" if logged.form == "pt2" else "")
        if logged
        else "",
        notes=notes,
        profile=profile,
        replay=replay,
    )


def _verdict(
    setup: Setup,
    cfg: RunConfig,
    epochs: list[EpochResult],
    breakdown: Breakdown,
    utilisation: UtilSummary,
    profile: Any,
) -> Verdict:
    """What held the run back (``pipeline.report.verdict.judge``), from its step-time shares, each steady epoch's,
    the machine's use and what the profile found."""
    groups = (
        operator_groups(profile, outputs=cfg.task.outputs, device_type=setup.device.type) if profile is not None else []
    )
    run = RunFacts(
        device_type=setup.device.type,
        precision=setup.policy.label,
        convolutional=has_convolutions(setup.state.model),
        mfu=run_mfu(setup, device_speed(epochs)),
        amp_check=setup.amp_probe,
    )
    profiled = Profiled(groups, _profiled_words(setup.profiler, profile))
    return judge(cfg, run, breakdown, utilisation, epochs=epochs, profile=profiled)


def _profiled_words(profiler: Any, profile: Any) -> str:
    """Which steps the profile covered, or why the run profiled none (the auto profile's reason)."""
    if profile is not None:
        return f"profile of steps {profile.first}-{profile.first + profile.steps - 1}"
    return getattr(profiler, "skipped", "")


def _plots(tracker: Tracker, title: str, sampler: Any, epochs: list[EpochResult], epoch_starts: list[float]) -> None:
    tracker.log_figure(
        lambda: utilisation_timeline(sampler.samples, epoch_starts, title=title), "plots/utilisation.png"
    )
    tracker.log_figure(lambda: step_breakdown([e.breakdown for e in epochs], title=title), "plots/step_time.png")


def _log_model(tracker: Tracker, setup: Setup, model: Any, once: dict[str, float], *, form: str) -> Logged | None:
    """The trained model logged to the run (its training is over: it moves to the host); what loads it, and
    ``time/log_model_s`` into ``once``."""
    began = time.perf_counter()
    logged = tracker.log_model(model.cpu(), model_card(setup, model), form=form)
    once[TIME_LOG_MODEL_S] = time.perf_counter() - began
    return logged


class EpochModels:
    """``tracking.log_model=checkpoints``: at each epoch's checkpoint, a copy of the model on the host logged to the
    run with ``step`` the epoch (MLflow links the epoch's metrics to it); ``last`` is the newest."""

    def __init__(self, tracker: Tracker, setup: Setup, *, form: str) -> None:
        self.tracker, self.setup, self.form = tracker, setup, form
        self.last: Logged | None = None

    def checkpointed(self, epoch: int) -> None:
        copied = copy.deepcopy(self.setup.group.unwrap(self.setup.state.model)).cpu()
        self.last = (
            self.tracker.log_model(copied, model_card(self.setup, copied), form=self.form, step=epoch) or self.last
        )


def epoch_models(cfg: RunConfig, tracker: Tracker, setup: Setup) -> EpochModels | NoEpochModels:
    if cfg.tracking.models == "checkpoints" and tracker.run_id is not None:
        return EpochModels(tracker, setup, form=cfg.tracking.model_format)
    return NoEpochModels()


def compile_note(compile_s: float, breakdown: Breakdown, compiles: Any, *, mode: str) -> str:
    """What the summary says torch.compile cost (``compile_seconds``) and where that time is left out."""
    later = (
        f" and {breakdown.compile_steps} later step(s) that recompiled for a new batch shape"
        if breakdown.compile_steps
        else ""
    )
    return (
        f"torch.compile (mode {mode}) took about {compile_s:.1f} s: the first step's "
        f"{breakdown.first_step_s:.1f} s{later}, less steady steps' time; samples/s leaves those steps out "
        f"({compiles.graphs} graph(s), {compiles.recompiles} recompile(s))"
    )


def _setup_facts(setup: Setup, cfg: RunConfig) -> dict[str, Any]:
    """What the run's result says of what was built: names, device, precision, loader, sizes and micro-batches."""
    return {
        "run_name": setup.run_name,
        "device": str(setup.device),
        "device_name": setup.choice.name,
        "precision": setup.policy.label,
        "loader": describe_loader(cfg),
        "loader_kind": setup.train_batches.kind,
        "parameters": setup.parameters,
        "steps": setup.state.step,
        "oom_events": list(setup.state.micro.events),
        "micro_batch": setup.state.micro.micro_batch,
        "eval_micro_batch": setup.eval_micro.micro_batch,
        "primary": setup.task.primary,
        "amp_probe": setup.amp_probe,
        "flops": setup.model_flops,
        "distributed": setup.group.describe(cfg.loader.batch_size),
    }


def run_mfu(setup: Setup, samples_per_s: float | None) -> Mfu | None:
    """The run's MFU at the summary's speed (``device_speed``), for the verdict."""
    pct = setup.model_flops.mfu_pct(samples_per_s) if samples_per_s is not None else None
    return Mfu(pct, setup.model_flops.peak.dtype) if pct is not None else None


def model_card(setup: Setup, model: Any) -> ModelCard:
    """What the logged model carries (``pipeline.record.logged_model``): what the model was called with on the first
    two samples (the built-in sources' after normalisation; a step hook's arguments as it passed them), its output
    for them, the classes and how inputs were prepared."""
    import torch

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args, kwargs = (move(part, device, non_blocking=False) for part in _example(setup))
    outputs = None
    if args or kwargs:
        with torch.no_grad():
            outputs = model.eval()(*args, **kwargs)
    spec = setup.spec
    metadata: dict[str, Any] = {"task": setup.task.name, "primary_metric": setup.task.primary}
    if spec.classes:
        metadata.update(classes=list(spec.classes), class_to_idx=spec.class_to_idx)
    if spec.builtin:
        metadata["inputs"] = {
            "from": "uint8 pixels [N, C, H, W]",
            "scale": "x / 255",
            "mean": spec.mean,
            "std": spec.std,
        }
    return ModelCard(_as_input(args, kwargs), outputs, metadata, [*setup.scoring.metric_names, TRAIN_EPOCH_LOSS])


def _example(setup: Setup) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What the model was called with on the first batch, less the labels the pipeline added for the model's own
    loss (``task.loss=model``), which are no input of the model's."""
    args, kwargs = setup.example
    if setup.task.from_model:
        kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
    return args, kwargs


def _as_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The model's input example: its one positional input, its keyword inputs, or both as they are."""
    if kwargs and not args:
        return kwargs
    return args[0] if len(args) == 1 and not kwargs else (args, kwargs)


def check_model_format(setup: Setup, cfg: RunConfig) -> None:
    """``tracking.model_format=pt2`` for a model that takes something else than one tensor is refused before the run
    opens (``pipeline.record.logged_model.check_format``)."""
    if cfg.tracking.enabled and cfg.tracking.models is not None:
        check_format(cfg.tracking.model_format, _as_input(*_example(setup)))


def compile_seconds(breakdowns: list[Breakdown]) -> float | None:
    """What ``torch.compile`` cost a run: its first step's time, and that of the later steps that recompiled for a
    new batch shape, beyond what as many steady steps take, in seconds.

    torch.compile compiles at the model's first forward, inside the run's first training step, and again in a
    step whose batch has a shape it has not seen (an epoch's last, smaller batch; the out-of-memory fallback's
    half). Those steps are already kept out of the step-time shares and of ``throughput/samples_per_s``
    (``timing``: each epoch's first step and every compiling step are reported on their own), so compilation never
    counts as training time; this only names its size: their duration less the mean of the steady steps. It was
    chosen over timing an explicit warm-up step before training, which would run a real forward and backward whose
    side effects must then be undone (BatchNorm's running statistics, gradients, DDP's gradient hooks), need its
    own out-of-memory path, and cost a step; this costs nothing. What it also holds is the first step's other
    warm-up (cuDNN's autotuning, the allocator's first blocks, loader workers starting): milliseconds, against
    compilation's seconds to minutes.

    Args:
        breakdowns: the run's epochs' breakdowns, in order.

    Returns:
        Seconds (>= 0), or None when no epoch had a steady step, so nothing says what a step costs.
    """
    steady = [b for b in breakdowns if b.steps >= 2]  # a one-step epoch's only step is its first
    steps = sum(b.steady_steps for b in steady)
    if not breakdowns or not steps:
        return None
    mean = sum(b.step_s for b in steady) / steps
    compiling = breakdowns[0].first_step_s + sum(b.compile_steps_s for b in breakdowns)
    return max(compiling - (1 + sum(b.compile_steps for b in breakdowns)) * mean, 0.0)
