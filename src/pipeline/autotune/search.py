"""The search: interleaved rounds, dropping the clearly slow, the worker plateau, the budget, the batch size;
then fresh confirmation rounds for what the search chose.

``tune`` times the candidates (``candidates.candidates``) with whatever ``measure`` it is given (the real one is
``trials.Trials.measure``; tests pass a fake and a fake clock) and returns an ``Outcome`` for ``report``.

Choosing the fastest of several noisy measurements and then quoting its margin from the same measurements
overstates it (the winner is, in part, the luckiest), and so does stopping when the lead looks large. So the
search only *chooses*: its early stops may favour whatever they like. The margin the tuner claims comes from
``Settings.confirm`` rounds run afterwards, the winner, the current setting and the runner-up timed again side
by side in alternating order (or, with ``Settings.order_seed``, in a seeded random order: every rank of a DDP
job draws the same), with ``CONFIRM_SHARE`` of the budget kept for them.

``search`` is the same for any list of candidates (``python -m pipeline.tune`` hands it whole-config variants); a
candidate whose trial raises ``Unusable`` is skipped with the reason, and the search goes on without it.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.autotune.candidates import Candidate, Machine, candidates, prefetch_variant, worker_ladder
from pipeline.common.device_memory import is_oom
from pipeline.config import LoaderConfig

PLATEAU_GAIN = 0.03  # a doubling of the workers that gains less than this ends the ladder
DROP_BELOW = 0.80  # a candidate whose best round is under this share of the leader's median is dropped ...
DROP_BELOW_FIRST = 0.50  # ... or this share after round 1, where "best" is a single, possibly unlucky, round
BATCH_SEARCH_SHARE = 0.5  # the batch-size search may use at most this share of the budget
CONFIRM_SHARE = 0.25  # kept for the confirmation rounds: the search stops at the rest
CLEAR_LEAD = "the leader's slowest round beat the runner-up's fastest"  # the search's one stop that ranks the top two


@dataclass(frozen=True)
class Settings:
    budget_s: float = 90.0  # no trial starts that would end after this many seconds
    steps: int = 20  # timed training steps per trial
    warmup: int = 3  # untimed steps before them (worker start-up, allocator, cuDNN autotuning); >= 1
    rounds: int = 3  # interleaved rounds at most
    search_batch_size: bool = False  # first double loader.batch_size until out of memory or no faster
    confirm: int = 6  # fresh rounds of the winner, the current setting and the runner-up, after the search
    order_seed: int | None = None  # None: confirmation rounds alternate their order; else a seeded random order
    runner_up: bool = True  # the runner-up is confirmed too (its margin is printed); false: only when the search
    # left the lead unclear (no ``CLEAR_LEAD``), else winner vs current only


class Unusable(Exception):
    """A candidate this device or run cannot use (autocast unsupported, compile unavailable, out of memory): its
    message is the reason, printed in its row."""


class Measure(Protocol):
    def __call__(self, candidate: Candidate, *, steps: int, warmup: int) -> float:
        """Samples per second over ``steps`` timed training steps after ``warmup`` untimed ones."""
        ...


@dataclass
class Tally:
    """One candidate's samples/s by round (round 0: the batch-size search), and why it is no longer timed."""

    candidate: Candidate
    by_round: dict[int, float] = field(default_factory=dict)
    stopped: str = ""  # empty while it is still in the running

    @property
    def measured(self) -> bool:
        return bool(self.by_round)

    @property
    def median(self) -> float:
        return statistics.median(self.by_round.values())

    @property
    def low(self) -> float:
        return min(self.by_round.values())

    @property
    def high(self) -> float:
        return max(self.by_round.values())


@dataclass(frozen=True)
class Trial:
    candidate: Candidate
    round: int  # 0: the batch-size search
    samples_per_s: float | None  # None: out of memory
    seconds: float  # the trial's wall time, building the candidate included the first time
    confirm: bool = False  # a confirmation round's trial (``round`` counts those from 1 too)


@dataclass(frozen=True)
class Outcome:
    current: Candidate
    tallies: list[Tally]  # every candidate considered, in the first round's order
    rounds: int  # rounds with at least one trial
    stop_reason: str
    cut_short: bool  # the time budget ended the search
    elapsed_s: float
    budget_s: float
    trials: list[Trial]
    batch_sizes: list[tuple[int, float | None]]  # --batch-size: samples/s per size tried, None = out of memory
    batch_size: int  # what the candidates other than the current setting use
    confirmed: list[Tally] = field(default_factory=list)  # the finalists' confirmation rounds, winner first
    unconfirmed: str = ""  # why there are none ("" when there are)

    def confirmation(self, candidate: Candidate) -> Tally | None:
        return next((t for t in self.confirmed if t.candidate == candidate and t.measured), None)

    def ranking(self) -> list[Tally]:
        """The measured candidates, fastest median first."""
        return sorted((t for t in self.tallies if t.measured), key=lambda t: t.median, reverse=True)

    def tally(self, candidate: Candidate) -> Tally | None:
        return next((t for t in self.tallies if t.candidate == candidate and t.measured), None)


