"""Sweeps that finish, every job recorded under one parent MLflow run.

    python -m pipeline -m loader.batch_size=32,64,128 loader.num_workers=0,2,4
    python -m pipeline -m hydra/launcher=parallel loader.batch_size=32,64 loader.num_workers=0,2   # 2 at a time
    python -m pipeline hparams_search=accuracy_optuna                                           # an Optuna search

Hydra runs the jobs (one after another, in joblib's processes, or as Optuna asks); this module keeps the books:

- ``SweepCallback.on_multirun_start`` (``hydra.callbacks.sweep`` in ``conf/config.yaml``) opens the parent run in
  the sweep's experiment and store, tagged ``sweep.role=parent``, and writes ``<hydra.sweep.dir>/sweep.json``: the
  sweep's id, the parent's run id, the swept keys and the metric the jobs return. A file, because joblib's jobs run
  in other processes.
- each job (``pipeline.__main__.run_sweep_job``) reads it back with ``current_job()``; ``train`` tags its run
  ``mlflow.parentRunId``, ``sweep.id``, ``sweep.job``, ``sweep.keys`` and names it after the swept values that its
  derived name does not show. How the job ended goes to ``<hydra.sweep.dir>/jobs/<n>.json``. A job that fails is
  recorded (``failed``: its run FAILED with the ``error`` tag, or a FAILED run made for it when it failed before it
  had one) and returns None, which Optuna takes as a failed trial, so the next job starts. Raising would not do:
  Hydra's sweepers re-raise a failed job's error once its batch is done, which ends the sweep without
  ``on_multirun_end``; ``sys.exit`` in a job ends the sweep at once (what a stop request does).
- ``on_multirun_end`` summarises the jobs on the parent (``summarize_sweep``: ``compare/compare.md``, ``.csv``,
  ``.png``), ends it FINISHED, or FAILED with the failed jobs in the tag ``sweep.failures``, prints one line per
  failed job and exits 2 when every failure was the user's to fix (``PipelineError``: bad data, a missing GPU...),
  else 1. A sweep that ends without it (a stop request, a sweeper that raised) is closed by ``end_unfinished``,
  which ``pipeline.__main__.main`` calls on its way out.
- a launcher that loses its worker processes (``hydra/launcher=parallel`` when one is killed: loky kills the others)
  records the batch with ``lost``: the jobs that had started (``started`` marks them) end FAILED, runs included,
  the others ``NOT_RUN``; then ``end_sweep`` closes the parent and the command exits 1
  (``hydra_plugins.pipeline_sweeper.parallel_launcher``).
"""

from __future__ import annotations

import logging
import math
import re
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.common.cli import bug_line, debugging
from pipeline.common.errors import ConfigError, PipelineError
from pipeline.common.messages import brief
from pipeline.common.metric_names import THROUGHPUT_SAMPLES_PER_S, VAL_ACC, VAL_PREFIX
from pipeline.common.secrets import env_values, mask_overrides, mask_text
from pipeline.config import as_typed
from pipeline.engine.outputs import make_output_folder
from pipeline.experiments.sweep_files import (
    JOBS_DIR,
    NOT_RUN,
    SWEEP_FILE,
    JobOutcome,
    Sweep,
    SweepJob,
    _save_outcome,
    load_outcomes,
    load_round,
    load_seed,
    planned_jobs,
    records_jobs,
    sweep_folder,
)
from pipeline.experiments.sweep_parent import close_parent, failed_run, open_parent, parent_links
from pipeline.parallel.slurm import check_slurm_commands
from pipeline.record.filesystems import check_slurm_store

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.engine.results import RunResult

log = logging.getLogger(__name__)

# what a job can return to the sweeper: its task's leading metric, a validation metric by name, or its speed
METRICS = ("primary", THROUGHPUT_SAMPLES_PER_S)
VALIDATION = re.compile(re.escape(VAL_PREFIX) + r"[\w.]+")  # val/<name>
USER_ERROR = 2  # exit status of a failure the user can fix (PipelineError), as for single runs
_UNFINISHED: set[Path] = set()  # folders of the sweeps started in this process and not yet ended (end_unfinished)


