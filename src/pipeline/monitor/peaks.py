"""What the run's device can compute at most, per dtype: the denominator of MFU (``pipeline.engine.building.flops``).

- **A CUDA GPU**: the dense datasheet figure for the dtype the run computes in, from the table in
  ``pipeline.monitor.gpu_peaks``. A card not in the table gets no peak and the reason, never another card's.
- **A CPU**: no datasheet says what a given CPU, torch build and thread count reach, so the peak is *measured*: square
  matmuls (``torch.mm``, ``CPU_MATMUL_N`` a side, less for a dtype too slow for that) in fp32, bfloat16 and the run's
  dtype, taken in turns in one window of ``CPU_BUDGET_S`` (``measure_window``); each dtype's peak is its fastest repeat.
  Other processes only ever slow a matmul down, and one snapshot taken under load read 4x low (8 calls on a shared
  machine: fp32 0.039-0.175 TFLOP/s), so a window counts only when the machine was quiet in it: the CPU time other
  processes took from the CPUs the matmuls' threads need (psutil's ``/proc/stat`` on the CPUs this process may use, less
  its own and less the CPUs its threads leave free) at most ``QUIET_OTHERS_PCT``, and every dtype's median repeat within
  ``MAX_SPREAD`` of its fastest. A busy window is refused and not cached: the run's MFU is unknown, with the reason,
  rather than wrong. A quiet one is cached per machine, torch version and thread count in
  ``$XDG_CACHE_HOME/pipeline/cpu_peaks.json`` (``~/.cache`` by default), each figure with the time of the window that
  measured it: a run's ``perf.peak_measured``, by which ``pipeline.compare`` tells whether rows' MFU were read against
  one measurement. A later quiet window raises a lower cached figure and never lowers one; a figure older than torch's
  installed files is measured again. So a machine's first quiet run pays for it (about half a second); ``python -m
  pipeline.doctor`` measures again.
- **Apple MPS**: none (no table, no measurement yet), and the reason.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from pipeline.common.atomic import write_text_atomic
from pipeline.monitor.gpu_peaks import gpu_peak, unknown_reason

log = logging.getLogger(__name__)

CPU_MATMUL_N = 1024  # a side of the measured matmuls: 2.1 GFLOP each, large enough for every core's kernels
# The timed window, all its dtypes in turns: about 20 rounds of fp32 (12 ms) and bf16 (5 ms) on a 2-CPU AMD EPYC VM,
# 0.5 s in all with the sizing.
CPU_BUDGET_S = 0.4
MIN_ROUNDS = 5  # timed rounds at least, whatever the clock says: a median of fewer says little of the spread
MAX_ROUNDS = 1000
PROBE_SIDE = 256  # the first size matmul_side times on the way up to CPU_MATMUL_N
CPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Measured together in every window, whatever the run computes in: an amp=false and an amp=true run's MFU are then
# read against peaks of one moment (cached at different moments they were 8-17x apart, against 2.2x quietly).
WINDOW_DTYPES = ("fp32", "bf16")
# The most CPU time other processes may take from the CPUs the matmuls' threads need during a window that is kept,
# as a share of those CPUs' time (``others_pct``). A matmul's threads wait for each other, so a core taken from one
# of them for a moment stalls all: on the 2-CPU VM above, a burner spinning 1 ms in every 3 (the worst kind: no
# repeat escapes it) read 10-15% and put fp32 at 0.77-0.87 of its quiet figure; at 8-10%, 0.81-0.91; a burner
# 1 ms in 10 read 5-6%, at 0.97-1.00; a steady burner on one core read 27-48%, at 0.5-0.6. Quiet windows read 0-7%
# (/proc/stat counts in 10 ms ticks).
QUIET_OTHERS_PCT = 10.0
# The most a dtype's median repeat may take over its fastest in a kept window. Quiet, 1.02-1.18 (fp32 and bf16 at
# 1024 a side, 2 threads). A steady neighbour slows every repeat alike (the others' CPU time shows it); this catches
# load that the CPU counters do not see, such as another VM's.
MAX_SPREAD = 1.5


@dataclass(frozen=True)
class Peak:
    """The peak a run's MFU is read against: ``tflops`` None with ``reason`` when there is none."""

    dtype: str  # fp32, tf32, bf16, fp16: what the run computes in
    tflops: float | None
    holder: str = ""  # "this CPU", "this GPU"
    basis: str = ""  # where the figure comes from: "measured matmul, 2 threads", "H100 SXM datasheet"
    reason: str = ""  # why there is no peak (tflops None)
    measured_at: str = ""  # a measured peak's window (UTC, ISO 8601): which measurement it is; "" for a datasheet's

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
    is the device's as ``pipeline.engine.building.devices`` names it (a CPU's model name: what its cached peak is kept
    under); for a GPU, default ``torch.cuda.get_device_name``."""
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


@dataclass(frozen=True)
class Figure:
    """A cached CPU peak: TFLOP/s, and when the window that measured it ended (Unix seconds)."""

    tflops: float
    at: float

    @property
    def when(self) -> str:
        """The window's time as a run's ``perf.peak_measured`` tag holds it: its id for ``pipeline.compare``."""
        return datetime.datetime.fromtimestamp(self.at, datetime.UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds at one moment: every process's on the CPUs this process may run on, and this process's own."""

    wall_s: float
    busy_s: float  # all processes' (and the hypervisor's steal) on those CPUs
    own_s: float  # this process's, all its threads
    cpus: int  # how many CPUs ``busy_s`` counts


