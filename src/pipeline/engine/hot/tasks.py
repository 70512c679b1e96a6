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
model's output untouched. ``task.outputs=log_probs`` (classification, next_token) takes outputs that are
log-probabilities already (a model ending in ``log_softmax``): the loss is the NLL, not a second log-softmax.
``task.loss=model`` trains on the model's own loss (its output's ``loss``: a Hugging Face model given ``labels``),
the task's metrics still read the outputs. ``task.shift_labels`` (next_token) scores output ``t`` against target
``t + 1``, for targets that are the inputs themselves.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pipeline.common.errors import DatasetError, PipelineError
from pipeline.common.metric_names import (
    VAL_ACC,
    VAL_EXACT_MATCH,
    VAL_F1,
    VAL_LOSS,
    VAL_MAE,
    VAL_PERPLEXITY,
    VAL_RMSE,
    val_metric,
)
from pipeline.common.targets import hook
from pipeline.data.structures import count, describe

if TYPE_CHECKING:  # the config is read, never imported: building the run hands it in
    from typing_extensions import Self  # typing.Self from Python 3.11

    from pipeline.config import TargetConfig, TaskConfig

log = logging.getLogger("pipeline.engine.tasks")  # the name its lines have always shown


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


def model_loss(outputs: Any) -> torch.Tensor:
    """The loss a model computed itself (``task.loss=model``): its output's ``loss`` (an object's or a dict's)."""
    found = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if not isinstance(found, torch.Tensor):
        raise OutputMismatch(
            f"task.loss=model, but the model returned {describe(outputs)} without a loss tensor: a Hugging Face model "
            f"returns .loss when it is given labels (its forward takes labels=; the targets are passed as them), or "
            f"let the task compute the loss (task.loss=null)"
        )
    return found


def _shapes(outputs: torch.Tensor, targets: torch.Tensor) -> str:
    return f"outputs {list(outputs.shape)} against targets {list(targets.shape)}"


class Builtin:
    """What the built-in tasks share: no state to move or reset between validation passes, the model's own loss where
    ``task.loss=model`` says so, and nothing to check of the inputs."""

    from_model = False  # task.loss=model

    def to(self, device: torch.device) -> Self:
        return self

    def reset(self) -> None:
        pass

    def check_inputs(self, inputs: Any, targets: Any) -> None:
        pass

    def _summed_loss(self, outputs: Any, n: torch.Tensor | float) -> torch.Tensor:
        """The model's own mean loss times what it averages over (``task.loss=model``), as a validation sum."""
        return model_loss(outputs).detach().float().reshape(()) * n


class Classification(Builtin):
    """Cross-entropy against integer labels (NLL for log-probabilities); ``val/acc``. Outputs ``[B, C]`` (or
    ``[B, C, ...]`` per position)."""

    name, primary, higher_is_better = "classification", VAL_ACC, True
    metric_names = (VAL_LOSS, VAL_ACC)
    width = 3  # the length of ``sums``

    def __init__(self, outputs: str = "logits", *, from_model: bool = False) -> None:
        self.log_probs, self.from_model = outputs == "log_probs", from_model
        self.criterion = F.nll_loss if self.log_probs else F.cross_entropy

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.from_model:
            return model_loss(outputs)
        return self.criterion(logits(outputs), targets)

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
        check_log_probs(out, dim=1, log_probs=self.log_probs, task=self.name)

    def sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        out = logits(outputs).float()
        n = float(targets.numel())
        loss = self._summed_loss(outputs, n) if self.from_model else self.criterion(out, targets, reduction="sum")
        correct = (out.argmax(dim=1) == targets).sum()
        return torch.stack([loss, correct.to(loss.dtype), loss.new_tensor(n)])

    def finish(self, totals: list[float]) -> dict[str, float]:
        loss, correct, n = totals
        return {VAL_LOSS: loss / n, VAL_ACC: correct / n}


LOG_PROB_TOLERANCE = 1e-3  # |logsumexp| of a row of log-probabilities, in float32 (bfloat16 outputs: looser)


def check_log_probs(out: torch.Tensor, *, dim: int, log_probs: bool, task: str) -> None:
    """Outputs that are log-probabilities (each row's logsumexp 0) where ``task.outputs`` says logits cost a second
    log-softmax (said once, as a warning: the loss is the same); raw scores where it says ``log_probs`` would train
    on a wrong loss (refused)."""
    if not out.is_floating_point() or out.numel() == 0:
        return
    spread = float(torch.logsumexp(out.detach().float(), dim=dim).abs().max())
    tolerance = LOG_PROB_TOLERANCE if out.dtype == torch.float32 or out.dtype == torch.float64 else 0.05
    if log_probs and spread > tolerance:
        raise OutputMismatch(
            f"task.outputs=log_probs, but the model's outputs are not log-probabilities (a row's logsumexp is "
            f"{spread:.3g} from 0): end the model with log_softmax, or use task.outputs=logits"
        )
    if not log_probs and spread <= tolerance:
        log.warning(
            "the model's outputs are log-probabilities (each row's logsumexp is 0): task=%s applies log_softmax to "
            "them again; task.outputs=log_probs takes them as they are (NLL) and saves that work",
            task,
        )


