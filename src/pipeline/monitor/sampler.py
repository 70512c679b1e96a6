"""The utilisation sampler: a daemon thread reading CPU, RAM and the run's GPUs every interval.

Each reading goes to the run as MLflow system metrics (``system/cpu_utilization_percentage``,
``system/gpu_0_utilization_percentage``, ... — MLflow's own names, so the UI's System Metrics tab
shows them) through the tracker's buffer, with step = the tick number (step x interval = seconds
since the run started; timestamps are wall clock). A resumed run's readings continue after the
steps its earlier processes recorded (``after_step``), so each step holds one point and the
timeline runs on. The thread writes through the tracker's explicit run id, never MLflow's
thread-local active run.

Two CPU figures, kept apart: the machine's (``cpu_pct``, psutil's share of *all* the machine's CPUs) and the run's
own (``process_cpu_pct``: its process and loader workers, 100 = one core). ``UtilSummary`` states the run's as a
share of the CPUs it may use (``usable_cpus``) and what other processes took (``others_cpu_pct``, over the machine's
CPUs), which says whether the machine was busy (``BUSY_OTHERS_PCT``) and its speed figures not comparable.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import psutil

from pipeline.common.messages import brief
from pipeline.common.metric_names import (
    CPU_RUN_UTIL_MEAN_PCT,
    CPU_UTIL_MEAN_PCT,
    GPU_MEM_PEAK_MB,
    GPU_UTIL_MEAN_PCT,
    GPU_UTIL_P95_PCT,
    SYSTEM_CPU_UTILIZATION_PERCENTAGE,
    SYSTEM_MEMORY_USAGE_MEGABYTES,
    SYSTEM_MEMORY_USAGE_PERCENTAGE,
    SYSTEM_PROCESS_CPU_UTILIZATION_PERCENTAGE,
    system_gpu,
)
from pipeline.monitor.gpu import GpuBackend, GpuReading, NoGpu

log = logging.getLogger(__name__)

CLOCK_KEY = SYSTEM_CPU_UTILIZATION_PERCENTAGE  # logged at every reading: its last step is the sampler's last tick
# Other processes' mean share of the machine's CPUs from which the machine counts as busy. Below it is the usual
# background (a shell, an editor, the tracking server: a few %); a quarter of the CPUs is a whole core of a 4-CPU
# machine taken from the run and its loader (half of a 2-CPU one), and on bigger machines a share of the memory
# bandwidth and caches the run needs too. Lower, a quiet laptop's bursts (an update, an indexer) would mark many
# runs; higher, a neighbour's full core on a 4-CPU machine would go unsaid.
BUSY_OTHERS_PCT = 25.0


@dataclass(frozen=True)
class Sample:
    elapsed_s: float  # seconds since the sampler started
    cpu_pct: float  # whole machine
    process_cpu_pct: float  # this process (and its loader workers, if any); 100 = one core
    ram_used_mb: float
    ram_pct: float
    gpus: list[GpuReading] = field(default_factory=list)


@dataclass(frozen=True)
class UtilSummary:
    """Summaries over a window of samples; GPU fields are None without GPU readings."""

    samples: int
    cpu_mean_pct: float | None
    gpu_util_mean_pct: float | None
    gpu_util_p95_pct: float | None
    gpu_mem_peak_mb: float | None
    process_cpu_mean_pct: float | None = None  # the run's processes (loader workers included); 100 = one core
    cpus: int = 0  # CPUs the run may use (``usable_cpus``); under DDP, the job's on this machine (``job_summary``)
    machine_cpus: int = 0  # CPUs the machine has: what ``cpu_mean_pct`` is a share of

    @property
    def run_cpu_pct(self) -> float | None:
        """The run's own CPU use as a share of the CPUs it may use (100 = all of them, all the time)."""
        if self.process_cpu_mean_pct is None or not self.cpus:
            return None
        return self.process_cpu_mean_pct / self.cpus

    @property
    def others_cpu_pct(self) -> float | None:
        """Other processes' share of the machine's CPUs: the machine's less the run's, both over all its CPUs. Never
        below 0: the two are read at slightly different moments, so the run's can come out a little higher."""
        if self.cpu_mean_pct is None or self.process_cpu_mean_pct is None or not self.machine_cpus:
            return None
        return max(self.cpu_mean_pct - self.process_cpu_mean_pct / self.machine_cpus, 0.0)

    @property
    def busy(self) -> bool:
        """Other processes used ``BUSY_OTHERS_PCT`` or more of the machine's CPUs on average."""
        others = self.others_cpu_pct
        return others is not None and others >= BUSY_OTHERS_PCT

    def tags(self) -> dict[str, str]:
        """``machine.busy`` (true/false) and ``machine.others_cpu_pct``; none without CPU readings."""
        others = self.others_cpu_pct
        if others is None:
            return {}
        return {"machine.busy": str(self.busy).lower(), "machine.others_cpu_pct": f"{others:.0f}"}

    def metrics(self) -> dict[str, float]:
        values = {
            CPU_UTIL_MEAN_PCT: self.cpu_mean_pct,
            CPU_RUN_UTIL_MEAN_PCT: self.run_cpu_pct,
            GPU_UTIL_MEAN_PCT: self.gpu_util_mean_pct,
            GPU_UTIL_P95_PCT: self.gpu_util_p95_pct,
            GPU_MEM_PEAK_MB: self.gpu_mem_peak_mb,
        }
        return {k: v for k, v in values.items() if v is not None}


