"""The groups the user fills with objects of their own: a ``_target_`` and its keywords.

    python -m pipeline model=custom model._target_=nets.Tiny model.width=64 task=regression
    python -m pipeline optimizer=adamw optimizer.lr=3e-4 scheduler=warmup_cosine

``model``, ``optimizer`` and ``scheduler`` hold a ``_target_`` (a dotted path) and any other keys, which are the
keywords it is called with (``keywords``, spread back into the group in the record: ``model.width``). ``task``
names the loss and the metrics; ``task=custom`` takes a ``_target_`` for each. The built-in options are cases of the
same mechanism (``conf/model/mlp.yaml`` is ``_target_: pipeline.engine.models.mlp`` and ``hidden_sizes``). Here the
targets are only checked for form: they are imported where they are made (``pipeline.common.targets``), before any
MLflow run is opened.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.common.errors import ConfigError
from pipeline.common.metric_names import VAL_LOSS, val_metric

DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
NAME = re.compile(r"[A-Za-z_]\w*")
# the keys a group's open part collects: every key the dataclass does not name (see compose._build)
SPREAD = {"spread": True}
OMIT_NONE = {"omit_none": True}  # left out of the record while unset


def check_target(key: str, value: str | None, *, bare: bool = False) -> None:
    """``value`` has the form of a ``_target_``: ``module.name`` (or a bare ``name`` where ``bare``)."""
    if value is None:
        return
    if not (DOTTED.fullmatch(value) or (bare and NAME.fullmatch(value))):
        example = "a torch.optim name or a dotted path" if bare else "a dotted path such as mymodule.MyNet"
        raise ConfigError(key, value, f"{example} (importable from the launch folder or PYTHONPATH)")


def target_label(target: str | None) -> str:
    """The last part of a dotted path, as run names and tables show it (``nets.Tiny`` -> ``Tiny``)."""
    return (target or "none").rsplit(".", 1)[-1].replace("-", "_")


@dataclass(frozen=True)
class TargetConfig:
    """A ``_target_`` and its keywords inside another group: ``task.loss``, an entry of ``task.metrics``,
    ``data.collate_fn``, ``data.split_batch``. A class is instantiated with the keywords; a function is bound to them
    and called later, unless ``_partial_`` says otherwise."""

    _target_: str
    _partial_: bool | None = field(default=None, metadata=OMIT_NONE)  # null: functions bound, classes made now
    name: str | None = field(default=None, metadata=OMIT_NONE)  # a metric's name: val/<name>; null = the target's
    keywords: dict[str, Any] = field(default_factory=dict, metadata=SPREAD)

    def check_at(self, key: str) -> None:
        check_target(f"{key}._target_", self._target_)
        if self.name is not None and not re.fullmatch(r"[\w.]+", self.name):
            raise ConfigError(f"{key}.name", self.name, "a metric name of letters, digits, _ and . (val/<name>)")

    @property
    def label(self) -> str:
        return self.name or target_label(self._target_)


@dataclass(frozen=True)
class ModelConfig:
    """model: any callable returning an ``nn.Module``; the group's other keys are its keywords. It also receives
    ``in_shape`` and ``num_classes`` from the data where its signature names them and the group does not set them."""

    _target_: str
    keywords: dict[str, Any] = field(default_factory=dict, metadata=SPREAD)

    def check(self) -> None:
        check_target("model._target_", self._target_)

    @property
    def label(self) -> str:
        """``resnet50`` for an architecture by name (``model.arch``), else the target's last part (``Tiny``)."""
        arch = self.keywords.get("arch")
        return str(arch).replace("-", "_") if isinstance(arch, str) and arch else target_label(self._target_)


@dataclass(frozen=True)
class OptimizerConfig:
    """optimizer: a ``torch.optim`` class (``SGD``, ``torch.optim.AdamW``) or any dotted path, called with the model's
    parameters first and the group's other keys (``lr``, ``momentum``, ``weight_decay``, ``betas``...)."""

    _target_: str
    keywords: dict[str, Any] = field(default_factory=dict, metadata=SPREAD)

    def check(self) -> None:
        check_target("optimizer._target_", self._target_, bare=True)
        rules = {
            "lr": (lambda v: v > 0, "a learning rate > 0"),
            "momentum": (lambda v: 0 <= v < 1, "a value in [0, 1)"),
            "weight_decay": (lambda v: v >= 0, "a value >= 0"),
        }
        for name, (fits, expected) in rules.items():
            value = self.keywords.get(name)
            if value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"optimizer.{name}", value, "a finite number")
            if isinstance(value, bool) or not isinstance(value, int | float) or not fits(value):
                raise ConfigError(f"optimizer.{name}", value, expected)

    @property
    def lr(self) -> float | None:
        value = self.keywords.get("lr")
        return float(value) if isinstance(value, int | float) else None


