"""One run from its configuration to its result: ``session(cfg, asked, record)``.

Everything a run holds open is entered here, in order, on one ``ExitStack``, and closed in reverse whichever way
the run ends: the process's guards (no collector passes over start-up, the user's errors named as theirs, memory
running out in one line, the DDP job), the resumed checkpoint's lock, the loader workers, the stop requests, the
tracker, the profiler's and the memory snapshot's recording, the checkpointer and the utilisation sampler.

Order matters: the checkpoint to resume (if any), the device, the data and the model are all settled before the
MLflow run is opened, so a bad ``resume=``, a missing GPU or dataset fails fast and leaves no half-made or
modified run behind. What the run's record says beyond metrics is the layer above's (``record``:
``pipeline.train`` wires ``pipeline.report.logbook``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.common import usercode
from pipeline.common.heap import collector_paused
from pipeline.common.secrets import env_values, mask_overrides, mask_tree
from pipeline.common.usercode import user_errors
from pipeline.config import RunConfig
from pipeline.data.workers import deaths_expected_while
from pipeline.engine.building.build import Setup, announce, build
from pipeline.engine.building.provenance import run_tags, sweep_run_name, with_overrides
from pipeline.engine.checkpointing import checkpoint, resume
from pipeline.engine.checkpointing.continuation import own_overrides, stop_says_how_to_continue
from pipeline.engine.checkpointing.start import FreshStart, Resumed
from pipeline.engine.hot import compilation
from pipeline.engine.hot.memory import out_of_memory_is_an_error
from pipeline.engine.observe.progress import progress_mode
from pipeline.engine.results import RunResult
from pipeline.engine.run import EpochModels, Fitted, Run, fit
from pipeline.engine.stopping import StopRequests
from pipeline.monitor import open_sampler
from pipeline.parallel import distributed
from pipeline.record.lifecycle import Tracker, open_tracker
from pipeline.record.reachability import check_reachable


class SweepJob(Protocol):
    """The sweep job a run is (``pipeline.experiments.sweep.current_job``)."""

    @property
    def values(self) -> dict[str, str]: ...

    def tags(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class Asked:
    """What the run was asked: the command line's ``overrides`` as typed, the run's ``own_overrides`` (its
    checkpoints keep them for a resume; None: ``overrides``), ``quiet`` (no progress bar) and the ``sweep`` job it is
    (None outside a sweep)."""

    overrides: list[str]
    own_overrides: list[str] | None = None
    quiet: bool = False
    sweep: SweepJob | None = None

    @property
    def own(self) -> list[str]:
        """The run's own configuration as overrides, without ``resume=``/``fork=`` (``continuation.own_overrides``)."""
        return own_overrides(self.overrides if self.own_overrides is None else self.own_overrides)


@dataclass(frozen=True)
class Said:
    """What the record keeps of what was asked, no secret in it: the ``config`` and the ``typed`` overrides masked,
    and the ``secrets`` masked wherever they land (``pipeline.common.secrets``)."""

    config: dict[str, Any]
    typed: list[str]
    secrets: frozenset[str]

    @classmethod
    def of(cls, cfg: RunConfig, asked: Asked) -> Said:
        """Refuses an experiment named from a secret (``env_values``)."""
        masked = mask_tree(cfg.to_dict(), cfg.env_keys)
        return cls(masked, mask_overrides(asked.overrides, cfg.env_keys), env_values(cfg))


@dataclass(frozen=True)
class Hooks:
    """The run's seams for a tool that watches it from the same process (``pipeline.gpucheck``): ``model`` is handed
    the model as built, on its device, before anything runs it; ``evaluated`` each evaluation pass's seconds."""

    model: Callable[[Any], None] = lambda model: None
    evaluated: Callable[[float], None] = lambda seconds: None


class Record(Protocol):
    """What the layers above record of a run besides its metrics (``pipeline.report.logbook``)."""

    def explain_missing_gpu(self) -> str: ...

    def check(self, setup: Setup) -> None:
        """Refuse, before the record opens, what the record could not keep (``tracking.model_format``)."""

    def opened(self, tracker: Tracker, setup: Setup, start: FreshStart | Resumed, said: Said) -> None:
        """Rank 0's record of the run's start: its config, data and environment (or, resumed, what changed)."""

    def epoch_models(self, tracker: Tracker, setup: Setup) -> EpochModels: ...

    def conclude(self, run: Run, fitted: Fitted, total_s: float) -> RunResult:
        """The run's verdict, pictures and result, once its training is over and the sampler has stopped."""


