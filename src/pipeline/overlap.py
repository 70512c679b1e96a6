"""A DDP step's gradient all-reduce: overlapped with backward once the micro-batch is known.

    torchrun --nproc_per_node=2 -m pipeline device=cpu     # every logged step records time/allreduce_ms

``pipeline.loop.train_epoch`` averages a step's gradients in one of two ways:

- **By hand, while the micro-batch size is being found** (a run's first step, and the replay after an
  out-of-memory shrink): every backward runs under DDP's ``no_sync()`` and ``average_by_hand`` all-reduces the
  gradients after the step's agreement. A rank that runs out of memory has started no collective, so every rank
  can shrink and replay the step.
- **Overlapped, on every later step**: micro-batches 1..k-1 and the last one's forward still run under
  ``no_sync()``; the agreement (out of memory anywhere? a stop?) is issued between that forward and its backward
  and read after it, and ``backward_reduced`` arms DDP's reducer, whose bucketed hooks all-reduce each bucket as
  soon as backward has produced it: communication, the agreement's included, hides behind backward, as in the
  textbook DDP loop. A rank that ran out of memory before that backward backpropagates zeros instead, so every
  rank meets the same collectives; the agreement then discards the step everywhere and the ranks replay it smaller,
  by hand. An error inside that backward can
  no longer be replayed (the other ranks are already in the all-reduce): the failing rank posts what happened to
  the job's key-value store and leaves the process group, so the others' collective fails at once (not at the
  group's 10-minute timeout); each rank raises one ``DistributedError`` naming the rank, the step and the remedy,
  and rank 0 records the run FAILED with it.

Both ways compute the same numbers: DDP multiplies every gradient by 1/world size as it copies it into its bucket,
then sums over ranks; ``average_by_hand`` does the same, over every trainable parameter (zeros where this rank has
no gradient, so that every rank all-reduces the same sizes).

``time/allreduce_ms`` (``CommClock``, rank 0's, per logged step): the all-reduce time backward did not hide, from
the moment backward produced the last bucket's gradients to its return; on a hand-averaged step, the averaging.
A one-process run records none (there is no all-reduce).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.distributed import DistributedError
from pipeline.memory import is_oom

log = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 2**20  # gradients all-reduced per call by hand: DDP's default bucket size
FAILURE_KEY = "pipeline/backward_failure"  # in the job's store: why a rank left in an overlapped backward


class CommClock:
    """The all-reduce time of each step that backward did not hide; read (and reset) at logging points.

    On CUDA the marks are events on the current stream (nothing waits for the device until ``metrics``, which
    runs where the loop syncs anyway); elsewhere wall clocks, since Gloo's all-reduce is waited for on the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.started: Any = None

    def _mark(self) -> Any:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        self.started = self._mark()

    def end(self) -> None:
        if self.started is not None:
            self.spans.append((self.started, self._mark()))
            self.started = None

    def metrics(self) -> dict[str, float]:
        """``time/allreduce_ms``: the mean over the steps since the last call (none: nothing to report)."""
        if not self.spans:
            return {}
        if self.events:
            self.spans[-1][1].synchronize()  # a host sync: logging points only
            total_ms = sum(start.elapsed_time(stop) for start, stop in self.spans)
        else:
            total_ms = 1000.0 * sum(stop - start for start, stop in self.spans)
        count = len(self.spans)
        self.spans.clear()
        return {"time/allreduce_ms": total_ms / count}


@dataclass
class _HookState:
    clock: CommClock
    scale: float  # 1 / world size
    flags: torch.Tensor | None = None  # this step's agreement to send with the first bucket (CPU, Gloo), or None
    answer: torch.Tensor | None = None  # the agreement's sum over ranks, once the first bucket is all-reduced


AGREEMENT = 66  # the flags sent with the first bucket: [failed, then one slot per signal number 0..64]


def pack_agreement(failed: bool, stop: int) -> torch.Tensor:
    """This rank's agreement as counts that summing over ranks keeps apart: failed, and one slot per signal."""
    flags = torch.zeros(AGREEMENT)
    flags[0] = float(failed)
    if stop:
        flags[1 + stop] = 1.0
    return flags


def read_agreement(summed: torch.Tensor) -> tuple[bool, int]:
    """Whether any rank failed, and the highest stop signal any rank received (0 = none), as ``Group.agree``."""
    values = summed.tolist()
    signals = [signum for signum, count in enumerate(values[1:]) if count > 0]
    return values[0] > 0, max(signals, default=0)


def _allreduce_hook(state: _HookState, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
    """DDP's default all-reduce (the same arithmetic: scaled by 1/world, then summed), timed: the last bucket is
    ready when backward has produced every gradient, so the time from here to backward's return is exposed. On the
    CPU the step's agreement travels in the first bucket's all-reduce (one collective fewer per step): DDP caps
    that bucket at 1 MB, so the two copies that packing costs stay small whatever the model."""
    import torch.distributed as dist

    if bucket.is_last():
        state.clock.begin()
    buffer = bucket.buffer().mul_(state.scale)
    if bucket.index() != 0 or state.flags is None:
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])
    size = buffer.numel()
    packed = torch.cat([buffer, state.flags.to(buffer.dtype)])

    def unpack(fut):  # type: ignore[no-untyped-def]
        summed = fut.value()[0]
        state.answer = summed[size:].clone()
        buffer.copy_(summed[:size])
        return buffer

    return dist.all_reduce(packed, async_op=True).get_future().then(unpack)


