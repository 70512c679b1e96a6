"""The size rules of docs/development.md, read from the source: no function over 80 lines, and the two functions
every contributor reads (the epoch loop and the orchestrator) at most 50; no function with more than 7 parameters
unless a ``# params: <why>`` comment on its ``def`` line or the line above says why. Modules end at seams, not at a
line count.

The layer rules are import-linter's (``lint-imports`` in ``make test``); the command modules are
tests/test_commands.py's.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
FUNCTION_LINES, READ_IN_ONE_PASS, PARAMETERS = 80, 50, 7
WIDE_ON_PURPOSE = re.compile(r"#\s*params:\s*\S")  # "# params: <why>", on the def line or the line above


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


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    """The parameters a caller passes: every one, ``*args`` and ``**kwargs`` included, less a method's ``self`` or
    ``cls``."""
    args = node.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    bound = method and bool(named) and named[0].arg in ("self", "cls")
    return len(named) + (args.vararg is not None) + (args.kwarg is not None) - bound


@functools.cache
def wide_functions() -> dict[str, int]:
    """Every function in src/ over ``PARAMETERS`` without a ``# params:`` comment, ``path:qualname`` -> its count."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        methods = {id(child) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for child in node.body}
        for name, node in _defs(tree):
            n = parameters(node, id(node) in methods)
            said = any(WIDE_ON_PURPOSE.search(lines[i - 1]) for i in (node.lineno - 1, node.lineno) if i > 0)
            if n > PARAMETERS and not said:
                found[f"{path.relative_to(SRC)}:{name}"] = n
    return found


@functools.cache
def functions() -> dict[str, int]:
    """Every function and method in src/ and in the benchmarks (bench/, outside the package),
    ``path:qualname:line`` -> its length in lines (signature and docstring included). The line keeps apart what
    shares a qualified name in one file (a property's getter and setter, a function defined in both branches of an
    ``if``)."""
    found = {}
    sources = [(SRC, path) for path in sorted(SRC.rglob("*.py"))] + [(ROOT, p) for p in sorted(ROOT.glob("bench/*.py"))]
    for base, path in sources:
        for name, node in _defs(ast.parse(path.read_text())):
            found[f"{path.relative_to(base)}:{name}:{node.lineno}"] = node.end_lineno - node.lineno + 1
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
    assert any(name.startswith("bench/suite.py:main:") for name in functions())  # the benchmarks are read too
    assert {name: n for name, n in functions().items() if n > FUNCTION_LINES} == {}


@pytest.mark.parametrize("suffix", ["engine/hot/loop.py:train_epoch", "engine/session.py:session"])
def test_the_epoch_loop_and_the_orchestrator_read_in_one_pass(suffix: str) -> None:
    assert length_of(suffix) <= READ_IN_ONE_PASS


def test_a_function_not_found_fails_by_name() -> None:
    with pytest.raises(AssertionError, match="nowhere.py:gone: expected one function"):
        length_of("nowhere.py:gone")


def test_no_function_takes_more_than_7_parameters_unless_a_comment_says_why() -> None:
    assert wide_functions() == {}


@pytest.mark.parametrize(
    ("source", "count"),
    [
        ("def f(a, b, /, c, *args, d, **kwargs): pass", 6),
        ("class C:\n    def m(self, a, *, b): pass", 2),
        ("class C:\n    @classmethod\n    def m(cls, a): pass", 1),
        ("def f(self, a): pass", 2),  # a function's first parameter is no method's self
    ],
)
def test_parameters_count_what_a_caller_passes(source: str, count: int) -> None:
    tree = ast.parse(source)
    methods = {id(c) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) for c in n.body}
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert parameters(node, id(node) in methods) == count
