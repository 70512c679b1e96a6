"""The user's own code, and an error raised in it told as the user's.

    python -m pipeline model=custom model._target_=nets.Tiny   # nets.py raises: one line naming nets.py, the line,
                                                               # the exception and model._target_

A file is the user's when it lies under the launch folder, a ``PYTHONPATH`` entry or the folder of a module a
``_target_`` named (``remember``), and is neither this package's nor an installed library's (site-packages, the
interpreter's own). The same files are what the record hashes and what the logged model ships
(``pipeline.engine.building.provenance``, ``pipeline.record.logged_model``).

``user_errors()`` turns an exception whose traceback passes through such a file into ``UserCodeError``: one line with
the innermost user frame (file, line, function), the exception, and the key whose ``_target_`` chose the code (the
outermost user frame whose file a target made, ``remember``). A loader worker's exception arrives in the main process
with the worker's traceback as text (PyTorch's ``ExceptionWrapper``); its frames are read from there. ``--debug``
still shows the whole traceback (the cause is chained).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import re
import sys
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pipeline
from pipeline.common.device_memory import is_oom
from pipeline.common.errors import Interruption, PipelineError
from pipeline.common.messages import brief

PACKAGE = str(Path(pipeline.__file__).resolve().parent)
WORKER_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)', re.MULTILINE)


@dataclass(frozen=True)
class Chosen:
    """Lines ``first``..``last`` of ``file`` hold code that ``key``'s target named or made (a function, a class)."""

    file: str
    first: int
    last: int
    key: str  # model._target_=nets.Tiny


_CHOSEN: list[Chosen] = []  # newest first: a later run's targets win over an earlier one's (one process, many runs)
_ROOTS: dict[str, None] = {}  # the folders of the modules targets named (an editable install outside the launch folder)


class UserCodeError(PipelineError):
    """The user's code raised: the message names where, what and which key chose it; the cause is chained."""


def installed(path: str) -> bool:
    """A file of this package, of an installed library (site-packages) or of the interpreter itself."""
    resolved = os.path.realpath(path)
    if resolved.startswith(PACKAGE) or "site-packages" in resolved or "dist-packages" in resolved:
        return True
    return resolved.startswith(_interpreter())


@functools.cache
def _interpreter() -> tuple[str, ...]:
    return tuple(os.path.realpath(p) + os.sep for p in {sys.base_prefix, sys.prefix})


def roots() -> list[str]:
    """Where the user's code lives: the launch folder, the ``PYTHONPATH`` entries and the targets' folders."""
    found = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), *_ROOTS]
    return [os.path.realpath(p) for p in found]


def is_user_file(path: str | None, homes: list[str] | None = None) -> bool:
    """Whether ``path`` is a file of the user's own code (see the module's docstring); ``homes``: ``roots()``, when
    the caller asks about many files."""
    if not path or path.startswith("<") or installed(path):
        return False
    resolved = os.path.realpath(path)
    return any(resolved.startswith(root + os.sep) for root in (homes if homes is not None else roots()))


def imported() -> dict[str, str]:
    """The user's modules this process has imported, by name: their files (a package's ``__init__.py``), in name
    order. What the record hashes and the logged model ships (``pipeline.engine.building.provenance``,
    ``pipeline.record.logged_model``). Some 3,000 modules are imported by then: the libraries' are passed over by
    their path alone (a few ms), before any file system call."""
    homes = roots()
    skipped = ("site-packages", "dist-packages")
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name == "__main__" or any(part in path for part in skipped) or path.startswith(_interpreter()):
            continue
        if is_user_file(path, homes) and os.path.isfile(path):
            found[name] = os.path.realpath(path)
    return dict(sorted(found.items()))


def forget() -> None:
    """A new run: the targets an earlier run in this process named no longer say where the user's code is."""
    _CHOSEN.clear()
    _ROOTS.clear()


