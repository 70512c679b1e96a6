"""From the command line to a validated ``RunConfig``: Hydra's composition of ``conf/`` (``compose``,
``load``), the jobs of a ``-m`` sweep listed so that each is validated before the first one starts
(``sweep_jobs``), and the typed reading of the composed tree (``from_dictconfig``): unknown keys, wrong types and
invalid values raise ``ConfigError`` naming the dotted key. Every float must be finite (``inf`` and ``nan`` pass
most range checks unnoticed) unless its field says ``metadata={"nonfinite": True}``.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from pipeline.common.errors import ConfigError, OverrideError
from pipeline.common.secrets import env_keys
from pipeline.config.data import DataConfig
from pipeline.config.schema import MAX_TAG_KEY, MISSING_VALUE, MOVED, TAGS_PREFIX, RunConfig, _at_most
from pipeline.config.targets import TargetConfig

OPEN_GROUPS = ("model", "data", "optimizer", "scheduler", "step")  # groups whose new keys are a _target_'s keywords
FORCED = "++"  # Hydra's "set, or add if new": what a keyword group's key is handed to Hydra as


def config_dir() -> Path:
    """The folder holding ``config.yaml``: inside the installed wheel, else the source checkout."""
    package = Path(__file__).resolve().parents[1]  # src/pipeline, or the installed pipeline
    packaged = package / "conf"
    if packaged.is_dir():
        return packaged
    checkout = package.parents[1] / "conf"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"pipeline's config tree is missing: looked in {packaged} and {checkout}")


def with_open_keys(overrides: Sequence[str]) -> list[str]:
    """The overrides as Hydra is handed them: a key of a keyword group (``model.emsize=64``: a keyword of the group's
    ``_target_``) as ``++model.emsize=64``, which sets it or adds it, so no ``+`` is needed for a new one; everything
    else as typed. An unknown keyword is then the target's to refuse, naming the keywords it takes."""
    return [FORCED + o if opens_a_key(o) else o for o in overrides]


def opens_a_key(override: str) -> bool:
    """Whether ``override`` sets a keyword of a group's target (``model.emsize=64``), as typed without a prefix. The
    data group's own keys (``data.num_samples``) stay Hydra's to refuse where the chosen source has no such key: only
    the user's factory takes keywords."""
    key, sep, _ = override.partition("=")
    if not sep or "." not in key or key.startswith(("+", "~")) or key.split(".")[0] not in OPEN_GROUPS:
        return False
    return not (key.startswith("data.") and key.split(".")[1] in DATA_KEYS)


DATA_KEYS = frozenset(f.name for f in dataclasses.fields(DataConfig))  # the data group's own, of every source


def as_typed(override: str) -> str:
    """An override as the user typed it, from the form ``with_open_keys`` handed to Hydra."""
    return override[len(FORCED) :] if override.startswith(FORCED) and opens_a_key(override[len(FORCED) :]) else override


def compose(overrides: Sequence[str] = ()) -> Any:
    """Compose ``conf/`` with command-line style overrides, as ``python -m pipeline`` would.

    Raises:
        OverrideError: an unknown group option or key, or an override Hydra cannot parse; one line.
        ConfigError: a ``tracking.tags`` key longer than MLflow takes (Hydra would fail on it as a file name).
    """
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        if key.startswith(TAGS_PREFIX) and len(key) - len(TAGS_PREFIX) > MAX_TAG_KEY:
            raise ConfigError(key, value, _at_most(MAX_TAG_KEY, "tag keys"))
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            return hydra_compose("config", overrides=with_open_keys(overrides))
    except MissingConfigException as err:
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        if err.options and group:
            raise OverrideError(
                f"{group}={option} is not an option: expected one of {', '.join(err.options)}"
            ) from None
        raise OverrideError(str(err).splitlines()[0]) from None
    except OverrideParseException as err:
        raise OverrideError(f"cannot parse the overrides {' '.join(overrides)!r}: {str(err).splitlines()[0]}") from None
    except HydraException as err:
        lines = [line for line in str(err).splitlines() if line]
        key = getattr(err.__cause__, "full_key", None)
        if key and "To append" in str(err):
            parent = key.rpartition(".")[0]
            if key in MOVED:
                raise OverrideError(f"{key} moved: use {MOVED[key]}") from None
            if parent in OPEN_GROUPS:  # a keyword for the group's _target_: new keys take a +
                raise OverrideError(
                    f"{key} is not a key of {parent} yet: to pass it to {parent}._target_ as a keyword, add it with "
                    f"a +: +{key}=..."
                ) from None
            raise OverrideError(
                f"{key} is not a config key{f' of {parent}' if parent else ''}: check the spelling "
                f"(python -m pipeline --cfg {'hydra' if key.startswith('hydra.') else 'job'} shows every key)"
            ) from None
        raise OverrideError("; ".join(lines)) from None
    except OSError as err:  # Hydra looks a key up as a config group's file: a long one is too long a file name
        if err.errno != errno.ENAMETOOLONG:
            raise
        long = next((o for o in overrides if len(o.partition("=")[0]) > MAX_TAG_KEY), "")
        raise OverrideError(f"{long[:80]}...: not a config key (too long)") from None


