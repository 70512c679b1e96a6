"""A sweep's parent MLflow run: opened in the sweep's experiment and store (``open_parent``, tagged
``sweep.role=parent``), given the compare table of its jobs at the end (``summarize_sweep``: ``compare/compare.md``,
``.csv``, ``.png``, ``.txt`` and the description; each job's run tagged with its row and verdict) and closed
FINISHED, or FAILED with its failed jobs (``close_parent``); a job that failed before it had a run gets a FAILED one
(``failed_run``), named like the run it would have had.
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from omegaconf import DictConfig

from pipeline.common.errors import ConfigError
from pipeline.common.messages import best_effort
from pipeline.common.secrets import env_keys, mask_overrides, mask_text
from pipeline.common.uris import absolute, run_page, ui_base
from pipeline.config import as_typed
from pipeline.experiments.sweep_files import (
    JobOutcome,
    Sweep,
    SweepJob,
    sweep_folder,
)
from pipeline.record.reachability import check_reachable
from pipeline.record.runs import create_run
from pipeline.record.store import connect, retrying

if TYPE_CHECKING:
    from pipeline.config import RunConfig

log = logging.getLogger(__name__)


MAX_CHILDREN = 50_000  # MLflow's most runs per search


def open_parent(config: DictConfig, sweep: Sweep, specs: dict[str, str]) -> Sweep:
    """Create the parent run named ``sweep-<short id>: <what is swept>``; ``sweep`` with its id and store.

    A store that cannot work raises (nothing has started); an MLflow error creating the run is a warning, and the
    jobs are recorded without a parent.
    """
    # lazy: engine.provenance imports torch (~1.4 s); every `python -m pipeline` imports this module (end_unfinished)
    from pipeline.engine.building.provenance import source_tags

    experiment = str(config.tracking.experiment)
    if "tracking.experiment" in env_keys(config):  # as open_tracker refuses it for each job
        raise ConfigError("tracking.experiment", "***", "a name written out, not read from an environment variable")
    uri = absolute(str(config.tracking.uri))
    check_reachable(uri)
    shown = mask_overrides(f"{key}={spec}" for key, spec in specs.items())
    name = f"sweep-{sweep.short_id}: {' '.join(shown) or 'no swept keys'}"
    choices = config.hydra.runtime.choices
    tags = {
        **source_tags(),
        "sweep.id": sweep.id,
        "sweep.role": "parent",  # how pipeline.experiments.compare tells the parent from the jobs, which share sweep.id
        "sweep.keys": ",".join(sweep.keys),
        "sweep.command": "python -m pipeline " + shlex.join(mask_overrides(map(as_typed, sys.argv[1:]))),
        "sweep.launcher": str(choices.get("hydra/launcher")),
        "sweep.sweeper": str(choices.get("hydra/sweeper")),
        "sweep.optimized_metric": sweep.metric,
        "sweep.folder": str(sweep_folder(config.hydra)),
    }
    # the jobs can still run and be recorded, only not nested
    with best_effort(
        f"the sweep's parent run could not be created in {mask_text(uri)}, its jobs are recorded without one", log
    ) as attempt:
        client, experiment_id = connect(uri, experiment)
        run = create_run(client, experiment_id, run_name=mask_text(name)[:250], tags=tags)  # once, answer lost or not
    if attempt.failed:
        return sweep
    return replace(sweep, parent_run_id=run.info.run_id, uri=uri, experiment_id=experiment_id)


def parent_links(sweep: Sweep, status: str) -> list[str]:
    """Where the parent run is and how to open it, as a single run's summary says it (``Tracker.describe``)."""
    server = urlparse(sweep.uri or "").scheme in ("http", "https")
    base = ui_base(sweep.uri or "")
    lines = [f"  MLflow parent run {sweep.parent_run_id} ({status}) in {mask_text(sweep.uri or '')}"]
    if not server:
        lines.append(f"    open the UI:  mlflow ui --backend-store-uri {sweep.uri}")
    lines.append(f"    this sweep:   {base}/{run_page(sweep.experiment_id, sweep.parent_run_id)}")
    return lines


def close_parent(
    sweep: Sweep,
    failures: Sequence[JobOutcome],
    status: str,
    *,
    complete: bool = True,
    not_run: Sequence[JobOutcome] = (),
    design_seed: int | None = None,
) -> str:
    """Log the summary on the parent and end it with ``status``, the failures listed in a tag; returns the
    summary as a terminal shows it ("" when it could not be made: the parent still ends)."""
    from mlflow import MlflowClient

    client = MlflowClient(sweep.uri)
    where = f"tags.`mlflow.parentRunId` = '{sweep.parent_run_id}'"
    table = ""
    with best_effort("the sweep's summary could not be logged", log):  # the parent must not stay RUNNING
        children = retrying(
            lambda: client.search_runs([sweep.experiment_id], where, max_results=MAX_CHILDREN), what="reading runs"
        )
        children = sorted(children, key=_typed_order)
        table = summarize_sweep(client, sweep.parent_run_id, children, sweep=sweep)
    tags = {"sweep.failed": str(len(failures))}
    if design_seed is not None:  # the seed of the rounds' order: known once the sweeper listed the jobs
        tags["sweep.design_seed"] = str(design_seed)
    if failures:
        tags["sweep.failures"] = "\n".join(o.line() for o in failures)[:5000]
    if not_run:
        tags["sweep.not_run"] = str(len(not_run))
        tags["sweep.not_run_jobs"] = "\n".join(o.name() for o in not_run)[:5000]
    if not complete:
        tags["sweep.incomplete"] = "the sweep stopped before its end: a stop request, or the sweeper's error"
    _end_parent(sweep, status, tags)
    return table


