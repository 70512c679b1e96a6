"""Datasets and the batches the loop consumes (see ``sources`` and ``loaders``)."""

from pipeline.data.loaders import Normalize, ResidentLoader, make_loader
from pipeline.data.sources import DataBundle, DataSpec, load_data

__all__ = ["DataBundle", "DataSpec", "Normalize", "ResidentLoader", "load_data", "make_loader"]
