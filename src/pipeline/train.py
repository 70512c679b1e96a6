"""``train(cfg)``: build everything the config names, train, evaluate, record. Returns a ``RunResult``.

The composition root: the engine's session (``pipeline.engine.session``) builds and trains the run inside everything
it holds open; the run's record beyond its metrics is ``pipeline.report.logbook``'s, wired in here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pipeline.config import RunConfig
from pipeline.engine.building.build import Setup
from pipeline.engine.checkpointing.start import FreshStart, Resumed
from pipeline.engine.results import RunResult
from pipeline.engine.run import EpochModels, Fitted, Run
from pipeline.engine.session import Asked, Hooks, Said, SweepJob, session
from pipeline.machine import doctor
from pipeline.record.lifecycle import Tracker
from pipeline.report import logbook
from pipeline.report.summary import format_summary


def train(
    cfg: RunConfig,
    *,
    overrides: Sequence[str] = (),
    echo: bool = True,
    quiet: bool = False,
    sweep: SweepJob | None = None,
    own_overrides: Sequence[str] | None = None,
    hooks: Hooks | None = None,
) -> RunResult:
    """Train and evaluate the configured model and record the run.

    Args:
        cfg: a validated config (``pipeline.config.from_dictconfig``).
        overrides: the command-line overrides as typed, for the record.
        echo: print the summary at the end.
        quiet: no progress bar (sweep jobs).
        sweep: the sweep job this run is (``pipeline.experiments.sweep.current_job``): the run is nested under the
            sweep's parent run, tagged with the sweep, and named after its swept values unless
            ``tracking.run_name`` is set.
        own_overrides: the run's own configuration as overrides, kept in its checkpoints for a resume to restore
            (``pipeline.engine.checkpointing.continuation``); default ``overrides`` without ``resume=``/``fork=``.
        hooks: seams for a tool that watches the run from this process (``pipeline.engine.session.Hooks``).

    Raises:
        Stopped: SIGTERM or Ctrl-C arrived; a checkpoint was written and the run marked KILLED.
    """
    started = time.perf_counter()
    book = _Logbook(cfg)
    own = list(own_overrides) if own_overrides is not None else None
    asked = Asked(list(overrides), own, quiet=quiet, sweep=sweep)
    result = session(cfg, asked, book, started=started, hooks=hooks or Hooks())
    if echo and book.main:
        print(book.summary, flush=True)
    return result


class _Logbook:
    """The run's record beyond its metrics (``pipeline.report.logbook``), as the session asks for it; it keeps the
    summary it stored as the run's description, and whether this process is the job's rank 0 (which prints it)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg, self.summary, self.main = cfg, "", True

    def explain_missing_gpu(self) -> str:
        return doctor.main_finding()

    def check(self, setup: Setup) -> None:
        self.main = setup.group.is_main
        logbook.check_model_format(setup, self.cfg)  # tracking.model_format=pt2 for a model it cannot take

    def opened(self, tracker: Tracker, setup: Setup, start: FreshStart | Resumed, said: Said) -> None:
        logbook.start(tracker, setup, self.cfg, said.config, said.typed, start)

    def epoch_models(self, tracker: Tracker, setup: Setup) -> EpochModels:
        return logbook.epoch_models(self.cfg, tracker, setup)  # tracking.log_model=checkpoints: one at each epoch's

    def conclude(self, run: Run, fitted: Fitted, total_s: float) -> RunResult:
        result = logbook.conclude(run, self.cfg, fitted, total_s=total_s)
        self.summary = format_summary(result)
        run.tracker.set_tags({"mlflow.note.content": f"```\n{self.summary}\n```"})
        return result
