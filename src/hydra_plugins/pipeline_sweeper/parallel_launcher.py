"""``hydra/launcher=parallel``: Hydra's joblib launcher, whose sweep still ends in a record when a worker dies.

When one of loky's worker processes dies (``kill -9``, the OOM killer, a crash in native code), loky kills every
other worker too and joblib raises ``TerminatedWorkerError``: the healthy jobs beside it die mid-run, the queued
ones never start, and Hydra's launcher ends the sweep in a traceback with runs left RUNNING. This launcher records
the batch instead (``pipeline.sweep.lost``: the jobs that were running FAILED, their runs too; the others not
run), closes the sweep's parent FAILED with the list, and exits 1 with one ``error:`` line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher  # joblib itself: only in launch


class ParallelLauncher(JoblibLauncher):
    """Hydra's ``JoblibLauncher``; a batch that loses a worker is recorded and ends the sweep (exit 1)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from joblib.externals.loky.process_executor import TerminatedWorkerError

        try:
            return super().launch(job_overrides, initial_job_idx)
        except TerminatedWorkerError as err:
            from pipeline import sweep

            assert self.config is not None  # set by setup() before any launch
            folder = Path(str(self.config.hydra.runtime.cwd), str(self.config.hydra.sweep.dir))
            jobs = [(initial_job_idx + i, overrides) for i, overrides in enumerate(job_overrides)]
            sweep.lost(folder, jobs, worker_died(err))
            sys.exit(sweep.end_sweep(folder, complete=False))


def worker_died(err: BaseException) -> str:
    """One line for a lost job: what happened to its process, from loky's message (its workers' exit codes)."""
    codes = str(err).rpartition("The exit codes of the workers are ")[2].strip() or "unknown"
    return (
        f"a worker process of the parallel launcher died (exit codes {codes}: killed by a signal or the OOM "
        "killer, or a crash); loky then ended every job running beside it. Run the lost jobs again; if memory ran "
        "out, with fewer at once (hydra.launcher.n_jobs=1)"
    )
