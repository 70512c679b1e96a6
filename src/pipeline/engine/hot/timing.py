"""Where a step's time goes: the pipeline's own bookkeeping, waiting for the batch, copying it, computing.

The loop marks four points per step: it asks the loader for the next batch (``fetch``), has the
batch in hand (``ready``), has it on the device (``copied``), and has enqueued the optimizer step
(``done``). So the time between the previous step's end and the next ``fetch`` is the
pipeline's own work (reading the loss back at logging points, writing metrics to the buffer, a
mid-epoch checkpoint, the progress bar), which is never booked as waiting for data.

On the CPU the marks are wall clocks. On CUDA and Apple MPS they are device events recorded on
the training device's stream, so nothing waits for the device until the epoch ends, and a gap
between two marks is time the device sat idle: a host that is busy with bookkeeping while the
device still computes costs nothing, as it should. A wall clock would book the device's
asynchronous work wherever the host happens to wait for it (on MPS, typically while fetching
the next batch) and call a compute-bound run input-bound. ``finish()`` is the epoch's one sync.

The first step of an epoch (warm-up, cuDNN autotuning, compilation, worker start-up) is kept
out of the shares and of the steady-state throughput and reported on its own; so are the steps that
compiled and, with ``trainer.profile=true``, the steps run under the profiler (``profiled()``).

With a device prefetcher (``pipeline.data.prefetch``) batch k+1 is copied on a side stream while
batch k computes. The prefetcher marks ``ready`` itself, just before it makes the training stream
wait for the copy, so ``h2d`` is still the time the training stream stood idle for the copy: the
part of the copy that compute did not hide, which is what the copy costs a step (zero when it is
fully overlapped). The copy's own duration, timed by events on its stream, is reported apart
(``time/h2d_copy_ms``) and is not part of the step time, since it overlaps the other parts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pipeline.common.metric_names import (
    THROUGHPUT_SAMPLES_PER_S,
    TIME_COMPUTE_PCT,
    TIME_DATA_WAIT_PCT,
    TIME_FIRST_STEP_S,
    TIME_H2D_COPY_MS,
    TIME_H2D_PCT,
    TIME_LAUNCH_TO_FIRST_STEP_S,
    TIME_OVERHEAD_PCT,
    TIME_STEP_MS,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Breakdown:
    """One epoch's step-time breakdown; shares and throughput cover the steady-state steps."""

    data_wait_s: float  # waiting for the loader to hand over the next batch
    h2d_s: float  # copying the batch to the device (prefetched: waiting for the copy compute did not hide)
    compute_s: float  # forward, backward, optimizer step
    steady_steps: int
    steady_samples: int
    first_step_s: float
    steps: int
    samples: int
    overhead_s: float = 0.0  # the pipeline's own work between steps: logging, checkpoints, progress
    copy_s: float = 0.0  # copying on a prefetcher's side stream, overlapped with the above: not in step_s
    compile_steps: int = 0  # steps after the first that compiled (torch.compile met a new shape): left out, too
    compile_steps_s: float = 0.0  # their time
    profiled_steps: int = 0  # steps run under torch.profiler (trainer.profile=true): left out, too
    profiled_steps_s: float = 0.0  # their time, the profiler's start and stop included

    @property
    def step_s(self) -> float:
        return self.overhead_s + self.data_wait_s + self.h2d_s + self.compute_s

    def share(self, part_s: float) -> float:
        return 100.0 * part_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def data_wait_pct(self) -> float:
        return self.share(self.data_wait_s)

    @property
    def h2d_pct(self) -> float:
        return self.share(self.h2d_s)

    @property
    def compute_pct(self) -> float:
        return self.share(self.compute_s)

    @property
    def overhead_pct(self) -> float:
        return self.share(self.overhead_s)

    @property
    def samples_per_s(self) -> float:
        """Steady-state throughput: the first step's samples and time left out."""
        return self.steady_samples / self.step_s if self.step_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        per_step_ms = 1000.0 / self.steady_steps if self.steady_steps else 0.0
        return {
            TIME_DATA_WAIT_PCT: self.data_wait_pct,
            TIME_H2D_PCT: self.h2d_pct,
            TIME_COMPUTE_PCT: self.compute_pct,
            TIME_OVERHEAD_PCT: self.overhead_pct,
            TIME_FIRST_STEP_S: self.first_step_s,
            TIME_STEP_MS: self.step_s * per_step_ms,
            THROUGHPUT_SAMPLES_PER_S: self.samples_per_s,
            **({TIME_H2D_COPY_MS: self.copy_s * per_step_ms} if self.copy_s else {}),  # prefetched runs only
        }


