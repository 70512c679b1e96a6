"""What a run needs in memory, estimated before it is allocated, against what is free.

A model or input too large for the machine would otherwise end in the allocator's traceback
(``DefaultCPUAllocator: can't allocate memory``), possibly after minutes of loading. Two checks
run first and refuse in one line that gives the estimate and the free memory:

- the data (``check_data`` in ``pipeline.common.device_memory``, from ``load_data``, before the samples are
  made): the uint8 images of ``data=digits`` and ``data=synthetic``, whose size the config alone decides (the
  published datasets have a fixed, small size, and image folders are decoded as they are read);
- the training state and one micro-batch (``check_training``, from ``build``, before the model is
  made): parameters, gradients and the optimizer's state, counted on PyTorch's meta device (shapes
  only, nothing allocated), and what one forward pass of the smallest micro-batch the out-of-memory
  fallback can reach keeps for the backward pass: its input and the outputs of the layers with
  parameters, found by that pass on the meta device (a few milliseconds).

Both are floors, not forecasts: a run refused here could not have fitted; one that passes may still
run out (then the fallback shrinks the micro-batch, and an error it cannot help is ``OutOfMemory``,
one line as well, see ``pipeline.engine.hot.memory``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.common.device_memory import FLOAT32, DoesNotFit, free_memory, size
from pipeline.common.messages import brief
from pipeline.config import RunConfig
from pipeline.data import structures
from pipeline.data.structures import call_model
from pipeline.engine.models import attributes_now, build_model

log = logging.getLogger("pipeline.engine.footprint")  # the name its lines have always shown

HALF = 2  # bytes: activations under amp (float16 or bfloat16)


@dataclass(frozen=True)
class Estimate:
    """What training needs on the device at the least: the model's state and one micro-batch."""

    parameters: int
    state_bytes: int  # parameters, gradients, optimizer state
    batch_bytes: int  # the micro-batch's input and the activations kept for backward
    samples: int  # the micro-batch's size

    @property
    def total(self) -> int:
        return self.state_bytes + self.batch_bytes


def estimate(
    cfg: RunConfig,
    *,
    in_shape: tuple[int, ...] | None,
    num_classes: int | None,
    samples: int,
    model: torch.nn.Module | None = None,
    example: Any = None,
    batch_dim: int = 0,
) -> Estimate:
    """The training state and a ``samples``-sample micro-batch of ``cfg``'s model, measured on the meta device
    (nothing is allocated, whatever the sizes). Without ``model``, the pipeline's own factory makes it there, for float
    inputs of ``in_shape``; a user's model, made already, runs on meta copies of its tensors
    (``torch.func.functional_call``) and of ``example``, its first batch's inputs (their dtypes, their structure;
    ``batch_dim`` the samples' dimension), and is left exactly as it was: every attribute its forward set (a cached
    mask, a rotary table) is put back. A forward that cannot run on meta tensors (it reads values, it takes more than
    the batch) counts the state alone, with one warning."""
    if model is None:
        with torch.device("meta"):
            model = build_model(cfg.model, in_shape=in_shape, num_classes=num_classes)
    if example is None and in_shape is not None:  # a tensor input of that shape, in float32
        example = torch.empty(samples, *in_shape, device="meta")
    parameters = sum(p.numel() for p in model.parameters())
    per_value = HALF if cfg.amp else FLOAT32
    state_bytes = parameters * FLOAT32 * (2 + _moments(cfg))
    if example is None:
        return Estimate(parameters, state_bytes, 0, samples)
    inputs = structures.apply(example, lambda t: _meta(t, samples, batch_dim))
    kept = [sum(t.numel() for t in structures.leaves(inputs))]
    try:
        kept += _activations(model, inputs)
    except Exception as err:  # an op without a meta kernel, a forward that reads values or takes more arguments
        log.warning(
            "the memory estimate could not run %s on meta tensors (%s): it counts the parameters, gradients and "
            "optimizer state only",
            cfg.model.label,
            brief(err, first_line=True),
        )
    return Estimate(parameters, state_bytes, sum(kept) * per_value, samples)


def _meta(tensor: torch.Tensor, samples: int, batch_dim: int) -> torch.Tensor:
    """A meta tensor of ``tensor``'s dtype and shape, with ``samples`` along ``batch_dim``."""
    shape = list(tensor.shape)
    if len(shape) > batch_dim:
        shape[batch_dim] = samples
    return torch.empty(shape, dtype=tensor.dtype, device="meta")


def _activations(model: torch.nn.Module, inputs: Any) -> list[int]:
    """The sizes of the outputs of the layers with parameters in one meta forward, in eval mode (one sample:
    BatchNorm); the model's mode and every attribute of every module are put back afterwards."""
    kept: list[int] = []

    def keep(module: torch.nn.Module, args: object, output: object) -> None:
        if isinstance(output, torch.Tensor):
            kept.append(output.numel())

    weighted = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    saved = [attributes_now(m) for m in model.modules()]  # a forward may cache tensors in plain attributes
    training = model.training
    handles = [m.register_forward_hook(keep) for m in weighted]
    try:
        model.eval()
        _meta_forward(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
        for restore in saved:
            restore()
        model.train(training)
    return kept


def _meta_forward(model: torch.nn.Module, inputs: Any) -> None:
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if all(t.is_meta for t in tensors.values()):
        call_model(model, inputs)
        return
    meta = {name: torch.empty_like(t, device="meta") for name, t in tensors.items()}
    if isinstance(inputs, Mapping):
        torch.func.functional_call(model, meta, (), dict(inputs))
    else:
        torch.func.functional_call(model, meta, (inputs,))


def _moments(cfg: RunConfig) -> int:
    """Tensors the optimizer keeps per parameter: Adam's two moments, SGD's momentum (others: none counted, a
    floor)."""
    target = cfg.optimizer._target_.rsplit(".", 1)[-1].lower()
    if target.startswith("adam"):
        return 2
    return 1 if target == "sgd" and cfg.optimizer.keywords.get("momentum") else 0


def check_training(
    cfg: RunConfig,
    *,
    in_shape: tuple[int, ...] | None,
    num_classes: int | None,
    device: torch.device,
    model: torch.nn.Module | None = None,
    example: Any = None,
) -> None:
    """Refuse a model whose training state and smallest micro-batch (``oom.min_micro_batch`` samples: the least the
    out-of-memory fallback can shrink to) exceed the memory free on ``device``. ``example``: a user's model's first
    inputs (``estimate``).

    Raises:
        DoesNotFit: with the estimate, its parts, the free memory and what to change.
    """
    need = estimate(
        cfg,
        in_shape=in_shape,
        num_classes=num_classes,
        samples=cfg.oom.min_micro_batch,
        model=model,
        example=example,
        batch_dim=cfg.data.batch_dim,
    )
    free = free_memory(device)
    if need.total <= free.bytes:
        return
    shape = f" on {'x'.join(map(str, in_shape))} inputs" if in_shape is not None else ""
    sizes = f" model.hidden_sizes={cfg.model.keywords['hidden_sizes']}" if "hidden_sizes" in cfg.model.keywords else ""
    raise DoesNotFit(
        f"model={cfg.model.label}{sizes}{shape} needs at least {size(need.total)} to train "
        f"({size(need.state_bytes)} for {need.parameters:,} parameters, their gradients and the optimizer's state; "
        f"{size(need.batch_bytes)} for a micro-batch of {need.samples}), but the {free.where} is "
        f"{size(free.bytes)}: use a smaller model or input size (data.image_size), or a machine with more memory"
    )
