"""Which loader settings to time: the worker ladder, pinned memory on CUDA only, resident when it fits.

The worker ladder is 0, 1, 2, 4, ... up to the CPUs this process may use divided by ``LOCAL_WORLD_SIZE``
(``worker_limit``); ``pin_memory`` is varied on CUDA only; ``resident`` is a candidate when the dataset fits in
half the free memory (``resident_fits``). ``candidates`` lists what the first round of ``search.tune`` times.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from pipeline.common.device_memory import free_memory
from pipeline.common.errors import PipelineError
from pipeline.config import LoaderConfig, RunConfig

RESIDENT_SHARE = 0.5  # resident only if the dataset takes at most this share of the free memory (model, batches)


@dataclass(frozen=True)
class Candidate:
    """One configuration to time: the run's own ``RunConfig`` with its loader group replaced by ``loader`` and the
    keys of ``changes`` set (``python -m pipeline.tune``: ``(("amp", True),)``); autotune's have loader changes only.

    ``name`` is the short name the tables print ("" = ``describe``'s, from the loader)."""

    loader: LoaderConfig
    oom_fallback: bool = True  # false while searching the batch size: an out-of-memory error must surface
    changes: tuple[tuple[str, Any], ...] = ()  # (dotted key, value) beyond the loader group, in override order
    name: str = ""

    def config(self, base: RunConfig) -> RunConfig:
        """``base`` as this candidate runs it, validated as a whole (a micro-batch over the batch is refused)."""
        cfg = dataclasses.replace(base, loader=self.loader)
        for key, value in self.changes:
            cfg = _replaced(cfg, key.split("."), value)
        cfg.check()
        return cfg

    def overrides(self, current: LoaderConfig) -> list[str]:
        """The overrides that make this candidate from the run: the loader keys it changes, then ``changes``."""
        loader = [
            f"loader.{f.name}={yaml_value(getattr(self.loader, f.name))}"
            for f in dataclasses.fields(LoaderConfig)
            if getattr(self.loader, f.name) != getattr(current, f.name)
        ]
        return loader + [f"{key}={yaml_value(value)}" for key, value in self.changes]


def _replaced(node: Any, path: list[str], value: Any) -> Any:
    """``node`` (a frozen config dataclass) with the key at ``path`` set to ``value``."""
    head, *rest = path
    return dataclasses.replace(node, **{head: _replaced(getattr(node, head), rest, value) if rest else value})


def yaml_value(value: Any) -> str:
    """A value as an override or YAML spells it: ``true``, ``null``, ``0.5``, ``4``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class Machine:
    """What the candidates depend on."""

    device_type: str  # pinned memory is a candidate on cuda only
    max_workers: int  # the worker ladder's top: ``worker_limit()``
    resident_fits: bool  # ``resident_fits()``: loader.resident=true is a candidate
    max_batch_size: int = 4096  # the batch-size search stops here (and at the training set's size)


def worker_limit() -> int:
    """Loader workers this process may use: its CPUs (affinity, where the OS has it) over ``LOCAL_WORLD_SIZE``.

    Raises:
        PipelineError: ``LOCAL_WORLD_SIZE`` is not a positive integer.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(raw) if raw.strip().isdigit() else 0
    if ranks < 1:
        raise PipelineError(
            f"LOCAL_WORLD_SIZE={raw!r} is not allowed: expected a positive integer (the training processes on "
            "this machine, which share its CPUs)"
        )
    return cpus // ranks


def worker_ladder(limit: int) -> list[int]:
    """0, 1, 2, 4, ... up to ``limit``, and ``limit`` itself: 6 -> [0, 1, 2, 4, 6]."""
    ladder, workers = [0], 1
    while workers <= limit:
        ladder.append(workers)
        workers *= 2
    if limit > ladder[-1]:
        ladder.append(limit)
    return ladder


def candidates(current: LoaderConfig, machine: Machine, *, batch_size: int | None = None) -> list[Candidate]:
    """What the first round times, in order: the current setting, resident, then the worker ladder.

    Variants take ``batch_size`` (default: the current one) and keep the user's ``drop_last``; workers are
    persistent unless the user runs workers without (as training will), and pinned memory is varied on CUDA only.
    """
    base = dataclasses.replace(current, batch_size=batch_size or current.batch_size)
    had = current.num_workers > 0 and not current.resident
    found = [current]
    if machine.resident_fits:
        pin = "auto" if base.pin_memory is True else base.pin_memory  # resident refuses pin_memory=true
        no_workers = {
            "num_workers": 0,
            "persistent_workers": False,
            "prefetch_factor": None,
            "timeout": 0.0,
            "multiprocessing_context": "auto",
        }
        found.append(dataclasses.replace(base, resident=True, pin_memory=pin, **no_workers))
    pins = [current.pin_memory]
    if machine.device_type == "cuda":  # "auto" pins on CUDA: kept as the user spelled it
        pins = ["auto" if current.pin_memory == "auto" else True, False]
    for workers in worker_ladder(machine.max_workers):
        for pin in pins:
            found.append(
                dataclasses.replace(
                    base,
                    resident=False,
                    num_workers=workers,
                    pin_memory=pin,
                    persistent_workers=workers > 0 and (current.persistent_workers if had else True),
                    prefetch_factor=(current.prefetch_factor if had else 2) if workers else None,
                    timeout=current.timeout if workers and had else 0.0,
                    multiprocessing_context=current.multiprocessing_context if workers else "auto",
                )
            )
    for loader in found:
        loader.check()  # a variant the run itself would refuse is a bug here, not a measurement
    return [Candidate(loader) for loader in dict.fromkeys(found)]


def prefetch_variant(loader: LoaderConfig) -> LoaderConfig:
    """The same workers with the other of prefetch_factor 2 (PyTorch's default) and 4."""
    return dataclasses.replace(loader, prefetch_factor=2 if (loader.prefetch_factor or 2) == 4 else 4)


def resident_fits(spec: Any, device: Any) -> bool:
    """Whether ``loader.resident=true`` is worth a trial: the dataset (``DataSpec``) can be held whole (map-style, of
    tensors alone), and both splits take at most ``RESIDENT_SHARE`` of the memory free where they would live (the
    CUDA device's, else the host's, which MPS shares)."""
    needs = spec.resident_bytes
    return needs is not None and needs <= RESIDENT_SHARE * free_memory(device).bytes


def describe(candidate: Candidate, current: Candidate) -> str:
    """A short name: ``resident``, ``workers=4``, ``workers=4 unpinned prefetch=4 batch=256``; a named candidate's
    own (``amp``)."""
    if candidate.name:
        return candidate.name
    loader = candidate.loader
    parts = ["resident"] if loader.resident else [f"workers={loader.num_workers}"]
    if loader.pin_memory is False:
        parts.append("unpinned")
    elif loader.pin_memory is True and not loader.resident:
        parts.append("pinned")
    if loader.num_workers and not loader.persistent_workers:
        parts.append("not-persistent")
    if loader.num_workers and (loader.prefetch_factor or 2) != 2:
        parts.append(f"prefetch={loader.prefetch_factor}")
    if loader.batch_size != current.loader.batch_size:
        parts.append(f"batch={loader.batch_size}")
    return " ".join(parts)
