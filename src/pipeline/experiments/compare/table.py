"""Every number the outputs show, computed once: rows compared with the baseline (and, in a ladder, with the row
before), each comparison's test corrected for the others (Holm), the step-time change, the drift.

A row's speed-up is ``pipeline.common.stats.compare`` of its runs' samples/s against the baseline's: the Hodges–Lehmann
ratio with its interval, and an exact test: paired round by round where the runs ran in the same rounds of an
interleaved sweep and the pairs can reach the level, else the rank test. It is *real* when the p-value, adjusted
by Holm over the table's comparisons, is below ``alpha`` and the change is at least ``min_effect``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.common.metric_names import VAL_ACC, VAL_PREFIX
from pipeline.common.stats import ALPHA, MIN_EFFECT, Comparison, Drift, compare, drift, holm, repeats_needed
from pipeline.experiments.compare.rows import (
    COVERED,
    PROVENANCE,
    REPEAT_KEYS,
    SHOWN,
    Row,
    config_key,
    differences,
    group,
    only_provenance,
    provenance_columns,
)
from pipeline.experiments.compare.runs import LOWER_IS_BETTER, STEP_PARTS, VAL_LOSS, ComparedRun, CompareError

__all__ = [
    "COVERED",
    "PROVENANCE",
    "REPEAT_KEYS",
    "SHOWN",
    "Line",
    "Speedup",
    "Table",
    "build",
    "config_key",
    "power_note",
]


@dataclass(frozen=True)
class Speedup:
    """One row's samples/s against another's: the comparison, its adjusted p, and whether the change is real
    (None: the design cannot show a difference, or there is nothing to compare)."""

    comparison: Comparison | None
    p_adjusted: float | None
    tests: int  # comparisons in the family Holm corrects over
    real: bool | None
    reason: str
    # True when even the smallest p these repeats allow, after Holm, is not below the level: no data could make it
    # real; ``repeats_needed`` per row could (None where the design can show a difference)
    cannot_show: bool = False
    repeats_needed: int | None = None

    @property
    def ratio(self) -> float | None:
        return self.comparison.ratio if self.comparison else None

    @property
    def single(self) -> bool:
        """A single run on either side: its samples/s carries no measure of its own noise, so no interval."""
        c = self.comparison
        return c is not None and min(c.n_base, c.n_new) < 2

    @property
    def cannot_tell(self) -> bool:
        """No test these runs allow can show a difference: the design's smallest p is above the level (``real``
        None: ``cannot_show``, with the ``repeats_needed`` that could), or a side has a single run."""
        return self.comparison is not None and (self.cannot_show or self.real is None or self.single)

    def verdict(self) -> str:
        """The comparison in words: ``faster: shown``, ``slower: shown``, ``no difference shown`` (may be noise,
        or under ``min_effect``), ``cannot tell: add repeats``; ``baseline``, or ``no samples/s``."""
        c = self.comparison
        if c is None:
            return "baseline" if self.reason == "baseline" else "no samples/s"
        if self.cannot_tell:
            return "cannot tell: add repeats"  # how many: power_note, under the table
        if self.real:
            return "faster: shown" if c.ratio > 1 else "slower: shown"
        return "no difference shown"

    def estimate(self) -> str:
        """``1.18× [1.12–1.24]``: the ratio with its interval (none for a single run); a ``*`` on an interval
        below the nominal coverage."""
        c = self.comparison
        if c is None:
            return "–"
        star = "*" if c.confidence < 0.95 - 1e-9 else ""
        return f"{c.ratio:.2f}×" + ("" if self.single else f" [{c.low:.2f}–{c.high:.2f}]{star}")

    def cell(self) -> str:
        """``1.18× [1.12–1.24]``, ``~1.02× [0.97–1.08]``, ``0.77× slower [0.75–0.79]``, ``~0.55×`` (a single
        run: no interval); a ``*`` on an interval below the nominal coverage."""
        c = self.comparison
        if c is None:
            return "–"
        slower = " slower" if self.real and c.ratio < 1 else ""  # a step that cost speed is said in words
        ratio, _, interval = self.estimate().partition(" ")
        return f"{'' if self.real else '~'}{ratio}{slower}{' ' if interval else ''}{interval}"


BASELINE = Speedup(None, None, 0, None, "baseline")


@dataclass(frozen=True)
class Line:
    row: Row
    vs_baseline: Speedup
    vs_previous: Speedup | None  # ladders only
    step_change: str  # what changed in a steady step against the baseline, in ms ("" for the baseline)


@dataclass(frozen=True)
class Table:
    """Every number the outputs show, computed once."""

    lines: list[Line]
    baseline: Row
    diff_keys: list[str]
    same: dict[str, str]
    provenance: list[str]  # provenance tags that differ between rows (each a column)
    twins: list[tuple[Row, Row, list[str]]]  # rows of one config that differ only in code or software
    ladder: bool
    total: float | None  # ladders: the last row over the baseline
    per_step: float | None  # ladders: the geometric mean step, total ** (1 / steps)
    drift: Drift | None
    lacking: list[tuple[ComparedRun, list[str]]]  # runs without some CORE metrics, and which
    ranked_by: str | None = None  # an objective the rows are sorted by (a search), best first
    quality: str = VAL_ACC  # the validation metric shown: the rows' leading one, val/loss where they differ
    min_effect: float = MIN_EFFECT
    alpha: float = ALPHA


def build(
    runs: Sequence[ComparedRun],
    *,
    baseline: str | None = None,
    ladder: bool = False,
    min_effect: float = MIN_EFFECT,
    alpha: float = ALPHA,
    rank_by: str | None = None,
) -> Table:
    """The table of ``runs`` (sweep parents left out), rows in the order given (or by ``rank_by``).

    Args:
        runs: the runs, in table order (sweep job, start time or as listed).
        baseline: a row's name, or a run's id (or its first 8 characters) or name, whose row the others are
            measured against; default the first row.
        ladder: also compare each row with the one before, and give the total and the mean step.
        rank_by: sort the rows by this metric's median, best first (a search's objective: a ``val/...`` metric, or
            ``throughput/samples_per_s`` for the job's whole throughput).

    Raises:
        CompareError: no runs, or ``baseline`` names none of the rows (or several).
    """
    runs = [r for r in runs if not r.is_parent]
    if not runs:
        raise CompareError("no runs to compare (sweep parent runs are never rows)")
    rows = group(runs)
    if rank_by:
        rows = _ranked(rows, rank_by)
    base = rows[_baseline_index(rows, baseline)] if baseline else rows[0]
    others = [row for row in rows if row is not base]
    vs_base = _family([(base, row) for row in others], min_effect=min_effect, alpha=alpha)
    vs_prev = _family(list(itertools.pairwise(rows)), min_effect=min_effect, alpha=alpha) if ladder else []
    lines = []
    for i, row in enumerate(rows):
        previous = (vs_prev[i - 1] if i else None) if ladder else None
        versus = BASELINE if row is base else vs_base[others.index(row)]
        lines.append(Line(row, versus, previous, "" if row is base else step_change(base, row)))
    diff, same = differences(runs)
    lacking = [(r, missing) for r in runs if (missing := r.lacking())]
    leading = {r.quality for r in runs}
    total = lines[-1].vs_baseline.ratio if ladder and len(lines) > 1 and lines[-1].row is not base else None
    return Table(
        lines=lines,
        baseline=base,
        diff_keys=diff,
        same=same,
        provenance=provenance_columns(rows),
        twins=only_provenance(rows),
        ladder=ladder,
        total=total,
        per_step=total ** (1 / (len(lines) - 1)) if total else None,
        drift=sweep_drift(rows),
        lacking=lacking,
        ranked_by=rank_by,
        min_effect=min_effect,
        alpha=alpha,
        quality=leading.pop() if len(leading) == 1 else VAL_LOSS,
    )


def _family(pairs: Sequence[tuple[Row, Row]], *, min_effect: float, alpha: float) -> list[Speedup]:
    """Each ``(reference, row)`` compared, the p-values adjusted together (Holm): one family of comparisons."""
    tests = sum(1 for ref, row in pairs if ref.speeds() and row.speeds())
    level = alpha / max(tests, 1)  # Holm's strictest step: what a paired test must be able to reach to be chosen
    found = []
    for ref, row in pairs:
        before, after = ref.by_round(), row.by_round()
        together = [(before[r], after[r]) for r in sorted(before.keys() & after.keys())]
        found.append(compare(ref.speeds(), row.speeds(), pairs=together, level=level))
    adjusted = holm([c.p if c is not None and c.min_p <= alpha else None for c in found])
    family = sum(p is not None for p in adjusted)  # Holm multiplies the smallest p by this many
    verdicts = []
    for c, p in zip(found, adjusted, strict=True):
        rows = family + (p is None)  # a row outside the family would join it with more repeats
        if c is not None and rows * c.min_p >= alpha:
            verdicts.append(_cannot_show(c, p, tests, rows, alpha=alpha))
        else:
            verdicts.append(_verdict(c, p, tests, min_effect=min_effect, alpha=alpha))
    return verdicts


def _cannot_show(c: Comparison, p: float | None, tests: int, rows: int, *, alpha: float) -> Speedup:
    """A design whose smallest reachable p, after Holm over ``rows`` comparisons, is not below ``alpha``."""
    needed = repeats_needed(rows, level=alpha)
    repeats = f"{c.n_base}" if c.n_base == c.n_new else f"{c.n_base} and {c.n_new}"
    holm_note = f" (Holm over {rows} rows)" if rows > 1 else ""
    plural = "" if c.n_base == c.n_new == 1 else "s"
    said = f"cannot show a difference with {repeats} repeat{plural}{holm_note}: use at least {needed}"
    return Speedup(c, p, tests, None, said, cannot_show=True, repeats_needed=needed)


def _verdict(c: Comparison | None, p: float | None, tests: int, *, min_effect: float, alpha: float) -> Speedup:
    if c is None:
        return Speedup(None, None, tests, None, "no samples/s to compare")
    sizes = c.sizes
    said = f"p={p:.2g}" + (f" (Holm, {tests} tests)" if tests > 1 else "")
    if p >= alpha:
        return Speedup(c, p, tests, False, f"~ {said} ≥ {alpha:g}, {sizes}")
    effect = abs(c.ratio - 1)
    if effect < min_effect:
        return Speedup(c, p, tests, False, f"~ {said}, but {effect:.1%} < {min_effect:.0%}")
    return Speedup(c, p, tests, True, f"real: {said}, {sizes}")


def power_note(table: Table) -> str:
    """One line for the rows whose repeats can never show a difference, and how many repeats would; '' if none."""
    blind = [ln.vs_baseline for ln in table.lines if ln.vs_baseline.cannot_show]
    if not blind:
        return ""
    needed = max(s.repeats_needed or 0 for s in blind)
    first = blind[0].reason.removeprefix("cannot show a difference with ").partition(":")[0]
    who = f"{len(blind)} rows cannot" if len(blind) > 1 else "1 row cannot"
    return f"{who} show a difference with {first}: use at least {needed} per row; their speed-up is no evidence."


def step_change(base: Row, row: Row) -> str:
    """What changed in a steady step against the baseline, biggest first: ``data wait −42 ms, compute +1.0 ms``.

    Rows of another batch size are compared per sample instead (``per sample: compute −4.1 µs``): a step of 256
    samples takes longer than one of 64 without being slower. Parts that moved by less than 1% of the baseline's
    step (or sample), or 0.05 ms, are left out; '' without the figures.
    """
    mine, theirs = row.step_parts_ms(), base.step_parts_ms()
    if mine is None or theirs is None:
        return ""
    sizes = [_batch(base), _batch(row)]
    if sizes[0] != sizes[1] and None not in sizes:
        mine = {p: 1000 * v / sizes[1] for p, v in mine.items()}  # µs a sample
        theirs = {p: 1000 * v / sizes[0] for p, v in theirs.items()}
        moved = _moved(mine, theirs, floor=max(0.05, 0.01 * sum(theirs.values())), unit="µs")
        return f"per sample: {moved}"
    return _moved(mine, theirs, floor=max(0.05, 0.01 * sum(theirs.values())), unit="ms")


def _moved(mine: dict[str, float], theirs: dict[str, float], *, floor: float, unit: str) -> str:
    moved = sorted(((mine[p] - theirs[p], p) for p in STEP_PARTS), key=lambda d: -abs(d[0]))
    said = [f"{part} {_signed(delta, unit)}" for delta, part in moved if abs(delta) >= floor][:2]
    return ", ".join(said) or "same split"


def _batch(row: Row) -> int | None:
    value = row.param("loader.batch_size")
    return int(value) if value.isdigit() else None


def _signed(delta: float, unit: str) -> str:
    sign = "+" if delta > 0 else "−"
    size = abs(delta)
    digits = 0 if size >= 10 else 1 if size >= 1 else 2
    return f"{sign}{size:.{digits}f} {unit}"


def sweep_drift(rows: Sequence[Row]) -> Drift | None:
    """The machine's drift over the runs' order (sweep job, else start time), each row's level taken out."""
    runs = sorted((r for row in rows for r in row.runs), key=lambda r: (r.job, r.start_time))
    order = {r.id: i for i, r in enumerate(runs)}
    return drift([(i, order[r.id], r.speed) for i, row in enumerate(rows) for r in row.runs if r.speed])


def _ranked(rows: list[Row], metric: str) -> list[Row]:
    def key(row: Row) -> float:
        s = row.stat(metric) if metric.startswith(VAL_PREFIX) else row.speed()
        if s is None:
            return float("inf")
        return s.median if metric in LOWER_IS_BETTER else -s.median

    return sorted(rows, key=key)


def _baseline_index(rows: Sequence[Row], wanted: str) -> int:
    hits = {i for i, row in enumerate(rows) if wanted in (row.name, row.base_name)}
    if not hits:
        hits = {i for i, row in enumerate(rows) for r in row.runs if wanted in (r.id, r.id[:8], r.name)}
    if len(hits) == 1:
        return hits.pop()
    names = ", ".join(row.name for row in rows)
    if not hits:
        raise CompareError(f"--baseline {wanted}: no row or selected run has that name or id (rows: {names})")
    raise CompareError(f"--baseline {wanted}: several rows have that name; give a run id (rows: {names})")
