"""``hparams_search=...``: Hydra's Optuna sweeper, whose search ends in the sweep's own record when no trial counts.

When every trial failed (or returned no finite value), Optuna has no best trial and Hydra's sweeper raises
``ValueError: No trials are completed yet`` after the last one, in a traceback. This sweeper closes the sweep as any
other ends (``pipeline.experiments.sweep.end_sweep``: the parent FAILED, each failed trial listed in one line) and
exits 2 when every failure was the user's to fix, else 1.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper  # optuna itself: only in sweep
from omegaconf import DictConfig


class OptunaSearchSweeper(OptunaSweeper):
    """Hydra's ``OptunaSweeper``; a search without a single completed trial ends in its list, not a traceback."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        # lazy: Hydra imports every plugin as it starts, in any Hydra app here: this is 48 modules (~0.03 s)
        from pipeline.experiments import sweep

        try:
            return super().sweep(arguments)
        except ValueError:
            assert self.config is not None  # set by setup() before any sweep
            folder = sweep.sweep_folder(self.config.hydra)
            if any(o.status == "FINISHED" and o.value is not None for o in sweep.load_outcomes(folder)):
                raise  # a trial completed: not the search without a best trial, so not ours to explain
            code = sweep.end_sweep(folder)
            if code == 0:  # every trial finished, none with a finite value to rank
                info = sweep.Sweep.load(folder)
                metric = info.metric if info else "value"
                print(f"error: no trial returned a finite {metric}: Optuna has no best trial", file=sys.stderr)
                code = 1
            sys.exit(code)
