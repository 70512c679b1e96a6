"""What the first batch says before any MLflow run is opened: the targets fit the task, the model takes the inputs
and its output fits the loss, ``channels_last`` has 4-D inputs and convolutions to lay out.

    python -m pipeline model=custom model._target_=nets.Tiny data=custom data._target_=sets.make task=regression

One forward of two samples through the run's step, in eval mode and without gradients (no BatchNorm statistics move,
no random number is drawn), on the training device. A mismatch is one line naming both shapes, and the run never
starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.common.device_memory import is_oom
from pipeline.common.errors import ConfigError, PipelineError
from pipeline.common.messages import brief
from pipeline.common.targets import TargetError
from pipeline.common.usercode import site
from pipeline.data.structures import describe, move
from pipeline.engine.hot.hooks import Computed, Step, StepContext, StepHookError, TaskStep
from pipeline.engine.hot.step import Inputs
from pipeline.engine.hot.tasks import OutputMismatch, Task
from pipeline.engine.models import has_convolutions


@dataclass(frozen=True)
class FirstBatch:
    """What the first batch's check found: whether the step returns outputs for the task's metrics, and what the model
    itself was called with (its positional and keyword arguments: the logged model's input example)."""

    outputs: bool
    example: tuple[tuple[Any, ...], dict[str, Any]]


def check_first_batch(
    model: nn.Module,
    task: Task,
    batch: tuple[Any, Any],
    *,
    inputs: Inputs,
    channels_last: bool,
    step: Step | None = None,
) -> FirstBatch:
    """Refuse what the first batch (two samples) shows cannot train. The batch reaches the model as training's do
    (``inputs``: moved to its device and prepared, the forward under its policy's autocast; no augmentation). The step
    (the task's, or the user's hook with a context of its own: nothing it keeps reaches training) runs as training's.

    Raises:
        DatasetError: targets whose dtype or shape the task cannot take (``task.check_targets``).
        ConfigError: ``trainer.channels_last=true`` without 4-D inputs or without convolutions.
        OutputMismatch: the model's forward raised on the inputs, its output does not fit the loss, or the targets
            are the inputs and the task would score them unshifted (``task.shift_labels``).
        StepHookError: the user's step returned no loss tensor, or a loss that is not one number.
    """
    step, device = step or TaskStep(task), inputs.device
    given, targets = batch
    task.check_targets(targets)
    if channels_last:
        check_channels_last(model, given)
    given, targets = move(given, device, non_blocking=False), move(targets, device, non_blocking=False)
    if not step.custom:  # the task computes the loss: its targets must line up with the outputs
        task.check_inputs(given, targets)
    context = StepContext(task.loss, device, model, training=False)
    training = model.training
    model.eval()
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    seen = model.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    try:  # the random stream forked: a step that draws numbers leaves training's stream as it was
        with torch.no_grad(), inputs.policy.autocast(), torch.random.fork_rng(devices=_cuda(device)):
            done = step.compute(model, inputs.prepare(given), targets, context)
    except (PipelineError, TargetError):
        raise
    except Exception as err:
        if is_oom(err):  # two samples do not fit: said as the out-of-memory error it is (memory.OutOfMemory)
            raise
        raise OutputMismatch(
            f"{_what_ran(step)} on the first batch ({describe(given)}) raised {brief(err, first_line=True)}"
            f"{site(err)} (--debug shows the traceback)"
        ) from err
    finally:
        seen.remove()
        model.train(training)
    _check_loss(done, step)
    if done.outputs is not None:
        with torch.no_grad():
            task.check_outputs(done.outputs, done.targets if done.targets is not None else targets)
    return FirstBatch(done.outputs is not None, calls[0] if calls else ((), {}))


def _cuda(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _what_ran(step: Step) -> str:
    return f"the step ({step.label})" if step.custom else "the model's forward"


def _check_loss(done: Computed, step: Step) -> None:
    if done.loss.numel() != 1 or not done.loss.is_floating_point():
        raise StepHookError(
            f"{step.label} gave a loss of {describe(done.loss)}: expected one floating-point number (reduce it, e.g. "
            f"with .mean())"
        )


def check_channels_last(model: nn.Module, inputs: Any) -> None:
    """``channels_last`` lays out 4-D inputs for 2-D convolutions; anything else is refused in one line."""
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
        raise ConfigError(
            "trainer.channels_last",
            True,
            f"false for inputs {describe(inputs)}: channels_last lays out 4-D [N, C, H, W] tensors only",
        )
    if not has_convolutions(model):
        raise ConfigError(
            "trainer.channels_last",
            True,
            f"false for {type(model).__name__}: channels_last lays out convolution inputs, and it has no Conv2d",
        )
