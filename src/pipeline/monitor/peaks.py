"""What the run's device can compute at most, per dtype: the denominator of MFU (``pipeline.engine.flops``).

- **A CUDA GPU**: the dense datasheet figure for the dtype the run computes in, from the table in
  ``pipeline.monitor.gpu_peaks``. A card not in the table gets no peak and the reason, never another card's.
- **A CPU**: no datasheet says what a given CPU, torch build and thread count reach, so the peak is *measured*: square
  matmuls (``torch.mm``, ``CPU_MATMUL_N`` a side, less for a dtype too slow for that in the budget) in the dtype,
  the best of repeats within ``CPU_BUDGET_S``. It is
  cached per machine, torch version, thread count and dtype in ``$XDG_CACHE_HOME/pipeline/cpu_peaks.json``
  (``~/.cache`` by default), so only a machine's first run pays it; ``python -m pipeline.doctor`` measures again.
  A peak measured while other processes used the CPUs reads low, and MFU against it reads high: the doctor's
  re-measurement on a quiet machine is the cure.
- **Apple MPS**: none (no table, no measurement yet), and the reason.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.common.atomic import write_text_atomic
from pipeline.monitor.gpu_peaks import gpu_peak, unknown_reason

log = logging.getLogger(__name__)

CPU_MATMUL_N = 1024  # a side of the measured matmuls: 2.1 GFLOP each, large enough for every core's kernels
CPU_BUDGET_S = 0.3  # per dtype: with the first (untimed) matmul, well under a second for fp32 and bf16
MAX_TIMED = 1000  # matmuls at most, whatever the clock says
PROBE_SIDE = 256  # the first size matmul_side times on the way up to CPU_MATMUL_N
CPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Peak:
    """The peak a run's MFU is read against: ``tflops`` None with ``reason`` when there is none."""

    dtype: str  # fp32, tf32, bf16, fp16: what the run computes in
    tflops: float | None
    holder: str = ""  # "this CPU", "this GPU"
    basis: str = ""  # where the figure comes from: "measured matmul, 2 threads", "H100 SXM datasheet"
    reason: str = ""  # why there is no peak (tflops None)

    @property
    def measured(self) -> bool:
        """Measured on this machine (a CPU's matmuls, cached), not read from a datasheet."""
        return self.basis.startswith("measured")

    @property
    def what(self) -> str:
        """``this GPU's bf16 peak (H100 SXM datasheet)``."""
        return f"{self.holder}'s {self.dtype} peak ({self.basis})"


def run_dtype(device: torch.device, autocast_dtype: torch.dtype | None) -> str:
    """The dtype the run's matmuls compute in: autocast's, else TF32 where CUDA's matmuls are allowed it (Ampere and
    newer with ``precision.tf32``, which sets the switch), else fp32."""
    if autocast_dtype is not None:
        return "bf16" if autocast_dtype == torch.bfloat16 else "fp16"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp32"
    return "fp32"


def device_peak(device: torch.device, dtype: str, *, device_name: str = "") -> Peak:
    """The peak of ``device`` in ``dtype``: a GPU's datasheet figure, a CPU's measured (or cached) one. ``device_name``
    is the device's as ``pipeline.engine.devices`` names it (a CPU's model name: what its cached peak is kept under);
    for a GPU, default ``torch.cuda.get_device_name``."""
    if device.type == "cpu":
        return cpu_peak(dtype, cpu=device_name)
    if device.type == "cuda":
        name = device_name or torch.cuda.get_device_name(device)
        entry = gpu_peak(name)
        if entry is None:
            return Peak(dtype, None, reason=unknown_reason(name))
        figure = entry.tflops.get(dtype)
        if figure is None:
            return Peak(dtype, None, reason=f"no MFU: the table has no {dtype} figure for the {entry.card}")
        return Peak(dtype, figure, "this GPU", f"{entry.card} datasheet")
    return Peak(dtype, None, reason=f"no MFU on {device.type}: no table of its peaks and no measurement of it yet")


