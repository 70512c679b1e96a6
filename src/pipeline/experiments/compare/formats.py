"""A ``Table`` as text: Markdown (padded to read as plain text, with its footnotes) and CSV (numbers unrounded).

The Markdown is also the sweep parent's description in MLflow's UI, so no line of prose runs long and nothing
unbreakable (a URL, a long list of keys without spaces) is wider than the page.
"""

from __future__ import annotations

import csv
import io
import math
import textwrap

from pipeline.common.markdown import markdown_table
from pipeline.common.metric_names import (
    GPU_MEM_PEAK_MB,
    GPU_UTIL_MEAN_PCT,
    MEMORY_MAX_ALLOCATED_MB,
    PERF_MFU_PCT,
    TIME_EPOCH_S,
)
from pipeline.common.stats import NOISY, Summary
from pipeline.experiments.compare.rows import LOADER_SHOWN, PROVENANCE, Row
from pipeline.experiments.compare.runs import STEP_PARTS
from pipeline.experiments.compare.table import Line, Speedup, Table, power_note

WIDTH = 100  # prose lines are wrapped to this many characters
BUSY_MARK = "†"  # after a row's samples/s when some of its runs ran on a busy machine (tag machine.busy)
PEAKS_MARK = "‡"  # after a row's MFU when the table's CPU peaks come from more than one measurement
PEAK_MEASURED = "perf.peak_measured"  # the tag: when the CPU peak a run's MFU is read against was measured


def number(x: float | None) -> str:
    """Three significant digits, trailing zeros kept (0.800, 9.60, 123), thousands grouped (2,099)."""
    if x is None:
        return "–"
    rounded = float(f"{x:.3g}")  # 99.96 is 100, not 100.0
    if rounded == 0 or abs(rounded) >= 100:
        return f"{x:,.0f}"
    return f"{rounded:.{2 - math.floor(math.log10(abs(rounded)))}f}"


def _range(s: Summary | None, mark: str = "") -> str:
    if s is None:
        return "–"
    return f"{number(s.median)}{mark}" + (f" ({number(s.low)}–{number(s.high)})" if s.n > 1 else "")


def _spread(s: Summary | None) -> str:
    if s is None or s.n < 2 or s.spread is None:
        return "–"
    return f"{s.spread:.0%}" + (" noisy" if s.noisy else "")


def busy_mark(row: Row) -> str:
    return BUSY_MARK if row.busy_runs else ""


def busy_note(table: Table) -> str | None:
    """The note under both tables that explains ``BUSY_MARK``; None when no row has it."""
    rows = [line.row for line in table.lines if line.row.busy_runs]
    if not rows:
        return None
    which = ", ".join(f"{row.name} ({row.busy_runs} of {row.n} runs)" for row in rows[:3])
    return (
        f"{BUSY_MARK} some of the row's runs ran on a busy machine (other processes used a large share of its CPUs: "
        "tag machine.busy, and machine.others_cpu_pct how much), so their samples/s and the speed-ups from them are "
        f"not comparable; rerun them on a quieter machine. Rows: {which}" + (" …" if len(rows) > 3 else ".")
    )


def step_cell(row: Row) -> str:
    """``61.0 = 50.0+0.0+10.0+1.0``: the parts in the total's precision, so that they add up to the eye."""
    parts = row.step_parts_ms()
    if parts is None:
        return "–"
    total = sum(parts.values())
    places = 0 if total >= 100 else 1 if total >= 10 else 2
    return f"{total:.{places}f} = " + "+".join(f"{parts[p]:.{places}f}" for p in STEP_PARTS)


def _provenance(row: Row, tag: str) -> str:
    value = row.runs[0].tags.get(tag)
    if value is None:
        return "–"
    return value[:8] if tag == "mlflow.source.git.commit" else value


def _headers(table: Table) -> list[str]:
    return [
        "run",
        "n",
        "device",
        "model",
        "precision",
        "batch",
        "workers",
        "resident",
        *table.diff_keys,
        *(PROVENANCE[t] for t in table.provenance),
        "epoch s",
        "samples/s",
        "spread",
        "speed-up [95% CI]",
        "significance",
        *(["vs previous"] if table.ladder else []),
        "step ms = " + "+".join(STEP_PARTS),
        "step vs baseline",
        table.quality,
        "GPU util %",
        "MFU %",
        "peak MB",
        "bottleneck",
        "OOM",
        *(["status"] if _any_unfinished(table) else []),
    ]


