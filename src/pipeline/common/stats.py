"""The one statistics module: what every comparison the pipeline prints is computed with.

``bench``, ``autotune``, ``compare`` and the GPU check all say "A is N× faster than B" through these
functions, so there is one definition of *noisy*, one test and one interval:

- ``summarize``: median, min–max and IQR of some timings; ``noisy`` when IQR/median reaches ``NOISY``.
- ``rank_test`` (two independent samples) and ``signed_rank_test`` (paired differences): exact two-sided
  p-values from the permutation distribution, ties handled by midranks (no normal approximation below
  ``EXACT_LIMIT`` values). ``min_p_unpaired`` / ``min_p_paired`` say whether a design can show a
  difference at all: 4 vs 4 runs can reach p = 0.029, 3 vs 5 p = 0.036, 3 vs 3 only 0.10, 4 pairs only 0.125;
  ``repeats_needed`` how many repeats per row can, once Holm multiplies the smallest p by the rows compared.
- ``compare``: the speed-up as a ratio with its confidence interval (the Hodges–Lehmann estimate on the
  log scale: the median of all pairwise ratios, or of the paired ratios' Walsh averages), and the p-value
  of the test that fits the design: paired when the two samples ran round by round and that test can
  reach ``level``, else the rank test.
- ``holm``: p-values adjusted for the number of comparisons in one table.
- ``drift``: whether the machine got faster or slower over a series of runs (a stratified Theil–Sen
  slope of log throughput on run order, tested by permuting each configuration's runs among themselves).
- ``paired_ratio``: the median of per-round ratios, for interleaved benchmarks.

Pure Python and numpy; nothing here times anything.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

NOISY = 0.10  # IQR/median of repeated timings from which they are called noisy
ALPHA = 0.05  # a difference is real only below this (after the correction for several comparisons)
MIN_EFFECT = 0.03  # a significant change smaller than this is noise we do not act on
CONFIDENCE = 0.95  # the interval's nominal level (or the most the sample sizes allow, stated)
EXACT_LIMIT = 120  # values in all up to which p-values are exact; above, the normal approximation
DRIFT_PERMUTATIONS = 2000  # Monte Carlo permutations of the drift test (seeded: the same data, the same p)
DRIFT_EXACT_RUNS = 200  # above this many runs the drift test uses the normal approximation instead


# ---- summaries ----


@dataclass(frozen=True)
class Summary:
    """Repeated measurements of one thing."""

    median: float
    low: float
    high: float
    n: int
    iqr: float  # interquartile range (inclusive quantiles, numpy's default); 0 with one value

    @property
    def spread(self) -> float | None:
        """IQR over the median; None when the median is 0."""
        return self.iqr / abs(self.median) if self.median else None

    @property
    def noisy(self) -> bool:
        return self.spread is not None and self.spread >= NOISY


def summarize(values: Iterable[float]) -> Summary | None:
    """Median, min, max and IQR of ``values``; None when there are none."""
    data = sorted(values)
    if not data:
        return None
    iqr = 0.0
    if len(data) > 1:
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
        iqr = q3 - q1
    return Summary(statistics.median(data), data[0], data[-1], len(data), iqr)


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of per-round ratios. A round's variants run back to back, so the machine's slow drifts cancel,
    which a ratio of medians would not do."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


# ---- exact rank tests ----


def midranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, tied values sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _subset_sums(weights: Sequence[int], size: int) -> np.ndarray:
    """``counts[s]``: how many ``size``-element subsets of ``weights`` sum to ``s`` (floats: counts reach 1e29)."""
    import numpy as np  # lazy, as everywhere here: the GPU check imports this module where only torch is sure

    total = sum(weights)
    ways = np.zeros((size + 1, total + 1))
    ways[0, 0] = 1.0
    for w in weights:
        if w:
            ways[1:, w:] = ways[1:, w:] + ways[:-1, : total + 1 - w]  # the right side is read before it is written
        else:
            ways[1:] = ways[1:] + ways[:-1]
    return ways[size]


def _signed_sums(weights: Sequence[int]) -> np.ndarray:
    """``counts[s]``: how many of the ``2**n`` sign choices give the positive weights the sum ``s``."""
    import numpy as np

    total = sum(weights)
    ways = np.zeros(total + 1)
    ways[0] = 1.0
    for w in weights:
        ways[w:] = ways[w:] + ways[: total + 1 - w]
    return ways


def rank_test(a: Sequence[float], b: Sequence[float]) -> float:
    """Exact two-sided p of the Wilcoxon–Mann–Whitney test: how often a random split of the pooled values into
    groups of these sizes gives a rank sum at least as far from its mean as ``a``'s. Ties take midranks and the
    distribution is the one conditional on them (so 4 vs 4 with one tie gives 0.057, where the normal
    approximation says 0.042). 1.0 when either sample is empty or every value is equal."""
    import numpy as np

    n, m = len(a), len(b)
    if not n or not m:
        return 1.0
    ranks = midranks([*a, *b])
    doubled = [round(2 * r) for r in ranks]  # midranks are whole or half: doubled, they are integers
    observed = sum(doubled[:n])
    if n + m > EXACT_LIMIT:
        return _normal_rank_p(doubled, n, observed)
    counts = _subset_sums(doubled, n)
    center = n * (n + m + 1)  # the doubled rank sum's mean
    sums = np.arange(len(counts))
    extreme = np.abs(sums - center) >= abs(observed - center)
    return float(min(1.0, counts[extreme].sum() / counts.sum()))


def _normal_rank_p(doubled: Sequence[int], n: int, observed: int) -> float:
    """The large-sample p (normal approximation with the tie correction), above ``EXACT_LIMIT``."""
    import numpy as np

    ranks = np.asarray(doubled, dtype=float) / 2
    total = len(ranks)
    mean = n * (total + 1) / 2
    variance = n * (total - n) / total * ranks.var() * total / (total - 1) if total > 1 else 0.0
    if variance <= 0:
        return 1.0
    z = abs(observed / 2 - mean) / math.sqrt(variance)
    return math.erfc(z / math.sqrt(2))


def signed_rank_test(differences: Sequence[float]) -> float:
    """Exact two-sided p of the Wilcoxon signed-rank test on paired differences (zeros dropped, ties of the
    absolute values by midranks): how often random signs give a positive-rank sum at least as far from its mean."""
    import numpy as np

    nonzero = [d for d in differences if d != 0]
    if not nonzero:
        return 1.0
    doubled = [round(2 * r) for r in midranks([abs(d) for d in nonzero])]
    observed = sum(w for w, d in zip(doubled, nonzero, strict=True) if d > 0)
    total = sum(doubled)
    if len(nonzero) > EXACT_LIMIT:
        ranks = np.asarray(doubled, dtype=float) / 2
        z = abs(observed / 2 - ranks.sum() / 2) / math.sqrt((ranks**2).sum() / 4)
        return math.erfc(z / math.sqrt(2))
    counts = _signed_sums(doubled)
    sums = np.arange(len(counts))
    extreme = np.abs(2 * sums - total) >= abs(2 * observed - total)
    return float(min(1.0, counts[extreme].sum() / counts.sum()))


def min_p_unpaired(n: int, m: int) -> float:
    """The smallest two-sided p the rank test can give with ``n`` and ``m`` values (no ties): 2 / C(n+m, n)."""
    return 1.0 if not n or not m else min(1.0, 2 / math.comb(n + m, n))


def min_p_paired(n: int) -> float:
    """The smallest two-sided p the signed-rank test can give with ``n`` pairs: 2 / 2**n."""
    return 1.0 if not n else min(1.0, 2 / 2**n)


def repeats_needed(tests: int = 1, *, level: float = ALPHA) -> int:
    """The fewest repeats per row at which a comparison, one of ``tests`` corrected by Holm, can be below
    ``level`` at all: the smallest n with ``tests × min_p_unpaired(n, n) < level``. The rank test's floor is the
    lower one (C(2n, n) ≥ 2**n), so more rounds of a sweep never need more than this."""
    n = 1
    while tests * min_p_unpaired(n, n) >= level:
        n += 1
    return n


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of the p-values of one family of comparisons (None: not tested, not counted).
    A comparison is real when its adjusted p is below ``ALPHA``; the family's chance of any false "real" stays
    below ``ALPHA``."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    adjusted: list[float | None] = [None] * len(pvalues)
    running, count = 0.0, len(tested)
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (count - rank) * p))
        adjusted[i] = running
    return adjusted


# ---- estimates with intervals ----


@dataclass(frozen=True)
class Comparison:
    """``new`` against ``base``: a ratio (above 1: ``new`` is larger) with its interval and the test's p."""

    ratio: float  # the Hodges–Lehmann estimate of new/base
    low: float
    high: float
    confidence: float  # the interval's coverage: CONFIDENCE, or less where the sample sizes allow no more
    p: float
    test: str  # "rank" (independent samples) or "paired" (round by round)
    n_base: int
    n_new: int
    pairs: int  # rounds compared (the paired test), else 0
    min_p: float  # the smallest p this design can give at all

    @property
    def sizes(self) -> str:
        """``rank 4v4`` or ``paired 6 rounds``: the test and what it had."""
        return f"paired, {self.pairs} rounds" if self.test == "paired" else f"rank, {self.n_base}v{self.n_new}"


