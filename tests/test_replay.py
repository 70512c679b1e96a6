"""The loader's ceiling (issue 37, item 2): ``perf/replay_speedup``, a few steps replayed on one batch already on the
device, against the run's steady step time; training left exactly as it would have been without them."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient

import pipeline.engine.building.build as build_module
import pipeline.engine.observe.replay as replay_module
from helpers import LEAN
from pipeline.engine.hot.loop import EpochHooks, train_epoch
from pipeline.engine.hot.memory import MicroBatcher
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.hot.step import SOLO, Inputs, Peers, TrainState
from pipeline.engine.hot.timing import WallTimer
from pipeline.engine.observe.replay import BUDGET, MOST, ReplayCheck, ReplayOutcome, SetAside, plan, replay
from pipeline.engine.optim import Clipping, Schedule
from pipeline.engine.results import RunResult
from pipeline.report.summary import format_summary
from pipeline.train import train

SETS = '''
import time

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

HOOK_CALLS = []


class Slow(Dataset):
    """A loader's work, as sleep: each item takes sleep_s to load."""

    def __init__(self, x, y, sleep_s):
        self.x, self.y, self.sleep_s = x, y, sleep_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[index], self.y[index]


def sets(n=96, sleep_s=0.0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n + 32, 16, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return Slow(x[:n], y[:n], sleep_s), TensorDataset(x[n:], y[n:])


class Net(nn.Module):
    """What a replay could disturb: BatchNorm's statistics and dropout's draws."""

    def __init__(self, num_classes, width=32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, num_classes)
        )

    def forward(self, x):
        return self.body(x)


class Carrying(nn.Module):
    """State carried across batches in plain attributes, as research code keeps a recurrent model's memory: a tensor
    rebound every step, one changed in place, and a count."""

    def __init__(self, num_classes, width=32):
        super().__init__()
        self.inp, self.out = nn.Linear(16, width), nn.Linear(width, num_classes)
        self.memory, self.total, self.seen = None, torch.zeros(width), 0

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.training:
            if self.memory is not None and self.memory.shape == h.shape:
                h = h + 0.5 * self.memory + 0.01 * self.total
            self.memory = h.detach()
            self.total += h.detach().mean(0)
            self.seen += 1
        return self.out(h)


def counting(model, batch, ctx):
    """A step hook that keeps a running count and the last loss in ctx.state."""
    inputs, targets = batch
    HOOK_CALLS.append(ctx.step)
    loss = ctx.loss(model(inputs), targets)
    ctx.state["seen"] = ctx.state.get("seen", 0) + 1
    ctx.state["last"] = loss.detach() + ctx.state.get("last", torch.zeros(()))
    return loss
