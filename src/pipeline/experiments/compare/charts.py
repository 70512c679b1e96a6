"""A ``Table`` as a chart: samples/s per row beside where each row's step time goes; matplotlib is imported only
when one is drawn."""

from __future__ import annotations

from typing import Any

from pipeline.experiments.compare.records import STEP_PARTS
from pipeline.experiments.compare.table import Table

COLOURS = {"data wait": "tab:orange", "copy": "tab:purple", "compute": "tab:blue", "own work": "0.6"}


def chart(table: Table) -> Any:
    """Left: median samples/s per row as horizontal bars, min–max whiskers, the speed-up written beside each bar.
    Right: a steady step's time in ms, stacked by part (data wait, copy, compute, the pipeline's own work), so
    that a faster row shows which part it saved.

    Returns:
        A ``matplotlib.figure.Figure`` made without pyplot: headless, owned by nobody, nothing to close.
    """
    from matplotlib.figure import Figure

    lines = table.lines[::-1]  # barh draws bottom-up: the first row goes on top
    fig = Figure(figsize=(13, 1.4 + 0.45 * len(lines)), layout="constrained")
    speed_ax, step_ax = fig.subplots(1, 2, sharey=True, width_ratios=[3, 2])
    stats = [line.row.speed() for line in lines]
    medians = [s.median if s else 0.0 for s in stats]
    whiskers = [[s.median - s.low if s else 0.0 for s in stats], [s.high - s.median if s else 0.0 for s in stats]]
    # grey: the baseline; dark: a real speed-up; light: "~"
    colours = ["0.6" if ln.row is table.baseline else "tab:blue" if ln.vs_baseline.real else "#9ecae1" for ln in lines]
    y = list(range(len(lines)))
    speed_ax.barh(y, medians, xerr=whiskers, color=colours, capsize=3, error_kw={"elinewidth": 1})
    speed_ax.set_yticks(y, [f"{_short(line.row.name)} (n={line.row.n})" for line in lines])
    for i, (line, s) in enumerate(zip(lines, stats, strict=True)):
        text = "baseline" if line.row is table.baseline else line.vs_baseline.cell()
        speed_ax.text(s.high if s else 0.0, i, f"  {text if s else 'no samples/s'}", va="center", fontsize=8)
    speed_ax.set_xlabel("steady-state samples/s (median; whiskers: min–max over the repeats)")
    speed_ax.margins(x=0.35)

    left = [0.0] * len(lines)
    for part in STEP_PARTS:
        widths = [(parts or {}).get(part, 0.0) for parts in (line.row.step_parts_ms() for line in lines)]
        step_ax.barh(y, widths, left=left, color=COLOURS[part], label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    step_ax.set_xlabel("a steady step, ms (medians over the repeats)")
    step_ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1), ncol=4, frameon=False)  # above: no bar hidden
    return fig


def _short(name: str, most: int = 60) -> str:
    return name if len(name) <= most else name[: most - 1] + "…"