class SweepCallback(Callback):
    """Hydra callback (``hydra.callbacks.sweep``): a sweep's parent run, its summary and its exit status.

    Hydra turns an exception raised here into a warning, so what must stop the sweep exits instead: a store that
    cannot work or an unknown ``optimized_metric`` at the start (one line, status 2, no job started), and failed
    jobs at the end (the list, status 2 or 1).

    Args:
        optimized_metric: what each job returns to the sweeper: ``primary`` (the task's leading metric: val/acc,
            val/mae, val/f1, val/perplexity), a validation metric by name (``val/rmse``), or
            ``throughput/samples_per_s``.
    """

    def __init__(self, optimized_metric: str = "primary") -> None:
        self.optimized_metric = optimized_metric

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A single run: its output folder made first, in one line when it cannot be (Hydra's is a traceback)."""
        try:
            make_output_folder(config.hydra, "hydra.run.dir")
        except PipelineError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(USER_ERROR)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            sweep = start_sweep(config, metric=self.optimized_metric)
        except PipelineError as err:
            print(f"error: {err}; no job was started", file=sys.stderr, flush=True)
            sys.exit(USER_ERROR)
        where = f"parent MLflow run {sweep.parent_run_id}" if sweep.parent_run_id else "no parent run"
        log.info("sweep %s: %s; jobs return %s", sweep.short_id, where, sweep.metric)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        code = end_sweep(sweep_folder(config.hydra))
        if code:
            sys.exit(code)


def start_sweep(config: DictConfig, *, metric: str) -> Sweep:
    """Open the sweep's parent run (tracking on) and write ``sweep.json``, before the first job starts.

    Raises:
        ConfigError: ``metric`` is not one of ``METRICS``, the experiment's name comes from the environment, or the
            sweep's folder cannot be made.
        SlurmMissing: ``hydra/launcher=slurm`` where SLURM's commands are missing.
        SqliteUnderSlurm: ``hydra/launcher=slurm`` with an SQLite store (``pipeline.record.filesystems``).
        TrackingUnavailable: the store cannot work (``pipeline.record.reachability.check_reachable``).
    """
    if metric not in METRICS and not VALIDATION.fullmatch(metric):
        raise ConfigError(
            "hydra.callbacks.sweep.optimized_metric", metric, f"{_one_of(METRICS)} or a val/<name> metric"
        )
    launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    check_slurm_commands(launcher)
    if OmegaConf.select(config, "tracking.enabled"):
        check_slurm_store(launcher, str(config.tracking.uri))
    folder = make_output_folder(config.hydra, "hydra.sweep.dir")  # before the parent run: nothing left RUNNING
    specs = swept(config)
    sweep = Sweep(id=uuid.uuid4().hex, keys=tuple(specs), metric=metric)
    if OmegaConf.select(config, "tracking.enabled"):
        sweep = open_parent(config, sweep, specs)
    sweep.save(folder)
    _UNFINISHED.add(folder)
    return sweep


def swept(config: DictConfig) -> dict[str, str]:
    """The keys a sweep varies and how, as typed: the sweeper's own ``params`` (Optuna's search space) and the
    command line's sweeps (``a,b``, ``range()``, ``choice()``, ``glob()``, ``interval()``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    specs = {str(key).lstrip("+~"): str(value) for key, value in params.items()}  # +ladder: a group appended
    for override in OverridesParser.create().parse_overrides(list(config.hydra.overrides.task)):
        if override.is_sweep_override():
            specs[override.key_or_group] = override.input_line.partition("=")[2]
    return specs


def current_job() -> SweepJob:
    """The sweep job running in this process, from Hydra's job config and the sweep's ``sweep.json``."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    folder = sweep_folder(hydra)
    sweep = Sweep.load(folder)
    if sweep is None:  # the callback did not run (hydra.callbacks replaced): no parent, failures still listed
        log.warning("%s is missing: this job is recorded without its sweep's parent run", folder / SWEEP_FILE)
        sweep = Sweep(id="unknown", keys=(), metric=VAL_ACC)
    number = int(hydra.job.num)
    overrides = tuple(as_typed(str(o)) for o in hydra.overrides.task)  # model.width=2, not Hydra's ++model.width=2
    config = load_round(folder, number, "configs")
    return SweepJob(sweep, number, overrides, folder, load_round(folder, number), load_seed(folder), config)


def use_platform_start_method() -> None:
    """Give loader workers the platform's start method back inside a joblib job.

    joblib's loky workers make ``loky`` the default start method, and a DataLoader's workers started with it fail
    (``'Process' object has no attribute 'env'``): ``loader.num_workers > 0`` would fail in every parallel job.
    The platform's default is the first method ``get_all_start_methods`` lists (spawn on Windows and macOS), the
    one ``loader.multiprocessing_context=auto`` means; a named method is the DataLoader's own and needs nothing here.
    """
    import multiprocessing

    if multiprocessing.get_start_method(allow_none=True) == "loky":
        multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)  # the default


