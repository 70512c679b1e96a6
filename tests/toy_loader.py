"""A loader backend of the tests' own (``loader.backend=toy``): a map-style dataset's samples in their order, cut
into batches of ``loader.batch_size`` in the training process, each batch counted as it is served."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import default_collate

from pipeline.config import LoaderConfig
from pipeline.data import Place, Split

NAME = "toy"


class ToyBatches:
    """Batches of ``batch_size`` samples in the dataset's order; ``served`` counts those the loop drew."""

    kind = NAME

    def __init__(self, dataset: Any, batch_size: int, collate: Any) -> None:
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collate or default_collate
        self.skip, self.served, self.epochs, self.closed = 0, 0, [], False

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        self.epochs.append(epoch)
        self.skip = skip

    def close(self) -> None:
        self.closed = True

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size) - self.skip

    def __iter__(self) -> Iterator[Any]:
        for start in range(self.skip * self.batch_size, len(self.dataset), self.batch_size):
            stop = min(start + self.batch_size, len(self.dataset))
            self.served += 1
            yield self.collate([self.dataset[i] for i in range(start, stop)])


MADE: list[ToyBatches] = []  # every ToyBatches made, training's and validation's, in order


def make(split: Split, cfg: LoaderConfig, place: Place) -> ToyBatches:
    batches = ToyBatches(split.dataset, cfg.batch_size, split.collate)
    MADE.append(batches)
    return batches
