"""Surviving out-of-memory: shrink the micro-batch, keep the effective batch.

``is_oom(err)`` is the predicate, one pattern per backend; anything else passes through
untouched. ``MicroBatcher`` owns the current micro-batch size: after an OOM the loop leaves its
``except`` block (so the traceback, and with it the failed step's tensors, can be freed), calls
``recover()``, and replays the same batch in halves, scaling each half's loss by its share of the
batch so the gradients — and so the optimizer's step and learning rate — are those of the whole
batch. The smaller size is kept for the rest of the run.
"""

from __future__ import annotations

import gc
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

OOM_PATTERNS = (
    "CUDA out of memory",  # the caching allocator (torch.OutOfMemoryError's message)
    "CUDA error: out of memory",  # a kernel launch or context allocation
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN found no algorithm whose workspace fits: OOM in disguise
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN's own allocation
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS handle or workspace
    "MPS backend out of memory",  # Apple MPS
    "DefaultCPUAllocator: can't allocate memory",  # the CPU allocator
)


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` means the device ran out of memory (and a smaller micro-batch may fit)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(pattern in str(err) for pattern in OOM_PATTERNS)


class OutOfMemoryAtMinimum(PipelineError):
    """Even the smallest allowed micro-batch does not fit."""


@dataclass(frozen=True)
class OomEvent:
    step: int  # the global step being attempted
    micro_batch: int  # the size that failed
    memory_mb: float  # memory in use when it failed (device allocator on CUDA, process RSS elsewhere)
    message: str


@dataclass
class MicroBatcher:
    """The micro-batch size and the OOM events that shaped it.

    Args:
        batch_size: the effective batch (what the optimizer sees per step).
        micro_batch: the size to start with (``batch_size`` = no accumulation).
        min_micro_batch: below this, give up.
        enabled: false = every OOM is raised as is.
    """

    batch_size: int
    micro_batch: int
    min_micro_batch: int = 1
    enabled: bool = True
    events: list[OomEvent] = field(default_factory=list)

    def should_retry(self, err: BaseException) -> bool:
        return self.enabled and is_oom(err)

    def recover(
        self,
        *,
        step: int,
        message: str,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        device: torch.device,
    ) -> OomEvent:
        """Free the failed attempt's memory and halve the micro-batch. Call outside the ``except`` block.

        Raises:
            OutOfMemoryAtMinimum: the micro-batch is already at ``min_micro_batch``.
        """
        if optimizer is not None:  # training: drop the failed step's partial gradients
            optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            reset_scaler_step(scaler)
        memory_mb = memory_in_use_mb(device)
        release_memory(device)
        event = OomEvent(step, self.micro_batch, memory_mb, message.splitlines()[0][:300])
        self.events.append(event)
        if self.micro_batch <= self.min_micro_batch:
            raise OutOfMemoryAtMinimum(
                f"out of memory at step {step} even with a micro-batch of {self.micro_batch} "
                f"(oom.min_micro_batch={self.min_micro_batch}; {memory_mb:,.0f} MB in use): use a smaller model "
                f"or input size, amp=true, or a device with more memory. Last error: {event.message}"
            )
        self.micro_batch = max(self.min_micro_batch, self.micro_batch // 2)
        log.warning(
            "out of memory at step %d with micro-batch %d (%.0f MB in use): retrying the same batch as "
            "micro-batches of %d, effective batch %d kept",
            step,
            event.micro_batch,
            memory_mb,
            self.micro_batch,
            self.batch_size,
        )
        return event

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each micro-batch of an ``n``-sample batch."""
        return [(start, min(start + self.micro_batch, n)) for start in range(0, n, self.micro_batch)]


def reset_scaler_step(scaler: torch.amp.GradScaler) -> None:
    """Forget a failed step's unscale/step bookkeeping so the replay starts clean (scale kept)."""
    if scaler.is_enabled():
        scaler._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)


def release_memory(device: torch.device) -> None:
    """Collect reference cycles and hand cached blocks back, so the retry starts from free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def memory_in_use_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 1e6
    import psutil

    return psutil.Process().memory_info().rss / 1e6