@dataclass(frozen=True)
class MatmulTimer:
    """One dtype's matmul, ready to time: ``run()`` does one and returns its seconds."""

    flops: float  # of one matmul
    run: Callable[[], float]


@dataclass(frozen=True)
class Window:
    """One measurement: its dtypes' matmuls taken in turns, and how quiet the machine was meanwhile."""

    tflops: dict[str, float]  # the fastest repeat's rate, per dtype
    spread: dict[str, float]  # the median repeat's time over the fastest's, per dtype
    others_pct: float  # what other processes took of the CPUs the matmuls' threads needed (``others_pct``)
    cpus: int  # the CPUs the matmuls' threads needed: as many as the threads, at most the CPUs this process may use
    at: float  # when it ended (Unix seconds)

    @property
    def refused(self) -> str:
        """Why its figures are no peak: the evidence that the machine was busy; "" when it was quiet."""
        if self.others_pct > QUIET_OTHERS_PCT:
            return (
                f"the machine was busy: other processes took {self.others_pct:.0f}% of the time of the {self.cpus} "
                f"CPU(s) its matmuls needed while it was measured (a peak needs {QUIET_OTHERS_PCT:.0f}% at most)"
            )
        dtype = max(self.spread, key=lambda d: self.spread[d])
        if self.spread[dtype] > MAX_SPREAD:
            return (
                f"the machine was busy: {dtype}'s median matmul took {self.spread[dtype]:.2f}x its fastest while it "
                f"was measured (a quiet machine's stay within {MAX_SPREAD:g}x)"
            )
        return ""


@dataclass(frozen=True)
class CpuPeaks:
    """What the cache holds for this machine after a look, and why a measurement just taken was refused."""

    figures: dict[str, Figure]  # per dtype, those still valid (measured since torch's files were installed)
    refused: str = ""  # "" when nothing was measured or the window was kept


def cpu_peak(
    dtype: str,
    *,
    cpu: str,
    refresh: bool = False,
    cache: Path | None = None,
    measure: Callable[[Sequence[str]], Window] | None = None,
) -> Peak:
    """This CPU's measured matmul peak in ``dtype`` at torch's current thread count (``cpu_peaks``); ``cpu``: its
    model name (``pipeline.engine.building.devices.cpu_name``). None, with the reason, when it is not cached and the
    measurement was refused (the machine was busy)."""
    if dtype not in CPU_DTYPES:
        return Peak(dtype, None, reason=f"no MFU: {dtype} is not measured on a CPU")
    found = cpu_peaks((dtype,), cpu=cpu, refresh=refresh, cache=cache, measure=measure or measure_window)
    figure = found.figures.get(dtype)
    if figure is None:
        return Peak(
            dtype,
            None,
            reason=f"no MFU: this CPU's {dtype} peak was not measured, {found.refused}; "
            "python -m pipeline.doctor measures it when the machine is quiet",
        )
    threads = torch.get_num_threads()
    return Peak(dtype, figure.tflops, "this CPU", f"measured matmul, {threads} thread(s)", measured_at=figure.when)


