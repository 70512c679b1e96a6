"""Several processes, one training: DistributedDataParallel under ``torchrun`` (or a SLURM job step, or submitit's
local tasks, mapped by ``pipeline.parallel.slurm``).

``from_env()`` returns a ``Solo`` for a plain run, whose every method is free, or a ``Group`` once it has joined
the process group (NCCL on CUDA, Gloo on the CPU). The loop talks to either through the same few calls:

- ``agree(failed, stop)``: did any rank run out of memory (every rank shrinks and replays the step), did any get a
  stop request (every rank stops after this same step); one small collective on Gloo, never waiting for a GPU.
- ``average_gradients(model)`` (by hand, after ``agree``, while the micro-batch size is being found) and
  ``reduce_in_backward(model, loss, ...)`` (afterwards: DDP's bucketed all-reduce overlapped with the last
  backward, the agreement taken meanwhile); see ``pipeline.parallel.overlap``.
- ``sum``, ``mean`` (a NaN loss is seen by every rank at the same step), ``gather`` (rank 0 records every rank's
  shares) and ``share`` (rank 0 decides, every rank gets the answer or the same error).

Rank 0 alone owns the MLflow run and writes checkpoints; every rank loads them.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from pipeline.common.messages import brief
from pipeline.parallel import overlap
from pipeline.parallel.overlap import posted_failure
from pipeline.parallel.ranks import DistributedError, Launch, cuda_index, launch_from

if TYPE_CHECKING:  # the config is read, never imported: building the run hands it in
    from pipeline.config import DeviceConfig

log = logging.getLogger(__name__)

T = TypeVar("T")
TIMEOUT = datetime.timedelta(minutes=10)  # a rank that never answers a collective ends the run instead of hanging it
_JOINED: list[bool] = []  # one entry each time this process joined a job's process group


def joins() -> int:
    """How many times this process joined a distributed job (a command that joined one ends without the
    interpreter's teardown: ``pipeline.common.heap.exit_without_teardown``)."""
    return len(_JOINED)


class Solo:
    """A plain, one-process run: every collective is the identity and costs nothing."""

    rank = 0
    local_rank = 0
    world_size = 1
    backend = "none"
    is_main = True

    def place(self, device: torch.device) -> torch.device:
        return device

    def join(self, device: DeviceConfig) -> None:
        pass

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> Any:
        return nullcontext()

    def agree(self, *, failed: bool, stop: int) -> tuple[bool, int]:
        return failed, stop

    can_overlap = False  # DDP's all-reduce can run inside backward (a one-process run has none)

    def average_gradients(self, model: nn.Module) -> None:
        pass

    def reduce_in_backward(
        self,
        model: nn.Module,
        loss: torch.Tensor | None,
        *,
        step: int,
        micro: int,
        failed: bool,
        stop: int,
        carry: torch.Tensor | None = None,
    ) -> tuple[bool, int, torch.Tensor | None]:
        if loss is not None:
            loss.backward()
        return (*self.agree(failed=failed, stop=stop), carry)

    def step_metrics(self) -> dict[str, float]:  # time/allreduce_ms: a one-process run has no all-reduce
        return {}

    def untimed(self) -> Any:  # a block time/allreduce_ms leaves out: a one-process run times none
        return nullcontext()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, obj: T) -> list[T]:
        return [obj]

    def share(self, fn: Callable[[], T]) -> T:
        return fn()

    def broadcast_buffers(self, model: nn.Module) -> None:
        pass

    def close(self, *, clean: bool = True) -> None:
        pass

    def record(self, batch_size: int) -> dict[str, Any]:
        return {}

    def describe(self, batch_size: int) -> str:
        return ""


