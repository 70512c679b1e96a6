"""The order a sweep's jobs run in: repeats interleaved, so that a machine that drifts favours no configuration.

    python -m pipeline -m amp=false,true trainer.seed=1,2,3,4      # A1 B1 | B2 A2 | A3 B3 | B4 A4

Hydra's basic sweeper runs the cartesian product with the last key varying fastest, so with the seed typed last
(as the guides write it) each configuration's repeats run back to back: A1 A2 A3 A4 B1 B2 B3 B4. On a machine
that slows down 1% a run, four *identical* configurations then differ "significantly" (all of A's runs beat all
of B's). ``interleave`` runs the repeat keys (``trainer.seed``, ``repeat``) slowest whatever order they were
typed in: round r runs every configuration once with the r-th repeat, and every other round runs the
configurations in reverse (A B, B A, ...), so a steady drift cancels over each two rounds and the runs of one
round can be compared pair by pair (``pipeline.common.stats.compare``). A sweep without a repeat key keeps Hydra's
order.

``hydra_plugins.pipeline_sweeper`` is the Hydra sweeper that uses it (``hydra/sweeper=interleaved``, the default
in ``conf/config.yaml``), for the basic, joblib and submitit launchers alike, and for the ladders.
"""

from __future__ import annotations

import itertools
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


def interleave(axes: Sequence[tuple[str, Sequence[str]]]) -> Plan:
    """The jobs of the sweep whose keys, in the order typed, take the overrides ``axes`` lists.

    Args:
        axes: ``(key, ["key=value", ...])`` per key, as Hydra's basic sweeper lists them (a plain override is a
            one-value axis).
    """
    repeat = [i for i, (key, _) in enumerate(axes) if key.lstrip("+~") in REPEAT_KEYS]
    if not repeat:
        return Plan([list(job) for job in itertools.product(*(values for _, values in axes))], [None] * _size(axes))
    others = [i for i in range(len(axes)) if i not in repeat]
    configs = list(itertools.product(*(axes[i][1] for i in others)))
    jobs, rounds = [], []
    for number, repeats in enumerate(itertools.product(*(axes[i][1] for i in repeat))):
        for config in configs if number % 2 == 0 else configs[::-1]:
            chosen = dict(zip(others, config, strict=True)) | dict(zip(repeat, repeats, strict=True))
            jobs.append([chosen[i] for i in range(len(axes))])
            rounds.append(number)
    return Plan(jobs, rounds)


def _size(axes: Sequence[tuple[str, Sequence[str]]]) -> int:
    size = 1
    for _, values in axes:
        size *= len(values)
    return size
