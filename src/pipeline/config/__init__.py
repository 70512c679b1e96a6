"""The run's configuration, composed and validated once at start-up before any run or CUDA work.

Each config group owns a frozen dataclass. ``from_dictconfig`` turns Hydra's composed config
into a ``RunConfig``: unknown keys, wrong types and invalid values all raise ``ConfigError``
naming the dotted key, the value and what is allowed. Every float must be finite (``inf`` and
``nan`` pass most range checks unnoticed) unless its field says ``metadata={"nonfinite": True}``.
The YAML files in ``conf/`` hold the defaults and the comments; these classes hold the types and
the rules. ``sweep_jobs`` lists the jobs of a ``-m`` sweep, so each is validated before the first
one starts.

``schema`` holds the dataclasses and their rules, ``compose`` the Hydra side and the typed reading of its tree,
``design`` the order of a sweep's jobs, ``search_space`` what a sweep's command line lists (its jobs, each key's
values, the search spaces only Optuna runs); what the rest of the package uses is named here.
"""

from pipeline.common.errors import ConfigError
from pipeline.config.compose import as_typed, compose, config_dir, flatten, from_dictconfig, load, with_open_keys
from pipeline.config.data import DataConfig
from pipeline.config.schema import (
    DATALOADER,
    RESIDENT,
    CheckpointConfig,
    DeviceConfig,
    LoaderConfig,
    MonitorConfig,
    OomConfig,
    PrecisionConfig,
    RunConfig,
    TrackingConfig,
    TrainerConfig,
    cuda_only_expected,
    tree,
)
from pipeline.config.search_space import check_multirun, check_search_space, sweep_jobs, sweep_values
from pipeline.config.targets import (
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    StepConfig,
    TargetConfig,
    TaskConfig,
    target_label,
)

__all__ = [
    "DATALOADER",
    "RESIDENT",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DeviceConfig",
    "LoaderConfig",
    "ModelConfig",
    "MonitorConfig",
    "OomConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RunConfig",
    "SchedulerConfig",
    "StepConfig",
    "TargetConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainerConfig",
    "as_typed",
    "check_multirun",
    "check_search_space",
    "compose",
    "config_dir",
    "cuda_only_expected",
    "flatten",
    "from_dictconfig",
    "load",
    "sweep_jobs",
    "sweep_values",
    "target_label",
    "tree",
    "with_open_keys",
]
