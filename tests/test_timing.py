"""The step-time breakdown: bookkeeping is not data wait, device events bind to the training device's stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from helpers import StepClock, machine
from pipeline.config import RunConfig
from pipeline.data import ResidentLoader
from pipeline.engine.building.devices import activate
from pipeline.engine.hot.loop import EpochHooks, StepMetrics, train_epoch
from pipeline.engine.hot.memory import MicroBatcher
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.hot.step import Inputs, TrainState
from pipeline.engine.hot.timing import Breakdown, EventTimer, WallTimer, _breakdown, combine, make_timer
from pipeline.engine.models import mlp
from pipeline.report.verdict import RunFacts, judge


def test_breakdown_splits_bookkeeping_wait_copy_and_compute_and_leaves_the_first_step_out() -> None:
    # (fetch, ready, copied, done) per step; the epoch starts at 0
    marks = [(0.0, 0.5, 0.6, 2.0), (2.1, 2.3, 2.4, 3.4), (3.5, 3.6, 3.7, 4.7)]
    b = _breakdown(0.0, marks, [10, 10, 5], [False] * 3)
    assert b.first_step_s == pytest.approx(2.0)
    assert (b.overhead_s, b.data_wait_s, b.h2d_s, b.compute_s) == pytest.approx((0.2, 0.3, 0.2, 2.0))
    assert b.overhead_pct + b.data_wait_pct + b.h2d_pct + b.compute_pct == pytest.approx(100.0)
    assert b.samples_per_s == pytest.approx(15 / 2.7) and (b.steps, b.samples, b.steady_steps) == (3, 25, 2)
    assert b.metrics()["time/overhead_pct"] == pytest.approx(100 * 0.2 / 2.7)


def test_one_step_epochs_still_report_their_shares() -> None:
    b = _breakdown(0.0, [(0.0, 0.2, 0.2, 1.0)], [4], [True])
    assert b.data_wait_pct == pytest.approx(20.0) and b.samples_per_s == pytest.approx(4.0)


def test_a_step_that_compiled_is_left_out_of_the_steady_state_like_the_first() -> None:
    """The last, smaller batch recompiles (1.84 s against 0.03 s seen on digits): it is counted apart."""
    marks = [(0.0, 0.0, 0.0, 5.0), (5.0, 5.0, 5.0, 5.1), (5.1, 5.1, 5.1, 5.2), (5.2, 5.2, 5.2, 7.0)]
    b = _breakdown(0.0, marks, [64, 64, 64, 30], [True, False, False, True])
    assert (b.steady_steps, b.steady_samples) == (2, 128) and b.step_s == pytest.approx(0.2)
    assert b.samples_per_s == pytest.approx(640.0)  # not 158 / 2.0 s with the recompile in it
    assert (b.compile_steps, b.compile_steps_s) == (1, pytest.approx(1.8))
    assert combine([b, b]).compile_steps == 2


def test_steps_run_under_the_profiler_are_left_out_of_the_steady_state_and_counted_apart() -> None:
    """trainer.profile=true: steps 2 and 3 of five ran under torch.profiler, 10x slower; the steady state is steps 4
    and 5, as fast as they are, and the profiled steps' time is reported on its own."""
    marks = [
        (0.0, 0.0, 0.0, 5.0),
        (5.0, 5.0, 5.0, 6.0),
        (6.0, 6.0, 6.0, 7.0),
        (7.0, 7.0, 7.0, 7.1),
        (7.1,) * 3 + (7.2,),
    ]
    b = _breakdown(0.0, marks, [64] * 5, [False] * 5, profiled={1, 2})
    assert (b.steady_steps, b.steady_samples) == (2, 128) and b.step_s == pytest.approx(0.2)
    assert b.samples_per_s == pytest.approx(640.0)
    assert (b.profiled_steps, b.profiled_steps_s) == (2, pytest.approx(2.0)) and b.compile_steps == 0
    assert (combine([b, b]).profiled_steps, combine([b, b]).profiled_steps_s) == (4, pytest.approx(4.0))


