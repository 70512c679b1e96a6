"""The loader's ceiling: how fast a run's steps go when the data costs nothing (``perf/replay_speedup``).

    python -m pipeline data=custom data._target_=sets.make      # the summary's ``free data`` line says how much

At the end of the run's first epoch that timed a steady step, a few steps are replayed on one batch already on the
device (the epoch's last full one, as it was augmented): forward, backward and optimizer step as training runs them
(``run_step``: micro-batches, DDP's all-reduce, autocast and the scaler, a closure optimizer, the user's step hook),
with nothing to load, copy or augment. The run's steady step time (the four parts ``pipeline.engine.hot.timing``
measures, data wait included) over their mean time is ``perf/replay_speedup``: how many times faster the run would
go with free data. The pipeline's own work between steps is in the real step too, so that is the most any loader
setting could win: 1 means the loader costs nothing measurable.

Replaying never changes training. Before the first replayed step the training state is set aside on the host (the
weights and every buffer, BatchNorm's statistics too; the optimizer's state and hyper-parameters, the schedule, the
scaler, the micro-batch, the step hook's ``ctx.state``, clipping's last norm, the random streams: torch's, the
device's, Python's and NumPy's; and what a model keeps in plain attributes, as research code carries a recurrent
memory across batches: every module's attributes as they were bound, and the values of the tensors among them) and
after the last one put back as it was, bit for bit; the gradients are dropped, as each step's start drops them.
Replayed steps are not counted, timed as training steps or logged, and ``time/allreduce_ms`` never sees them. Under
DDP every rank replays the same steps together (the all-reduce is part of a step), as many as the rank with the least
room allows. A step hook is called for them as for any training step; what it does outside ``ctx.state`` and the
model (a file it writes, a list it appends to) is not undone. Out of memory at the smallest micro-batch in a replayed
step ends the check, not the run: the tag ``perf.replay`` says so.

Cost: at most ``BUDGET`` (1%) of the run's expected time (its time so far, from start-up on, and its steps still to
train at the steady step time; evaluation after this epoch comes on top), setting the state aside and back included
(estimated at ``COPY_BYTES_PER_S``): a short run whose start-up dwarfs its training is measured too. The first
replayed step runs only when a real step's compute fits what is left, and its measured time then says how many more
fit, at most ``MOST`` in all; their mean is the replayed step time (the first, warming up, only when it ran alone).
When not even one fits, none runs and the tag ``perf.replay`` says why, as it does for a run that timed no steady
step. Until it has run, the check holds one batch more on the device than training alone (the latest full one, by
reference). ``trainer.replay_check=false`` turns it off (``NoReplay``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeline.common.heap import collector_paused
from pipeline.common.metric_names import PERF_REPLAY_SPEEDUP, PERF_REPLAY_STEP_MS, TIME_REPLAY_S
from pipeline.engine.checkpointing.checkpoint import CheckpointError, plain_state
from pipeline.engine.hot.memory import OutOfMemoryAtMinimum
from pipeline.engine.hot.step import Inputs, Peers, run_step
from pipeline.engine.hot.timing import Breakdown
from pipeline.engine.models import attributes_now
from pipeline.parallel.distributed import Group, Solo
from pipeline.parallel.overlap import unwrap

if TYPE_CHECKING:
    from pipeline.engine.hot.step import TrainState

log = logging.getLogger("pipeline.engine.replay")  # the name its lines have always shown

BUDGET = 0.01  # of the run's expected time, for the whole check
MOST = 5  # replayed steps: enough for a mean, few enough for a long step to fit the budget
COPY_BYTES_PER_S = 1e9  # setting the state aside on the host and back, estimated low (memcpy and PCIe do several GB/s)
NOTHING_MEASURABLE = 1.1  # a speedup below this: the loader costs nothing the replay can tell from noise


@dataclass(frozen=True)
class ReplayOutcome:
    """What the check found: the run's steady step time and the replayed steps' mean, or why no step was replayed."""

    real_step_s: float = 0.0  # the run's steady step time (all its steady epochs pooled)
    replayed_step_s: float = 0.0  # one replayed step, their mean
    steps: int = 0  # replayed
    cost_s: float = 0.0  # the whole check: setting the state aside, the steps, putting it back
    why_not: str = ""  # no step replayed, or none to compare with: why

    @property
    def speedup(self) -> float | None:
        """Real step time over replayed step time; None when not measured."""
        if self.why_not or self.replayed_step_s <= 0 or self.real_step_s <= 0:
            return None
        return self.real_step_s / self.replayed_step_s

    def metrics(self) -> dict[str, float]:
        """``perf/replay_speedup``, ``perf/replay_step_ms`` and ``time/replay_s`` (the check's cost), or none."""
        if self.speedup is None:
            return {}
        return {
            PERF_REPLAY_SPEEDUP: self.speedup,
            PERF_REPLAY_STEP_MS: 1000.0 * self.replayed_step_s,
            TIME_REPLAY_S: self.cost_s,
        }

    def tags(self) -> dict[str, str]:
        """``perf.replay``: why there is no ``perf/replay_speedup`` (none when there is)."""
        return {"perf.replay": f"not measured: {self.why_not}"} if self.speedup is None else {}

    def describe(self) -> str:
        """The summary's ``free data`` line."""
        speedup = self.speedup
        if speedup is None:
            return f"not measured: {self.why_not}"
        said = (
            f"{self.steps} step(s) replayed on one batch on the device took {_ms(self.replayed_step_s)} a step, "
            f"the run's took {_ms(self.real_step_s)}"
        )
        if speedup < NOTHING_MEASURABLE:
            return f"the loader costs nothing measurable ({speedup:.2f}×): {said}"
        return f"with free data this run would go {speedup:.1f}× faster: at most that from the loader ({said})"


def _ms(seconds: float) -> str:
    ms = 1000.0 * seconds
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms:,.0f} ms"


