"""The real trials: each candidate built with ``pipeline.engine.building.build.build`` and timed over real training
steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.autotune.candidates import Candidate
from pipeline.config import LoaderConfig, RunConfig
from pipeline.engine.building.build import build
from pipeline.engine.hot import compilation, loop
from pipeline.engine.hot.loop import StepMetrics
from pipeline.engine.hot.memory import release_memory
from pipeline.engine.hot.step import Peers
from pipeline.engine.hot.timing import make_timer
from pipeline.machine import doctor


@dataclass
class _Live:
    setup: Any  # pipeline.engine.building.build.Setup
    timer: Any
    keep_batches: bool  # persistent workers (or none): the iterator lives across rounds, as across epochs
    batches: Iterator[Any] | None = None

    def close_batches(self) -> None:
        if self.batches is not None:
            self.batches.close()  # a non-persistent loader's workers stop here
            self.batches = None


MIN_TIMED_S = 0.15  # a trial times at least this long (whole calls of --steps steps); more rounds beat longer trials


def queue_depth(loader: LoaderConfig, *, prefetched: bool = False) -> int:
    """How many batches a loader can have made ahead of the step that asks for them: each worker's
    ``prefetch_factor`` (the DataLoader keeps that many requests per worker in flight), plus one held by a device
    prefetcher (``prefetched``); 0 for resident data, which is cut when asked for."""
    if loader.resident:
        return 0
    ahead = loader.num_workers * (loader.prefetch_factor or 2) if loader.num_workers else 0
    return ahead + (1 if prefetched else 0)


class Trials:
    """Trials in the real training step: each candidate built once with ``build`` (the run's seed, so every
    candidate starts from the same weights and sample order), trained with ``train_epoch``, freed by ``release``.

    Live candidates keep their model on the device and their persistent workers idle between rounds (a worker
    that has filled its prefetch queue waits, using no CPU); the search releases a dropped candidate at once.
    """

    def __init__(self, cfg: RunConfig, group: Any = None) -> None:
        self.cfg = cfg
        self.group = group  # a DDP job's (``pipeline.parallel.distributed``): every rank builds and trains each one
        self._live: dict[Candidate, _Live] = {}
        self._compiling = False
        self.split: dict[Candidate, Any] = {}  # each candidate's last timed call: its ``Breakdown`` (the step split)

    def _allow_compiling(self) -> None:
        if not self._compiling:
            compilation.fresh()
            # Each live candidate is a model of its own, and each one's graphs count towards the same forward's
            # recompile limit: room for a dozen candidates' shapes, beyond which it still raises, never runs eager.
            compilation.allow_models(12)
            self._compiling = True

    def probe(self) -> Any:
        """Build the current setting first (its ``Setup``): its device and data decide the other candidates."""
        return self._get(Candidate(self.cfg.loader)).setup

    def measure(self, candidate: Candidate, *, steps: int, warmup: int) -> float:
        """Samples/s of ``steps`` training steps after ``warmup`` untimed ones (the step timer leaves out a call's
        first step, so the untimed call runs ``warmup - 1``), repeated until the timed steps add up to
        ``MIN_TIMED_S``: 20 steps of a small model take 40 ms, which one hiccup of the machine can make ten times
        longer. Longer trials would buy little more: a busy machine's slow minutes pass over several trials alike,
        and the paired rounds, not the trials' length, tell a change from that drift.

        A live candidate's workers kept working while the others were timed: its queue holds up to
        ``queue_depth`` batches made before this trial began. Those are drawn and dropped first, so every batch
        this trial times was asked for, and made, after it started: the trial times the loader, not its backlog.
        """
        live = self._get(candidate)
        if live.batches is None:
            live.batches = _endless(live.setup.train_batches)
        try:
            prefetched = hasattr(live.setup.train_batches, "timed_by")  # a DevicePrefetcher holds one more
            for _ in range(queue_depth(candidate.loader, prefetched=prefetched)):
                next(live.batches)
            if warmup > 1:
                self._train(live, warmup - 1)
            samples = seconds = 0.0
            while True:  # whole calls of ``steps`` timed steps until they add up to MIN_TIMED_S
                done = self._train(live, steps + 1).breakdown
                self.split[candidate] = done
                samples, seconds = samples + done.steady_samples, seconds + done.step_s
                enough = seconds >= MIN_TIMED_S or not done.steady_steps
                if self._agreed(enough):  # every rank trains the same steps: each is a collective
                    return samples / seconds if seconds > 0 else 0.0
        finally:
            if not live.keep_batches:
                live.close_batches()

    def _agreed(self, mine: bool) -> bool:
        """Rank 0's answer on every rank of a DDP job (``group.share``): a rank that decided on its own clock to
        train one more call than the others would wait for them in its first all-reduce forever."""
        return mine if self.group is None else self.group.share(lambda: mine)

    def release(self, candidate: Candidate) -> None:
        """Free the candidate's model, data and loader workers (gc, then the device's cached memory)."""
        live = self._live.pop(candidate, None)
        if live is None:
            return

        device = live.setup.device
        live.close_batches()
        live.setup.end_loaders()  # its persistent workers end now
        del live
        release_memory(device)

    def close(self) -> None:
        for candidate in list(self._live):
            self.release(candidate)

    def _get(self, candidate: Candidate) -> _Live:
        if candidate not in self._live:
            cfg = candidate.config(self.cfg)
            if cfg.trainer.compile:
                self._allow_compiling()
            oom = dataclasses.replace(cfg.oom, enabled=cfg.oom.enabled and candidate.oom_fallback)
            setup = build(dataclasses.replace(cfg, oom=oom), self.group, explain_missing_gpu=doctor.main_finding)
            keep = candidate.loader.num_workers == 0 or candidate.loader.persistent_workers
            self._live[candidate] = _Live(setup, make_timer(setup.device), keep)
        return self._live[candidate]

    def _train(self, live: _Live, steps: int) -> Any:
        setup = live.setup
        return loop.train_epoch(
            setup.state,
            live.batches,
            inputs=setup.inputs,  # the run's own input path, GPU augmentation included
            timer=live.timer,
            hooks=loop.EpochHooks(metrics=StepMetrics(every=self.cfg.trainer.log_every_n_steps)),
            peers=Peers(setup.group),  # the run's own host syncs, nothing written
            max_steps=setup.state.step + steps,
        )


def _endless(batches: Any) -> Iterator[Any]:
    """The batches of epoch 1, 2, ... without end: a trial may cross an epoch boundary, as training does."""
    epoch = 1
    while True:
        batches.set_epoch(epoch)
        yield from batches
        epoch += 1
