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
one line as well, see ``pipeline.engine.memory``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.common.device_memory import FLOAT32, DoesNotFit, free_memory, size
from pipeline.config import RunConfig
from pipeline.engine.models import build_model

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
) -> Estimate:
    """The training state and a ``samples``-sample micro-batch of ``cfg``'s model on ``in_shape`` inputs, measured on
    the meta device (nothing is allocated, whatever the sizes). Without ``model``, the pipeline's own factory makes
    it there; a user's model, made already, runs on meta copies of its tensors (``torch.func.functional_call``).
    Inputs that are no single tensor (``in_shape`` None) count the state alone."""
    if model is None:
        with torch.device("meta"):
            model = build_model(cfg.model, in_shape=in_shape, num_classes=num_classes)
    training = model.training
    model.eval()  # 1 sample: BatchNorm
    parameters = sum(p.numel() for p in model.parameters())
    kept = [samples * math.prod(in_shape)] if in_shape is not None else [0]

    def keep(module: torch.nn.Module, inputs: object, output: object) -> None:
        if isinstance(output, torch.Tensor):
            kept.append(output.numel())

    weighted = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    handles = [m.register_forward_hook(keep) for m in weighted] if in_shape is not None else []
    try:
        if in_shape is not None:
            _meta_forward(model, torch.empty(samples, *in_shape, device="meta"))
    except Exception:  # too small an input, an op without a meta kernel, a user's forward that reads values: a
        kept = kept[:1]  # floor needs no activations, and the real run says what went wrong in its own words
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    per_value = HALF if cfg.amp else FLOAT32
    return Estimate(parameters, parameters * FLOAT32 * (2 + _moments(cfg)), sum(kept) * per_value, samples)


def _meta_forward(model: torch.nn.Module, inputs: torch.Tensor) -> None:
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if all(t.is_meta for t in tensors.values()):
        model(inputs)
        return
    meta = {name: torch.empty_like(t, device="meta") for name, t in tensors.items()}
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
) -> None:
    """Refuse a model whose training state and smallest micro-batch (``oom.min_micro_batch`` samples: the least the
    out-of-memory fallback can shrink to) exceed the memory free on ``device``.

    Raises:
        DoesNotFit: with the estimate, its parts, the free memory and what to change.
    """
    need = estimate(cfg, in_shape=in_shape, num_classes=num_classes, samples=cfg.oom.min_micro_batch, model=model)
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