class Sampler:
    """Samples every ``interval_s`` on its own thread from ``start()`` until ``stop()``.

    Args:
        interval_s: seconds between readings.
        gpu: the GPU backend (``NoGpu`` on CPU runs).
        log_metrics: where readings go, ``(metrics, step)``; must be thread-safe.
        children: count child processes' CPU too (set when the loader has workers).
        after_step: the last step already recorded (a resumed run's); ticks are logged after it.
    """

    def __init__(
        self,
        *,
        interval_s: float,
        gpu: GpuBackend | None = None,
        log_metrics: Callable[[dict[str, float], int], None] = lambda m, s: None,
        children: bool = False,
        after_step: int = 0,
    ) -> None:
        self.interval_s = interval_s
        self.after_step = after_step
        self.gpu = gpu or NoGpu()
        self.log_metrics = log_metrics
        self.children = children  # also count child processes (loader workers)
        self.samples: list[Sample] = []
        self._process = psutil.Process()
        # pid -> Process, kept across readings: cpu_percent() measures since the same object's last
        # call, so a fresh object per reading would always read 0.0 for the loader workers.
        self._family: dict[int, psutil.Process] = {self._process.pid: self._process}
        self._failed = False  # a reading raised: sampling stays stopped, stop() takes no closing reading
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> Sampler:
        self._t0 = time.monotonic()
        psutil.cpu_percent(interval=None)  # primed for stop()'s closing reading, on this thread
        self._process_cpu()
        self._thread = threading.Thread(target=self._run, name="pipeline-sampler", daemon=True)
        self._thread.start()
        return self

    def now(self) -> float:
        """Seconds on the sampler's clock (for marking epoch boundaries)."""
        return time.monotonic() - self._t0

    def stop(self) -> None:
        """Stop within one interval (a hung GPU read is abandoned, not waited for).

        A last reading covers the time since the previous one, so a run shorter than one
        interval still gets its CPU and GPU figures; none is taken once a reading has failed
        (that failure was already reported, once).
        """
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=2 * self.interval_s + 1.0)
        if self._thread.is_alive():
            log.warning("the utilisation sampler did not stop within %.1f s", 2 * self.interval_s + 1.0)
        elif not self._failed:
            self._record(int(self.now() / self.interval_s) + 1)
        self.gpu.close()
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        psutil.cpu_percent(interval=None)  # psutil keeps the last reading per thread: this one's, primed here
        tick = 0
        while not self._stop.wait(self._t0 + (tick + 1) * self.interval_s - time.monotonic()):
            tick = max(tick + 1, int(self.now() / self.interval_s))  # a slow read skips ticks, never bursts
            if not self._record(tick):
                return

    def _record(self, tick: int) -> bool:
        try:
            sample = self.read()
            self.samples.append(sample)
            self.log_metrics(system_metrics(sample), self.after_step + tick)
        except Exception as err:  # never let a reading (or its logging) kill the thread or training
            log.warning("utilisation sample failed (%s); sampling stops", brief(err))
            self._failed = True
            return False
        return True

    def read(self) -> Sample:
        memory = psutil.virtual_memory()
        return Sample(
            elapsed_s=self.now(),
            cpu_pct=psutil.cpu_percent(interval=None),
            process_cpu_pct=self._process_cpu(),
            ram_used_mb=memory.used / 1e6,
            ram_pct=memory.percent,
            gpus=self.gpu.read(),
        )

    def _process_cpu(self) -> float:
        """This process's CPU since the last call, plus its children's when ``children`` is set.

        A child seen for the first time reads 0.0 (its counters start now) and counts from the
        next reading on.
        """
        if self.children:
            self._refresh_family()
        total = 0.0
        for proc in self._family.values():
            try:
                total += proc.cpu_percent(interval=None)
            except psutil.Error:  # a loader worker that exited since the refresh
                continue
        return total

    def _refresh_family(self) -> None:
        """Keep the Process objects of children still running; add new ones, drop those gone.

        Workers restart every epoch without ``persistent_workers``, so dropping matters on long
        runs. Process equality includes the creation time, so a new process that reuses an old
        pid gets a new object rather than the old one's counters. Recursive, because under the
        forkserver start method the workers are the fork server's children, not ours (it, and the
        resource tracker that spawn and forkserver start, are counted too: idle, they add ~0%).
        psutil lists children from /proc on Linux (~1 ms) and from the process table elsewhere.
        """
        known = self._family
        family = {self._process.pid: self._process}
        for child in self._process.children(recursive=True):
            old = known.get(child.pid)
            family[child.pid] = old if old is not None and old == child else child
        self._family = family

    def summary(self, since: float = 0.0, until: float | None = None) -> UtilSummary:
        window = [s for s in list(self.samples) if s.elapsed_s >= since and (until is None or s.elapsed_s <= until)]
        return summarize(window)


