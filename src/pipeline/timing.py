"""Where a step's time goes: waiting for the batch, copying it to the device, computing.

The loop marks three points per step (batch in hand, batch on the device, optimizer step
done). On the CPU the marks are wall clocks. On CUDA they are events recorded on the stream,
so nothing waits for the GPU until the epoch ends: the gap between the previous step's end and
this step's copy is time the GPU sat idle waiting for input, the copy is the H2D transfer as
the GPU executed it, and the rest is compute. ``finish()`` is the one sync point.

The first step of an epoch (warm-up, cuDNN autotuning, compilation, worker start-up) is kept
out of the shares and of the steady-state throughput and reported on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Breakdown:
    """One epoch's step-time breakdown; shares and throughput cover the steady-state steps."""

    data_wait_s: float
    h2d_s: float
    compute_s: float
    steady_steps: int
    steady_samples: int
    first_step_s: float
    steps: int
    samples: int

    @property
    def step_s(self) -> float:
        return self.data_wait_s + self.h2d_s + self.compute_s

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
    def samples_per_s(self) -> float:
        """Steady-state throughput: the first step's samples and time left out."""
        return self.steady_samples / self.step_s if self.step_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "time/data_wait_pct": self.data_wait_pct,
            "time/h2d_pct": self.h2d_pct,
            "time/compute_pct": self.compute_pct,
            "time/first_step_s": self.first_step_s,
            "time/step_ms": 1000.0 * self.step_s / self.steady_steps if self.steady_steps else 0.0,
            "throughput/samples_per_s": self.samples_per_s,
        }


class _Marks:
    """Three marks a step; subclasses say what a mark is and how marks become seconds."""

    def __init__(self) -> None:
        self._marks: list[tuple[Any, Any, Any]] = []
        self._sizes: list[int] = []
        self._start: Any = None
        self._ready: Any = None
        self._copied: Any = None

    def _mark(self) -> Any:
        raise NotImplementedError

    def start(self) -> None:
        self._marks.clear()
        self._sizes.clear()
        self._start = self._mark()

    def ready(self) -> None:
        self._ready = self._mark()

    def copied(self) -> None:
        self._copied = self._mark()

    def done(self, samples: int) -> None:
        self._marks.append((self._ready, self._copied, self._mark()))
        self._sizes.append(samples)


class WallTimer(_Marks):
    """Marks with ``time.perf_counter`` (CPU and MPS: the host waits for the work anyway)."""

    def _mark(self) -> float:
        return time.perf_counter()

    def finish(self) -> Breakdown:
        return _breakdown(self._start, self._marks, self._sizes)


class CudaEventTimer(_Marks):
    """Marks with CUDA events on the current stream; read once, in ``finish``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._pool: list[torch.cuda.Event] = []  # reused every epoch: no event creation in steady state
        self._used = 0

    def _mark(self) -> torch.cuda.Event:
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._used]
        self._used += 1
        event.record()  # about a microsecond on the host; nothing waits
        return event

    def start(self) -> None:
        self._used = 0
        super().start()

    def finish(self) -> Breakdown:
        if not self._marks:
            return _breakdown(0.0, [], [])
        self._marks[-1][2].synchronize()  # the epoch's only wait for the GPU
        start = self._start
        marks = [tuple(start.elapsed_time(event) / 1e3 for event in step) for step in self._marks]
        return _breakdown(0.0, marks, self._sizes)


def make_timer(device: torch.device) -> WallTimer | CudaEventTimer:
    return CudaEventTimer(device) if device.type == "cuda" else WallTimer()


def _breakdown(start: float, marks: list[tuple[float, float, float]], sizes: list[int]) -> Breakdown:
    """Sum the parts of steps 2..N from (ready, copied, done) times; step 1 is reported alone."""
    if not marks:
        return Breakdown(0.0, 0.0, 0.0, 0, 0, 0.0, 0, 0)
    first_step_s = marks[0][2] - start
    steady = marks[1:] if len(marks) > 1 else marks
    previous_done = marks[0][2] if len(marks) > 1 else start
    wait = h2d = compute = 0.0
    for ready, copied, done in steady:
        wait += max(ready - previous_done, 0.0)
        h2d += max(copied - ready, 0.0)
        compute += max(done - copied, 0.0)
        previous_done = done
    steady_samples = sum(sizes[1:]) if len(marks) > 1 else sum(sizes)
    return Breakdown(wait, h2d, compute, len(steady), steady_samples, first_step_s, len(marks), sum(sizes))


def combine(breakdowns: list[Breakdown]) -> Breakdown:
    """Several epochs as one: parts and counts add up; the first step is the run's first."""
    if not breakdowns:
        return _breakdown(0.0, [], [])
    return Breakdown(
        data_wait_s=sum(b.data_wait_s for b in breakdowns),
        h2d_s=sum(b.h2d_s for b in breakdowns),
        compute_s=sum(b.compute_s for b in breakdowns),
        steady_steps=sum(b.steady_steps for b in breakdowns),
        steady_samples=sum(b.steady_samples for b in breakdowns),
        first_step_s=breakdowns[0].first_step_s,
        steps=sum(b.steps for b in breakdowns),
        samples=sum(b.samples for b in breakdowns),
    )
