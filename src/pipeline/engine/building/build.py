"""``build(cfg) -> Setup``: everything a run needs, built in the order that fails fastest.

Device, precision, data, model (with the CPU amp check), optimizer and batches are all made
before any MLflow run is opened, so a missing GPU or dataset, or a configuration that trains no
step, fails in seconds and leaves no half-made run behind.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.utils.data import IterableDataset

from pipeline.common.errors import ConfigError, DatasetError
from pipeline.config import LoaderConfig, RunConfig
from pipeline.data import (
    AsGiven,
    Batches,
    CropFlip,
    DataBundle,
    DataSpec,
    Normalize,
    Place,
    Split,
    custom,
    first_batch,
    load_data,
    make_augment,
    make_batches,
    with_prefetch,
)
from pipeline.data.backends import backend_of
from pipeline.data.iterable import check_shares, steps_per_epoch
from pipeline.data.structures import count, move, split
from pipeline.engine.building import flops
from pipeline.engine.building.amp_check import AmpProbe, check_cpu_amp, model_loss
from pipeline.engine.building.devices import DeviceChoice, activate, resolve_device
from pipeline.engine.building.footprint import check_training
from pipeline.engine.building.inputs import FirstBatch, check_first_batch
from pipeline.engine.building.precision_setup import configure_backends, resolve_precision
from pipeline.engine.building.provenance import UserCode, run_name
from pipeline.engine.hot.compilation import NO_COMPILE, CompileWatch, compile_model
from pipeline.engine.hot.hooks import Step, StepContext, make_step
from pipeline.engine.hot.loop import Scoring
from pipeline.engine.hot.memory import MicroBatcher, has_batchnorm, single_sample_tail
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.hot.step import Inputs, TrainState
from pipeline.engine.hot.tasks import Task, make_task
from pipeline.engine.models import BUILTIN, build_model, count_parameters
from pipeline.engine.observe.profiling import NO_PROFILER, NoProfiler, StepProfiler, make_profiler
from pipeline.engine.observe.replay import NO_REPLAY, NoReplay, ReplayCheck, make_replay
from pipeline.engine.observe.snapshot import NO_SNAPSHOT, NoSnapshot, OomSnapshot, make_snapshot
from pipeline.engine.optim import Schedule, build_optimizer, build_scheduler, make_clipping, needs_closure
from pipeline.monitor.peaks import device_peak, run_dtype
from pipeline.parallel.distributed import Group, Solo

log = logging.getLogger("pipeline.engine.build")  # the name its lines have always shown


@dataclass
class Setup:
    """Everything a run needs, built before its MLflow run is opened (the config that made it stays the caller's)."""

    choice: DeviceChoice
    policy: PrecisionPolicy
    backends: dict[str, str]
    spec: DataSpec
    task: Task  # the loss and the validation metrics (pipeline.engine.hot.tasks)
    first: tuple[Any, Any]  # the first training batch on the host
    example: tuple[tuple[Any, ...], dict[str, Any]]  # what the model was called with on it (the input example)
    state: TrainState
    scoring: Scoring  # how evaluation scores a batch (its own step context)
    eval_micro: MicroBatcher  # evaluation's own: its out-of-memory errors never shrink training's
    parameters: int
    train_batches: Batches  # made by the backend loader.backend names (pipeline.data.backends)
    val_batches: Batches
    prepare: Normalize | AsGiven  # per micro-batch: evaluation's whole path, training's last step
    augment: CropFlip | None  # training only, once per batch before the OOM replay; None = data.augment=none
    run_name: str
    amp_probe: AmpProbe | None  # amp=true on the CPU: float32 and amp steps timed before training
    group: Solo | Group  # this process's place in a DDP job (``Solo`` for a plain run)
    model_flops: flops.ModelFlops  # model FLOPs per sample and the device's peak: each epoch's TFLOP/s and MFU
    code: UserCode = field(default_factory=lambda: UserCode({}))  # the user's code it imported (hashed)
    profiler: StepProfiler | NoProfiler = NO_PROFILER  # trainer.profile (pipeline.engine.observe.profiling)
    snapshot: OomSnapshot | NoSnapshot = NO_SNAPSHOT  # trainer.memory_snapshot (pipeline.engine.observe.snapshot)
    replay: ReplayCheck | NoReplay = NO_REPLAY  # trainer.replay_check: the step time with free data (engine.replay)

    @property
    def device(self) -> torch.device:
        return self.choice.device

    def end_loaders(self) -> None:
        """End the training and validation loaders' worker processes kept between epochs: with the run, not at some
        later garbage collection (``WatchedLoader.close``)."""
        for batches in (self.train_batches, self.val_batches):
            batches.close()

    @property
    def inputs(self) -> Inputs:
        """How a training batch reaches the model (``pipeline.engine.hot.step``)."""
        return Inputs(self.device, self.policy, self.prepare, self.augment)


def build(
    cfg: RunConfig,
    group: Solo | Group | None = None,
    *,
    explain_missing_gpu: Callable[[], str] = lambda: "",
    on_model: Callable[[torch.nn.Module], None] = lambda model: None,
) -> Setup:
    """Device, precision, data, model, optimizer and batches, in the order that fails fastest.

    Under DDP (``group``, joined already), the device is the rank's own (``cuda:LOCAL_RANK``), the model is
    wrapped in DistributedDataParallel and each loader reads this rank's share. ``explain_missing_gpu`` adds a
    diagnosis to the error when CUDA was asked for and is unusable (the caller's: ``train`` and ``autotune`` pass
    ``pipeline.machine.doctor.main_finding``; the engine never imports the doctor, a layer above it).
    ``on_model`` is handed the model as built, on its device, before anything runs it (the GPU check's dry run
    injects its out-of-memory errors there).
    """
    group = group or Solo()
    choice = _device(cfg, group, explain_missing_gpu)
    device, trainer = choice.device, cfg.trainer
    policy = resolve_precision(cfg.precision, amp=cfg.amp, device=device)
    backends = configure_backends(cfg.precision, trainer, device, amp=cfg.amp)  # may refuse a CUDA-only switch
    torch.manual_seed(trainer.seed)
    backend_of(cfg.loader)  # an unknown loader.backend is refused before the data loads
    data = load_data(cfg.data, batch_size=cfg.loader.batch_size, long_targets=cfg.task.name in LABELS)
    spec = data.spec
    task = make_task(cfg.task).to(device)
    step = make_step(cfg.step, task)  # the user's step imported now: a bad path fails before the model is made
    first = data.first or first_batch(data.train, 2)  # two samples: BatchNorm needs more than one
    model = _model(cfg, spec, device, example=first[0])
    on_model(model)
    train_loader = _batchnorm_safe(cfg, batchnorm=has_batchnorm(model), samples=spec.train_size, world=group.world_size)
    prepare = _prepare(spec, trainer, device)
    checked, model_flops = _model_flops(
        cfg, model, task, first, step, inputs=Inputs(device, policy, prepare), choice=choice
    )
    if trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    augment = _augment(cfg, spec, device, group)
    first_prepared, amp_loss = _first_prepared(data, cfg.loader, prepare, device), _amp_loss(step, task, device, model)
    amp_probe = check_cpu_amp(policy, model, first_prepared, loss=amp_loss, per_sample=model_flops.per_sample)
    parameters = count_parameters(model)
    module = model
    model = _wrapped(model, group, trainer)
    # the model's own parameters: not DDP's agreement (pipeline.parallel.overlap.Agreeing)
    optimizer = build_optimizer(cfg.optimizer, module.parameters())
    train_batches, val_batches = _loaders(cfg, data, train_loader, device=device, group=group)
    snapshot = make_snapshot(trainer, device)  # called by both micro-batchers at an out-of-memory error
    scoring = Scoring(task, step, StepContext(task.loss, device, module), _splitter(data, cfg.data.batch_dim))
    scoring.batch_dim, scoring.outputs = cfg.data.batch_dim, checked.outputs
    steps = total_steps(trainer, len(train_batches))
    scheduler = build_scheduler(
        cfg.scheduler, optimizer, steps=steps, epochs=trainer.epochs, metrics=scoring.metric_names
    )
    state = _train_state(cfg, model, optimizer, policy, scheduler, scoring, snapshot=snapshot)
    batch = cfg.loader.batch_size
    return Setup(
        choice=choice,
        policy=policy,
        backends=backends,
        spec=spec,
        task=task,
        first=first,
        example=checked.example,
        state=state,
        scoring=scoring,
        eval_micro=MicroBatcher(batch, batch, cfg.oom.min_micro_batch, cfg.oom.enabled, on_oom=snapshot),
        parameters=parameters,
        train_batches=train_batches,
        val_batches=val_batches,
        prepare=prepare,
        augment=augment,
        run_name=cfg.tracking.run_name or run_name(cfg, device_type=device.type, precision=policy.label),
        amp_probe=amp_probe,
        group=group,
        model_flops=model_flops,
        code=UserCode.imported(),  # every user module is imported by now: the data's, the model's, the step's
        profiler=make_profiler(trainer, device, mfu_pct=model_flops.mfu_pct),
        snapshot=snapshot,
        replay=make_replay(trainer),
    )


def _augment(cfg: RunConfig, spec: DataSpec, device: torch.device, group: Solo | Group) -> Any:
    """The GPU-side augmentation of a built-in source's batches (None: off, or the user's data, which arrives
    augmented by its own transform)."""
    if not spec.builtin:
        return None
    assert spec.in_shape is not None  # a built-in source knows its shape
    return make_augment(
        cfg.data, in_shape=spec.in_shape, seed=cfg.trainer.seed, device=device, rank=group.rank, world=group.world_size
    )


def _train_state(
    cfg: RunConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: PrecisionPolicy,
    scheduler: Schedule,
    scoring: Scoring,
    *,
    snapshot: OomSnapshot | NoSnapshot,
) -> TrainState:
    """What the epochs advance: with the scaler, training's own micro-batcher (at least 2 samples when the model,
    ``scoring``'s unwrapped module, has BatchNorm), the step and a context of training's own (``scoring``'s task, step
    and cut, not its context), clipping, whether the optimizer takes a closure and, compiled, the watch over what
    torch.compile compiles."""
    least = 2 if has_batchnorm(scoring.context.module) else 1
    micro = MicroBatcher.from_config(cfg.oom, batch_size=cfg.loader.batch_size, least=least, on_oom=snapshot)
    task, step = scoring.task, scoring.compute
    return TrainState(
        model,
        optimizer,
        policy.make_scaler(),
        micro,
        compiles=CompileWatch.start() if cfg.trainer.compile else NO_COMPILE,
        scheduler=scheduler,
        task=task,
        split=scoring.split,
        compute=step,
        context=StepContext(task.loss, scoring.context.device, scoring.context.module),
        batch_dim=cfg.data.batch_dim,
        clip=make_clipping(cfg.trainer, scoring.context.module.parameters()),
        closure=_closure_allowed(cfg, optimizer, policy),
    )


def _closure_allowed(cfg: RunConfig, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy) -> bool:
    """Whether the optimizer's step takes a closure (L-BFGS); refused under float16's GradScaler, which cannot step
    one.

    Raises:
        ConfigError: a closure optimizer with amp in float16.
    """
    if not needs_closure(optimizer):
        return False
    if policy.make_scaler().is_enabled():
        raise ConfigError(
            "precision.dtype",
            cfg.precision.dtype,
            f"bf16, or amp=false, with optimizer._target_={cfg.optimizer._target_}: its step re-evaluates the loss "
            f"through a closure, which float16's GradScaler cannot step",
        )
    return True


def _amp_loss(step: Step, task: Task, device: torch.device, model: torch.nn.Module) -> Callable[..., Any]:
    """The run's step loss as the CPU amp check times it, ``(model, inputs, targets)``: the task's on the model's
    outputs, or a step hook's, each call in a context of its own (on the copy the check times)."""
    if not step.custom:
        return model_loss(task.loss)
    return lambda model_, inputs, targets: step.loss(
        model_, inputs, targets, StepContext(task.loss, device, model_, training=True)
    )


def _device(cfg: RunConfig, group: Solo | Group, explain: Callable[[], str]) -> DeviceChoice:
    """The run's device (under DDP the rank's own), made the current one and logged."""
    choice = resolve_device(cfg.device, explain=explain)
    device = group.place(choice.device)
    if device != choice.device:
        choice = DeviceChoice(device, torch.cuda.get_device_name(device), f"{choice.reason}; LOCAL_RANK={device.index}")
    activate(device)
    log.info("device: %s (%s) - %s", device, choice.name, choice.reason)
    return choice


def _model_flops(
    cfg: RunConfig,
    model: torch.nn.Module,
    task: Task,
    first: tuple[Any, Any],
    step: Step,
    *,
    inputs: Inputs,
    choice: DeviceChoice,
) -> tuple[FirstBatch, flops.ModelFlops]:
    """The first batch checked against the model, the task and the step (``check_first_batch``; ``inputs``: how it
    reaches the model, unaugmented), its forward's FLOPs counted on the way (MFU's numerator, counted once per run),
    and the peak of ``choice``'s device at the run's precision."""
    device = choice.device
    with flops.counting() as counted:
        checked = check_first_batch(
            model, task, first, inputs=inputs, channels_last=cfg.trainer.channels_last, step=step
        )
    model_flops = flops.ModelFlops(
        flops.per_sample(counted.forward, count(first[0], cfg.data.batch_dim)),
        device_peak(device, run_dtype(device, inputs.policy.dtype), device_name=choice.name),
    )
    return checked, model_flops


def _prepare(spec: DataSpec, trainer: Any, device: torch.device) -> Normalize | AsGiven:
    """Per micro-batch, the inputs as the model takes them: a built-in source's uint8 pixels normalised on the
    device; the user's as they are (in ``channels_last`` if asked)."""
    if spec.builtin:
        assert spec.mean is not None and spec.std is not None  # a built-in source publishes its statistics
        return Normalize(spec.mean, spec.std, device=device, channels_last=trainer.channels_last)
    return AsGiven(channels_last=trainer.channels_last)


def _first_prepared(
    data: DataBundle, loader: LoaderConfig, prepare: Normalize | AsGiven, device: torch.device
) -> Callable[[], tuple[Any, Any]]:
    """A full first batch on the device, prepared: read only when the CPU amp check runs."""

    def first_prepared() -> tuple[Any, Any]:
        images, labels = first_batch(data.train, loader.batch_size, data.collate)
        return prepare(move(images, device)), move(labels, device)

    return first_prepared


def _wrapped(model: torch.nn.Module, group: Solo | Group, trainer: Any) -> torch.nn.Module:
    """The model in DDP's wrapper (a plain run: as it is), compiled around it when ``trainer.compile``."""
    model = group.wrap(model)
    if trainer.compile:  # around DDP's wrapper, not inside it: dynamo's DDPOptimizer then splits the graph at DDP's
        # buckets, so each bucket's all-reduce starts while backward still computes (one compiled backward would
        # hold all back)
        model = compile_model(model, mode=trainer.compile_mode)  # compiles lazily: the first step pays
    return model


def announce(setup: Setup, cfg: RunConfig) -> None:
    """The run's first line: its name (the one the summary and MLflow show), what trains on what, and its size."""
    spec = setup.spec
    log.info(
        "run %s: %s on %s, %s train / %s val samples, %s parameters",
        setup.run_name,
        cfg.model.label,
        spec.name,
        spec.train_size if spec.train_size is not None else "a stream of",
        spec.val_size if spec.val_size is not None else "a stream of",
        f"{setup.parameters:,}",
    )


def _model(cfg: RunConfig, spec: DataSpec, device: torch.device, *, example: Any) -> torch.nn.Module:
    """The model on ``device``, after its memory needs were checked: the pipeline's own factories on the meta device
    before anything is allocated; a user's model (or pretrained weights) once made, on the host, with its first
    inputs (``example``) on meta copies, the model left as it was."""
    in_shape, classes = spec.in_shape, spec.num_classes
    own = cfg.model._target_.startswith(BUILTIN) and not cfg.model.keywords.get("weights")
    if own:
        check_training(cfg, in_shape=in_shape, num_classes=classes, device=device)
    model = build_model(cfg.model, in_shape=in_shape, num_classes=classes)
    if not own:
        check_training(cfg, in_shape=in_shape, num_classes=classes, device=device, model=model, example=example)
    return model.to(device)


def _loaders(
    cfg: RunConfig, data: DataBundle, train_loader: LoaderConfig, *, device: torch.device, group: Solo | Group
) -> tuple[Batches, Batches]:
    """The training and validation batches (this rank's share), each behind a device prefetcher where wanted; the
    user's datasets are checked for what their workers and ranks need first."""
    place = Place(device, cfg.trainer.seed, rank=group.rank, world=group.world_size)
    steps = None
    if data.spec.iterable:
        stream = cast(IterableDataset, data.train)  # spec.iterable: the user's IterableDataset
        steps = steps_per_epoch(
            stream, configured=cfg.data.steps_per_epoch, batch_size=cfg.loader.batch_size, world=group.world_size
        )
        check_shares(stream, cfg.loader, collate=data.collate, gather=group.gather, world=group.world_size)
    elif cfg.data.steps_per_epoch is not None:
        raise ConfigError(
            "data.steps_per_epoch", cfg.data.steps_per_epoch, "null for a map-style dataset (its length is the epoch)"
        )
    if not data.spec.builtin:
        custom.check_picklable(data, cfg.loader)
    train = make_batches(Split(data.train, True, data.collate, steps), train_loader, place)
    val = make_batches(Split(data.val, False, data.collate), cfg.loader, place)
    return with_prefetch(train, cfg.loader, device=device), with_prefetch(val, cfg.loader, device=device)


def _splitter(data: DataBundle, batch_dim: int) -> Any:
    """How the out-of-memory fallback cuts a batch: the user's ``data.split_batch``, checked to give as many pieces
    as asked, or the structures' own cut along ``batch_dim``."""
    hook = data.split_batch
    if hook is None:
        return functools.partial(split, dim=batch_dim) if batch_dim else split

    def cut(batch: Any, pieces: int) -> list[Any]:
        parts = list(hook(batch, pieces))
        if len(parts) != pieces:
            raise DatasetError(f"data.split_batch returned {len(parts)} micro-batches where {pieces} were asked for")
        return parts

    return cut


LABELS = ("classification", "next_token")  # tasks whose integer targets are made int64 (what cross-entropy takes)


def total_steps(trainer: Any, per_epoch: int) -> int:
    """The run's optimizer steps: every epoch's batches, or ``trainer.max_steps`` when fewer (the schedule's
    length)."""
    steps = trainer.epochs * per_epoch
    return min(steps, trainer.max_steps) if trainer.max_steps > 0 else steps


def _batchnorm_safe(cfg: RunConfig, *, batchnorm: bool, samples: int | None, world: int) -> LoaderConfig:
    """The training loader's config, such that a model with BatchNorm never trains on a batch of one sample (the
    statistics of one value per channel are undefined: PyTorch stops with "Expected more than 1 value per channel").

    A last batch of one sample is dropped each epoch, with one warning; a batch or micro-batch of one is refused.

    Raises:
        ConfigError: ``loader.batch_size=1`` or ``oom.micro_batch_size=1`` with a BatchNorm model.
    """
    loader = cfg.loader
    if not batchnorm:
        return loader
    why = f"at least 2 for model={cfg.model.label}: its BatchNorm layers cannot normalise a batch of one sample"
    if loader.batch_size == 1:
        raise ConfigError("loader.batch_size", 1, why)
    if cfg.oom.micro_batch_size == 1:
        raise ConfigError("oom.micro_batch_size", 1, why)
    if (
        samples is None
        or loader.drop_last
        or not single_sample_tail(samples, batch_size=loader.batch_size, world=world)
    ):
        return loader
    share = f" over {world} ranks" if world > 1 else ""
    log.warning(
        "each epoch's last training batch would hold 1 sample (%d training samples%s, loader.batch_size=%d) and "
        "BatchNorm cannot normalise one sample: it is dropped each epoch, as loader.drop_last=true would; choose "
        "another loader.batch_size to train on every sample",
        samples,
        share,
        loader.batch_size,
    )
    return dataclasses.replace(loader, drop_last=True)
