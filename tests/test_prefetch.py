"""The device prefetcher: every batch once and in order, one copy ahead, resume's skip in the sampler, the copy
timed apart; on the CPU through ``InlineCopies`` (the same hand-over order), on CUDA for real where there is one."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import pipeline.engine.building.build as build_module
from helpers import sigterm_at_step
from pipeline.config import ConfigError, LoaderConfig, RunConfig, load
from pipeline.data import DevicePrefetcher, Place, ResidentLoader, Split, make_batches, with_prefetch
from pipeline.data.prefetch import CudaCopies, InFlight, InlineCopies, prefetch_wanted
from pipeline.engine.hot.loop import EpochHooks, StepMetrics, train_epoch
from pipeline.engine.hot.memory import MicroBatcher
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.hot.step import Inputs, TrainState
from pipeline.engine.hot.timing import WallTimer
from pipeline.engine.models import mlp
from pipeline.engine.stopping import Stopped
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]
CPU = torch.device("cpu")
LOADER = LoaderConfig(
    batch_size=16,
    num_workers=0,
    pin_memory="auto",
    persistent_workers=False,
    prefetch_factor=None,
    drop_last=False,
    resident=False,
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Counting(torch.utils.data.Dataset):
    """40 samples whose label is their index; remembers which were loaded."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.loaded.append(i)
        return torch.full((1, 2, 2), i, dtype=torch.uint8), i


class LoggedCopies(InlineCopies):
    """``InlineCopies`` that log each start and hand-over (by the batch's first label) and say every copy took
    ``seconds_each``."""

    def __init__(self, log: list[tuple[str, int]], seconds_each: float = 0.25) -> None:
        super().__init__(CPU)
        self.log, self.seconds_each = log, seconds_each

    def start(self, host: tuple[torch.Tensor, ...]) -> InFlight:
        self.log.append(("start", int(host[1][0])))
        return super().start(host)

    def hand_over(self, flight: InFlight) -> tuple[torch.Tensor, ...]:
        self.log.append(("hand", int(flight.batch[1][0])))
        return super().hand_over(flight)

    def seconds(self, started: Any, copied: Any) -> float:
        return self.seconds_each


def labels_of(batches: Any) -> list[int]:
    return torch.cat([labels for _, labels in batches]).tolist()


def test_every_batch_comes_out_once_and_in_the_loaders_order() -> None:
    loader = make_batches(Split(Counting(), train=True), LOADER, Place(CPU, seed=0))
    prefetcher = DevicePrefetcher(loader, InlineCopies(CPU))
    for epoch in (1, 2):
        prefetcher.set_epoch(epoch)
        fetched = labels_of(prefetcher)
        loader.set_epoch(epoch)
        assert len(prefetcher) == len(loader) == 3 and fetched == labels_of(loader)
        assert sorted(fetched) == list(range(40))
    loader.set_epoch(1)
    assert fetched != labels_of(loader)  # epoch 2's order is not epoch 1's


def test_batch_k_plus_1_is_copied_before_batch_k_is_handed_over() -> None:
    log: list[tuple[str, int]] = []
    resident = ResidentLoader(
        torch.zeros(6, 1, 1, 1), torch.arange(6), batch_size=2, shuffle=False, drop_last=False, seed=0
    )
    for _, labels in DevicePrefetcher(resident, LoggedCopies(log)):
        log.append(("train", int(labels[0])))
    assert log == [
        ("start", 0), ("start", 2), ("hand", 0), ("train", 0),
        ("start", 4), ("hand", 2), ("train", 2),
        ("hand", 4), ("train", 4),
    ]  # fmt: skip


def test_resumes_skip_reaches_the_sampler_so_skipped_batches_are_neither_loaded_nor_copied() -> None:
    dataset, log = Counting(), []
    loader = make_batches(Split(dataset, train=True), LOADER, Place(CPU, seed=0))
    loader.set_epoch(1)
    whole = labels_of(loader)
    prefetcher = DevicePrefetcher(loader, LoggedCopies(log))
    dataset.loaded.clear()
    prefetcher.set_epoch(1, skip=2)  # batches of 16: the last 8 samples are left
    assert len(prefetcher) == 1 and labels_of(prefetcher) == whole[32:]
    assert sorted(dataset.loaded) == sorted(whole[32:]) and [e for e, _ in log] == ["start", "hand"]


