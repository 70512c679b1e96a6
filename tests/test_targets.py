"""``_target_``: imported from the launch folder or PYTHONPATH, called with the group's keywords, every failure in
one line."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from pipeline.common.targets import FactoryFailed, TargetError, bind, instantiate, resolve


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``userlib.py`` in the launch folder (the test's own), not on ``sys.path`` until a target is resolved."""
    (tmp_path / "userlib.py").write_text(
        "import torch\n\n"
        "def factory(a, b=2, *, in_shape=None, num_classes=None):\n    return (a, b, in_shape, num_classes)\n\n"
        "def anything(**kwargs):\n    return kwargs\n\n"
        "class Holder:\n    def __init__(self, inner):\n        self.inner = inner\n\n"
        "def fails(reason):\n    raise KeyError(reason)\n"
    )
    (tmp_path / "needs_more.py").write_text("import not_installed_anywhere\n")
    (tmp_path / "syntax.py").write_text("def broken(:\n")
    for name in ("userlib", "needs_more", "syntax"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return tmp_path


def test_a_target_is_found_in_the_launch_folder(module: Path) -> None:
    assert instantiate("userlib.factory", {"a": 1}, key="model") == (1, 2, None, None)
    assert str(module) == sys.path[0]  # the launch folder is searched first, as python -m does


def test_supplied_values_reach_only_a_signature_that_names_them_and_never_override_the_users(module: Path) -> None:
    supplied = {"in_shape": (1, 8), "num_classes": 3, "total_steps": 10}
    assert instantiate("userlib.factory", {"a": 1, "num_classes": 5}, key="model", supplied=supplied) == (
        1,
        2,
        (1, 8),
        5,
    )
    assert instantiate("userlib.anything", {"x": 1}, key="model", supplied=supplied) == {"x": 1}  # **kwargs: none


def test_a_bare_name_is_looked_up_in_the_namespaces_given() -> None:
    assert resolve("SGD", key="optimizer", namespaces=("torch.optim",)) is torch.optim.SGD
    with pytest.raises(TargetError, match=r"^optimizer\._target_=Nope: not a dotted path .* \(nor a name in torch"):
        resolve("Nope", key="optimizer", namespaces=("torch.optim",))


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("nowhere.Net", r"^model\._target_=nowhere\.Net: no module named 'nowhere' \(the launch folder .* PYTHONPATH"),
        ("userlib.Nett", r"^model\._target_=userlib\.Nett: userlib \(.*userlib\.py\) has no attribute 'Nett'$"),
        ("needs_more.Net", r"it imports not_installed_anywhere, which is not installed \(pip install it"),
        ("syntax.broken", r"^model\._target_=syntax\.broken: importing syntax failed: SyntaxError: "),
    ],
)
def test_a_target_that_does_not_import_says_why_in_one_line(module: Path, path: str, match: str) -> None:
    with pytest.raises(TargetError, match=match) as info:
        resolve(path, key="model")
    assert "\n" not in str(info.value)


def test_an_unknown_keyword_names_the_ones_the_target_takes(module: Path) -> None:
    with pytest.raises(TargetError, match=r"^model\.c is not a keyword of userlib\.factory \(it takes a, b, in_shape"):
        instantiate("userlib.factory", {"a": 1, "c": 3}, key="model")


def test_a_factory_that_raises_is_one_line_with_its_exception_chained(module: Path) -> None:
    with pytest.raises(
        FactoryFailed,
        match=r"^data\._target_=userlib\.fails raised KeyError: 'gone' at userlib\.py:\d+ in fails \(--debug",
    ) as info:
        instantiate("userlib.fails", {"reason": "gone"}, key="data")
    assert isinstance(info.value.__cause__, KeyError)


def test_a_nested_target_is_made_first_and_partial_binds_it(module: Path) -> None:
    made = instantiate("userlib.Holder", {"inner": {"_target_": "userlib.factory", "a": 7}}, key="model")
    assert made.inner == (7, 2, None, None)
    bound = instantiate("userlib.Holder", {"inner": {"_target_": "userlib.factory", "_partial_": True}}, key="model")
    assert isinstance(bound.inner, functools.partial) and bound.inner(a=1) == (1, 2, None, None)
    assert bind("userlib.factory", {"b": 5}, key="task.loss")(0) == (0, 5, None, None)
