"""``hydra/launcher=parallel``: Hydra's joblib launcher, whose sweep still ends in a record when a worker dies.

When one of loky's worker processes dies (``kill -9``, the OOM killer, a crash in native code), loky kills every
other worker too and joblib raises ``TerminatedWorkerError``: the healthy jobs beside it die mid-run, the queued
ones never start, and Hydra's launcher ends the sweep in a traceback with runs left RUNNING. This launcher records
the batch instead (``pipeline.experiments.sweep.lost``: the jobs that were running FAILED, their runs too; the
others not run), closes the sweep's parent FAILED with the list, and exits 1 with one ``error:`` line.

A stop request to the launching process (SIGTERM, Ctrl-C) would otherwise kill it alone: its parent run left
RUNNING, loky's workers orphaned and running on. While it waits for its jobs it passes the signal on to the workers
instead (each job stops at a step boundary with a checkpoint, its run KILLED), waits for them (``STOP_WAIT_S``),
records the jobs that never started ``NOT_RUN``, ends the parent KILLED and exits 128 + the signal's number.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher  # joblib itself: only in launch

from pipeline.common.signals import signal_name


class ParallelLauncher(JoblibLauncher):
    """Hydra's ``JoblibLauncher``; a batch that loses a worker is recorded and ends the sweep (exit 1)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from joblib.externals.loky.process_executor import TerminatedWorkerError

        # lazy: Hydra imports every plugin as it starts, in any Hydra app here: these are 48 modules (~0.03 s)
        from pipeline.engine.stopping import stop_signals
        from pipeline.experiments import sweep

        assert self.config is not None  # set by setup() before any launch
        folder = Path(str(self.config.hydra.runtime.cwd), str(self.config.hydra.sweep.dir))
        jobs = [(initial_job_idx + i, overrides) for i, overrides in enumerate(job_overrides)]
        stop = StopSweep(folder, jobs)
        previous = {sig: signal.signal(sig, stop.handle) for sig in stop_signals()}  # for the wait only
        try:
            return super().launch(job_overrides, initial_job_idx)
        except TerminatedWorkerError as err:
            if stop.signum is None:
                sweep.lost(folder, jobs, worker_died(err))
                sys.exit(sweep.end_sweep(folder, complete=False))
            stop.end()  # a worker that died of the stop signal itself (between two steps of loky's)
        except StopLaunch:
            stop.end()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        raise AssertionError("unreachable")  # stop.end() exits


STOP_WAIT_S = 120.0  # how long the stopped jobs get to write their checkpoints and end their runs


class StopLaunch(BaseException):
    """Raised in the launching process once its stopped workers are done: ends joblib's wait (``launch``)."""


class StopSweep:
    """The launcher's stop: the first SIGTERM / Ctrl-C marks the sweep stopping (queued jobs then do not start),
    passes the signal on to loky's workers, waits for the jobs that had started to record their stop, then ends
    joblib's wait (``StopLaunch``); a second one only says the sweep is already stopping."""

    def __init__(self, folder: Path, jobs: list[tuple[int, Sequence[str]]]) -> None:
        self.folder, self.jobs = folder, jobs
        self.signum: int | None = None
        self.workers: list[int] = []

    def handle(self, signum: int, frame: FrameType | None) -> None:
        from pipeline.experiments import sweep_files  # lazy: as launch's imports (loaded by now)

        if self.signum is not None:
            print(f"{signal_name(signum)} received: the sweep is already stopping (kill -9 abandons it)", flush=True)
            return
        self.signum = signum
        sweep_files.request_stop(self.folder, signum)  # first: a job a worker takes from its queue now is not started
        self.workers = worker_pids()
        for pid in self.workers:
            try:
                os.kill(pid, signum)  # the job's StopRequests: a checkpoint, its run KILLED
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and not self.recorded():
            time.sleep(0.2)
        raise StopLaunch

    def recorded(self) -> bool:
        """Whether every job that started has its outcome (or its worker is gone)."""
        import psutil

        jobs = self.folder / "jobs"
        running = [n for n, _ in self.jobs if (jobs / f"{n}.started").exists() and not (jobs / f"{n}.json").exists()]
        return not running or not any(psutil.pid_exists(pid) for pid in self.workers)

    def end(self) -> None:
        """Stop loky's workers (idle by now, or dropping a queued job), record the jobs left, end the parent KILLED,
        exit 128 + the signal's number."""
        from pipeline.experiments import sweep  # lazy: as launch's imports (loaded by now)

        assert self.signum is not None
        stop_workers(self.workers)
        lost = "the sweep was stopped while this job ran and it did not record its stop in time; its worker was killed"
        sweep.lost(self.folder, self.jobs, lost)  # started: FAILED unless recorded KILLED; the rest NOT_RUN
        print(f"stopped by {signal_name(self.signum)}: each running job stopped at a step boundary", flush=True)
        sweep.end_sweep(self.folder, complete=False)
        sys.exit(128 + self.signum)


def worker_pids() -> list[int]:
    """The pids of loky's worker processes (joblib's reusable executor), [] when there is none."""
    from joblib.externals.loky import reusable_executor

    executor = reusable_executor._executor
    return [int(pid) for pid in getattr(executor, "_processes", {}) or {}]


def stop_workers(pids: Sequence[int], timeout: float = 10.0) -> None:
    """End loky's executor and kill its workers: none is left to run a job after the launcher exits."""
    import psutil
    from joblib.externals.loky import reusable_executor

    procs = []
    for pid in [*pids, *worker_pids()]:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(procs, timeout=timeout)
    executor = reusable_executor._executor
    if executor is not None:
        executor.shutdown(wait=False, kill_workers=True)


def worker_died(err: BaseException) -> str:
    """One line for a lost job: what happened to its process, from loky's message (its workers' exit codes)."""
    codes = str(err).rpartition("The exit codes of the workers are ")[2].strip() or "unknown"
    return (
        f"a worker process of the parallel launcher died (exit codes {codes}: killed by a signal or the OOM "
        "killer, or a crash); loky then ended every job running beside it. Run the lost jobs again; if memory ran "
        "out, with fewer at once (hydra.launcher.n_jobs=1)"
    )
