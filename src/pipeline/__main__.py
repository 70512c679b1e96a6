"""Train from the command line: ``python -m pipeline [group=option] [group.key=value] ...``.

    python -m pipeline                                      # MLP on the bundled digits
    python -m pipeline model=resnet50 amp=true trainer.max_steps=20
    python -m pipeline -m loader.batch_size=32,64,128 loader.num_workers=0,2,4
    python -m pipeline --help                               # the groups and the composed config

Exit status: 0 on success, 2 for a problem the user can fix (bad config, missing device or dataset,
a tracking store that cannot work, a full disk; one line on stderr), 143 / 130 after SIGTERM /
Ctrl-C (checkpoint written, run KILLED; Ctrl-C before the first step or while exiting: one line,
130), 1 for anything else (a bug, or a fault of the machine: one line, the run recorded FAILED;
``--debug`` or ``HYDRA_FULL_ERROR=1`` shows the traceback). A sweep (``-m``) is checked job by job
before the first job starts; a job that fails while it runs is recorded and the others still run,
then the sweep exits 2 (every failure the user's to fix) or 1, listing the failed jobs (see
``pipeline.experiments.sweep``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

BEFORE_THE_FIRST_STEP = "interrupted before the first step: nothing was recorded, nothing to resume"
try:  # Ctrl-C while Hydra, OmegaConf and the config load: one line, not the import machinery's traceback
    import hydra
    from omegaconf import DictConfig

    from pipeline.common.cli import DEBUG_FLAG, debugging, report_bug
    from pipeline.common.errors import OverrideError, PipelineError
    from pipeline.common.heap import exit_without_teardown, frozen_at_exit
    from pipeline.common.secrets import mask_overrides
    from pipeline.config import (
        RunConfig,
        as_typed,
        check_multirun,
        check_search_space,
        config_dir,
        from_dictconfig,
        load,
        sweep_jobs,
        sweep_values,
        with_open_keys,
    )
    from pipeline.engine.stopping import Stopped
except KeyboardInterrupt:
    print(BEFORE_THE_FIRST_STEP, file=sys.stderr, flush=True)
    raise SystemExit(130) from None

if TYPE_CHECKING:
    from pipeline.engine.results import RunResult
    from pipeline.experiments.sweep import SweepJob


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def run(cfg: DictConfig) -> float | None:
    """Hydra's task: one run, or one job of a sweep (``-m``), whose return value goes to the sweeper."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return run_sweep_job(cfg)
    global _CLOSED
    try:
        result = _train(from_dictconfig(cfg), cfg)  # validated before any torch work: bad input never touches CUDA
        _CLOSED = True
    except PipelineError as err:
        _fail(err)
    except Stopped as stop:
        _stop(stop)
    except Exception as err:  # a bug, or a fault of the machine: the run is recorded FAILED with it already
        if debugging():
            raise  # Hydra prints the whole traceback (HYDRA_FULL_ERROR=1 is set by --debug)
        report_bug(err, debug=False)
        sys.exit(1)
    return result.metric(result.primary)


def run_sweep_job(cfg: DictConfig) -> float | None:
    """One job of a sweep. Its failure is recorded (``pipeline.experiments.sweep.failed``) and returned as None, so
    that the next job starts; the sweep exits non-zero at its end with the failures listed. Raising or exiting here
    would end the whole sweep. A stop request (SIGTERM, Ctrl-C) does end it, as it would a single run, except in a
    submitit job, whose process is its own: there the other jobs run on and the sweep ends KILLED after them.

    Returns:
        The sweep's ``optimized_metric`` for this job (what Optuna maximises), None when it failed.
    """
    from pipeline.experiments import sweep, sweep_files  # lazy: 45 modules (~0.03 s) that bad input never needs

    job = sweep.current_job()
    if sweep_files.stop_requested(job.folder):  # a stopped parallel sweep: this job was still queued in a worker
        sweep.not_started(job.folder, [(job.number, job.overrides)])
        return None
    sweep.started(job)  # a job lost with its process (a launcher's worker killed) is then told from one not run
    sweep.use_platform_start_method()
    run_cfg = None
    try:
        run_cfg = from_dictconfig(cfg)
        result = _train(run_cfg, cfg, job=job)
    except Stopped as stop:
        sweep.stopped(job, stop, stop.exit_code)
        if "SUBMITIT_EXECUTOR" in os.environ:  # a submitit job (local or SLURM): its own process, one job
            # Exiting would leave submitit no result, and the launcher would abandon the other jobs still running;
            # returning lets it wait for them. The stop is recorded: the sweep still ends KILLED and exits 1.
            print(f"{stop}; {stop.advice('<run id>')}", file=sys.stderr, flush=True)
            return None
        _stop(stop)
    except PipelineError as err:
        sweep.failed(job, err, exit_code=2, cfg=run_cfg)
        return None
    # A bug, or a runtime failure that is nobody's input (a lost GPU, a crashed loader worker): logged with its
    # traceback, recorded, and the other jobs still run.
    except Exception as err:
        sweep.failed(job, err, exit_code=1, cfg=run_cfg)
        return None
    return sweep.finished(job, result)


