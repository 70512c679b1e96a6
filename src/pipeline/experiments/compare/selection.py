"""Reading MLflow: which runs to compare (``select``), each in one ``search_runs`` query, and ``open_store``.
mlflow itself is imported only by ``open_store``; ``select`` works on any client it is given."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.common.uris import sqlite_path
from pipeline.experiments.compare.runs import PARENT, ROLE, ComparedRun, CompareError
from pipeline.record.reachability import check_reachable
from pipeline.record.store import retrying

MAX_RUNS = 50_000  # MLflow's largest max_results: one page, one query


@dataclass(frozen=True)
class Selection:
    runs: list[ComparedRun]  # in table order, sweep parents left out
    parent: ComparedRun | None  # the sweep's parent run (where --log attaches the files), when a sweep was selected
    note: str  # how the runs were chosen, in words

    @property
    def objective(self) -> str | None:
        """What the sweep searched for, when it was a search (Optuna): its rows are ranked by it."""
        return search_objective(self.parent.tags if self.parent else {})


def search_objective(parent_tags: Any) -> str | None:
    """The metric a search maximised (a sweep's ``sweep.optimized_metric``), None for a grid sweep: a grid's
    jobs all return a metric too, but its rows keep their order."""
    if parent_tags.get("sweep.sweeper") in (None, "basic", "interleaved"):
        return None
    return parent_tags.get("sweep.optimized_metric")


def select(
    client: Any,
    experiment: str = "pipeline",
    *,
    sweep: str = "latest",
    run_ids: Sequence[str] | None = None,
    last: int | None = None,
) -> Selection:
    """The runs to compare, in one ``search_runs`` query (plus one to find the latest sweep).

    Args:
        experiment: the experiment's name (ignored with ``run_ids``: run ids are unique across experiments).
        sweep: ``latest`` (the newest run tagged ``sweep.role=parent`` and its sweep; without one, every run of
            the experiment) or a ``sweep.id``.
        run_ids: these runs, in this order, instead of a sweep.
        last: the newest ``last`` runs of the experiment, oldest first, instead of a sweep.

    Raises:
        CompareError: no such experiment or sweep, or no run to compare.
    """
    if run_ids:
        return _by_ids(client, run_ids)
    found = client.get_experiment_by_name(experiment)
    if found is None or found.lifecycle_stage == "deleted":
        names = sorted(e.name for e in client.search_experiments())
        raise CompareError(f"no experiment {experiment!r}; there are: {', '.join(names) or 'none'} (--experiment NAME)")
    ids = [found.experiment_id]
    if last is not None:
        # Sweep parents are skipped; each starts before its first job, so the newest 2N runs hold N others
        # (+10 for sweeps whose first job has not started yet).
        newest = _search(client, ids, order_by=["attributes.start_time DESC"], max_results=min(MAX_RUNS, 2 * last + 10))
        runs = [r for r in newest if not r.is_parent][:last][::-1]
        return _selection(runs, None, f"the newest runs of experiment {experiment!r}", experiment)
    parent = None
    if sweep == "latest":
        parents = _search(client, ids, f"tags.`{ROLE}` = '{PARENT}'", ["attributes.start_time DESC"], max_results=1)
        if not parents:
            runs = _search(client, ids, order_by=["attributes.start_time ASC"])
            note = f"no sweep in experiment {experiment!r} (no run tagged {ROLE}={PARENT}): all its runs"
            return _selection(runs, None, note, experiment)
        parent = parents[0]
        sweep = parent.tags.get("sweep.id", "")
    _check_literal("--sweep", sweep)
    if not sweep:  # a parent without an id (made by hand): its children
        runs = _search(client, ids, f"tags.`mlflow.parentRunId` = '{parent.id if parent else ''}'")
    else:  # the id as printed (its first 8 characters) or whole: one query finds every run of the sweep
        runs = _search(client, ids, f"tags.`sweep.id` LIKE '{sweep}%'")
        found = sorted({r.tags.get("sweep.id", "") for r in runs})
        if len(found) > 1:
            if sweep in found:
                runs = [r for r in runs if r.tags.get("sweep.id") == sweep]
            else:
                shown = ", ".join(f[:12] for f in found[:5])
                raise CompareError(f"--sweep {sweep}: {len(found)} sweeps start so ({shown}); give more characters")
        sweep = found[0] if len(found) == 1 else sweep
    parent = next((r for r in runs if r.is_parent), parent)
    if not runs:
        raise CompareError(f"no sweep {sweep!r} in experiment {experiment!r} (no run tagged sweep.id={sweep}...)")
    runs.sort(key=lambda r: (r.config_number, r.job, r.start_time))  # rows in the order typed, then launched
    return _selection(runs, parent, f"sweep {sweep[:8]}", experiment)


def _by_ids(client: Any, run_ids: Sequence[str]) -> Selection:
    wanted = list(dict.fromkeys(run_ids))
    for run_id in wanted:
        _check_literal("--runs", run_id)
    experiments = [e.experiment_id for e in client.search_experiments(max_results=MAX_RUNS)]
    quoted = ", ".join(f"'{r}'" for r in wanted)
    found = {r.id: r for r in _search(client, experiments, f"attributes.run_id IN ({quoted})")}
    missing = [r for r in wanted if r not in found]
    if not found:
        raise CompareError(f"none of the runs {', '.join(wanted)} is in the store")
    runs = [found[r] for r in wanted if r in found]
    parents = [r for r in runs if r.is_parent]
    note = "runs given by id" + (f" (not found: {', '.join(missing)})" if missing else "")
    return _selection(runs, parents[0] if len(parents) == 1 else None, note, "")


def _selection(runs: list[ComparedRun], parent: ComparedRun | None, note: str, experiment: str) -> Selection:
    kept = [r for r in runs if not r.is_parent]
    if not kept:
        where = f" in experiment {experiment!r}" if experiment else ""
        raise CompareError(f"no runs to compare{where} ({note}); train some, or choose with --runs or --last N")
    if len(runs) >= MAX_RUNS:
        note += f"; only the first {MAX_RUNS:,} (MLflow's limit for one query)"
    return Selection(kept, parent, note)


def _search(
    client: Any,
    experiment_ids: list[str],
    filter_string: str = "",
    order_by: list[str] | None = None,
    *,
    max_results: int = MAX_RUNS,
) -> list[ComparedRun]:
    """One ``search_runs`` page (retried while SQLite is locked by a run writing), as ``ComparedRun``s."""
    page = retrying(
        lambda: client.search_runs(experiment_ids, filter_string, max_results=max_results, order_by=order_by),
        what="reading runs",
    )
    return [ComparedRun.from_run(run) for run in page]


def _check_literal(option: str, value: str) -> None:
    if any(c in value for c in "'\\%_"):  # it goes into a filter string between single quotes, or a LIKE
        raise CompareError(f"{option} {value!r}: quotes, backslashes, % and _ are not allowed")


def open_store(uri: str) -> Any:
    """An ``MlflowClient`` on an existing store (a missing SQLite file is not created).

    Raises:
        CompareError: no database at a ``sqlite:///`` path.
        TrackingUnavailable: the store cannot be reached (``pipeline.record.reachability.check_reachable``).
    """
    path = sqlite_path(uri)
    if path is not None and not path.is_file():
        raise CompareError(f"no MLflow store at {path}: run this where you trained, or pass --uri sqlite:///PATH")
    check_reachable(uri)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)
