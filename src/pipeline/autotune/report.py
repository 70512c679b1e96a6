"""What the tuner says: the table, the winner line, the command to paste, the plot and the MLflow run."""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from typing import Any

from pipeline.autotune.candidates import Candidate, describe
from pipeline.autotune.search import Outcome, Settings, Tally
from pipeline.common.errors import PipelineError
from pipeline.common.metric_names import (
    AUTOTUNE_BEST_SAMPLES_PER_S,
    AUTOTUNE_CONFIRMED_VS_CURRENT_HIGH_PCT,
    AUTOTUNE_CONFIRMED_VS_CURRENT_LOW_PCT,
    AUTOTUNE_CONFIRMED_VS_CURRENT_P,
    AUTOTUNE_CONFIRMED_VS_CURRENT_PCT,
    AUTOTUNE_CURRENT_SAMPLES_PER_S,
    AUTOTUNE_ELAPSED_S,
    AUTOTUNE_TRIALS,
    AUTOTUNE_VS_CURRENT_PCT,
    AUTOTUNE_VS_NEXT_PCT,
)
from pipeline.common.secrets import env_values, mask_tree
from pipeline.common.stats import ALPHA, MIN_EFFECT, Comparison, compare, min_p_paired, summarize
from pipeline.config import LoaderConfig, RunConfig, flatten
from pipeline.record.lifecycle import open_tracker


def gain(a: Tally, b: Tally) -> float:
    """How much faster ``a`` is than ``b`` in the search's table: the ratio of the medians it prints, less 1 (what
    chooses; the claimed gain is ``confirmed_gain``'s)."""
    return a.median / b.median - 1


def confirmed_gain(outcome: Outcome, candidate: Candidate, against: Candidate) -> Comparison | None:
    """``candidate`` against ``against`` over the confirmation rounds both ran: the paired estimate (the median of
    the per-round ratios' Walsh averages), its interval and the signed-rank test (``pipeline.common.stats.compare``);
    None without a confirmation of both. Always paired: the rounds ran side by side, so the machine's drift cancels.
    """
    a, b = outcome.confirmation(candidate), outcome.confirmation(against)
    if a is None or b is None:
        return None
    pairs = [(b.by_round[r], a.by_round[r]) for r in sorted(set(a.by_round) & set(b.by_round))]
    level = max(ALPHA, min_p_paired(len(pairs)))  # the paired test even where it cannot reach ALPHA: it then says so
    return compare([x for x, _ in pairs], [y for _, y in pairs], pairs=pairs, level=level)


def shown(gain: Comparison | None, *, alpha: float = ALPHA) -> bool:
    """A gain the tuner claims: paired, significant (p < ``alpha``) and at least ``MIN_EFFECT``."""
    return gain is not None and gain.test == "paired" and gain.p < alpha and gain.ratio >= 1 + MIN_EFFECT


def rounds_needed(alpha: float = ALPHA) -> int:
    """The fewest confirmation rounds whose paired test can reach ``alpha`` (6 for 0.05, 8 for 0.01)."""
    rounds = 2
    while min_p_paired(rounds) >= alpha:
        rounds += 1
    return rounds


def said(gain: Comparison, *, against: str = "") -> str:
    """``+200% [+190% to +210%] on X, p=0.031, paired over 6 confirmation rounds run after the search chose it``."""
    interval = f"[{pct(gain.low - 1)} to {pct(gain.high - 1)}]" + (f" on {against}" if against else "")
    return (
        f"{pct(gain.ratio - 1)} {interval}, p={gain.p:.2g}, paired over {gain.pairs} confirmation rounds run after "
        "the search chose it"
    )


def _runner(outcome: Outcome) -> str:
    """``; +25% [...] on workers=2 prefetch=4 (240 samples/s)...``, or ``not shown``: the winner on the runner-up."""
    chosen = outcome.ranking()[0].candidate
    runner = next((t for t in outcome.confirmed if t.candidate not in (chosen, outcome.current)), None)
    versus = None if runner is None else confirmed_gain(outcome, chosen, runner.candidate)
    if runner is None or versus is None:
        return ""
    who = f"{describe(runner.candidate, outcome.current)} ({_rate(runner.median)} samples/s)"
    if shown(versus):
        return f"; {pct(versus.ratio - 1)} [{pct(versus.low - 1)} to {pct(versus.high - 1)}] on {who}"
    return f"; on {who}: not shown ({pct(versus.ratio - 1)}, p={versus.p:.2g})"


