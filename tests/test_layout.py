"""The size rules of docs/development.md, read from the source: no function over 80 lines, and the two functions
every contributor reads (the epoch loop and the orchestrator) at most 50. Modules end at seams, not at a line count.

The layer rules are import-linter's (``lint-imports`` in ``make test``); the command modules are
tests/test_commands.py's.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
FUNCTION_LINES, READ_IN_ONE_PASS = 80, 50


def _defs(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``node`` with its qualified name (``Class.method``, ``outer.<locals>.inner``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + child.name, child
            yield from _defs(child, f"{prefix}{child.name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _defs(child, f"{prefix}{child.name}.")
        else:
            yield from _defs(child, prefix)


@functools.cache
def functions() -> dict[str, int]:
    """Every function and method in src/, ``path:qualname:line`` -> its length in lines (signature and docstring
    included). The line keeps apart what shares a qualified name in one file (a property's getter and setter, a
    function defined in both branches of an ``if``)."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        for name, node in _defs(ast.parse(path.read_text())):
            found[f"{path.relative_to(SRC)}:{name}:{node.lineno}"] = node.end_lineno - node.lineno + 1
    return found


def length_of(suffix: str) -> int:
    """The length of the one function whose ``path:qualname`` ends with ``suffix`` (wherever in src/ it lives, at
    whatever line), failing by name when none or several do."""
    found = {key: n for key, n in functions().items() if key.rsplit(":", 1)[0].endswith(suffix)}
    assert len(found) == 1, f"{suffix}: expected one function in src/ whose path:name ends so, found {sorted(found)}"
    return next(iter(found.values()))


def test_every_function_is_measured_methods_and_nested_ones_included() -> None:
    keys = list(functions())
    # two methods named alike in one module, and a function nested in another, are each measured
    assert sum(":".join(key.split(":")[:2]).endswith("data/loaders.py:EpochLoader.set_epoch") for key in keys) == 1
    assert sum(":".join(key.split(":")[:2]).endswith("data/loaders.py:ResidentLoader.set_epoch") for key in keys) == 1
    assert any(".<locals>." in key for key in keys)


def test_no_function_is_over_80_lines() -> None:
    assert {name: n for name, n in functions().items() if n > FUNCTION_LINES} == {}


@pytest.mark.parametrize("suffix", ["engine/loop.py:train_epoch", "pipeline/train.py:_train"])
def test_the_epoch_loop_and_the_orchestrator_read_in_one_pass(suffix: str) -> None:
    assert length_of(suffix) <= READ_IN_ONE_PASS


def test_a_function_not_found_fails_by_name() -> None:
    with pytest.raises(AssertionError, match="nowhere.py:gone: expected one function"):
        length_of("nowhere.py:gone")
