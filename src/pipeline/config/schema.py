"""The run's schema: a frozen dataclass per config group, with the types and rules of every key (the YAML files in
``conf/`` hold the defaults and their comments). Each class checks its own values in ``__post_init__`` and raises
``ConfigError`` naming the dotted key, the value and what is allowed; ``RunConfig`` checks what depends on
several groups.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.common.errors import ConfigError
from pipeline.common.uris import sqlite_database, uri_scheme
from pipeline.config.data import DataConfig
from pipeline.config.targets import (
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    StepConfig,
    TaskConfig,
)

MISSING_VALUE = "???"


# MLflow's limits (mlflow.utils.validation's MAX_EXPERIMENT_NAME_LENGTH and MAX_ENTITY_KEY_LENGTH, the runs table's
# name column): checked with the config, not after the data loaded; tests/test_tracking.py keeps them equal
MAX_EXPERIMENT_NAME = 500


MAX_RUN_NAME = 250


MAX_TAG_KEY = 250


MAX_TAG_VALUE = 8000  # MAX_TAG_VAL_LENGTH: MLflow cuts a longer value, with a warning


TAGS_PREFIX = "tracking.tags."


PROFILE_STEPS = 3  # trainer.profile_steps' default (conf/trainer/default.yaml says the same)


# The built-in loader backends' names (loader.backend; pipeline.data.backends registers them and any other)
DATALOADER, RESIDENT = "dataloader", "resident"


@dataclass(frozen=True)
class DeviceConfig:
    name: Literal["auto", "cpu", "cuda", "mps"]
    index: int | None = None

    def check(self) -> None:
        if self.index is not None and self.name != "cuda":
            raise ConfigError("device.index", self.index, f"null with device={self.name} (only cuda has indices)")
        if self.index is not None and self.index < 0:
            raise ConfigError("device.index", self.index, "a GPU index >= 0")


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: Literal["auto", "fp16", "bf16"]
    tf32: bool


@dataclass(frozen=True)
class LoaderConfig:
    batch_size: int
    num_workers: int
    pin_memory: bool | Literal["auto"]
    persistent_workers: bool
    prefetch_factor: int | None
    drop_last: bool
    resident: bool
    timeout: float = 0.0
    # true is checked against the device at build time (data.prefetch.prefetch_wanted), once device=auto is resolved
    prefetch_to_device: bool | Literal["auto"] = "auto"
    # how workers start; auto = this process's default: spawn on Windows and macOS, fork on Linux (3.14: forkserver)
    multiprocessing_context: Literal["auto", "fork", "spawn", "forkserver"] = "auto"
    shuffle: bool = True  # false: the dataset's order every epoch (each DDP rank its contiguous share)
    # the registered backend that makes the batches (pipeline.data.backends); auto = the built-in one loader.resident
    # chooses; the registry, not this schema, knows the names (an unknown one is refused as the run is built)
    backend: str = "auto"

    @property
    def backend_name(self) -> str:
        """The backend that makes the batches: ``loader.backend``, or for ``auto`` the built-in one that
        ``loader.resident`` chooses."""
        if self.backend != "auto":
            return self.backend
        return RESIDENT if self.resident else DATALOADER

    def check(self) -> None:
        if self.resident != (self.backend_name == RESIDENT):
            raise ConfigError(
                "loader.resident",
                self.resident,
                f"{str(not self.resident).lower()} with loader.backend={self.backend} "
                f"(loader.resident=true is the {RESIDENT} backend's switch)",
            )
        if self.batch_size < 1:
            raise ConfigError("loader.batch_size", self.batch_size, "an integer >= 1")
        if self.num_workers < 0:
            raise ConfigError("loader.num_workers", self.num_workers, "an integer >= 0 (0 = main process)")
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise ConfigError("loader.prefetch_factor", self.prefetch_factor, "null or an integer >= 1")
        if self.timeout < 0:
            raise ConfigError("loader.timeout", self.timeout, "seconds >= 0 (0 = wait forever)")
        if self.num_workers == 0:
            if self.timeout:
                raise ConfigError("loader.timeout", self.timeout, "0 with loader.num_workers=0 (no worker to wait for)")
            if self.persistent_workers:
                raise ConfigError("loader.persistent_workers", True, "false with loader.num_workers=0")
            if self.prefetch_factor is not None:
                raise ConfigError("loader.prefetch_factor", self.prefetch_factor, "null with loader.num_workers=0")
            if self.multiprocessing_context != "auto":
                raise ConfigError(
                    "loader.multiprocessing_context",
                    self.multiprocessing_context,
                    "auto with loader.num_workers=0 (no worker processes to start)",
                )
        # a method the platform lacks (fork, forkserver on Windows) would fail only as the first worker starts
        if self.multiprocessing_context not in ("auto", *multiprocessing.get_all_start_methods()):
            raise ConfigError(
                "loader.multiprocessing_context",
                self.multiprocessing_context,
                f"auto or a start method this platform ({sys.platform}) has: "
                f"{', '.join(multiprocessing.get_all_start_methods())}",
            )
        if self.resident:
            if self.num_workers:
                raise ConfigError(
                    "loader.num_workers", self.num_workers, "0 with loader.resident=true (no workers needed)"
                )
            if self.pin_memory is True:
                raise ConfigError("loader.pin_memory", True, "auto or false with loader.resident=true")
            if self.prefetch_to_device is True:
                raise ConfigError(
                    "loader.prefetch_to_device",
                    True,
                    "auto or false with loader.resident=true (the data is on the device already: no copy to overlap)",
                )
        if self.prefetch_to_device is True and self.pin_memory is False:
            raise ConfigError(
                "loader.prefetch_to_device",
                True,
                "auto or false with loader.pin_memory=false (a copy from unpinned memory blocks the host: "
                "nothing would overlap), or set loader.pin_memory=auto",
            )


@dataclass(frozen=True)
class TrainerConfig:
    epochs: int
    max_steps: int
    seed: int
    log_every_n_steps: int
    channels_last: bool
    cudnn_benchmark: bool
    compile: bool
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
    progress: bool | Literal["auto"]
    clip_grad_norm: float | None = None  # the gradients' total norm clipped to this (after unscaling); null = none
    clip_grad_value: float | None = None  # each gradient element clipped to [-value, value]; null = none
    profile: bool = False  # torch.profiler over a few steady steps (pipeline.engine.observe.profiling)
    profile_steps: int = PROFILE_STEPS
    auto_profile: bool = True  # low MFU: a few steps profiled by the run itself, within 2% of its time
    memory_snapshot: Literal["off", "on_oom"] = "off"  # the allocator's history, dumped at an out-of-memory error
    replay_check: bool = True  # perf/replay_speedup: a few steps replayed on one batch (pipeline.engine.observe.replay)

    def check(self) -> None:
        if self.profile_steps < 1:
            raise ConfigError("trainer.profile_steps", self.profile_steps, "an integer >= 1")
        if self.profile_steps != PROFILE_STEPS and not self.profile:
            raise ConfigError(
                "trainer.profile_steps",
                self.profile_steps,
                f"{PROFILE_STEPS} while trainer.profile=false (add trainer.profile=true to profile that many steps)",
            )
        if self.compile_mode != "default" and not self.compile:
            raise ConfigError(
                "trainer.compile_mode",
                self.compile_mode,
                "default while trainer.compile=false (add trainer.compile=true to compile in this mode)",
            )
        if self.epochs < 1:
            raise ConfigError("trainer.epochs", self.epochs, "an integer >= 1")
        for key in ("clip_grad_norm", "clip_grad_value"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"trainer.{key}", value, "null (no clipping) or a number > 0")
        if self.clip_grad_norm is not None and self.clip_grad_value is not None:
            raise ConfigError(
                "trainer.clip_grad_value",
                self.clip_grad_value,
                f"null while trainer.clip_grad_norm={self.clip_grad_norm} (clip by one of the two)",
            )
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError("trainer.max_steps", self.max_steps, "-1 (no limit) or an integer >= 1")
        if self.log_every_n_steps < 1:
            raise ConfigError("trainer.log_every_n_steps", self.log_every_n_steps, "an integer >= 1")
        if not 0 <= self.seed < 2**32:  # torch's generators, NumPy and the loader's worker seeds all take it
            raise ConfigError("trainer.seed", self.seed, "an integer from 0 to 4294967295 (2**32 - 1)")

    def cuda_only(self) -> dict[str, object]:
        """The switches set here that only a CUDA device acts on: cuDNN's autotuner, CUDA graphs (what
        ``compile_mode=reduce-overhead`` adds to the default mode) and the CUDA allocator's history
        (``memory_snapshot``). Elsewhere they would be silent no-ops."""
        switches: dict[str, object] = {}
        if self.cudnn_benchmark:
            switches["trainer.cudnn_benchmark"] = True
        if self.compile_mode == "reduce-overhead":
            switches["trainer.compile_mode"] = self.compile_mode
        if self.memory_snapshot != "off":
            switches["trainer.memory_snapshot"] = self.memory_snapshot
        return switches


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool
    uri: str
    experiment: str
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    # final: the trained model as an MLflow logged model (pipeline.record.logged_model); checkpoints: one per epoch too
    log_model: Literal["final", "checkpoints"] | bool = "final"
    model_format: Literal["pickle", "pt2", "auto"] = "pickle"  # how the logged model is saved

    @property
    def models(self) -> Literal["final", "checkpoints"] | None:
        """Which models the run logs: the final one, one per epoch's checkpoint as well, or none (``true``: the key's
        old form of ``final``)."""
        if self.log_model is False:
            return None
        return "final" if self.log_model is True else self.log_model

    def check(self) -> None:
        if self.enabled and not self.uri.strip():
            raise ConfigError("tracking.uri", self.uri, "a tracking URI such as sqlite:///mlflow.db")
        if self.enabled and not self.experiment.strip():
            raise ConfigError("tracking.experiment", self.experiment, "a non-empty experiment name")
        if self.enabled and len(self.experiment) > MAX_EXPERIMENT_NAME:
            raise ConfigError("tracking.experiment", self.experiment, _at_most(MAX_EXPERIMENT_NAME, "a name"))
        if self.run_name is not None and not self.run_name.strip():  # it names the run and its checkpoint folder
            raise ConfigError("tracking.run_name", self.run_name, "a non-empty name or null (a name made from the run)")
        if self.run_name is not None and len(self.run_name) > MAX_RUN_NAME:
            raise ConfigError("tracking.run_name", self.run_name, _at_most(MAX_RUN_NAME, "a name"))
        if self.run_name is not None and any(not c.isprintable() for c in self.run_name):
            raise ConfigError("tracking.run_name", self.run_name, "a name on one line, without control characters")
        for key, value in self.tags.items() if self.enabled else ():
            if len(key) > MAX_TAG_KEY:
                raise ConfigError(f"{TAGS_PREFIX}{key}", value, _at_most(MAX_TAG_KEY, "tag keys"))
            if len(str(value)) > MAX_TAG_VALUE:
                raise ConfigError(f"{TAGS_PREFIX}{key}", f"{str(value)[:40]}...", _at_most(MAX_TAG_VALUE, "tag values"))
        try:
            scheme = uri_scheme(self.uri) if self.enabled else ""
        except ValueError as err:
            raise ConfigError(
                "tracking.uri", self.uri, f"a valid URI ({err}), e.g. sqlite:///mlflow.db or http://127.0.0.1:5000"
            ) from None
        if scheme == "sqlite" and sqlite_database(self.uri) is None:
            raise ConfigError(
                "tracking.uri",
                self.uri,
                "a database file, e.g. sqlite:///mlflow.db: an in-memory SQLite store records the run nowhere "
                "(it is gone when the run ends); to record nothing, say tracking=none",
            )


@dataclass(frozen=True)
class MonitorConfig:
    enabled: bool
    backend: Literal["auto", "nvml", "gputil", "none"]
    interval_s: float
    plots: bool

    def check(self) -> None:
        if not 0.05 <= self.interval_s <= 60:
            raise ConfigError("monitor.interval_s", self.interval_s, "seconds between 0.05 and 60")


@dataclass(frozen=True)
class OomConfig:
    enabled: bool
    micro_batch_size: int | None
    min_micro_batch: int

    def check(self) -> None:
        if self.min_micro_batch < 1:
            raise ConfigError("oom.min_micro_batch", self.min_micro_batch, "an integer >= 1")
        if self.micro_batch_size is not None and self.micro_batch_size < self.min_micro_batch:
            raise ConfigError(
                "oom.micro_batch_size",
                self.micro_batch_size,
                f"null or an integer >= oom.min_micro_batch ({self.min_micro_batch})",
            )


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool
    dir: str
    every_n_steps: int

    def check(self) -> None:
        if self.every_n_steps < 0:
            raise ConfigError("checkpoint.every_n_steps", self.every_n_steps, "0 (epoch ends only) or more")
        if not self.dir:
            raise ConfigError("checkpoint.dir", self.dir, "a folder name")


@dataclass(frozen=True)
class RunConfig:
    device: DeviceConfig
    model: ModelConfig
    precision: PrecisionConfig
    loader: LoaderConfig
    data: DataConfig
    task: TaskConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    trainer: TrainerConfig
    tracking: TrackingConfig
    monitor: MonitorConfig
    oom: OomConfig
    checkpoint: CheckpointConfig
    amp: bool
    resume: str | None
    # how a batch becomes a loss: the task's (step=default: no trace in the record), or the user's hook
    step: StepConfig = field(default_factory=StepConfig, metadata={"omit_empty": True})
    fork: bool = False  # with resume=: continue the checkpoint in a new MLflow run instead of the same one
    # not a config key: the dotted keys whose values came from environment variables (masked in the record)
    env_keys: frozenset[str] = field(default=frozenset(), compare=False, metadata={"internal": True})

    def check(self) -> None:
        micro = self.oom.micro_batch_size
        if micro is not None and micro > self.loader.batch_size:
            raise ConfigError("oom.micro_batch_size", micro, f"at most loader.batch_size ({self.loader.batch_size})")
        if self.fork and self.resume is None:
            raise ConfigError("fork", True, "false without resume= (fork=true continues a checkpoint in a new run)")
        if self.resume is not None and not self.checkpoint.enabled:
            raise ConfigError("resume", self.resume, "null while checkpoint.enabled=false (nothing to resume from)")
        if not self.amp and self.precision.dtype != "auto":
            raise ConfigError(
                "precision.dtype", self.precision.dtype, "auto while amp=false (add amp=true to train in it)"
            )
        if self.loader.resident and self.data.batch_dim != 0:
            raise ConfigError(
                "loader.resident",
                True,
                f"false with data.batch_dim={self.data.batch_dim} (resident batches are cut along 0)",
            )
        if self.trainer.memory_snapshot != "off" and not self.tracking.enabled:
            raise ConfigError(
                "trainer.memory_snapshot",
                self.trainer.memory_snapshot,
                "off while tracking.enabled=false (the snapshot is kept as an artifact of the run's record)",
            )
        cuda_only = self.trainer.cuda_only()
        if cuda_only and self.device.name in ("cpu", "mps"):  # device=auto: checked once it has chosen (precision.py)
            key, value = next(iter(cuda_only.items()))
            raise ConfigError(key, value, cuda_only_expected(key, self.device.name))

    def to_dict(self) -> dict[str, Any]:
        """The config as plain nested values (what the run uses; see ``pipeline.common.secrets`` for the record)."""
        return tree(self)


def tree(node: Any) -> Any:
    """A config dataclass as the nested plain values of its YAML: a group's spread keywords back among its keys
    (``{"_target_": "nets.Tiny", "width": 64}``), unset hooks as null, internal fields left out."""
    if not dataclasses.is_dataclass(node):
        if isinstance(node, list):
            return [tree(item) for item in node]
        if isinstance(node, dict):
            return {key: tree(value) for key, value in node.items()}
        return node
    out: dict[str, Any] = {}
    for f in dataclasses.fields(node):
        if f.metadata.get("internal"):
            continue
        value = getattr(node, f.name)
        if value is None and f.metadata.get("omit_none"):
            continue
        if f.metadata.get("spread"):
            out.update(tree(value))
        elif not (f.metadata.get("omit_empty") and not tree(value)):
            out[f.name] = tree(value)
    return out


# Keys that moved to a group of their own: named in the refusal of the old key.
MOVED = {
    "trainer.optimizer": "optimizer=sgd|adamw|adam|custom (the optimizer group)",
    "trainer.lr": "optimizer.lr",
    "trainer.momentum": "optimizer.momentum",
    "trainer.weight_decay": "optimizer.weight_decay",
}


def cuda_only_expected(key: str, device_type: str) -> str:
    """What a CUDA-only trainer switch must be on ``device_type``, and why: the end of its ``ConfigError``."""
    if key == "trainer.cudnn_benchmark":
        return f"false on {device_type}: cuDNN's autotuner exists only on CUDA GPUs (device=cuda)"
    if key == "trainer.memory_snapshot":
        return f"off on {device_type}: the allocator's history is recorded only on CUDA GPUs (device=cuda)"
    return (
        f"default, max-autotune or max-autotune-no-cudagraphs on {device_type}: reduce-overhead adds CUDA graphs, "
        "which exist only on CUDA GPUs (device=cuda)"
    )


def _at_most(limit: int, what: str) -> str:
    return f"{what} of at most {limit} characters (MLflow's limit)"