class Regression(Builtin):
    """Mean squared error; ``val/mae`` and ``val/rmse``. Outputs and targets of one shape, floating point."""

    name, primary, higher_is_better = "regression", VAL_MAE, False
    metric_names = (VAL_LOSS, VAL_MAE, VAL_RMSE)
    width = 4

    def __init__(self, *, from_model: bool = False) -> None:
        self.from_model = from_model

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.from_model:
            return model_loss(outputs)
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
        n, squared = float(error.numel()), error.square().sum()
        loss = self._summed_loss(outputs, n) if self.from_model else squared  # val/loss: the model's own, or MSE
        return torch.stack([loss, error.abs().sum(), error.new_tensor(n), squared])

    def finish(self, totals: list[float]) -> dict[str, float]:
        loss, absolute, n, squared = totals
        return {VAL_LOSS: loss / n, VAL_MAE: absolute / n, VAL_RMSE: math.sqrt(squared / n)}


class Multilabel(Builtin):
    """Binary cross-entropy with logits per label; ``val/f1`` (micro-averaged) and ``val/exact_match``."""

    name, primary, higher_is_better = "multilabel", VAL_F1, True
    metric_names = (VAL_LOSS, VAL_F1, VAL_EXACT_MATCH)
    width = 7

    def __init__(self, threshold: float = 0.5, *, from_model: bool = False) -> None:
        self.cut = math.log(threshold / (1 - threshold))  # sigmoid(x) > threshold  <=>  x > logit(threshold)
        self.from_model = from_model

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.from_model:
            return model_loss(outputs)
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
        if self.from_model:
            loss = self._summed_loss(outputs, float(targets.numel()))
        else:
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
            VAL_LOSS: loss / elements,
            VAL_F1: 2 * tp / scored if scored else 0.0,
            VAL_EXACT_MATCH: exact / rows,
        }