def _quantile_rank(counts: np.ndarray, confidence: float) -> tuple[int, float]:
    """For a null distribution of a rank statistic (counts over 0..max), the largest k >= 1 with
    P(stat <= k-1) <= (1 - confidence) / 2, and the coverage 1 - 2 P(stat <= k-1); k = 1 when even that
    exceeds the tail (the widest interval, with its lower coverage)."""
    import numpy as np

    cumulative = np.cumsum(counts) / counts.sum()
    tail = (1 - confidence) / 2
    k = int(np.searchsorted(cumulative, tail, side="right"))  # values 0..k-1 have P <= tail
    k = max(k, 1)
    return k, float(1 - 2 * cumulative[k - 1])


def _interval(values: Sequence[float], counts: np.ndarray, confidence: float) -> tuple[float, float, float, float]:
    """Estimate (median), interval and coverage from sorted-able ``values`` and the rank statistic's null counts."""
    ordered = sorted(values)
    k, coverage = _quantile_rank(counts, confidence)
    k = min(k, (len(ordered) + 1) // 2)
    return statistics.median(ordered), ordered[k - 1], ordered[len(ordered) - k], coverage


def compare(
    base: Sequence[float],
    new: Sequence[float],
    *,
    pairs: Sequence[tuple[float, float]] = (),
    level: float = ALPHA,
    confidence: float = CONFIDENCE,
) -> Comparison | None:
    """How ``new`` compares with ``base`` (both positive, e.g. samples/s); None when either is empty.

    Args:
        base, new: every measurement of each.
        pairs: ``(base, new)`` measured in the same round (interleaved runs of the same seed). The paired test
            cancels drift between rounds; it is used when there are at least 2 pairs and it can reach ``level``
            (6 pairs for 0.05), otherwise the rank test on all values.
        level: the p the comparison must be able to reach (``ALPHA`` over the number of comparisons, for Holm's
            strictest step): it decides which test fits the design, never the data.
        confidence: the interval's nominal level.
    """
    base = [v for v in base if v > 0 and math.isfinite(v)]
    new = [v for v in new if v > 0 and math.isfinite(v)]
    if not base or not new:
        return None
    pairs = [(a, b) for a, b in pairs if a > 0 and b > 0]
    if len(pairs) >= 2 and min_p_paired(len(pairs)) <= level:
        logs = [math.log(b / a) for a, b in pairs]
        walsh = [(logs[i] + logs[j]) / 2 for i in range(len(logs)) for j in range(i, len(logs))]
        estimate, low, high, coverage = _interval(walsh, _signed_sums(list(range(1, len(logs) + 1))), confidence)
        p = signed_rank_test(logs)
        test, used, min_p = "paired", len(pairs), min_p_paired(len(pairs))
    else:
        differences = [math.log(b) - math.log(a) for a in base for b in new]
        small, large = sorted((len(base), len(new)))
        weights = list(range(1, small + large + 1))
        counts = _subset_sums(weights, small)  # the rank sum of the smaller sample: U + small(small+1)/2
        counts = counts[small * (small + 1) // 2 :]
        estimate, low, high, coverage = _interval(differences, counts, confidence)
        p = rank_test(base, new)
        test, used, min_p = "rank", 0, min_p_unpaired(len(base), len(new))
    ratio, low, high = math.exp(estimate), math.exp(low), math.exp(high)
    return Comparison(ratio, low, high, coverage, p, test, len(base), len(new), used, min_p)


# ---- drift ----


@dataclass(frozen=True)
class Drift:
    """How the machine's speed changed over a series of runs, each configuration's level taken out."""

    change: float  # relative change from the first run to the last (-0.12: 12% slower by the end)
    p: float  # two-sided, from permuting each configuration's runs among themselves
    runs: int  # runs that informed it (configurations with at least 2 runs)

    @property
    def real(self) -> bool:
        return self.p < ALPHA and abs(self.change) >= MIN_EFFECT


def drift(points: Sequence[tuple[Hashable, float, float]], *, seed: int = 0) -> Drift | None:
    """Drift of ``value`` over ``order`` within groups: ``points`` are ``(configuration, run order, value)``.

    The slope is the median of the within-configuration pairwise slopes of log(value) on order (Theil–Sen,
    stratified), so that differences between configurations never read as drift, whatever order they ran
    in; the test permutes each configuration's values among its own runs (Kendall's S summed over the
    configurations, ``DRIFT_PERMUTATIONS`` seeded permutations; the normal approximation above
    ``DRIFT_EXACT_RUNS`` runs). None with fewer than 3 runs in configurations of 2 or more.
    """
    groups: dict[Hashable, list[tuple[float, float]]] = {}
    for key, order, value in points:
        if value > 0 and math.isfinite(value):
            groups.setdefault(key, []).append((order, math.log(value)))
    kept = [sorted(g) for g in groups.values() if len(g) >= 2]
    if sum(len(g) for g in kept) < 3:
        return None
    slopes = [(yj - yi) / (xj - xi) for g in kept for i, (xi, yi) in enumerate(g) for xj, yj in g[i + 1 :] if xj != xi]
    if not slopes:
        return None
    orders = [x for g in kept for x, _ in g]
    change = math.exp(statistics.median(slopes) * (max(orders) - min(orders))) - 1
    observed = sum(_kendall_s([y for _, y in g]) for g in kept)
    runs = sum(len(g) for g in kept)
    if runs > DRIFT_EXACT_RUNS:  # many runs: Kendall's S is close to normal, and permuting would take seconds
        variance = sum(len(g) * (len(g) - 1) * (2 * len(g) + 5) / 18 for g in kept)
        z = max(abs(observed) - 1, 0) / math.sqrt(variance) if variance else 0.0  # with continuity correction
        return Drift(change, math.erfc(z / math.sqrt(2)), runs)
    rng = random.Random(seed)
    beyond = 0
    for _ in range(DRIFT_PERMUTATIONS):
        total = 0
        for g in kept:
            ys = [y for _, y in g]
            rng.shuffle(ys)
            total += _kendall_s(ys)
        beyond += abs(total) >= abs(observed)
    p = (beyond + 1) / (DRIFT_PERMUTATIONS + 1)
    return Drift(change, p, runs)


def _kendall_s(ys: Sequence[float]) -> int:
    """Concordant minus discordant pairs of ``ys`` against their order (ties count as neither)."""
    return sum((yj > yi) - (yj < yi) for i, yi in enumerate(ys) for yj in ys[i + 1 :])