def _cells(table: Table, line: Line) -> list[str]:
    row = line.row
    peak, device_peak = row.peak_mb()
    is_base = row is table.baseline
    return [
        row.name,
        str(row.n),
        row.tag("device.type") if row.tag("device.type") != "–" else row.param("device.name"),
        row.model,
        row.tag("precision"),
        *(row.param(k) for k in LOADER_SHOWN),
        *(row.param(k) for k in table.diff_keys),
        *(_provenance(row, t) for t in table.provenance),
        _range(row.stat(TIME_EPOCH_S), "¹" if row.single_epoch else ""),
        _range(row.speed(), busy_mark(row)),
        _spread(row.speed()),
        "1.00× (baseline)" if is_base else line.vs_baseline.cell(),
        "baseline" if is_base else line.vs_baseline.reason,
        *([line.vs_previous.cell() if line.vs_previous else "–"] if table.ladder else []),
        step_cell(row),
        "baseline" if is_base else line.step_change or "–",
        _range(row.stat(table.quality)),
        number(s.median) if (s := row.stat(GPU_UTIL_MEAN_PCT)) else "–",
        mfu_cell(table, row),
        (number(peak.median) + ("²" if device_peak else "")) if peak else "–",
        row.tag("bottleneck"),
        str(row.oom_events),
        *([row.status] if _any_unfinished(table) else []),
    ]


def mfu_cell(table: Table, row: Row) -> str:
    """The row's median MFU in percent (``perf/mfu_pct``), ``–`` where its runs have none; marked ``PEAKS_MARK``
    where the row's runs read it against a CPU peak and the table's runs against more than one measurement."""
    stat = row.stat(PERF_MFU_PCT)
    if not stat:
        return "–"
    mixed = len(peak_measurements(table)) > 1 and any(PEAK_MEASURED in run.tags for run in row.runs)
    return (f"{stat.median:.0f}" if stat.median >= 1 else f"{stat.median:.2g}") + (PEAKS_MARK if mixed else "")


def peak_measurements(table: Table) -> list[str]:
    """The measurements of the CPU peaks the table's runs read MFU against (``PEAK_MEASURED``), oldest first."""
    return sorted({when for line in table.lines for run in line.row.runs if (when := run.tags.get(PEAK_MEASURED))})


def peaks_note(table: Table) -> str | None:
    """The note under both tables that explains ``PEAKS_MARK``; None when the table's CPU peaks are one measurement."""
    measured = peak_measurements(table)
    if len(measured) < 2:
        return None
    return (
        f"{PEAKS_MARK} MFU read against CPU peaks from {len(measured)} measurements ({PEAK_MEASURED} "
        f"{measured[0]} to {measured[-1]}): rows' MFU differ by their peaks as well as by their speed; compare "
        "samples/s, or rerun the rows to read MFU against one measurement."
    )


def _any_unfinished(table: Table) -> bool:
    return any(r.status != "FINISHED" for line in table.lines for r in line.row.runs)


def table_markdown(table: Table) -> str:
    """The table as Markdown, with the keys that are the same everywhere and the drift above it and its footnotes
    below."""
    lines = markdown_table(_headers(table), [_cells(table, line) for line in table.lines])
    same = ", ".join(f"`{k}={v}`" for k, v in table.same.items())
    head = wrap(f"Same in every run: {same}" if same else "No config key is the same in every run.")
    return "\n".join([*head, *above(table), "", *lines, "", *_footnotes(table)]) + "\n"


def above(table: Table) -> list[str]:
    """What both tables say above their rows: the drift, a search's ranking, a ladder's total and mean step."""
    lines = wrap(_drift(table))
    if table.ranked_by:
        lines += wrap(f"Rows ranked by {table.ranked_by} (the search's objective), best first.")
    if table.ladder and table.total is not None:
        lines += wrap(_ladder(table))
    return lines


def _ladder(table: Table) -> str:
    """The ladder's total and mean step, with how many steps were shown on their own: a total of steps each
    within the noise is no finding, however large it reads."""
    steps = len(table.lines) - 1
    shown = sum(1 for line in table.lines[1:] if line.vs_previous is not None and line.vs_previous.real)
    said = (
        f"Ladder: {number(table.total)}× in all (the last row over the baseline), {number(table.per_step)}× per "
        f"step over {steps} step(s) (the geometric mean: the total's {steps}th root); {shown} of {steps} step(s) "
        "shown on its own."
    )
    if shown:
        return said
    if table.lines[-1].vs_baseline.real:
        return said + (
            " Caveat: no step was shown to change the speed on its own: the total is real, but not which steps gave it."
        )
    return said + (
        " Caveat: no step was shown to change the speed on its own: the totals may be noise; add repeats "
        "(trainer.seed) or rerun on a quieter machine."
    )


