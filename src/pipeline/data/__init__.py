"""Datasets and the batches the loop consumes (see ``sources`` and ``loaders``)."""

from pipeline.data.loaders import (
    EpochLoader,
    EpochOrder,
    LoaderError,
    Normalize,
    ResidentLoader,
    first_batch,
    make_loader,
)
from pipeline.data.sources import DataBundle, DataSpec, load_data

__all__ = [
    "DataBundle",
    "DataSpec",
    "EpochLoader",
    "EpochOrder",
    "LoaderError",
    "Normalize",
    "ResidentLoader",
    "first_batch",
    "load_data",
    "make_loader",
]
