"""An exception raised in the user's own code is the user's: one line naming their file and line, the exception and
the key that chose the code, exit 2; never "internal error ... a bug in pipeline" (issue 36, items 4 and 9)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers import LEAN, run_main

FAULTY = """
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate


class Net(nn.Module):
    def __init__(self, in_shape, fail_at=0):
        super().__init__()
        self.fc, self.fail_at, self.calls = nn.Linear(in_shape[0], 1), fail_at, 0

    def forward(self, x):
        self.calls += self.training
        if self.fail_at and self.calls == self.fail_at:
            raise ValueError("forward failed")  # FORWARD
        return self.fc(x).squeeze(-1)


class Items(Dataset):
    def __init__(self, n, bad):
        self.x, self.y, self.bad = torch.randn(n, 8), torch.randn(n), bad

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"item {i} is missing")  # ITEM
        return self.x[i], self.y[i]


def make(bad=-1):
    return Items(96, bad), Items(16, -1)


def loss(outputs, targets):
    if torch.is_grad_enabled():  # training, not the first batch's check
        raise ZeroDivisionError("loss failed")  # LOSS
    return (outputs - targets).square().mean()


def metric(outputs, targets):
    raise ArithmeticError("metric failed")  # METRIC


class Collate:
    def __init__(self, fail_at=6):  # three collates before the run: the first items, the digests
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, items):
        self.calls += 1
        if self.fail_at and self.calls == self.fail_at:
            raise TypeError("collate failed")  # COLLATE
        return default_collate(items)


class Opt(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("optimizer failed")  # OPTIMIZER
"""

RUN = ["device=cpu", "trainer.epochs=1", "trainer.max_steps=-1", "loader.batch_size=8", *LEAN]  # 12 steps
BASE = ["model=custom", "model._target_=faulty.Net", "data=custom", "data._target_=faulty.make"]
REGRESSION = ["task=regression"]
CUSTOM = ["task=custom", "task.loss._target_=torch.nn.functional.mse_loss"]


def line_of(folder: Path, marker: str) -> int:
    return next(i for i, text in enumerate((folder / "faulty.py").read_text().splitlines(), 1) if marker in text)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "faulty.py").write_text(FAULTY.lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "faulty", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    ("args", "key", "marker", "what"),
    [
        ([*REGRESSION, "+model.fail_at=3"], "model._target_=faulty.Net", "FORWARD", "ValueError: forward failed"),
        ([*REGRESSION, "+data.bad=80"], "data._target_=faulty.make", "ITEM", "KeyError: 'item 80 is missing'"),
        (
            [*REGRESSION, "+data.bad=80", "loader.num_workers=1"],
            "data._target_=faulty.make",
            "ITEM",
            "KeyError: 'item 80 is missing'",
        ),
        (["task=custom", "task.loss._target_=faulty.loss"], "task.loss._target_=faulty.loss", "LOSS", "ZeroDivision"),
        ([*CUSTOM, "+task.metrics=[{_target_: faulty.metric}]"], "task.metrics[0]", "METRIC", "ArithmeticError"),
        ([*REGRESSION, "+data.collate_fn._target_=faulty.Collate"], "data.collate_fn", "COLLATE", "TypeError"),
        (
            [*REGRESSION, "optimizer=custom", "optimizer._target_=faulty.Opt", "+optimizer.lr=0.1"],
            "optimizer._target_=faulty.Opt",
            "OPTIMIZER",
            "RuntimeError: optimizer failed",
        ),
    ],
    ids=["model forward", "dataset item", "dataset item in a worker", "loss", "metric", "collate", "optimizer"],
)
def test_an_exception_in_the_users_code_names_their_file_line_and_key(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    key: str,
    marker: str,
    what: str,
) -> None:
    code = run_main(monkeypatch, *BASE, *args, *RUN)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(("error", "internal error"))]
    assert code == 2 and len(lines) == 1, err
    (line,) = lines
    assert line.startswith(f"error: {key}") and what in line and "a bug in pipeline" not in line, line
    assert re.search(rf" at faulty\.py:{line_of(project, marker)} in \w+ ", line), line
    runs = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    assert [r.info.status for r in runs] == ["FAILED"]  # it failed while training: the run is recorded so
    assert runs[0].data.tags["error"].startswith(f"UserCodeError: {key}")


def test_an_item_read_before_the_run_opens_names_the_line_and_opens_no_run(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_main(monkeypatch, *BASE, *REGRESSION, "+data.bad=20", *RUN)  # the record's digest reads the first 64
    (line,) = capsys.readouterr().err.splitlines()
    assert code == 2 and line.startswith("error: data._target_=faulty.make: your code raised KeyError: 'item 20")
    assert f" at faulty.py:{line_of(project, 'ITEM')} in __getitem__ " in line
    assert not (project / "mlflow.db").exists()


def test_a_forward_that_fails_on_the_first_batch_names_the_line_before_any_run_opens(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "faulty.py").write_text(FAULTY.lstrip().replace("self.calls += self.training", "self.calls = 1"))
    code = run_main(monkeypatch, *BASE, *REGRESSION, "+model.fail_at=1", *RUN)
    (line,) = capsys.readouterr().err.splitlines()
    assert code == 2 and f"ValueError: forward failed at faulty.py:{line_of(project, 'FORWARD')} in forward" in line
    assert not (project / "mlflow.db").exists()


def test_an_injected_fault_in_pipelines_own_code_is_still_an_internal_error(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pipeline.engine.hot.step as step_module

    def broken(*args: object, **kwargs: object) -> None:
        raise AttributeError("the pipeline's own mistake")

    monkeypatch.setattr(step_module, "_apply", broken)
    assert run_main(monkeypatch, *BASE, *REGRESSION, *RUN) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert line.startswith("internal error: AttributeError at test_user_code_errors.py:")
