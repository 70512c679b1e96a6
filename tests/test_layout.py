"""The size rules of docs/development.md, read from the source: no function over 80 lines, and the two functions
every contributor reads (the epoch loop and the orchestrator) at most 50. Modules end at seams, not at a line count.

The layer rules are import-linter's (``lint-imports`` in ``make test``); the command modules are
tests/test_commands.py's.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
FUNCTION_LINES, READ_IN_ONE_PASS = 80, 50


@functools.cache
def functions() -> dict[str, int]:
    """Every function and method in src/ and in the benchmarks (bench/, outside the package), ``path:name`` -> its
    length in lines (signature and docstring included)."""
    found = {}
    sources = [(SRC, path) for path in sorted(SRC.rglob("*.py"))] + [(ROOT, p) for p in sorted(ROOT.glob("bench/*.py"))]
    for base, path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found[f"{path.relative_to(base)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return found


def test_no_function_is_over_80_lines() -> None:
    assert "bench/suite.py:main" in functions()  # the benchmarks are read too
    assert {name: n for name, n in functions().items() if n > FUNCTION_LINES} == {}


@pytest.mark.parametrize("name", ["pipeline/engine/loop.py:train_epoch", "pipeline/train.py:_train"])
def test_the_epoch_loop_and_the_orchestrator_read_in_one_pass(name: str) -> None:
    assert functions()[name] <= READ_IN_ONE_PASS
