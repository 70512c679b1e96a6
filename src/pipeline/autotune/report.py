"""What the tuner says: the table, the winner line, the command to paste, the plot and the MLflow run."""

from __future__ import annotations

import dataclasses
import json
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.autotune.candidates import describe
from pipeline.autotune.search import Outcome, Settings, Tally
from pipeline.config import LoaderConfig, RunConfig

NOISY = 1.25  # a candidate whose fastest round beat its slowest by more than this earns a warning


@dataclass(frozen=True)
class Speedup:
    """How much faster one candidate is than another: the median and range of per-round ratios."""

    ratio: float
    low: float
    high: float
    rounds: int

    def pct(self, value: float | None = None) -> str:
        gain = 100 * ((self.ratio if value is None else value) - 1)
        return f"{gain:+.1f}%" if abs(gain) < 10 else f"{gain:+.0f}%"


def speedup(a: Tally, b: Tally) -> Speedup:
    """``a`` over ``b`` paired by round (a round's trials ran back to back, so the machine's drifts cancel);
    the ratio of medians when they share no round."""
    shared = sorted(a.by_round.keys() & b.by_round.keys() - {0})
    ratios = [a.by_round[r] / b.by_round[r] for r in shared] or [a.median / b.median]
    return Speedup(statistics.median(ratios), min(ratios), max(ratios), len(shared))


def override_line(overrides: Sequence[str], current: LoaderConfig, winner: LoaderConfig) -> str:
    """``python -m pipeline`` with the user's overrides and the loader keys the winner changes (and num_workers,
    always), each stated once: the user's override of a key restated here is left out."""
    keys = [f.name for f in dataclasses.fields(LoaderConfig) if getattr(winner, f.name) != getattr(current, f.name)]
    keys = keys if "num_workers" in keys else ["num_workers", *keys]
    stated = {f"loader.{key}" for key in keys}
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in stated]
    loader = [f"loader.{key}={_yaml(getattr(winner, key))}" for key in keys]
    return shlex.join(["python", "-m", "pipeline", *kept, *loader])


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def table(outcome: Outcome) -> str:
    """The timed candidates fastest first (samples/s: median and range over rounds; speed-ups paired by round
    with the current setting and with the next row), then those not timed and why."""
    ranking, current = outcome.ranking(), outcome.tally(outcome.current)
    rows = [("candidate", "samples/s", "min–max", "rounds", "vs current", "vs next")]
    for i, tally in enumerate(ranking):
        name = describe(tally.candidate, outcome.current) + (" (current)" if tally is current else "")
        versus = "—" if current is None or tally is current else speedup(tally, current).pct()
        following = speedup(tally, ranking[i + 1]).pct() if i + 1 < len(ranking) else "—"
        spread = f"{_rate(tally.low)}–{_rate(tally.high)}"
        rows.append((name, _rate(tally.median), spread, str(len(tally.by_round)), versus, following))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines += [f"{describe(t.candidate, outcome.current)}: {t.stopped}" for t in outcome.tallies if not t.measured]
    return "\n".join(lines)


def verdict(outcome: Outcome, overrides: Sequence[str]) -> list[str]:
    """The winner, by how much it beats the next best and the current setting, and the command to paste."""
    ranking, current = outcome.ranking(), outcome.tally(outcome.current)
    if not ranking:
        return ["nothing was measured: the budget ran out before the first trial; raise --budget-s"]
    winner = ranking[0]
    name = describe(winner.candidate, outcome.current)
    if len(ranking) == 1:
        lines = [f"fastest: {name} (the only candidate timed)"]
    else:
        gain = speedup(winner, ranking[1])
        spread = f"spread {gain.pct(gain.low)} to {gain.pct(gain.high)}" if gain.rounds > 1 else "one round"
        said = (
            f"{gain.pct()[1:]} faster than the next best, {describe(ranking[1].candidate, outcome.current)} ({spread})"
        )
        if gain.low <= 1.0:
            said += ": within the noise, either will do"
        if winner is current:
            lines = [f"fastest: your current setting ({name}), {said}"]
        elif current is None:
            lines = [f"fastest: {name}, {said}; your current setting was not timed"]
        else:
            lines = [f"fastest: {name}, {said}; {speedup(winner, current).pct()[1:]} faster than your current setting"]
    lines.append("  " + override_line(overrides, outcome.current.loader, winner.candidate.loader))
    if winner.candidate.loader.batch_size != outcome.current.loader.batch_size:
        lines.append("  (a larger batch changes the optimisation: scale trainer.lr with it and check val/acc)")
    return lines


