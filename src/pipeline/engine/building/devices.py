"""Which device a run trains on, and why.

``resolve_device(cfg.device)`` turns ``device=auto|cpu|cuda|mps`` into a ``torch.device``.
A device that was asked for and is not usable is a ``DeviceError`` that says what was found;
there is no silent fallback to the CPU. Only ``device=auto`` chooses, and it says why.
"""

from __future__ import annotations

import logging
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from pipeline.common.errors import DeviceError
from pipeline.config import DeviceConfig

log = logging.getLogger("pipeline.engine.devices")  # the name its lines have always shown


@dataclass(frozen=True)
class GpuFact:
    """One CUDA device as torch numbers it (after ``CUDA_VISIBLE_DEVICES``)."""

    index: int
    name: str
    total_memory_mb: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class DeviceChoice:
    """The device a run uses, its human-readable name, and why it was picked."""

    device: torch.device
    name: str
    reason: str

    @property
    def type(self) -> str:
        return self.device.type


def cuda_devices() -> list[GpuFact]:
    """The CUDA devices torch can use; empty when CUDA is not usable. Does not create a context."""
    if not torch.cuda.is_available():
        return []
    facts = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        facts.append(GpuFact(index, props.name, props.total_memory // 2**20, (props.major, props.minor)))
    return facts


def mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


@cache
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def resolve_device(cfg: DeviceConfig, *, explain: Callable[[], str] = lambda: "") -> DeviceChoice:
    """Pick the run's device as configured.

    Args:
        cfg: the device group.
        explain: when CUDA was asked for and is unusable, the diagnosis to add to the error (the
            doctor's main finding; passed in, so this module does not depend on the doctor).

    Raises:
        DeviceError: ``cuda`` or ``mps`` was asked for and is not usable, or the index is out of range.
    """
    if cfg.name == "cpu":
        return DeviceChoice(torch.device("cpu"), cpu_name(), "device=cpu requested")
    if cfg.name == "cuda":
        gpus = cuda_devices()
        if not gpus:
            finding = explain()
            raise DeviceError(
                f"device=cuda requested, but CUDA is not usable: {_cuda_findings()}"
                + (f". The doctor finds {finding}" if finding else ". Run python -m pipeline.doctor for the checks")
            )
        index = cfg.index or 0
        if index >= len(gpus):
            raise DeviceError(
                f"device.index={index} requested, but torch sees {len(gpus)} CUDA device(s): "
                + ", ".join(f"{g.index}: {g.name}" for g in gpus)
            )
        gpu = gpus[index]
        return DeviceChoice(torch.device("cuda", index), gpu.name, f"device=cuda device.index={index} requested")
    if cfg.name == "mps":
        if not mps_available():
            built = getattr(torch.backends, "mps", None) and torch.backends.mps.is_built()
            raise DeviceError(
                "device=mps requested, but MPS is not usable: "
                + (
                    "torch is built with MPS but macOS reports no Metal device"
                    if built
                    else f"this torch build has no MPS support (platform {platform.system()} {platform.machine()})"
                )
                + ". Use device=cpu or device=auto."
            )
        return DeviceChoice(torch.device("mps"), "Apple MPS", "device=mps requested")
    return _auto()


def activate(device: torch.device) -> None:
    """Make ``device`` the target of every implicit CUDA call, and start its memory figures afresh.

    Without ``set_device``, calls that take the *current* device (streams, events, ``empty_cache``,
    new contexts) would go to GPU 0 while the run trains on another. The allocator's peaks and its
    counters (``num_alloc_retries``: cudaMalloc retried after freeing the cache) are per process:
    reset here, each run (and each in-process sweep job) reports its own, not the jobs' before it.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)


def cudnn_version() -> tuple[int | None, str | None]:
    """cuDNN's version, or None; and the error when cuDNN refuses this machine's GPU (it raises then)."""
    try:
        return (torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None), None
    except RuntimeError as err:  # e.g. "cuDNN version 92400 is not compatible with devices with SM < 7.5"
        return None, " ".join(str(err).split())


def _auto() -> DeviceChoice:
    gpus = cuda_devices()
    if gpus:
        best = max(gpus, key=lambda g: (g.total_memory_mb, -g.index))
        reason = f"auto: CUDA device {best.index} has the most memory ({best.total_memory_mb} MB)"
        if len(gpus) > 1:
            reason += " of " + ", ".join(f"{g.index}: {g.name} {g.total_memory_mb} MB" for g in gpus)
        return DeviceChoice(torch.device("cuda", best.index), best.name, reason)
    if mps_available():
        return DeviceChoice(torch.device("mps"), "Apple MPS", "auto: no CUDA device; Apple MPS is available")
    return DeviceChoice(torch.device("cpu"), cpu_name(), f"auto: no CUDA or MPS device ({_cuda_findings()})")


def _cuda_findings() -> str:
    """What stands between torch and a GPU, in one clause (no CUDA context is created)."""
    build = f"torch {torch.__version__}"
    build += f" built for CUDA {torch.version.cuda}" if torch.version.cuda else " is a CPU-only build"
    smi = shutil.which("nvidia-smi")
    driver = f"nvidia-smi at {smi}" if smi else "no nvidia-smi on PATH (no NVIDIA driver installed?)"
    return f"{build}, sees {torch.cuda.device_count()} CUDA device(s); {driver}"