def finished(job: SweepJob, result: RunResult) -> float | None:
    """Record a job that trained; returns what the sweeper gets: the sweep's metric, None when it is not finite
    (Optuna fails a trial cleanly on None, but not on NaN)."""
    value = objective(result, job.sweep.metric)
    overrides = mask_overrides(job.overrides)
    _save_outcome(job, JobOutcome(job.number, overrides, "FINISHED", 0, None, result.run_id, result.run_name, value))
    return value


def objective(result: RunResult, metric: str) -> float | None:
    """The task's leading metric (``primary``), a ``val/...`` metric, or the steady-state samples/s of the last epoch
    (a DDP job's over all its ranks); None when not finite (or the run has no such metric)."""
    if metric == THROUGHPUT_SAMPLES_PER_S:
        value = result.epochs[-1].job_samples_per_s if result.epochs else math.nan
    else:
        value = result.metric(result.primary if metric == "primary" else metric)
    return value if math.isfinite(value) else None


def failed(job: SweepJob, err: BaseException, *, exit_code: int, cfg: RunConfig | None) -> None:
    """Record a job that failed, so that the sweep goes on: say so (one line; the traceback of a bug in the job's
    log only under ``--debug``), make sure the job has a FAILED run under the parent, write its outcome.

    Args:
        job: the failed job.
        err: what it raised.
        exit_code: 2 for the user's to fix (``PipelineError``), 1 for anything else.
        cfg: the job's validated config, or None when it did not validate.
    """
    secrets = _secret_values(cfg)
    error = brief(err, secrets=secrets, limit=5000)
    if exit_code == USER_ERROR:
        print(f"error: sweep {job.describe()}: {err}", file=sys.stderr, flush=True)
    else:
        log.error("sweep %s failed: %s", job.describe(), bug_line(err), exc_info=err if debugging() else None)
    if not records_jobs():
        return  # a DDP job (SLURM tasks_per_node > 1): rank 0 records it
    run_id, run_name = failed_run(job, cfg, error, secrets)
    overrides = mask_overrides(job.overrides)
    _save_outcome(job, JobOutcome(job.number, overrides, "FAILED", exit_code, error, run_id, run_name))


def started(job: SweepJob) -> None:
    """Mark the job as started (``jobs/<n>.started``): when a launcher loses its worker processes, a job with a
    marker and no outcome was lost while it ran, one without had not started (``lost``)."""
    if records_jobs():
        (job.folder / JOBS_DIR).mkdir(parents=True, exist_ok=True)
        (job.folder / JOBS_DIR / f"{job.number}.started").touch()


def lost(folder: Path, jobs: Sequence[tuple[int, Sequence[str]]], reason: str) -> None:
    """Record the jobs a launcher lost with its worker processes (a worker killed by a signal or the OOM killer;
    loky then kills every worker beside it): each job of ``jobs`` with no outcome yet ends FAILED with ``reason``
    (its run too, which nobody is left to end) when it had started, else ``NOT_RUN``.

    Args:
        folder: the sweep's folder.
        jobs: the launched jobs, as ``(job number, overrides)``.
        reason: one line saying what happened, the error recorded on each lost job's run.
    """
    sweep = Sweep.load(folder) or Sweep(id="unknown", keys=(), metric=VAL_ACC)
    ended = {outcome.job for outcome in load_outcomes(folder)}
    for number, overrides in jobs:
        if number in ended:
            continue
        job = SweepJob(sweep, number, tuple(overrides), folder)
        masked = mask_overrides(job.overrides)
        if (folder / JOBS_DIR / f"{number}.started").exists():
            error = mask_text(f"WorkerLost: {reason}")
            run_id, run_name = failed_run(job, None, error, frozenset())
            _save_outcome(job, JobOutcome(number, masked, "FAILED", 1, error, run_id, run_name))
        else:
            _save_outcome(job, JobOutcome(number, masked, NOT_RUN, 0, "not run: the sweep stopped before it"))


def not_started(folder: Path, jobs: Sequence[tuple[int, Sequence[str]]]) -> None:
    """Record as ``NOT_RUN`` each job of ``jobs`` that never started (no ``started`` marker, no outcome): the jobs
    after the one a stop request ended, or those a stopped launcher had not begun."""
    unstarted = [(n, o) for n, o in jobs if not (folder / JOBS_DIR / f"{n}.started").exists()]
    lost(folder, unstarted, "")  # none of them started: each is recorded NOT_RUN, none FAILED


