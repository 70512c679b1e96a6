"""A ``Table`` as a chart: samples/s per row beside where each row's step time goes, titled, every colour and
mark in a legend; matplotlib is imported only when one is drawn."""

from __future__ import annotations

from typing import Any

from pipeline.experiments.compare.runs import STEP_PARTS
from pipeline.experiments.compare.table import Line, Table
from pipeline.report.plots import STEP_COLOURS  # the parts of a step in step_time.png's colours

# The samples/s bars, by verdict; none of them a step part's colour, so that no colour means two things here
VERDICT_COLOURS = {
    "baseline": "0.25",
    "faster: shown": "#1f4e9c",
    "slower: shown": "#7b3294",
    "no difference shown, or cannot tell": "#c6dbef",
}
CHART_ROWS = 40  # the most rows a chart draws (``shown``)
WIDTH_IN, LEFT_IN, TOP_IN = 14.0, 5.0, 1.25  # inches: the figure, room for 50-character row names, title and legends
SLOWER_HATCH = "///"  # every row slower than the baseline, shown or not: a slowdown never reads as a speed-up


def chart(table: Table) -> Any:
    """Left: median samples/s per row as horizontal bars, min–max whiskers, coloured by the verdict against the
    baseline (hatched where slower), the speed-up and its verdict written beside each bar. Right: a steady step's
    time in ms, stacked by part (data wait, copy, compute, the pipeline's own work) in ``step_time.png``'s
    colours, so that a faster row shows which part it saved. A title and a legend for every colour and mark.

    Returns:
        A ``matplotlib.figure.Figure`` made without pyplot: headless, owned by nobody, nothing to close.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lines = shown(table)[::-1]  # barh draws bottom-up: the first row goes on top
    height = 2.4 + 0.45 * len(lines)
    fig = Figure(figsize=(WIDTH_IN, height))  # margins set in inches: a layout engine took as long as the runs' query
    fig.subplots_adjust(
        left=LEFT_IN / WIDTH_IN, right=1 - 0.2 / WIDTH_IN, top=1 - TOP_IN / height, bottom=0.6 / height, wspace=0.3
    )
    rows = f"{len(lines)} row(s)" if len(lines) == len(table.lines) else f"{len(lines)} of {len(table.lines)} rows"
    fig.suptitle(f"steady-state samples/s of {rows} against the baseline, {_short(table.baseline.name)}")
    speed_ax, step_ax = fig.subplots(1, 2, sharey=True, width_ratios=[3, 2])
    stats = [line.row.speed() for line in lines]
    medians = [s.median if s else 0.0 for s in stats]
    whiskers = [[s.median - s.low if s else 0.0 for s in stats], [s.high - s.median if s else 0.0 for s in stats]]
    y = list(range(len(lines)))
    bars = speed_ax.barh(y, medians, xerr=whiskers, color=[_colour(table, ln) for ln in lines], capsize=3)
    for bar, line in zip(bars, lines, strict=True):
        if line.vs_baseline.ratio is not None and line.vs_baseline.ratio < 1:
            bar.set_hatch(SLOWER_HATCH)
            bar.set_edgecolor("white")
    speed_ax.set_yticks(y, [f"{_short(line.row.name, 50)} (n={line.row.n})" for line in lines])
    for i, (line, s) in enumerate(zip(lines, stats, strict=True)):
        versus = line.vs_baseline
        text = "baseline" if line.row is table.baseline else f"{versus.estimate()} {versus.verdict()}"
        speed_ax.text(s.high if s else 0.0, i, f"  {text if s else 'no samples/s'}", va="center", fontsize=8)
    speed_ax.set_xlabel("steady-state samples/s (median; whiskers: min–max over the repeats)")
    speed_ax.margins(x=0.45)
    handles = [Patch(color=colour, label=verdict) for verdict, colour in VERDICT_COLOURS.items()]
    slower = "hatched: slower than the baseline"
    handles.append(Patch(facecolor="white", edgecolor="0.3", hatch=SLOWER_HATCH, label=slower))
    handles.append(Patch(color="none", label="[a–b]: 95% interval of the speed-up; *: less, too few runs for 95%"))
    speed_ax.legend(handles=handles, fontsize=7, loc="lower left", bbox_to_anchor=(0, 1), ncol=2, frameon=False)

    left = [0.0] * len(lines)
    for part in STEP_PARTS:
        widths = [(parts or {}).get(part, 0.0) for parts in (line.row.step_parts_ms() for line in lines)]
        step_ax.barh(y, widths, left=left, color=STEP_COLOURS[part], label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    step_ax.set_xlabel("a steady step, ms (medians over the repeats)")
    step_ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1), ncol=2, frameon=False)  # above: no bar hidden
    return fig


def shown(table: Table) -> list[Line]:
    """The table's first ``CHART_ROWS`` lines, its baseline's among them: a bar a row stops being readable (and a
    figure of 250 rows takes longer to draw than the runs take to load); every row is in compare.md and .csv."""
    if len(table.lines) <= CHART_ROWS:
        return table.lines
    first = table.lines[:CHART_ROWS]
    if any(line.row is table.baseline for line in first):
        return first
    return [*first[:-1], next(line for line in table.lines if line.row is table.baseline)]


def _colour(table: Table, line: Line) -> str:
    if line.row is table.baseline:
        return VERDICT_COLOURS["baseline"]
    return VERDICT_COLOURS.get(line.vs_baseline.verdict(), VERDICT_COLOURS["no difference shown, or cannot tell"])


def _short(name: str, most: int = 60) -> str:
    return name if len(name) <= most else name[: most - 1] + "…"