class _Session:
    """Runs trials while the budget allows, and remembers what each took."""

    def __init__(
        self,
        measure: Measure,
        release: Callable[[Candidate], None],
        clock: Callable[[], float],
        settings: Settings,
        started: float | None,
    ) -> None:
        self.measure, self.release, self.clock, self.settings = measure, release, clock, settings
        self.started = clock() if started is None else started
        self.built: set[Candidate] = set()
        self.first_s: list[float] = []  # trials that built their candidate
        self.again_s: list[float] = []
        self.trials: list[Trial] = []
        self.cut_short = False
        self.next_s = 0.0  # what the trial refused for lack of time was expected to take
        self.limit_s = settings.budget_s  # where trials stop by default: the search's share, then the whole budget

    def elapsed(self) -> float:
        return self.clock() - self.started

    def run(
        self, candidate: Candidate, round_: int, *, within_s: float | None = None, confirm: bool = False
    ) -> float | None:
        """Samples/s of one trial, or None (nothing run) when it would end after ``within_s`` (default:
        ``limit_s``).

        The estimate is the longest trial of its kind so far (first trials pay for the build), so the budget is
        not overrun by more than one trial's variation.
        """
        first = candidate not in self.built
        durations = (self.first_s if first else self.again_s) or self.first_s or self.again_s
        estimate = max(durations, default=0.0)
        if self.elapsed() + estimate > (self.limit_s if within_s is None else within_s):
            if within_s is None:
                self.cut_short, self.next_s = True, estimate
            return None
        self.built.add(candidate)
        begun = self.clock()
        value = None
        try:
            value = self.measure(candidate, steps=self.settings.steps, warmup=self.settings.warmup)
        finally:
            seconds = self.clock() - begun
            (self.first_s if first else self.again_s).append(seconds)
            self.trials.append(Trial(candidate, round_, value, seconds, confirm))
        return value


def tune(
    current: LoaderConfig,
    *,
    measure: Measure,
    machine: Machine,
    settings: Settings = Settings(),
    release: Callable[[Candidate], None] = lambda candidate: None,
    clock: Callable[[], float] = time.monotonic,
    started: float | None = None,
) -> Outcome:
    """Time the candidates in interleaved rounds and rank them.

    Args:
        current: the run's loader group, as configured.
        measure: times one trial (``Trials.measure``; tests pass a fake).
        machine: what the candidates depend on.
        settings: budget, steps and rounds.
        release: frees a candidate that will not be timed again (its model, data and workers).
        clock: seconds, for the budget.
        started: the clock's value when the budget began (default: now).
    """
    session = _Session(measure, release, clock, settings, started)
    batch_size, batch_sizes = current.batch_size, []
    if settings.search_batch_size:
        session.limit_s = settings.budget_s * (1 - CONFIRM_SHARE) if settings.confirm else settings.budget_s
        batch_size, batch_sizes = _search_batch_size(current, session, cap=machine.max_batch_size)
    plan = candidates(current, machine, batch_size=batch_size)
    outcome = _searched(plan, Candidate(current), session, ladder=worker_ladder(machine.max_workers))
    return dataclasses.replace(outcome, batch_sizes=batch_sizes, batch_size=batch_size)


def search(
    plan: list[Candidate],
    *,
    measure: Measure,
    settings: Settings = Settings(),
    release: Callable[[Candidate], None] = lambda candidate: None,
    clock: Callable[[], float] = time.monotonic,
    started: float | None = None,
    ladder: list[int] | None = None,
) -> Outcome:
    """``tune``'s rounds and confirmation over any ``plan``, the current setting first in it: the search of
    ``python -m pipeline.tune``. ``ladder`` is the worker ladder whose plateau ends it early (none: no plateau)."""
    session = _Session(measure, release, clock, settings, started)
    return _searched(plan, plan[0], session, ladder=ladder or [])


