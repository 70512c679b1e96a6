"""A device's memory as every layer reads it: whether an error means it ran out (``is_oom``, one pattern per
backend), how much is free (``free_memory``), and the one-line refusal of what would not fit (``DoesNotFit``,
``check_data``).

Pure helpers over torch and psutil, with no policy: what to do about an out-of-memory error is the engine's
(``pipeline.engine.hot.memory``), what a run needs is estimated in ``pipeline.engine.building.footprint``, what the data
needs in ``pipeline.data``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.common.errors import PipelineError

FLOAT32 = 4  # bytes: parameters, gradients, optimizer state, activations without amp

OOM_PATTERNS = (
    "CUDA out of memory",  # the caching allocator (torch.OutOfMemoryError's message)
    "CUDA error: out of memory",  # a kernel launch or context allocation
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN's own allocation
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS handle or workspace
    "MPS backend out of memory",  # Apple MPS
    "DefaultCPUAllocator: can't allocate memory",  # the CPU allocator
)
# Out of memory only when the device is nearly full: cuDNN also says NOT_SUPPORTED when no algorithm's
# workspace fits, but more often for a layout or dtype it has no kernel for, where a retry cannot help.
AMBIGUOUS_PATTERNS = ("CUDNN_STATUS_NOT_SUPPORTED",)
NEARLY_FULL = 0.10  # less than this share of the device's memory free (as the driver counts it)


def is_oom(err: BaseException, *, nearly_full: bool = False) -> bool:
    """Whether ``err`` means the device ran out of memory (and a smaller micro-batch may fit).

    Args:
        err: the exception raised by a training or evaluation step.
        nearly_full: the device had little memory free when it was raised (see ``nearly_full``);
            the evidence that turns an ambiguous cuDNN error into an out-of-memory one.
    """
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err)
    return any(p in text for p in OOM_PATTERNS) or (nearly_full and any(p in text for p in AMBIGUOUS_PATTERNS))


def nearly_full(device: torch.device) -> bool:
    """Whether less than ``NEARLY_FULL`` of the CUDA device's memory is free (False elsewhere)."""
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    return free < NEARLY_FULL * total


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
