"""The task: the loss a run trains on, the metrics its validation reports, and whether the model's outputs fit them.

    python -m pipeline task=regression               # MSE; val/mae, val/rmse
    python -m pipeline task=next_token               # cross-entropy over [B, T, V]; val/perplexity
    python -m pipeline task=custom task.loss._target_=mylosses.focal

Every task keeps validation on the device: ``sums`` adds one batch to a short vector of running sums (no host sync),
the vector is reduced across DDP ranks, and ``finish`` turns the totals into ``val/...`` metrics, with one sync for
the whole pass. ``weight`` is what the loss averages over (samples, elements, tokens that count), so the
out-of-memory fallback weights each micro-batch's loss by its share and the step's gradients stay the whole batch's.
``check_targets`` and ``check_outputs`` run on the first batch before any MLflow run is opened: a target of the wrong
dtype or an output that does not fit the loss is one line naming both shapes (``(B, 1)`` against ``(B,)`` too, which
``mse_loss`` would only warn about and then train on a broadcast loss).

A model's output is used as it is when it is a tensor; from a dict or an object with ``logits`` (Hugging Face's
``ModelOutput``) its ``logits``; from a tuple its first element. ``task=custom`` hands the loss and the metrics the
model's output untouched.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.common.errors import DatasetError, PipelineError
from pipeline.common.targets import bind, instantiate, resolve
from pipeline.config import TargetConfig, TaskConfig
from pipeline.data.structures import count, describe


class OutputMismatch(PipelineError):
    """The model's output does not fit the task's loss."""


def logits(outputs: Any) -> torch.Tensor:
    """The tensor a built-in task scores: the output, its ``logits``, or a tuple's first element."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    if hasattr(outputs, "logits") and isinstance(outputs.logits, torch.Tensor):
        return outputs.logits
    if isinstance(outputs, tuple | list) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise OutputMismatch(
        f"the model returned {describe(outputs)}: a built-in task needs a tensor (or a dict or object with logits, or "
        f"a tuple whose first element is a tensor); task=custom hands your loss the output as it is"
    )


def _shapes(outputs: torch.Tensor, targets: torch.Tensor) -> str:
    return f"outputs {list(outputs.shape)} against targets {list(targets.shape)}"


class Builtin:
    """What the built-in tasks share: no state to move or reset between validation passes."""

    def to(self, device: torch.device) -> Builtin:
        return self

    def reset(self) -> None:
        pass


