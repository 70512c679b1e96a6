"""``hydra/sweeper=interleaved``: Hydra's basic sweeper with a sweep's repeats interleaved (``pipeline.config.design``).

It lists the same jobs as the basic sweeper (comma lists, ``range()``, ``glob()``, ``hydra.sweeper.params``) and
hands them to whatever launcher is configured; only their order differs (drawn at random within each round), and
it writes which round each job is in, and the seed of the order, to ``<hydra.sweep.dir>/design.json`` for the jobs
to tag their runs with (``sweep.round``, ``sweep.design_seed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
        from pipeline.config.design import draw_seed, interleave
        from pipeline.experiments.sweep_files import save_design

        plan = interleave(axes(overrides), seed=draw_seed() if self.seed is None else int(self.seed))
        if self.config is not None:
            folder = Path(str(self.config.hydra.runtime.cwd), str(self.config.hydra.sweep.dir))
            save_design(folder, plan.rounds, plan.jobs, seed=plan.seed, configs=plan.configs)
        size = len(plan.jobs) if max_batch_size in (None, -1) else max_batch_size
        return [plan.jobs[i : i + size] for i in range(0, len(plan.jobs), size)] or [[]]


def axes(overrides: list[Override]) -> list[tuple[str, list[str]]]:
    """Each key with its overrides, as the basic sweeper expands them (its errors for sweeps it cannot list)."""
    listed: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                from hydra.errors import HydraException

                kind: Any = override.value_type
                raise HydraException(f"{BasicSweeper.__name__} does not support sweep type : {kind.name}")
            listed[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            listed[key] = [f"{key}={override.get_value_element_as_str()}"]
    return list(listed.items())


def check_search_space(overrides: list[str]) -> None:
    """Refuse a continuous search space (``interval()``) when the sweep's sweeper can only list jobs: the basic and
    interleaved sweepers raise on it once the sweep has begun, in a traceback. Optuna's is left to Optuna.

    Raises:
        OverrideError: naming the override and the Optuna search that runs it.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from pipeline.common.errors import OverrideError
    from pipeline.config import config_dir

    parsed = OverridesParser.create().parse_overrides(overrides)
    spaces = [o for o in parsed if o.is_sweep_override() and not o.is_discrete_sweep() and not o.is_hydra_override()]
    if not spaces:
        return
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            fixed = [o.input_line for o in parsed if not o.is_sweep_override()]  # what chooses the sweeper
            sweeper = str(compose("config", overrides=fixed, return_hydra_config=True).hydra.sweeper._target_)
    except HydraException:  # a bad group or key: the job checks say so, in one line
        return
    if sweeper.endswith((".BasicSweeper", ".InterleavedSweeper")):
        raise OverrideError(
            f"{spaces[0].input_line} needs an Optuna search: add hparams_search=accuracy_optuna (or "
            f"hparams_search=throughput_optuna, or hydra/sweeper=optuna); the {sweeper.rpartition('.')[2]} runs "
            "lists (a,b,c), range() and choice() only"
        )