def session(cfg: RunConfig, asked: Asked, record: Record, *, started: float, hooks: Hooks = Hooks()) -> RunResult:
    """Train and evaluate the configured model and record the run (``started``: its ``time.perf_counter``)."""
    usercode.forget()  # where the user's code lives is this run's targets' to say, not an earlier run's
    stop = StopRequests(checkpoints=cfg.checkpoint.enabled)
    with contextlib.ExitStack() as envelope:
        enter = envelope.enter_context
        enter(collector_paused(freeze=False))  # none over what start-up and close import; training has them (fit)
        enter(user_errors())  # an exception raised in the user's code: one line naming their file, line and key
        enter(out_of_memory_is_an_error())
        group = enter(distributed.joined(cfg.device))  # torchrun: this rank's place in the job; else a plain run
        _fail_fast(cfg, group.is_main)
        said = Said.of(cfg, asked)
        start = resume.start_point(cfg, said.config, group)
        enter(start)  # a resumed run stays locked to this process until it ends
        # loader workers killed by the same stop signal are no fault, up to and while their loaders end: on a loaded
        # machine they can die of it only as the run ends them
        enter(deaths_expected_while(stop.requested))
        setup = build(cfg, group, explain_missing_gpu=record.explain_missing_gpu, on_model=hooks.model)
        envelope.callback(setup.end_loaders)  # its loader workers end with it, whichever way it ends
        setup = _named(setup, asked.sweep, said.typed) if not cfg.tracking.run_name else setup
        announce(setup, cfg)  # under the name the summary and MLflow show
        start.restore(setup.state, setup.device, cfg.optimizer)
        record.check(setup)
        enter(stop)
        tracker = enter(_open_tracker(cfg, setup, start, said, asked.sweep))
        enter(user_errors())  # inside the tracker: the run's FAILED record says it as the user's too
        enter(setup.profiler.recording(tracker))  # trainer.profile: where the profiled steps are kept
        enter(setup.snapshot.recording(tracker))  # trainer.memory_snapshot=on_oom: kept at an OOM
        start.continue_record(tracker)  # the same run: steps trained again keep their first points
        if group.is_main:
            record.opened(tracker, setup, start, said)
        saver = enter(_checkpointer(cfg, setup, start, said.config, asked.own, tracker))
        enter(stop_says_how_to_continue(saver, asked.own, resumed=start.from_checkpoint))
        sampler = _sampler(cfg, setup, start, tracker)
        envelope.callback(sampler.stop)  # stopped before the record's end reads it; here, whichever way it ends
        run = Run(setup, cfg.trainer, tracker, sampler, saver, stop, started,
                  progress=progress_mode(cfg.trainer.progress, quiet=asked.quiet),
                  models=record.epoch_models(tracker, setup), evaluated=hooks.evaluated)  # fmt: skip
        fitted = fit(run, start.position)
        sampler.stop()
        saver.mark("finished")
        return record.conclude(run, fitted, time.perf_counter() - started)


def _fail_fast(cfg: RunConfig, main: bool) -> None:
    """What can refuse the run before any data is loaded: a dead tracking server (in seconds), an unusable
    checkpoint folder; and a fresh recompile budget (a sweep's earlier jobs' graphs must not count towards it)."""
    if cfg.tracking.enabled and main:
        check_reachable(cfg.tracking.uri)
    checkpoint.check_dir(cfg.checkpoint)
    if cfg.trainer.compile:
        compilation.fresh()


def _named(setup: Setup, sweep: SweepJob | None, typed: list[str]) -> Setup:
    """``setup`` under a name of its own: runs whose configurations differ never share one (``tracking.run_name``
    unset)."""
    swept = sweep.values if sweep is not None else {}
    name = sweep_run_name(setup.run_name, swept) if sweep is not None else setup.run_name
    return dataclasses.replace(setup, run_name=with_overrides(name, typed, list(swept)))


def _open_tracker(
    cfg: RunConfig, setup: Setup, start: FreshStart | Resumed, said: Said, sweep: SweepJob | None
) -> contextlib.AbstractContextManager[Tracker]:
    """Rank 0's tracker (the other ranks' record nothing), the run tagged with the configured tags, what ran it, and
    the sweep's (``mlflow.parentRunId`` nests the run under the sweep's parent in the UI)."""
    tags: dict[str, Any] = {
        **said.config["tracking"]["tags"],
        **run_tags(setup.choice, setup.policy, said.typed, setup.backends),
    }
    if sweep is not None:
        tags.update(sweep.tags())
    return open_tracker(
        cfg.tracking if setup.group.is_main else dataclasses.replace(cfg.tracking, enabled=False),
        run_name=setup.run_name,
        tags=start.run_tags(tags),
        run_id=start.run_id,
        secret_values=said.secrets,
    )


def _sampler(cfg: RunConfig, setup: Setup, start: FreshStart | Resumed, tracker: Tracker) -> Any:
    """The run's utilisation sampler, started, logging into ``tracker`` after the points a resumed run holds."""
    return open_sampler(
        cfg.monitor,
        device=setup.device,
        log_metrics=tracker.log_metrics,
        children=cfg.loader.num_workers > 0,
        after_step=start.sampler_after(tracker),
    )


def _checkpointer(
    cfg: RunConfig, setup: Setup, start: FreshStart | Resumed, config: dict[str, Any], own: list[str], tracker: Tracker
) -> checkpoint.Checkpointer:
    """The run's checkpointer, holding the masked ``config`` and the run's ``own`` overrides: rank 0 writes, every
    rank knows the run's checkpoint folder."""
    kept = checkpoint.Kept(
        run_id=setup.group.share(lambda: tracker.run_id),
        run_name=setup.run_name,
        config=config,
        world_size=setup.group.world_size,
        classes=list(setup.spec.classes) if setup.spec.classes else None,
        overrides=mask_overrides(own, cfg.env_keys),
        code=setup.code.files,
    )
    return checkpoint.Checkpointer.for_run(
        cfg.checkpoint, cfg.tracking, kept, state=setup.state, device=setup.device, lock=start.lock,
        write=setup.group.is_main,
    )  # fmt: skip
