"""The order a sweep's jobs run in: repeats interleaved, so that a machine that drifts favours no configuration.

    python -m pipeline -m amp=false,true trainer.seed=1,2,3,4      # e.g. A1 B1 | B2 A2 | B3 A3 | A4 B4
    python -m pipeline -m amp=false,true trainer.seed=1,2,3,4 hydra.sweeper.seed=7   # that order again

Hydra's basic sweeper runs the cartesian product with the last key varying fastest, so with the seed typed last
(as the set-up recipe writes it) each configuration's repeats run back to back: A1 A2 A3 A4 B1 B2 B3 B4. On a machine
that slows down 1% a run, four *identical* configurations then differ "significantly" (all of A's runs beat all
of B's). ``interleave`` runs the repeat keys (``trainer.seed``, ``repeat``) slowest whatever order they were
typed in: round r runs every configuration once with the r-th repeat, in an order drawn at random for that round
(a randomised block design), so the runs of one round can be compared pair by pair
(``pipeline.common.stats.compare``). A fixed order (A B, B A, A B, ...) would cancel a steady drift, but a
disturbance that recurs every 4 jobs hits B in every round and makes an A/A pair "0.83× slower, real"; drawn at
random, each round's order is as likely one way as the other, whatever the machine does, which is exactly what the
paired test's p-value counts on. The seed is in ``design.json`` and tagged ``sweep.design_seed`` on every run and
on the sweep's parent: the same seed, the same order. A sweep without a repeat key keeps Hydra's order.

``hydra_plugins.pipeline_sweeper`` is the Hydra sweeper that uses it (``hydra/sweeper=interleaved``, the default
in ``conf/config.yaml``), for the basic, joblib and submitit launchers alike, and for the ladders.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

# Repeats of one configuration: the sweep runs them round by round, the run name lists them last, and
# pipeline.experiments.compare groups runs that differ only here into one row.
REPEAT_KEYS = frozenset({"trainer.seed", "repeat"})


@dataclass(frozen=True)
class Plan:
    """The jobs in launch order, each as its overrides (in the order the keys were typed), and its round."""

    jobs: list[list[str]]
    rounds: list[int | None]  # None: the sweep has no repeat key
    seed: int | None = None  # what drew each round's order; None: the sweep has no repeat key
    configs: list[int] | None = None  # each job's configuration, numbered in the order typed (Hydra's): the order
    # the table lists them in, whatever order a round ran them in; None: each job is its own (no repeat key)


def draw_seed() -> int:
    """A fresh seed for a sweep's order (``hydra.sweeper.seed: null``), from the operating system."""
    return random.SystemRandom().randrange(2**31)


def interleave(axes: Sequence[tuple[str, Sequence[str]]], *, seed: int) -> Plan:
    """The jobs of the sweep whose keys, in the order typed, take the overrides ``axes`` lists.

    Args:
        axes: ``(key, ["key=value", ...])`` per key, as Hydra's basic sweeper lists them (a plain override is a
            one-value axis).
        seed: draws each round's order (``random.Random(seed)``): the same seed, the same jobs in the same order.
    """
    repeat = [i for i, (key, _) in enumerate(axes) if key.lstrip("+~") in REPEAT_KEYS]
    if not repeat:
        return Plan([list(job) for job in itertools.product(*(values for _, values in axes))], [None] * _size(axes))
    others = [i for i in range(len(axes)) if i not in repeat]
    configs = list(itertools.product(*(axes[i][1] for i in others)))
    rng = random.Random(seed)
    jobs, rounds, numbers = [], [], []
    for number, repeats in enumerate(itertools.product(*(axes[i][1] for i in repeat))):
        for index in rng.sample(range(len(configs)), len(configs)):
            chosen = dict(zip(others, configs[index], strict=True)) | dict(zip(repeat, repeats, strict=True))
            jobs.append([chosen[i] for i in range(len(axes))])
            rounds.append(number)
            numbers.append(index)
    return Plan(jobs, rounds, seed, numbers)


def _size(axes: Sequence[tuple[str, Sequence[str]]]) -> int:
    size = 1
    for _, values in axes:
        size *= len(values)
    return size
