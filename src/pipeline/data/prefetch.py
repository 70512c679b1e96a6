"""Host-to-device copies that overlap compute: batch k+1 is copied on a side stream while batch k trains.

    python -m pipeline data=cifar10 model=resnet18 loader=workers loader.prefetch_to_device=true

``DevicePrefetcher`` wraps a loader (an ``EpochLoader``) and yields batches already on the device.
It stays one batch ahead: before it hands batch k over, it has taken batch k+1 from the loader and
queued its copy on its own CUDA stream, so that copy runs while batch k's forward and backward run
on the training stream. Handing a batch over makes the training stream wait for that batch's copy
(an event wait queued on the device; the host does not wait) and tells the caching allocator that
the training stream uses its tensors (``record_stream``): their memory, allocated on the copy
stream, is not given to a later copy before the training stream is done with them. The loop's
``.to(device)`` is then a no-op.

It keeps what the loop relies on: ``len()`` and ``set_epoch(epoch, skip=...)`` pass through to the
loader, so resume's skip happens in its sampler (no batch is loaded or copied only to be dropped),
and every batch comes out exactly once, in the loader's order. Under the step timer it marks
``ready`` itself, just before the training stream's wait, and reports each copy's duration on its
own stream (see ``pipeline.engine.hot.timing``); being one batch ahead, step k's wait for data is the wait for
batch k+1 from the loader.

``loader.prefetch_to_device=auto`` turns it on for CUDA with DataLoader batches in pinned memory (a
copy from pageable memory blocks the host, so nothing would overlap); resident data is on the
device already, and the CPU has nothing to copy. ``true`` on another device is refused at build
time, where ``device=auto`` is resolved. The copies are injectable: ``InlineCopies`` runs the same
hand-over order with plain copies, on the CPU and in tests.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pipeline.common.errors import ConfigError
from pipeline.config import LoaderConfig
from pipeline.data import structures
from pipeline.data.backends import backend_of
from pipeline.data.batches import Batches

Batch = tuple[Any, ...]  # (inputs, targets), each a tensor or a structure of them (pipeline.data.structures)


@dataclass(frozen=True)
class InFlight:
    """A batch whose copy is queued: ``batch`` is on the device, written until the copy stream passes ``copied``."""

    batch: Batch
    host: Batch  # the source, kept alive until the hand-over
    started: Any  # marks on the copy stream around the copy: CUDA events, or wall clocks for InlineCopies
    copied: Any


class Copies(Protocol):
    """How a prefetcher copies: queue a batch's copy, hand a copied batch to the training stream, time a copy."""

    def start(self, host: Batch) -> InFlight: ...

    def hand_over(self, flight: InFlight) -> Batch: ...

    def seconds(self, started: Any, copied: Any) -> float: ...  # read after a sync only (EventTimer.finish)


class CudaCopies:
    """Copies on a side stream of ``device``, each between two timing events on that stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def start(self, host: Batch) -> InFlight:
        started = torch.cuda.Event(enable_timing=True)  # two events a batch: a few microseconds on the host
        copied = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            started.record(self.stream)
            batch = tuple(structures.move(part, self.device) for part in host)
            copied.record(self.stream)
        return InFlight(batch, host, started, copied)

    def hand_over(self, flight: InFlight) -> Batch:
        training = torch.cuda.current_stream(self.device)
        training.wait_event(flight.copied)  # queued on the device: the host goes on
        for tensor in structures.leaves(flight.batch):
            tensor.record_stream(training)  # when freed, the block waits for the training stream's work on it
        return flight.batch

    def seconds(self, started: Any, copied: Any) -> float:
        return started.elapsed_time(copied) / 1e3


class InlineCopies:
    """The same hand-over order with plain copies on the current stream: each copy is complete when ``start``
    returns, so a hand-over has nothing to wait for. Timed with wall clocks. For the CPU and for tests."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self, host: Batch) -> InFlight:
        started = time.perf_counter()
        batch = tuple(structures.move(part, self.device, non_blocking=False) for part in host)
        return InFlight(batch, host, started, time.perf_counter())

    def hand_over(self, flight: InFlight) -> Batch:
        return flight.batch

    def seconds(self, started: Any, copied: Any) -> float:
        return copied - started