@dataclass(frozen=True)
class SchedulerConfig:
    """scheduler: the learning-rate schedule, stepped once per optimizer step (never per micro-batch) or once per
    epoch after its evaluation (``interval``); null = none. It is called with the optimizer first, and receives
    ``total_steps`` (the times it will be stepped) where its signature names it and the group does not set it. A
    schedule whose ``step`` takes a metric (``ReduceLROnPlateau``) is stepped after each evaluation with ``monitor``."""

    _target_: str | None = None
    keywords: dict[str, Any] = field(default_factory=dict, metadata=SPREAD)
    interval: Literal["step", "epoch"] | None = field(default=None, metadata=OMIT_NONE)  # null: step (none: unused)
    monitor: str | None = field(default=None, metadata=OMIT_NONE)  # a metric-fed schedule's metric; null = val/loss

    def check(self) -> None:
        check_target("scheduler._target_", self._target_, bare=True)
        if self._target_ is None and self.keywords:
            first = next(iter(self.keywords))
            raise ConfigError(f"scheduler.{first}", self.keywords[first], "no keywords with scheduler=none")
        if self._target_ is None:
            for key, value in (("interval", self.interval), ("monitor", self.monitor)):
                if value is not None:
                    raise ConfigError(f"scheduler.{key}", value, "null with scheduler=none")
        if self.monitor is not None and not re.fullmatch(r"[\w./-]+", self.monitor):
            raise ConfigError("scheduler.monitor", self.monitor, "a metric name such as val/loss")

    @property
    def every(self) -> Literal["step", "epoch"]:
        return self.interval or "step"

    @property
    def label(self) -> str:
        return target_label(self._target_)


@dataclass(frozen=True)
class StepConfig:
    """step: how a batch becomes a loss. ``null`` = the task's loss of the model's output (``step=default``); a
    ``_target_`` names the user's ``fn(model, batch, ctx)`` (``step=custom``), whose keywords are the group's other
    keys (``pipeline.engine.hot.hooks``)."""

    _target_: str | None = field(default=None, metadata=OMIT_NONE)
    keywords: dict[str, Any] = field(default_factory=dict, metadata=SPREAD)

    def check(self) -> None:
        check_target("step._target_", self._target_)
        if self._target_ is None and self.keywords:
            first = next(iter(self.keywords))
            raise ConfigError(
                f"step.{first}", self.keywords[first], "nothing with step=default (step=custom takes one)"
            )


TaskName = Literal["classification", "regression", "multilabel", "next_token", "custom"]
MODEL_LOSS = "model"  # task.loss=model: the model's own output.loss


@dataclass(frozen=True)
class TaskConfig:
    """task: the loss and the validation metrics (``pipeline.engine.hot.tasks``)."""

    name: TaskName
    ignore_index: int = -100  # next_token: target positions left out of the loss and the metrics (padding)
    threshold: float = 0.5  # multilabel: a label is predicted where sigmoid(output) > threshold
    # custom: any callable (outputs, targets) -> scalar tensor; model (any task): the model's own output.loss
    loss: Literal["model"] | TargetConfig | None = field(default=None, metadata=OMIT_NONE)
    metrics: list[TargetConfig] = field(default_factory=list)  # custom: callables or torchmetrics Metric classes
    primary: str | None = None  # custom: the metric the summary leads with and a sweep optimises; null = val/loss
    outputs: Literal["logits", "log_probs"] = "logits"  # classification, next_token: what the model returns
    shift_labels: bool = False  # next_token: output t is scored against target t + 1 (targets = the inputs)

    @property
    def model_loss(self) -> bool:
        """``task.loss=model``: the loss is the model's own (its output's ``loss``)."""
        return self.loss == MODEL_LOSS

    def check(self) -> None:
        if self.outputs != "logits" and self.name not in ("classification", "next_token"):
            raise ConfigError(
                "task.outputs", self.outputs, f"logits with task={self.name} (classification and next_token)"
            )
        if self.shift_labels and self.name != "next_token":
            raise ConfigError("task.shift_labels", True, f"false with task={self.name} (next_token shifts)")
        if self.name == "custom":
            self._check_custom()
            return
        if isinstance(self.loss, TargetConfig):
            raise ConfigError(
                "task.loss", self.loss._target_, f"null or model with task={self.name} (task=custom takes your own)"
            )
        if self.metrics:
            raise ConfigError("task.metrics", "...", f"none with task={self.name} (task=custom takes your own)")
        if self.primary is not None:
            raise ConfigError("task.primary", self.primary, f"null with task={self.name} (its metrics are fixed)")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError("task.threshold", self.threshold, "a probability strictly between 0 and 1")

    def _check_custom(self) -> None:
        if self.loss is None:
            raise ConfigError.missing("task.loss._target_")
        if isinstance(self.loss, TargetConfig):
            self.loss.check_at("task.loss")
        for index, metric in enumerate(self.metrics):
            metric.check_at(f"task.metrics[{index}]")
        names = [m.label for m in self.metrics]
        if len(set(names)) < len(names):
            raise ConfigError("task.metrics", names, "metrics of distinct names (give each a name: key)")
        known = {VAL_LOSS, *(val_metric(n) for n in names)}
        if self.primary is not None and self.primary not in known:
            raise ConfigError("task.primary", self.primary, f"one of {', '.join(sorted(known))}")
