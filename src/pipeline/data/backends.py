"""The loader backends by name: ``loader.backend`` chooses the function that makes a split's ``Batches``.

    python -m pipeline loader.backend=resident          # or loader=resident, which says loader.resident=true

A backend of your own is one module with a function ``make(split, cfg, place) -> Batches`` (``pipeline.data.batches``:
batches with a ``kind``, ``set_epoch``, ``close``, a length and an iterator), one YAML file in ``conf/loader/``
naming it in ``backend:``, and one line that registers it, ``register("name", make)``, run before the run is built
(the module that defines it, imported by the code that starts the run). The built-in ones are registered below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.common.errors import ConfigError
from pipeline.config import DATALOADER, RESIDENT, LoaderConfig
from pipeline.data import loaders
from pipeline.data.batches import Batches, Place, Split

Factory = Callable[[Split, LoaderConfig, Place], Batches]


@dataclass(frozen=True)
class Backend:
    make: Factory
    # its batches are on the training device already: nothing for a prefetcher to copy, and the loop's wait for data
    # is the time to cut a batch (the summary says so)
    on_device: bool = False


BACKENDS: dict[str, Backend] = {
    DATALOADER: Backend(loaders.dataloader),
    RESIDENT: Backend(loaders.resident, on_device=True),
}


def register(name: str, make: Factory, *, on_device: bool = False) -> None:
    """Make ``make`` the backend ``loader.backend=<name>`` chooses.

    Raises:
        ValueError: ``name`` is ``auto`` or taken by another backend.
    """
    if name == "auto" or (name in BACKENDS and BACKENDS[name].make is not make):
        raise ValueError(f"loader backend {name!r} is taken: choose another name (taken: auto, {', '.join(BACKENDS)})")
    BACKENDS[name] = Backend(make, on_device=on_device)


def backend_of(cfg: LoaderConfig) -> Backend:
    """The backend ``loader.backend`` names.

    Raises:
        ConfigError: naming loader.backend and the known backends.
    """
    name = cfg.backend_name
    if name not in BACKENDS:
        known = ", ".join(["auto", *sorted(BACKENDS)])
        raise ConfigError(
            "loader.backend", name, f"one of {known} (others are added with pipeline.data.backends.register)"
        )
    return BACKENDS[name]


def make_batches(split: Split, cfg: LoaderConfig, place: Place) -> Batches:
    """One split's batches, made by the backend ``loader.backend`` names (this rank's share, under DDP)."""
    return backend_of(cfg).make(split, cfg, place)


def on_device(kind: str) -> bool:
    """Whether batches of this ``kind`` (``Batches.kind``) are on the training device already (``resident``)."""
    backend = BACKENDS.get(kind)
    return backend is not None and backend.on_device
