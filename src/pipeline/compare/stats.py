"""The numbers over a row's repeats: median, range and IQR (``stat``), and the speed-up a Mann–Whitney U test
must confirm (``speedup``). scipy is imported only when a test runs (``--help`` does not pay for it)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIN_REPEATS = 4  # with 3 against 3 samples the smallest two-sided Mann–Whitney p is 0.10; with 4 against 4, 0.029
MIN_EFFECT = 0.03  # a significant change smaller than this is noise we do not act on
ALPHA = 0.05
NOISY = 0.10  # IQR/median of a row's samples/s from which the row is flagged


@dataclass(frozen=True)
class Stat:
    """A metric over a row's runs."""

    median: float
    low: float
    high: float
    n: int
    iqr: float  # interquartile range (linear interpolation, as numpy's default); 0 with one sample

    @property
    def spread(self) -> float | None:
        return self.iqr / abs(self.median) if self.median else None

    @property
    def noisy(self) -> bool:
        return self.spread is not None and self.spread >= NOISY


def stat(values: Iterable[float]) -> Stat | None:
    """Median, min, max and IQR of ``values``; None when there are none."""
    data = sorted(values)
    if not data:
        return None
    iqr = 0.0
    if len(data) > 1:
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
        iqr = q3 - q1
    return Stat(statistics.median(data), data[0], data[-1], len(data), iqr)


@dataclass(frozen=True)
class Speedup:
    """A row's samples/s against another's; ``real`` is None when the test cannot decide (too few repeats)."""

    median_ratio: float | None
    real: bool | None
    p: float | None
    reason: str

    def cell(self) -> str:
        if self.median_ratio is None:
            return "–"
        slower = " slower" if self.real and self.median_ratio < 1 else ""  # a step that cost speed is said in words
        return f"{'' if self.real else '~'}{self.median_ratio:.2f}×{slower}"


def speedup(
    baseline_samples: Sequence[float], samples: Sequence[float], *, min_effect: float = MIN_EFFECT, alpha: float = ALPHA
) -> Speedup:
    """``median(samples) / median(baseline_samples)``, real only when a two-sided Mann–Whitney U test gives
    p < ``alpha`` and the ratio is at least ``min_effect`` away from 1."""
    if not baseline_samples or not samples:
        return Speedup(None, None, None, "no samples/s to compare")
    base = statistics.median(baseline_samples)
    if base <= 0:
        return Speedup(None, None, None, "the baseline's samples/s is 0")
    ratio = statistics.median(samples) / base
    n = min(len(baseline_samples), len(samples))
    if n < MIN_REPEATS:
        return Speedup(ratio, None, None, f"n={n} < {MIN_REPEATS}: cannot show a difference")
    from scipy.stats import mannwhitneyu  # lazy: scipy.stats costs ~1 s to import

    p = float(mannwhitneyu(samples, baseline_samples, alternative="two-sided").pvalue)
    p = 1.0 if math.isnan(p) else p  # every sample equal: nothing differs
    effect = abs(ratio - 1)
    if p >= alpha:
        return Speedup(ratio, False, p, f"~ p={p:.2g} ≥ {alpha:g}")
    if effect < min_effect:
        return Speedup(ratio, False, p, f"~ p={p:.2g}, but {effect:.1%} < {min_effect:.0%}")
    return Speedup(ratio, True, p, f"real: p={p:.2g}")


def geomean(values: Iterable[float | None]) -> float | None:
    logs = [math.log(v) for v in values if v is not None and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None
