"""Surviving out-of-memory: shrink the micro-batch, keep the effective batch.

``is_oom(err)`` (``pipeline.common.device_memory``) is the predicate, one pattern per backend; anything else
passes through untouched. ``MicroBatcher`` owns the current micro-batch size: after an OOM the loop leaves its
``except`` block (so the traceback, and with it the failed step's tensors, can be freed), calls
``recover()``, and replays the same batch in halves, scaling each half's loss by its share of the
batch so the gradients — and so the optimizer's step and learning rate — are those of the whole
batch. The smaller size is kept for the rest of the run. Evaluation has a micro-batcher of its
own, so an out-of-memory error there never shrinks the training micro-batch.

Accumulation gives the whole batch's gradients only for models whose layers treat samples
independently: BatchNorm normalises each micro-batch with its own statistics, so such runs are
tagged (``batchnorm_note``); and since it cannot normalise one sample, such a model's micro-batch
never shrinks below 2 and ``pieces`` makes no micro-batch of one sample. An out-of-memory error the fallback
does not handle (making the model, ``oom.enabled=false``) ends the run as ``OutOfMemory``, one line.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pipeline.common.device_memory import is_oom, nearly_full
from pipeline.common.errors import PipelineError
from pipeline.common.messages import brief

if TYPE_CHECKING:  # the config is read, never imported: building the run hands it in
    from pipeline.config import OomConfig

log = logging.getLogger("pipeline.engine.memory")  # the name its lines have always shown


def memory_at_failure_mb(device: torch.device) -> float:
    """The memory figure an out-of-memory event records, read while the failed step's tensors still exist.

    CUDA: the allocator's peak since the run started or its last out-of-memory event (``reset_peak_memory_stats``
    at start-up and after each event), which includes the failed step's allocations; MPS: memory allocated now;
    elsewhere the process's RSS.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    if device.type == "mps":
        return torch.mps.current_allocated_memory() / 1e6
    import psutil

    return psutil.Process().memory_info().rss / 1e6


class OutOfMemoryAtMinimum(PipelineError):
    """Even the smallest allowed micro-batch does not fit."""


class OutOfMemory(PipelineError):
    """Memory ran out where the micro-batch fallback does not act: making the data or the model, or with
    ``oom.enabled=false``."""


