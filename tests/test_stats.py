"""``pipeline.common.stats``: the exact tests against brute force and scipy, the intervals' coverage, Holm, drift."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from scipy import stats as scipy_stats

from pipeline.common import stats
from pipeline.common.stats import (
    ALPHA,
    compare,
    drift,
    holm,
    min_p_paired,
    min_p_unpaired,
    rank_test,
    signed_rank_test,
    summarize,
)


def brute_rank_p(a: list[float], b: list[float]) -> float:
    """Every split of the pooled values into groups of these sizes, rank sums by midranks: the definition."""
    ranks = stats.midranks([*a, *b])
    center = len(a) * (len(a) + len(b) + 1) / 2
    observed = abs(sum(ranks[: len(a)]) - center)
    splits = list(itertools.combinations(range(len(ranks)), len(a)))
    beyond = sum(abs(sum(ranks[i] for i in split) - center) >= observed - 1e-9 for split in splits)
    return beyond / len(splits)


def brute_signed_p(d: list[float]) -> float:
    nonzero = [x for x in d if x != 0]
    ranks = stats.midranks([abs(x) for x in nonzero])
    center = sum(ranks) / 2
    observed = abs(sum(r for r, x in zip(ranks, nonzero, strict=True) if x > 0) - center)
    signs = list(itertools.product((0, 1), repeat=len(nonzero)))
    beyond = sum(
        abs(sum(r for r, s in zip(ranks, sign, strict=True) if s) - center) >= observed - 1e-9 for sign in signs
    )
    return beyond / len(signs)


def test_summary_gives_the_median_range_and_iqr_and_calls_a_tenth_of_spread_noisy() -> None:
    s = summarize([120, 80, 100, 110, 90])
    assert (s.median, s.low, s.high, s.n, s.iqr) == (100, 80, 120, 5, 20)
    assert s.spread == pytest.approx(0.20) and s.noisy
    calm = summarize([99, 100, 100, 101, 102])
    assert calm.spread == pytest.approx(0.01) and not calm.noisy
    assert summarize([7.0]).iqr == 0 and not summarize([7.0]).noisy
    assert summarize([]) is None


def test_the_tie_case_gets_its_exact_p_not_the_normal_approximations() -> None:
    """4 vs 4 with one value shared: exactly 4 of the 70 splits are as extreme (0.057); scipy's 'auto' gives 0.042."""
    base, new = [1.0, 2.0, 3.0, 4.0], [4.0, 5.0, 6.0, 7.0]
    assert rank_test(base, new) == pytest.approx(4 / 70)
    assert scipy_stats.mannwhitneyu(base, new, method="auto").pvalue == pytest.approx(0.042, abs=0.001)


@pytest.mark.parametrize("seed", range(12))
def test_the_rank_test_equals_brute_force_with_and_without_ties(seed: int) -> None:
    rng = random.Random(seed)
    n, m = rng.randint(1, 6), rng.randint(1, 6)
    pool = [rng.choice([1.0, 2.0, 3.0, 2.5, 4.0, 5.0, 6.0]) if seed % 2 else rng.random() for _ in range(n + m)]
    a, b = pool[:n], pool[n:]
    assert rank_test(a, b) == pytest.approx(brute_rank_p(a, b))
    if seed % 2 == 0:  # no ties: scipy's exact method agrees
        assert rank_test(a, b) == pytest.approx(scipy_stats.mannwhitneyu(a, b, method="exact").pvalue)


@pytest.mark.parametrize("seed", range(10))
def test_the_signed_rank_test_equals_brute_force_with_ties_and_zeros(seed: int) -> None:
    rng = random.Random(100 + seed)
    d = [rng.choice([-2.0, -1.0, 0.0, 1.0, 1.0, 2.0, 3.0]) for _ in range(rng.randint(1, 9))]
    assert signed_rank_test(d) == pytest.approx(brute_signed_p(d))


