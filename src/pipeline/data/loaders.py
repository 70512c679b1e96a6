"""Batches for the loop, the two built-in backends (``pipeline.data.backends``): torch's DataLoader
(``dataloader``) and the resident tensors (``resident``).

Both yield ``(images, labels)``; the loop copies them to the device (a no-op for resident
batches, which are there already, and for batches a ``prefetch.DevicePrefetcher`` copied ahead)
and ``Normalize`` turns uint8 pixels into normalised floats on the device, one whole batch at a
time. Training may augment the uint8 batch first (``augment``), once per batch; evaluation only
normalises.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset, default_collate

from pipeline.common.device_memory import DoesNotFit, check_data, free_memory, size
from pipeline.common.errors import ConfigError
from pipeline.config import DATALOADER, RESIDENT, LoaderConfig
from pipeline.data import structures
from pipeline.data.batches import Place, Split
from pipeline.data.iterable import IterableLoader
from pipeline.data.workers import WatchedLoader, leave_ctrl_c_to_the_trainer

log = logging.getLogger(__name__)


class MapStyle(Protocol):
    """A map-style dataset as the loaders use it: samples by index, and a length (torch's ``Dataset`` has none)."""

    def __getitem__(self, index: int) -> Any: ...

    def __len__(self) -> int: ...


Batch = tuple[Any, Any]  # (inputs, targets): uint8 images and labels for the built-in sources


@dataclass(frozen=True)
class Shard:
    """Which samples of an epoch's order one rank visits (``EpochOrder``, ``resident_share``)."""

    rank: int = 0
    world: int = 1
    pad: bool = True  # training: repeat the order's first samples so every rank has as many, and so as many steps
    contiguous: bool = False  # loader.shuffle=false: each rank a contiguous share of whole batches, not every world-th
    unit: int = 1  # the samples of one batch (contiguous shares are whole batches)


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
    ``contiguous`` (``loader.shuffle=false``: the dataset's own order, for data laid out in batch order) gives
    each rank its contiguous share instead, whole batches of ``unit`` samples each, so a stream of batches stays a
    stream of the same batches on each rank.
    """

    def __init__(self, size: int, *, seed: int, shuffle: bool, shard: Shard = Shard()) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.rank, self.world, self.pad, self.contiguous, self.unit = (
            shard.rank,
            shard.world,
            shard.pad,
            shard.contiguous,
            shard.unit,
        )
        self.epoch, self.start = 1, 0

    def set_epoch(self, epoch: int, *, start: int = 0) -> None:
        """Visit ``epoch``'s order from its ``start``-th sample of this rank's share (0 = the whole epoch)."""
        self.epoch, self.start = epoch, min(max(start, 0), self.shard_size)

    @property
    def shard_size(self) -> int:
        """The samples this rank visits in a whole epoch."""
        if self.world == 1:
            return self.size
        if self.contiguous:
            share = self._share()
            return share if self.pad else len(range(self.size)[self.rank * share : (self.rank + 1) * share])
        if self.pad:
            return math.ceil(self.size / self.world)
        return len(range(self.rank, self.size, self.world))

    def _share(self) -> int:
        """A contiguous share's samples: each rank as many whole batches of ``unit`` as the most any rank has."""
        return math.ceil(math.ceil(self.size / self.unit) / self.world) * self.unit

    def indices(self) -> torch.Tensor:
        if not self.shuffle:
            order = torch.arange(self.size)
        else:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**63)
            order = torch.randperm(self.size, generator=generator)
        if self.world > 1:
            if self.pad and self.shard_size * self.world > self.size:
                extra = self.shard_size * self.world - self.size
                order = torch.cat([order, order.repeat(math.ceil(extra / self.size))[:extra]])
            if self.contiguous:
                share = self._share()
                order = order[self.rank * share : (self.rank + 1) * share]
            else:
                order = order[self.rank :: self.world]
        return order[self.start :]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.shard_size - self.start


class EpochLoader(WatchedLoader):
    """A watched DataLoader whose order is an ``EpochOrder``: ``set_epoch(epoch, skip=batches)`` before each epoch."""

    sampler: EpochOrder
    kind = DATALOADER

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        """Use ``epoch``'s order and pass over its first ``skip`` batches (resume) without loading them."""
        self.sampler.set_epoch(epoch, start=skip * (self.batch_size or 1))


class ResidentLoader:
    """Batches cut by index from a dataset that lives on the device: inputs and targets, each a tensor (or a
    structure of them, ``pipeline.data.structures``).

    One permutation per epoch (made on the CPU by an ``EpochOrder``, so the order does not
    depend on the device), then each batch is an index gather on the device: no per-sample
    Python, no collation, no host-to-device copy. Call ``set_epoch`` before each epoch.
    """

    kind = RESIDENT

    def __init__(self, images: Any, labels: Any, *, batch_size: int, shuffle: bool, drop_last: bool, seed: int) -> None:
        if structures.count(images) != structures.count(labels):
            raise ValueError(f"{structures.count(images)} inputs but {structures.count(labels)} targets")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.images, self.labels = images, labels
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.order = EpochOrder(structures.count(labels), seed=seed, shuffle=shuffle)

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        self.order.set_epoch(epoch, start=skip * self.batch_size)

    def close(self) -> None:
        """No workers to end: the batches are cut in the training process."""

    def __len__(self) -> int:
        n = len(self.order)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        size, first = self.batch_size, self.order.start
        if not self.shuffle:  # slices are views: no gather
            for start in range(first, first + len(self) * size, size):
                cut = slice(start, start + size)
                yield structures.take(self.images, cut), structures.take(self.labels, cut)
            return
        device = structures.leaves(self.labels)[0].device
        order = self.order.indices().to(device, non_blocking=True)
        for start in range(0, len(self) * size, size):
            index = order[start : start + size]
            yield structures.take(self.images, index), structures.take(self.labels, index)


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


class AsGiven:
    """The user's inputs as their dataset made them (no normalisation); 4-D tensors in ``channels_last`` if asked."""

    def __init__(self, *, channels_last: bool = False) -> None:
        self.channels_last = channels_last

    def __call__(self, inputs: Any) -> Any:
        if self.channels_last and isinstance(inputs, torch.Tensor):
            return inputs.contiguous(memory_format=torch.channels_last)
        return inputs


def dataloader(split: Split, cfg: LoaderConfig, place: Place) -> EpochLoader | IterableLoader:
    """The ``dataloader`` backend: one split's batches through torch's DataLoader, as ``loader.*`` configures them
    (this rank's share, under DDP); an iterable dataset's as a stream of ``split.steps`` batches an epoch."""
    dataset, device, seed = split.dataset, place.device, place.seed
    pin = device.type == "cuda" and cfg.pin_memory in ("auto", True)
    if isinstance(dataset, IterableDataset):
        return IterableLoader(
            dataset,
            cfg,
            collate=split.collate,
            steps=split.steps,
            pin=pin,
            seed=seed,
            start_method=worker_start_method(cfg),
        )
    if cfg.pin_memory is True and device.type != "cuda":
        log.warning(
            "loader.pin_memory=true has no effect on %s: pinned memory speeds up copies to CUDA only", device.type
        )
    sized = cast(MapStyle, dataset)  # map-style: indexed, with a length
    loader = EpochLoader(
        dataset,
        batch_size=cfg.batch_size,
        # the dataset's order without shuffling: each rank a contiguous share of it, whole batches
        sampler=EpochOrder(len(sized), seed=seed, shuffle=split.train and cfg.shuffle, shard=_shard(split, cfg, place)),
        num_workers=cfg.num_workers,
        pin_memory=pin,
        persistent_workers=cfg.persistent_workers,
        prefetch_factor=cfg.prefetch_factor,
        drop_last=split.train and cfg.drop_last,
        timeout=cfg.timeout,
        generator=torch.Generator().manual_seed(seed),  # seeds the workers' base seed only: the order is EpochOrder's
        multiprocessing_context=worker_start_method(cfg),
        worker_init_fn=leave_ctrl_c_to_the_trainer,
        collate_fn=split.collate,
    )
    return _with_steps(loader, cfg, len(sized))


def resident(split: Split, cfg: LoaderConfig, place: Place) -> ResidentLoader | IterableLoader:
    """The ``resident`` backend: one split held whole on ``place.device`` (this rank's share under DDP), batches cut by
    index; an iterable dataset, which cannot be held whole, as a stream (the ``dataloader`` backend's)."""
    if isinstance(split.dataset, IterableDataset):
        return cast(IterableLoader, dataloader(split, cfg, place))
    images, labels = materialize(split.dataset, split.collate, device=place.device)
    if place.world > 1:  # a fixed share per rank, so each moves only its own samples to its device
        share = resident_share(structures.count(labels), _shard(split, cfg, place))
        images, labels = structures.take(images, share), structures.take(labels, share)
    batches = ResidentLoader(
        structures.move(images, place.device, non_blocking=False),
        structures.move(labels, place.device, non_blocking=False),
        batch_size=cfg.batch_size,
        shuffle=split.train and cfg.shuffle,
        drop_last=split.train and cfg.drop_last,
        seed=place.seed,
    )
    return _with_steps(batches, cfg, structures.count(labels))


def _shard(split: Split, cfg: LoaderConfig, place: Place) -> Shard:
    """This rank's share of the split: training padded (every rank as many steps), the dataset's order in contiguous
    whole batches with ``loader.shuffle=false``."""
    return Shard(place.rank, place.world, pad=split.train, contiguous=not cfg.shuffle, unit=cfg.batch_size)


_Sized = TypeVar("_Sized", EpochLoader, ResidentLoader)


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


def resident_share(size: int, shard: Shard) -> torch.Tensor:
    """The samples rank ``shard.rank`` of ``shard.world`` keeps resident: every ``world``-th one (``contiguous``: its
    contiguous share, for ``loader.shuffle=false``), padded (training) from the start so every rank has as many, and so
    as many steps."""
    total = math.ceil(size / shard.world) * shard.world if shard.pad else size
    order = torch.arange(total) % size
    if shard.contiguous:
        share = math.ceil(total / shard.world)
        return order[shard.rank * share : (shard.rank + 1) * share]
    return order[shard.rank :: shard.world]


def _with_steps(batches: _Sized, cfg: LoaderConfig, samples: int) -> _Sized:
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


def materialize(
    dataset: Dataset, collate: Callable[[list[Any]], Any] | None = None, *, device: torch.device | None = None
) -> tuple[Any, Any]:
    """All samples as inputs and targets: free for tensor datasets, one pass over the others (an image folder's
    decoding, the user's items), after their estimated size is checked against the memory free on the host and on
    ``device``. A tensor dataset's targets pass through the collate's ``as_targets`` where it has one (integer labels
    made int64, as its batches would be).

    Raises:
        DoesNotFit: the dataset would not fit (``pipeline.common.device_memory``).
    """
    if isinstance(dataset, TensorDataset):
        images, labels = dataset.tensors
        return images, getattr(collate, "as_targets", lambda targets: targets)(labels)
    _check_resident_room(cast(MapStyle, dataset), collate, device)
    loader = DataLoader(dataset, batch_size=256, shuffle=False, collate_fn=collate)
    parts = list(loader)
    return structures.concat([p[0] for p in parts]), structures.concat([p[1] for p in parts])


def _check_resident_room(dataset: MapStyle, collate: Callable[[list[Any]], Any] | None, device: Any) -> None:
    """Refuse ``loader.resident=true`` for a dataset whose first samples say it would not fit where it would live."""
    sample = (collate or default_collate)([dataset[i] for i in range(min(8, len(dataset)))])
    if not structures.only_tensors(sample):
        raise ConfigError(
            "loader.resident",
            True,
            f"false for batches of {structures.describe(sample)}: a resident dataset is tensors alone, cut by index",
        )
    needs = (structures.sample_bytes(sample) or 0) * len(dataset)
    fix = "loader.resident=false (the DataLoader reads it as it goes), or a smaller dataset"
    check_data(f"loader.resident=true with {len(dataset):,} samples", needs, fix)
    if device is not None and device.type == "cuda":
        free = free_memory(device)
        if needs > free.bytes:
            raise DoesNotFit(
                f"loader.resident=true with {len(dataset):,} samples needs about {size(needs)} on {device}, but "
                f"{size(free.bytes)} is {free.where}: {fix}"
            )


def first_batch(dataset: Dataset, size: int, collate: Callable[[list[Any]], Any] | None = None) -> Batch:
    """The dataset's first ``size`` samples as one batch (a slice of tensor datasets; decoded otherwise)."""
    if isinstance(dataset, TensorDataset):
        images, labels = dataset.tensors
        return images[:size], labels[:size]
    items = []
    sized = cast(MapStyle, dataset)
    for item in dataset if isinstance(dataset, IterableDataset) else (sized[i] for i in range(len(sized))):
        items.append(item)
        if len(items) == size:
            break
    batch = (collate or default_collate)(items)
    return batch[0], batch[1]