def format_report(outcome: Outcome, overrides: Sequence[str], *, title: str) -> str:
    timed = sum(t.measured for t in outcome.tallies)
    lines = [
        f"autotune: {title} · {timed} of {len(outcome.tallies)} candidates timed · {outcome.rounds} round(s) · "
        f"{outcome.elapsed_s:.1f} s of a {outcome.budget_s:g} s budget",
        f"stopped: {outcome.stop_reason}",
    ]
    if outcome.batch_sizes:
        tried = ", ".join(f"{b}: {'out of memory' if v is None else _rate(v) + '/s'}" for b, v in outcome.batch_sizes)
        lines.append(f"batch sizes tried (micro-batch fallback off): {tried}; kept {outcome.batch_size}")
    lines += ["", table(outcome), "", *verdict(outcome, overrides)]
    if outcome.cut_short:
        lines.append("cut short by the time budget: the ranking uses what was measured (see rounds); raise --budget-s")
    varied = max((t.high / t.low for t in outcome.tallies if len(t.by_round) > 1), default=1.0)
    if varied > NOISY:
        lines.append(
            f"noisy: one candidate's rounds differed {varied:.1f}x (other work on this machine?); the ranking may "
            "not hold: rerun with more --rounds on a quiet machine"
        )
    return "\n".join(lines)


def workers_figure(outcome: Outcome, *, title: str) -> Any:
    """Samples/s against num_workers (median, whiskers min–max), one line per pin/prefetch/batch setting;
    resident as a dashed line over its range, the current setting starred."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    measured = [t for t in outcome.tallies if t.measured]
    loaders = [t for t in measured if not t.candidate.loader.resident]
    xs = sorted({t.candidate.loader.num_workers for t in loaders})
    families: dict[tuple[Any, ...], list[Tally]] = {}
    for tally in sorted(loaders, key=lambda t: t.candidate.loader.num_workers):
        loader = tally.candidate.loader
        families.setdefault((loader.pin_memory, loader.prefetch_factor or 2, loader.batch_size), []).append(tally)
    for family in families.values():
        name = describe(family[-1].candidate, outcome.current)  # the most workers: prefetch shows there
        label = " ".join(p for p in name.split() if not p.startswith(("workers=", "not-persistent"))) or "DataLoader"
        ax.errorbar(
            [xs.index(t.candidate.loader.num_workers) for t in family],
            [t.median for t in family],
            yerr=[[t.median - t.low for t in family], [t.high - t.median for t in family]],
            fmt="o-",
            capsize=4,
            label=label,
        )
    for tally in measured:
        if tally.candidate.loader.resident:
            ax.axhline(tally.median, color="tab:green", linestyle="--", label="resident")
            ax.axhspan(tally.low, tally.high, color="tab:green", alpha=0.15)
        elif tally.candidate == outcome.current:
            x = xs.index(tally.candidate.loader.num_workers)
            ax.plot([x], [tally.median], marker="*", markersize=14, color="black", linestyle="", label="current")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_xlabel("loader.num_workers")
    ax.set_ylabel("samples/s (median; min–max)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def record(
    cfg: RunConfig, outcome: Outcome, report: str, *, overrides: Sequence[str], settings: Settings, name: str
) -> list[str]:
    """An MLflow run with the settings, the report, every trial, the plot and the winner; returns where it is."""
    from pipeline.config import flatten
    from pipeline.secrets import env_values, mask_tree
    from pipeline.tracking import open_tracker

    ranking, current = outcome.ranking(), outcome.tally(outcome.current)
    tags = {
        **cfg.tracking.tags,
        "autotune": "true",
        "mlflow.source.name": "python -m pipeline.autotune",
        "overrides": shlex.join(overrides) if overrides else "(none)",
        "autotune.stopped": outcome.stop_reason,
        "autotune.cut_short": str(outcome.cut_short).lower(),
    }
    metrics = {"autotune/elapsed_s": outcome.elapsed_s, "autotune/trials": float(len(outcome.trials))}
    if ranking:
        winner = ranking[0]
        tags["autotune.winner"] = describe(winner.candidate, outcome.current)
        tags["autotune.command"] = override_line(overrides, outcome.current.loader, winner.candidate.loader)
        metrics["autotune/best_samples_per_s"] = winner.median
        if len(ranking) > 1:
            metrics["autotune/vs_next_pct"] = 100 * (speedup(winner, ranking[1]).ratio - 1)
        if current is not None:
            metrics["autotune/current_samples_per_s"] = current.median
            metrics["autotune/vs_current_pct"] = 100 * (speedup(winner, current).ratio - 1)
    trials = [
        {
            "candidate": describe(t.candidate, outcome.current),
            "loader": dataclasses.asdict(t.candidate.loader),
            "round": t.round,
            "samples_per_s": t.samples_per_s,
            "seconds": round(t.seconds, 3),
        }
        for t in outcome.trials
    ]
    with open_tracker(cfg.tracking, run_name=name, tags=tags, secret_values=env_values(cfg)) as tracker:
        params = {f"autotune.{k}": v for k, v in dataclasses.asdict(settings).items()}
        tracker.log_params({**params, **flatten(mask_tree(cfg.to_dict(), cfg.env_keys))})
        tracker.log_metrics(metrics, step=0)
        tracker.log_text(report + "\n", "autotune/report.txt")
        tracker.log_text(json.dumps(trials, indent=2), "autotune/trials.json")
        if ranking:
            tracker.log_figure(lambda: workers_figure(outcome, title=name), "autotune/workers.png")
        return tracker.describe()