def test_set_epoch_passes_through_to_a_resident_loader_too() -> None:
    resident = ResidentLoader(
        torch.zeros(10, 1, 1, 1), torch.arange(10), batch_size=4, shuffle=True, drop_last=False, seed=0
    )
    resident.set_epoch(3)
    order = labels_of(resident)
    prefetcher = DevicePrefetcher(resident, InlineCopies(CPU))
    prefetcher.set_epoch(3, skip=1)
    assert len(prefetcher) == 2 and labels_of(prefetcher) == order[4:]


def tiny_state() -> TrainState:
    torch.manual_seed(0)
    model = mlp((16,), 2, [8])
    return TrainState(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        PrecisionPolicy("cpu", None).make_scaler(),
        MicroBatcher(8, 8),
    )


def resident_batches(n: int = 64) -> ResidentLoader:
    images = torch.randint(0, 255, (n, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    loader = ResidentLoader(images, torch.arange(n) % 2, batch_size=8, shuffle=True, drop_last=False, seed=0)
    loader.set_epoch(1)
    return loader


class LoggedTimer(WallTimer):
    def __init__(self, log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.log = log

    def ready(self) -> None:
        self.log.append(("ready", -1))
        super().ready()

    def copied(self) -> None:
        self.log.append(("copied", -1))
        super().copied()


def epoch(batches: Any, timer: WallTimer, state: TrainState | None = None) -> Any:
    return train_epoch(
        state or tiny_state(),
        batches,
        inputs=Inputs(CPU, PrecisionPolicy("cpu", None), lambda x: x.float() / 255),
        timer=timer,
        hooks=EpochHooks(metrics=StepMetrics(every=100)),
    )


def test_under_the_step_timer_the_wait_for_the_copy_is_booked_as_the_copy_and_its_duration_reported() -> None:
    log: list[tuple[str, int]] = []
    stats = epoch(DevicePrefetcher(resident_batches(), LoggedCopies(log, seconds_each=0.25)), LoggedTimer(log))
    events = [e for e, _ in log]
    assert events[:5] == ["start", "start", "ready", "hand", "copied"]  # ready marked before the hand-over's wait
    assert events.count("ready") == events.count("hand") == events.count("copied") == 8
    b = stats.breakdown
    assert b.copy_s == pytest.approx(7 * 0.25)  # steps 2..8; the first step is reported alone
    assert b.metrics()["time/h2d_copy_ms"] == pytest.approx(250.0)
    assert b.step_s == pytest.approx(b.overhead_s + b.data_wait_s + b.h2d_s + b.compute_s)  # overlapped: not in it


def test_a_run_without_the_prefetcher_reports_no_side_stream_copy() -> None:
    b = epoch(resident_batches(), WallTimer()).breakdown
    assert b.copy_s == 0.0 and "time/h2d_copy_ms" not in b.metrics()


def test_the_prefetcher_changes_nothing_the_loop_computes() -> None:
    plain, prefetched = tiny_state(), tiny_state()
    first = epoch(resident_batches(), WallTimer(), plain)
    second = epoch(DevicePrefetcher(resident_batches(), InlineCopies(CPU)), WallTimer(), prefetched)
    assert first.loss == second.loss and first.steps == second.steps == 8
    for a, b in zip(plain.model.parameters(), prefetched.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_timer_keeps_the_copies_marks_and_lets_the_batches_go() -> None:
    refs: list[weakref.ref] = []
    timer = WallTimer()
    timer.start()
    for images, labels in timer.batches(DevicePrefetcher(resident_batches(), LoggedCopies([]))):
        refs.append(weakref.ref(images))
        timer.copied()
        timer.done(len(labels))
    del images, labels
    gc.collect()
    assert len(refs) == 8 and all(ref() is None for ref in refs)  # no batch lives on until the epoch's end
    assert timer.finish().copy_s == pytest.approx(7 * 0.25)


@pytest.mark.parametrize(
    ("setting", "device", "keys", "wanted"),
    [
        ("auto", "cpu", {}, False),
        ("auto", "cuda", {}, True),  # the DataLoader path, pinned (pin_memory=auto)
        ("auto", "cuda", {"pin_memory": True}, True),
        ("auto", "cuda", {"pin_memory": False}, False),  # an unpinned copy blocks the host: nothing to overlap
        ("auto", "cuda", {"resident": True}, False),  # on the device already
        ("auto", "mps", {}, False),
        (False, "cuda", {}, False),
        (True, "cuda", {}, True),
    ],
)
def test_prefetch_to_device_auto_is_on_for_pinned_dataloader_batches_on_cuda_only(
    setting: Any, device: str, keys: dict[str, Any], wanted: bool
) -> None:
    cfg = LoaderConfig(**{**LOADER.__dict__, **keys, "prefetch_to_device": setting})
    assert prefetch_wanted(cfg, torch.device(device)) is wanted
    loader = object()
    wrapped = with_prefetch(loader, cfg, device=torch.device(device), copies=InlineCopies)
    assert (isinstance(wrapped, DevicePrefetcher) and wrapped.batches is loader) if wanted else wrapped is loader


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_prefetch_to_device_true_without_cuda_is_refused_at_build_time(device: str) -> None:
    cfg = LoaderConfig(**{**LOADER.__dict__, "prefetch_to_device": True})
    with pytest.raises(ConfigError, match=rf"loader.prefetch_to_device=True .* auto or false on device {device}"):
        prefetch_wanted(cfg, torch.device(device))


def test_a_cpu_run_with_prefetch_to_device_true_fails_before_training(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"loader.prefetch_to_device=True .* on device cpu: .* needs CUDA"):
        train(make_cfg("tracking=none", "loader.prefetch_to_device=true"), echo=False)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["loader=resident", "loader.prefetch_to_device=true"], r"auto or false with loader.resident=true"),
        (["loader.pin_memory=false", "loader.prefetch_to_device=true"], r"auto or false with loader.pin_memory=false"),
        (["loader.prefetch_to_device=always"], r"loader.prefetch_to_device='always' .* true or false or one of 'auto'"),
    ],
)
def test_impossible_prefetch_settings_are_refused_by_validation(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load(overrides)


@pytest.mark.parametrize("option", ["default", "workers", "resident"])
def test_every_loader_option_leaves_prefetching_to_auto(option: str) -> None:
    assert load([f"loader={option}"]).loader.prefetch_to_device == "auto"


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()])


