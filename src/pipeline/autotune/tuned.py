"""What ``python -m pipeline.tune`` says and leaves: the report, the command line to use, the experiment file that
holds the change, and the MLflow record (a parent run, one nested run per trial).

The experiment file goes where the launch's configs are: ``<--config-dir>/experiment/tuned_<name>.yaml``, else
``./tuned/experiment/tuned_<name>.yaml`` (a config folder of its own, used with ``--config-dir tuned``). It holds only
the change (``# @package _global_``), on top of the experiment the launch chose, if any; the user's other overrides
stay on the command line. It is written only when a gain was shown.

The record lives in ``<tracking.experiment>-tune``. The parent is tagged like a sweep's (``sweep.role=parent``,
``sweep.id``), and each trial is a child run (``mlflow.parentRunId``, ``sweep.id``, ``sweep.round``) whose params are
its candidate's whole configuration and whose metric is ``throughput/samples_per_s``: ``python -m pipeline.compare
--experiment <name>-tune`` then shows one row per candidate, its trials as repeats, paired by round.
"""

from __future__ import annotations

import datetime
import re
import shlex
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.autotune.candidates import Candidate, describe
from pipeline.autotune.report import confirmed_gain, shown, table, why_not_shown
from pipeline.autotune.search import Outcome, Settings
from pipeline.common.metric_names import (
    THROUGHPUT_SAMPLES_PER_S,
    TUNE_ELAPSED_S,
    TUNE_PROBE_MFU_PCT,
    TUNE_PROBE_SAMPLES_PER_S,
    TUNE_TRIALS,
)
from pipeline.common.secrets import env_values, mask_tree
from pipeline.common.stats import ALPHA, Comparison
from pipeline.config import flatten
from pipeline.record.lifecycle import open_tracker
from pipeline.record.runs import create_run

if TYPE_CHECKING:
    from pipeline.autotune.tuning import Tuning

PARAMS_PER_BATCH = 100  # MLflow's most params per log_batch call


def ratio(gain: Comparison) -> str:
    """``1.42x [1.21, 1.66]``: the paired estimate and its interval."""
    return f"{gain.ratio:.2f}x [{gain.low:.2f}, {gain.high:.2f}]"


def probe_line(result: Tuning) -> str:
    probe = result.probe
    mfu = "MFU unknown" if probe.mfu_pct is None else f"MFU {probe.mfu_pct:.1f}%"
    return (
        f"probe: {probe.samples_per_s:,.0f} samples/s · waiting for data {probe.data_wait_pct:.0f}% · copy "
        f"{probe.h2d_pct:.0f}% · compute {probe.compute_pct:.0f}% · overhead {probe.overhead_pct:.0f}% · {mfu} "
        f"→ {probe.bottleneck}"
    )


ALPHA_FIRST = 0.04  # the search's winner is tested at this level when a runner-up was confirmed beside it ...
ALPHA_FALLBACK = ALPHA - ALPHA_FIRST  # ... and the runner-up, only if the winner was not shown, at the rest


def claim(outcome: Outcome) -> tuple[Candidate | None, str]:
    """The change to use (None: keep yours) and the line that says so, from the confirmation rounds alone.

    The search's winner is claimed when its rounds show it faster than the current setting. When the search left
    its lead unclear and the runner-up was confirmed too, a fallback procedure keeps the chance of claiming noise at
    ``ALPHA`` in all: the winner is tested at ``ALPHA_FIRST`` and, only if it is not shown, the runner-up at
    ``ALPHA_FALLBACK`` (the two levels add up to ``ALPHA``)."""
    ranking = outcome.ranking()
    if not ranking:
        return None, "nothing was measured: the budget ran out before the first trial; raise --budget-s"
    best, current = ranking[0].candidate, outcome.current
    if best == current:
        return None, "no change shown: keep your configuration (it was the fastest in the search)"
    gain = confirmed_gain(outcome, best, current)
    if gain is None:
        return (
            None,
            f"no change shown: keep your configuration ({describe(best, current)} not confirmed: "
            f"{outcome.unconfirmed})",
        )
    runner = _fallback(outcome, best)
    first = ALPHA if runner is None else ALPHA_FIRST
    if shown(gain, alpha=first):
        return best, f"faster: {describe(best, current)}: {ratio(gain)} your configuration's speed ({_rounds(gain)})"
    why = "slower in the confirmation rounds" if gain.ratio < 1 else why_not_shown(gain, alpha=first)
    kept = f"{describe(best, current)}: {ratio(gain)}, {_rounds(gain)}; {why}"
    second = None if runner is None else confirmed_gain(outcome, runner, current)
    if runner is not None and second is not None and shown(second, alpha=ALPHA_FALLBACK):
        return runner, (
            f"faster: {describe(runner, current)}: {ratio(second)} your configuration's speed ({_rounds(second)}, "
            f"below {ALPHA_FALLBACK:g} as the runner-up; the search's fastest, {kept})"
        )
    return None, f"no change shown: keep your configuration ({kept})"