def load(overrides: Sequence[str] = ()) -> RunConfig:
    """``compose`` then ``from_dictconfig``: the validated config for these overrides."""
    return from_dictconfig(compose(overrides))


def from_dictconfig(cfg: Any) -> RunConfig:
    """Validate Hydra's composed config and return it typed.

    Args:
        cfg: the ``DictConfig`` handed to the Hydra task (or any mapping of the same shape).

    Returns:
        The whole run's config, every group checked.

    Raises:
        ConfigError: the first invalid key, with its value and what is allowed.
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    sensitive: frozenset[str] = frozenset()
    if isinstance(cfg, DictConfig):
        sensitive = env_keys(cfg)
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", None) or "config"
            unset = re.search(r"Environment variable '([^']+)' not found", str(err))
            if unset:
                name = unset.group(1)
                raise ConfigError(
                    key,
                    f"${{oc.env:{name}}}",
                    f"a set environment variable, and {name} is not set: export {name}=... before the command, or "
                    f"give a default: ${{oc.env:{name},<default>}}",
                ) from None
            first = str(err.msg).strip().splitlines()[0]
            raise ConfigError(key, "<unresolved>", f"a value that resolves ({first})") from None
    return dataclasses.replace(_build(RunConfig, cfg, prefix=""), env_keys=sensitive)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted keys: ``{"loader": {"batch_size": 64}}`` -> ``{"loader.batch_size": 64}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, prefix=f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _build(cls: type, node: Any, prefix: str) -> Any:
    if not isinstance(node, Mapping):
        raise ConfigError(prefix.rstrip(".") or "config", node, "a group of keys")
    hints = typing.get_type_hints(cls)
    settable = [f for f in fields(cls) if not f.metadata.get("internal")]
    spread = next((f for f in settable if f.metadata.get("spread")), None)
    fixed = [f for f in settable if f is not spread]
    if spread is not None:  # a group whose other keys are a _target_'s keywords (pipeline.config.targets)
        opener = getattr(cls, "open_fields", None)
        kept = opener(node) if opener is not None else frozenset(f.name for f in fixed)
        if kept is None:
            spread = None
        else:
            fixed = [f for f in fixed if f.name in kept]
    known = [f.name for f in fixed]
    kwargs = {}
    if spread is not None:
        kwargs[spread.name] = {k: _keyword(v, f"{prefix}{k}") for k, v in node.items() if k not in known}
    else:
        for key in node:
            if key not in known:
                moved = MOVED.get(f"{prefix}{key}")
                if moved:
                    raise ConfigError(f"{prefix}{key}", node[key], f"nothing here: it moved to {moved}")
                where = f"{prefix.rstrip('.')} keys" if prefix else "top-level keys"
                raise ConfigError(f"{prefix}{key}", node[key], f"one of the {where}: {', '.join(known)}")
    for f in fixed:
        key = f"{prefix}{f.name}"
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in node or node[f.name] == MISSING_VALUE:
            if required or node.get(f.name) == MISSING_VALUE:
                raise ConfigError.missing(key)
            continue
        kwargs[f.name] = _coerce(node[f.name], hints[f.name], key, finite=not f.metadata.get("nonfinite"))
    built = cls(**kwargs)
    if hasattr(built, "check"):
        built.check()
    return built


def _keyword(value: Any, key: str) -> Any:
    """A keyword for a ``_target_``, as composed: any plain value, none of it still ``???``."""
    if isinstance(value, Mapping):
        return {str(k): _keyword(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_keyword(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if value == MISSING_VALUE:
        raise ConfigError.missing(key)
    return value


def _coerce(value: Any, hint: Any, key: str, *, finite: bool = True) -> Any:
    if dataclasses.is_dataclass(hint):
        if isinstance(value, str) and hint is TargetConfig:  # data.collate_fn=mymodule.pad: a target, no keywords
            value = {"_target_": value}
        return _build(hint, value, prefix=f"{key}.")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        concrete = [o for o in options if o is not type(None)]
        if isinstance(value, Mapping):  # a group of keys: the one option that is a group, with its own errors
            concrete = [o for o in concrete if dataclasses.is_dataclass(o)] or concrete
        if len(concrete) == 1:  # `X | None`: X's own, more precise error
            return _coerce(value, concrete[0], key, finite=finite)
        for option in concrete:
            try:
                return _coerce(value, option, key, finite=finite)
            except ConfigError:
                continue
        raise ConfigError(key, value, " or ".join(_describe(o) for o in options))
    if origin is Literal:
        if value in typing.get_args(hint) and not isinstance(value, bool):
            return value
        raise ConfigError(key, value, _describe(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise ConfigError(key, value, _describe(hint))
        return [_coerce(v, item, f"{key}[{i}]", finite=finite) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, value, _describe(hint))
        return {str(k): str(v) for k, v in value.items()}
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and is_number and isinstance(value, int):
        return value
    if hint is float and is_number:
        if finite and not math.isfinite(value):  # inf and nan slip through `x > 0` and `x < 0` alike
            raise ConfigError(key, value, "a finite number")
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise ConfigError(key, value, _describe(hint))


def _describe(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list ({_describe(typing.get_args(hint)[0])} each)"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
