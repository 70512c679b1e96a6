"""What a sweep's command line lists, read before the sweep starts: its jobs (``sweep_jobs``), each key's values as
Hydra's basic sweeper expands them (``axes``), and a continuous search space refused where the sweeper can only
list jobs (``check_search_space``).

``python -m pipeline -m`` validates every job with these before the first one starts; the interleaved sweeper
(``hydra_plugins.pipeline_sweeper``) lists its jobs with ``axes`` and orders them with ``pipeline.config.design``.
Hydra is imported inside the functions: a single run never pays for its override parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.common.errors import OverrideError
from pipeline.config.compose import config_dir, with_open_keys
from pipeline.config.design import interleave

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override


def sweep_jobs(overrides: Sequence[str]) -> list[list[str]] | None:
    """The jobs ``python -m pipeline -m ...`` runs, each as its overrides, expanded by Hydra's own parser as its
    basic sweeper does (comma lists, ``range()``, ``choice()``, ``glob()`` over a group's options), in one
    order the interleaved sweeper can draw (``pipeline.config.design``, seed 0). ``hydra...``
    overrides configure Hydra, not a job, and are left out, as the sweeper leaves them out.

    Returns:
        One list of overrides per job, in launch order; None when the jobs cannot be listed here: a continuous
        search space (``interval()``) or another sweeper (``hydra/sweeper=...``), whose jobs Hydra decides.

    Raises:
        OverrideError: an override Hydra cannot parse, or a ``glob()`` over something that is not a group.
    """
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())  # glob() lists options
        try:
            parsed = parser.parse_overrides(list(overrides))
        except OverrideParseException as err:
            raise OverrideError(
                f"cannot parse the overrides {' '.join(overrides)!r}: {str(err).splitlines()[0]}"
            ) from None
        if any(o.key_or_group == "hydra/sweeper" for o in parsed):
            return None
        task = [o for o in parsed if not o.is_hydra_override()]
        if any(o.is_sweep_override() and not o.is_discrete_sweep() for o in task):
            return None
        try:
            return interleave(axes(task), seed=0).jobs  # every job, each checked; the order the sweep draws may differ
        except HydraException as err:
            raise OverrideError(str(err).splitlines()[0]) from None


def axes(overrides: list[Override]) -> list[tuple[str, list[str]]]:
    """Each key with its overrides, as the basic sweeper expands them (its errors for sweeps it cannot list)."""
    listed: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                from hydra.errors import HydraException

                kind: Any = override.value_type
                raise HydraException(f"BasicSweeper does not support sweep type : {kind.name}")  # the sweeper's words
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

    parsed = OverridesParser.create().parse_overrides(overrides)
    spaces = [o for o in parsed if o.is_sweep_override() and not o.is_discrete_sweep() and not o.is_hydra_override()]
    if not spaces:
        return
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            fixed = [o.input_line for o in parsed if not o.is_sweep_override()]  # what chooses the sweeper
            hydra = compose("config", overrides=with_open_keys(fixed), return_hydra_config=True).hydra
            sweeper = str(hydra.sweeper._target_)
    except HydraException:  # a bad group or key: the job checks say so, in one line
        return
    if sweeper.endswith((".BasicSweeper", ".InterleavedSweeper")):
        raise OverrideError(
            f"{spaces[0].input_line} needs an Optuna search: add hparams_search=accuracy_optuna (or "
            f"hparams_search=throughput_optuna, or hydra/sweeper=optuna); the {sweeper.rpartition('.')[2]} runs "
            "lists (a,b,c), range() and choice() only"
        )


def sweep_values(overrides: Sequence[str]) -> list[str]:
    """The overrides that list values to sweep (``a,b``, ``choice()``, ``range()``, ``interval()``), as typed; [] for
    a single run's. One that Hydra cannot parse is left to the composition, which says so in one line."""
    if not any("," in o or "(" in o for o in overrides):  # a list or a function: what every sweep value holds
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException:
        return []
    return [o.input_line for o in parsed if o.is_sweep_override() and not o.is_hydra_override()]


def check_multirun(overrides: Sequence[str]) -> None:
    """Values to sweep typed without ``-m`` are a sweep only where the composed config says so (an Optuna search's
    ``hydra.mode: MULTIRUN``, e.g. ``hparams_search=accuracy_optuna``).

    Raises:
        OverrideError: naming the first of them and the ``-m`` to add.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    listed = sweep_values(overrides)
    fixed = [o for o in overrides if o not in listed]
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            mode = compose("config", overrides=with_open_keys(fixed), return_hydra_config=True).hydra.mode
    except HydraException:  # a bad group or key: the job checks say so, in one line
        return
    if str(mode) != "RunMode.MULTIRUN" and str(mode) != "MULTIRUN":
        raise OverrideError(
            f"{listed[0]} lists values to sweep: add -m (python -m pipeline -m {' '.join(overrides)}), or set one value"
        )
