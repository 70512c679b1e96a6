"""The comparison back in MLflow: every run of a table tagged with its row and that row's verdict (``tag_runs``),
so that MLflow's runs table, grouped by ``compare.row`` (its "Group by"), shows each row's repeats together with
the words the terminal prints.

    compare.row      the row's name as the table prints it (whole: the terminal cuts a long one in its middle)
    compare.verdict  the row's verdict against the baseline, the terminal's verdict column (``faster: shown``,
                     ``no difference shown``, ...); ``baseline`` on the baseline's runs
    compare.speedup  the terminal's speed-up cell: ``1.23× [1.03–1.67]``, ``1.00× (baseline)``

The last comparison written wins: comparing the same runs again writes the same tags (a run whose tags already say
so is not written: a rerun costs no call), another comparison of them (another baseline, other runs beside them)
replaces them, and a run left out of it keeps its own. A run that cannot be written (a read-only store, an
experiment the user may not write) fails nothing: ``Tagging.line`` says what was not written and why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pipeline.common.messages import brief
from pipeline.experiments.compare.runs import ComparedRun
from pipeline.experiments.compare.table import Table
from pipeline.experiments.compare.terminal import speedup_cell
from pipeline.record.store import retrying

ROW, VERDICT, SPEEDUP = "compare.row", "compare.verdict", "compare.speedup"
TAGS = (ROW, VERDICT, SPEEDUP)
# logs a failed SQLite write with its traceback, then raises it: Tagging.line says it in one line instead
STORE_LOGGER = "mlflow.store.db.utils"


@dataclass(frozen=True)
class Tagging:
    """What ``tag_runs`` did: the table's runs, those whose tags it changed, those it could not write and why."""

    runs: int
    changed: int
    failed: int = 0
    error: str = ""  # the first failure, in one line

    def line(self) -> str:
        """One line for the terminal: the runs tagged and how to use it, or what was not written and why."""
        names = f"{ROW}, {VERDICT} and {SPEEDUP}"
        if self.failed:
            return (
                f"warning: the tags {names} were not written on {self.failed} of {self.runs} runs ({self.error}): "
                "the table is whole, but MLflow's UI cannot group those runs by row"
            )
        changed = f"{self.changed} written" if self.changed else "none changed"
        said = f"tags: {self.runs} runs carry their row and its verdict ({names}; {changed})"
        return f"{said}: group MLflow's runs by {ROW}"


def run_tags(table: Table) -> dict[str, dict[str, str]]:
    """Each run's tags, by run id: its row's name, verdict and speed-up as the terminal prints them."""
    return {
        run.id: {
            ROW: line.row.name,
            VERDICT: line.vs_baseline.verdict(),
            SPEEDUP: speedup_cell(line, baseline=line.row is table.baseline),
        }
        for line in table.lines
        for run in line.row.runs
    }


def tag_runs(client: Any, table: Table) -> Tagging:
    """Tag every run of ``table`` (``run_tags``) through ``client`` (an ``MlflowClient``): one call a run whose tags
    change. The runs of an experiment share its permissions, so its first failure skips the rest of it (counted
    as not written); other experiments are still tried. Never raises for a store that refuses the write."""
    from mlflow.exceptions import MlflowException  # lazy: compare imports mlflow only once its arguments parse

    wanted = run_tags(table)
    runs = [run for line in table.lines for run in line.row.runs]
    by_experiment: dict[str, list[ComparedRun]] = {}
    for run in runs:
        if any(run.tags.get(key) != value for key, value in wanted[run.id].items()):
            by_experiment.setdefault(run.experiment_id, []).append(run)
    changed = failed = 0
    error = ""
    with _store_logs_muted():
        for stale in by_experiment.values():
            for i, run in enumerate(stale):
                try:
                    _write(client, run.id, wanted[run.id])
                except (MlflowException, OSError) as err:
                    failed += len(stale) - i
                    error = error or brief(err, first_line=True)
                    break
                changed += 1
    return Tagging(len(runs), changed, failed, error)


def _write(client: Any, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    retrying(lambda: client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()]), what="tagging runs")


@contextmanager
def _store_logs_muted() -> Iterator[None]:
    logger = logging.getLogger(STORE_LOGGER)
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was
