"""A DDP step's gradient all-reduce: overlapped with backward once the micro-batch is known.

    torchrun --nproc_per_node=2 -m pipeline device=cpu     # each logging interval records time/allreduce_ms

``pipeline.engine.hot.step.run_step`` averages a step's gradients in one of two ways:

- **By hand, while the micro-batch size is being found** (a run's first step, and the replay after an
  out-of-memory shrink): every backward runs under DDP's ``no_sync()`` and ``average_by_hand`` all-reduces the
  gradients after the step's agreement. A rank that runs out of memory has started no collective, so every rank
  can shrink and replay the step.
- **Overlapped, on every later step**: micro-batches 1..k-1 and the last one's forward still run under
  ``no_sync()``; then ``backward_reduced`` arms DDP's reducer and runs the last backward, whose bucketed hooks
  all-reduce each bucket (DDP's own C++ all-reduce) as soon as backward has produced it: communication hides behind
  backward, as in the textbook DDP loop. The step's agreement (out of memory anywhere? a stop?) rides along: on the
  CPU as the gradient of one more parameter (``Agreeing``), all-reduced with the others; on CUDA as a small
  collective on the Gloo group, issued before that backward and read after it. A rank that ran out of memory
  before that backward backpropagates zeros instead, so every rank meets the same collectives; the agreement then
  discards the step everywhere and the ranks replay it smaller, by hand. An error inside that backward can no
  longer be replayed (the other ranks are already in the all-reduce): the failing rank posts what happened to the
  job's key-value store and leaves the process group, so the others' collective fails at once (not at the group's
  10-minute timeout); each rank raises one ``DistributedError`` naming the rank, the step and the remedy, and
  rank 0 records the run FAILED with it.

Both ways compute the same numbers: DDP divides every gradient by the world size and sums over ranks;
``average_by_hand`` does the same, over every trainable parameter (zeros where this rank has no gradient, so that
every rank all-reduces the same sizes).

``time/allreduce_ms`` (``CommClock``, rank 0's): the all-reduce time backward did not hide, from the moment
backward produced the last gradient to its return, on the first step of each logging interval (measuring every
step would cost a Python call per parameter per step); on a hand-averaged step, the averaging. A one-process run
records none (there is no all-reduce).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pipeline.common.device_memory import is_oom
from pipeline.common.messages import brief
from pipeline.common.metric_names import TIME_ALLREDUCE_MS
from pipeline.parallel.ranks import DistributedError

log = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 2**20  # gradients all-reduced per call by hand: DDP's default bucket size
FAILURE_KEY = "pipeline/backward_failure"  # in the job's store: why a rank left in an overlapped backward


class CommClock:
    """The all-reduce time that backward did not hide, on one step per logging interval; read at logging points.

    The clock is armed until it has measured a step, and ``metrics`` arms it again: between logging points every
    other step runs with no hook and no mark. On CUDA the marks are events on the current stream (nothing waits for
    the device until ``metrics``, which runs where the loop syncs anyway); elsewhere wall clocks, since Gloo's
    all-reduce is waited for on the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.started: Any = None
        self.armed = True

    def _mark(self) -> Any:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        if self.armed:
            self.started = self._mark()

    def watch(self, params: list[torch.Tensor]) -> Any:
        """On an armed step, a hook that calls ``begin`` once backward has produced the gradients of all of
        ``params`` (DDP's last bucket is then all-reducing); remove it after the backward. None when not armed."""
        if not self.armed:
            return None
        from torch.autograd.graph import register_multi_grad_hook

        return register_multi_grad_hook(params, lambda grads: self.begin(), mode="all")

    def end(self) -> None:
        if self.started is not None:
            self.spans.append((self.started, self._mark()))
            self.started, self.armed = None, False

    def metrics(self) -> dict[str, float]:
        """``time/allreduce_ms`` of the step measured since the last call (none: nothing to report); re-arms."""
        self.armed = True
        if not self.spans:
            return {}
        if self.events:
            self.spans[-1][1].synchronize()  # a host sync: logging points only
            total_ms = sum(start.elapsed_time(stop) for start, stop in self.spans)
        else:
            total_ms = 1000.0 * sum(stop - start for start, stop in self.spans)
        count = len(self.spans)
        self.spans.clear()
        return {TIME_ALLREDUCE_MS: total_ms / count}


AGREEMENT = 66  # the agreement's flags: [failed, then one slot per signal number 0..64]
CARRY = 64  # then room for a logging interval's losses, averaged over ranks with the logging step's gradients
SLOTS = AGREEMENT + CARRY

_NOTHING = torch.zeros(SLOTS)  # the usual step's flags (never written: backward only reads them)