@contextlib.contextmanager
def out_of_memory_is_an_error() -> Iterator[None]:
    """Turn an out-of-memory error that ends a run into ``OutOfMemory``: one line saying what to change, not the
    allocator's traceback. Every other error passes through untouched."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if not isinstance(err, MemoryError) and not is_oom(err):
            raise
        first = brief(err, first_line=True, with_type=False)
        raise OutOfMemory(
            f"out of memory ({first}): use a smaller model, input size (data.image_size), loader.batch_size or "
            f"dataset, oom.enabled=true to shrink the micro-batch, or a machine with more memory"
        ) from err


@dataclass(frozen=True)
class OomFailure:
    """What an out-of-memory error left to know once its traceback (and the step's tensors) are gone."""

    message: str  # the error's first line
    memory_mb: float  # ``memory_at_failure_mb``, read inside the ``except`` block


@dataclass(frozen=True)
class OomEvent:
    step: int  # the global step being attempted (-1: evaluation)
    micro_batch: int  # the size that failed
    memory_mb: float  # see ``memory_at_failure_mb``
    message: str


@dataclass
class MicroBatcher:
    """The micro-batch size and the OOM events that shaped it.

    Args:
        batch_size: the effective batch (what the optimizer sees per step).
        micro_batch: the size to start with (``batch_size`` = no accumulation).
        min_micro_batch: below this, give up.
        enabled: false = every OOM is raised as is.
        on_oom: called at each out-of-memory error, while the failed step's memory is held, whether or not the
            fallback then acts (``trainer.memory_snapshot=on_oom``: ``pipeline.engine.observe.snapshot``); default
            nothing.
    """

    batch_size: int
    micro_batch: int
    min_micro_batch: int = 1
    enabled: bool = True
    events: list[OomEvent] = field(default_factory=list)
    found: bool = False  # a training step has completed at this micro-batch size (DDP may then overlap its all-reduce)
    on_oom: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)

    @classmethod
    def from_config(
        cls, cfg: OomConfig, *, batch_size: int, least: int = 1, on_oom: Callable[[], None] = lambda: None
    ) -> MicroBatcher:
        """``least``: the fewest samples the model can train on (2 with BatchNorm), a floor under
        ``oom.min_micro_batch``."""
        micro, least = cfg.micro_batch_size or batch_size, max(cfg.min_micro_batch, least)
        return cls(batch_size, micro, least, cfg.enabled, on_oom=on_oom)

    def diagnose(self, err: BaseException, device: torch.device) -> OomFailure | None:
        """The failure to recover from, or None when ``err`` must be raised. Call inside the ``except`` block,
        where the failed step's memory is still held, so the figures are those of the failure (and ``on_oom``'s
        snapshot is of it)."""
        if not is_oom(err, nearly_full=nearly_full(device)):
            return None
        self.on_oom()
        if not self.enabled:
            return None
        return OomFailure(brief(err, first_line=True, with_type=False), memory_at_failure_mb(device))

    def recover(
        self,
        failure: OomFailure,
        *,
        step: int,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        device: torch.device,
    ) -> OomEvent:
        """Free the failed attempt's memory and halve the micro-batch. Call outside the ``except`` block.

        Raises:
            OutOfMemoryAtMinimum: the micro-batch is already at ``min_micro_batch``.
        """
        discard_attempt(optimizer=optimizer, scaler=scaler, device=device)
        self.found = False
        memory_mb = failure.memory_mb
        event = OomEvent(step, self.micro_batch, memory_mb, failure.message)
        self.events.append(event)
        if self.micro_batch <= self.min_micro_batch:
            raise OutOfMemoryAtMinimum(
                f"out of memory at step {step} even with a micro-batch of {self.micro_batch} "
                f"(oom.min_micro_batch={self.min_micro_batch}; {memory_mb:,.0f} MB at the failure): use a smaller "
                f"model or input size, amp=true, or a device with more memory. Last error: {event.message}"
            )
        self.micro_batch = max(self.min_micro_batch, self.micro_batch // 2)
        log.warning(
            "out of memory at step %d with micro-batch %d (%.0f MB at the failure): retrying the same batch as "
            "micro-batches of %d, effective batch %d kept",
            step,
            event.micro_batch,
            memory_mb,
            self.micro_batch,
            self.batch_size,
        )
        return event

    def pieces(self, n: int) -> int:
        """How many micro-batches an ``n``-sample batch takes: as few as fit ``micro_batch`` each, split as evenly
        as ``torch.tensor_split`` does (100 at 32 -> 4 of 25, not 32/32/32/4: no small tail that BatchNorm
        normalises on its own and ``torch.compile`` compiles once more).

        A micro-batch of one sample (BatchNorm cannot train on it) is avoided unless micro-batches of one were
        asked for: then there is one micro-batch fewer, each a little over ``micro_batch`` (5 by 2 -> 3 + 2).
        """
        count = -(-n // self.micro_batch)
        if count > 1 and self.micro_batch > 1 and n // count < 2:
            count = max(1, n // 2)
        return count

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each micro-batch of an ``n``-sample batch: the spans ``tensor_split`` cuts into
        ``pieces(n)`` (the larger ones first)."""
        spans = torch.arange(n).tensor_split(self.pieces(n))
        return [(int(span[0]), int(span[-1]) + 1) for span in spans]


def discard_attempt(
    *, optimizer: torch.optim.Optimizer | None, scaler: torch.amp.GradScaler | None, device: torch.device
) -> None:
    """Forget a failed attempt at a step: its partial gradients (training), the scaler's bookkeeping for it, and
    its memory. Call outside the ``except`` block; nothing of the attempt reaches the weights."""
    if optimizer is not None:  # training: drop the failed step's partial gradients
        optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        reset_scaler_step(scaler)
    release_memory(device)
    reset_peak(device)  # the next event's figure is its own, not this one's peak again


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


def reset_peak(device: torch.device) -> None:
    """Start the allocator's peak afresh from what is allocated now (CUDA; elsewhere nothing to reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def has_batchnorm(model: torch.nn.Module) -> bool:
    """Whether ``model`` normalises by batch statistics: then it cannot train on a batch of one sample."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def single_sample_tail(samples: int, *, batch_size: int, world: int = 1) -> bool:
    """Whether each epoch's last training batch holds one sample, on each of ``world`` ranks (the loaders pad
    training so every rank visits ``ceil(samples / world)``), while the batches before it hold more."""
    share = math.ceil(samples / world)
    return batch_size > 1 and share > 1 and share % batch_size == 1


def batchnorm_note(model: torch.nn.Module, micro: MicroBatcher) -> str | None:
    """Why a micro-batched run of a model with BatchNorm is not exactly whole-batch training, or None."""
    if micro.micro_batch >= micro.batch_size:
        return None
    if not has_batchnorm(model):
        return None
    return (
        f"BatchNorm normalised micro-batches of {micro.micro_batch}, not batches of {micro.batch_size}: "
        "its statistics, and so the gradients, differ from whole-batch training"
    )
