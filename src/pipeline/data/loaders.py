"""Batches for the loop: the torch DataLoader path and the resident path.

Both yield ``(images, labels)``; the loop copies them to the device (a no-op for resident
batches, which are there already) and ``Normalize`` turns uint8 pixels into normalised floats
on the device, one whole batch at a time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pipeline.config import LoaderConfig

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class ResidentLoader:
    """Batches cut by index from a dataset that lives on the device as two tensors.

    One shuffle per epoch (a permutation made on the CPU with a seeded generator, so the order
    does not depend on the device), then each batch is an index gather on the device: no
    per-sample Python, no collation, no host-to-device copy.
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
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        n = len(self.labels)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        n, size = len(self.labels), self.batch_size
        if not self.shuffle:
            for start in range(0, len(self) * size, size):
                yield self.images[start : start + size], self.labels[start : start + size]
            return
        order = torch.randperm(n, generator=self.generator).to(self.images.device, non_blocking=True)
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
    dataset: Dataset, cfg: LoaderConfig, *, device: torch.device, train: bool, seed: int
) -> Iterable[Batch]:
    """The batches of one split, as ``loader.*`` configures them.

    Args:
        dataset: yields ``(uint8 image [C, H, W], label)``.
        cfg: the loader group.
        device: where training runs (resident data is moved there; pinning only for CUDA).
        train: shuffle and honour ``drop_last`` (validation does neither).
        seed: seeds the shuffling, so the same seed gives the same order.
    """
    if cfg.resident:
        images, labels = materialize(dataset)
        return ResidentLoader(
            images.to(device),
            labels.to(device),
            batch_size=cfg.batch_size,
            shuffle=train,
            drop_last=train and cfg.drop_last,
            seed=seed,
        )
    if cfg.pin_memory is True and device.type != "cuda":
        log.warning(
            "loader.pin_memory=true has no effect on %s: pinned memory speeds up copies to CUDA only", device.type
        )
    pin = device.type == "cuda" and cfg.pin_memory in ("auto", True)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=train,
        num_workers=cfg.num_workers,
        pin_memory=pin,
        persistent_workers=cfg.persistent_workers,
        prefetch_factor=cfg.prefetch_factor,
        drop_last=train and cfg.drop_last,
        timeout=cfg.timeout,
        generator=torch.Generator().manual_seed(seed),
    )


def materialize(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """All samples as two tensors: free for tensor datasets, one decoding pass for image folders."""
    if isinstance(dataset, TensorDataset):
        images, labels = dataset.tensors
        return images, labels
    loader = DataLoader(dataset, batch_size=256, shuffle=False)
    parts = list(loader)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
