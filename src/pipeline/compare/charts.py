"""A ``Table`` as a bar chart of samples/s; matplotlib is imported only when one is drawn."""

from __future__ import annotations

from typing import Any

from pipeline.compare.records import THROUGHPUT
from pipeline.compare.table import Table


def chart(table: Table) -> Any:
    """Median samples/s per row as horizontal bars, min–max whiskers, the speed-up written beside each bar.

    Returns:
        A ``matplotlib.figure.Figure`` made without pyplot: headless, owned by nobody, nothing to close.
    """
    from matplotlib.figure import Figure

    lines = table.lines[::-1]  # barh draws bottom-up: the first row goes on top
    fig = Figure(figsize=(9, 1.2 + 0.45 * len(lines)), layout="constrained")
    ax = fig.subplots()
    stats = [line.row.stat(THROUGHPUT) for line in lines]
    medians = [s.median if s else 0.0 for s in stats]
    whiskers = [[s.median - s.low if s else 0.0 for s in stats], [s.high - s.median if s else 0.0 for s in stats]]
    # grey: the baseline; dark: a real speed-up; light: "~"
    colours = ["0.6" if ln.row is table.baseline else "tab:blue" if ln.vs_baseline.real else "#9ecae1" for ln in lines]
    y = range(len(lines))
    ax.barh(y, medians, xerr=whiskers, color=colours, capsize=3, error_kw={"elinewidth": 1})
    ax.set_yticks(list(y), [f"{_short(line.row.name)} (n={line.row.n})" for line in lines])
    for i, (line, s) in enumerate(zip(lines, stats, strict=True)):
        text = "baseline" if line.row is table.baseline else line.vs_baseline.cell()
        ax.text(s.high if s else 0.0, i, f"  {text if s else 'no samples/s'}", va="center", fontsize=8)
    ax.set_xlabel("steady-state samples/s (median; whiskers: min–max over the repeats)")
    ax.margins(x=0.15)
    return fig


def _short(name: str, most: int = 60) -> str:
    return name if len(name) <= most else name[: most - 1] + "…"
