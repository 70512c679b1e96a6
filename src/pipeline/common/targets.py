"""Objects the user names by ``_target_``: a dotted path, imported from the launch folder or ``PYTHONPATH``, called
with the group's other keys as keywords. The one implementation behind models, datasets, collate and split hooks,
losses, metrics, optimizers and schedules:

    python -m pipeline model=custom model._target_=nets.Tiny model.width=64

- ``resolve`` imports the object; a path that does not import is one line naming the module and where it was
  looked for (the launch folder first, then ``PYTHONPATH``);
- ``instantiate`` calls it with the keywords (a nested ``{_target_: ...}`` value is made first), adding the
  ``supplied`` values (``in_shape``, ``num_classes``, ``total_steps``) only where the signature names them and the
  user set none; a keyword the callable does not take, or a callable that raises, is one line too (``--debug``
  shows the traceback of the user's exception);
- ``bind`` is ``_partial_``: the object with its keywords bound, completed later (an optimizer with the model's
  parameters, a scheduler with its optimizer).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeline.common.errors import PipelineError
from pipeline.common.messages import brief
from pipeline.common.usercode import remember, site

TARGET = "_target_"
PARTIAL = "_partial_"


class TargetError(PipelineError):
    """A ``_target_`` cannot be imported or called with its keywords, or made something unusable."""


class FactoryFailed(TargetError):
    """The user's callable raised; the cause is chained (``--debug`` prints its traceback)."""


def launch_folder_on_path() -> str:
    """Put the launch folder first on ``sys.path``, as ``python -m`` does (a sweep's worker processes and
    ``torchrun``'s may not), so that ``nets.Tiny`` finds ``./nets.py``. Returns the folder."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    return here


def resolve(path: str, *, key: str, namespaces: Sequence[str] = ()) -> Any:
    """The object ``path`` names: ``package.module.name`` (or ``module.Class.attribute``); a bare name is looked up
    in ``namespaces`` first (``SGD`` in ``torch.optim``).

    Raises:
        TargetError: nothing importable by that name, naming the module and where it was looked for.
    """
    if "." not in path:
        for space in namespaces:
            found = getattr(importlib.import_module(space), path, None)
            if found is not None:
                return found
        within = f" (nor a name in {', '.join(namespaces)})" if namespaces else ""
        raise TargetError(f"{key}._target_={path}: not a dotted path such as mymodule.{path}{within}")
    where = launch_folder_on_path()
    parts = path.split(".")
    searched = f"the launch folder {where} and PYTHONPATH are searched"
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and not module_name.startswith(err.name):
                raise TargetError(
                    f"{key}._target_={path}: importing {module_name} failed: it imports {err.name}, which is not "
                    f"installed (pip install it, or check the spelling in {module_name})"
                ) from err
            continue  # maybe a class attribute: nets.Tiny.make -> module nets
        except Exception as err:  # the user's module itself raised (a syntax error, a bad import-time line)
            raise FactoryFailed(
                f"{key}._target_={path}: importing {module_name} failed: {brief(err, first_line=True)}"
            ) from err
        for name in parts[cut:]:
            if not hasattr(obj, name):
                file = getattr(obj, "__file__", None) or module_name
                raise TargetError(f"{key}._target_={path}: {module_name} ({file}) has no attribute {name!r}")
            obj = getattr(obj, name)
        remember(obj, f"{key}._target_={path}", module=module_name)  # its errors are the user's
        return obj
    raise TargetError(f"{key}._target_={path}: no module named {parts[0]!r} ({searched})")


def signature_names(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    """The keyword names ``fn`` takes and whether it takes any (``**kwargs``, or a signature Python cannot read)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


def instantiate(
    path: str,
    keywords: Mapping[str, Any],
    *,
    key: str,
    supplied: Mapping[str, Any] | None = None,
    positional: Sequence[Any] = (),
    namespaces: Sequence[str] = (),
) -> Any:
    """``path(*positional, **keywords)``, plus each of ``supplied`` the signature names and ``keywords`` lacks.

    Args:
        path: the ``_target_``.
        keywords: the group's other keys (a ``{_target_: ...}`` value is instantiated first).
        key: the group's dotted key, for messages (``model``, ``task.loss``).
        supplied: values the pipeline knows (``in_shape``, ``num_classes``), passed only where named.
        positional: leading arguments (an optimizer's parameters).
        namespaces: where a bare name is looked up (``resolve``).

    Raises:
        TargetError: the import, an unknown keyword; ``FactoryFailed``: the callable raised.
    """
    fn = resolve(path, key=key, namespaces=namespaces)
    return call(fn, keywords, key=key, path=path, supplied=supplied, positional=positional)