@dataclass(frozen=True)
class Plan:
    """One rank's room for replayed steps (``room_s``), or why it has none."""

    room_s: float = 0.0  # the budget left once setting the state aside and back is paid for
    why_not: str = ""
    ready: bool = True  # this rank timed a steady step and kept a batch: the check can run after this epoch


def plan(*, compute_s: float, state_bytes: int, run_s: float) -> Plan:
    """The room ``BUDGET`` of the run's expected time (``run_s``) leaves for replayed steps once setting
    ``state_bytes`` aside and back is paid for; none unless a first step fits, at the cost of a real step's compute
    (``compute_s``: replayed, it is no slower)."""
    aside_s = 2 * state_bytes / COPY_BYTES_PER_S
    room_s = BUDGET * run_s - aside_s
    if room_s >= compute_s > 0:
        return Plan(room_s)
    return Plan(
        why_not=f"one replayed step (up to {_ms(compute_s)}) and setting the training state aside and back (about "
        f"{_ms(aside_s)}) would take more than {BUDGET:.0%} of the run's expected {run_s:.1f} s"
    )


class ReplayCheck:
    """The check of one run (see the module's docstring): ``keep`` sees every trained batch, ``after_epoch`` replays
    once an epoch timed a steady step, ``outcome`` says what it found against the run's steady step time."""

    def __init__(self) -> None:
        self._batch: tuple[Any, Any] | None = None
        self._samples = 0
        self._found: ReplayOutcome | None = None  # once decided: the replayed steps, or why none (no real time yet)

    def keep(self, images: Any, labels: Any, samples: int) -> None:
        """A batch just trained, on the device: the latest full one is kept for the replay (one reference, no copy)."""
        if self._found is None and samples >= self._samples:
            self._batch, self._samples = (images, labels), samples

    def after_epoch(
        self,
        state: TrainState,
        breakdown: Breakdown,
        *,
        inputs: Inputs,
        group: Solo | Group,
        steps_left: int,
        started: float,
    ) -> None:
        """After an epoch's training (``breakdown``: its steps' times), before its evaluation: replay the kept batch
        when every rank is ready and has room (a collective: every rank calls it after every epoch), once.
        ``steps_left``: the steps the run has still to train; ``started``: its start (``time.perf_counter``)."""
        if self._found is not None:
            return
        plans = group.gather(self._plan(state, breakdown, steps_left=steps_left, started=started))
        if not all(p.ready for p in plans):
            return  # no steady step timed yet somewhere: the next epoch's end
        why_not = next((p.why_not for p in plans if p.why_not), "")
        batch, self._batch = self._batch, None
        if why_not or batch is None:
            self._found = ReplayOutcome(why_not=why_not)
            return
        began = time.perf_counter()
        step_s, steps, why_not = replay(state, batch, room_s=min(p.room_s for p in plans), inputs=inputs, group=group)
        self._found = ReplayOutcome(0.0, step_s, steps, time.perf_counter() - began, why_not)
        if steps:
            log.info("replayed %d step(s) on one batch: %.2f ms a step", steps, 1000.0 * step_s)

    def _plan(self, state: TrainState, breakdown: Breakdown, *, steps_left: int, started: float) -> Plan:
        if not breakdown.steady_steps or self._batch is None:
            return Plan(ready=False)
        try:
            plain_state(state.context.state)  # what a checkpoint keeps, the replay sets aside
        except CheckpointError as err:
            held = str(err).split(": a checkpoint keeps")[0]  # "ctx.state['x'] holds a module.Class"
            return Plan(why_not=f"{held}, which the replay does not set aside (tensors, numbers, strings, containers)")
        steady = breakdown.steady_steps
        step_s = breakdown.step_s / steady
        return plan(
            compute_s=breakdown.compute_s / steady,
            state_bytes=state_bytes(state),
            run_s=time.perf_counter() - started + max(steps_left, 0) * step_s,
        )

    def outcome(self, breakdown: Breakdown) -> ReplayOutcome:
        """What the check found, against ``breakdown`` (the run's steady steps pooled)."""
        if self._found is None:
            return ReplayOutcome(why_not="no epoch timed a steady step (an epoch's first step is warm-up)")
        real_s = breakdown.step_s / breakdown.steady_steps if breakdown.steady_steps else 0.0
        return dataclasses.replace(self._found, real_step_s=real_s)