def _searched(plan: list[Candidate], now: Candidate, session: _Session, *, ladder: list[int]) -> Outcome:
    """The search, then the confirmation of its finalists, as an ``Outcome``."""
    settings = session.settings
    if settings.confirm:
        session.limit_s = settings.budget_s * (1 - CONFIRM_SHARE)
    tallies = {c: Tally(c) for c in plan}
    reason = _search(plan, tallies, session, ladder=ladder, current=now)
    for tally in tallies.values():
        if not tally.measured and not tally.stopped:
            tally.stopped = "not measured: time budget"
    finalists = _finalists(list(tallies.values()), now, runner_up=settings.runner_up or reason != CLEAR_LEAD)
    for tally in tallies.values():
        if tally.candidate not in finalists:
            session.release(tally.candidate)
    confirmed, unconfirmed = _confirm(finalists, session, settings)
    for candidate in finalists:
        session.release(candidate)
    return Outcome(
        current=now,
        tallies=list(tallies.values()),
        rounds=max((t.round for t in session.trials if not t.confirm), default=0),  # the search's, with a trial
        stop_reason=reason,
        cut_short=session.cut_short,
        elapsed_s=session.elapsed(),
        budget_s=settings.budget_s,
        trials=session.trials,
        batch_sizes=[],
        batch_size=now.loader.batch_size,
        confirmed=confirmed,
        unconfirmed=unconfirmed,
    )


def _search(
    plan: list[Candidate], tallies: dict[Candidate, Tally], session: _Session, *, ladder: list[int], current: Candidate
) -> str:
    """Interleaved rounds over ``plan`` (each in the reverse order of the last, without the dropped), filling
    ``tallies``; returns why the search stopped."""
    settings, order = session.settings, plan
    for round_ in range(1, settings.rounds + 1):
        if round_ > 1:
            order = [c for c in reversed(order) if not tallies[c].stopped]
        order = _round(order, round_, tallies, session, ladder=ladder, current=current)
        if session.cut_short:
            return (
                f"cut short: the next trial (about {session.next_s:.1f} s) would have passed the search's "
                f"{session.limit_s:g} s of the {settings.budget_s:g} s budget"
            )
        for dropped in _drop_slow(tallies.values(), round_):
            session.release(dropped.candidate)  # its workers and model, before the next round
        if reason := _settled(tallies.values(), round_):
            return reason
    return f"all {settings.rounds} round(s) done"


def _round(
    order: list[Candidate],
    round_: int,
    tallies: dict[Candidate, Tally],
    session: _Session,
    *,
    ladder: list[int],
    current: Candidate,
) -> list[Candidate]:
    """One round: each candidate in ``order`` timed once, until the budget runs out (round 1: past the worker
    plateau, then the prefetch variant of the leader); returns those timed, in order."""
    timed = []
    for candidate in order:
        why = _plateau(candidate, tallies.values(), ladder) if round_ == 1 and candidate != current else ""
        if why:
            tallies[candidate].stopped = why
            continue
        try:
            value = session.run(candidate, round_)
        except Unusable as why:
            tallies[candidate].stopped = f"skipped: {why}"
            session.release(candidate)
            continue
        if value is None:
            break
        tallies[candidate].by_round[round_] = value
        timed.append(candidate)
    if round_ == 1 and not session.cut_short:
        variant = _prefetch_candidate(tallies.values())
        if variant is not None and variant not in tallies:
            tallies[variant] = Tally(variant)
            value = session.run(variant, round_)
            if value is not None:
                tallies[variant].by_round[round_] = value
                timed.append(variant)
    return timed


def _settled(tallies: Any, round_: int) -> str:
    """Why the search may stop after ``round_`` ("" = go on): one candidate left, or a clear leader."""
    running = sorted((t for t in tallies if t.measured and not t.stopped), key=lambda t: -t.median)
    if len(running) < 2:
        return "one candidate left"
    if round_ >= 2 and running[0].low > running[1].high:
        return CLEAR_LEAD
    return ""


def _finalists(tallies: list[Tally], current: Candidate, *, runner_up: bool = True) -> list[Candidate]:
    """The search's winner, the current setting and (``runner_up``) the runner-up, as far as they were measured."""
    ranking = sorted((t for t in tallies if t.measured), key=lambda t: t.median, reverse=True)
    found = [t.candidate for t in ranking[:1]]
    if any(t.candidate == current for t in ranking):
        found.append(current)
    found += [t.candidate for t in ranking[1:2]] if runner_up or len(found) < 2 else []
    return list(dict.fromkeys(found))


