"""What a sweep keeps in its folder (``hydra.sweep.dir``), for jobs that run in other processes (joblib, submitit):
``sweep.json`` (the sweep: its id, the parent run, the swept keys, the metric), ``design.json`` (each job's round,
from the interleaved sweeper), ``jobs/<n>.json`` (how each job ended) and ``jobs/stop`` (a stop request). Every
file is written atomically (``pipeline.common.atomic``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from pipeline.common.atomic import write_text_atomic
from pipeline.common.secrets import mask_overrides

if TYPE_CHECKING:
    pass


SWEEP_FILE = "sweep.json"  # in hydra.sweep.dir


DESIGN_FILE = (
    "design.json"  # in hydra.sweep.dir: each job's round, from the interleaved sweeper (pipeline.config.design)
)


JOBS_DIR = "jobs"  # in hydra.sweep.dir: <job number>.json, one per job that ended


STOP_FILE = "stop"  # in JOBS_DIR: the parallel launcher was stopped (request_stop); queued jobs do not start


NOT_RUN = "NOT_RUN"  # a job's status when the sweep stopped before it started (``lost``)


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
    design_seed: int | None = None  # the seed that drew the rounds' order, None without repeats
    config: int | None = None  # its configuration's number in the order typed (``Plan.configs``), None without repeats

    @property
    def values(self) -> dict[str, str]:
        """The swept keys' values in this job, as typed: ``{"loader.batch_size": "32", "optimizer.lr": "0.01"}``."""
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
        if self.config is not None:  # the table lists configurations in this order, not the rounds' drawn one
            tags["sweep.config"] = str(self.config)
        if self.design_seed is not None:
            tags["sweep.design_seed"] = str(self.design_seed)
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
        """One line for the terminal: ``job #3 (optimizer.lr=1e30): NonFiniteLoss: ...``."""
        error = next(iter((self.error or "").strip().splitlines()), self.status)
        return f"{self.name()}: {error}"

    def name(self) -> str:
        """``job #3 (optimizer.lr=1e30)``."""
        return f"job #{self.job} ({' '.join(self.overrides) or 'no overrides'})"


def sweep_folder(hydra: DictConfig) -> Path:
    """The sweep's folder (``hydra.sweep.dir``), absolute: a job run with ``hydra.job.chdir=true`` is elsewhere."""
    return Path(str(hydra.runtime.cwd), str(hydra.sweep.dir))


def save_design(
    folder: Path,
    rounds: Sequence[int | None],
    jobs: Sequence[Sequence[str]] = (),
    *,
    seed: int | None = None,
    configs: Sequence[int] | None = None,
) -> None:
    """Write each job's round (``pipeline.config.design.Plan.rounds``, by job number) to ``design.json``, each job's
    overrides (masked: a sweep stopped before its end lists the jobs it never started, ``end_sweep``), the seed
    that drew the rounds' order and each job's configuration number (``Plan.configs``)."""
    design = {"rounds": list(rounds), "jobs": [mask_overrides(job) for job in jobs], "seed": seed}
    design["configs"] = list(configs) if configs is not None else None
    _write_json(folder / DESIGN_FILE, design)


def load_seed(folder: Path) -> int | None:
    """The seed that drew the sweep's order, from ``design.json``; None without one (no repeats, another sweeper)."""
    path = folder / DESIGN_FILE
    return json.loads(path.read_text()).get("seed") if path.is_file() else None


def planned_jobs(folder: Path) -> list[tuple[int, list[str]]]:
    """Every job the sweeper listed, as ``(job number, overrides)``, from ``design.json``; [] when there is none
    (a sweeper that decides its jobs as it goes: Optuna)."""
    path = folder / DESIGN_FILE
    if not path.is_file():
        return []
    return list(enumerate(json.loads(path.read_text()).get("jobs", [])))


def load_round(folder: Path, job: int, field: str = "rounds") -> int | None:
    """The round job ``job`` runs in (``field="configs"``: its configuration's number), from ``design.json``; None
    when there is none (another sweeper, a sweep without repeats)."""
    path = folder / DESIGN_FILE
    if not path.is_file():
        return None
    values = json.loads(path.read_text()).get(field) or []
    return values[job] if 0 <= job < len(values) else None


def request_stop(folder: Path, signum: int) -> None:
    """Mark the sweep as stopping (``jobs/stop``), before its workers get the signal: a job a worker takes from
    its queue after that is recorded ``NOT_RUN`` and not started (``stop_requested``)."""
    (folder / JOBS_DIR).mkdir(parents=True, exist_ok=True)
    (folder / JOBS_DIR / STOP_FILE).write_text(f"{signum}\n")


def stop_requested(folder: Path) -> bool:
    """Whether the sweep's launcher was asked to stop (``request_stop``)."""
    return (folder / JOBS_DIR / STOP_FILE).exists()


def load_outcomes(folder: Path) -> list[JobOutcome]:
    """The outcomes the jobs wrote, by job number."""
    paths = sorted((folder / JOBS_DIR).glob("*.json"), key=lambda p: int(p.stem))
    return [JobOutcome(**json.loads(p.read_text())) for p in paths]


def _save_outcome(job: SweepJob, outcome: JobOutcome) -> None:
    if not records_jobs():
        return
    _write_json(job.folder / JOBS_DIR / f"{job.number}.json", asdict(outcome))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: a reader (the callback, another job) never sees half a file."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def records_jobs() -> bool:
    """Whether this process records the job: always, except ranks other than 0 of a DDP job (their run is rank 0's;
    ``pipeline.parallel.distributed`` has set ``RANK`` by the time a job ends)."""
    return os.environ.get("RANK", "0") == "0"