class Group(Solo):
    """One rank of a DistributedDataParallel job (see the module's docstring)."""

    def __init__(self, launch: Launch) -> None:
        self.rank, self.local_rank, self.world_size = launch.rank, launch.local_rank, launch.world_size
        self.is_main = self.rank == 0
        self.backend = ""
        self._control: Any = None  # the Gloo group for decisions (the default group when it is Gloo already)
        self._clock: Any = None  # pipeline.parallel.overlap.CommClock, made with the DDP wrapper
        self._owned = True  # the run joined the process group itself, so it leaves it at close

    def join(self, device: DeviceConfig) -> None:
        """Join the process group before anything is built: NCCL when the run is to use CUDA, else Gloo; the
        step's decisions always travel over Gloo, on the CPU. A group the calling program joined already is used
        (and left to it at ``close``).

        Raises:
            DistributedError: MPS (no collective backend), fewer GPUs than processes on this node (``cuda_index``),
                or a group already joined with another backend or size.
        """
        import torch.distributed as dist

        if device.name == "mps":
            raise DistributedError("torchrun with device=mps: MPS has no collective backend; train in one process")
        cuda = device.name == "cuda" or (device.name == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(cuda_index(self.local_rank))
        self.backend = "nccl" if cuda else "gloo"
        if dist.is_initialized():  # the caller joined the job already (a script calling pipeline.train): use its group
            if dist.get_backend() != self.backend or dist.get_world_size() != self.world_size:
                raise DistributedError(
                    f"this process already joined a {dist.get_backend()} process group of {dist.get_world_size()} "
                    f"ranks; the run needs {self.backend} with {self.world_size} (device={device.name})"
                )
            self._owned = False
        else:
            dist.init_process_group(self.backend, timeout=TIMEOUT)
        self._control = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else None
        _JOINED.append(True)
        log.info("rank %d of %d joined the job (%s)", self.rank, self.world_size, self.backend)

    def place(self, device: torch.device) -> torch.device:
        """The rank's own device: ``cuda:LOCAL_RANK`` (one GPU per process), ``cuda:0`` where SLURM bound one GPU to
        each task (``cuda_index``); the CPU as it is."""
        if device.type == "cuda":
            return torch.device("cuda", cuda_index(self.local_rank))
        if self.backend == "nccl":
            raise DistributedError(f"the job joined with NCCL but this rank resolved device {device}")
        return device

    can_overlap = True

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP around the model and the step's agreement (``pipeline.parallel.overlap.wrap``)."""
        self._clock = overlap.CommClock(next(model.parameters()).device)
        return overlap.wrap(model)

    def no_sync(self, model: nn.Module) -> Any:
        inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper around DDP
        return inner.no_sync() if hasattr(inner, "no_sync") else nullcontext()

    def agree(self, *, failed: bool, stop: int) -> tuple[bool, int]:
        """Whether any rank failed this step (out of memory), and the stop signal any rank received (0 = none)."""
        return self.agree_async(failed=failed, stop=stop)()

    def agree_async(self, *, failed: bool, stop: int) -> Callable[[], tuple[bool, int]]:
        """``agree``, issued now (every rank issues it at the same point of the step, so collectives keep one order);
        the returned function waits for the answer. An overlapped CUDA step reads it after its backward, so the small
        collective's latency hides behind backward."""
        import torch.distributed as dist

        flags = torch.tensor([int(failed), stop], dtype=torch.int64)
        try:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control, async_op=True)
        except RuntimeError as err:
            raise _left_or(err) from err

        def answer() -> tuple[bool, int]:
            try:
                work.wait()
            except RuntimeError as err:
                raise _left_or(err) from err
            return bool(flags[0]), int(flags[1])

        return answer

    def average_gradients(self, model: nn.Module) -> None:
        """Every trainable parameter's gradient averaged over the ranks, after the step's agreement."""
        overlap.average_by_hand(model, world_size=self.world_size, clock=self._clock)

    def reduce_in_backward(
        self,
        model: nn.Module,
        loss: torch.Tensor | None,
        *,
        step: int,
        micro: int,
        failed: bool,
        stop: int,
        carry: torch.Tensor | None = None,
    ) -> tuple[bool, int, torch.Tensor | None]:
        """``loss.backward()``, DDP's all-reduce overlapped (None: this rank failed the step and sends zeros), and the
        step's agreement taken meanwhile (``agree``'s answer); an error ends the job cleanly
        (``pipeline.parallel.overlap``). On the CPU the agreement travels with the gradients' all-reduce, and
        ``carry`` (e.g. a logging interval's losses) with it: the third value is its mean over ranks (None: not
        carried, on CUDA or when too long); on CUDA the agreement is issued on the Gloo group before the backward and
        read after it, so no rank waits for its GPU to read it."""
        if self._control is None:
            agreement: Any = (failed, stop, carry if carry is not None and len(carry) <= overlap.CARRY else None)
        else:
            agreement = self.agree_async(failed=failed, stop=stop)
        return overlap.backward_reduced(
            model, loss, clock=self._clock, rank=self.rank, step=step, micro=micro, agreement=agreement
        )

    def step_metrics(self) -> dict[str, float]:
        """``time/allreduce_ms``: the all-reduce time backward did not hide, per step since the last logged one."""
        return self._clock.metrics() if self._clock is not None else {}

    @contextmanager
    def untimed(self) -> Iterator[None]:
        """A block whose all-reduces ``time/allreduce_ms`` leaves out (the steps ``pipeline.engine.observe.replay``
        replays, which are no training steps): the clock is disarmed in it, and armed again as it was."""
        clock = self._clock
        armed = clock is not None and clock.armed
        if clock is not None:
            clock.armed = False
        try:
            yield
        finally:
            if clock is not None:
                clock.armed = armed

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor)
        return tensor

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.sum(tensor).div_(self.world_size)

    def gather(self, obj: T) -> list[T]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._control)
        return out

    def share(self, fn: Callable[[], T]) -> T:
        """``fn()`` on rank 0, its result on every rank; an error there is raised on every rank."""
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn())
            except Exception as err:
                dist.broadcast_object_list([("error", brief(err))], src=0, group=self._control)
                raise
        dist.broadcast_object_list(box, src=0, group=self._control)
        kind, value = box[0]
        if kind == "error":
            raise DistributedError(f"rank 0 stopped: {value}")
        return value

    def broadcast_buffers(self, model: nn.Module) -> None:
        """Rank 0's buffers (BatchNorm's running statistics) on every rank: evaluation and checkpoints agree."""
        import torch.distributed as dist

        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model behind DDP (and ``torch.compile`` around it): what outlives the job's process group."""
        return overlap.unwrap(model)

    def close(self, *, clean: bool = True) -> None:
        """Leave the job. After a clean run every rank first waits for the others, so that no rank closes its
        connections under a peer still in a collective. (A rank once aborted at its exit, "terminate called without
        an active exception", after a run that had succeeded: the run's result held DDP's wrapper, whose reducer
        keeps the process group, so Gloo was torn down in the interpreter's finalisation; see ``unwrap``. It happened
        again once, with no such reference left: a rank's command now ends without that teardown, ``joins``.)"""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if clean:
            dist.barrier(group=self._control)
        if self._control is not None and not self._owned:
            dist.destroy_process_group(self._control)
        if self._owned:  # a group the caller joined is the caller's to leave
            dist.destroy_process_group()

    def record(self, batch_size: int) -> dict[str, Any]:
        """What the run records about the job: world size, backend, the per-rank and the global batch."""
        return {
            "distributed.world_size": self.world_size,
            "distributed.backend": self.backend,
            "distributed.batch_size_per_rank": batch_size,
            "distributed.global_batch_size": batch_size * self.world_size,
        }

    def describe(self, batch_size: int) -> str:
        return (
            f"{self.world_size} ranks over {self.backend}, batch {batch_size} per rank, "
            f"{batch_size * self.world_size} in all"
        )


