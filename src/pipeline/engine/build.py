"""``build(cfg) -> Setup``: everything a run needs, built in the order that fails fastest.

Device, precision, data, model (with the CPU amp check), optimizer and batches are all made
before any MLflow run is opened, so a missing GPU or dataset, or a configuration that trains no
step, fails in seconds and leaves no half-made run behind.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.common.errors import ConfigError
from pipeline.config import LoaderConfig, RunConfig
from pipeline.data import (
    CropFlip,
    DataSpec,
    DevicePrefetcher,
    EpochLoader,
    Normalize,
    ResidentLoader,
    first_batch,
    load_data,
    make_augment,
    make_loader,
    with_prefetch,
)
from pipeline.engine.amp_check import AmpProbe, check_cpu_amp
from pipeline.engine.compilation import NO_COMPILE, CompileWatch, compile_model
from pipeline.engine.devices import DeviceChoice, activate, resolve_device
from pipeline.engine.footprint import check_training
from pipeline.engine.loop import TrainState
from pipeline.engine.memory import MicroBatcher, has_batchnorm, single_sample_tail
from pipeline.engine.models import build_model, build_optimizer, count_parameters
from pipeline.engine.precision import PrecisionPolicy, configure_backends, resolve_precision
from pipeline.engine.provenance import run_name
from pipeline.parallel.distributed import Group, Solo

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
    eval_micro: MicroBatcher  # evaluation's own: its out-of-memory errors never shrink training's
    parameters: int
    train_batches: EpochLoader | ResidentLoader | DevicePrefetcher
    val_batches: EpochLoader | ResidentLoader | DevicePrefetcher
    prepare: Normalize  # per micro-batch: evaluation's whole path, training's last step
    augment: CropFlip | None  # training only, once per batch before the OOM replay; None = data.augment=none
    run_name: str
    amp_probe: AmpProbe | None  # amp=true on the CPU: float32 and amp steps timed before training
    group: Solo | Group  # this process's place in a DDP job (``Solo`` for a plain run)

    @property
    def device(self) -> torch.device:
        return self.choice.device


def build(
    cfg: RunConfig, group: Solo | Group | None = None, *, explain_missing_gpu: Callable[[], str] = lambda: ""
) -> Setup:
    """Device, precision, data, model, optimizer and batches, in the order that fails fastest.

    Under DDP (``group``, joined already), the device is the rank's own (``cuda:LOCAL_RANK``), the model is
    wrapped in DistributedDataParallel and each loader reads this rank's share. ``explain_missing_gpu`` adds a
    diagnosis to the error when CUDA was asked for and is unusable (the caller's:
    ``pipeline.diagnostics.doctor.main_finding``
    from the entry points; the engine never imports the diagnostics).
    """
    group = group or Solo()
    choice = resolve_device(cfg.device, explain=explain_missing_gpu)
    device = group.place(choice.device)
    if device != choice.device:
        choice = DeviceChoice(device, torch.cuda.get_device_name(device), f"{choice.reason}; LOCAL_RANK={device.index}")
    activate(device)
    log.info("device: %s (%s) - %s", device, choice.name, choice.reason)
    policy = resolve_precision(cfg.precision, amp=cfg.amp, device=device)
    backends = configure_backends(cfg.precision, cfg.trainer, device, amp=cfg.amp)  # may refuse a CUDA-only switch
    t = cfg.trainer
    torch.manual_seed(t.seed)

    data = load_data(cfg.data)
    spec = data.spec
    check_training(cfg, in_shape=spec.in_shape, num_classes=spec.num_classes, device=device)  # before allocating
    model = build_model(cfg.model, in_shape=spec.in_shape, num_classes=spec.num_classes).to(device)
    batchnorm = has_batchnorm(model)
    train_loader = _batchnorm_safe(cfg, batchnorm=batchnorm, samples=spec.train_size, world=group.world_size)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    prepare = Normalize(spec.mean, spec.std, device=device, channels_last=t.channels_last)
    augment = make_augment(
        cfg.data, in_shape=spec.in_shape, seed=t.seed, device=device, rank=group.rank, world=group.world_size
    )

    def first_prepared() -> tuple[torch.Tensor, torch.Tensor]:  # read only when the amp check runs
        images, labels = first_batch(data.train, cfg.loader.batch_size)
        return prepare(images.to(device)), labels.to(device)

    amp_probe = check_cpu_amp(policy, model, first_prepared)
    parameters = count_parameters(model)
    model = group.wrap(model)
    if t.compile:  # around DDP's wrapper, not inside it: dynamo's DDPOptimizer then splits the graph at DDP's buckets,
        # so each bucket's all-reduce starts while backward still computes (one compiled backward would hold all back)
        model = compile_model(model, mode=t.compile_mode)  # compiles lazily: the first step pays
    optimizer = build_optimizer(  # the model's own parameters: not DDP's agreement (pipeline.parallel.overlap.Agreeing)
        t.optimizer, group.unwrap(model).parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
    )
    batch = cfg.loader.batch_size
    shard = {"rank": group.rank, "world": group.world_size}
    setup = Setup(
        cfg=cfg,
        choice=choice,
        policy=policy,
        backends=backends,
        spec=spec,
        state=TrainState(
            model,
            optimizer,
            policy.make_scaler(),
            MicroBatcher.from_config(cfg.oom, batch_size=batch, least=2 if batchnorm else 1),
            compiles=CompileWatch.start() if t.compile else NO_COMPILE,
        ),
        eval_micro=MicroBatcher(batch, batch, cfg.oom.min_micro_batch, cfg.oom.enabled),
        parameters=parameters,
        train_batches=with_prefetch(
            make_loader(data.train, train_loader, device=device, train=True, seed=t.seed, **shard),
            cfg.loader,
            device=device,
        ),
        val_batches=with_prefetch(
            make_loader(data.val, cfg.loader, device=device, train=False, seed=t.seed, **shard),
            cfg.loader,
            device=device,
        ),
        prepare=prepare,
        augment=augment,
        run_name=cfg.tracking.run_name or run_name(cfg, device_type=device.type, precision=policy.label),
        amp_probe=amp_probe,
        group=group,
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


def _batchnorm_safe(cfg: RunConfig, *, batchnorm: bool, samples: int, world: int) -> LoaderConfig:
    """The training loader's config, such that a model with BatchNorm never trains on a batch of one sample (the
    statistics of one value per channel are undefined: PyTorch stops with "Expected more than 1 value per channel").

    A last batch of one sample is dropped each epoch, with one warning; a batch or micro-batch of one is refused.

    Raises:
        ConfigError: ``loader.batch_size=1`` or ``oom.micro_batch_size=1`` with a BatchNorm model.
    """
    loader = cfg.loader
    if not batchnorm:
        return loader
    why = f"at least 2 for model={cfg.model.name}: its BatchNorm layers cannot normalise a batch of one sample"
    if loader.batch_size == 1:
        raise ConfigError("loader.batch_size", 1, why)
    if cfg.oom.micro_batch_size == 1:
        raise ConfigError("oom.micro_batch_size", 1, why)
    if loader.drop_last or not single_sample_tail(samples, batch_size=loader.batch_size, world=world):
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
