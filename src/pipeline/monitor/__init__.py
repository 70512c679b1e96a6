"""Utilisation monitoring: ``open_sampler(cfg.monitor, device=..., log_metrics=...)``.

See ``sampler`` (the thread, CPU/RAM through psutil, MLflow system-metric names) and ``gpu``
(NVML / GPUtil backends that never raise into training).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.common.metric_names import MEMORY_ALLOC_RETRIES, MEMORY_MAX_ALLOCATED_MB, MEMORY_MAX_RESERVED_MB
from pipeline.config import MonitorConfig
from pipeline.monitor.gpu import GpuTarget, open_backend
from pipeline.monitor.sampler import (
    BUSY_OTHERS_PCT,
    CLOCK_KEY,
    RankCpu,
    Sample,
    Sampler,
    UtilSummary,
    job_summary,
    rank_cpu,
    summarize,
    system_metrics,
)

__all__ = [
    "BUSY_OTHERS_PCT",
    "CLOCK_KEY",
    "GpuTarget",
    "NullSampler",
    "RankCpu",
    "Sample",
    "Sampler",
    "UtilSummary",
    "allocator_metrics",
    "gpu_targets",
    "job_summary",
    "open_sampler",
    "rank_cpu",
    "summarize",
    "system_metrics",
]


class NullSampler:
    """``monitor.enabled=false``: no thread, no samples."""

    alive = False

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def start(self) -> NullSampler:
        return self

    def stop(self) -> None:
        pass

    def now(self) -> float:
        return 0.0

    def summary(self, since: float = 0.0, until: float | None = None) -> UtilSummary:
        return summarize([])


def gpu_targets(device: torch.device) -> list[GpuTarget]:
    """The CUDA device(s) this run uses, with the UUIDs NVML and nvidia-smi know them by."""
    if device.type != "cuda":
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [GpuTarget(index, str(torch.cuda.get_device_properties(index).uuid))]


def open_sampler(
    cfg: MonitorConfig,
    *,
    device: torch.device,
    log_metrics: Callable[[dict[str, float], int], None],
    children: bool = False,
    after_step: int = 0,
) -> Sampler | NullSampler:
    """A started sampler for this run (or a do-nothing one when monitoring is off); ``after_step`` is the last
    system-metric step the run holds already (a resumed run's)."""
    if not cfg.enabled:
        return NullSampler()
    backend = open_backend(cfg.backend, gpu_targets(device), timeout_s=cfg.interval_s)
    return Sampler(
        interval_s=cfg.interval_s, gpu=backend, log_metrics=log_metrics, children=children, after_step=after_step
    ).start()


def allocator_metrics(device: torch.device) -> dict[str, float]:
    """torch's CUDA allocator peaks (MB = 1e6 bytes) and its retries after a failed cudaMalloc."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        MEMORY_MAX_ALLOCATED_MB: torch.cuda.max_memory_allocated(device) / 1e6,
        MEMORY_MAX_RESERVED_MB: torch.cuda.max_memory_reserved(device) / 1e6,
        MEMORY_ALLOC_RETRIES: float(stats.get("num_alloc_retries", 0)),
    }