def _left_or(err: RuntimeError) -> Exception:
    """A broken collective ("connection closed"): why a rank that left says it did (``pipeline.parallel.overlap``), else
    ``err`` itself."""
    return posted_failure() or err


def from_env(environ: Mapping[str, str] | None = None) -> Solo | Group:
    """The run's place in a distributed job: a ``Group`` under torchrun (not started yet), else ``Solo``."""
    launch = launch_from(os.environ if environ is None else environ)
    return Solo() if launch is None else Group(launch)


@contextmanager
def joined(device: DeviceConfig, environ: Mapping[str, str] | None = None) -> Iterator[Solo | Group]:
    """This process's place in the job, joined for the block (and its log lines tagged with its rank)."""
    group = from_env(environ)
    with rank_logging(group):
        group.join(device)
        clean = False
        try:
            yield group
            clean = True
        finally:
            group.close(clean=clean)


@contextmanager
def rank_logging(group: Solo | Group) -> Iterator[None]:
    """Ranks other than 0 prefix their log lines with their rank and show warnings and errors only."""
    if group.world_size == 1:
        yield
        return
    prefix = f"[rank {group.rank}] "

    def tag(record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(prefix):
            record.msg = prefix + str(record.msg)
        return True

    root, package = logging.getLogger(), logging.getLogger("pipeline")
    level = package.level
    for handler in root.handlers:
        handler.addFilter(tag)
    if not group.is_main:
        package.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.removeFilter(tag)
        package.setLevel(level)
