"""Batches for the loop: the torch DataLoader path and the resident path.

Both yield ``(images, labels)``; the loop copies them to the device (a no-op for resident
batches, which are there already, and for batches a ``prefetch.DevicePrefetcher`` copied ahead)
and ``Normalize`` turns uint8 pixels into normalised floats on the device, one whole batch at a
time. Training may augment the uint8 batch first (``augment``), once per batch; evaluation only
normalises.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from pipeline.common.errors import ConfigError
from pipeline.config import LoaderConfig
from pipeline.data.workers import (
    WATCHDOG_GRACE_S,
    LoaderError,
    Watchdog,
    describe_fault,
    is_worker_fault,
    kill_workers,
    leave_ctrl_c_to_the_trainer,
)

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class EpochOrder(Sampler[int]):
    """The samples an epoch visits, in order: a function of the seed and the epoch number alone.

    A permutation drawn from a generator seeded with ``(seed, epoch)`` does not depend on how
    many epochs ran in this process, on loader workers (a DataLoader draws its workers' base
    seed from its own generator whenever it creates an iterator, which with persistent workers
    happens once per process), or on anything else that draws random numbers. So a resumed run
    visits the same samples in the same order as an uninterrupted one, and ``start`` skips the
    samples already trained on without loading them.

    Under DDP each of ``world`` ranks visits every ``world``-th sample of that order from its
    ``rank`` on, so batch ``k`` of all ranks together is batch ``k`` of one process with the global
    batch. ``pad`` (training) repeats the order's first samples so every rank has as many samples, and
    so as many steps, as the others; evaluation does not pad (its sums are reduced, not its steps).
    """

    def __init__(self, size: int, *, seed: int, shuffle: bool, rank: int = 0, world: int = 1, pad: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.rank, self.world, self.pad = rank, world, pad
        self.epoch, self.start = 1, 0

    def set_epoch(self, epoch: int, *, start: int = 0) -> None:
        """Visit ``epoch``'s order from its ``start``-th sample of this rank's share (0 = the whole epoch)."""
        self.epoch, self.start = epoch, min(max(start, 0), self.shard_size)

    @property
    def shard_size(self) -> int:
        """The samples this rank visits in a whole epoch."""
        if self.world == 1:
            return self.size
        if self.pad:
            return math.ceil(self.size / self.world)
        return len(range(self.rank, self.size, self.world))

    def indices(self) -> torch.Tensor:
        if not self.shuffle:
            order = torch.arange(self.size)
        else:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**63)
            order = torch.randperm(self.size, generator=generator)
        if self.world > 1:
            if self.pad and self.size % self.world:
                extra = self.shard_size * self.world - self.size
                order = torch.cat([order, order.repeat(math.ceil(extra / self.size))[:extra]])
            order = order[self.rank :: self.world]
        return order[self.start :]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.shard_size - self.start


class EpochLoader(DataLoader):
    """A DataLoader whose order is an ``EpochOrder``: ``set_epoch(epoch, skip=batches)`` before each epoch.

    With workers, a worker that dies or stops answering ends the epoch with a ``LoaderError``
    rather than a traceback or a hang: ``loader.timeout`` bounds every wait for a batch, including
    the ones PyTorch's own timeout does not cover (receiving a batch's shared memory from a worker
    that was stopped, e.g. by SIGSTOP, after it announced the batch), through a SIGALRM watchdog
    in the main thread (two ``setitimer`` calls a batch, about a microsecond; Windows has no SIGALRM, so there
    PyTorch's timeout alone applies). Under spawn and forkserver the first batch also waits for the workers to
    start and import torch, seconds each: loader.timeout must cover that too.
    """

    sampler: EpochOrder

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        """Use ``epoch``'s order and pass over its first ``skip`` batches (resume) without loading them."""
        self.sampler.set_epoch(epoch, start=skip * (self.batch_size or 1))

    def __iter__(self) -> Iterator[Batch]:
        batches = super().__iter__()
        if self.num_workers == 0:
            return batches  # the main process loads: nothing to watch, nothing added per batch
        return self._watched(batches)

    def _watched(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        watchdog = Watchdog(self.timeout + WATCHDOG_GRACE_S if self.timeout else 0.0)
        with watchdog:
            while True:
                try:
                    with watchdog.armed():
                        batch = next(batches)
                except StopIteration:
                    return
                except LoaderError:  # the watchdog's: a batch that never came
                    kill_workers(batches)
                    raise
                except RuntimeError as err:
                    if not is_worker_fault(err):
                        raise
                    kill_workers(batches)
                    raise LoaderError(describe_fault(str(err), self.timeout)) from err
                except (ConnectionError, EOFError) as err:
                    if "in DataLoader worker process" in str(err):  # the dataset's own error, re-raised from a worker
                        raise
                    # a worker that died while this process received a batch's shared memory from it: the socket
                    # passing the file descriptor is reset mid-receive, before PyTorch notices the death
                    kill_workers(batches)
                    lost = f"a loader worker's connection broke mid-batch ({type(err).__name__}: {err})"
                    raise LoaderError(describe_fault(lost, self.timeout)) from err
                yield batch


class ResidentLoader:
    """Batches cut by index from a dataset that lives on the device as two tensors.

    One permutation per epoch (made on the CPU by an ``EpochOrder``, so the order does not
    depend on the device), then each batch is an index gather on the device: no per-sample
    Python, no collation, no host-to-device copy. Call ``set_epoch`` before each epoch.
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, *, batch_size: int, shuffle: bool, drop_last: bool, seed: int
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.images, self.labels = images, labels
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.order = EpochOrder(len(labels), seed=seed, shuffle=shuffle)

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        self.order.set_epoch(epoch, start=skip * self.batch_size)

    def __len__(self) -> int:
        n = len(self.order)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        size, first = self.batch_size, self.order.start
        if not self.shuffle:  # slices are views: no gather
            for start in range(first, first + len(self) * size, size):
                yield self.images[start : start + size], self.labels[start : start + size]
            return
        order = self.order.indices().to(self.images.device, non_blocking=True)
        for start in range(0, len(self) * size, size):
            index = order[start : start + size]
            yield self.images[index], self.labels[index]


class Normalize:
    """uint8 ``[N, C, H, W]`` on the device -> float32 ``(x / 255 - mean) / std`` in one fused pass."""

    def __init__(
        self, mean: tuple[float, ...], std: tuple[float, ...], *, device: torch.device, channels_last: bool = False
    ) -> None:
        m = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        s = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.scale = 1.0 / (255.0 * s)
        self.shift = -m / s
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.addcmul(self.shift, images.float(), self.scale)
        return x.contiguous(memory_format=self.memory_format)


def make_loader(
    dataset: Dataset,
    cfg: LoaderConfig,
    *,
    device: torch.device,
    train: bool,
    seed: int,
    rank: int = 0,
    world: int = 1,
) -> EpochLoader | ResidentLoader:
    """The batches of one split, as ``loader.*`` configures them (this rank's share, under DDP).

    Args:
        dataset: yields ``(uint8 image [C, H, W], label)``.
        cfg: the loader group.
        device: where training runs (resident data is moved there; pinning only for CUDA).
        train: shuffle and honour ``drop_last`` (validation does neither).
        seed: seeds the shuffling, so the same seed gives the same order.
        rank, world: this process's rank and the number of ranks (DDP); ``loader.batch_size`` is per rank.
    """
    if cfg.resident:
        images, labels = materialize(dataset)
        if world > 1:  # a fixed share per rank, so each moves only its own samples to its device
            share = resident_share(len(labels), rank=rank, world=world, pad=train)
            images, labels = images[share], labels[share]
        resident = ResidentLoader(
            images.to(device),
            labels.to(device),
            batch_size=cfg.batch_size,
            shuffle=train,
            drop_last=train and cfg.drop_last,
            seed=seed,
        )
        return _with_steps(resident, cfg, len(labels))
    if cfg.pin_memory is True and device.type != "cuda":
        log.warning(
            "loader.pin_memory=true has no effect on %s: pinned memory speeds up copies to CUDA only", device.type
        )
    pin = device.type == "cuda" and cfg.pin_memory in ("auto", True)
    loader = EpochLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=EpochOrder(len(dataset), seed=seed, shuffle=train, rank=rank, world=world, pad=train),
        num_workers=cfg.num_workers,
        pin_memory=pin,
        persistent_workers=cfg.persistent_workers,
        prefetch_factor=cfg.prefetch_factor,
        drop_last=train and cfg.drop_last,
        timeout=cfg.timeout,
        generator=torch.Generator().manual_seed(seed),  # seeds the workers' base seed only: the order is EpochOrder's
        multiprocessing_context=worker_start_method(cfg),
        worker_init_fn=leave_ctrl_c_to_the_trainer,
    )
    return _with_steps(loader, cfg, len(dataset))


def worker_start_method(cfg: LoaderConfig) -> str | None:
    """``loader.multiprocessing_context`` as the DataLoader takes it: None for auto (and without workers), which
    leaves the choice to this process's default, the platform's unless the program set another.

    Under spawn and forkserver each worker unpickles the dataset and the collate function and imports torch
    afresh (seconds per worker, paid again each epoch without ``persistent_workers``); what the datasets hold
    (tensors, paths, torchvision transforms, ``images._ImageLoader``) is picklable for that.
    """
    if cfg.num_workers == 0 or cfg.multiprocessing_context == "auto":
        return None
    return cfg.multiprocessing_context


def resident_share(size: int, *, rank: int, world: int, pad: bool) -> torch.Tensor:
    """The samples rank ``rank`` of ``world`` keeps resident: every ``world``-th one, padded (training) from the
    start so every rank has as many, and so as many steps."""
    total = math.ceil(size / world) * world if pad else size
    return (torch.arange(total) % size)[rank::world]


def _with_steps(batches: EpochLoader | ResidentLoader, cfg: LoaderConfig, samples: int) -> EpochLoader | ResidentLoader:
    """``batches``, unless they hold none: drop_last with a batch larger than the data would train no step.

    Raises:
        ConfigError: naming loader.batch_size and what would work.
    """
    if len(batches) == 0:
        raise ConfigError(
            "loader.batch_size",
            cfg.batch_size,
            f"at most the {samples} training samples with loader.drop_last=true (or loader.drop_last=false)",
        )
    return batches


def materialize(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """All samples as two tensors: free for tensor datasets, one decoding pass for image folders."""
    if isinstance(dataset, TensorDataset):
        images, labels = dataset.tensors
        return images, labels
    loader = DataLoader(dataset, batch_size=256, shuffle=False)
    parts = list(loader)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def first_batch(dataset: Dataset, size: int) -> Batch:
    """The dataset's first ``size`` samples as one batch (a slice of tensor datasets; decoded otherwise)."""
    if isinstance(dataset, TensorDataset):
        images, labels = dataset.tensors
        return images[:size], labels[:size]
    items = [dataset[i] for i in range(min(size, len(dataset)))]
    return torch.stack([image for image, _ in items]), torch.tensor([label for _, label in items])
