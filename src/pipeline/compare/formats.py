"""A ``Table`` as text: Markdown (padded to read as plain text, with its footnotes) and CSV (numbers unrounded)."""

from __future__ import annotations

import csv
import io
import math

from pipeline.compare.records import DEVICE_PEAK_MB, EPOCH_S, GPU_UTIL, PEAK_MB, THROUGHPUT, VAL_ACC
from pipeline.compare.stats import MIN_REPEATS, NOISY, Stat
from pipeline.compare.table import SHOWN, Line, Table


def _num(x: float | None) -> str:
    """Three significant digits, trailing zeros kept (0.800, 9.60, 123), thousands grouped (2,099)."""
    if x is None:
        return "–"
    rounded = float(f"{x:.3g}")  # 99.96 is 100, not 100.0
    if rounded == 0 or abs(rounded) >= 100:
        return f"{x:,.0f}"
    return f"{rounded:.{2 - math.floor(math.log10(abs(rounded)))}f}"


def _range(s: Stat | None, mark: str = "") -> str:
    if s is None:
        return "–"
    return f"{_num(s.median)}{mark}" + (f" ({_num(s.low)}–{_num(s.high)})" if s.n > 1 else "")


def _spread(s: Stat | None) -> str:
    if s is None or s.n < 2 or s.spread is None:
        return "–"
    return f"{s.spread:.0%}" + (" noisy" if s.noisy else "")


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
        "epoch s",
        "samples/s",
        "spread",
        "speed-up",
        "significance",
        *(["vs previous"] if table.ladder else []),
        "val/acc",
        "GPU util %",
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
        row.param("model.name"),
        row.tag("precision"),
        *(row.param(k) for k in SHOWN if k != "model.name"),
        *(row.param(k) for k in table.diff_keys),
        _range(row.stat(EPOCH_S), "¹" if row.single_epoch else ""),
        _range(row.stat(THROUGHPUT)),
        _spread(row.stat(THROUGHPUT)),
        "1.00×" if is_base else line.vs_baseline.cell(),
        line.vs_baseline.reason,
        *([line.vs_previous.cell() if line.vs_previous else "–"] if table.ladder else []),
        _range(row.stat(VAL_ACC)),
        _num(s.median) if (s := row.stat(GPU_UTIL)) else "–",
        (_num(peak.median) + ("²" if device_peak else "")) if peak else "–",
        row.tag("bottleneck"),
        str(row.oom_events),
        *([row.status] if _any_unfinished(table) else []),
    ]


def _geomean_cells(table: Table) -> list[str]:
    cells = ["" for _ in _headers(table)]
    cells[0] = "geometric mean"
    at = _headers(table).index("speed-up")
    cells[at] = f"{_num(table.geomean_vs_baseline)}×" if table.geomean_vs_baseline else "–"
    cells[at + 1] = "of the rows after the baseline"
    cells[at + 2] = f"{_num(table.geomean_per_step)}× per step" if table.geomean_per_step else "–"
    return cells


def _any_unfinished(table: Table) -> bool:
    return any(r.status != "FINISHED" for line in table.lines for r in line.row.runs)


def table_markdown(table: Table) -> str:
    """The table as Markdown, columns padded so it also reads as plain text, with the keys that are the same
    everywhere above it and its footnotes below."""
    headers = _headers(table)
    body = [_cells(table, line) for line in table.lines]
    if table.ladder:
        body.append(_geomean_cells(table))
    rows = [[_md(c) for c in row] for row in [headers, *body]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    same = ", ".join(f"`{k}={v}`" for k, v in table.same.items())
    out = [f"Same in every run: {same}" if same else "No config key is the same in every run.", "", *lines, ""]
    out += _footnotes(table)
    return "\n".join(out) + "\n"


def _footnotes(table: Table) -> list[str]:
    notes = [
        f"samples/s: steady-state throughput, median (min–max) over a row's n repeats; spread = IQR/median, "
        f"'noisy' from {NOISY:.0%}. speed-up = median samples/s over the baseline's ({table.baseline.name}); "
        f"real only when a Mann–Whitney U test gives p < {table.alpha:g} and the change is ≥ {table.min_effect:.0%}, "
        f"else '~'; a row needs ≥ {MIN_REPEATS} repeats to show a difference."
    ]
    if any(line.row.single_epoch for line in table.lines):
        notes.append(
            "¹ a single epoch: its time includes warm-up (first allocations, cuDNN autotuning, compilation); "
            "train with trainer.epochs ≥ 2 for a steady epoch time (samples/s leaves the first step out already)."
        )
    if any(line.row.peak_mb()[1] for line in table.lines):
        notes.append(f"² the device's peak in use ({DEVICE_PEAK_MB}, all processes): {PEAK_MB} was not recorded.")
    for record, missing in table.lacking:
        error = f"; error: {record.tags['error'][:120]}" if "error" in record.tags else ""
        notes.append(f"- run {record.name} ({record.id[:8]}, {record.status}) has no {', '.join(missing)}{error}")
    return notes


def _md(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def table_csv(table: Table) -> str:
    """One line per row: every number unrounded, min and max included; the geometric means last (ladders)."""
    metrics = {"epoch_s": EPOCH_S, "samples_per_s": THROUGHPUT, "val_acc": VAL_ACC}
    header = ["run", "n", "run_ids", "status", "device", "device_name", "model", "precision"]
    header += ["batch_size", "workers", "resident", *table.diff_keys]
    header += [f"{name}_{part}" for name in metrics for part in ("median", "min", "max")]
    header += ["spread_iqr_over_median", "speedup", "speedup_real", "speedup_p", "speedup_note"]
    header += ["speedup_vs_previous", "vs_previous_real", "vs_previous_p", "gpu_util_mean_pct", "peak_mb"]
    header += ["peak_mb_source", "bottleneck", "oom_events", "single_epoch"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for line in table.lines:
        row = line.row
        peak, device_peak = row.peak_mb()
        stats = [row.stat(m) for m in metrics.values()]
        prev = line.vs_previous
        writer.writerow(
            [
                row.name,
                row.n,
                " ".join(r.id for r in row.runs),
                row.status,
                row.tag("device.type"),
                row.tag("device.name"),
                row.param("model.name"),
                row.tag("precision"),
                *(row.param(k) for k in SHOWN if k != "model.name"),
                *(row.param(k) for k in table.diff_keys),
                *(_g(getattr(s, part, None)) for s in stats for part in ("median", "low", "high")),
                _g(s.spread if (s := row.stat(THROUGHPUT)) else None),
                _g(line.vs_baseline.median_ratio),
                _flag(line.vs_baseline.real),
                _g(line.vs_baseline.p),
                line.vs_baseline.reason,
                _g(prev.median_ratio if prev else None),
                _flag(prev.real if prev else None),
                _g(prev.p if prev else None),
                _g(s.median if (s := row.stat(GPU_UTIL)) else None),
                _g(peak.median if peak else None),
                (DEVICE_PEAK_MB if device_peak else PEAK_MB) if peak else "",
                row.tag("bottleneck"),
                row.oom_events,
                _flag(row.single_epoch),
            ]
        )
    if table.ladder:
        geo = {"run": "geometric mean", "speedup": table.geomean_vs_baseline}
        geo["speedup_vs_previous"] = table.geomean_per_step
        writer.writerow([_g(geo[h]) if h in geo and h != "run" else geo.get(h, "") for h in header])
    return out.getvalue()


def _g(x: float | None) -> str:
    return "" if x is None else format(x, ".6g")


def _flag(x: bool | None) -> str:
    return "" if x is None else str(x).lower()