class Classification(Builtin):
    """Cross-entropy against integer labels; ``val/acc``. Outputs ``[B, C]`` (or ``[B, C, ...]`` per position)."""

    name, primary, higher_is_better = "classification", "val/acc", True
    metric_names = ("val/loss", "val/acc")
    width = 3  # the length of ``sums``

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits(outputs), targets)

    def weight(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def check_targets(self, targets: Any) -> None:
        _tensor_targets(targets, self.name)
        if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
            raise DatasetError(
                f"the targets are {describe(targets)}: task=classification needs integer class labels (int64); for "
                f"numbers to predict use task=regression, for 0/1 labels per class task=multilabel"
            )

    def check_outputs(self, outputs: Any, targets: torch.Tensor) -> None:
        out = logits(outputs)
        if out.dim() < 2 or out.shape[:1] + out.shape[2:] != targets.shape:
            raise OutputMismatch(
                f"task=classification cannot score {_shapes(out, targets)}: it needs [B, C] class scores for [B] "
                f"labels (or [B, C, ...] for [B, ...])"
            )
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= out.shape[1]:
            raise OutputMismatch(
                f"the labels run from {low} to {high}, but the model scores {out.shape[1]} classes (outputs "
                f"{list(out.shape)}): the model's last layer needs {high + 1} outputs (data.num_classes)"
            )

    def sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        out = logits(outputs).float()
        loss = F.cross_entropy(out, targets, reduction="sum")
        correct = (out.argmax(dim=1) == targets).sum()
        return torch.stack([loss, correct.to(loss.dtype), loss.new_tensor(float(targets.numel()))])

    def finish(self, totals: list[float]) -> dict[str, float]:
        loss, correct, n = totals
        return {"val/loss": loss / n, "val/acc": correct / n}


class Regression(Builtin):
    """Mean squared error; ``val/mae`` and ``val/rmse``. Outputs and targets of one shape, floating point."""

    name, primary, higher_is_better = "regression", "val/mae", False
    metric_names = ("val/loss", "val/mae", "val/rmse")
    width = 3

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(logits(outputs), targets)

    def weight(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def check_targets(self, targets: Any) -> None:
        _tensor_targets(targets, self.name)
        if not targets.dtype.is_floating_point:
            raise DatasetError(
                f"the targets are {describe(targets)}: task=regression needs floating-point targets (return "
                f"y.float() from the dataset); for class labels use task=classification"
            )

    def check_outputs(self, outputs: Any, targets: torch.Tensor) -> None:
        out = logits(outputs)
        if out.shape != targets.shape:
            hint = ""
            if out.shape == (*targets.shape, 1):
                hint = ": squeeze the model's last dimension (outputs.squeeze(-1)), or return [B, 1] targets"
            elif targets.shape == (*out.shape, 1):
                hint = ": return [B] targets from the dataset, or a model output of [B, 1]"
            raise OutputMismatch(
                f"task=regression needs outputs of the targets' shape: {_shapes(out, targets)} would broadcast in "
                f"mse_loss and train on the wrong loss{hint}"
            )

    def sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        error = logits(outputs).float() - targets.float()
        return torch.stack([error.square().sum(), error.abs().sum(), error.new_tensor(float(error.numel()))])

    def finish(self, totals: list[float]) -> dict[str, float]:
        squared, absolute, n = totals
        return {"val/loss": squared / n, "val/mae": absolute / n, "val/rmse": math.sqrt(squared / n)}


class Multilabel(Builtin):
    """Binary cross-entropy with logits per label; ``val/f1`` (micro-averaged) and ``val/exact_match``."""

    name, primary, higher_is_better = "multilabel", "val/f1", True
    metric_names = ("val/loss", "val/f1", "val/exact_match")
    width = 7

    def __init__(self, threshold: float = 0.5) -> None:
        self.cut = math.log(threshold / (1 - threshold))  # sigmoid(x) > threshold  <=>  x > logit(threshold)

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        out = logits(outputs)
        return F.binary_cross_entropy_with_logits(out, targets.to(out.dtype))

    def weight(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def check_targets(self, targets: Any) -> None:
        _tensor_targets(targets, self.name)
        if targets.dim() < 2 or not bool(((targets == 0) | (targets == 1)).all()):
            raise DatasetError(
                f"the targets are {describe(targets)}: task=multilabel needs [B, L] targets of 0 and 1 (one column per "
                f"label)"
            )

    def check_outputs(self, outputs: Any, targets: torch.Tensor) -> None:
        out = logits(outputs)
        if out.shape != targets.shape:
            raise OutputMismatch(f"task=multilabel needs one output per label: {_shapes(out, targets)}")

    def sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        out = logits(outputs).float()
        truth = targets.float()
        loss = F.binary_cross_entropy_with_logits(out, truth, reduction="sum")
        predicted = out > self.cut
        actual = truth > 0.5
        tp = (predicted & actual).sum()
        fp = (predicted & ~actual).sum()
        fn = (~predicted & actual).sum()
        exact = (predicted == actual).flatten(1).all(dim=1).sum()
        counts = torch.stack([tp, fp, fn, exact]).to(loss.dtype)
        sizes = loss.new_tensor([float(targets.shape[0]), float(targets.numel())])
        return torch.cat([loss.view(1), counts, sizes])

    def finish(self, totals: list[float]) -> dict[str, float]:
        loss, tp, fp, fn, exact, rows, elements = totals
        scored = 2 * tp + fp + fn
        return {
            "val/loss": loss / elements,
            "val/f1": 2 * tp / scored if scored else 0.0,
            "val/exact_match": exact / rows,
        }


class NextToken(Builtin):
    """Cross-entropy over ``[B, T, V]`` logits against ``[B, T]`` token ids, ``ignore_index`` left out;
    ``val/perplexity`` (and ``val/acc``, the share of tokens predicted right)."""

    name, primary, higher_is_better = "next_token", "val/perplexity", False
    metric_names = ("val/loss", "val/perplexity", "val/acc")
    width = 3

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore = ignore_index

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        out = logits(outputs)
        return F.cross_entropy(out.flatten(0, -2), targets.flatten(), ignore_index=self.ignore)

    def weight(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets != self.ignore).sum()  # a device tensor: no sync

    def check_targets(self, targets: Any) -> None:
        _tensor_targets(targets, self.name)
        if targets.dtype.is_floating_point or targets.dim() != 2:
            raise DatasetError(f"the targets are {describe(targets)}: task=next_token needs [B, T] integer token ids")

    def check_outputs(self, outputs: Any, targets: torch.Tensor) -> None:
        out = logits(outputs)
        if out.dim() != 3 or out.shape[:2] != targets.shape:
            raise OutputMismatch(f"task=next_token needs [B, T, V] logits for [B, T] tokens: {_shapes(out, targets)}")
        counted = targets[targets != self.ignore]
        if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= out.shape[2]):
            raise OutputMismatch(
                f"token ids run from {int(counted.min())} to {int(counted.max())}, but the model scores a vocabulary "
                f"of {out.shape[2]} (outputs {list(out.shape)})"
            )

    def sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        out = logits(outputs).float().flatten(0, -2)
        flat = targets.flatten()
        loss = F.cross_entropy(out, flat, ignore_index=self.ignore, reduction="sum")
        counted = flat != self.ignore
        correct = ((out.argmax(dim=1) == flat) & counted).sum()
        return torch.stack([loss, correct.to(loss.dtype), counted.sum().to(loss.dtype)])

    def finish(self, totals: list[float]) -> dict[str, float]:
        loss, correct, tokens = totals
        mean = loss / tokens if tokens else math.nan
        return {"val/loss": mean, "val/perplexity": math.exp(min(mean, 700.0)), "val/acc": correct / tokens}


class Custom:
    """``task=custom``: the user's loss ``(outputs, targets) -> scalar``, and metrics that are either callables
    ``(outputs, targets) -> float`` (averaged over validation batches, weighted by their samples) or torchmetrics
    ``Metric`` objects (``update`` per batch, ``compute`` at the end: torchmetrics reduces them across DDP ranks)."""

    name, higher_is_better = "custom", None

    def __init__(self, cfg: TaskConfig) -> None:
        assert cfg.loss is not None  # TaskConfig.check requires it
        self._loss = _callable(cfg.loss, "task.loss")
        self.metrics = [(f"val/{m.label}", _callable(m, f"task.metrics[{i}]")) for i, m in enumerate(cfg.metrics)]
        self.averaged = [(name, fn) for name, fn in self.metrics if not _stateful(fn)]
        self.stateful = [(name, fn) for name, fn in self.metrics if _stateful(fn)]
        self.primary = cfg.primary or "val/loss"
        self.metric_names = ("val/loss", *(name for name, _ in self.metrics))
        self.width = 2 + len(self.averaged)

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self._loss(outputs, targets)

    def weight(self, targets: Any) -> int:
        return count(targets)

    def check_targets(self, targets: Any) -> None:
        pass  # the user's loss decides what it takes

    def check_outputs(self, outputs: Any, targets: Any) -> None:
        value = self._loss(outputs, targets)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise OutputMismatch(
                f"task.loss returned {describe(value)} for outputs {describe(outputs)} and targets {describe(targets)}:"
                f" expected a scalar tensor (reduce it, e.g. with .mean())"
            )

    def to(self, device: torch.device) -> Custom:
        for _, metric in self.stateful:
            metric.to(device)
        return self

    def reset(self) -> None:
        for _, metric in self.stateful:
            metric.reset()

    def sums(self, outputs: Any, targets: Any) -> torch.Tensor:
        n = float(count(targets))
        loss = self._loss(outputs, targets).detach().float().reshape(())
        values = [loss * n]
        for _, fn in self.averaged:
            value = fn(outputs, targets)
            value = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else loss.new_tensor(value)
            values.append(value * n)
        for _, metric in self.stateful:
            metric.update(outputs, targets)
        return torch.stack([*values, loss.new_tensor(n)])

    def finish(self, totals: list[float]) -> dict[str, float]:
        n = totals[-1]
        out = {"val/loss": totals[0] / n}
        out.update({name: value / n for (name, _), value in zip(self.averaged, totals[1:-1], strict=True)})
        for name, metric in self.stateful:
            value = metric.compute()
            out[name] = float(value.item() if isinstance(value, torch.Tensor) else value)
        return out


def _callable(cfg: TargetConfig, key: str) -> Any:
    """A class is made with the keywords (then called per batch); a function is bound to them (``_partial_``)."""
    partial = cfg._partial_
    if partial is None:
        partial = not inspect.isclass(resolve(cfg._target_, key=key))
    if partial:
        return bind(cfg._target_, cfg.keywords, key=key)
    return instantiate(cfg._target_, cfg.keywords, key=key)


def _stateful(metric: Any) -> bool:
    """A torchmetrics-style ``Metric``: it accumulates with ``update`` and answers with ``compute``."""
    return all(callable(getattr(metric, name, None)) for name in ("update", "compute", "reset"))


def _tensor_targets(targets: Any, task: str) -> None:
    if not isinstance(targets, torch.Tensor):
        raise DatasetError(f"the targets are {describe(targets)}: task={task} needs a tensor (task=custom takes any)")


Task = Classification | Regression | Multilabel | NextToken | Custom


def make_task(cfg: TaskConfig) -> Task:
    """The task ``task.name`` names, its metrics made (``task=custom``: the user's targets imported)."""
    if cfg.name == "classification":
        return Classification()
    if cfg.name == "regression":
        return Regression()
    if cfg.name == "multilabel":
        return Multilabel(cfg.threshold)
    if cfg.name == "next_token":
        return NextToken(cfg.ignore_index)
    return Custom(cfg)