def compact_markdown(table: Table) -> str:
    """The table for MLflow's run page (a sweep parent's description): the rows' speed and why, in a few narrow
    columns, so that the page keeps room for its About panel and child runs; the whole table is an artifact."""
    unfinished = _any_unfinished(table)
    headers = ["run", "n", "samples/s", "speed-up [95% CI]", "significance", "step vs baseline"]
    headers += ["status"] if unfinished else []
    body = []
    for line in table.lines:
        base = line.row is table.baseline
        speed = line.row.speed()
        body.append(
            [
                line.row.name,
                str(line.row.n),
                (number(speed.median) if speed else "–") + busy_mark(line.row),
                "1.00× (baseline)" if base else line.vs_baseline.cell(),
                "baseline" if base else line.vs_baseline.reason,
                "baseline" if base else line.step_change or "–",
                *([line.row.status] if unfinished else []),
            ]
        )
    whole = (
        "The whole table (every key that differs, epoch time, accuracy, GPU use, memory, the footnotes) is in "
        "this run's artifacts: compare/compare.md, compare.csv and compare.png."
    )
    busy = wrap(note) if (note := busy_note(table)) else []
    return "\n".join([*above(table), "", *markdown_table(headers, body), "", *busy, *wrap(whole)]) + "\n"


def _drift(table: Table) -> str:
    drift = table.drift
    if drift is None:
        return "Drift: not measurable (no configuration ran more than once)."
    if drift.real:
        way = "slower" if drift.change < 0 else "faster"
        return (
            f"Drift: this machine ran {abs(drift.change):.0%} {way} by the last of these {drift.runs} runs than by the "
            f"first (p={drift.p:.2g}, each configuration's own speed taken out). Speed-ups from runs made side by side "
            "in each round still hold; for the rest, rerun on a quieter machine."
        )
    way = "slowed" if drift.change < 0 else "sped up"
    return (
        f"Drift: the machine {way} about {abs(drift.change):.0%} from the first to the last of these {drift.runs} "
        f"runs, p={drift.p:.2g}: not shown."
    )


def _footnotes(table: Table) -> list[str]:
    tests = max((ln.vs_baseline.tests for ln in table.lines), default=0)
    holm = f", adjusted by Holm over the table's {tests} comparisons," if tests > 1 else ""
    notes = [
        f"samples/s: steady-state throughput (a DDP job's over all its ranks), median (min–max) over a row's n "
        f"repeats; spread = IQR/median, 'noisy' from {NOISY:.0%}.",
        f"speed-up: the Hodges–Lehmann ratio to the baseline ({table.baseline.name}) with its 95% interval (* where "
        f"so few runs allow only a lower coverage). real when the exact test's p{holm} is < {table.alpha:g} and the "
        f"change is ≥ {table.min_effect:.0%}, else '~'; the test is paired round by round where both rows ran in the "
        "same rounds of an interleaved sweep and enough rounds can reach the level, else a rank test on all runs.",
        "step ms: a steady step's mean, split into waiting for data, copying to the device, computing and the "
        "pipeline's own work between steps (medians over the repeats); 'step vs baseline' names the parts that moved.",
    ]
    if any(line.row.single_epoch for line in table.lines):
        notes.append(
            "¹ a single epoch: its time includes warm-up (first allocations, cuDNN autotuning, compilation); "
            "train with trainer.epochs ≥ 2 for a steady epoch time (samples/s leaves the warm-up out already)."
        )
    if any(line.row.peak_mb()[1] for line in table.lines):
        notes.append(
            f"² the device's peak in use ({GPU_MEM_PEAK_MB}, all processes): "
            f"{MEMORY_MAX_ALLOCATED_MB} was not recorded."
        )
    if busy := busy_note(table):
        notes.append(busy)
    if peaks := peaks_note(table):
        notes.append(peaks)
    if power := power_note(table):
        notes.append(power)
    return [wrapped for note in notes for wrapped in wrap(note)] + gaps(table)


