"""What the loop consumes, whichever backend made it: ``Batches``, and what a backend is asked for (``Split``, on a
``Place``).

A backend (``pipeline.data.backends``: ``loader.backend``) is a function ``(split, cfg, place) -> Batches``; the
built-in ones are torch's DataLoader (``EpochLoader``, ``IterableLoader``) and the resident tensors
(``ResidentLoader``), each maybe behind a ``DevicePrefetcher``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset


class Batches(Protocol):
    """One split's batches for the loop: ``set_epoch`` before each epoch, then ``len`` batches of ``(inputs,
    targets)``; ``close`` ends what the batches keep running (loader workers) with the run."""

    @property
    def kind(self) -> str:
        """The name of the backend that made them (``loader.backend``'s resolved name: ``dataloader``,
        ``resident``, or a registered one): what the record and the summary read, never the class."""
        ...

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        """Use ``epoch``'s order and pass over its first ``skip`` batches (resume)."""
        ...

    def close(self) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


@dataclass(frozen=True)
class Place:
    """Where a run's batches go and whose they are: the same for each split of one run."""

    device: torch.device  # where training runs (resident data is moved there; pinning only for CUDA)
    seed: int  # seeds the shuffling: the same seed, the same order
    rank: int = 0  # this process's rank under DDP; loader.batch_size is per rank
    world: int = 1  # the number of ranks


@dataclass(frozen=True)
class Split:
    """One split as a backend is asked for it."""

    dataset: Dataset  # yields (uint8 image [C, H, W], label), or the user's items (``collate`` batches them)
    train: bool  # shuffle and honour drop_last (validation does neither)
    collate: Callable[[list[Any]], Any] | None = None  # the user's items into (inputs, targets); None = torch's
    steps: int | None = None  # an iterable dataset's batches per epoch (None: one pass, for validation)