@dataclass(frozen=True)
class Frame:
    """One frame of a traceback, as a message names it."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        here = os.getcwd()
        shown = os.path.relpath(self.file, here) if os.path.realpath(self.file).startswith(here + os.sep) else self.file
        return f"{shown}:{self.line} in {self.function}"


def remember(obj: Any, key: str, *, module: str | None = None) -> None:
    """Note that ``key``'s ``_target_`` named or made ``obj`` (a function or a class): an error raised in its lines
    names ``key``. ``module``: the dotted name it was imported by, whose top folder then counts as the user's."""
    try:
        span = _lines(obj)
    except TypeError:  # an object that cannot be a cache key (unhashable): no lines to remember
        return
    if span is None:
        return
    chosen = Chosen(*span, key)
    _CHOSEN[:] = [chosen, *(c for c in _CHOSEN if (c.file, c.first, c.last) != span)]
    if module is not None:
        root = Path(span[0]).parent
        for _ in module.split(".")[1:]:
            root = root.parent
        _ROOTS.setdefault(str(root), None)


@functools.cache
def _lines(obj: Any) -> tuple[str, int, int] | None:
    """The file and lines of a function or class of the user's (None: installed, built-in or made at run time).
    Cached: a class's lines are found by parsing its file."""
    try:
        path = inspect.getsourcefile(obj)
        lines, first = inspect.getsourcelines(obj)
    except (TypeError, OSError):
        return None
    if not path or installed(path):
        return None
    return os.path.realpath(path), max(first, 1), max(first, 1) + len(lines) - 1


def chosen_by(frame: Frame) -> str | None:
    """The key whose target named or made the code ``frame`` runs: the narrowest remembered lines around it."""
    resolved = os.path.realpath(frame.file)
    around = [c for c in _CHOSEN if c.file == resolved and c.first <= frame.line <= c.last]
    return min(around, key=lambda c: c.last - c.first).key if around else None


def user_frames(err: BaseException) -> list[Frame]:
    """The frames of ``err``'s traceback in the user's files, outermost first (a loader worker's, from its text)."""
    frames = [Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(err.__traceback__)]
    if "Original Traceback" in str(err):  # raised in a loader worker: its frames are in the message
        text = str(err).split("Original Traceback", 1)[1]
        frames += [Frame(m["file"], int(m["line"]), m["function"]) for m in WORKER_FRAME.finditer(text)]
    return [f for f in frames if is_user_file(f.file)]


def site(err: BaseException) -> str:
    """``" at nets.py:12 in forward"``: the innermost user frame of ``err``; empty when none."""
    frames = user_frames(err)
    return f" at {frames[-1]}" if frames else ""


def described(err: BaseException) -> str:
    """``err`` as one line; a loader worker's by its own last line, not PyTorch's "Caught ... in DataLoader worker"."""
    text = str(err)
    if "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1].strip()
        return brief(Exception(last), with_type=False)
    return brief(err, first_line=True)


def as_user_error(err: BaseException) -> UserCodeError | None:
    """``err`` told as the user's (``UserCodeError``), or None when no frame of its traceback is the user's."""
    frames = user_frames(err)
    if not frames:
        return None
    key = next((k for k in map(chosen_by, frames) if k is not None), None)
    whose = f"{key}: your code raised" if key else "your code raised"
    return UserCodeError(
        f"{whose} {described(err)} at {frames[-1]} (a problem in your code, not in pipeline; --debug shows the "
        f"traceback)"
    )


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Within it, an exception raised in the user's code becomes ``UserCodeError`` (its cause chained); every other
    one, a stop, running out of memory and the pipeline's own errors pass through untouched."""
    try:
        yield
    except (PipelineError, Interruption):
        raise
    except Exception as err:
        if is_oom(err):  # memory, not a mistake: pipeline.engine.hot.memory says what to change
            raise
        told = as_user_error(err)
        if told is None:
            raise
        raise told from err


def file_hash(path: str) -> str:
    """A user file's hash as a run's record and its checkpoints keep it: sha256 of its bytes, 16 hex digits."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def changed_since(saved: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The files of ``saved`` (a checkpoint's ``file_hash``es; paths relative to the launch folder, so a project moved
    whole resumes) whose bytes differ now: ``{path: (then, now)}``, now ``missing`` for a file gone."""
    now = {path: file_hash(path) if os.path.isfile(path) else "missing" for path in saved}
    return {path: (saved[path], now[path]) for path in saved if saved[path] != now[path]}