def wrap(model: nn.Module, *, world_size: int, clock: CommClock) -> nn.Module:
    """DDP around ``model``: gradients are views into its buckets (no second copy of every gradient), buffers are
    not broadcast in forward (a collective a replayed step would unbalance; BatchNorm's running statistics are
    taken from rank 0 before evaluation instead), and its all-reduce is timed (``CommClock``)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    # torch >= 2.13 names the forward pass's sync forward_sync_buffers and warns (once per rank) at the deprecated
    # broadcast_buffers; the new flag still syncs once at the wrap, where every rank is anyway: harmless
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    ddp = DistributedDataParallel(
        model,
        device_ids=ids,
        gradient_as_bucket_view=True,
        **{"forward_sync_buffers" if newer else "broadcast_buffers": False},
    )
    state = _HookState(clock, 1.0 / world_size)
    ddp.register_comm_hook(state, _allreduce_hook)
    ddp.pipeline_hook_state = state  # backward_reduced hands it the step's agreement
    return ddp


def ddp_of(model: nn.Module) -> Any:
    """The DDP wrapper, also under ``torch.compile``'s (None when ``model`` has none)."""
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, DistributedDataParallel) else None


def backward_reduced(
    model: nn.Module,
    loss: torch.Tensor | None,
    *,
    clock: CommClock,
    rank: int,
    step: int,
    micro: int,
    agreement: Any,
) -> tuple[bool, int]:
    """``loss.backward()`` with DDP's all-reduce running alongside, for a last micro-batch whose forward ran under
    ``no_sync()``; returns the step's agreement (any rank failed? the stop signal), taken meanwhile.

    ``agreement`` is ``(failed, stop)`` on the CPU, where it travels with the first bucket's all-reduce, or a
    function that reads an agreement already issued on another group (``Group.agree_async``: CUDA, whose buckets
    live on the device, where reading the flags would wait for the GPU). ``loss`` None: this rank failed the step
    (out of memory before this backward); it backpropagates zeros to every parameter, so that it takes part in the
    same all-reduces as the others, and the agreement then discards the step on every rank.

    Raises:
        DistributedError: this rank ran out of memory in the backward, or another rank failed in its own (every
            rank's process group is left: no rank waits for the others).
    """
    ddp = ddp_of(model)
    state: _HookState = ddp.pipeline_hook_state
    if isinstance(agreement, tuple):
        state.flags, state.answer = pack_agreement(*agreement), None
    # what DDP's own forward does outside no_sync(): count the iteration and expect every gradient's hook
    ddp.reducer.prepare_for_forward()
    ddp.reducer.prepare_for_backward([])
    ddp.require_forward_param_sync = True
    if loss is None:  # one element of each parameter, times zero: every gradient hook fires, little memory is used
        loss = torch.stack([p.reshape(-1)[0] for p in model.parameters() if p.requires_grad]).sum() * 0.0
    try:
        loss.backward()
    except Exception as err:
        failure = _leave(err, rank=rank, step=step, micro=micro)
        if failure is err:
            raise
        raise failure from err
    finally:
        state.flags = None
    clock.end()
    # DDP re-orders its buckets once, after its first synced backward, with a broadcast from rank 0 that it runs at
    # the start of the next forward. A rank that fails a step before its model's forward (the input's
    # preparation ran out of memory) would skip that broadcast while the others wait in it: run it here, where
    # every rank is, right after the backward they all took part in (a no-op from then on).
    ddp.reducer._rebuild_buckets()
    if isinstance(agreement, tuple):
        assert state.answer is not None, "the first bucket carried no agreement"
        return read_agreement(state.answer)
    return agreement()


def _leave(err: Exception, *, rank: int, step: int, micro: int) -> Exception:
    """The error this rank ends with after its overlapped backward broke, once it has left the process group.

    The first rank to fail posts why to the job's store before it leaves, so the others (whose all-reduce fails
    as it leaves) raise the same message instead of "connection closed by peer".
    """
    import torch.distributed as dist

    posted = posted_failure()
    if posted is not None:
        dist.destroy_process_group()
        return posted
    if is_oom(err):
        first = (str(err).splitlines() or [type(err).__name__])[0][:200]
        failure: Exception = DistributedError(
            f"rank {rank} ran out of memory in the backward of step {step} (micro-batch {micro}) while the other "
            f"ranks were all-reducing its gradients, where a step can no longer be replayed smaller, so the job "
            f"stopped ({first}). Use a smaller loader.batch_size, or oom.micro_batch_size smaller than {micro} so "
            f"that the first step finds a micro-batch that fits, or a device with more memory"
        )
    else:
        failure = err
    message = str(failure) if failure is not err else f"rank {rank} failed in the backward of step {step}: {err}"
    dist.distributed_c10d._get_default_store().set(FAILURE_KEY, message)
    log.error("leaving the job: %s", message)
    dist.destroy_process_group()  # the others' all-reduce fails now instead of at the group's timeout
    return failure


def posted_failure() -> DistributedError | None:
    """Why a rank left the job in its overlapped backward, as it posted before leaving (None: no rank did).

    Ask after a collective failed: on NCCL a peer's backward does not wait for the all-reduce, so it meets the
    departed rank only at the next agreement."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()  # torchrun's store: it answers while collectives cannot
    return DistributedError(store.get(FAILURE_KEY).decode()) if store.check([FAILURE_KEY]) else None


def average_by_hand(model: nn.Module, *, world_size: int, clock: CommClock) -> None:
    """Every trainable parameter's gradient averaged over ranks, as DDP's reducer would (see the module)."""
    import torch.distributed as dist

    clock.begin()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # unused on this rank: the others may have one, and every rank sends the same sizes
            p.grad = torch.zeros_like(p)
    scale = 1.0 / world_size
    for bucket in buckets([p.grad for p in params if p.grad is not None]):
        flat = torch.cat([g.reshape(-1) for g in bucket]).mul_(scale)
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    clock.end()


def buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Gradients in groups of one dtype and device, about ``BUCKET_BYTES`` each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device or size >= BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        yield bucket
