"""Repeats grouped into rows, and every number the outputs show computed once: ``group``, ``build``, ``Table``."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.compare.records import CORE, DEVICE_PEAK_MB, OOM_EVENTS, PEAK_MB, THROUGHPUT, CompareError, RunRecord
from pipeline.compare.stats import ALPHA, MIN_EFFECT, Speedup, Stat, geomean, speedup, stat

REPEAT_KEYS = frozenset({"trainer.seed", "repeat"})  # runs differing only here are repeats of one configuration
NOT_CONFIG = frozenset({"tracking.run_name"})  # names the run, changes nothing it measures
# params with a column of their own (model, batch, workers, resident), never repeated as a diff column
SHOWN = ("model.name", "loader.batch_size", "loader.num_workers", "loader.resident")
HARDWARE_TAGS = ("device.type", "device.name")  # the same params on other hardware are not repeats


@dataclass(frozen=True)
class Row:
    """One configuration: its repeats, in selection order."""

    runs: tuple[RunRecord, ...]

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def name(self) -> str:
        """The runs' name; where repeats are named apart (a sweep names ``...-w0-seed1``), the parts they share."""
        names = list(dict.fromkeys(r.name for r in self.runs))
        parts = [name.split("-") for name in names]
        columns = list(zip(*parts, strict=False))  # the i-th part of every name, as far as the shortest goes
        if len({len(p) for p in parts}) == 1:
            shared = [c[0] for c in columns if len(set(c)) == 1]
        else:
            shared = [c[0] for c in itertools.takewhile(lambda c: len(set(c)) == 1, columns)]
        return "-".join(shared) or f"{names[0]} (+{len(names) - 1} names)"

    def samples(self, metric: str) -> list[float]:
        return [r.metrics[metric] for r in self.runs if metric in r.metrics and math.isfinite(r.metrics[metric])]

    def stat(self, metric: str) -> Stat | None:
        return stat(self.samples(metric))

    def param(self, key: str) -> str:
        return self.runs[0].params.get(key, "–")  # equal across repeats, by construction

    def tag(self, key: str) -> str:
        values = Counter(r.tags[key] for r in self.runs if key in r.tags)
        if len(values) <= 1:
            return next(iter(values), "–")
        return " ".join(f"{value}×{count}" for value, count in values.most_common())

    def peak_mb(self) -> tuple[Stat | None, bool]:
        """The allocator's peak, else the device's (NVML) peak; True when it is the device's."""
        own = self.stat(PEAK_MB)
        if own is not None:
            return own, False
        device = self.stat(DEVICE_PEAK_MB)
        return device, device is not None

    @property
    def oom_events(self) -> int:
        return sum(int(r.metrics.get(OOM_EVENTS, 0)) for r in self.runs)

    @property
    def status(self) -> str:
        counts = Counter(r.status for r in self.runs)
        return "FINISHED" if set(counts) == {"FINISHED"} else ", ".join(f"{c} {s}" for s, c in counts.items())

    @property
    def single_epoch(self) -> bool:
        return any(r.single_epoch for r in self.runs)


def config_key(record: RunRecord) -> tuple[Any, ...]:
    """What makes runs repeats of each other: every param but the seed and repeat keys, and the hardware."""
    params = tuple(sorted((k, v) for k, v in record.params.items() if k not in REPEAT_KEYS | NOT_CONFIG))
    return (params, *(record.tags.get(t) for t in HARDWARE_TAGS))


def group(records: Iterable[RunRecord]) -> list[Row]:
    """Repeats into rows, in the order each configuration first appears."""
    groups: dict[tuple[Any, ...], list[RunRecord]] = {}
    for record in records:
        groups.setdefault(config_key(record), []).append(record)
    return [Row(tuple(runs)) for runs in groups.values()]


def differences(records: Sequence[RunRecord]) -> tuple[list[str], dict[str, str]]:
    """The config keys whose values differ between ``records`` (a missing key counts as a value), and the keys
    equal in all of them with their value; seed, repeat and keys with a column of their own are in neither."""
    keys = sorted({k for r in records for k in r.params} - REPEAT_KEYS - NOT_CONFIG - set(SHOWN))
    diff, same = [], {}
    for key in keys:
        values = {r.params.get(key) for r in records}
        if len(values) > 1:
            diff.append(key)
        else:
            same[key] = next(iter(values))
    return diff, same


@dataclass(frozen=True)
class Line:
    row: Row
    vs_baseline: Speedup
    vs_previous: Speedup | None  # ladders only


@dataclass(frozen=True)
class Table:
    """Every number the outputs show, computed once."""

    lines: list[Line]
    baseline: Row
    diff_keys: list[str]
    same: dict[str, str]
    ladder: bool
    geomean_vs_baseline: float | None  # ladders: over the rows after the baseline
    geomean_per_step: float | None  # ladders: over the speed-ups against the previous row
    lacking: list[tuple[RunRecord, list[str]]]  # runs without some CORE metrics, and which
    min_effect: float = MIN_EFFECT
    alpha: float = ALPHA


BASELINE = Speedup(1.0, None, None, "baseline")


def build(
    records: Sequence[RunRecord],
    *,
    baseline: str | None = None,
    ladder: bool = False,
    min_effect: float = MIN_EFFECT,
    alpha: float = ALPHA,
) -> Table:
    """The table of ``records`` (sweep parents left out), rows in the order given.

    Args:
        records: the runs, in table order (sweep job, start time or as listed).
        baseline: a run id (or its first 8 characters) or run name whose row the others are measured against;
            default the first row.
        ladder: also compare each row with the one before, and add the geometric means.

    Raises:
        CompareError: no runs, or ``baseline`` names none of them (or runs in several rows).
    """
    records = [r for r in records if not r.is_parent]
    if not records:
        raise CompareError("no runs to compare (sweep parent runs are never rows)")
    rows = group(records)
    base = rows[_baseline_index(rows, baseline)] if baseline else rows[0]
    lines, previous = [], None
    for row in rows:
        vs_base = BASELINE if row is base else speedup(_speed(base), _speed(row), min_effect=min_effect, alpha=alpha)
        vs_prev = None
        if ladder and previous is not None:
            vs_prev = speedup(_speed(previous), _speed(row), min_effect=min_effect, alpha=alpha)
        lines.append(Line(row, vs_base, vs_prev))
        previous = row
    diff, same = differences(records)
    lacking = [(r, missing) for r in records if (missing := [m for m in CORE if m not in r.metrics])]
    after_baseline = [ln.vs_baseline.median_ratio for ln in lines if ln.row is not base]
    per_step = [ln.vs_previous.median_ratio for ln in lines if ln.vs_previous]
    return Table(
        lines=lines,
        baseline=base,
        diff_keys=diff,
        same=same,
        ladder=ladder,
        geomean_vs_baseline=geomean(after_baseline) if ladder else None,
        geomean_per_step=geomean(per_step) if ladder else None,
        lacking=lacking,
        min_effect=min_effect,
        alpha=alpha,
    )


def _speed(row: Row) -> list[float]:
    return row.samples(THROUGHPUT)


def _baseline_index(rows: Sequence[Row], wanted: str) -> int:
    hits = {i for i, row in enumerate(rows) for r in row.runs if wanted in (r.id, r.id[:8], r.name)}
    if len(hits) == 1:
        return hits.pop()
    names = ", ".join(row.name for row in rows)
    if not hits:
        raise CompareError(f"--baseline {wanted}: no selected run has that id or name (rows: {names})")
    raise CompareError(f"--baseline {wanted}: runs of several rows have that name; give a run id (rows: {names})")