def test_what_a_design_can_show_comes_from_its_smallest_possible_p() -> None:
    assert min_p_unpaired(4, 4) == pytest.approx(2 / 70)  # 0.029: can reach 0.05
    assert min_p_unpaired(3, 5) == pytest.approx(2 / 56)  # 0.036: so can 3 vs 5...
    assert min_p_unpaired(3, 3) == pytest.approx(0.1)  # ...but not 3 vs 3
    assert min_p_paired(4) == pytest.approx(0.125) and min_p_paired(6) == pytest.approx(1 / 32)
    assert rank_test([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(min_p_unpaired(4, 4))


def test_holm_multiplies_the_smallest_p_by_the_family_size_and_keeps_the_order() -> None:
    adjusted = holm([0.01, 0.04, None, 0.03])
    assert adjusted[0] == pytest.approx(0.03) and adjusted[3] == pytest.approx(0.06)
    assert adjusted[1] == pytest.approx(0.06)  # 0.04 * 1, raised to the step before it
    assert adjusted[2] is None
    assert holm([]) == []


def test_an_unpaired_comparison_is_the_median_pairwise_ratio_with_the_exact_interval() -> None:
    base, new = [100.0, 101.0, 102.0, 103.0, 104.0], [110.0, 111.0, 112.0, 113.0, 114.0]
    c = compare(base, new)
    ratios = sorted(b / a for a in base for b in new)
    assert c.test == "rank" and (c.n_base, c.n_new, c.sizes) == (5, 5, "rank, 5v5")
    assert c.ratio == pytest.approx(ratios[12], rel=1e-3)  # the median of the 25 ratios (on the log scale)
    assert (c.low, c.high) == pytest.approx((ratios[2], ratios[22]))  # k = 3 for 5 vs 5 at 95%
    assert c.confidence == pytest.approx(1 - 2 * 4 / 252)
    assert c.p == pytest.approx(2 / 252)


def test_four_against_four_states_the_interval_it_can_give() -> None:
    c = compare([1.0, 1.1, 1.2, 1.3], [2.0, 2.1, 2.2, 2.3])
    assert (c.low, c.high) == pytest.approx((2.0 / 1.3, 2.3 / 1.0))  # the whole range, at 97.1%
    assert c.confidence == pytest.approx(1 - 2 / 70)
    assert compare([1.0, 1.1, 1.2], [2.0, 2.1, 2.2]).confidence == pytest.approx(0.9)  # 3 vs 3 allows only 90%


def test_the_paired_test_serves_only_where_it_can_reach_the_level() -> None:
    base = [100.0, 90.0, 80.0, 70.0, 60.0, 50.0]  # a machine slowing down round by round...
    new = [b * 1.05 for b in base]  # ...and a steady 5% gain within each round
    pairs = list(zip(base, new, strict=True))
    paired = compare(base, new, pairs=pairs)
    assert paired.test == "paired" and paired.ratio == pytest.approx(1.05)
    assert paired.p == pytest.approx(1 / 32)  # all six rounds agree: the smallest p six pairs give
    unpaired = compare(base, new)
    assert unpaired.test == "rank" and unpaired.p > 0.5  # the drift hides the gain from the rank test
    four = compare(base[:4], new[:4], pairs=pairs[:4])
    assert four.test == "rank"  # 4 pairs cannot reach 0.05 (0.125 at best): the rank test is used
    assert compare(base, new, pairs=pairs, level=0.01).test == "rank"  # nor can 6 reach Holm's 0.05/5


def test_nothing_to_compare_is_none() -> None:
    assert compare([], [1.0]) is None and compare([1.0], [0.0, math.nan]) is None


def test_drift_finds_a_steady_slowdown_whatever_order_the_configurations_ran_in() -> None:
    points = []
    for job in range(16):  # two configurations, seed last: four of A, four of B, then again
        config = "A" if (job // 4) % 2 == 0 else "B"
        points.append((config, job, (1000 if config == "A" else 1300) * 0.99**job))
    found = drift(points)
    assert found.change == pytest.approx(0.99**15 - 1, rel=1e-6) and found.p < 0.01 and found.real
    steady = [(c, j, (1000 if c == "A" else 1300) * (1 + 0.001 * ((j * 7) % 5))) for c, j, _ in points]
    assert not drift(steady).real


def test_drift_needs_repeats_to_say_anything() -> None:
    assert drift([("A", 0, 1.0), ("B", 1, 2.0), ("C", 2, 3.0)]) is None


def test_there_is_one_statistics_module() -> None:
    """Tests, intervals and "noisy" are defined in pipeline.common.stats alone: bench, autotune, compare, the GPU check
    and the doctor import it; none of them computes a p-value, a quantile or a noise threshold of its own."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [*(root / "src").rglob("*.py"), *(root / "bench").glob("*.py"), *(root / "scripts").glob("*.py")]
    forbidden = ("scipy", "mannwhitney", "wilcoxon(", "quantiles(", "NOISY =", "def paired_ratio", "\ndef median(")
    found = [
        f"{path.relative_to(root)}: {pattern}"
        for path in sources
        if path.name != "stats.py"
        for pattern in forbidden
        if pattern in path.read_text()
    ]
    assert found == []
    users = [
        "bench/suite.py",
        "bench/claims.py",
        "src/pipeline/gpucheck/overheads.py",
        "src/pipeline/autotune/report.py",
        "src/pipeline/experiments/compare/table.py",
        "src/pipeline/engine/building/amp_check.py",
    ]
    assert all("from pipeline.common.stats import" in (root / u).read_text() for u in users)


def test_drift_over_many_runs_uses_the_normal_approximation_and_agrees() -> None:
    rng = random.Random(3)
    steady = [(job % 50, job, 1000 * (1 + rng.uniform(-0.05, 0.05))) for job in range(400)]
    slowing = [(c, j, v * 0.999**j) for c, j, v in steady]  # 33% slower by the 400th run
    assert not drift(steady).real and drift(steady).p > 0.05
    found = drift(slowing)
    assert found.real and found.p < 1e-6 and found.change == pytest.approx(0.999**399 - 1, abs=0.03)


def test_the_repeats_needed_are_the_fewest_whose_smallest_p_after_holm_is_below_the_level() -> None:
    from pipeline.common.stats import repeats_needed

    assert repeats_needed(1) == 4  # 2 / C(8, 4) = 0.029 < 0.05; 3 v 3 reaches only 0.10
    assert repeats_needed(3) == 5  # 3 × 0.029 = 0.086; 3 × 2 / C(10, 5) = 0.024
    assert repeats_needed(7) == 6  # 7 × 0.0079 = 0.056; 7 × 2 / C(12, 6) = 0.015
    for tests in range(1, 30):
        n = repeats_needed(tests)
        assert tests * min_p_unpaired(n, n) < ALPHA <= tests * min_p_unpaired(n - 1, n - 1)
