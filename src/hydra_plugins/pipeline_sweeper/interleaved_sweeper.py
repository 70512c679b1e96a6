"""``hydra/sweeper=interleaved``: Hydra's basic sweeper with a sweep's repeats interleaved (``pipeline.config.design``).

It lists the same jobs as the basic sweeper (comma lists, ``range()``, ``glob()``, ``hydra.sweeper.params``) and
hands them to whatever launcher is configured; only their order differs (drawn at random within each round), and
it writes which round each job is in, and the seed of the order, to ``<hydra.sweep.dir>/design.json`` for the jobs
to tag their runs with (``sweep.round``, ``sweep.design_seed``).
"""

from __future__ import annotations

from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override


class InterleavedSweeper(BasicSweeper):
    """The basic sweeper, repeats interleaved round by round in a random order; see ``pipeline.config.design``.

    Args:
        seed: draws each round's order; None draws a fresh one. Recorded either way (``design.json``, the tag
            ``sweep.design_seed``), so ``hydra.sweeper.seed=<it>`` runs the same order again.
    """

    def __init__(self, max_batch_size: int | None, params: dict[str, str] | None = None, seed: int | None = None):
        super().__init__(max_batch_size, params)
        self.seed = seed

    def split_arguments(self, overrides: list[Override], max_batch_size: int | None) -> list[list[list[str]]]:  # type: ignore[override]
        # lazy: Hydra imports every plugin as it starts, in any Hydra app here: these are 26 modules (~0.03 s)
        from pipeline.config.design import draw_seed, interleave
        from pipeline.config.search_space import axes
        from pipeline.experiments.sweep_files import save_design

        plan = interleave(axes(overrides), seed=draw_seed() if self.seed is None else int(self.seed))
        if self.config is not None:
            folder = Path(str(self.config.hydra.runtime.cwd), str(self.config.hydra.sweep.dir))
            save_design(folder, plan.rounds, plan.jobs, seed=plan.seed, configs=plan.configs)
        size = len(plan.jobs) if max_batch_size in (None, -1) else max_batch_size
        return [plan.jobs[i : i + size] for i in range(0, len(plan.jobs), size)] or [[]]