class _Marks:
    """Four marks a step; subclasses say what a mark is and how marks become seconds."""

    def __init__(self) -> None:
        self._marks: list[tuple[Any, Any, Any, Any]] = []
        self._sizes: list[int] = []
        self._compiled: list[bool] = []
        self._profiled: set[int] = set()  # the steps run under the profiler, by index
        self._start: Any = None
        self._fetch: Any = None
        self._ready: Any = None
        self._copied: Any = None
        self._copies: list[tuple[int, Callable[[], float]]] = []  # (step index, reads its side-stream copy's seconds)

    def _mark(self) -> Any:
        raise NotImplementedError

    def start(self) -> None:
        self._marks.clear()
        self._sizes.clear()
        self._compiled.clear()
        self._profiled.clear()
        self._copies.clear()
        self._start = self._mark()

    def fetch(self) -> None:
        self._fetch = self._mark()

    def ready(self) -> None:
        self._ready = self._mark()

    def copied(self) -> None:
        self._copied = self._mark()

    def done(self, samples: int, *, compiled: bool = False) -> None:
        """The step ended; ``compiled``: torch.compile compiled during it, so it is no steady step."""
        self._marks.append((self._fetch, self._ready, self._copied, self._mark()))
        self._sizes.append(samples)
        self._compiled.append(compiled)

    def profiled(self) -> None:
        """The step just marked ran under the profiler: no steady step either. Called by the profiler's timer
        (``pipeline.engine.observe.profiling``) alone, so a run that does not profile pays nothing for it."""
        self._profiled.add(len(self._marks) - 1)

    def copy_took(self, seconds: Callable[[], float]) -> None:
        """This step's batch was copied on a side stream; ``seconds()`` says how long that took. Called by a
        prefetcher; ``finish`` reads the value after its sync, so reading an event never waits mid-epoch."""
        self._copies.append((len(self._marks), seconds))

    def batches(self, iterable: Iterable[T]) -> Generator[T, None, None]:
        """``iterable``'s items with ``fetch`` marked as each is asked for and ``ready`` as it arrives.

        An iterable with ``timed_by(marks)`` (a device prefetcher) marks ``ready`` itself and reports its copies.
        """
        timed_by = getattr(iterable, "timed_by", None)  # a prefetcher marks ``ready`` itself, before its wait
        iterator = timed_by(self) if timed_by is not None else iter(iterable)  # starts loader workers: step 1's
        while True:
            self.fetch()
            try:
                item = next(iterator)
            except StopIteration:
                return
            if timed_by is None:
                self.ready()
            yield item

    def _copy_seconds(self) -> float:
        """The steady steps' side-stream copy time (the first step, compiling and profiled ones left out, as
        ``_breakdown`` leaves them out)."""
        first = 1 if len(self._marks) > 1 else 0
        steady = [
            first <= i and not (i and self._compiled[i]) and i not in self._profiled for i in range(len(self._marks))
        ]
        return sum(seconds() for index, seconds in self._copies if index < len(self._marks) and steady[index])


class WallTimer(_Marks):
    """Marks with ``time.perf_counter`` (the CPU, where the host does the work itself)."""

    def _mark(self) -> float:
        return time.perf_counter()

    def finish(self) -> Breakdown:
        return _breakdown(
            self._start, self._marks, self._sizes, self._compiled, copy_s=self._copy_seconds(), profiled=self._profiled
        )


class EventTimer(_Marks):
    """Marks as device events (CUDA or MPS) recorded where the training device's work is queued.

    Args:
        new_event: makes a timing event (``torch.cuda.Event(enable_timing=True)``, ...).
        record: records an event on the training device's stream.
    """

    def __init__(self, new_event: Callable[[], Any], record: Callable[[Any], None]) -> None:
        super().__init__()
        self._new_event, self._record = new_event, record
        self._pool: list[Any] = []  # reused every epoch: no event creation in steady state
        self._used = 0

    def _mark(self) -> Any:
        if self._used == len(self._pool):
            self._pool.append(self._new_event())
        event = self._pool[self._used]
        self._used += 1
        self._record(event)  # about a microsecond on the host; nothing waits
        return event

    def start(self) -> None:
        self._used = 0
        super().start()

    def finish(self) -> Breakdown:
        if not self._marks:
            return _breakdown(0.0, [], [], [])
        self._marks[-1][3].synchronize()  # the epoch's only wait for the device
        start = self._start
        marks = [tuple(start.elapsed_time(event) / 1e3 for event in step) for step in self._marks]
        copy_s = self._copy_seconds()  # the copies' events are synced too
        return _breakdown(0.0, marks, self._sizes, self._compiled, copy_s=copy_s, profiled=self._profiled)


