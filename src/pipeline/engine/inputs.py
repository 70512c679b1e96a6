"""What the first batch says before any MLflow run is opened: the targets fit the task, the model takes the inputs
and its output fits the loss, ``channels_last`` has 4-D inputs and convolutions to lay out.

    python -m pipeline model=custom model._target_=nets.Tiny data=custom data._target_=sets.make task=regression

One forward of two samples, in eval mode and without gradients (no BatchNorm statistics move, no random number is
drawn), on the training device. A mismatch is one line naming both shapes, and the run never starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.common.device_memory import is_oom
from pipeline.common.errors import ConfigError
from pipeline.common.messages import brief
from pipeline.data.structures import call_model, describe, move
from pipeline.engine.models import has_convolutions
from pipeline.engine.tasks import OutputMismatch, Task


def check_first_batch(
    model: nn.Module,
    task: Task,
    batch: tuple[Any, Any],
    *,
    prepare: Callable[[Any], Any],
    device: torch.device,
    channels_last: bool,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> None:
    """Refuse what the first batch (two samples) shows cannot train. The forward runs under the run's ``autocast``,
    as training's.

    Raises:
        DatasetError: targets whose dtype or shape the task cannot take (``task.check_targets``).
        ConfigError: ``trainer.channels_last=true`` without 4-D inputs or without convolutions.
        OutputMismatch: the model's forward raised on the inputs, or its output does not fit the loss.
    """
    inputs, targets = batch
    task.check_targets(targets)
    if channels_last:
        check_channels_last(model, inputs)
    inputs, targets = move(inputs, device, non_blocking=False), move(targets, device, non_blocking=False)
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            outputs = call_model(model, prepare(inputs))
    except Exception as err:
        if is_oom(err):  # two samples do not fit: said as the out-of-memory error it is (memory.OutOfMemory)
            raise
        raise OutputMismatch(
            f"the model's forward on the first batch ({describe(inputs)}) raised {brief(err, first_line=True)} "
            f"(--debug shows the traceback)"
        ) from err
    finally:
        model.train(training)
    with torch.no_grad():
        task.check_outputs(outputs, targets)


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
