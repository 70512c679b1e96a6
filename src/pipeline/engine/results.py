"""What a run's training returns: each epoch's record (``EpochResult``, which computes the metrics it logs) and the
run's (``RunResult``, what ``pipeline.train.train`` returns), with the epochs whose steady steps the run's figures
pool. The summary printed from them is ``pipeline.report.summary``'s."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.common import stats
from pipeline.common.metric_names import (
    THROUGHPUT_GLOBAL_SAMPLES_PER_S,
    TIME_DATA_WAIT_PCT_SLOWEST_RANK,
    TIME_EPOCH_S,
    TRAIN_EPOCH_LOSS,
    VAL_ACC,
    VAL_LOSS,
)
from pipeline.engine.building.flops import ModelFlops
from pipeline.engine.hot.timing import Breakdown, combine
from pipeline.engine.observe.replay import ReplayOutcome
from pipeline.monitor import UtilSummary, summarize


@dataclass(frozen=True)
class EpochResult:
    epoch: int
    train_loss: float
    val_metrics: dict[str, float]  # val/loss and the task's metrics (pipeline.engine.hot.tasks)
    seconds: float  # wall clock, first step included
    samples_per_s: float  # steady state
    breakdown: Breakdown
    ranks: dict[str, float] = field(default_factory=dict)  # DDP: every rank's shares (pipeline.parallel.distributed)
    launch_s: float | None = None  # the first epoch of a fresh run: the process's start to its first step's end

    @property
    def val_loss(self) -> float:
        return self.val_metrics.get(VAL_LOSS, math.nan)

    def metrics(self) -> dict[str, float]:
        """The epoch's own figures as logged at its end: ``train/epoch_loss``, ``val/*`` and ``time/epoch_s``."""
        return {TRAIN_EPOCH_LOSS: self.train_loss, **self.val_metrics, TIME_EPOCH_S: self.seconds}

    @property
    def val_acc(self) -> float:
        return self.val_metrics.get(VAL_ACC, math.nan)

    @property
    def job_samples_per_s(self) -> float:
        """The whole job's steady-state samples/s: every rank's together under DDP, else this run's. What runs are
        compared and searched by (``pipeline.experiments.compare``, the sweep's objective), so a 2-rank job is not
        read as 1×."""
        return self.ranks.get(THROUGHPUT_GLOBAL_SAMPLES_PER_S, self.samples_per_s)

    @property
    def slowest_rank_wait_pct(self) -> float:
        """Under DDP, the data-wait share of the rank that waited most (a straggler holds every rank back)."""
        return self.ranks.get(TIME_DATA_WAIT_PCT_SLOWEST_RANK, 0.0)


@dataclass(frozen=True)
class RunResult:
    """What ``train`` returns: enough to compare runs in code (sweeps, benchmarks, tests)."""

    run_name: str
    run_id: str | None
    device: str
    device_name: str
    precision: str
    loader: str
    parameters: int
    steps: int
    total_s: float
    epochs: list[EpochResult] = field(default_factory=list)
    breakdown: Breakdown = field(default_factory=lambda: combine([]))
    utilisation: UtilSummary = field(default_factory=lambda: summarize([]))
    tracking_write_s: float = 0.0  # time the training thread spent writing metrics (between epochs)
    tracking_background_write_s: float = 0.0  # time the tracker's writer thread spent writing (during epochs)
    oom_events: list[Any] = field(default_factory=list)  # pipeline.engine.hot.memory.OomEvent, in order
    micro_batch: int = 0  # samples per forward/backward at the end (the effective batch is the loader's)
    eval_micro_batch: int = 0  # samples per evaluation forward at the end (evaluation shrinks on its own)
    bottleneck: str = ""
    verdict: str = ""
    tracking: list[str] = field(default_factory=list)
    amp_probe: Any = None  # pipeline.engine.hot.precision.AmpProbe: amp=true on the CPU, timed against float32 at start
    notes: list[str] = field(default_factory=list)  # caveats about what the numbers mean (e.g. BatchNorm)
    flops: ModelFlops | None = None  # model FLOPs per sample and the device's peak: the compute line's MFU
    distributed: str = ""  # DDP: world size, backend, per-rank and global batch ("" for one process)
    model: Any = field(default=None, repr=False, compare=False)  # the trained torch module
    primary: str = VAL_ACC  # the task's leading metric (pipeline.engine.hot.tasks): what a sweep returns by default
    logged_model: str = ""  # where the trained model is in MLflow (runs:/<id>/model), "" when not logged
    profile: Any = None  # observe.profile_report.ProfileReport: trainer.profile=true, once steps were profiled
    replay: ReplayOutcome | None = None  # the step time with free data (observe/replay.py): the free data line
    loader_kind: str = ""  # the backend that made the batches (Batches.kind: dataloader, resident, a registered one)

    @property
    def val_acc(self) -> float:
        return self.epochs[-1].val_acc if self.epochs else float("nan")

    @property
    def val_loss(self) -> float:
        return self.epochs[-1].val_loss if self.epochs else float("nan")

    def metric(self, name: str) -> float:
        """The last epoch's value of validation metric ``name`` (``val/mae``), NaN when the run has none."""
        return self.epochs[-1].val_metrics.get(name, math.nan) if self.epochs else math.nan

    def speed(self) -> stats.Summary | None:
        """The run's speed: median, min and max over its ``steady_epochs`` of the job's steady-state samples/s
        (every rank's together under DDP); None when no epoch timed a steady step."""
        return stats.summarize(e.job_samples_per_s for e in steady_epochs(self.epochs))


def steady_epochs(epochs: list[EpochResult]) -> list[EpochResult]:
    """The epochs that timed a steady step. The summary's speed is the median of their samples/s and its step-time
    shares are their steady steps pooled (``run_breakdown``): the same steps, weighed differently (the median
    is the middle epoch; the pooled shares weigh each epoch by its time, a slow epoch more)."""
    return [e for e in epochs if e.breakdown.steady_steps > 0]


def run_breakdown(epochs: list[EpochResult]) -> Breakdown:
    """The run's step-time breakdown (``RunResult.breakdown``): its ``steady_epochs``' breakdowns combined."""
    return combine([e.breakdown for e in steady_epochs(epochs)])