class NextToken(Builtin):
    """Cross-entropy (NLL for log-probabilities) over ``[B, T, V]`` outputs against ``[B, T]`` token ids (or flat
    ``[N, V]`` outputs against targets of ``N`` ids, as a sequence-first model returns them), ``ignore_index`` left
    out; ``val/perplexity`` (and ``val/acc``, the share of tokens predicted right). With ``shift``, output ``t`` is
    scored against target ``t + 1`` (targets that are the inputs: Hugging Face's ``labels=input_ids``)."""

    name, primary, higher_is_better = "next_token", VAL_PERPLEXITY, False
    metric_names = (VAL_LOSS, VAL_PERPLEXITY, VAL_ACC)
    width = 3

    def __init__(
        self, ignore_index: int = -100, outputs: str = "logits", *, shift: bool = False, from_model: bool = False
    ) -> None:
        self.ignore, self.shift, self.from_model = ignore_index, shift, from_model
        self.log_probs = outputs == "log_probs"
        self.criterion = F.nll_loss if self.log_probs else F.cross_entropy

    def aligned(self, out: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs and targets as the loss pairs them, flat: ``[N, V]`` and ``[N]``."""
        if self.shift:
            out, targets = out[:, :-1], targets[:, 1:]
        return out.flatten(0, -2), targets.flatten()

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.from_model:
            return model_loss(outputs)
        out, flat = self.aligned(logits(outputs), targets)
        return self.criterion(out, flat, ignore_index=self.ignore)

    def weight(self, targets: torch.Tensor) -> torch.Tensor:
        return ((targets[:, 1:] if self.shift else targets) != self.ignore).sum()  # a device tensor: no sync

    def check_targets(self, targets: Any) -> None:
        _tensor_targets(targets, self.name)
        if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.dim() < 1:
            raise DatasetError(f"the targets are {describe(targets)}: task=next_token needs [B, T] integer token ids")
        if self.shift and targets.dim() != 2:
            raise DatasetError(f"the targets are {describe(targets)}: task.shift_labels=true shifts [B, T] token ids")

    def check_inputs(self, inputs: Any, targets: torch.Tensor) -> None:
        """Targets that are the inputs themselves (Hugging Face's ``labels=input_ids``) must be shifted: scored
        unshifted, the model learns to copy its input. The model's own loss shifts them inside (Hugging Face's causal
        LMs do), so the metrics shift too.

        Raises:
            OutputMismatch: the task would compute the loss on such targets unshifted; naming ``task.shift_labels``.
        """
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
        same = isinstance(ids, torch.Tensor) and ids.shape == targets.shape and bool(torch.equal(ids, targets))
        if not same or self.shift:
            return
        if self.from_model:
            self.shift = True  # the model shifts its labels itself: so do the metrics
            return
        raise OutputMismatch(
            "the targets are the inputs themselves, and task=next_token scores output t against target t: the model "
            "would learn to copy its input. Add task.shift_labels=true (output t against target t + 1, as Hugging "
            "Face's labels=input_ids means), or task.loss=model for a model that shifts its labels itself"
        )

    def check_outputs(self, outputs: Any, targets: torch.Tensor) -> None:
        out = logits(outputs)
        flat = out.dim() == 2 and out.shape[0] == targets.numel()
        if not flat and (out.dim() != targets.dim() + 1 or out.shape[:-1] != targets.shape):
            raise OutputMismatch(
                f"task=next_token needs [B, T, V] outputs for [B, T] tokens (or [N, V] for N tokens): "
                f"{_shapes(out, targets)}"
            )
        if flat and self.shift:
            raise OutputMismatch(
                f"task.shift_labels=true shifts [B, T, V] outputs, not flat ones: {_shapes(out, targets)}"
            )
        counted = targets[targets != self.ignore]
        if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= out.shape[-1]):
            raise OutputMismatch(
                f"token ids run from {int(counted.min())} to {int(counted.max())}, but the model scores a vocabulary "
                f"of {out.shape[-1]} (outputs {list(out.shape)})"
            )
        check_log_probs(out, dim=-1, log_probs=self.log_probs, task=self.name)

    def sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        out, flat = self.aligned(logits(outputs).float(), targets)
        counted = flat != self.ignore
        tokens = counted.sum()
        if self.from_model:
            loss = self._summed_loss(outputs, tokens.float())
        else:
            loss = self.criterion(out, flat, ignore_index=self.ignore, reduction="sum")
        correct = ((out.argmax(dim=1) == flat) & counted).sum()
        return torch.stack([loss, correct.to(loss.dtype), tokens.to(loss.dtype)])

    def finish(self, totals: list[float]) -> dict[str, float]:
        loss, correct, tokens = totals
        mean = loss / tokens if tokens else math.nan
        return {VAL_LOSS: mean, VAL_PERPLEXITY: math.exp(min(mean, 700.0)), VAL_ACC: correct / tokens}


class Custom:
    """``task=custom``: the user's loss ``(outputs, targets) -> scalar`` (or, ``task.loss=model``, the model's own), and
    metrics that are either callables ``(outputs, targets) -> float`` (averaged over validation batches, weighted by
    their samples) or torchmetrics ``Metric`` objects (``update`` per batch, ``compute`` at the end: torchmetrics
    reduces them across DDP ranks)."""

    name, higher_is_better = "custom", None

    def __init__(self, cfg: TaskConfig) -> None:
        assert cfg.loss is not None  # TaskConfig.check requires it
        self.from_model = cfg.model_loss
        self._loss: Callable[..., torch.Tensor] = model_loss
        if not isinstance(cfg.loss, str):  # the one string task.loss takes is "model" (cfg.model_loss)
            self._loss = _callable(cfg.loss, "task.loss")
        self.metrics = [(val_metric(m.label), _callable(m, f"task.metrics[{i}]")) for i, m in enumerate(cfg.metrics)]
        self.averaged = [(name, fn) for name, fn in self.metrics if not _stateful(fn)]
        self.stateful = [(name, fn) for name, fn in self.metrics if _stateful(fn)]
        self.primary = cfg.primary or VAL_LOSS
        self.metric_names = (VAL_LOSS, *(name for name, _ in self.metrics))
        self.width = 2 + len(self.averaged)

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self._loss(outputs) if self.from_model else self._loss(outputs, targets)

    def weight(self, targets: Any) -> int:
        return count(targets)

    def check_targets(self, targets: Any) -> None:
        pass  # the user's loss decides what it takes

    def check_inputs(self, inputs: Any, targets: Any) -> None:
        pass

    def check_outputs(self, outputs: Any, targets: Any) -> None:
        value = self.loss(outputs, targets)
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
        loss = self.loss(outputs, targets).detach().float().reshape(())
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
        out = {VAL_LOSS: totals[0] / n}
        out.update({name: value / n for (name, _), value in zip(self.averaged, totals[1:-1], strict=True)})
        for name, metric in self.stateful:
            value = metric.compute()
            out[name] = float(value.item() if isinstance(value, torch.Tensor) else value)
        return out


def _callable(cfg: TargetConfig, key: str) -> Any:
    return hook(cfg._target_, cfg.keywords, key=key, partial=cfg._partial_)


def _stateful(metric: Any) -> bool:
    """A torchmetrics-style ``Metric``: it accumulates with ``update`` and answers with ``compute``."""
    return all(callable(getattr(metric, name, None)) for name in ("update", "compute", "reset"))


def _tensor_targets(targets: Any, task: str) -> None:
    if not isinstance(targets, torch.Tensor):
        raise DatasetError(f"the targets are {describe(targets)}: task={task} needs a tensor (task=custom takes any)")


Task = Classification | Regression | Multilabel | NextToken | Custom


def make_task(cfg: TaskConfig) -> Task:
    """The task ``task.name`` names, its metrics made (``task=custom``: the user's targets imported)."""
    own = cfg.model_loss
    if cfg.name == "classification":
        return Classification(cfg.outputs, from_model=own)
    if cfg.name == "regression":
        return Regression(from_model=own)
    if cfg.name == "multilabel":
        return Multilabel(cfg.threshold, from_model=own)
    if cfg.name == "next_token":
        return NextToken(cfg.ignore_index, cfg.outputs, shift=cfg.shift_labels, from_model=own)
    return Custom(cfg)