def _train(run_cfg: RunConfig, cfg: DictConfig, *, job: SweepJob | None = None) -> RunResult:
    """``train`` with the overrides as typed; a full disk mid-run becomes ``DiskFull``, one line naming where."""
    from hydra.core.hydra_config import HydraConfig

    from pipeline.train import train  # lazy: torch and the run's modules (~1.6 s); --help and bad input skip them

    try:
        typed = [as_typed(o) for o in HydraConfig.get().overrides.task]
        typed_overrides = typed if _TYPED_OVERRIDES is None else _TYPED_OVERRIDES
        return train(run_cfg, overrides=typed_overrides, quiet=job is not None, sweep=job, own_overrides=_OWN_OVERRIDES)
    except Exception as err:
        from pipeline.record.store import DiskFull, disk_full  # lazy: 10 modules (~5 ms), for a failed run only

        if not disk_full(err):
            raise
        uri = cfg.tracking.uri if cfg.tracking.enabled else None
        raise DiskFull.explain(err, uri=uri, also=[Path(cfg.checkpoint.dir)]) from err


def main() -> None:
    """Check plain overrides, or every job of a sweep, in one line each, then hand over to Hydra. Ctrl-C at any
    moment ends in one line and exit 130: in training, the stop's own line (``_stop``); before the first step
    (config, build, the memory estimate) or once the run is closed, ``_interrupted``'s."""
    global _TYPED_OVERRIDES, _OWN_OVERRIDES, _CLOSED
    _TYPED_OVERRIDES = _OWN_OVERRIDES = None  # a resume before this one, in this process (tests), set them
    _CLOSED = False
    frozen_at_exit()  # the interpreter's last collections at exit would walk every object the run imported (~3 s)
    joins = _joins()  # a test's process may have joined a group before: only this command's join counts
    try:
        try:
            _main()
        except KeyboardInterrupt:  # outside training, where StopRequests turns Ctrl-C into a stop at a step boundary
            _interrupted(resuming=any(a.startswith("resume=") for a in sys.argv[1:]))
    except SystemExit as end:
        if _joins() > joins:
            _leave_the_job(end.code)
        raise
    if _joins() > joins:
        _leave_the_job(0)


def _joins() -> int:
    """How many times this process has joined a distributed job's process group (the module that joins one is
    loaded by then)."""
    distributed = sys.modules.get("pipeline.parallel.distributed")
    return 0 if distributed is None else distributed.joins()


def _leave_the_job(code: int | str | None) -> NoReturn:
    """A rank of a distributed job ends here, without the interpreter's teardown, where Gloo's threads can abort
    it after its run has finished; any other process returns and exits as usual. (An unexpected exception, which
    prints its traceback, does not come here.)"""
    if isinstance(code, str):  # as Python would: the message on stderr, status 1
        print(code, file=sys.stderr)
    exit_without_teardown(code if isinstance(code, int) else int(code is not None))