def _fallback(outcome: Outcome, best: Candidate) -> Candidate | None:
    """The runner-up confirmed beside the winner and the current setting, if any."""
    return next((t.candidate for t in outcome.confirmed if t.candidate not in (best, outcome.current)), None)


def _rounds(gain: Comparison) -> str:
    return f"paired over {gain.pairs} confirmation rounds in random order, p={gain.p:.2g}"


def command_line(overrides: Sequence[str], changes: Sequence[str], *, config_dir: str | None = None) -> str:
    """``python -m pipeline`` with the user's overrides and ``changes``; a user's override of a key the changes set
    is left out, so each key is stated once."""
    stated = {c.partition("=")[0] for c in changes}
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in stated]
    flag = ["--config-dir", config_dir] if config_dir else []
    return shlex.join(["python", "-m", "pipeline", *flag, *kept, *changes])


def experiment_text(changes: Sequence[str], *, chosen: str | None, note: str, use: str) -> str:
    """The experiment file: the changes as YAML under ``# @package _global_``, on top of ``chosen`` (the launch's
    ``experiment=``) if any."""
    import yaml  # PyYAML, Hydra's own dependency

    tree: dict[str, Any] = {}
    for change in changes:
        key, _, value = change.partition("=")
        *groups, leaf = key.split(".")
        node = tree
        for group in groups:
            node = node.setdefault(group, {})
        node[leaf] = yaml.safe_load(value)
    head = ["# @package _global_", f"# {note}", f"#   {use}"]
    if chosen:
        head += [
            "defaults:  # the experiment the launch chose, then this file's change",
            f"  - /experiment/{chosen}",
            "  - _self_",
        ]
    return "\n".join(head) + "\n" + yaml.safe_dump(tree, sort_keys=False)


def write_experiment(
    result: Tuning, winner: Candidate, overrides: Sequence[str], *, config_dir: str | None, note: str
) -> tuple[Path, str]:
    """Write the experiment file (module docstring); returns its path and the command that uses it."""
    changes = winner.overrides(result.cfg.loader)
    name = "tuned_" + (re.sub(r"[^A-Za-z0-9]+", "-", describe(winner, result.outcome.current)).strip("-") or "change")
    folder = Path(config_dir) if config_dir else Path("tuned")
    chosen = next((o.partition("=")[2] for o in overrides if o.lstrip("+").startswith("experiment=")), None)
    others = [o for o in overrides if not o.lstrip("+").startswith("experiment=")]
    use = command_line([*others, f"experiment={name}"], [], config_dir=str(folder))
    path = folder / "experiment" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(experiment_text(changes, chosen=chosen, note=note, use=use))
    return path, use


def report(result: Tuning, verdict: str, *, settings: Settings) -> str:
    outcome = result.outcome
    timed = sum(t.measured for t in outcome.tallies)
    lines = [
        f"tune: {result.name} · {result.device} · {timed} of {len(outcome.tallies)} candidates timed · "
        f"{outcome.elapsed_s:.1f} s of a {settings.budget_s:g} s budget",
        probe_line(result),
        f"search stopped: {outcome.stop_reason}",
        "",
        table(outcome),
        "",
        verdict,
    ]
    return "\n".join(lines)


