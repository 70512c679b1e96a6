"""Keeping secrets out of the record: params, tags and config artifacts are masked.

Masked: every value resolved from an environment variable (``${oc.env:...}``), every key that
looks like a password, token, secret, credential or API key, and the ``user:password@`` part
of any URI. The run still uses the real values; only what is written to MLflow is masked.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"
SECRET_KEY = re.compile(r"(pass(word|wd)?|secret|token|api[_-]?key|credential|private[_-]?key|auth)", re.IGNORECASE)
URI_CREDENTIALS = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<password>[^@/\s]+)@", re.IGNORECASE
)


def env_keys(cfg: Any) -> frozenset[str]:
    """Dotted keys of a composed (unresolved) config whose values come from ``${oc.env:...}``."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    return frozenset(k for k, v in _flatten(raw) if isinstance(v, str) and "oc.env:" in v)


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(key.rsplit(".", 1)[-1]))


def mask_text(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:***@host``, anywhere in ``text``."""
    return URI_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)


def mask_value(key: str, value: Any, sensitive: Iterable[str] = ()) -> Any:
    if key in sensitive or (is_secret_key(key) and value not in (None, "")):
        return MASK
    return mask_text(value) if isinstance(value, str) else value


def mask_tree(tree: Mapping[str, Any], sensitive: Iterable[str] = (), prefix: str = "") -> dict[str, Any]:
    """A nested config with every sensitive leaf masked (for config.yaml)."""
    sensitive = frozenset(sensitive)
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out[key] = mask_tree(value, sensitive, prefix=f"{dotted}.")
        else:
            out[key] = mask_value(dotted, value, sensitive)
    return out


def mask_overrides(overrides: Iterable[str], sensitive: Iterable[str] = ()) -> list[str]:
    """Command-line overrides as typed, with sensitive values masked: ``db.password=***``."""
    sensitive = frozenset(sensitive)
    masked = []
    for override in overrides:
        key, sep, value = override.partition("=")
        name = key.lstrip("+~")
        if sep and (name in sensitive or is_secret_key(name) or "oc.env:" in value):
            masked.append(f"{key}={MASK}")
        else:
            masked.append(mask_text(override))
    return masked


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if not isinstance(tree, Mapping):
        return [(prefix.rstrip("."), tree)]
    items: list[tuple[str, Any]] = []
    for key, value in tree.items():
        items += (
            _flatten(value, f"{prefix}{key}.") if isinstance(value, Mapping) and value else [(f"{prefix}{key}", value)]
        )
    return items