def cpu_ids() -> frozenset[int] | None:
    """The CPUs this process may run on (Linux: taskset, cgroup cpusets, SLURM's binding); None where the OS has no
    affinity call (macOS, Windows). A CPU quota (cgroups' ``cpu.max``) is not an affinity and is not seen."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return frozenset(getaffinity(0)) if getaffinity is not None else None


def usable_cpus() -> int:
    """How many CPUs this process may use: its affinity's, else the machine's."""
    ids = cpu_ids()
    return len(ids) if ids else os.cpu_count() or 1


def summarize(window: list[Sample], *, cpus: int | None = None, machine_cpus: int | None = None) -> UtilSummary:
    """Means, the GPU's p95 and peak over ``window``; ``cpus`` and ``machine_cpus`` default to this process's usable
    CPUs and the machine's."""
    if not window:
        return UtilSummary(0, None, None, None, None)
    utils = sorted(g.util_pct for s in window for g in s.gpus if g.util_pct is not None)
    mems = [g.mem_used_mb for s in window for g in s.gpus if g.mem_used_mb is not None]
    return UtilSummary(
        samples=len(window),
        cpu_mean_pct=sum(s.cpu_pct for s in window) / len(window),
        gpu_util_mean_pct=sum(utils) / len(utils) if utils else None,
        gpu_util_p95_pct=utils[min(len(utils) - 1, round(0.95 * (len(utils) - 1)))] if utils else None,
        gpu_mem_peak_mb=max(mems) if mems else None,
        process_cpu_mean_pct=sum(s.process_cpu_pct for s in window) / len(window),
        cpus=cpus or usable_cpus(),
        machine_cpus=machine_cpus or os.cpu_count() or 1,
    )


@dataclass(frozen=True)
class RankCpu:
    """What one rank of a DDP job says of its CPU use, for ``job_summary``."""

    host: str
    process_cpu_mean_pct: float | None  # 100 = one core
    cpu_ids: frozenset[int] | None  # its affinity; None where the OS has none


def rank_cpu(summary: UtilSummary) -> RankCpu:
    return RankCpu(socket.gethostname(), summary.process_cpu_mean_pct, cpu_ids())


def job_summary(summary: UtilSummary, ranks: list[RankCpu], *, host: str | None = None) -> UtilSummary:
    """This rank's summary with the job's other ranks on the same machine counted as the run's own, not as others.

    Each rank samples only its own process, so without this a 2-rank job on 2 CPUs would read as a machine half
    used by others. The run's CPUs become the union of those ranks' affinities (the machine's where one has none).

    Args:
        summary: this rank's summary over the run.
        ranks: every rank's ``rank_cpu`` (``group.gather``); one entry for a single process.
        host: this machine's name (default: ``socket.gethostname()``).
    """
    here = host or socket.gethostname()
    local = [r for r in ranks if r.host == here and r.process_cpu_mean_pct is not None]
    if len(local) <= 1 or summary.process_cpu_mean_pct is None:
        return summary
    affinities = [r.cpu_ids for r in local]
    cpus = len(frozenset().union(*affinities)) if all(affinities) else summary.machine_cpus
    return replace(summary, process_cpu_mean_pct=sum(r.process_cpu_mean_pct or 0.0 for r in local), cpus=cpus)


def system_metrics(sample: Sample) -> dict[str, float]:
    """A reading under MLflow's system-metric names (plus the process's own CPU share)."""
    metrics = {
        SYSTEM_CPU_UTILIZATION_PERCENTAGE: sample.cpu_pct,
        SYSTEM_PROCESS_CPU_UTILIZATION_PERCENTAGE: sample.process_cpu_pct,
        SYSTEM_MEMORY_USAGE_MEGABYTES: sample.ram_used_mb,
        SYSTEM_MEMORY_USAGE_PERCENTAGE: sample.ram_pct,
    }
    for gpu in sample.gpus:
        fields = {
            "utilization_percentage": gpu.util_pct,
            "memory_usage_megabytes": gpu.mem_used_mb,
            "memory_usage_percentage": 100 * gpu.mem_used_mb / gpu.mem_total_mb
            if gpu.mem_used_mb is not None and gpu.mem_total_mb
            else None,
            "temperature_celsius": gpu.temp_c,
            "power_usage_watts": gpu.power_w,
            "power_usage_percentage": 100 * gpu.power_w / gpu.power_limit_w
            if gpu.power_w is not None and gpu.power_limit_w
            else None,
        }
        metrics.update({system_gpu(gpu.index, k): v for k, v in fields.items() if v is not None})
    return metrics
