"""No file is unpickled before it is trusted: unpickling runs whatever code the file names.

Every ``pickle.load``/``pickle.loads``/``pickle.Unpickler``/``torch.load``/``numpy.load(allow_pickle=True)`` under
``src/`` and ``scripts/`` must either load tensors and plain values only (``weights_only=True``) or carry a
``# verified: <check>`` comment on its line, where ``<check>`` is a function called earlier in the same function
on the same bytes (a checksum against the published one, say).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNPICKLERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "torch.load", "torch.serialization.load"}
VERIFIED = re.compile(r"#\s*verified:\s*([A-Za-z_][\w.]*)")


def _qualified(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The dotted name a call's function is known by: ``torch.load`` for ``th.load`` after ``import torch as th``,
    or for ``load`` after ``from torch import load``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _aliases(tree: ast.Module) -> dict[str, str]:
    names: dict[str, str] = {"np": "numpy"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return names


def _is_true(call: ast.Call, keyword: str) -> bool:
    return any(k.arg == keyword and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def _unsafe(call: ast.Call, name: str | None) -> bool:
    if name == "numpy.load":
        return _is_true(call, "allow_pickle")
    return name in UNPICKLERS and not _is_true(call, "weights_only")


def _called_before(function: ast.AST, check: str, line: int, aliases: dict[str, str]) -> bool:
    """Whether ``function`` calls ``check`` (its last dotted part suffices) on a line before ``line``."""
    last = check.rpartition(".")[2]
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and node.lineno < line:
            name = _qualified(node.func, aliases) or ""
            if name == check or name.rpartition(".")[2] == last:
                return True
    return False


def unverified_unpickling(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: call`` for each unpickling call of ``source`` that neither loads weights only nor is verified."""
    tree = ast.parse(source, filename)
    aliases, lines = _aliases(tree), source.splitlines()
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _qualified(node.func, aliases)
        if not _unsafe(node, name):
            continue
        span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        token = next((m for line in span if (m := VERIFIED.search(line))), None)
        enclosing = [f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
        if token and enclosing and _called_before(enclosing[-1], token[1], node.lineno, aliases):
            continue
        found.append(f"{filename}:{node.lineno}: {name}")
    return found


def _sources() -> list[Path]:
    return sorted(p for folder in ("src", "scripts") for p in (ROOT / folder).rglob("*.py"))


def test_nothing_under_src_or_scripts_unpickles_a_file_before_verifying_it() -> None:
    sources = _sources()
    assert any(p.name == "archives.py" for p in sources)  # the scan sees the package
    found = [hit for path in sources for hit in unverified_unpickling(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\ndef f(raw):\n    return pickle.loads(raw)\n",
        "import torch\ndef f(p):\n    return torch.load(p, weights_only=False)\n",
        "import torch as th\ndef f(p):\n    return th.load(p)\n",
        "from pickle import load\ndef f(fh):\n    return load(fh)\n",
        "import numpy as np\ndef f(p):\n    return np.load(p, allow_pickle=True)\n",
        "import pickle\ndef f(raw):\n    return pickle.loads(raw)  # verified: check\n",  # no check before it
        "import pickle\ndef f(raw):\n    x = pickle.loads(raw)  # verified: check\n    check(raw)\n",  # checked after
    ],
    ids=["pickle", "weights_only=False", "an alias", "from-import", "numpy allow_pickle", "no check", "check after"],
)
def test_the_scan_finds_unpickling_that_is_not_verified_first(source: str) -> None:
    assert len(unverified_unpickling(source)) == 1


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ndef f(p):\n    return torch.load(p, map_location='cpu', weights_only=True)\n",
        "import pickle\ndef f(raw):\n    _check_md5(raw)\n    return pickle.loads(raw)  # verified: _check_md5\n",
        "import numpy as np\ndef f(p):\n    return np.load(p)\n",
    ],
    ids=["weights only", "verified first", "numpy without pickles"],
)
def test_the_scan_accepts_weights_only_and_verified_loads(source: str) -> None:
    assert unverified_unpickling(source) == []