def why_not_shown(gain: Comparison, *, alpha: float = ALPHA) -> str:
    """Why a paired gain is not claimed at level ``alpha``, in words."""
    if gain.min_p >= alpha:
        return f"{gain.pairs} rounds cannot show a difference: use --confirm {rounds_needed(alpha)} or more"
    if gain.p < alpha:
        return f"a change under {MIN_EFFECT:.0%} is not worth acting on"
    return f"p={gain.p:.2g} is not below {alpha:g}"


def pct(value: float) -> str:
    gain_pct = 100 * value
    return f"{gain_pct:+.1f}%" if abs(gain_pct) < 10 else f"{gain_pct:+.0f}%"


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
    """The timed candidates fastest first: samples/s (median and range over the search's rounds), and each row's
    gain over the current setting and over the next row, as the ratios of those medians."""
    ranking, current = outcome.ranking(), outcome.tally(outcome.current)
    rows = [("candidate", "samples/s", "min–max", "rounds", "vs current", "vs next")]
    for i, tally in enumerate(ranking):
        name = describe(tally.candidate, outcome.current) + (" (current)" if tally is current else "")
        versus = "—" if current is None or tally is current else pct(gain(tally, current))
        following = pct(gain(tally, ranking[i + 1])) if i + 1 < len(ranking) else "—"
        noisy = " noisy" if (summary := summarize(tally.by_round.values())) is not None and summary.noisy else ""
        spread = f"{_rate(tally.low)}–{_rate(tally.high)}{noisy}"
        rows.append((name, _rate(tally.median), spread, str(len(tally.by_round)), versus, following))
    lines = _aligned(rows)
    lines += [f"{describe(t.candidate, outcome.current)}: {t.stopped}" for t in outcome.tallies if not t.measured]
    return "\n".join(lines)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def suggestion(outcome: Outcome) -> Candidate | None:
    """The setting the tuner suggests: the search's fastest when the confirmation rounds showed it faster than the
    current setting (``shown``), else the current one; None when nothing was measured."""
    ranking = outcome.ranking()
    if not ranking:
        return None
    chosen = ranking[0].candidate
    return chosen if shown(confirmed_gain(outcome, chosen, outcome.current)) else outcome.current


def verdict(outcome: Outcome, overrides: Sequence[str]) -> list[str]:
    """The suggestion and what it gains: the paired estimate over the confirmation rounds run after the search chose
    it (the search's own rounds would overstate the margin), claimed only when significant; the command to paste."""
    suggested = suggestion(outcome)  # what the tuning run's autotune.command tag holds too
    if suggested is None:
        return ["nothing was measured: the budget ran out before the first trial; raise --budget-s"]
    chosen = outcome.ranking()[0]
    name = describe(chosen.candidate, outcome.current)
    winner, current = outcome.confirmation(chosen.candidate), outcome.confirmation(outcome.current)
    if winner is None:
        lines = [f"fastest in the search: {name} (not confirmed: {outcome.unconfirmed}; no gain claimed)"]
        if chosen.candidate != outcome.current and (mine := outcome.tally(outcome.current)):
            lines[0] += (
                f"; {_rate(chosen.median)} vs {_rate(mine.median)} samples/s for your current setting in the search's "
                "own rounds, an optimistic margin"
            )
    elif chosen.candidate == outcome.current:
        lines = [
            f"fastest: your current setting ({name}): {_rate(winner.median)} samples/s in the confirmation rounds"
            + _runner(outcome)
        ]
    elif current is None:  # the current setting was never measured: nothing to claim a gain over
        lines = [f"fastest in the search: {name}, {_rate(winner.median)} samples/s; your current setting was not timed"]
    else:
        claimed = confirmed_gain(outcome, chosen.candidate, outcome.current)
        numbers = f"{_rate(winner.median)} vs {_rate(current.median)} samples/s"
        if shown(claimed):
            lines = [
                f"fastest: {name}: {said(claimed, against=f'your current setting ({numbers})')}" + _runner(outcome)
            ]
        else:
            lines = [
                f"keep your current setting: the search's fastest, {name}, was not shown faster in the confirmation "
                f"rounds ({said(claimed)}, {numbers}: not shown; {why_not_shown(claimed)})"
            ]
    if any(s.noisy for t in outcome.confirmed if (s := summarize(t.by_round.values())) is not None):
        lines.append("  (noisy: the confirmation rounds disagreed by 10% or more; rerun on a quieter machine)")
    lines.append("  " + override_line(overrides, outcome.current.loader, suggested.loader))
    if suggested.loader.batch_size != outcome.current.loader.batch_size:
        lines.append("  (a larger batch changes the optimisation: scale optimizer.lr with it and check val/acc)")
    return lines


