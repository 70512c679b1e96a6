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

import json
import logging
import math
import os
import shlex
import sys
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args
from urllib.parse import urlparse

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.common.atomic import write_text_atomic
from pipeline.common.cli import bug_line, debugging
from pipeline.common.errors import ConfigError, PipelineError
from pipeline.common.secrets import mask_overrides, mask_text
from pipeline.common.uris import ui_base

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.report.summary import RunResult

log = logging.getLogger(__name__)

Metric = Literal["val/acc", "throughput/samples_per_s"]  # what a job can return to the sweeper
SWEEP_FILE = "sweep.json"  # in hydra.sweep.dir
DESIGN_FILE = (
    "design.json"  # in hydra.sweep.dir: each job's round, from the interleaved sweeper (pipeline.config.design)
)
JOBS_DIR = "jobs"  # in hydra.sweep.dir: <job number>.json, one per job that ended
STOP_FILE = "stop"  # in JOBS_DIR: the parallel launcher was stopped (request_stop); queued jobs do not start
MAX_CHILDREN = 50_000  # MLflow's most runs per search
NOT_RUN = "NOT_RUN"  # a job's status when the sweep stopped before it started (``lost``)
USER_ERROR = 2  # exit status of a failure the user can fix (PipelineError), as for single runs
_UNFINISHED: set[Path] = set()  # folders of the sweeps started in this process and not yet ended (end_unfinished)


@dataclass(frozen=True)
class Sweep:
    """What every job of a sweep needs to know: ``sweep.json`` in the sweep's folder."""

    id: str  # uuid4 hex; the parent run's name shows the first 8 characters
    keys: tuple[str, ...]  # the swept keys (dotted, or a group's name), in the order given
    metric: str  # what each job returns to the sweeper (a ``Metric``)
    parent_run_id: str | None = None  # None with tracking off, or when the parent could not be created
    uri: str | None = None  # the parent's store, absolute
    experiment_id: str | None = None

    @property
    def short_id(self) -> str:
        return self.id[:8]

    def save(self, folder: Path) -> None:
        _write_json(folder / SWEEP_FILE, asdict(self))

    @classmethod
    def load(cls, folder: Path) -> Sweep | None:
        path = folder / SWEEP_FILE
        if not path.is_file():
            return None
        fields = json.loads(path.read_text())
        return cls(**{**fields, "keys": tuple(fields["keys"])})


@dataclass(frozen=True)
class SweepJob:
    """One job of a sweep, as the job itself sees it (``current_job``)."""

    sweep: Sweep
    number: int  # Hydra's job number (hydra.job.num), from 0
    overrides: tuple[str, ...]  # the job's overrides, as Hydra passed them
    folder: Path  # the sweep's folder (hydra.sweep.dir)
    round: int | None = None  # the round of an interleaved sweep (pipeline.config.design), None without repeats

    @property
    def values(self) -> dict[str, str]:
        """The swept keys' values in this job, as typed: ``{"loader.batch_size": "32", "trainer.lr": "0.01"}``."""
        given = {}
        for override in self.overrides:
            key, _, value = override.partition("=")
            given[key.lstrip("+~")] = value
        return {key: given[key] for key in self.sweep.keys if key in given}

    def tags(self) -> dict[str, str]:
        """The job's run's sweep tags; ``mlflow.parentRunId`` nests it under the parent in MLflow's UI."""
        tags = {"sweep.id": self.sweep.id, "sweep.job": str(self.number), "sweep.keys": ",".join(self.sweep.keys)}
        if self.round is not None:  # runs of one round ran side by side: pipeline.experiments.compare pairs them
            tags["sweep.round"] = str(self.round)
        if self.sweep.parent_run_id:
            tags["mlflow.parentRunId"] = self.sweep.parent_run_id
        return tags

    def describe(self) -> str:
        """``job #3 (loader.batch_size=128 loader.num_workers=4)`` (Hydra's number, as in its log), secrets masked."""
        return f"job #{self.number} ({' '.join(mask_overrides(self.overrides)) or 'no overrides'})"


