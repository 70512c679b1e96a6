"""A ``Table`` for a terminal: the columns that matter, in plain words, in lines of at most ``MAX_WIDTH``
characters; every other column, the ranges and the tests' numbers stay in ``compare.md`` and ``compare.csv``.

    row  n  [keys]  samples/s  speed-up [95% CI]  verdict  [vs previous]  val/acc  MFU %  step ms

[keys]: the config keys that differ between rows beyond the batch size, workers and the like that run names
carry, as many as leave the name room; [vs previous]: ladders only. samples/s is marked ``†`` where runs of the
row ran on a busy machine (tag ``machine.busy``), with a note below.

A row's name is cut in its middle (``…``) where the other columns leave it no room: sweeps name their runs
with the swept values first and the provenance last, so both ends are kept.
"""

from __future__ import annotations

import textwrap

from pipeline.experiments.compare.formats import (
    above,
    busy_mark,
    busy_note,
    gaps,
    mfu_cell,
    number,
    peaks_note,
    step_cell,
    wrap,
)
from pipeline.experiments.compare.table import Line, Table, power_note

MAX_WIDTH = 160  # a terminal's width at most: no line of the view is longer
GAP = "  "  # between columns
RIGHT = frozenset({"n", "samples/s"})  # numbers, aligned on their last digit
NAME_ROOM = 40  # a key's column is left to compare.md before the row's name gets less room than this


def table_terminal(table: Table) -> str:
    """The table as a terminal shows it, with the drift, a ladder's total and what is left out, in words."""
    keys = list(table.diff_keys)  # config keys that differ beyond those the names carry: as many as fit
    while True:
        headers, body = _columns(table, keys)
        rest = sum(max(len(cell) for cell in column) for column in list(zip(headers, *body, strict=True))[1:])
        room = MAX_WIDTH - rest - len(GAP) * (len(headers) - 1)  # what the other columns leave the name
        if room >= NAME_ROOM or not keys:
            break
        keys.pop()
    for cells in body:
        cells[0] = _cut(cells[0], max(room, 12))
    prose = [f"Same in every run: {len(table.same)} config keys (listed in compare.md)."] if table.same else []
    if len(keys) < len(table.diff_keys):
        left = table.diff_keys[len(keys) :]
        prose.append(f"{len(left)} more config key(s) differ between rows, shown in compare.md: {', '.join(left)}.")
    notes = _fit([*_notes(table), *gaps(table)])
    return "\n".join([*_fit([*prose, *above(table)]), "", *_aligned([headers, *body]), "", *notes]) + "\n"


def _columns(table: Table, keys: list[str]) -> tuple[list[str], list[list[str]]]:
    headers = ["row", "n", *keys, "samples/s", "speed-up [95% CI]", "verdict"]
    headers += ["vs previous"] * table.ladder + [table.quality, "MFU %", "step ms"]
    return headers, [_cells(table, line, keys) for line in table.lines]


def _cells(table: Table, line: Line, keys: list[str]) -> list[str]:
    row, base = line.row, line.row is table.baseline
    speed, quality = row.speed(), row.stat(table.quality)
    marked = any(other.row.busy_runs for other in table.lines)  # then unmarked numbers keep the digits aligned
    mark = busy_mark(row) or (" " if marked else "")
    cells = [row.name, str(row.n), *(row.param(k) for k in keys), (number(speed.median) if speed else "–") + mark]
    cells += [speedup_cell(line, baseline=base), line.vs_baseline.verdict()]
    if table.ladder:
        previous = line.vs_previous
        cells.append(f"{previous.estimate().split(' ')[0]} {previous.verdict()}" if previous else "–")
    cells += [number(quality.median) if quality else "–", mfu_cell(table, row), step_cell(row)]
    return cells


def speedup_cell(line: Line, *, baseline: bool) -> str:
    """The speed-up column: ``1.18× [1.12–1.24]`` (``estimate``), ``1.00× (baseline)`` on the baseline's row."""
    return "1.00× (baseline)" if baseline else line.vs_baseline.estimate()


def _fit(lines: list[str]) -> list[str]:
    """Prose lines, any longer than ``MAX_WIDTH`` (a long run name, an error) broken there."""
    return [part for line in lines for part in (textwrap.wrap(line, MAX_WIDTH) if len(line) > MAX_WIDTH else [line])]


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    right = [header in RIGHT for header in rows[0]]
    return [
        GAP.join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)).rstrip()
        for cells in rows
    ]


def _cut(name: str, most: int) -> str:
    """``name`` in at most ``most`` characters: its start and its end, ``…`` between."""
    if len(name) <= most:
        return name
    tail = (most - 1) // 2
    return name[: most - 1 - tail] + "…" + name[len(name) - tail :]


def _notes(table: Table) -> list[str]:
    tests = max((line.vs_baseline.tests for line in table.lines), default=0)
    over = f", allowing for the table's {tests} comparisons" if tests > 1 else ""
    notes = [
        f"samples/s: steady-state throughput, the median over a row's n runs. speed-up: samples/s over the "
        f"baseline's ({_cut(table.baseline.name, 60)}), with the range it lies in at 95% confidence; * where too "
        "few runs allow only less; none for a single run.",
        f"verdict: 'shown' when the test finds the difference too large to be noise (under a 5% chance{over}) and it "
        f"is at least {table.min_effect:.0%}; 'no difference shown': it may be noise; 'cannot tell: add repeats': "
        "too few runs for any test to show one (rerun with more trainer.seed values).",
        "MFU %: the model's FLOPs per second over the device's peak in the dtype it computes in (a GPU's datasheet, "
        "a CPU's measured matmul peak), the median over a row's runs; – where a run has none. step ms: a steady step "
        "= waiting for data + copying to the device + computing + the pipeline's own work.",
        "compare.md and compare.csv hold every column: the keys that differ, ranges, p-values, epoch time, GPU use, "
        "memory, the bottleneck (python -m pipeline.compare writes them to its --out; a sweep attaches them to its "
        "parent run, under compare/).",
    ]
    if power := power_note(table):
        notes.append(power)
    if busy := busy_note(table):
        notes.append(busy)
    if peaks := peaks_note(table):
        notes.append(peaks)
    return [wrapped for note in notes for wrapped in wrap(note)]