def _interrupted(*, resuming: bool) -> NoReturn:
    if _CLOSED:
        print("interrupted while exiting: the run had finished and is recorded", file=sys.stderr, flush=True)
    elif resuming:
        print(
            "interrupted before the first step: the run is as it was; continue it with the same command",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(BEFORE_THE_FIRST_STEP, file=sys.stderr, flush=True)
    sys.exit(130)


def _main() -> None:
    if DEBUG_FLAG in sys.argv[1:]:  # ours, not Hydra's: tracebacks in full, Hydra's own included
        sys.argv.remove(DEBUG_FLAG)
        os.environ["HYDRA_FULL_ERROR"] = "1"
    args = sys.argv[1:]
    plain = not any(a.startswith("-") for a in args)  # Hydra's own overrides (hydra/launcher=..., hydra.x=...) too
    try:
        if plain and sweep_values(args):  # a search whose config runs it as a sweep (hydra.mode: MULTIRUN)
            check_multirun(args)
            check_sweep(args)
        elif plain:
            load(args)  # Hydra reports these in several lines and exits 1; we say it in one and exit 2
            if any(a.startswith("resume=") for a in args):
                _continue_the_run(args)
        else:
            check_flags(args)
            if "-m" in args or "--multirun" in args:
                check_sweep(args)
    except PipelineError as err:
        _fail(err)
    sys.argv[1:] = with_open_keys(sys.argv[1:])  # model.emsize=64: a keyword, set or added, without a +
    try:
        run()
    finally:  # a sweep Hydra ended early (a stop request, a sweeper's error) still gets its parent run closed
        from pipeline.experiments.sweep import end_unfinished  # lazy: as run_sweep_job's; bad input exits first

        end_unfinished()


_CLOSED = False  # the run trained and was closed: a Ctrl-C now interrupts only the exit
# A resume's overrides as typed, when Hydra composes the run's own (``_continue_the_run``), and the run's own
# overrides as its next checkpoint keeps them.
_TYPED_OVERRIDES: list[str] | None = None
_OWN_OVERRIDES: list[str] | None = None


def _continue_the_run(args: list[str]) -> None:
    """A resume composes the run's own overrides (from its checkpoint) plus those typed now
    (``pipeline.engine.checkpointing.continuation``): Hydra is handed the merged list, the record keeps what was
    typed."""
    global _TYPED_OVERRIDES, _OWN_OVERRIDES
    from pipeline.engine.checkpointing.continuation import continued  # lazy: torch (~1.4 s), for a resume only

    merged, _OWN_OVERRIDES = continued(args)
    _TYPED_OVERRIDES = list(args)
    sys.argv[1:] = merged


def check_flags(args: list[str]) -> None:
    """The folders Hydra's flags name exist (Hydra says it in several lines and exits 1).

    Raises:
        OverrideError: ``--config-dir`` names no folder.
    """
    from hydra._internal.utils import get_args_parser

    parsed, _ = get_args_parser().parse_known_args(args)
    if parsed.config_dir and not Path(parsed.config_dir).is_dir():
        raise OverrideError(f"--config-dir {parsed.config_dir}: no such folder")


def check_sweep(args: list[str]) -> None:
    """Validate every job of ``-m ...`` before Hydra starts the first (which would run before the second fails).

    Commands that run no job (``--help``, ``--cfg``, ``--info``), another primary config (``--config-name``...) and
    sweeps whose jobs the basic sweeper cannot list (``interval()``, another sweeper) are left to Hydra.

    Raises:
        PipelineError: the first bad job, named by its overrides; ``OverrideError`` for one Hydra cannot parse.
    """
    from hydra._internal.utils import get_args_parser

    parsed, unknown = get_args_parser().parse_known_args(args)
    elsewhere = (parsed.config_path, parsed.config_name, parsed.config_dir, parsed.experimental_rerun)
    shows = (parsed.help, parsed.hydra_help, parsed.cfg, parsed.info, parsed.shell_completion, parsed.run)
    if unknown or any(elsewhere) or any(shows):
        return
    if any(o.lstrip("+~").startswith("hydra") for o in parsed.overrides):  # Hydra's groups: its launcher...
        listed = sweep_values(parsed.overrides)  # ...and sweeper (with what chooses it: hparams_search=...), which
        load([o for o in parsed.overrides if o not in listed])  # the jobs leave out: a wrong one is one line
    jobs = sweep_jobs(parsed.overrides)
    if jobs is None:  # an interval() or another sweeper: refused here only where the sweeper cannot run it
        check_search_space(parsed.overrides)
    for number, job in enumerate(jobs or [], start=1):
        try:
            load(job)
        except PipelineError as err:
            raise PipelineError(
                f"sweep job {number} of {len(jobs)} ({' '.join(mask_overrides(job))}): {err}; no job was started"
            ) from err


def _fail(err: PipelineError) -> NoReturn:
    """One line; under ``--debug`` the traceback of what caused it first (a user's factory that raised)."""
    if debugging() and err.__cause__ is not None:
        import traceback

        traceback.print_exception(err.__cause__, file=sys.stderr)
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


def _stop(stop: Stopped) -> NoReturn:
    """SIGTERM / Ctrl-C: checkpoint written (unless checkpoints are off), run KILLED; exit as the signal would."""
    print(f"{stop}; {stop.advice()}", file=sys.stderr, flush=True)
    sys.exit(stop.exit_code)


if __name__ == "__main__":
    main()