class Marks(Protocol):
    """What a prefetcher tells the step timer (``timing._Marks``)."""

    def ready(self) -> None: ...

    def copy_took(self, seconds: Callable[[], float]) -> None: ...


class _Untimed:
    """Plain iteration (evaluation, autotuning's endless batches): nothing to mark."""

    def ready(self) -> None:
        pass

    def copy_took(self, seconds: Callable[[], float]) -> None:
        pass


class DevicePrefetcher:
    """``batches`` on the device, each copied while the one before it computes (see the module docstring).

    Args:
        batches: the loader: iterable, sized, with ``set_epoch(epoch, skip=...)``.
        copies: how to copy (``CudaCopies`` on a GPU).
    """

    def __init__(self, batches: Batches, copies: Copies) -> None:
        self.batches, self.copies = batches, copies

    @property
    def kind(self) -> str:
        """The wrapped batches' backend: a prefetcher is no backend of its own."""
        return self.batches.kind

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        """The loader's ``set_epoch``: its sampler passes over the first ``skip`` batches without loading them."""
        self.batches.set_epoch(epoch, skip=skip)

    def close(self) -> None:
        """The loader's ``close``: its persistent workers end now."""
        self.batches.close()

    def __iter__(self) -> Iterator[Batch]:
        return self._run(_Untimed())

    def timed_by(self, marks: Marks) -> Iterator[Batch]:
        """Iterate under the step timer: ``ready`` is marked before the training stream waits for the copy, so that
        wait is booked as the copy's (``h2d``), not as waiting for data; each copy's duration is reported."""
        return self._run(marks)

    def _run(self, marks: Marks) -> Iterator[Batch]:
        source = iter(self.batches)
        ahead = self._start(next(source, None))
        while ahead is not None:
            current, ahead = ahead, self._start(next(source, None))  # batch k+1's copy is queued before k computes
            marks.ready()
            batch = self.copies.hand_over(current)
            # the marks only, not the batch: the timer keeps them to the epoch's end
            marks.copy_took(functools.partial(self.copies.seconds, current.started, current.copied))
            yield batch

    def _start(self, host: Batch | None) -> InFlight | None:
        return None if host is None else self.copies.start(tuple(host))


def prefetch_wanted(cfg: LoaderConfig, device: torch.device) -> bool:
    """Whether ``loader.prefetch_to_device`` puts a ``DevicePrefetcher`` on this device's batches.

    Raises:
        ConfigError: ``true`` on a device other than CUDA (checked here, at build time, once ``device=auto`` is
            resolved; ``true`` with resident data or unpinned memory is refused by the config's validation).
    """
    if cfg.prefetch_to_device is True and device.type != "cuda":
        raise ConfigError(
            "loader.prefetch_to_device",
            True,
            f"auto or false on device {device.type}: copying on a side stream needs CUDA "
            f"({'the batches are on the CPU already' if device.type == 'cpu' else 'MPS has no side streams to use'})",
        )
    if backend_of(cfg).on_device or device.type != "cuda":  # resident batches: nothing to copy
        return False
    return cfg.prefetch_to_device is True or (cfg.prefetch_to_device == "auto" and cfg.pin_memory in ("auto", True))


def with_prefetch(
    batches: Batches, cfg: LoaderConfig, *, device: torch.device, copies: Callable[[torch.device], Copies] = CudaCopies
) -> Batches:
    """``batches`` in a ``DevicePrefetcher`` when ``prefetch_wanted``, else ``batches`` themselves (nothing added)."""
    return DevicePrefetcher(batches, copies(device)) if prefetch_wanted(cfg, device) else batches