def cpu_peaks(
    dtypes: Sequence[str],
    *,
    cpu: str,
    refresh: bool = False,
    cache: Path | None = None,
    measure: Callable[[Sequence[str]], Window],
) -> CpuPeaks:
    """This CPU's cached peaks; measured first when ``refresh`` (the doctor) or when one of ``dtypes`` is not cached
    or older than torch's installed files. The window measures ``WINDOW_DTYPES`` and ``dtypes`` together
    (``measure``: ``measure_window``, or a fake); a busy one is refused and nothing is written, a quiet one raises
    each lower cached figure to its own and is written."""
    path = cache or cache_file()
    stored = _read(path)
    key = machine_key(cpu, threads=torch.get_num_threads())
    installed = torch_installed_at()
    valid = {dtype: figure for dtype, figure in stored.get(key, {}).items() if figure.at >= installed}
    if not refresh and all(dtype in valid for dtype in dtypes):
        return CpuPeaks(valid)
    window = measure(tuple(dict.fromkeys((*WINDOW_DTYPES, *dtypes))))
    if window.refused:
        log.info("the CPU's matmul peak was not measured: %s", window.refused)
        return CpuPeaks(valid, window.refused)
    stored[key] = raised(valid, window)
    write_cache(path, stored)
    return CpuPeaks(stored[key])


def raised(cached: dict[str, Figure], window: Window) -> dict[str, Figure]:
    """The cached figures, each raised to the kept ``window``'s where that is higher: the peak is the most the CPU was
    seen to do quietly, and a later quiet window that is slower says only that something held it back."""
    merged = dict(cached)
    for dtype, tflops in window.tflops.items():
        if dtype not in cached or tflops > cached[dtype].tflops:
            merged[dtype] = Figure(tflops, window.at)
    return merged


def measure_window(
    dtypes: Sequence[str],
    *,
    n: int = CPU_MATMUL_N,
    budget_s: float = CPU_BUDGET_S,
    timer: Callable[..., MatmulTimer] | None = None,
    read_times: Callable[[], CpuTimes] | None = None,
    now: Callable[[], float] = time.time,
    threads: int | None = None,
) -> Window:
    """Matmuls of each of ``dtypes`` in turns, round after round, for ``budget_s`` of matmul time (at least
    ``MIN_ROUNDS`` rounds), and the other processes' CPU time over those rounds. In turns, so that each dtype's
    repeats saw the same machine. ``timer(dtype name, n=, budget_s=)`` makes each dtype's (``matmul_timer`` when
    None); ``read_times``: the CPU times before and after (``read_cpu_times`` when None); ``now``: the wall clock;
    ``threads``: the matmuls' (torch's thread count when None). Tests pass fakes of them."""
    make, read_times = timer or matmul_timer, read_times or read_cpu_times
    threads = threads or torch.get_num_threads()
    timers = {dtype: make(dtype, n=n, budget_s=budget_s / len(dtypes)) for dtype in dtypes}
    seconds: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    before, spent, rounds = read_times(), 0.0, 0
    while rounds < MIN_ROUNDS or (spent < budget_s and rounds < MAX_ROUNDS):
        for dtype, matmul in timers.items():
            took = matmul.run()
            seconds[dtype].append(took)
            spent += took
        rounds += 1
    after = read_times()
    fastest = {dtype: max(min(times), 1e-9) for dtype, times in seconds.items()}
    return Window(
        tflops={dtype: timers[dtype].flops / fastest[dtype] / 1e12 for dtype in dtypes},
        spread={dtype: statistics.median(seconds[dtype]) / fastest[dtype] for dtype in dtypes},
        others_pct=others_pct(before, after, threads=threads),
        cpus=min(threads, after.cpus),
        at=now(),
    )


