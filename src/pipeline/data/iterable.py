"""Iterable datasets (``torch.utils.data.IterableDataset``): a fixed number of batches an epoch, and each rank's and
worker's share checked at start-up.

    python -m pipeline data=custom data._target_=streams.make data.steps_per_epoch=500

An iterable dataset decides itself which items each process reads: PyTorch hands every loader worker its own copy,
and under DDP every rank runs its own loader. So the dataset must deal out its items: each worker by
``torch.utils.data.get_worker_info()`` (``id`` of ``num_workers``), each rank by ``torch.distributed.get_rank()``
of ``get_world_size()`` (docs/your-own-model.md shows how). Forgetting it makes every worker, or every rank, train on
the same items: ``check_shares`` reads the first batch of two workers and of every rank and refuses identical ones.

An epoch is ``data.steps_per_epoch`` batches (default: ``len(dataset)`` over the batch size and the ranks); a stream
that runs out first starts again, so every rank steps as often as the others (DDP's collectives never wait for a rank
that has stopped). A dataset with ``set_epoch(epoch)`` is told each epoch's number; resuming inside an epoch reads
and drops the batches trained before the stop (a stream cannot skip without reading).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from pipeline.common.errors import DatasetError
from pipeline.config import DATALOADER, LoaderConfig
from pipeline.data import structures
from pipeline.data.workers import WatchedLoader, leave_ctrl_c_to_the_trainer

log = logging.getLogger(__name__)


class IterableLoader:
    """An iterable dataset's batches: ``steps`` of them an epoch (training), or one whole pass (``steps=None``)."""

    kind = DATALOADER  # the DataLoader backend's, over a stream

    def __init__(
        self,
        dataset: IterableDataset,
        cfg: LoaderConfig,
        *,
        collate: Callable[[list[Any]], Any] | None,
        steps: int | None,
        pin: bool,
        seed: int,
        start_method: str | None,
    ) -> None:
        import torch

        self.dataset, self.steps = dataset, steps
        self.epoch, self.skip = 1, 0
        self.loader = WatchedLoader(
            dataset,
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            pin_memory=pin,
            persistent_workers=cfg.persistent_workers,
            prefetch_factor=cfg.prefetch_factor,
            drop_last=cfg.drop_last,
            timeout=cfg.timeout,
            generator=torch.Generator().manual_seed(seed),
            multiprocessing_context=start_method,
            worker_init_fn=leave_ctrl_c_to_the_trainer,
            collate_fn=collate,
        )
        self._restarted = False

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size or 1

    def close(self) -> None:
        """End the loader's persistent workers (``WatchedLoader.close``)."""
        self.loader.close()

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        """Epoch ``epoch``, less its first ``skip`` batches (read and dropped: a stream cannot skip)."""
        self.epoch, self.skip = epoch, skip
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        if self.steps is None:
            return len(self.loader)  # TypeError without a length, as for any unsized iterable
        return self.steps - self.skip

    def __iter__(self) -> Iterator[Any]:
        if self.steps is None:
            yield from self.loader
            return
        stream, drawn = iter(self.loader), 0
        while drawn < self.steps:
            try:
                batch = next(stream)
            except StopIteration:
                stream = self._restart(drawn)
                continue
            drawn += 1
            if drawn > self.skip:
                yield batch

    def _restart(self, drawn: int) -> Iterator[Any]:
        if drawn == 0:
            raise DatasetError("the training set's iterator yielded no batch: nothing to train on")
        if not self._restarted:
            log.warning(
                "the training stream ran out after %d of the epoch's %d batches (data.steps_per_epoch): it starts "
                "again, so every rank steps as often as the others",
                drawn,
                self.steps,
            )
            self._restarted = True
        return iter(self.loader)


def steps_per_epoch(dataset: IterableDataset, *, configured: int | None, batch_size: int, world: int) -> int:
    """``data.steps_per_epoch``, or ``len(dataset)`` (all ranks' items together) over the batch size and the ranks.

    Raises:
        DatasetError: no length and no ``data.steps_per_epoch``.
    """
    if configured is not None:
        return configured
    try:
        items = len(dataset)  # type: ignore[arg-type]  # an iterable dataset may define __len__; TypeError if not
    except TypeError:
        raise DatasetError(
            f"the training set is an iterable dataset ({type(dataset).__name__}) without __len__: say how many "
            f"batches make an epoch with data.steps_per_epoch=N"
        ) from None
    return max(1, math.ceil(items / (batch_size * world)))


def check_shares(
    dataset: IterableDataset,
    cfg: LoaderConfig,
    *,
    collate: Callable[[list[Any]], Any] | None,
    gather: Callable[[Any], list[Any]],
    world: int,
) -> None:
    """Refuse an iterable dataset whose workers, or whose ranks, all yield the same items: the first batch of two
    workers (with ``loader.num_workers >= 2``), and of every rank (under DDP), must differ.

    Raises:
        DatasetError: naming who yields the same items and how a dataset deals them out.
    """
    how = (
        "deal its items out in __iter__: each worker by torch.utils.data.get_worker_info() (id of num_workers), "
        "each rank by torch.distributed.get_rank() of get_world_size() (docs/your-own-model.md)"
    )
    if world > 1:
        first = next(iter(DataLoader(dataset, batch_size=cfg.batch_size, collate_fn=collate)), None)
        digests = gather(structures.digest([first]) if first is not None else "")
        if len(set(digests)) == 1:
            raise DatasetError(f"every one of the {world} ranks yields the same training items: {how}")
    if cfg.num_workers >= 2:
        method = None if cfg.multiprocessing_context == "auto" else cfg.multiprocessing_context
        loader = DataLoader(
            dataset, batch_size=cfg.batch_size, collate_fn=collate, num_workers=2, multiprocessing_context=method
        )
        batches = []
        for batch in loader:  # the DataLoader takes batches from its workers in turn: worker 0's, then worker 1's
            batches.append(structures.digest([batch]))
            if len(batches) == 2:
                break
        if len(batches) == 2 and batches[0] == batches[1]:
            raise DatasetError(f"the loader's workers all yield the same training items (loader.num_workers=2): {how}")