def _confirm(finalists: list[Candidate], session: _Session, settings: Settings) -> tuple[list[Tally], str]:
    """``settings.confirm`` fresh rounds of the finalists in alternating order, within the whole budget; their
    tallies (winner first), or [] and why not."""
    if len(finalists) < 2:
        return [], "only one candidate was measured"
    if not settings.confirm:
        return [], "no confirmation rounds were asked for (--confirm 0)"
    session.limit_s = settings.budget_s
    tallies = {c: Tally(c) for c in finalists}
    draw = random.Random(settings.order_seed)  # seeded: every rank of a DDP job runs the same order
    for round_ in range(1, settings.confirm + 1):
        if settings.order_seed is not None:
            order = draw.sample(finalists, len(finalists))
        else:
            order = finalists if round_ % 2 else finalists[::-1]
        for candidate in order:
            try:
                value = session.run(candidate, round_, confirm=True)
            except Unusable:  # it ran in the search: a failure now (out of memory) ends the confirmation
                value = None
            if value is None:
                break
            tallies[candidate].by_round[round_] = value
    done = [t for t in tallies.values() if t.measured]
    if len(done) < 2 or len({len(t.by_round) for t in done}) > 1:  # a round cut short: keep whole rounds only
        whole = min((len(t.by_round) for t in done), default=0)
        done = [Tally(t.candidate, {r: v for r, v in t.by_round.items() if r <= whole}) for t in done]
        done = [t for t in done if t.measured]
    if len(done) < 2:
        return [], "the budget left no time for a confirmation round"
    return done, ""


def _search_batch_size(current: LoaderConfig, session: _Session, *, cap: int) -> tuple[int, list]:
    """The fastest of 2x, 4x, ... the current batch, doubling until an out-of-memory error (the micro-batch
    fallback off), ``cap``, a doubling that gains under ``PLATEAU_GAIN`` (on a CPU, past the caches, a larger batch
    can be slower) or ``BATCH_SEARCH_SHARE`` of the budget; the current batch if none was timed."""
    best, tried, size = current.batch_size, [], current.batch_size * 2
    rates: dict[int, float] = {}
    while size <= cap:
        candidate = Candidate(dataclasses.replace(current, batch_size=size), oom_fallback=False)
        try:
            value = session.run(candidate, 0, within_s=BATCH_SEARCH_SHARE * session.settings.budget_s)
        except Exception as err:
            if not is_oom(err):
                raise
            value = -1.0  # out of memory; freed below, outside this block, once the traceback is gone
        session.release(candidate)  # the next size needs the memory
        if value is None:
            break
        tried.append((size, value if value >= 0 else None))
        if value < 0:
            break
        rates[size] = value
        best = max(rates, key=rates.__getitem__)
        if size // 2 in rates and value < (1 + PLATEAU_GAIN) * rates[size // 2]:
            break
        size *= 2
    return best, tried


def _best_at(tallies: list[Tally], workers: int) -> float | None:
    """The fastest median among the DataLoader candidates with ``workers`` workers (any pinning), or None."""
    at = [t for t in tallies if t.measured and not t.candidate.loader.resident and not t.candidate.changes]
    return max((t.median for t in at if t.candidate.loader.num_workers == workers), default=None)


def _plateau(candidate: Candidate, tallies: Any, ladder: list[int]) -> str:
    """Why the ladder ends below ``candidate``'s worker count ('' if it does not): a doubling (1 -> 2 and up;
    0 -> 1 is none) gained less than ``PLATEAU_GAIN``."""
    loader = candidate.loader
    if loader.resident or loader.num_workers not in ladder or candidate.changes:
        return ""
    tallies = list(tallies)
    for rung in range(3, ladder.index(loader.num_workers) + 1):
        lower, upper = _best_at(tallies, ladder[rung - 2]), _best_at(tallies, ladder[rung - 1])
        if lower and upper and upper < (1 + PLATEAU_GAIN) * lower:
            return (
                f"not measured: {ladder[rung - 1]} workers gained {100 * (upper / lower - 1):+.1f}% over "
                f"{ladder[rung - 2]} (plateau)"
            )
    return ""


def _prefetch_candidate(tallies: Any) -> Candidate | None:
    """prefetch_factor 4 (or 2) for the best candidate with workers, if it is within reach of the leader."""
    measured = [t for t in tallies if t.measured]
    with_workers = [t for t in measured if t.candidate.loader.num_workers > 0 and not t.candidate.changes]
    if not with_workers:
        return None
    best = max(with_workers, key=lambda t: t.median)
    if best.median < DROP_BELOW * max(t.median for t in measured):
        return None
    return Candidate(prefetch_variant(best.candidate.loader))


def _drop_slow(tallies: Any, round_: int) -> list[Tally]:
    """Stop timing the candidates (all but the leader and the runner-up) whose best round is under ``DROP_BELOW``
    of the leader's median (``DROP_BELOW_FIRST`` after round 1); returns them."""
    running = sorted((t for t in tallies if t.measured and not t.stopped), key=lambda t: t.median, reverse=True)
    if not running:
        return []
    share = DROP_BELOW_FIRST if round_ == 1 else DROP_BELOW
    leader = running[0]  # it and the runner-up stay: their paired rounds give the lead its spread
    dropped = [t for t in running[2:] if t.high < share * leader.median]
    for tally in dropped:
        tally.stopped = f"dropped after round {round_}: best round under {share:.0%} of the leader's median"
    return dropped
