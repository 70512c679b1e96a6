"""One run as the comparison reads it: ``ComparedRun``, the metric names it reads, and ``CompareError``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.common.errors import PipelineError
from pipeline.common.metric_names import (
    THROUGHPUT_GLOBAL_SAMPLES_PER_S,
    THROUGHPUT_SAMPLES_PER_S,
    TIME_COMPUTE_PCT,
    TIME_DATA_WAIT_PCT,
    TIME_EPOCH_S,
    TIME_H2D_PCT,
    TIME_OVERHEAD_PCT,
    TIME_STEP_MS,
    VAL_ACC,
    VAL_LOSS,
    VAL_MAE,
    VAL_PERPLEXITY,
    VAL_RMSE,
)

# The metric names are pipeline.common.metric_names's. A steady step's mean time (TIME_STEP_MS) is split by the four
# shares below; THROUGHPUT_SAMPLES_PER_S is one rank's under DDP, THROUGHPUT_GLOBAL_SAMPLES_PER_S every rank's together
# (what a job is compared by); GPU_MEM_PEAK_MB (NVML's reading of the whole device) is shown only where
# MEMORY_MAX_ALLOCATED_MB (the allocator's peak, CUDA) is missing; OOM_EVENTS is logged only at an event: none = 0.
STEP_PARTS = {  # a step's parts, as the table and the chart name them, from their shares of the step
    "data wait": TIME_DATA_WAIT_PCT,
    "copy": TIME_H2D_PCT,
    "compute": TIME_COMPUTE_PCT,
    "own work": TIME_OVERHEAD_PCT,
}
PRIMARY = "task.primary"  # the tag naming a run's leading validation metric (val/acc, val/mae, ...)
LOWER_IS_BETTER = frozenset({VAL_LOSS, VAL_MAE, VAL_RMSE, VAL_PERPLEXITY})
# a run lacking one of these, or its leading metric, is listed under the table
CORE = (TIME_EPOCH_S, THROUGHPUT_SAMPLES_PER_S)

BUSY = "machine.busy"  # "true": other processes kept the machine busy during the run (pipeline.monitor.sampler)
ROLE, PARENT = "sweep.role", "parent"  # the tag (set by the sweep callback) that marks a sweep's parent run


class CompareError(PipelineError):
    """Nothing to compare: no such experiment, sweep, runs or baseline; the message says what there is."""


@dataclass(frozen=True)
class ComparedRun:
    """One run as the table needs it: built from an MLflow run by ``from_run``, or by hand in tests."""

    id: str
    name: str
    status: str  # FINISHED, FAILED, KILLED, RUNNING
    params: Mapping[str, str]
    metrics: Mapping[str, float]  # each metric's last value (highest step)
    tags: Mapping[str, str]
    steps: Mapping[str, int] = field(default_factory=dict)  # the step of that last value (per epoch: the epoch)
    experiment_id: str = "0"
    start_time: int = 0  # ms since the epoch

    @classmethod
    def from_run(cls, run: Any) -> ComparedRun:
        """From an ``mlflow.entities.Run`` as ``search_runs`` returns it (latest metrics with their steps)."""
        data, info = run.data, run.info
        return cls(
            id=info.run_id,
            name=info.run_name or data.tags.get("mlflow.runName") or info.run_id[:8],
            status=info.status,
            params=dict(data.params),
            metrics=dict(data.metrics),
            tags=dict(data.tags),
            steps=_steps(data),
            experiment_id=info.experiment_id,
            start_time=info.start_time or 0,
        )

    @property
    def speed(self) -> float | None:
        """Steady-state samples/s of the whole job: every rank's under DDP, else the run's; None if not recorded."""
        value = self.metrics.get(THROUGHPUT_GLOBAL_SAMPLES_PER_S, self.metrics.get(THROUGHPUT_SAMPLES_PER_S))
        return value if value is not None and math.isfinite(value) else None

    @property
    def busy(self) -> bool:
        """Other processes kept the machine busy while it ran (tag ``machine.busy``): its speed is not comparable."""
        return self.tags.get(BUSY) == "true"

    @property
    def quality(self) -> str:
        """The run's leading validation metric (``task.primary``; runs from before tasks: ``val/acc``)."""
        return self.tags.get(PRIMARY, VAL_ACC)

    def lacking(self) -> list[str]:
        """The metrics every row needs that this run did not record."""
        return [m for m in (*CORE, self.quality) if m not in self.metrics]

    @property
    def job(self) -> float:
        """The sweep job number (``sweep.job``: the launch order), inf outside a sweep."""
        job = self.tags.get("sweep.job", "")
        return int(job) if job.isdigit() else math.inf

    @property
    def config_number(self) -> float:
        """Its configuration's number in the order the sweep's values were typed (``sweep.config``; a round runs
        them in a random order), inf without one: the order a sweep's rows are listed in."""
        number = self.tags.get("sweep.config", "")
        return int(number) if number.isdigit() else math.inf

    @property
    def round(self) -> str | None:
        """The round of an interleaved sweep this run ran in (``sweep.round``): runs of one round ran together."""
        return self.tags.get("sweep.round")

    @property
    def block(self) -> tuple[str, str] | None:
        """``(sweep id, round)``: the runs that ran side by side. A round number alone pairs nothing: round 2 of
        one sweep and round 2 of another (``--last N`` over both) ran hours apart."""
        sweep, number = self.tags.get("sweep.id"), self.round
        return (sweep, number) if sweep and number is not None else None

    def step_parts_ms(self) -> dict[str, float] | None:
        """A steady step's parts in ms (``STEP_PARTS``), from ``time/step_ms`` and the shares; None without them."""
        step = self.metrics.get(TIME_STEP_MS)
        if step is None or not all(m in self.metrics for m in STEP_PARTS.values()):
            return None
        return {name: step * self.metrics[metric] / 100 for name, metric in STEP_PARTS.items()}

    @property
    def is_parent(self) -> bool:
        return self.tags.get(ROLE) == PARENT

    @property
    def single_epoch(self) -> bool:
        """Its epoch time is its first epoch's, warm-up included (per-epoch metrics are logged at step = epoch)."""
        return TIME_EPOCH_S in self.metrics and self.steps.get(TIME_EPOCH_S, 2) <= 1


def _steps(data: Any) -> dict[str, int]:
    """Each latest metric's step: from the ``Metric`` objects ``RunData`` keeps (MLflow 2 and 3), else through its
    protobuf, which costs 0.5 s over 1,000 runs (half of what compare added to ``search_runs``)."""
    metrics = getattr(data, "_metric_objs", None)
    if metrics is None:
        metrics = data.to_proto().metrics
    return {m.key: m.step for m in metrics}
