"""Datasets and the batches the loop consumes (see ``sources``, ``batches``, ``backends``, ``loaders``, ``prefetch`` and
``augment``)."""

from pipeline.data.augment import CropFlip, make_augment
from pipeline.data.backends import make_batches, register
from pipeline.data.batches import Batches, Place, Split
from pipeline.data.loaders import (
    AsGiven,
    EpochLoader,
    EpochOrder,
    Normalize,
    ResidentLoader,
    first_batch,
)
from pipeline.data.prefetch import DevicePrefetcher, with_prefetch
from pipeline.data.sources import DataBundle, DataSpec, load_data
from pipeline.data.workers import LoaderError

__all__ = [
    "AsGiven",
    "Batches",
    "CropFlip",
    "DataBundle",
    "DataSpec",
    "DevicePrefetcher",
    "EpochLoader",
    "EpochOrder",
    "LoaderError",
    "Normalize",
    "Place",
    "ResidentLoader",
    "Split",
    "first_batch",
    "load_data",
    "make_augment",
    "make_batches",
    "register",
    "with_prefetch",
]
