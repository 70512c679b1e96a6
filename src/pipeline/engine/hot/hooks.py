"""How a batch becomes a loss: the task's own step (``step=default``), or the user's (``step=custom``).

    python -m pipeline step=custom step._target_=lm.tbptt task=next_token task.outputs=log_probs

The user's step is ``fn(model, batch, ctx)``: ``batch`` is ``(inputs, targets)`` as the loader gives them (built-in
images already normalised), and it returns the loss tensor, or a dict with ``loss`` and, optionally, ``outputs`` and
``targets``, which the task's metrics read in evaluation. Everything around it stays the pipeline's: autocast, the
scaled backward, micro-batches and the out-of-memory fallback, DDP, unscaling and clipping, the optimizer and the
schedule, the step-time split, FLOPs (counted on its forward at start-up), checkpoints and the record. The same
function evaluates, under ``torch.no_grad()`` and ``model.eval()``, with ``ctx.training`` false.

``ctx`` (``StepContext``) carries the task's loss function, the epoch, the optimizer steps done, the device, the model
without DDP's wrapper (``ctx.module``, for its methods other than ``forward``) and ``ctx.state``: a dict the pipeline
keeps for the step from one batch to the next (a recurrent model's hidden state). Training's is emptied at each
epoch start and evaluation's before each evaluation; its tensors are detached after every optimizer step, so a graph
never spans two steps; training's goes into checkpoints, so a resumed run continues with it. The out-of-memory
fallback cannot cut a state it knows nothing of with the batch: a step that carries state and would be split is
refused in one line naming ``loader.batch_size``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeline.common.errors import PipelineError
from pipeline.common.targets import hook
from pipeline.data.structures import call_model, describe, detached, leaves
from pipeline.engine.hot.tasks import Task

if TYPE_CHECKING:  # the config is read, never imported: building the run hands it in
    from pipeline.config import StepConfig


class StepHookError(PipelineError):
    """The user's step returned something the pipeline cannot train on, or cannot be split as asked."""


@dataclass(eq=False)
class StepContext:
    """What a step gets besides the model and the batch (see the module's docstring)."""

    loss: Callable[[Any, Any], torch.Tensor]  # the task's loss: (outputs, targets) -> a scalar tensor
    device: torch.device
    module: nn.Module  # the model itself, without DDP's wrapper
    training: bool = True
    epoch: int = 1
    step: int = 0  # optimizer steps done before this batch
    state: dict[str, Any] = field(default_factory=dict)

    def begin(self, epoch: int, *, keep: bool = False) -> None:
        """A new epoch (or evaluation pass): its number, and an empty state unless ``keep`` (a resume mid-epoch)."""
        self.epoch = epoch
        if not keep:
            self.state.clear()


@dataclass(frozen=True)
class Computed:
    """A step's loss and, where known, what it scored: the outputs and targets the task's metrics read."""

    loss: torch.Tensor
    outputs: Any = None
    targets: Any = None


class TaskStep:
    """``step=default``: the task's loss of ``model(inputs)``; under ``task.loss=model`` the model is also given
    ``labels=targets`` where its forward takes them (a Hugging Face model then returns its own ``loss``)."""

    custom = False
    label = "step=default"

    def __init__(self, task: Task) -> None:
        self.task = task
        self.labels: bool | None = None if task.from_model else False  # known at the first call, from the model

    def loss(self, model: Any, inputs: Any, targets: Any, ctx: StepContext) -> torch.Tensor:
        return self.task.loss(self._forward(model, inputs, targets), targets)

    def compute(self, model: Any, inputs: Any, targets: Any, ctx: StepContext) -> Computed:
        outputs = self._forward(model, inputs, targets)
        return Computed(self.task.loss(outputs, targets), outputs, targets)

    def _forward(self, model: Any, inputs: Any, targets: Any) -> Any:
        if self.labels is None:
            self.labels = takes_labels(model)
        return call_model(model, inputs, labels=targets) if self.labels else call_model(model, inputs)

    def after_step(self, ctx: StepContext) -> None:
        pass  # no state

    def check_split(self, ctx: StepContext) -> None:
        pass  # every batch stands alone


class HookStep:
    """``step=custom``: the user's ``fn(model, batch, ctx)``."""

    custom = True

    def __init__(self, fn: Callable[..., Any], *, label: str) -> None:
        self.fn, self.label = fn, label

    def loss(self, model: Any, inputs: Any, targets: Any, ctx: StepContext) -> torch.Tensor:
        return self.compute(model, inputs, targets, ctx).loss

    def compute(self, model: Any, inputs: Any, targets: Any, ctx: StepContext) -> Computed:
        return self.computed(self.fn(model, (inputs, targets), ctx))

    def computed(self, made: Any) -> Computed:
        """What the step returned, as a ``Computed``.

        Raises:
            StepHookError: neither a tensor nor a dict with a ``loss`` tensor.
        """
        if isinstance(made, torch.Tensor):
            return Computed(made)
        if isinstance(made, Mapping) and isinstance(made.get("loss"), torch.Tensor):
            return Computed(made["loss"], made.get("outputs"), made.get("targets"))
        raise StepHookError(
            f"{self.label} returned {describe(made)}: expected the loss tensor, or a dict with 'loss' (and optionally "
            f"'outputs' and 'targets', for the task's metrics)"
        )

    def after_step(self, ctx: StepContext) -> None:
        """The state's tensors detached: the next step's graph starts here (a hidden state's history is cut)."""
        if ctx.state:
            ctx.state.update({key: detached(value) for key, value in ctx.state.items()})

    def check_split(self, ctx: StepContext) -> None:
        """Refuse to cut a batch into micro-batches while the step carries state across batches.

        Raises:
            StepHookError: naming the state and ``loader.batch_size``.
        """
        carried = [key for key, value in ctx.state.items() if leaves(value)]
        if carried:
            raise StepHookError(
                f"{self.label} carries state across batches (ctx.state holds {', '.join(map(repr, carried))}), and the "
                f"out-of-memory fallback cannot cut that state with the batch: use a smaller loader.batch_size (or "
                f"oom.micro_batch_size=null)"
            )


def takes_labels(model: Any) -> bool:
    """Whether ``model``'s forward takes ``labels`` (by name, or any keyword)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


Step = TaskStep | HookStep


def make_step(cfg: StepConfig, task: Task) -> Step:
    """The step ``step._target_`` names (imported now: a path that does not import fails before any run opens), or
    the task's."""
    if cfg._target_ is None:
        return TaskStep(task)
    fn = hook(cfg._target_, cfg.keywords, key="step")
    return HookStep(fn, label=f"step._target_={cfg._target_}")