def pack_agreement(failed: bool, stop: int, carry: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's agreement as counts that summing over ranks keeps apart: failed, and one slot per signal; then
    ``carry`` (at most ``CARRY`` values, e.g. the losses since the last logging point), summed over ranks too."""
    if not failed and not stop and carry is None:
        return _NOTHING
    flags = torch.zeros(SLOTS)
    flags[0] = float(failed)
    if stop:
        flags[1 + stop] = 1.0
    if carry is not None:
        flags[AGREEMENT : AGREEMENT + len(carry)] = carry
    return flags


def read_agreement(summed: torch.Tensor) -> tuple[bool, int]:
    """Whether any rank failed, and the highest stop signal any rank received (0 = none), as ``Group.agree``."""
    values = summed[:AGREEMENT].tolist()
    if not any(values):
        return False, 0
    signals = [signum for signum, count in enumerate(values[1:]) if count > 0]
    return values[0] > 0, max(signals, default=0)


class Agreeing(nn.Module):
    """What DDP wraps: the model, and the step's agreement as one more parameter that no optimizer trains.

    On the CPU an overlapped backward starts from two roots, the loss and this parameter with the flags as its
    gradient; DDP all-reduces that gradient in its first bucket with the model's: the agreement costs no collective,
    no op and no copy of its own (a separate all-reduce, or flags appended to a bucket by a comm hook, each cost
    about 8% of a small MLP's step on 2 CPU ranks; see docs/benchmarks-history.md). On a logging step the interval's
    losses ride along too (a blocking all-reduce of them every 10 steps cost about 2.5%).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        device = next(model.parameters()).device
        self.agreement = nn.Parameter(torch.zeros(SLOTS, device=device))
        self.no_flags = torch.zeros(SLOTS, device=device)  # its gradient on CUDA (not a buffer: never saved)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def wrap(model: nn.Module) -> nn.Module:
    """DDP around ``model`` and the agreement (``Agreeing``): gradients are views into its buckets (no second copy
    of every gradient), buffers are not broadcast in forward (a collective a replayed step would unbalance;
    BatchNorm's running statistics are taken from rank 0 before evaluation instead), and its all-reduce is DDP's
    own (a Python comm hook costs a call per bucket per step: about 95 µs on the CPU)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    # torch >= 2.13 names the forward pass's sync forward_sync_buffers and warns (once per rank) at the deprecated
    # broadcast_buffers; the new flag still syncs once at the wrap, where every rank is anyway: harmless
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    ddp = DistributedDataParallel(
        Agreeing(model),
        device_ids=ids,
        gradient_as_bucket_view=True,
        **{"forward_sync_buffers" if newer else "broadcast_buffers": False},
    )
    return ddp


def ddp_of(model: nn.Module) -> Any:
    """The DDP wrapper, also under ``torch.compile``'s (None when ``model`` has none)."""
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, DistributedDataParallel) else None


def unwrap(model: nn.Module) -> nn.Module:
    """The model behind ``torch.compile``'s and DDP's wrappers (``wrap``'s, or a plain DDP): what is trained,
    checkpointed and outlives the job's process group."""
    ddp = ddp_of(model)
    if ddp is None:
        return getattr(model, "_orig_mod", model)
    return ddp.module.model if isinstance(ddp.module, Agreeing) else ddp.module


def backward_reduced(
    model: nn.Module,
    loss: torch.Tensor | None,
    *,
    clock: CommClock,
    rank: int,
    step: int,
    micro: int,
    agreement: Any,
) -> tuple[bool, int, torch.Tensor | None]:
    """``loss.backward()`` with DDP's all-reduce running alongside, for a last micro-batch whose forward ran under
    ``no_sync()``; returns the step's agreement (any rank failed? the stop signal), taken meanwhile, and the mean
    over ranks of what the agreement carried (None: nothing).

    ``agreement`` is ``(failed, stop, carry)`` on the CPU, where it travels as ``Agreeing``'s gradient with
    ``carry`` (None, or at most ``CARRY`` values to average over ranks), or a function that reads an agreement
    already issued on another group (``Group.agree_async``: CUDA, whose buckets live on the device, where reading
    the flags would wait for the GPU; nothing is carried). ``loss`` None: this rank failed the step
    (out of memory before this backward); it backpropagates zeros to every parameter, so that it takes part in the
    same all-reduces as the others, and the agreement then discards the step on every rank.

    Raises:
        DistributedError: this rank ran out of memory in the backward, or another rank failed in its own (every
            rank's process group is left: no rank waits for the others).
    """
    ddp = ddp_of(model)
    param = ddp.module.agreement
    param.grad = None  # the last step's answer: backward would add to it
    # what DDP's own forward does outside no_sync(): count the iteration and expect every gradient's hook (its
    # require_forward_param_sync matters only to the buffer broadcast, which ``wrap`` turns off)
    ddp.reducer.prepare_for_forward()
    ddp.reducer.prepare_for_backward([])
    # the model's own trainable parameters, listed only where needed (not on every step of the hot path)
    own = [p for p in unwrap(model).parameters() if p.requires_grad] if loss is None or clock.armed else []
    if loss is None:  # one element of each parameter, times zero: every gradient hook fires, little memory is used
        loss = torch.stack([p.reshape(-1)[0] for p in own]).sum() * 0.0
    # DDP expects every parameter's gradient, the agreement's included (on CUDA its flags stay zero: reading them
    # would wait for the GPU, so the agreement travels on the Gloo group instead)
    flags = pack_agreement(*agreement) if isinstance(agreement, tuple) else ddp.module.no_flags
    watch = clock.watch(own)
    try:  # the agreement's parameter is a second root: its gradient is the flags, with no op of its own
        torch.autograd.backward([loss, param], [None, flags])
    except Exception as err:
        failure = _leave(err, rank=rank, step=step, micro=micro)
        if failure is err:
            raise
        raise failure from err
    finally:
        if watch is not None:
            watch.remove()
    clock.end()
    # DDP re-orders its buckets once, after its first synced backward, with a broadcast from rank 0 that it runs at
    # the start of the next forward. A rank that fails a step before its model's forward (the input's
    # preparation ran out of memory) would skip that broadcast while the others wait in it: run it here, where
    # every rank is, right after the backward they all took part in (a no-op from then on).
    ddp.reducer._rebuild_buckets()
    if not isinstance(agreement, tuple):
        return (*agreement(), None)
    # the flags' sum over ranks, times 1/world size: the agreement reads zero or not, the carried values are means
    carry = agreement[2]
    carried = None if carry is None else param.grad[AGREEMENT : AGREEMENT + len(carry)].clone()
    return (*read_agreement(param.grad), carried)


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
        first = brief(err, first_line=True, with_type=False, limit=200)
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
    params = [p for p in unwrap(model).parameters() if p.requires_grad]  # the agreement has no gradient here
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