def conclude(result: Tuning, overrides: Sequence[str], *, config_dir: str | None, settings: Settings) -> None:
    """Print the report and the command to use, write the experiment file when a gain was shown, record it all."""
    winner, verdict = claim(result.outcome)
    changes = [] if winner is None else winner.overrides(result.cfg.loader)
    lines = [report(result, verdict, settings=settings), "  " + command_line(overrides, changes, config_dir=config_dir)]
    if winner is not None:
        note = f"found by python -m pipeline.tune on {datetime.date.today()}: {verdict}"
        path, use = write_experiment(result, winner, overrides, config_dir=config_dir, note=note)
        lines += [f"experiment file: {path}", f"  {use}"]
    text = "\n".join(lines)
    print(text, flush=True)
    if result.cfg.tracking.enabled:
        print("\n".join(record(result, text, overrides=overrides, changes=changes)), flush=True)


def record(result: Tuning, text: str, *, overrides: Sequence[str], changes: Sequence[str]) -> list[str]:
    """The parent run (the report, the probe, the command) and a child run per trial; returns where it is."""
    cfg, outcome, sweep = result.cfg, result.outcome, uuid.uuid4().hex
    probe = result.probe
    tags = {
        **cfg.tracking.tags,
        "tune": "true",
        "mlflow.source.name": "python -m pipeline.tune",
        "sweep.id": sweep,
        "sweep.role": "parent",  # compare's parent: its children are the rows
        "sweep.keys": "",
        "overrides": shlex.join(overrides) if overrides else "(none)",
        "tune.command": command_line(overrides, changes),
        "tune.changes": " ".join(changes) or "none: keep your configuration",
        "verdict.class": probe.bottleneck,
    }
    metrics = {
        TUNE_PROBE_SAMPLES_PER_S: probe.samples_per_s,
        TUNE_ELAPSED_S: outcome.elapsed_s,
        TUNE_TRIALS: float(len(outcome.trials)),
        **({TUNE_PROBE_MFU_PCT: probe.mfu_pct} if probe.mfu_pct is not None else {}),
    }
    with open_tracker(
        cfg.tracking, run_name=f"tune-{result.name}", tags=tags, secret_values=env_values(cfg)
    ) as tracker:
        tracker.log_metrics(metrics, step=0)
        tracker.log_text(text + "\n", "tune/report.txt")
        log_trials(tracker.client, tracker.experiment_id, tracker.run_id, result, sweep=sweep)
        return tracker.describe()


def log_trials(client: Any, experiment_id: str, parent: str, result: Tuning, *, sweep: str) -> None:
    """One FINISHED child run per timed trial, one FAILED per skipped candidate's failed trial."""
    outcome, cfg = result.outcome, result.cfg
    numbers = {t.candidate: i for i, t in enumerate(outcome.tallies, start=1)}
    why = {t.candidate: t.stopped for t in outcome.tallies}
    for job, trial in enumerate(outcome.trials, start=1):
        name = describe(trial.candidate, outcome.current)
        phase = "confirm" if trial.confirm else "search"
        tags = {
            "mlflow.parentRunId": parent,
            "sweep.id": sweep,
            "sweep.round": f"{phase}-{trial.round}",
            "sweep.config": str(numbers.get(trial.candidate, 0)),
            "sweep.job": str(job),
            "tune.candidate": name,
            "tune.phase": phase,
        }
        if trial.samples_per_s is None:
            tags["tune.skipped"] = why.get(trial.candidate, "") or "failed"
        run = create_run(client, experiment_id, run_name=f"{name} · {phase} {trial.round}", tags=tags)
        run_id = run.info.run_id
        params = flatten(mask_tree(trial.candidate.config(cfg).to_dict(), cfg.env_keys))
        items = [_param(k, v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=items[i : i + PARAMS_PER_BATCH])
        if trial.samples_per_s is not None:
            client.log_metric(run_id, THROUGHPUT_SAMPLES_PER_S, trial.samples_per_s, step=0)
        client.set_terminated(run_id, "FINISHED" if trial.samples_per_s is not None else "FAILED")


def _param(key: str, value: Any) -> Any:
    from mlflow.entities import Param

    return Param(key, str(value)[:6000])