def test_the_timer_leaves_out_the_steps_it_is_told_ran_under_the_profiler(clock: StepClock) -> None:
    timer = WallTimer()
    timer.start()
    for step in range(5):
        timer.fetch()
        timer.ready()
        timer.copied()
        clock.spend(1.0 if step in (1, 2) else 0.1)
        timer.done(8)
        if step in (1, 2):
            timer.profiled()
    b = timer.finish()
    assert (b.steady_steps, b.profiled_steps, b.step_s, b.profiled_steps_s) == (2, 2, pytest.approx(0.2), 2.0)
    timer.start()  # a new epoch forgets which steps were profiled
    for _ in range(3):
        timer.fetch()
        clock.spend(0.1)
        timer.done(8)
    assert (timer.finish().steady_steps, timer.finish().profiled_steps) == (2, 0)


def test_combine_adds_epochs_and_keeps_the_runs_first_step() -> None:
    one = Breakdown(1.0, 0.0, 3.0, 2, 20, 0.5, 3, 30, overhead_s=1.0)
    two = Breakdown(3.0, 0.0, 1.0, 2, 20, 0.1, 3, 30, overhead_s=1.0)
    both = combine([one, two])
    assert both.data_wait_pct == pytest.approx(40.0) and both.overhead_pct == pytest.approx(20.0)
    assert both.first_step_s == 0.5 and both.samples == 60


def test_the_timer_marks_when_a_batch_is_asked_for_and_when_it_arrives(clock: StepClock) -> None:
    """On the step timer's faked clock, which moves only when the loader, the step and the bookkeeping spend
    time: the loader's time is the wait, the time after the step is overhead, exactly."""
    timer = WallTimer()

    def slow_batches():
        for i in range(3):
            clock.spend(0.02)  # the loader's work
            yield i

    timer.start()
    for _ in timer.batches(slow_batches()):
        timer.copied()
        clock.spend(0.01)  # compute
        timer.done(8)
        clock.spend(0.03)  # the pipeline's own work after the step
    b = timer.finish()
    assert b.steps == 3 and b.steady_samples == 16
    # steps 2 and 3 (the first is left out): each waited 20 ms for its batch after 30 ms of bookkeeping
    assert (b.data_wait_s, b.overhead_s, b.compute_s) == pytest.approx((0.04, 0.06, 0.02))


def tiny_state() -> TrainState:
    torch.manual_seed(0)
    model = mlp((16,), 2, [8])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = PrecisionPolicy("cpu", None)
    return TrainState(model, optimizer, policy.make_scaler(), MicroBatcher(8, 8))


def resident_batches(n: int = 64) -> ResidentLoader:
    images = torch.randint(0, 255, (n, 1, 4, 4), dtype=torch.uint8)
    loader = ResidentLoader(images, torch.randint(0, 2, (n,)), batch_size=8, shuffle=True, drop_last=False, seed=0)
    loader.set_epoch(1)
    return loader


class EveryOther:
    """Mid-epoch checkpoints every second step, each written by ``save``."""

    def __init__(self, save: Callable[[int], object]) -> None:
        self.write = save

    def due(self, step: int) -> bool:
        return step % 2 == 0

    def save(self, step: int) -> None:
        self.write(step)


def test_slow_bookkeeping_between_steps_is_overhead_not_waiting_for_data(
    make_cfg: Callable[..., RunConfig], clock: StepClock
) -> None:
    """A progress bar, metric writes and a checkpoint that take time are the pipeline's own work (on the step
    timer's clock, which moves only when they spend time: the shares are exact on a busy machine too)."""
    saved: list[int] = []
    state = tiny_state()
    stats = train_epoch(
        state,
        resident_batches(),
        inputs=Inputs(torch.device("cpu"), PrecisionPolicy("cpu", None), lambda x: x.float() / 255),
        timer=WallTimer(),
        hooks=EpochHooks(
            metrics=StepMetrics(lambda metrics, step: clock.spend(0.005), every=1),
            checkpoints=EveryOther(lambda step: (saved.append(step), clock.spend(0.01))),
            on_step=lambda samples: clock.spend(0.005),
        ),
    )
    b = stats.breakdown
    assert saved == [2, 4, 6, 8]
    # steps 2..8: 7 x (5 + 5) ms logging and drawing, and the checkpoints after steps 2, 4 and 6 (step 8's comes
    # after the last mark); fetching resident batches and computing take no time on this clock
    assert b.overhead_s == pytest.approx(0.1) and b.data_wait_s == 0.0 and b.overhead_pct == pytest.approx(100.0)
    verdict = judge(make_cfg(), RunFacts("cpu", "fp32"), b, machine())
    assert verdict.bottleneck != "input"
    assert "the pipeline's own work between steps" in verdict.message and "trainer.log_every_n_steps" in verdict.message


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device