def test_a_run_resumed_through_the_prefetcher_ends_with_the_uninterrupted_runs_weights(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetcher on the CPU (``InlineCopies``: the same hand-over order), stopped at step 8 of 12 and resumed,
    against a run without it: same weights, same validation; the resumed epoch copies only its remaining batches."""
    base = ["trainer.epochs=2", "trainer.max_steps=-1", "loader.batch_size=256"]  # 6 batches an epoch on digits
    plain = train(make_cfg(*base, "tracking.experiment=plain"), echo=False)

    log: list[tuple[str, int]] = []

    def prefetched(batches: Any, cfg: LoaderConfig, *, device: torch.device) -> DevicePrefetcher:
        return DevicePrefetcher(batches, LoggedCopies(log if batches.sampler.shuffle else []))  # training's only

    monkeypatch.setattr(build_module, "with_prefetch", prefetched)
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 8)
        with pytest.raises(Stopped):
            train(make_cfg(*base), echo=False)
    stopped = [e for e, _ in log]
    assert (stopped.count("start"), stopped.count("hand")) == (9, 8)  # epoch 2's third batch was on its way
    log.clear()
    resumed = train(make_cfg(*base, "resume=latest"), echo=False)
    assert [e for e, _ in log].count("start") == [e for e, _ in log].count("hand") == 4  # batches 3..6 of epoch 2
    assert resumed.steps == plain.steps == 12 and torch.equal(weights(resumed.model), weights(plain.model))
    assert resumed.val_acc == plain.val_acc  # evaluation ran through the prefetcher too


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)


class FakeEvent:
    """A CUDA event stand-in: remembers the stream it was recorded on and a tick of a shared clock."""

    made: ClassVar[list[FakeEvent]] = []
    ticks: ClassVar[int] = 0  # one tick a record

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.stream: FakeStream | None = None
        self.at = 0
        FakeEvent.made.append(self)

    def record(self, stream: FakeStream) -> None:
        FakeEvent.ticks += 1
        self.stream, self.at = stream, FakeEvent.ticks

    def elapsed_time(self, later: FakeEvent) -> float:
        return 1000.0 * (later.at - self.at)


def test_cuda_copies_record_on_the_side_stream_and_hand_over_with_a_wait_and_record_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CudaCopies' stream logic with fake streams and events: the copy is bracketed by events on the side stream,
    the training stream waits for batch k's own copy event before k is used, and every tensor of the batch is
    marked as used by the training stream (so the caching allocator does not reuse its memory early)."""
    side, training, active = FakeStream("side"), FakeStream("training"), []
    marked: list[tuple[int, FakeStream]] = []

    @contextlib.contextmanager
    def on_stream(stream: FakeStream) -> Any:
        active.append(stream)
        yield
        active.pop()

    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: active[-1] if active else training)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: marked.append((int(t.view(-1)[0]), stream)))
    host = [(torch.full((2, 1), k), torch.full((2,), 10 + k)) for k in range(3)]

    copies = CudaCopies(CPU)  # a CPU "device": the copies are plain, the stream logic is CUDA's
    batches = []
    for images, labels in DevicePrefetcher(host, copies):
        assert len(training.waited) == len(batches) + 1 and len(FakeEvent.made) >= 2 * (len(batches) + 1)
        batches.append((int(images[0, 0]), int(labels[0])))
    starts, copied = FakeEvent.made[0::2], FakeEvent.made[1::2]
    assert batches == [(0, 10), (1, 11), (2, 12)]
    assert {event.stream for event in FakeEvent.made} == {side}  # the copy's events: on the side stream
    assert training.waited == copied and side.waited == []  # batch k waits for its own copy, in order
    assert marked == [(v, training) for k in range(3) for v in (k, 10 + k)]
    assert copies.seconds(starts[0], copied[0]) == pytest.approx(1.0)


