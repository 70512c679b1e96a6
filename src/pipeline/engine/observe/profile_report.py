"""What a profiled run's steps showed (``pipeline.engine.observe.profiling``): the top operators, the GPU's busy and
idle time, and the report that the run records and its summary shows.

``gpu_busy`` and the interval helpers are pure functions of intervals on one clock (the profiler's, in microseconds),
so they are tested on made-up intervals; ``analyse`` reads them from a stopped ``torch.profiler.profile``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch.autograd import DeviceType

from pipeline.common.markdown import markdown_table
from pipeline.common.metric_names import (
    PERF_GPU_BUSY_PCT,
    PERF_GPU_IDLE_DATA_PCT,
    PERF_GPU_IDLE_HOST_PCT,
    PROFILE_COST_S,
    PROFILE_STEP_MS,
    PROFILE_STEPS,
)

Span = tuple[float, float]  # (start, end) on the profiler's clock, in microseconds

TABLE_ROWS = 20  # operators in the artifact
SUMMARY_ROWS = 5  # operators in the printed summary
WAIT = "data wait"  # the trace's range for the loop's wait for the next batch


def merged(spans: Iterable[Span]) -> list[Span]:
    """``spans`` as sorted, disjoint intervals: overlapping or touching ones joined, empty ones dropped."""
    out: list[list[float]] = []
    for start, end in sorted(span for span in spans if span[1] > span[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end) for start, end in out]


def overlap(a: list[Span], b: list[Span]) -> list[Span]:
    """Where two merged lists of intervals overlap, merged."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(spans: list[Span], within: list[Span]) -> list[Span]:
    """The parts of ``within`` that no interval of ``spans`` covers (both merged)."""
    out = []
    for start, end in within:
        cursor = start
        for covered_start, covered_end in overlap(spans, [(start, end)]):
            if covered_start > cursor:
                out.append((cursor, covered_start))
            cursor = covered_end
        if cursor < end:
            out.append((cursor, end))
    return out


def length(spans: list[Span]) -> float:
    return sum(end - start for start, end in spans)


@dataclass(frozen=True)
class GpuBusy:
    """How the GPU spent the profiled steps, in percent of their time (the three add up to 100)."""

    busy_pct: float  # at least one kernel ran
    idle_host_pct: float  # no kernel while the loop was not waiting for data: the host launched too slowly
    idle_data_pct: float  # no kernel while the loop waited for its next batch

    def metrics(self) -> dict[str, float]:
        return {
            PERF_GPU_BUSY_PCT: self.busy_pct,
            PERF_GPU_IDLE_HOST_PCT: self.idle_host_pct,
            PERF_GPU_IDLE_DATA_PCT: self.idle_data_pct,
        }


def gpu_busy(kernels: Iterable[Span], steps: Iterable[Span], data_waits: Iterable[Span]) -> GpuBusy | None:
    """The GPU's busy and idle time within the profiled steps, from intervals on one clock.

    Busy is the union of the kernels' intervals on the device's timeline, clipped to the steps' spans; the rest of
    the steps' time is idle, and the idle time that falls inside the loop's own waits for a batch is idle for data;
    the remainder is idle for the host (a launch-bound step: Python, the optimizer's many small kernels, a sync).

    Args:
        kernels: each kernel's (start, end) on the device.
        steps: each profiled step's (start, end) on the host.
        data_waits: each wait for the next batch (the loop's ``data wait`` marks).

    Returns:
        The shares, or None when the steps have no length.
    """
    window = merged(steps)
    total = length(window)
    if total <= 0:
        return None
    running = merged(kernels)
    busy = length(overlap(running, window))
    data = length(overlap(gaps(running, window), merged(data_waits)))
    return GpuBusy(100 * busy / total, 100 * (total - busy - data) / total, 100 * data / total)


# ---------------------------------------------------------------------------------------------
# The top operators, and the report


@dataclass(frozen=True)
class Operator:
    name: str
    calls: int
    self_ms: float  # its own time, without the operators it called (on CUDA: its kernels' time)
    share_pct: float  # of the profiled steps' time


def top_operators(averages: Iterable[Any], *, on_device: bool, steps_us: float) -> list[Operator]:
    """The operators of ``key_averages()`` by self time, most first: CPU self time, or with ``on_device`` the time
    of the kernels each launched. Ranges (``step N``, ``data wait``, the optimizer's step: user annotations) and the
    kernels' own rows (counted in the operator that launched them) are left out, so no time counts twice."""
    rows = []
    for average in averages:
        if getattr(average, "is_user_annotation", False) or average.device_type != DeviceType.CPU:
            continue
        self_us = average.self_device_time_total if on_device else average.self_cpu_time_total
        if self_us > 0:
            share = 100 * self_us / steps_us if steps_us > 0 else 0.0
            rows.append(Operator(average.key, average.count, self_us / 1e3, share))
    return sorted(rows, key=lambda op: -op.self_ms)