class FakeEvent:
    """A timing event on a simulated device: ``record`` stamps the device's clock, not the host's."""

    clock: Any = None  # the SimulatedDevice events read

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = 0.0

    def record(self, stream: Any = None) -> None:
        self.at = FakeEvent.clock.record()

    def elapsed_time(self, later: FakeEvent) -> float:
        return 1000.0 * (later.at - self.at)

    def synchronize(self) -> None:
        pass


class SimulatedDevice:
    """A device that runs queued work asynchronously: the host enqueues, the device's clock runs ahead."""

    def __init__(self) -> None:
        self.host = 0.0  # the host's clock
        self.busy_until = 0.0  # when the device finishes what is queued

    def enqueue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, self.host) + seconds

    def host_work(self, seconds: float) -> None:
        self.host += seconds

    def record(self) -> float:  # an event completes when the device reaches it
        return max(self.busy_until, self.host)


def test_device_events_bind_to_the_training_devices_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.device] = []

    def current_stream(device: torch.device | None = None) -> FakeStream:
        asked.append(device)
        return FakeStream(device)

    recorded: list[Any] = []  # the stream of every event the timer recorded

    class Event(FakeEvent):
        def record(self, stream: Any = None) -> None:
            recorded.append(stream)
            super().record(stream)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    FakeEvent.clock = SimulatedDevice()
    timer = make_timer(torch.device("cuda", 1))
    assert isinstance(timer, EventTimer) and asked == [torch.device("cuda", 1)]
    timer.start()
    timer.fetch()
    timer.ready()
    timer.copied()
    timer.done(4)
    timer.finish()
    assert recorded and {s.device for s in recorded} == {torch.device("cuda", 1)}


def test_asynchronous_device_work_is_not_booked_as_waiting_for_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """On MPS (and CUDA) the host runs ahead of the device; events measure the device's idle gaps.

    Each step the host fetches a batch in 1 ms and enqueues 30 ms of device work; it then blocks in
    the next fetch while the device catches up (as MPS does when its queue is full). A wall clock books
    that block as waiting for data; events on the device's timeline see a device that never idles.
    """
    device = SimulatedDevice()
    FakeEvent.clock = device
    monkeypatch.setattr(torch.mps.event, "Event", FakeEvent)
    timer = make_timer(torch.device("mps"))
    assert isinstance(timer, EventTimer)
    timer.start()
    for _ in range(6):
        timer.fetch()
        device.host = max(device.host, device.busy_until - 0.030)  # a full queue blocks the host
        device.host_work(0.001)  # the loader hands over a batch
        timer.ready()
        timer.copied()
        device.enqueue(0.030)  # forward, backward, step: queued, not yet run
        timer.done(8)
    b = timer.finish()
    # the simulated device's own clock, so the shares are exact: 5 steady steps of 30 ms, never idle
    assert b.data_wait_s == 0.0 and b.overhead_s == 0.0 and b.compute_s == pytest.approx(0.150)
    assert b.compute_pct == pytest.approx(100.0) and b.data_wait_pct == 0.0


def test_activate_makes_the_training_gpu_current_and_resets_its_peak_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset_peak", d)))
    monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda d: calls.append(("reset_counts", d)))
    activate(torch.device("cuda", 1))
    gpu = torch.device("cuda", 1)
    assert calls == [("set_device", gpu), ("reset_peak", gpu), ("reset_counts", gpu)]
    calls.clear()
    activate(torch.device("cpu"))
    assert calls == []


def test_every_run_activates_the_device_it_trains_on(
    make_cfg: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.engine.building.build as build_module
    import pipeline.train as train_module

    activated: list[torch.device] = []
    monkeypatch.setattr(build_module, "activate", activated.append)
    train_module.train(make_cfg("tracking=none"), echo=False)
    assert activated == [torch.device("cpu")]