class NoReplay:
    """``trainer.replay_check=false``: nothing kept, nothing replayed, and the record says it was off."""

    def keep(self, images: Any, labels: Any, samples: int) -> None:
        pass

    def after_epoch(
        self,
        state: TrainState,
        breakdown: Breakdown,
        *,
        inputs: Inputs,
        group: Solo | Group,
        steps_left: int,
        started: float,
    ) -> None:
        pass

    def outcome(self, breakdown: Breakdown) -> ReplayOutcome:
        return ReplayOutcome(why_not="trainer.replay_check=false")


NO_REPLAY = NoReplay()


def make_replay(trainer: Any) -> ReplayCheck | NoReplay:
    """The run's check (``trainer.replay_check``), or none."""
    return ReplayCheck() if trainer.replay_check else NO_REPLAY


def replay(
    state: TrainState, batch: tuple[Any, Any], *, room_s: float, inputs: Inputs, group: Solo | Group
) -> tuple[float, int, str]:
    """Training steps on ``batch`` within ``room_s`` seconds, the training state set aside before and put back after:
    one, then as many more as its time says fit (at most ``MOST`` in all; under DDP every rank the fewest any rank
    has room for). Returns a replayed step's seconds (the mean of those after the first, the first when alone), the
    steps, and why that is no steady step's time ("" when it is)."""
    aside = SetAside.of(state, inputs.device)
    events, compiles = len(state.micro.events), state.compiles.count
    try:
        # as timeit does, no cyclic collection while timing: one full pass (0.1-0.5 s with torch.compile's heap) in
        # a handful of steps would make them look many times slower than the run's, whose mean spreads such passes
        with group.untimed(), collector_paused(freeze=False):  # and time/allreduce_ms is the training steps'
            first_s = _timed(state, batch, 1, inputs=inputs, group=group)
            more = min(group.gather(min(MOST - 1, int((room_s - first_s) / first_s)) if first_s > 0 else 0))
            step_s = _timed(state, batch, more, inputs=inputs, group=group) / more if more > 0 else first_s
        why_not = ""
    except OutOfMemoryAtMinimum as err:  # a measurement ends, the run goes on (its own steps meet their own memory)
        log.warning("the replay check stopped: %s", err)
        return 0.0, 0, f"a replayed step ran out of memory at the smallest micro-batch ({err})"
    else:
        if len(state.micro.events) != events:
            why_not = "the replayed steps ran out of memory (their time is the fallback's)"
        elif state.compiles.count != compiles:
            why_not = "the replayed steps compiled (their time is torch.compile's)"
        return step_s, 1 + max(more, 0), why_not
    finally:
        aside.put_back(state)


def _timed(state: TrainState, batch: tuple[Any, Any], steps: int, *, inputs: Inputs, group: Solo | Group) -> float:
    """Seconds ``steps`` steps on ``batch`` take, the device's queued work waited for at both ends (a host sync)."""
    images, labels = batch
    _wait_for(inputs.device)
    began = time.perf_counter()
    for _ in range(steps):
        run_step(state, images, labels, inputs=inputs, peers=Peers(group))  # never logs: no log, no carry
    _wait_for(inputs.device)
    return time.perf_counter() - began