@dataclass(frozen=True)
class ProfileReport:
    """What the profiled steps showed."""

    steps: int  # steps profiled
    asked: int  # trainer.profile_steps
    first: int  # the first profiled step's number
    step_ms: float  # a profiled step's mean time in the trace, the profiler's own cost included
    clock: str  # "CPU" or "CUDA": whose self time ranks the operators
    operators: list[Operator]
    gpu: GpuBusy | None  # on CUDA
    trace: str = ""  # the trace's artifact path; "" when it is not in the run's record
    why_no_trace: str = "tracking off"  # then, why
    optimizer_pct: float = 0.0  # the optimizer's step and zero_grad, everything they called included
    auto: bool = False  # profiled by the run itself (trainer.auto_profile), not asked for
    cost_s: float = 0.0  # the auto profile's cost beyond its steps' own time: the window's extra and the analysis

    def metrics(self) -> dict[str, float]:
        gpu = self.gpu.metrics() if self.gpu is not None else {}
        cost = {PROFILE_COST_S: self.cost_s} if self.auto else {}
        return {PROFILE_STEPS: float(self.steps), PROFILE_STEP_MS: self.step_ms, **gpu, **cost}

    def table(self, rows: int = TABLE_ROWS) -> str:
        """The top ``rows`` operators as the Markdown artifact."""
        header = ["operator", "calls", f"self {self.clock} ms", "% of the profiled steps"]
        body = [[op.name, str(op.calls), f"{op.self_ms:.3f}", f"{op.share_pct:.1f}"] for op in self.operators[:rows]]
        last = self.first + self.steps - 1
        return "\n".join(
            [
                f"# Top operators: steps {self.first}-{last} ({self.steps} profiled, {self.step_ms:.2f} ms a step)",
                "",
                f"Ranked by self {self.clock} time: an operator's own time, without the operators it called"
                + (" (on CUDA, the time of the kernels it launched)" if self.clock == "CUDA" else "")
                + "; the share is of the profiled steps' time.",
                "",
                *markdown_table(header, body),
                "",
            ]
        )

    def describe(self, rows: int = SUMMARY_ROWS) -> list[str]:
        """The summary's lines: the steps profiled and where the trace is, the GPU's time, the top operators."""
        short = f", {self.steps} of the {self.asked} asked: the epoch ended" if self.steps < self.asked else ""
        where = f"trace {self.trace} (ui.perfetto.dev opens it)" if self.trace else f"no trace ({self.why_no_trace})"
        how = f"by the run itself (low MFU; it cost {self.cost_s:.2f} s)" if self.auto else "under torch.profiler"
        lines = [
            f"steps {self.first}-{self.first + self.steps - 1} {how}{short}, {self.step_ms:.2f} ms a "
            f"step, left out of samples/s; {where}"
        ]
        if self.gpu is not None:
            lines.append(
                f"GPU busy {self.gpu.busy_pct:.0f}% of those steps, idle {self.gpu.idle_host_pct:.0f}% waiting on "
                f"the host, {self.gpu.idle_data_pct:.0f}% waiting for data"
            )
        top = " · ".join(f"{op.name[:40]} {op.share_pct:.1f}%" for op in self.operators[:rows])
        return [*lines, f"top self {self.clock}: {top or 'no operator ran'}"]


def analyse(profiler: Any, *, labels: list[str], asked: int, first: int, on_device: bool) -> ProfileReport:
    """The report of a stopped profiler whose steps are the ranges named ``labels``."""
    events = profiler.events()
    host = [event for event in events if event.device_type == DeviceType.CPU]
    named = set(labels)
    steps = [(e.time_range.start, e.time_range.end) for e in host if e.name in named]
    steps_us = length(merged(steps))
    gpu = None
    if on_device:
        waits = [(e.time_range.start, e.time_range.end) for e in host if e.name == WAIT]
        gpu = gpu_busy([(e.time_range.start, e.time_range.end) for e in events if is_kernel(e)], steps, waits)
    averages = profiler.key_averages()
    return ProfileReport(
        steps=len(labels),
        asked=asked,
        first=first,
        step_ms=steps_us / 1e3 / len(labels) if labels else 0.0,
        clock="CUDA" if on_device else "CPU",
        operators=top_operators(averages, on_device=on_device, steps_us=steps_us),
        gpu=gpu,
        optimizer_pct=optimizer_share(averages, on_device=on_device, steps_us=steps_us),
    )


def optimizer_share(averages: Iterable[Any], *, on_device: bool, steps_us: float) -> float:
    """The optimizer's share of the profiled steps: torch's ``Optimizer.step#...`` and ``Optimizer.zero_grad#...``
    ranges with everything they called (on CUDA, their kernels' time)."""
    total = 0.0
    for average in averages:
        if average.key.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            total += average.device_time_total if on_device else average.cpu_time_total
    return 100 * total / steps_us if steps_us > 0 else 0.0


def is_kernel(event: Any) -> bool:
    """A kernel on a CUDA device's timeline (not a copy, a memset or a range the device shows)."""
    if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
        return False
    kind = getattr(event, "activity_type", None)
    return kind == "kernel" if kind else not event.name.startswith(("Memcpy", "Memset"))