def format_report(outcome: Outcome, overrides: Sequence[str], *, title: str) -> str:
    timed = sum(t.measured for t in outcome.tallies)
    lines = [
        f"autotune: {title} · {timed} of {len(outcome.tallies)} candidates timed · {outcome.rounds} round(s) · "
        f"{outcome.elapsed_s:.1f} s of a {outcome.budget_s:g} s budget",
        f"search stopped: {outcome.stop_reason}",
    ]
    if outcome.batch_sizes:
        tried = ", ".join(f"{b}: {'out of memory' if v is None else _rate(v) + '/s'}" for b, v in outcome.batch_sizes)
        lines.append(f"batch sizes tried (micro-batch fallback off): {tried}; kept {outcome.batch_size}")
    lines += ["", table(outcome), "", *verdict(outcome, overrides)]
    if outcome.cut_short:
        lines.append("cut short by the time budget: the ranking uses what was measured (see rounds); raise --budget-s")
    if any((s := summarize(t.by_round.values())) is not None and s.noisy for t in outcome.tallies if t.measured):
        lines.append(
            "noisy: some candidate's rounds differed by 10% or more (other work on this machine?); the ranking may "
            "not hold: rerun with more --rounds on a quiet machine"
        )
    return "\n".join(lines)


def workers_figure(outcome: Outcome, *, title: str) -> Any:
    """Samples/s against num_workers (median, whiskers min–max), one line per pin/prefetch/batch setting;
    resident as a dashed line over its range, the current setting starred."""
    from matplotlib.figure import Figure  # without pyplot: headless, nothing to close

    fig = Figure(figsize=(8, 4.2))
    ax = fig.subplots()
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


class NothingMeasured(PipelineError):
    """The budget ended before any trial was timed: there is no result to record or suggest."""

    @classmethod
    def within(cls, outcome: Outcome) -> NothingMeasured:
        why = f"{outcome.budget_s:g} s budget ({outcome.stop_reason})"
        return cls(f"nothing was measured in the {why}: raise --budget-s")


def log_tuning_run(
    cfg: RunConfig, outcome: Outcome, report: str, *, overrides: Sequence[str], settings: Settings, name: str
) -> list[str]:
    """An MLflow run with the settings, the report, every trial, the plot and the winner; returns where it is."""
    ranking, current = outcome.ranking(), outcome.tally(outcome.current)
    tags = {
        **cfg.tracking.tags,
        "autotune": "true",
        "mlflow.source.name": "python -m pipeline.autotune",
        "overrides": shlex.join(overrides) if overrides else "(none)",
        "autotune.stopped": outcome.stop_reason,
        "autotune.cut_short": str(outcome.cut_short).lower(),
    }
    metrics = {AUTOTUNE_ELAPSED_S: outcome.elapsed_s, AUTOTUNE_TRIALS: float(len(outcome.trials))}
    if ranking:
        winner = ranking[0]
        suggested = suggestion(outcome) or winner.candidate
        tags["autotune.winner"] = describe(winner.candidate, outcome.current)  # the search's fastest
        tags["autotune.suggested"] = describe(suggested, outcome.current)  # after the confirmation rounds
        tags["autotune.command"] = override_line(overrides, outcome.current.loader, suggested.loader)  # as printed
        metrics[AUTOTUNE_BEST_SAMPLES_PER_S] = winner.median
        if len(ranking) > 1:
            metrics[AUTOTUNE_VS_NEXT_PCT] = 100 * gain(winner, ranking[1])
        if current is not None:
            metrics[AUTOTUNE_CURRENT_SAMPLES_PER_S] = current.median
            metrics[AUTOTUNE_VS_CURRENT_PCT] = 100 * gain(winner, current)
        claimed = confirmed_gain(outcome, winner.candidate, outcome.current)
        if claimed is not None and winner.candidate != outcome.current:  # the verdict's paired estimate
            metrics[AUTOTUNE_CONFIRMED_VS_CURRENT_PCT] = 100 * (claimed.ratio - 1)
            metrics[AUTOTUNE_CONFIRMED_VS_CURRENT_LOW_PCT] = 100 * (claimed.low - 1)
            metrics[AUTOTUNE_CONFIRMED_VS_CURRENT_HIGH_PCT] = 100 * (claimed.high - 1)
            metrics[AUTOTUNE_CONFIRMED_VS_CURRENT_P] = claimed.p
            tags["autotune.gain"] = "shown" if shown(claimed) else "not shown"
    trials = [
        {
            "candidate": describe(t.candidate, outcome.current),
            "loader": dataclasses.asdict(t.candidate.loader),
            "round": t.round,
            "phase": "confirm" if t.confirm else "search",
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
        if not ranking:  # the run ends FAILED with this as its error: a FINISHED run would claim a result
            raise NothingMeasured.within(outcome)
        tracker.log_figure(lambda: workers_figure(outcome, title=name), "autotune/workers.png")
        return tracker.describe()