@cuda
def test_cuda_copies_hand_every_pinned_batch_to_the_training_stream_in_order() -> None:
    device = torch.device("cuda")
    host = [
        (torch.full((256, 3, 32, 32), i, dtype=torch.uint8).pin_memory(), torch.full((256,), i).pin_memory())
        for i in range(6)
    ]
    seen = []
    for images, labels in DevicePrefetcher(host, CudaCopies(device)):
        assert images.device.type == labels.device.type == "cuda"
        torch.cuda._sleep(2_000_000)  # the training stream is busy while the next copy runs on the side stream
        seen.append((int(images.float().mean()), int(labels.min()), int(labels.max())))
    assert seen == [(i, i, i) for i in range(6)]


@cuda
def test_a_cuda_run_with_the_prefetcher_trains_as_one_without_and_times_its_copies(make_cfg: MakeCfg) -> None:
    base = ["tracking=none", "device=cuda", "trainer.max_steps=20", "loader.batch_size=64"]
    off = train(make_cfg(*base, "loader.prefetch_to_device=false"), echo=False)
    on = train(make_cfg(*base, "loader.prefetch_to_device=true"), echo=False)
    torch.testing.assert_close(weights(on.model), weights(off.model))
    assert on.val_acc == pytest.approx(off.val_acc, abs=1e-3)
    assert on.breakdown.copy_s > 0 and off.breakdown.copy_s == 0.0
