"""Keeping secrets out of the record: everything written to MLflow is masked.

Masked: every value resolved from an environment variable (``${oc.env:...}``), wherever it lands
(params, tags, the run's name, the error and the summary note, artifacts, the dataset's source);
every key that looks like a password, token, secret, credential or API key; ``key: value`` and
``key=value`` pairs of such keys and ``Bearer`` tokens inside longer text; and the
``user:password@`` part of any URI. The run still uses the real values; only what is written to
MLflow is masked: ``train`` passes ``env_values(cfg)`` to ``open_tracker``, whose tracker masks
every string it sends with them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re
import types
import typing
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pipeline.common.errors import ConfigError
from pipeline.common.uris import absolute, sqlite_database

MASK = "***"
URI_CREDENTIALS = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<password>[^@/\s]+)@", re.IGNORECASE
)
ENV_REFERENCE = re.compile(r"\$\{oc\.env:\s*['\"]?(?P<name>[^,'\"}\s]+)")

# A key is secret when one of its words is (words split at ``_ - .`` and camelCase, compared lower-case).
SECRET_WORDS = frozenset({"pwd", "pass", "auth", "authorization", "bearer"})
# ...or a word ends with one of these (dbpassword, authtoken, apikey): "tokenizer", "bypass", "passes" and
# "max_tokens" stay readable.
SECRET_ENDINGS = re.compile(
    r"[a-z0-9]*(password|passwd|passphrase|secrets?|token|apikey|accesskey|privatekey|secretkey|credentials?)"
)
SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("signing", "key"), ("ssh", "key")})
WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")

# ``key: value`` / ``key=value`` inside text whose key ends like a secret one (the pattern only finds the
# candidates; ``is_secret_key`` decides), with an optional auth scheme kept readable: ``Authorization: Bearer ***``.
SECRET_PAIR_IN_TEXT = re.compile(
    r"(?P<key>(?<![\w-])[\w-]*?(?:pass(?:word|wd|phrase)?|pwd|secrets?|token|api[_-]?key|access[_-]?key"
    r"|private[_-]?key|secret[_-]?key|credentials?|auth(?:orization)?|bearer))"
    r"(?P<sep>[\"']?\s*[:=]\s*[\"']?)(?P<scheme>(?:Bearer|Basic|Token|Digest)\s+)?(?P<value>[^\s,;&\"'<>]+)",
    re.IGNORECASE,
)
BEARER = re.compile(r"(?P<scheme>\bBearer\s+)(?P<value>[\w~+/.-]+=*)")  # the scheme as sent: prose keeps "bearer"

# Environment values that are not masked inside other text: so short or so common that replacing every
# occurrence would blank out unrelated words and numbers ("1", "true", "on") while hiding nothing. Their own
# key is still masked (``mask_tree``). Numbers and booleans are skipped for the same reason: a port or a seed
# read from the environment is config, not a secret, and every matching digit in the record would go.
MIN_MASKED_LENGTH = 4
COMMON_VALUES = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null", "auto", "default"})


def env_keys(cfg: Any) -> frozenset[str]:
    """Dotted keys of a composed (unresolved) config whose values come from environment variables.

    ``${oc.env:NAME,default}`` counts only when NAME is set: a default written in the config (``tracking.uri``'s
    ``sqlite:///mlflow.db``) is not from the environment. A reference whose name cannot be read counts.
    """
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    return frozenset(k for k, v in _flatten(raw) if isinstance(v, str) and _reads_environment(v))


def env_values(cfg: Any) -> frozenset[str]:
    """The strings the record must not hold: the resolved values of ``cfg.env_keys`` (a ``RunConfig``), with the
    forms a path takes once used (no trailing slash, normalised, resolved), minus those too short or too common to
    mask inside other text (see ``MIN_MASKED_LENGTH``) and the values of choice keys (``device.name=cuda``: one
    of the options the code lists, not a secret).

    Raises:
        ConfigError: ``tracking.experiment`` came from the environment while tracking is on. Its name is stored
            as such, and masking it would file every such run under one experiment called ``***``; refusing is
            the only choice that neither leaks nor silently merges experiments.
    """
    if "tracking.experiment" in cfg.env_keys and cfg.tracking.enabled:
        raise ConfigError(
            "tracking.experiment",
            MASK,
            "a name written out, not read from an environment variable (the experiment's name is stored "
            "unmasked): tracking.experiment=<name>",
        )
    flat = dict(_flatten(cfg.to_dict()))
    values: set[str] = set()
    for key in cfg.env_keys:
        if key in flat and not _is_choice(type(cfg), key):
            values.update(v for text in _strings(flat[key]) for v in _forms(text) if _maskable(v))
    return frozenset(values)


def is_secret_key(key: str) -> bool:
    """Whether the last part of a dotted key names a secret: ``db.password``, ``X-Api-Key``, ``client_secret``."""
    words = [w.lower() for w in WORDS.findall(key.rsplit(".", 1)[-1])]
    return any(w in SECRET_WORDS or SECRET_ENDINGS.fullmatch(w) for w in words) or any(
        pair in SECRET_PAIRS for pair in itertools.pairwise(words)
    )


def mask_text(text: str, values: Collection[str] = frozenset()) -> str:
    """``text`` with ``values`` (``env_values``), ``user:password@`` in URIs, ``token=...``, ``X-Api-Key: ...``
    and ``Bearer ...`` replaced by ``***``; the rest stays as it was."""
    if values:
        text = _values_pattern(frozenset(values)).sub(MASK, text)
    text = URI_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = SECRET_PAIR_IN_TEXT.sub(_mask_pair, text)
    return BEARER.sub(lambda m: f"{m['scheme']}{MASK}", text)


def mask_value(key: str, value: Any, sensitive: Iterable[str] = (), values: Collection[str] = frozenset()) -> Any:
    if key in sensitive or (is_secret_key(key) and value not in (None, "")):
        return MASK
    return mask_text(value, values) if isinstance(value, str) else value


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


def _reads_environment(raw: str) -> bool:
    if "oc.env:" not in raw:
        return False
    names = [m["name"] for m in ENV_REFERENCE.finditer(raw)]
    return not names or any(name in os.environ for name in names)


def _mask_pair(match: re.Match[str]) -> str:
    if not is_secret_key(match["key"]):
        return match[0]
    return f"{match['key']}{match['sep']}{match['scheme'] or ''}{MASK}"


@functools.lru_cache(maxsize=16)
def _values_pattern(values: frozenset[str]) -> re.Pattern[str]:
    # longest first: a value that contains another is masked whole, not as "***" plus a visible rest
    return re.compile("|".join(re.escape(v) for v in sorted(values, key=len, reverse=True)))


def _maskable(value: str) -> bool:
    return len(value) >= MIN_MASKED_LENGTH and value.lower() not in COMMON_VALUES


def _strings(value: Any) -> Iterator[str]:
    """The strings in a resolved value (a list or mapping read from the environment holds several)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _forms(value: str) -> set[str]:
    """``value`` as typed, and as it shows up once used: a path without its trailing slash, normalised, expanded
    and resolved (``data.root`` is recorded resolved), a ``sqlite:///`` URI made absolute and its database's path
    as typed and resolved (``tracking.uri``), and JSON-escaped (environment.json, the dataset input)."""
    forms = {value, value.rstrip("/\\"), json.dumps(value)[1:-1]}
    if "://" not in value and (value.startswith(("/", ".", "~")) or "/" in value.strip("/")):
        forms.add(os.path.normpath(value))
        forms.add(str(Path(value).expanduser().resolve()))
    database = sqlite_database(value)
    if database is not None:  # a SQLite URI is used made absolute (and shown so in the summary): its path, too
        forms |= {absolute(value), database, str(Path(database).expanduser().resolve())}
    return forms


def _is_choice(cls: type, dotted: str) -> bool:
    """Whether the key's type is a ``Literal`` (or one or None): its values are listed in the code."""
    hint: Any = cls
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(hint):
            return False
        hint = typing.get_type_hints(hint).get(part)
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    concrete = [o for o in options if o is not type(None)]
    return bool(concrete) and all(typing.get_origin(o) is Literal for o in concrete)


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if not isinstance(tree, Mapping):
        return [(prefix.rstrip("."), tree)]
    items: list[tuple[str, Any]] = []
    for key, value in tree.items():
        items += (
            _flatten(value, f"{prefix}{key}.") if isinstance(value, Mapping) and value else [(f"{prefix}{key}", value)]
        )
    return items
