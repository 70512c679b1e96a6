"""GPU readings for the sampler: NVML in-process, GPUtil through ``nvidia-smi``, or nothing.

A backend reads only the GPUs the run uses, matched to torch's devices by UUID (NVML and
``nvidia-smi`` count in PCI order; CUDA renumbers under ``CUDA_VISIBLE_DEVICES``). Whatever goes
wrong — a missing library, a missing or hung ``nvidia-smi``, a driver error, ``[N/A]``, NVML's
NotSupported on MIG devices — costs one warning and leaves that field empty; it never raises
into training.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.common.messages import brief

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuTarget:
    """A GPU the run uses: torch's index and the UUID that NVML and nvidia-smi know it by."""

    index: int
    uuid: str


@dataclass(frozen=True)
class GpuReading:
    index: int  # torch's index
    util_pct: float | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None


class GpuBackend(Protocol):
    name: str

    def read(self) -> list[GpuReading]: ...
    def close(self) -> None: ...


class NoGpu:
    """No GPU fields: the CPU-only case and ``monitor.backend=none``."""

    name = "none"

    def read(self) -> list[GpuReading]:
        return []

    def close(self) -> None:
        pass


class Warnings:
    """One warning per distinct problem, however often the sampler meets it."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def once(self, key: str, message: str, *args: object) -> None:
        if key not in self._seen:
            self._seen.add(key)
            log.warning(message, *args)


def normalize_uuid(uuid: Any) -> str:
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text.lower().removeprefix("gpu-")


class NvmlBackend:
    """nvidia-ml-py (``pynvml``): about a tenth of a millisecond per reading, no subprocess."""

    name = "nvml"

    def __init__(self, targets: list[GpuTarget], nvml: Any = None) -> None:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        self.nvml = nvml
        self.warnings = Warnings()
        nvml.nvmlInit()
        by_uuid = {}
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            by_uuid[normalize_uuid(nvml.nvmlDeviceGetUUID(handle))] = handle
        self.handles = []
        for target in targets:
            handle = by_uuid.get(normalize_uuid(target.uuid))
            if handle is None:
                self.warnings.once(
                    f"uuid{target.index}",
                    "NVML does not list CUDA device %d (UUID %s); its GPU fields stay empty",
                    target.index,
                    target.uuid,
                )
            else:
                self.handles.append((target.index, handle))

    def read(self) -> list[GpuReading]:
        return [self._read_one(index, handle) for index, handle in self.handles]

    def _read_one(self, index: int, handle: Any) -> GpuReading:
        nvml = self.nvml
        util = self._field(index, "utilization", lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        memory = self._field(index, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        temp_c = self._field(index, "temperature", lambda: float(nvml.nvmlDeviceGetTemperature(handle, 0)))
        power = self._field(index, "power", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        limit = self._field(index, "power limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0)
        return GpuReading(
            index,
            util_pct=util,
            mem_used_mb=memory.used / 1e6 if memory else None,
            mem_total_mb=memory.total / 1e6 if memory else None,
            temp_c=temp_c,
            power_w=power,
            power_limit_w=limit,
        )

    def _field(self, index: int, what: str, read: Any) -> Any:
        try:
            return read()
        except self.nvml.NVMLError as err:  # NotSupported on MIG slices, Unknown on a lost GPU, ...
            self.warnings.once(
                f"{what}{index}", "NVML cannot read %s of CUDA device %d (%s); left empty", what, index, err
            )
            return None

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


class GputilBackend:
    """GPUtil 1.4: runs ``nvidia-smi`` per reading (10-20 ms), in a helper thread with a deadline.

    GPUtil waits forever on a hung ``nvidia-smi``; the deadline keeps the sampler on time, and no
    new call starts until the hung one returns. ``close`` kills an ``nvidia-smi`` still hanging.
    """

    name = "gputil"

    def __init__(self, targets: list[GpuTarget], *, timeout_s: float) -> None:
        import GPUtil  # 1.4.0 imports distutils: fails on Python 3.12+ without setuptools

        self.gputil = GPUtil
        self.targets = {normalize_uuid(t.uuid): t.index for t in targets}
        self.timeout_s = timeout_s
        self.warnings = Warnings()
        self._hung: threading.Thread | None = None

    def read(self) -> list[GpuReading]:
        if self._hung is not None and self._hung.is_alive():
            return []
        box: dict[str, Any] = {}
        worker = threading.Thread(target=self._call, args=(box,), name="gputil-nvidia-smi", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            self._hung = worker
            self.warnings.once(
                "hung", "nvidia-smi did not answer within %.1f s; GPU fields left empty until it does", self.timeout_s
            )
            return []
        if "error" in box:
            self.warnings.once("error", "GPUtil could not read nvidia-smi (%s); GPU fields left empty", box["error"])
            return []
        readings = []
        for gpu in box["gpus"]:
            index = self.targets.get(normalize_uuid(gpu.uuid))
            if index is not None:
                readings.append(
                    GpuReading(
                        index,
                        util_pct=_finite(gpu.load * 100),
                        mem_used_mb=_finite(gpu.memoryUsed * 1.048576),
                        mem_total_mb=_finite(gpu.memoryTotal * 1.048576),
                        temp_c=_finite(gpu.temperature),
                    )
                )  # nvidia-smi reports MiB; system metrics use MB (1e6 bytes) as MLflow's do
        if not readings:
            self.warnings.once("none", "nvidia-smi lists none of this run's GPUs; GPU fields left empty")
        return readings

    def _call(self, box: dict[str, Any]) -> None:
        try:
            box["gpus"] = self.gputil.getGPUs()
        except Exception as err:  # GPUtil parses nvidia-smi's text: a driver error is a ValueError
            box["error"] = brief(err)

    def close(self) -> None:
        if self._hung is not None and self._hung.is_alive():
            import psutil

            for child in psutil.Process().children(recursive=True):
                try:
                    if child.name() == "nvidia-smi":
                        for proc in [*child.children(recursive=True), child]:
                            proc.kill()
                except psutil.Error:  # it exited on its own meanwhile
                    continue


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def open_backend(name: str, targets: list[GpuTarget], *, timeout_s: float) -> GpuBackend:
    """The configured backend for ``targets``; ``auto`` tries NVML, then GPUtil. Never raises."""
    if not targets or name == "none":
        return NoGpu()
    warnings = Warnings()
    for candidate in ["nvml", "gputil"] if name == "auto" else [name]:
        try:
            if candidate == "nvml":
                return NvmlBackend(targets)
            return GputilBackend(targets, timeout_s=timeout_s)
        except Exception as err:  # ImportError, NVMLError_LibraryNotFound, a distutils-less Python, ...
            warnings.once(candidate, "GPU monitoring through %s is unavailable (%s)", candidate, brief(err))
    log.warning("GPU utilisation will not be recorded (monitor.backend=%s); CPU and RAM still are", name)
    return NoGpu()
