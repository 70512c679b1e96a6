"""What a run needs in memory, estimated before it is allocated, against what is free.

A model or input too large for the machine would otherwise end in the allocator's traceback
(``DefaultCPUAllocator: can't allocate memory``), possibly after minutes of loading. Two checks
run first and refuse in one line that gives the estimate and the free memory:

- the data (``check_data``, from ``load_data``, before the samples are made): the uint8 images of
  ``data=digits`` and ``data=synthetic``, whose size the config alone decides (the published datasets
  have a fixed, small size, and image folders are decoded as they are read);
- the training state and one micro-batch (``check_training``, from ``build``, before the model is
  made): parameters, gradients and the optimizer's state, counted on PyTorch's meta device (shapes
  only, nothing allocated), and what one forward pass of the smallest micro-batch the out-of-memory
  fallback can reach keeps for the backward pass: its input and the outputs of the layers with
  parameters, found by that pass on the meta device (a few milliseconds).

Both are floors, not forecasts: a run refused here could not have fitted; one that passes may still
run out (then the fallback shrinks the micro-batch, and an error it cannot help is ``OutOfMemory``,
one line as well, see ``pipeline.engine.memory``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.common.errors import PipelineError
from pipeline.config import RunConfig

FLOAT32 = 4  # bytes: parameters, gradients, optimizer state, activations without amp
HALF = 2  # bytes: activations under amp (float16 or bfloat16)


class DoesNotFit(PipelineError):
    """The estimate of what a run needs exceeds the memory free where it would live."""


@dataclass(frozen=True)
class Free:
    """Memory free where a run's tensors would live, and how that was read."""

    bytes: int
    where: str  # "available host memory", "free on cuda:0"


def free_memory(device: torch.device) -> Free:
    """The CUDA device's free memory (as the driver counts it), else the host's available memory (Linux's
    ``MemAvailable``, through psutil; MPS shares it)."""
    if device.type == "cuda":
        return Free(torch.cuda.mem_get_info(device)[0], f"free on {device}")
    import psutil

    return Free(psutil.virtual_memory().available, "available host memory")


def size(n: float) -> str:
    """Bytes for people: ``1.2 GB``, ``340 MB``, ``1,234,567.9 GB``."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"


def check_data(what: str, needs: int, fix: str) -> None:
    """Refuse data that would take ``needs`` bytes of host memory when less is available.

    Args:
        what: the data, as the config names it (``data=synthetic with 1,001,000,000 samples of [1, 28, 28]``).
        needs: bytes the samples take while they are made.
        fix: the keys to change.

    Raises:
        DoesNotFit: with the estimate, the free memory and ``fix``.
    """
    free = free_memory(torch.device("cpu"))
    if needs > free.bytes:
        raise DoesNotFit(f"{what} needs at least {size(needs)}, but the {free.where} is {size(free.bytes)}: {fix}")


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


def estimate(cfg: RunConfig, *, in_shape: tuple[int, int, int], num_classes: int, samples: int) -> Estimate:
    """The training state and a ``samples``-sample micro-batch of ``cfg``'s model on ``in_shape`` inputs, measured on
    the meta device (nothing is allocated, whatever the sizes)."""
    from pipeline.engine.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model, in_shape=in_shape, num_classes=num_classes).eval()  # 1 sample: BN
    parameters = sum(p.numel() for p in model.parameters())
    t = cfg.trainer
    moments = 2 if t.optimizer == "adamw" else 1 if t.momentum else 0  # AdamW's two moments, SGD's momentum
    kept = [samples * math.prod(in_shape)]

    def keep(module: torch.nn.Module, inputs: object, output: object) -> None:
        if isinstance(output, torch.Tensor):
            kept.append(output.numel())

    weighted = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    handles = [m.register_forward_hook(keep) for m in weighted]
    try:
        model(torch.empty(samples, *in_shape, device="meta"))
    except (RuntimeError, ValueError):  # an input too small for the model: the real run says so, in its own words
        kept = kept[:1]
    finally:
        for handle in handles:
            handle.remove()
    per_value = HALF if cfg.amp else FLOAT32
    return Estimate(parameters, parameters * FLOAT32 * (2 + moments), sum(kept) * per_value, samples)


def check_training(cfg: RunConfig, *, in_shape: tuple[int, int, int], num_classes: int, device: torch.device) -> None:
    """Refuse a model whose training state and smallest micro-batch (``oom.min_micro_batch`` samples: the least the
    out-of-memory fallback can shrink to) exceed the memory free on ``device``.

    Raises:
        DoesNotFit: with the estimate, its parts, the free memory and what to change.
    """
    need = estimate(cfg, in_shape=in_shape, num_classes=num_classes, samples=cfg.oom.min_micro_batch)
    free = free_memory(device)
    if need.total <= free.bytes:
        return
    shape = "x".join(map(str, in_shape))
    sizes = f" model.hidden_sizes={cfg.model.hidden_sizes}" if cfg.model.hidden_sizes else ""
    raise DoesNotFit(
        f"model={cfg.model.name}{sizes} on {shape} inputs needs at least {size(need.total)} to train "
        f"({size(need.state_bytes)} for {need.parameters:,} parameters, their gradients and the optimizer's state; "
        f"{size(need.batch_bytes)} for a micro-batch of {need.samples}), but the {free.where} is "
        f"{size(free.bytes)}: use a smaller model or input size (data.image_size), or a machine with more memory"
    )