def cpu_peak(dtype: str, *, cpu: str, refresh: bool = False, cache: Path | None = None) -> Peak:
    """This CPU's measured matmul peak in ``dtype`` at torch's current thread count, from the cache unless
    ``refresh`` (or not cached yet), which measures and stores it; ``cpu``: its model name
    (``pipeline.engine.devices.cpu_name``)."""
    if dtype not in CPU_DTYPES:
        return Peak(dtype, None, reason=f"no MFU: {dtype} is not measured on a CPU")
    path = cache or cache_file()
    key = machine_key(dtype, cpu)
    stored = _read(path)
    tflops = None if refresh else stored.get(key)
    if tflops is None:
        tflops = measure_cpu_matmul(CPU_DTYPES[dtype])
        stored[key] = tflops
        _write(path, stored)
    return Peak(dtype, tflops, "this CPU", f"measured matmul, {torch.get_num_threads()} thread(s)")


def measure_cpu_matmul(dtype: torch.dtype, *, n: int = CPU_MATMUL_N, budget_s: float = CPU_BUDGET_S) -> float:
    """TFLOP/s of the fastest of repeated square matmuls in ``dtype`` (2 side³ FLOPs each) within ``budget_s``,
    after one untimed one; at least three are timed. The fastest, not the median: the peak is what the CPU can do,
    and other processes only ever slow a matmul down. The side is ``n``, or less where one such matmul would take
    far longer than the budget (``matmul_side``: float16, emulated on most CPUs, took 2.5 s for 1024 a side)."""
    side = matmul_side(dtype, n=n, budget_s=budget_s)
    numbers = torch.Generator().manual_seed(0)  # its own: a run's random stream is the same, cached peak or not
    a, b = (torch.randn(side, side, generator=numbers).to(dtype) for _ in range(2))
    out = torch.empty(side, side, dtype=dtype)
    torch.mm(a, b, out=out)  # the first call pays for the kernel's set-up
    best, began, timed = float("inf"), time.perf_counter(), 0
    while timed < 3 or (time.perf_counter() - began < budget_s and timed < MAX_TIMED):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
        timed += 1
    return 2 * side**3 / max(best, 1e-9) / 1e12


def matmul_side(dtype: torch.dtype, *, n: int = CPU_MATMUL_N, budget_s: float = CPU_BUDGET_S) -> int:
    """The side to measure ``dtype`` at: doubled from ``PROBE_SIDE`` up to ``n`` while the next size's matmul (8x
    the arithmetic of the fastest of two of this size) would take at most ``budget_s``. A small matmul's rate says
    little of a large one's in some dtypes (bfloat16's kernels change with the size), so each size is timed."""
    side = min(n, PROBE_SIDE)
    while side < n:
        a = torch.randn(side, side, generator=torch.Generator().manual_seed(0)).to(dtype)
        torch.mm(a, a)  # set-up
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            torch.mm(a, a)
            best = min(best, time.perf_counter() - start)
        if 8 * best > budget_s:
            break
        side = min(n, 2 * side)
    return side


def machine_key(dtype: str, cpu: str) -> str:
    """What a measured CPU peak holds for: the CPU model, its logical CPUs, torch's version and thread count."""
    return f"{cpu}|{os.cpu_count()} cpus|torch {torch.__version__}|{torch.get_num_threads()} threads|{dtype}"


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipeline" / "cpu_peaks.json"


def _read(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and rewritten
    return {k: float(v) for k, v in data.items() if isinstance(v, int | float)} if isinstance(data, dict) else {}


def _write(path: Path, stored: dict[str, float]) -> None:
    try:
        write_text_atomic(path, json.dumps(stored, indent=1, sort_keys=True) + "\n")
    except OSError as err:  # a read-only home: the next run measures again, which costs it under a second
        log.info("the measured CPU peak could not be cached in %s (%s)", path, err)