def matmul_timer(dtype: str, *, n: int = CPU_MATMUL_N, budget_s: float = CPU_BUDGET_S) -> MatmulTimer:
    """A square matmul in ``dtype`` (2 side³ FLOPs), after one untimed one that pays for the kernel's set-up. The side
    is ``n``, or less where one such matmul would take far longer than ``budget_s`` (``matmul_side``: float16,
    emulated on most CPUs, took 2.5 s for 1024 a side)."""
    kind = CPU_DTYPES[dtype]
    side = matmul_side(kind, n=n, budget_s=budget_s)
    numbers = torch.Generator().manual_seed(0)  # its own: a run's random stream is the same, cached peak or not
    a, b = (torch.randn(side, side, generator=numbers).to(kind) for _ in range(2))
    out = torch.empty(side, side, dtype=kind)
    torch.mm(a, b, out=out)

    def run() -> float:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        return time.perf_counter() - start

    return MatmulTimer(2.0 * side**3, run)


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


def read_cpu_times() -> CpuTimes:
    """Now: the busy seconds of the CPUs this process may run on (every process's: psutil reads ``/proc/stat`` on
    Linux, in 10 ms ticks) and this process's own (``os.times``: all its threads, torch's included)."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    per_cpu = psutil.cpu_times(percpu=True)
    chosen = [per_cpu[i] for i in usable if i < len(per_cpu)] if usable else per_cpu
    own = os.times()
    return CpuTimes(time.perf_counter(), sum(_busy(t) for t in chosen), own.user + own.system, len(chosen))


def _busy(times: tuple[float, ...]) -> float:
    """A CPU's busy seconds: all but idle and I/O wait; Linux counts guests' time in ``user`` already."""
    left_out = ("idle", "iowait", "guest", "guest_nice")
    return sum(times) - sum(getattr(times, name, 0.0) for name in left_out)


def others_pct(before: CpuTimes, after: CpuTimes, *, threads: int) -> float:
    """What other processes took, between two readings, of the CPUs that this process's ``threads`` needed: their
    CPU time beyond the CPUs the threads leave free, as a share of the threads' CPUs' time. With one thread on two
    CPUs (a torchrun rank, a test worker), a neighbour on the other CPU takes nothing from the matmul. Never below
    0: the two counters tick apart."""
    wall = max(after.wall_s - before.wall_s, 1e-9)
    others = max((after.busy_s - before.busy_s) - (after.own_s - before.own_s), 0.0) / wall  # in CPUs
    needed = min(threads, after.cpus)
    return 100.0 * max(others - (after.cpus - needed), 0.0) / needed


def torch_installed_at() -> float:
    """When torch's installed files were put here (its ``version.py``: the later of its modification and status
    change times, the latter set by the install even where an installer keeps the archive's dates). A figure
    measured before then was measured with another build, perhaps of the same version."""
    info = (Path(torch.__file__).parent / "version.py").stat()
    return max(info.st_mtime, info.st_ctime)


def machine_key(cpu: str, *, threads: int) -> str:
    """What a measured CPU peak holds for: the CPU model, its logical CPUs, torch's version and thread count."""
    return f"{cpu}|{os.cpu_count()} cpus|torch {torch.__version__}|{threads} threads"


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipeline" / "cpu_peaks.json"


def _read(path: Path) -> dict[str, dict[str, Figure]]:
    """The cache's figures per machine key. An entry of an earlier layout (one number per dtype, with no time) is
    left out: it was measured without the quiet check, and is measured again and overwritten."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and rewritten
    if not isinstance(data, dict):
        return {}
    entries = {key: _figures(entry) for key, entry in data.items()}
    return {key: figures for key, figures in entries.items() if figures}


def _figures(entry: object) -> dict[str, Figure]:
    if not isinstance(entry, dict):
        return {}
    numbers = (int, float)
    return {
        dtype: Figure(float(value["tflops"]), float(value["at"]))
        for dtype, value in entry.items()
        if isinstance(value, dict) and isinstance(value.get("tflops"), numbers) and isinstance(value.get("at"), numbers)
    }


def write_cache(path: Path, stored: dict[str, dict[str, Figure]]) -> None:
    """Replace the cache with ``stored`` (a folder that cannot be written in is logged: the next run measures)."""
    data = {
        key: {dtype: {"tflops": f.tflops, "at": f.at} for dtype, f in figures.items()}
        for key, figures in stored.items()
    }
    try:
        write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as err:  # a read-only home: the next run measures again, which costs it under a second
        log.info("the measured CPU peak could not be cached in %s (%s)", path, err)