def summarize_sweep(client: Any, parent_run_id: str, child_runs: Sequence[Any], *, sweep: Sweep | None = None) -> str:
    """Log the sweep's comparison (``pipeline.experiments.compare``: Markdown, CSV, a chart, the terminal's view) on
    its parent run, the table as the run's description (with links relative to the UI's page), and each child's row
    and verdict as its tags (``compare.tag_runs``). Returns the terminal's view with a line on the tags (printed at
    the end of the sweep). A search's rows are ranked by what it searched for."""
    # lazy: compare's 19 modules (~0.05 s); every python -m pipeline, --help too, imports this one (end_unfinished)
    from pipeline.experiments import compare

    parent = client.get_run(parent_run_id)
    note = f"sweep {sweep.short_id}" if sweep else ""
    rank_by = compare.search_objective(parent.data.tags)
    result = compare.report(client, list(child_runs), note=note, rank_by=rank_by)
    compare.attach(client, parent_run_id, result)
    client.set_tag(parent_run_id, "mlflow.note.content", result.note.rstrip("\n"))
    return result.terminal + compare.tag_runs(client, result.table).line() + "\n"


def _end_parent(sweep: Sweep, status: str, tags: dict[str, str]) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import RunTag

    client = MlflowClient(sweep.uri)
    # the exit status and the failures printed still tell the user
    unended = (
        f"the sweep's parent run {sweep.parent_run_id} could not be ended {status}, python -m pipeline.stale finds it"
    )
    with best_effort(unended, log):
        retrying(lambda: client.log_batch(sweep.parent_run_id, tags=[RunTag(k, v) for k, v in tags.items()]))
        retrying(lambda: client.set_terminated(sweep.parent_run_id, status))


def failed_run(
    job: SweepJob, cfg: RunConfig | None, error: str, secrets: frozenset[str]
) -> tuple[str | None, str | None]:
    """The FAILED run of a failed job: the one ``train`` opened (``open_tracker`` ended it with the error), else
    one made now, so that the parent holds every job. ``(None, None)`` with no parent or no store to write to."""
    sweep = job.sweep
    if not (sweep.parent_run_id and sweep.uri and sweep.experiment_id):
        return None, None
    from mlflow import MlflowClient

    client = MlflowClient(sweep.uri)
    # the outcome file and the list at the end still record the failure
    with best_effort(f"sweep {job.describe()}: its failure could not be recorded in MLflow", log, secrets=secrets):
        where = f"tags.`sweep.id` = '{sweep.id}' and tags.`sweep.job` = '{job.number}'"
        found = retrying(lambda: client.search_runs([sweep.experiment_id], where), what="reading runs")
        if found:
            run = found[0]
            if run.info.status == "RUNNING":  # its process died (``lost``): nobody else will end it
                retrying(lambda: client.set_tag(run.info.run_id, "error", error))
                retrying(lambda: client.set_terminated(run.info.run_id, "FAILED"))
            return run.info.run_id, run.info.run_name
        name = mask_text(job_run_name(job, cfg), secrets)
        tags = {
            **job.tags(),
            "error": error,
            "overrides": shlex.join(mask_overrides(job.overrides)) or "(none)",
        }
        run = create_run(client, sweep.experiment_id, run_name=name, tags=tags)
        retrying(lambda: client.set_terminated(run.info.run_id, "FAILED"))
        return run.info.run_id, name
    return None, None


def job_run_name(job: SweepJob, cfg: RunConfig | None) -> str:
    """The name a job that failed before its run existed gets: the derived one, with the device as asked."""
    if cfg is None:
        return f"sweep-{job.sweep.short_id}-job{job.number}"
    from pipeline.engine.building.provenance import (  # lazy: torch (~1.4 s), as above
        run_name,
        sweep_run_name,
        with_overrides,
    )

    precision = ("amp" if cfg.precision.dtype == "auto" else cfg.precision.dtype) if cfg.amp else "fp32"
    name = sweep_run_name(run_name(cfg, device_type=cfg.device.name, precision=precision), job.values)
    return with_overrides(name, mask_overrides(job.overrides, cfg.env_keys), list(job.values))


def _typed_order(run: Any) -> tuple[int, int]:
    """A child's place in the table: its configuration in the order typed (``sweep.config``; rounds run them in a
    random order), then its job number."""
    tags = run.data.tags
    return int(tags.get("sweep.config", "-1")), int(tags.get("sweep.job", "-1"))