'''

DATA = ["data=custom", "data._target_=sets.sets", "data.num_classes=2", "model=custom", "model._target_=sets.Net"]
SLOW = ["data.sleep_s=0.005", "loader.batch_size=8"]  # 40 ms of loading a step, against about 1 ms of compute
HOOK = ["step=custom", "step._target_=sets.counting"]
UNLIMITED = ["trainer.max_steps=-1", *LEAN]


@pytest.fixture
def sets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "sets.py").write_text(SETS.lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sets", raising=False)
    return __import__("sets")


def _metrics(store_uri: str, run_id: str | None) -> dict[str, float]:
    assert run_id is not None
    return MlflowClient(store_uri).get_run(run_id).data.metrics


def test_a_slowed_loader_records_a_replay_speedup_above_2_within_its_budget(
    make_cfg: Any, store_uri: str, sets: Any
) -> None:
    """50 steps of over 40 ms: 1% of them leaves room for a first replayed step of up to 40 ms, a busy machine's too."""
    torch.set_num_threads(1)  # a tiny model's steps: one thread is as fast, and its time is steadier (conftest resets)
    result = train(make_cfg(*DATA, *SLOW, "data.n=400", "trainer.epochs=1", *UNLIMITED), echo=False)
    metrics = _metrics(store_uri, result.run_id)
    assert metrics["perf/replay_speedup"] > 2, metrics
    assert result.replay is not None and 1 <= result.replay.steps <= MOST
    assert 0 < metrics["time/replay_s"] <= BUDGET * result.total_s
    assert metrics["perf/replay_step_ms"] < metrics["time/step_ms"]
    assert "perf.replay" not in MlflowClient(store_uri).get_run(result.run_id).data.tags
    (line,) = [line for line in format_summary(result).splitlines() if line.startswith("  free data")]
    assert "with free data this run would go" in line and "faster: at most that from the loader" in line


def test_a_resident_loader_records_a_replay_speedup_near_1(
    make_cfg: Any, store_uri: str, sets: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its steps have nothing to wait for: replayed, they take about as long. Steps of some 10 ms, replayed 5 times
    (the budget opened for it: the subject is the value), so that the few replayed steps see the same share of a
    busy machine as the run's 50."""
    monkeypatch.setattr(replay_module, "BUDGET", 1.0)
    torch.set_num_threads(1)
    resident = ["loader=resident", "data.n=12800", "loader.batch_size=256", "model.width=2048"]
    result = train(make_cfg(*DATA, *resident, "trainer.epochs=1", *UNLIMITED), echo=False)
    assert result.replay is not None and result.replay.steps == MOST
    speedup = _metrics(store_uri, result.run_id)["perf/replay_speedup"]
    assert 0.3 < speedup < 2, speedup


ADAMW = ["optimizer=adamw", "scheduler=cosine"]
LBFGS = ["optimizer=custom", "optimizer._target_=torch.optim.LBFGS", "optimizer.lr=0.5", "optimizer.max_iter=3"]
VARIANTS = {
    "default": ADAMW,
    "hook": [*ADAMW, *HOOK],
    "micro_batches_amp": [*ADAMW, "oom.micro_batch_size=4", "amp=true"],  # accumulation, bf16 autocast
    "lbfgs": LBFGS,  # a closure optimizer: its step re-evaluates the batch
    "compile": [*ADAMW, "trainer.compile=true"],
    "carrying": [*ADAMW, "model._target_=sets.Carrying"],  # a model's own state in plain attributes
}


FAST = [variant for variant in VARIANTS if variant != "compile"]  # a list: the same order in every xdist worker


@pytest.mark.parametrize("variant", [*FAST, pytest.param("compile", marks=pytest.mark.slow)])
def test_the_replay_leaves_training_bit_identical(
    make_cfg: Any, store_uri: str, sets: Any, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """Weights, BatchNorm's statistics, the optimizer's state, the schedule's rate, dropout's random stream, a step
    hook's state and the logged losses of two epochs: the same bits with the replay (after epoch 1) as without it."""
    monkeypatch.setattr(replay_module, "BUDGET", 1.0)  # room for every step in a short run: the subject is the state
    chosen = VARIANTS[variant]
    data = [o for o in DATA if not any(o.split("=")[0] == c.split("=")[0] for c in chosen)]
    base = [*data, "loader.batch_size=8", *chosen, "trainer.epochs=2"]
    base += ["trainer.log_every_n_steps=3", "trainer.clip_grad_norm=1.0", *UNLIMITED]
    with_replay = train(make_cfg(*base, "tracking.experiment=on"), echo=False)
    calls = len(sets.HOOK_CALLS)
    sets.HOOK_CALLS.clear()
    without = train(make_cfg(*base, "trainer.replay_check=false", "tracking.experiment=off"), echo=False)
    assert with_replay.replay is not None and with_replay.replay.steps == MOST  # it did replay
    assert with_replay.replay.speedup is not None and "perf/replay_speedup" in _metrics(store_uri, with_replay.run_id)
    if variant == "hook":
        assert calls - len(sets.HOOK_CALLS) == MOST  # the hook was called for the replayed steps, nothing else
    for (name, a), (_, b) in zip(
        with_replay.model.state_dict().items(), without.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    client = MlflowClient(store_uri)
    for key in ("train/loss", "train/lr", "train/grad_norm"):
        on = [(m.step, m.value) for m in client.get_metric_history(with_replay.run_id, key)]
        off = [(m.step, m.value) for m in client.get_metric_history(without.run_id, key)]
        assert on == off and on, key  # no replayed step logged, every logged value the same
    assert with_replay.steps == without.steps == 24
    assert with_replay.val_loss == without.val_loss
    assert without.replay == ReplayOutcome(why_not="trainer.replay_check=false")
    assert client.get_run(without.run_id).data.tags["perf.replay"] == "not measured: trainer.replay_check=false"


def test_a_short_run_is_measured_too_its_start_up_counts_in_the_budget(
    make_cfg: Any, store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3-step run after a 5 s start-up: 1% of its training is no step, 1% of the run has room for a few."""
    built = build_module.build_model

    def slow_build(*args: Any, **kwargs: Any) -> Any:
        time.sleep(5.0)  # a user's model that takes its time to build (weights read from disk, say)
        return built(*args, **kwargs)

    planned: list[tuple[dict[str, Any], replay_module.Plan]] = []

    def spied(**kwargs: Any) -> replay_module.Plan:
        planned.append((kwargs, plan(**kwargs)))
        return planned[-1][1]

    monkeypatch.setattr(build_module, "build_model", slow_build)
    monkeypatch.setattr(replay_module, "plan", spied)
    result = train(make_cfg(*LEAN), echo=False)
    ((asked, room),) = planned
    assert asked["run_s"] >= 5.0  # the start-up is in the run's time
    if room.why_not:  # only where a loaded machine made one step's compute longer than the room (never seen idle)
        assert asked["compute_s"] > BUDGET * asked["run_s"] - 2 * asked["state_bytes"] / replay_module.COPY_BYTES_PER_S
        return
    assert result.replay is not None and result.replay.steps >= 1 and result.replay.speedup is not None
    metrics = _metrics(store_uri, result.run_id)
    assert metrics["perf/replay_speedup"] == pytest.approx(result.replay.speedup)
    assert "perf.replay" not in MlflowClient(store_uri).get_run(result.run_id).data.tags


def test_a_run_too_short_for_the_budget_says_why_it_replayed_nothing(
    make_cfg: Any, store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replay_module, "COPY_BYTES_PER_S", 1e3)  # as a model whose state takes minutes to set aside
    result = train(make_cfg(*LEAN), echo=False)
    assert result.replay is not None and result.replay.steps == 0 and result.replay.speedup is None
    tags, metrics = MlflowClient(store_uri).get_run(result.run_id).data.tags, _metrics(store_uri, result.run_id)
    assert tags["perf.replay"].startswith("not measured: one replayed step (")
    assert "would take more than 1% of the run's expected" in tags["perf.replay"]
    assert "perf/replay_speedup" not in metrics
    assert f"  free data   {tags['perf.replay']}" in format_summary(result)


def test_the_budget_leaves_room_for_a_first_step_at_a_real_steps_compute_or_says_why_not() -> None:
    assert plan(compute_s=0.01, state_bytes=0, run_s=100.0).room_s == pytest.approx(1.0)
    assert plan(compute_s=0.09, state_bytes=int(1e8), run_s=30.0).room_s == pytest.approx(0.1)
    refused = plan(compute_s=0.11, state_bytes=int(1e8), run_s=30.0)  # 0.2 s of 0.3 s to set aside
    assert refused.room_s == 0 and refused.why_not == (
        "one replayed step (up to 110 ms) and setting the training state aside and back (about 200 ms) would take "
        "more than 1% of the run's expected 30.0 s"
    )


def test_the_first_replayed_steps_time_says_how_many_more_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    train_epoch(state, _batches(), inputs=INPUTS, timer=WallTimer())
    step_s, steps, why_not = replay(state, _batches(1)[0], room_s=0.0, inputs=INPUTS, group=SOLO)
    assert steps == 1 and step_s > 0 and why_not == ""  # the first alone: no room for more
    timed: list[int] = []

    def steps_of_a_tenth(state: TrainState, batch: Any, steps: int, **kwargs: Any) -> float:
        timed.append(steps)  # a step takes 0.1 s, whatever else the machine is doing
        return 0.1 * steps

    monkeypatch.setattr(replay_module, "_timed", steps_of_a_tenth)
    step_s, steps, _ = replay(state, _batches(1)[0], room_s=0.35, inputs=INPUTS, group=SOLO)
    assert steps == 3 and timed == [1, 2] and step_s == pytest.approx(0.1)  # the first, and the 2 more that fit
    assert replay(state, _batches(1)[0], room_s=10.0, inputs=INPUTS, group=SOLO)[1] == MOST


def test_the_summary_says_how_much_faster_free_data_would_go_or_that_the_loader_costs_nothing() -> None:
    def line(outcome: ReplayOutcome) -> str:
        (said,) = [x for x in format_summary(_result(outcome)).splitlines() if x.startswith("  free data")]
        return said

    assert line(ReplayOutcome(0.012, 0.004, 5, 0.03)).startswith(
        "  free data   with free data this run would go 3.0× faster: at most that from the loader (5 step(s) replayed"
    )
    assert line(ReplayOutcome(0.00408, 0.004, 5, 0.03)) == (
        "  free data   the loader costs nothing measurable (1.02×): 5 step(s) replayed on one batch on the device took "
        "4 ms a step, the run's took 4.08 ms"
    )
    assert ReplayOutcome(0.00408, 0.004, 5, 0.03).metrics() == pytest.approx(
        {"perf/replay_speedup": 1.02, "perf/replay_step_ms": 4.0, "time/replay_s": 0.03}
    )


def _result(outcome: ReplayOutcome) -> RunResult:
    from pipeline.engine.hot.timing import combine
    from pipeline.engine.results import EpochResult

    epoch = EpochResult(1, 0.5, {"val/loss": 0.4, "val/acc": 0.9}, 1.0, 100.0, combine([]))
    return RunResult("r", None, "cpu", "cpu", "fp32", "default", 10, 5, 1.0, epochs=[epoch], replay=outcome)


# --- the state put back, piece by piece -------------------------------------------------------------------------


def _accumulate(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
    module.seen.add_(out.detach().mean(0))  # a buffer a forward changes in place


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)
    )
    model[1].register_buffer("seen", torch.zeros(8), persistent=False)  # not in state_dict, still put back
    model[1].register_forward_hook(_accumulate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = Schedule(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    clip = Clipping(list(model.parameters()), max_norm=0.5, value=None)
    return TrainState(
        model, optimizer, torch.amp.GradScaler("cpu", enabled=False), MicroBatcher(8, 8), scheduler=schedule, clip=clip
    )


INPUTS = Inputs(torch.device("cpu"), PrecisionPolicy("cpu", None), lambda x: x)


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _everything(state: TrainState) -> dict[str, Any]:
    """A training state's every part a step changes, copied."""
    import copy
    import random

    return copy.deepcopy(
        {
            "model": {k: v.clone() for k, v in state.model.state_dict().items()},
            "seen": state.model[1].seen.clone(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "context": dict(state.context.state),
            "norm": state.clip.norm,
            "micro": (state.micro.micro_batch, state.micro.found, len(state.micro.events)),
            "step": state.step,
            "rng": (torch.get_rng_state(), random.getstate()),
        }
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_replayed_steps_change_the_state_and_putting_it_back_restores_every_part() -> None:
    state = _state()
    train_epoch(state, _batches(), inputs=INPUTS, timer=WallTimer())
    state.context.state["hidden"] = torch.ones(2)
    before = _everything(state)
    aside = SetAside.of(state, INPUTS.device)
    images, labels = _batches(1)[0]
    from pipeline.engine.hot.step import run_step

    for _ in range(3):
        run_step(state, images, labels, inputs=INPUTS)
        state.context.state["hidden"] = state.context.state["hidden"] * 2
    assert not _same(_everything(state), {**before, "step": state.step})  # the steps did change it
    aside.put_back(state)
    assert _same(_everything(state), before)


def test_the_check_keeps_the_last_full_batch_replays_it_once_and_the_next_epochs_weights_are_unchanged() -> None:
    plain, checked = _state(), _state()
    check = ReplayCheck()
    for epoch in (1, 2):
        batches = [*_batches(), (torch.randn(3, 6), torch.randint(0, 3, (3,)))]  # a smaller last batch
        torch.manual_seed(epoch)  # the same dropout for both
        train_epoch(plain, batches, inputs=INPUTS, timer=WallTimer())
        torch.manual_seed(epoch)
        stats = train_epoch(checked, batches, inputs=INPUTS, timer=WallTimer(), hooks=EpochHooks(keep=check.keep))
        if epoch == 1:
            assert check._batch is not None and check._batch[0] is batches[3][0]  # the last full one, itself
        check.after_epoch(
            checked, stats.breakdown, inputs=INPUTS, group=SOLO, steps_left=10**6, started=time.perf_counter()
        )
        assert check._batch is None  # let go once replayed
    outcome = check.outcome(stats.breakdown)
    assert outcome.steps == MOST and outcome.speedup is not None and outcome.cost_s > 0
    for a, b in zip(plain.model.state_dict().values(), checked.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real process group of one rank (Gloo), as in test_distributed: DDP's reducer and hooks, in this process."""
    from pipeline.config import DeviceConfig
    from pipeline.parallel import distributed
    from pipeline.parallel.distributed import Group, Launch
    from servers import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(distributed, "_JOINED", [])  # else this process's later commands end it as a rank's would
    group = Group(Launch(0, 0, 1))
    group.join(DeviceConfig("cpu"))
    yield group
    group.close(clean=False)


def test_a_replay_under_ddp_runs_the_all_reduce_and_leaves_the_all_reduce_clock_alone(one_rank: Any) -> None:
    state = _state()
    state.model = one_rank.wrap(state.model)
    train_epoch(state, _batches(), inputs=INPUTS, timer=WallTimer(), peers=Peers(one_rank))
    clock = one_rank._clock
    one_rank.step_metrics()  # read: armed for the next training step
    spans, armed = list(clock.spans), clock.armed
    before = _everything_of(state)
    step_s, steps, why_not = replay(state, _batches(1)[0], room_s=10.0, inputs=INPUTS, group=one_rank)
    assert step_s > 0 and steps == MOST and why_not == ""
    assert clock.spans == spans and clock.armed == armed  # time/allreduce_ms is the training steps' alone
    assert _same(_everything_of(state), before)


def _everything_of(state: TrainState) -> dict[str, Any]:
    from pipeline.parallel.overlap import unwrap

    model = unwrap(state.model)
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "rng": torch.get_rng_state()}


def test_out_of_memory_at_the_smallest_micro_batch_in_a_replayed_step_ends_the_check_not_the_run(
    make_cfg: Any, store_uri: str, sets: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replay_module, "BUDGET", 1.0)
    replaying = {"now": False}
    timed = replay_module._timed

    def flagged(*args: Any, **kwargs: Any) -> float:
        replaying["now"] = True
        try:
            return timed(*args, **kwargs)
        finally:
            replaying["now"] = False

    def out_of_memory_in_the_replay(module: torch.nn.Module, inputs: Any) -> None:
        if replaying["now"]:
            raise torch.OutOfMemoryError("CUDA out of memory")

    built = build_module.build_model

    def build(*args: Any, **kwargs: Any) -> Any:
        model = built(*args, **kwargs)
        model.register_forward_pre_hook(out_of_memory_in_the_replay)
        return model

    base = [*DATA, "loader.batch_size=8", "trainer.epochs=2", "oom.min_micro_batch=4", *UNLIMITED]
    without = train(make_cfg(*base, "trainer.replay_check=false", "tracking.experiment=off"), echo=False)
    monkeypatch.setattr(replay_module, "_timed", flagged)
    monkeypatch.setattr(build_module, "build_model", build)
    result = train(make_cfg(*base), echo=False)
    assert result.replay is not None and result.replay.steps == 0 and result.micro_batch == 8 and not result.oom_events
    run = MlflowClient(store_uri).get_run(result.run_id)
    assert run.info.status == "FINISHED" and result.steps == without.steps == 24
    assert run.data.tags["perf.replay"].startswith(
        "not measured: a replayed step ran out of memory at the smallest micro-batch ("
    )
    for a, b in zip(result.model.state_dict().values(), without.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
