"""Datasets and the batches the loop consumes (see ``sources``, ``loaders``, ``prefetch`` and ``augment``)."""

from pipeline.data.augment import CropFlip, make_augment
from pipeline.data.loaders import (
    AsGiven,
    EpochLoader,
    EpochOrder,
    Normalize,
    ResidentLoader,
    first_batch,
    make_loader,
)
from pipeline.data.prefetch import DevicePrefetcher, with_prefetch
from pipeline.data.sources import DataBundle, DataSpec, load_data
from pipeline.data.workers import LoaderError

__all__ = [
    "AsGiven",
    "CropFlip",
    "DataBundle",
    "DataSpec",
    "DevicePrefetcher",
    "EpochLoader",
    "EpochOrder",
    "LoaderError",
    "Normalize",
    "ResidentLoader",
    "first_batch",
    "load_data",
    "make_augment",
    "make_loader",
    "with_prefetch",
]