def call(
    fn: Callable[..., Any],
    keywords: Mapping[str, Any],
    *,
    key: str,
    path: str,
    supplied: Mapping[str, Any] | None = None,
    positional: Sequence[Any] = (),
) -> Any:
    """``instantiate`` for an object already resolved."""
    if not callable(fn):
        raise TargetError(f"{key}._target_={path} is a {type(fn).__name__}, not something to call")
    names, takes_any = signature_names(fn)
    unknown = [k for k in keywords if k not in names and not takes_any]
    if unknown:
        takes = ", ".join(sorted(names)) or "no keywords"
        raise TargetError(f"{key}.{unknown[0]} is not a keyword of {path} (it takes {takes}): drop it or rename it")
    extra = {k: v for k, v in (supplied or {}).items() if k in names and k not in keywords}
    made = {k: nested(v, key=f"{key}.{k}") for k, v in keywords.items()}
    try:
        obj = fn(*positional, **made, **extra)
    except PipelineError:
        raise
    except Exception as err:
        raise FactoryFailed(
            f"{key}._target_={path} raised {brief(err, first_line=True)}{site(err)} (--debug shows the traceback)"
        ) from err
    remember_made(obj, f"{key}._target_={path}")
    return obj


def remember_made(obj: Any, label: str) -> None:
    """The files of what a target made (a model's every layer class, each dataset of a pair), as chosen by
    ``label``: an error raised in them later names it (``pipeline.common.usercode``)."""
    parts = list(obj.values()) if isinstance(obj, Mapping) else list(obj) if isinstance(obj, tuple | list) else [obj]
    for part in parts:
        modules = getattr(part, "modules", None) if hasattr(part, "parameters") else None  # an nn.Module
        for each in modules() if callable(modules) else [part]:
            remember(type(each), label)


def bind(path: str, keywords: Mapping[str, Any], *, key: str, namespaces: Sequence[str] = ()) -> Callable[..., Any]:
    """``_partial_``: ``path`` with ``keywords`` bound, checked against its signature now, called later."""
    fn = resolve(path, key=key, namespaces=namespaces)
    names, takes_any = signature_names(fn)
    unknown = [k for k in keywords if k not in names and not takes_any]
    if unknown:
        takes = ", ".join(sorted(names)) or "no keywords"
        raise TargetError(f"{key}.{unknown[0]} is not a keyword of {path} (it takes {takes}): drop it or rename it")
    return functools.partial(fn, **{k: nested(v, key=f"{key}.{k}") for k, v in keywords.items()})


def hook(path: str, keywords: Mapping[str, Any], *, key: str, partial: bool | None = None) -> Callable[..., Any]:
    """A callable the pipeline calls later (a loss, a metric, a collate or split function, a step): a class is made
    with the keywords now (the object is then called), a function is bound to them; ``partial`` (``_partial_``)
    overrides which."""
    if partial is None:
        partial = not inspect.isclass(resolve(path, key=key))
    if partial:
        return bind(path, keywords, key=key)
    return instantiate(path, keywords, key=key)


def nested(value: Any, *, key: str) -> Any:
    """A keyword's value, with any ``{_target_: ...}`` inside it made (``_partial_: true`` binds instead)."""
    if isinstance(value, Mapping) and TARGET in value:
        rest = {k: v for k, v in value.items() if k not in (TARGET, PARTIAL)}
        if value.get(PARTIAL):
            return bind(str(value[TARGET]), rest, key=key)
        return instantiate(str(value[TARGET]), rest, key=key)
    if isinstance(value, Mapping):
        return {k: nested(v, key=f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(nested(v, key=f"{key}[{i}]") for i, v in enumerate(value))
    return value


def source_file(obj: Any) -> str | None:
    """The file an object (or its class) was defined in, None for built-ins and objects made at run time."""
    target = obj if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj) else type(obj)
    try:
        return inspect.getsourcefile(target)
    except (TypeError, OSError):
        return None