def _wait_for(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class _Held:
    """A tensor copied to the host, and the device it goes back to."""

    tensor: torch.Tensor
    device: torch.device


def _aside(value: Any) -> Any:
    """``value`` copied: tensors to the host (with their device), containers rebuilt, the rest deep-copied."""
    if isinstance(value, torch.Tensor):
        return _Held(value.detach().to("cpu", copy=True), value.device)
    if type(value) is dict:
        return {key: _aside(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_aside(item) for item in value)
    return copy.deepcopy(value)


def _back(value: Any) -> Any:
    """What ``_aside`` copied, back where it was (new objects, so a later step cannot change the copy)."""
    if isinstance(value, _Held):
        return value.tensor.to(value.device, copy=True)
    if type(value) is dict:
        return {key: _back(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_back(item) for item in value)
    return copy.deepcopy(value)


def plain_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors ``model``'s modules keep in plain attributes (neither parameters nor buffers), once each."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_meta:
                found.setdefault(id(value), value)
    return list(found.values())


def state_bytes(state: TrainState) -> int:
    """The bytes ``SetAside`` copies: the weights and buffers, the optimizer's state, the step hook's and the
    tensors in the model's plain attributes."""
    model = unwrap(state.model)
    tensors = [*model.parameters(), *model.buffers(), *plain_tensors(model)]
    tensors += [v for s in state.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors += [v for v in state.context.state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class SetAside:
    """A training state's every part that a step changes, copied to the host (``of``) and put back (``put_back``)."""

    tensors: list[torch.Tensor]  # the model's parameters and buffers, in place
    values: list[torch.Tensor]  # their values, on the host
    optimizer: dict[Any, Any]  # per parameter
    groups: list[dict[str, Any]]  # the hyper-parameters (the schedule sets the rate there)
    scheduler: Any
    scaler: dict[str, Any]
    micro: tuple[int, bool, int]  # micro-batch, found, events
    context: Any  # ctx.state
    norm: Any  # clipping's last norm (read at logging points)
    rng: dict[str, Any]
    attributes: list[Callable[[], None]]  # every module's attributes as bound now (``attributes_now``)
    plain: list[tuple[torch.Tensor, torch.Tensor]]  # tensors in plain attributes, and their values on the host

    @classmethod
    def of(cls, state: TrainState, device: torch.device) -> SetAside:
        model = unwrap(state.model)
        tensors = [*model.parameters(), *model.buffers()]  # non-persistent buffers too: no state_dict
        optimizer = state.optimizer
        return cls(
            tensors,
            [t.detach().to("cpu", copy=True) for t in tensors],
            {p: _aside(s) for p, s in optimizer.state.items()},
            [_aside({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups],
            _aside(state.scheduler.state_dict()),
            state.scaler.state_dict(),  # plain numbers ({} when off)
            (state.micro.micro_batch, state.micro.found, len(state.micro.events)),
            _aside(state.context.state),
            state.clip.norm,
            random_state(device),
            [attributes_now(module) for module in model.modules()],
            [(t, t.detach().to("cpu", copy=True)) for t in plain_tensors(model)],
        )

    def put_back(self, state: TrainState) -> None:
        for restore in self.attributes:
            restore()
        with torch.no_grad():
            for tensor, value in zip(self.tensors, self.values, strict=True):
                tensor.copy_(value)
            for tensor, value in self.plain:
                if tensor.shape == value.shape:  # else resized in place: the binding is all that can be put back
                    tensor.copy_(value)
        state.optimizer.zero_grad(set_to_none=True)  # as each step's start does: nothing reads them in between
        state.optimizer.state.clear()
        state.optimizer.state.update({p: _back(s) for p, s in self.optimizer.items()})
        for group, saved in zip(state.optimizer.param_groups, self.groups, strict=True):
            group.update(_back(saved))
        state.scheduler.load_state_dict(_back(self.scheduler))
        if self.scaler:
            state.scaler.load_state_dict(self.scaler)
        micro = state.micro
        micro.micro_batch, micro.found = self.micro[:2]
        del micro.events[self.micro[2] :]
        state.context.state.clear()
        state.context.state.update(_back(self.context))
        if state.clip.norm is not self.norm:
            state.clip.norm = self.norm
        set_random_state(self.rng)


def random_state(device: torch.device) -> dict[str, Any]:
    """Every random stream a step may draw from: torch's, the training device's, Python's, NumPy's (when imported)."""
    saved: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        saved["cuda"] = (device, torch.cuda.get_rng_state(device))
    elif device.type == "mps":
        saved["mps"] = torch.mps.get_rng_state()
    numpy = sys.modules.get("numpy")  # not imported: nothing drew from it
    if numpy is not None:
        saved["numpy"] = numpy.random.get_state()
    return saved


def set_random_state(saved: dict[str, Any]) -> None:
    setters: dict[str, Callable[[Any], None]] = {
        "torch": torch.set_rng_state,
        "python": random.setstate,
        "cuda": lambda held: torch.cuda.set_rng_state(held[1], held[0]),
        "mps": lambda value: torch.mps.set_rng_state(value),
        "numpy": lambda value: sys.modules["numpy"].random.set_state(value),
    }
    for key, value in saved.items():
        setters[key](value)