@dataclass(frozen=True)
class JobOutcome:
    """How one job ended: ``jobs/<n>.json`` in the sweep's folder."""

    job: int
    overrides: list[str]  # masked
    status: str  # FINISHED | FAILED | KILLED | NOT_RUN
    exit_code: int  # 0; 2 = the user's to fix; 1 = anything else; 130 / 143 = stopped
    error: str | None = None  # ``Type: message``, masked
    run_id: str | None = None
    run_name: str | None = None
    value: float | None = None  # what the job returned to the sweeper

    def line(self) -> str:
        """One line for the terminal: ``job #3 (trainer.lr=1e30): NonFiniteLoss: ...``."""
        error = next(iter((self.error or "").strip().splitlines()), self.status)
        return f"{self.name()}: {error}"

    def name(self) -> str:
        """``job #3 (trainer.lr=1e30)``."""
        return f"job #{self.job} ({' '.join(self.overrides) or 'no overrides'})"


class SweepCallback(Callback):
    """Hydra callback (``hydra.callbacks.sweep``): a sweep's parent run, its summary and its exit status.

    Hydra turns an exception raised here into a warning, so what must stop the sweep exits instead: a store that
    cannot work or an unknown ``optimized_metric`` at the start (one line, status 2, no job started), and failed
    jobs at the end (the list, status 2 or 1).

    Args:
        optimized_metric: what each job returns to the sweeper (``val/acc`` or ``throughput/samples_per_s``).
    """

    def __init__(self, optimized_metric: str = "val/acc") -> None:
        self.optimized_metric = optimized_metric

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A single run: its output folder made first, in one line when it cannot be (Hydra's is a traceback)."""
        from pipeline.engine.outputs import make_output_folder

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
        ConfigError: ``metric`` is not a ``Metric``, the experiment's name comes from the environment, or the
            sweep's folder cannot be made.
        SlurmMissing: ``hydra/launcher=slurm`` where SLURM's commands are missing.
        SqliteUnderSlurm: ``hydra/launcher=slurm`` with an SQLite store (``pipeline.record.filesystems``).
        TrackingUnavailable: the store cannot work (``pipeline.record.reachability.check_reachable``).
    """
    from pipeline.engine.outputs import make_output_folder
    from pipeline.parallel.slurm import check_slurm_commands
    from pipeline.record.filesystems import check_slurm_store

    if metric not in get_args(Metric):
        raise ConfigError("hydra.callbacks.sweep.optimized_metric", metric, _one_of(get_args(Metric)))
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


def sweep_folder(hydra: DictConfig) -> Path:
    """The sweep's folder (``hydra.sweep.dir``), absolute: a job run with ``hydra.job.chdir=true`` is elsewhere."""
    return Path(str(hydra.runtime.cwd), str(hydra.sweep.dir))


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


def open_parent(config: DictConfig, sweep: Sweep, specs: dict[str, str]) -> Sweep:
    """Create the parent run named ``sweep-<short id>: <what is swept>``; ``sweep`` with its id and store.

    A store that cannot work raises (nothing has started); an MLflow error creating the run is a warning, and the
    jobs are recorded without a parent.
    """
    from pipeline.common.secrets import env_keys
    from pipeline.common.uris import absolute
    from pipeline.engine.provenance import source_tags  # imports torch: only here, once per sweep
    from pipeline.record.reachability import check_reachable
    from pipeline.record.runs import create_run
    from pipeline.record.store import connect

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
        "sweep.command": "python -m pipeline " + shlex.join(mask_overrides(sys.argv[1:])),
        "sweep.launcher": str(choices.get("hydra/launcher")),
        "sweep.sweeper": str(choices.get("hydra/sweeper")),
        "sweep.optimized_metric": sweep.metric,
        "sweep.folder": str(sweep_folder(config.hydra)),
    }
    try:
        client, experiment_id = connect(uri, experiment)
        run = create_run(client, experiment_id, run_name=mask_text(name)[:250], tags=tags)  # once, answer lost or not
    except Exception as err:  # the jobs can still run and be recorded, only not nested
        log.warning(
            "the sweep's parent run could not be created in %s (%s: %s); its jobs are recorded without one",
            mask_text(uri),
            type(err).__name__,
            mask_text(str(err))[:300],
        )
        return sweep
    return replace(sweep, parent_run_id=run.info.run_id, uri=uri, experiment_id=experiment_id)