def stopped(job: SweepJob, stop: BaseException, exit_code: int) -> None:
    """A stop request (SIGTERM, Ctrl-C): record the job. In-process and joblib sweeps end there (``end_unfinished``
    ends the parent KILLED on the way out); under submitit the other jobs run on and the parent ends KILLED after."""
    overrides = mask_overrides(job.overrides)
    _save_outcome(job, JobOutcome(job.number, overrides, "KILLED", exit_code, brief(stop)))


def end_sweep(folder: Path, *, complete: bool = True) -> int:
    """Summarise the sweep in ``folder`` on its parent run, end the parent, print the outcome.

    Args:
        folder: the sweep's folder.
        complete: False when the sweep ended before Hydra's ``on_multirun_end`` (``end_unfinished``).

    Returns:
        The multirun's exit status: 0, 2 when every failed job failed for a reason the user can fix, else 1.
    """
    _UNFINISHED.discard(folder)
    if not complete:  # the jobs the sweeper listed and nobody started are part of the record too
        not_started(folder, planned_jobs(folder))
    sweep = Sweep.load(folder) or Sweep(id="unknown", keys=(), metric=VAL_ACC)
    outcomes = load_outcomes(folder)
    not_run = [o for o in outcomes if o.status == NOT_RUN]
    failures = [o for o in outcomes if o.status not in ("FINISHED", NOT_RUN)]
    killed = [o for o in failures if o.status == "KILLED"]  # stopped on request: listed, but not as failed
    if any(o.status == "KILLED" for o in outcomes):
        status = "KILLED"
    else:
        status = "FAILED" if failures or not complete else "FINISHED"
    parent = sweep.parent_run_id and sweep.uri
    table = (
        close_parent(sweep, failures, status, complete=complete, not_run=not_run, design_seed=load_seed(folder))
        if parent
        else ""
    )
    how = "" if complete else "stopped before its end: "
    unstarted = (f", {len(killed)} stopped" if killed else "") + (f", {len(not_run)} not run" if not_run else "")
    print(
        f"sweep {sweep.short_id}: {how}{len(outcomes)} job(s), {len(outcomes) - len(failures) - len(not_run)} "
        f"finished, {len(failures) - len(killed)} failed{unstarted} ({folder})",
        flush=True,
    )
    if table:
        print(table, flush=True)
    if sweep.parent_run_id and sweep.uri:
        print("\n".join(parent_links(sweep, status)), flush=True)
    if not failures and not not_run:
        return 0
    if killed:
        parts = [f"{len(killed)} of {len(outcomes)} sweep job(s) stopped"]
        parts += [f"{len(failures) - len(killed)} failed"] if len(failures) > len(killed) else []
        parts += [f"{len(not_run)} did not run"] if not_run else []
        lines = [f"error: the sweep was stopped: {' and '.join(parts)}:"]
    elif not_run:
        lines = [f"error: {len(failures)} of {len(outcomes)} sweep job(s) failed and {len(not_run)} did not run:"]
    elif len(failures) == len(outcomes):
        lines = [f"error: all {len(failures)} sweep job(s) failed:"]
    else:
        lines = [f"error: {len(failures)} of {len(outcomes)} sweep job(s) failed; the others ran and are recorded:"]
    lines += [f"  {o.line()}" for o in failures]
    lines += [f"  not run: {', '.join(o.name() for o in not_run)}"] if not_run else []
    print("\n".join(lines), file=sys.stderr, flush=True)
    return USER_ERROR if failures and all(o.exit_code == USER_ERROR for o in failures) else 1


def end_unfinished() -> None:
    """End the sweeps of this process that Hydra left without ``on_multirun_end``: a stop request, or a sweeper
    that raised (Optuna's when no trial completed). Their parents end KILLED or FAILED, their failures are listed;
    ``pipeline.__main__.main`` calls this on its way out, and the exit status stays the one already on its way."""
    while _UNFINISHED:
        folder = _UNFINISHED.pop()
        try:
            end_sweep(folder, complete=False)
        except Exception as err:  # the error that ended the sweep is the one to see; this one is only logged
            log.warning("sweep in %s could not be closed (%s)", folder, brief(err))


def _secret_values(cfg: RunConfig | None) -> frozenset[str]:
    if cfg is None:
        return frozenset()

    try:
        return env_values(cfg)
    except ConfigError:  # an experiment named from the environment: the job's error already says so
        return frozenset()


def _one_of(options: Sequence[str]) -> str:
    return "one of " + ", ".join(repr(o) for o in options)