def gaps(table: Table) -> list[str]:
    """What the rows leave out, wrapped: rows that differ only in code or software, runs lacking metrics."""
    twins = table.twins
    notes = [f"- {a.name} and {b.name} have the same config and differ only in: {', '.join(w)}." for a, b, w in twins]
    for run, missing in table.lacking:
        error = f"; error: {run.tags['error'][:120]}" if "error" in run.tags else ""
        notes.append(f"- run {run.name} ({run.id[:8]}, {run.status}) has no {', '.join(missing)}{error}")
    return [wrapped for note in notes for wrapped in wrap(note)]


def wrap(text: str) -> list[str]:
    """Prose in lines of at most ``WIDTH`` characters (Markdown joins them back into one paragraph)."""
    return textwrap.wrap(text, WIDTH, break_long_words=False, break_on_hyphens=False) or [""]


def table_csv(table: Table) -> str:
    """One line per row: every number unrounded, min and max included; the ladder's total and mean step last."""
    quality = table.quality.replace("/", "_")  # val_acc, val_mae, ...
    metrics = {
        "epoch_s": lambda r: r.stat(TIME_EPOCH_S),
        "samples_per_s": Row.speed,
        quality: lambda r: r.stat(table.quality),
    }
    header = ["run", "n", "run_ids", "status", "device", "device_name", "model", "precision"]
    header += ["batch_size", "workers", "resident", *table.diff_keys, *table.provenance]
    header += [f"{name}_{part}" for name in metrics for part in ("median", "min", "max")]
    header += ["spread_iqr_over_median", *_speedup_header(""), *_speedup_header("vs_previous_")]
    header += [f"step_{p.replace(' ', '_')}_ms" for p in STEP_PARTS] + ["step_vs_baseline"]
    header += ["gpu_util_mean_pct", "mfu_pct", "mfu_peak", "peak_mb", "peak_mb_source", "bottleneck", "oom_events"]
    header += ["single_epoch", "busy_runs"]  # busy_runs: runs of the row tagged machine.busy=true
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for line in table.lines:
        row = line.row
        peak, device_peak = row.peak_mb()
        stats = [get(row) for get in metrics.values()]
        parts = row.step_parts_ms() or {}
        writer.writerow(
            [
                row.name,
                row.n,
                " ".join(r.id for r in row.runs),
                row.status,
                row.tag("device.type"),
                row.tag("device.name"),
                row.model,
                row.tag("precision"),
                *(row.param(k) for k in LOADER_SHOWN),
                *(row.param(k) for k in table.diff_keys),
                *(row.runs[0].tags.get(t, "") for t in table.provenance),
                *(_g(getattr(s, part, None)) for s in stats for part in ("median", "low", "high")),
                _g(s.spread if (s := row.speed()) else None),
                *_speedup_cells(line.vs_baseline if row is not table.baseline else None),
                *_speedup_cells(line.vs_previous),
                *(_g(parts.get(p)) for p in STEP_PARTS),
                line.step_change,
                _g(s.median if (s := row.stat(GPU_UTIL_MEAN_PCT)) else None),
                _g(s.median if (s := row.stat(PERF_MFU_PCT)) else None),
                row.runs[0].tags.get("perf.peak", ""),
                _g(peak.median if peak else None),
                (GPU_MEM_PEAK_MB if device_peak else MEMORY_MAX_ALLOCATED_MB) if peak else "",
                row.tag("bottleneck"),
                row.oom_events,
                _flag(row.single_epoch),
                row.busy_runs,
            ]
        )
    if table.ladder and table.total is not None:
        writer.writerow([{"run": "ladder total", "speedup": _g(table.total)}.get(h, "") for h in header])
        writer.writerow([{"run": "ladder per step", "speedup": _g(table.per_step)}.get(h, "") for h in header])
    return out.getvalue()


def _speedup_header(prefix: str) -> list[str]:
    names = ["speedup", "speedup_low", "speedup_high", "confidence", "real", "p", "p_adjusted", "test", "note"]
    return [f"{prefix}{n}" for n in names]


def _speedup_cells(s: Speedup | None) -> list[str]:
    if s is None:
        return [""] * 9
    c = s.comparison
    numbers = [c.ratio, c.low, c.high, c.confidence] if c else [None] * 4
    test = c.sizes if c else ""
    return [*(_g(x) for x in numbers), _flag(s.real), _g(c.p if c else None), _g(s.p_adjusted), test, s.reason]


def _g(x: float | None) -> str:
    return "" if x is None else format(x, ".6g")


def _flag(x: bool | None) -> str:
    return "" if x is None else str(x).lower()