def current_job() -> SweepJob:
    """The sweep job running in this process, from Hydra's job config and the sweep's ``sweep.json``."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    folder = sweep_folder(hydra)
    sweep = Sweep.load(folder)
    if sweep is None:  # the callback did not run (hydra.callbacks replaced): no parent, failures still listed
        log.warning("%s is missing: this job is recorded without its sweep's parent run", folder / SWEEP_FILE)
        sweep = Sweep(id="unknown", keys=(), metric="val/acc")
    number = int(hydra.job.num)
    return SweepJob(sweep, number, tuple(str(o) for o in hydra.overrides.task), folder, load_round(folder, number))


def save_design(folder: Path, rounds: Sequence[int | None], jobs: Sequence[Sequence[str]] = ()) -> None:
    """Write each job's round (``pipeline.config.design.Plan.rounds``, by job number) to ``design.json``, and each job's
    overrides (masked): a sweep stopped before its end lists the jobs it never started (``end_sweep``)."""
    _write_json(folder / DESIGN_FILE, {"rounds": list(rounds), "jobs": [mask_overrides(job) for job in jobs]})


def planned_jobs(folder: Path) -> list[tuple[int, list[str]]]:
    """Every job the sweeper listed, as ``(job number, overrides)``, from ``design.json``; [] when there is none
    (a sweeper that decides its jobs as it goes: Optuna)."""
    path = folder / DESIGN_FILE
    if not path.is_file():
        return []
    return list(enumerate(json.loads(path.read_text()).get("jobs", [])))


def load_round(folder: Path, job: int) -> int | None:
    """The round job ``job`` runs in, from ``design.json``; None when there is none (another sweeper)."""
    path = folder / DESIGN_FILE
    if not path.is_file():
        return None
    rounds = json.loads(path.read_text())["rounds"]
    return rounds[job] if 0 <= job < len(rounds) else None


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
    """``val/acc`` or the steady-state samples/s of the last epoch (a DDP job's over all its ranks), None when not
    finite."""
    if metric == "throughput/samples_per_s":
        value = result.epochs[-1].job_samples_per_s if result.epochs else math.nan
    else:
        value = result.val_acc
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
    error = mask_text(f"{type(err).__name__}: {err}", secrets)[:5000]
    if exit_code == USER_ERROR:
        print(f"error: sweep {job.describe()}: {err}", file=sys.stderr, flush=True)
    else:
        log.error("sweep %s failed: %s", job.describe(), bug_line(err), exc_info=err if debugging() else None)
    if not _rank_0():
        return  # a DDP job (SLURM tasks_per_node > 1): rank 0 records it
    run_id, run_name = _failed_run(job, cfg, error, secrets)
    overrides = mask_overrides(job.overrides)
    _save_outcome(job, JobOutcome(job.number, overrides, "FAILED", exit_code, error, run_id, run_name))


def started(job: SweepJob) -> None:
    """Mark the job as started (``jobs/<n>.started``): when a launcher loses its worker processes, a job with a
    marker and no outcome was lost while it ran, one without had not started (``lost``)."""
    if _rank_0():
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
    sweep = Sweep.load(folder) or Sweep(id="unknown", keys=(), metric="val/acc")
    ended = {outcome.job for outcome in load_outcomes(folder)}
    for number, overrides in jobs:
        if number in ended:
            continue
        job = SweepJob(sweep, number, tuple(overrides), folder)
        masked = mask_overrides(job.overrides)
        if (folder / JOBS_DIR / f"{number}.started").exists():
            error = mask_text(f"WorkerLost: {reason}")
            run_id, run_name = _failed_run(job, None, error, frozenset())
            _save_outcome(job, JobOutcome(number, masked, "FAILED", 1, error, run_id, run_name))
        else:
            _save_outcome(job, JobOutcome(number, masked, NOT_RUN, 0, "not run: the sweep stopped before it"))


def not_started(folder: Path, jobs: Sequence[tuple[int, Sequence[str]]]) -> None:
    """Record as ``NOT_RUN`` each job of ``jobs`` that never started (no ``started`` marker, no outcome): the jobs
    after the one a stop request ended, or those a stopped launcher had not begun."""
    unstarted = [(n, o) for n, o in jobs if not (folder / JOBS_DIR / f"{n}.started").exists()]
    lost(folder, unstarted, "")  # none of them started: each is recorded NOT_RUN, none FAILED


def request_stop(folder: Path, signum: int) -> None:
    """Mark the sweep as stopping (``jobs/stop``), before its workers get the signal: a job a worker takes from
    its queue after that is recorded ``NOT_RUN`` and not started (``stop_requested``)."""
    (folder / JOBS_DIR).mkdir(parents=True, exist_ok=True)
    (folder / JOBS_DIR / STOP_FILE).write_text(f"{signum}\n")


def stop_requested(folder: Path) -> bool:
    """Whether the sweep's launcher was asked to stop (``request_stop``)."""
    return (folder / JOBS_DIR / STOP_FILE).exists()


def stopped(job: SweepJob, stop: BaseException, exit_code: int) -> None:
    """A stop request (SIGTERM, Ctrl-C): record the job. In-process and joblib sweeps end there (``end_unfinished``
    ends the parent KILLED on the way out); under submitit the other jobs run on and the parent ends KILLED after."""
    overrides = mask_overrides(job.overrides)
    _save_outcome(job, JobOutcome(job.number, overrides, "KILLED", exit_code, f"{type(stop).__name__}: {stop}"))


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
    sweep = Sweep.load(folder) or Sweep(id="unknown", keys=(), metric="val/acc")
    outcomes = load_outcomes(folder)
    not_run = [o for o in outcomes if o.status == NOT_RUN]
    failures = [o for o in outcomes if o.status not in ("FINISHED", NOT_RUN)]
    killed = [o for o in failures if o.status == "KILLED"]  # stopped on request: listed, but not as failed
    if any(o.status == "KILLED" for o in outcomes):
        status = "KILLED"
    else:
        status = "FAILED" if failures or not complete else "FINISHED"
    parent = sweep.parent_run_id and sweep.uri
    table = close_parent(sweep, failures, status, complete=complete, not_run=not_run) if parent else ""
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
        print("\n".join(_parent_links(sweep, status)), flush=True)
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
            log.warning("sweep in %s could not be closed (%s: %s)", folder, type(err).__name__, mask_text(str(err)))


def _parent_links(sweep: Sweep, status: str) -> list[str]:
    """Where the parent run is and how to open it, as a single run's summary says it (``Tracker.describe``)."""
    server = urlparse(sweep.uri or "").scheme in ("http", "https")
    base = ui_base(sweep.uri or "")
    lines = [f"  MLflow parent run {sweep.parent_run_id} ({status}) in {mask_text(sweep.uri or '')}"]
    if not server:
        lines.append(f"    open the UI:  mlflow ui --backend-store-uri {sweep.uri}")
    lines.append(f"    this sweep:   {base}/#/experiments/{sweep.experiment_id}/runs/{sweep.parent_run_id}")
    return lines


def load_outcomes(folder: Path) -> list[JobOutcome]:
    """The outcomes the jobs wrote, by job number."""
    paths = sorted((folder / JOBS_DIR).glob("*.json"), key=lambda p: int(p.stem))
    return [JobOutcome(**json.loads(p.read_text())) for p in paths]


def close_parent(
    sweep: Sweep,
    failures: Sequence[JobOutcome],
    status: str,
    *,
    complete: bool = True,
    not_run: Sequence[JobOutcome] = (),
) -> str:
    """Log the summary on the parent and end it with ``status``, the failures listed in a tag; returns the
    summary's Markdown ("" when it could not be made: the parent still ends)."""
    from mlflow import MlflowClient

    from pipeline.record.store import retrying

    client = MlflowClient(sweep.uri)
    where = f"tags.`mlflow.parentRunId` = '{sweep.parent_run_id}'"
    table = ""
    try:
        children = retrying(
            lambda: client.search_runs([sweep.experiment_id], where, max_results=MAX_CHILDREN), what="reading runs"
        )
        children = sorted(children, key=lambda run: int(run.data.tags.get("sweep.job", "-1")))
        table = summarize_sweep(client, sweep.parent_run_id, children, sweep=sweep)
    except Exception as err:  # a summary that cannot be made must not leave the parent RUNNING
        log.warning("the sweep's summary could not be logged (%s: %s)", type(err).__name__, mask_text(str(err))[:300])
    tags = {"sweep.failed": str(len(failures))}
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
    """Log the sweep's comparison (``pipeline.experiments.compare``: Markdown, CSV, a chart) on its parent run, and the
    table as the run's description (with links relative to the UI's page). Returns the Markdown (printed at the
    end of the sweep). A search's rows are ranked by what it searched for."""
    from pipeline.experiments import compare

    parent = client.get_run(parent_run_id)
    note = f"sweep {sweep.short_id}" if sweep else ""
    rank_by = compare.search_objective(parent.data.tags)
    result = compare.report(client, list(child_runs), note=note, rank_by=rank_by)
    compare.attach(client, parent_run_id, result)
    client.set_tag(parent_run_id, "mlflow.note.content", result.note.rstrip("\n"))
    return result.markdown


def _end_parent(sweep: Sweep, status: str, tags: dict[str, str]) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import RunTag

    from pipeline.record.store import retrying

    client = MlflowClient(sweep.uri)
    try:
        retrying(lambda: client.log_batch(sweep.parent_run_id, tags=[RunTag(k, v) for k, v in tags.items()]))
        retrying(lambda: client.set_terminated(sweep.parent_run_id, status))
    except Exception as err:  # the exit status and the failures printed still tell the user
        log.warning(
            "the sweep's parent run %s could not be ended %s (%s: %s); python -m pipeline.stale finds it",
            sweep.parent_run_id,
            status,
            type(err).__name__,
            mask_text(str(err))[:300],
        )


def _failed_run(
    job: SweepJob, cfg: RunConfig | None, error: str, secrets: frozenset[str]
) -> tuple[str | None, str | None]:
    """The FAILED run of a failed job: the one ``train`` opened (``open_tracker`` ended it with the error), else
    one made now, so that the parent holds every job. ``(None, None)`` with no parent or no store to write to."""
    sweep = job.sweep
    if not (sweep.parent_run_id and sweep.uri and sweep.experiment_id):
        return None, None
    from mlflow import MlflowClient

    from pipeline.record.runs import create_run
    from pipeline.record.store import retrying

    client = MlflowClient(sweep.uri)
    try:
        where = f"tags.`sweep.id` = '{sweep.id}' and tags.`sweep.job` = '{job.number}'"
        found = retrying(lambda: client.search_runs([sweep.experiment_id], where), what="reading runs")
        if found:
            run = found[0]
            if run.info.status == "RUNNING":  # its process died (``lost``): nobody else will end it
                retrying(lambda: client.set_tag(run.info.run_id, "error", error))
                retrying(lambda: client.set_terminated(run.info.run_id, "FAILED"))
            return run.info.run_id, run.info.run_name
        name = mask_text(_job_run_name(job, cfg), secrets)
        tags = {
            **job.tags(),
            "error": error,
            "overrides": shlex.join(mask_overrides(job.overrides)) or "(none)",
        }
        run = create_run(client, sweep.experiment_id, run_name=name, tags=tags)
        retrying(lambda: client.set_terminated(run.info.run_id, "FAILED"))
    except Exception as err:  # the outcome file and the list at the end still record the failure
        log.warning(
            "sweep %s: its failure could not be recorded in MLflow (%s: %s)",
            job.describe(),
            type(err).__name__,
            mask_text(str(err), secrets)[:300],
        )
        return None, None
    return run.info.run_id, name


def _job_run_name(job: SweepJob, cfg: RunConfig | None) -> str:
    """The name a job that failed before its run existed gets: the derived one, with the device as asked."""
    if cfg is None:
        return f"sweep-{job.sweep.short_id}-job{job.number}"
    from pipeline.engine.provenance import run_name, sweep_run_name

    precision = ("amp" if cfg.precision.dtype == "auto" else cfg.precision.dtype) if cfg.amp else "fp32"
    return sweep_run_name(run_name(cfg, device_type=cfg.device.name, precision=precision), job.values)


def _secret_values(cfg: RunConfig | None) -> frozenset[str]:
    if cfg is None:
        return frozenset()
    from pipeline.common.secrets import env_values

    try:
        return env_values(cfg)
    except ConfigError:  # an experiment named from the environment: the job's error already says so
        return frozenset()


def _rank_0() -> bool:
    """Whether this process records the job: always, except ranks other than 0 of a DDP job (their run is rank 0's;
    ``pipeline.parallel.distributed`` has set ``RANK`` by the time a job ends)."""
    return os.environ.get("RANK", "0") == "0"


def _save_outcome(job: SweepJob, outcome: JobOutcome) -> None:
    if not _rank_0():
        return
    _write_json(job.folder / JOBS_DIR / f"{job.number}.json", asdict(outcome))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: a reader (the callback, another job) never sees half a file."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def _one_of(options: Sequence[str]) -> str:
    return "one of " + ", ".join(repr(o) for o in options)