def make_timer(device: torch.device) -> WallTimer | EventTimer:
    """The step timer for ``device``: events on its current stream for CUDA and MPS, wall clocks on the CPU."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)  # the training device's, whatever device is current
        return EventTimer(lambda: torch.cuda.Event(enable_timing=True), lambda event: event.record(stream))
    if device.type == "mps":
        return EventTimer(lambda: torch.mps.event.Event(enable_timing=True), lambda event: event.record())
    return WallTimer()


def _breakdown(
    start: float,
    marks: Sequence[tuple[float, ...]],
    sizes: list[int],
    compiled: list[bool],
    *,
    copy_s: float = 0.0,
    profiled: Collection[int] = (),
) -> Breakdown:
    """Sum the parts of steps 2..N from (fetch, ready, copied, done) times; step 1 is reported alone, and so are
    the later steps that compiled (``compiled``) and those run under the profiler (``profiled``: their indices).
    ``copy_s`` is the steady steps' side-stream copy time."""
    if not marks:
        return Breakdown(0.0, 0.0, 0.0, 0, 0, 0.0, 0, 0)
    first_step_s = marks[0][3] - start
    previous_done = marks[0][3] if len(marks) > 1 else start
    overhead = wait = h2d = compute = compile_s = profiled_s = 0.0
    steady_steps = steady_samples = compile_steps = profiled_steps = 0
    for index, (fetch, ready, copied, done) in enumerate(marks):
        if index == 0 and len(marks) > 1:
            continue
        step = (
            max(fetch - previous_done, 0.0),
            max(ready - fetch, 0.0),
            max(copied - ready, 0.0),
            max(done - copied, 0.0),
        )
        previous_done = done
        if index and compiled[index] and len(marks) > 1:
            compile_steps, compile_s = compile_steps + 1, compile_s + sum(step)
            continue
        if index in profiled:
            profiled_steps, profiled_s = profiled_steps + 1, profiled_s + sum(step)
            continue
        overhead, wait, h2d, compute = overhead + step[0], wait + step[1], h2d + step[2], compute + step[3]
        steady_steps, steady_samples = steady_steps + 1, steady_samples + sizes[index]
    return Breakdown(
        wait,
        h2d,
        compute,
        steady_steps,
        steady_samples,
        first_step_s,
        len(marks),
        sum(sizes),
        overhead_s=overhead,
        copy_s=copy_s,
        compile_steps=compile_steps,
        compile_steps_s=compile_s,
        profiled_steps=profiled_steps,
        profiled_steps_s=profiled_s,
    )


def combine(breakdowns: list[Breakdown]) -> Breakdown:
    """Several epochs as one: parts and counts add up; the first step is the run's first."""
    if not breakdowns:
        return _breakdown(0.0, [], [], [])
    return Breakdown(
        data_wait_s=sum(b.data_wait_s for b in breakdowns),
        h2d_s=sum(b.h2d_s for b in breakdowns),
        compute_s=sum(b.compute_s for b in breakdowns),
        steady_steps=sum(b.steady_steps for b in breakdowns),
        steady_samples=sum(b.steady_samples for b in breakdowns),
        first_step_s=breakdowns[0].first_step_s,
        steps=sum(b.steps for b in breakdowns),
        samples=sum(b.samples for b in breakdowns),
        overhead_s=sum(b.overhead_s for b in breakdowns),
        copy_s=sum(b.copy_s for b in breakdowns),
        compile_steps=sum(b.compile_steps for b in breakdowns),
        compile_steps_s=sum(b.compile_steps_s for b in breakdowns),
        profiled_steps=sum(b.profiled_steps for b in breakdowns),
        profiled_steps_s=sum(b.profiled_steps_s for b in breakdowns),
    )


def launch_metrics(first_epoch_started_at: float, breakdown: Breakdown) -> dict[str, float]:
    """Seconds from the process's start (as the OS records it) to the end of the first training step."""
    import psutil

    return {
        TIME_LAUNCH_TO_FIRST_STEP_S: first_epoch_started_at - psutil.Process().create_time() + breakdown.first_step_s
    }


def seconds(value: float) -> str:
    """``1.7 s``, ``120 ms``, ``0.85 ms``: never ``0.00 s``."""
    if not math.isfinite(value):
        return "not measured"
    if value >= 1:
        return f"{value:.1f} s"
    return f"{value * 1000:.0f} ms" if value >= 0.01 else f"{value * 1000:.2f} ms"
