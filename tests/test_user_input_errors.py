"""A user's own pieces that cannot train: one line on stderr and exit 2, before any MLflow run is opened."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.project import REGRESSION, use_project

from helpers import run_main

TINY = ["device=cpu", "trainer.epochs=1", "trainer.max_steps=2", "loader.batch_size=8"]
CUSTOM_DATA = ["data=custom", "data._target_=sets.make", "task=regression"]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["model=custom", "model._target_=nest.Tiny", *CUSTOM_DATA],
            r"^error: model\._target_=nest\.Tiny: no module named 'nest' \(the launch folder \S+ and PYTHONPATH are "
            r"searched\)$",
        ),
        (
            ["model=custom", "model._target_=nets.Tinny", *CUSTOM_DATA],
            r"^error: model\._target_=nets\.Tinny: nets \(\S+nets\.py\) has no attribute 'Tinny'$",
        ),
        (
            ["model=custom", "model._target_=nets.broken", *CUSTOM_DATA],
            r"^error: model\._target_=nets\.broken raised ValueError: width 32 is too wide for this test at "
            r"nets\.py:\d+ in broken \(--debug shows the traceback\)$",
        ),
        (
            ["model=custom", "model._target_=nets.Tiny", "+model.widht=3", *CUSTOM_DATA],
            r"^error: model\.widht is not a keyword of nets\.Tiny \(it takes in_shape, width\): drop it or rename "
            r"it$",
        ),
        (
            ["model=custom", "model._target_=nets.not_a_module", *CUSTOM_DATA],
            r"^error: model\._target_=nets\.not_a_module returned a builtins\.dict, not a torch\.nn\.Module$",
        ),
        (
            [*REGRESSION[:2], "data=custom", "data._target_=sets.one", "task=regression"],
            r"^error: data\._target_=sets\.one returned one dataset: return \(train, val\) or "
            r"\{'train': \.\.\., 'val': \.\.\.\}, each a torch\.utils\.data\.Dataset$",
        ),
        (
            ["data=custom", "data._target_=sets.strings", "task=classification", "data.num_classes=2"],
            r"^error: training item 0 holds a builtins\.str, not a tensor: turn text into token tensors in the "
            r"dataset, or give data\.collate_fn that does$",
        ),
        (
            [*REGRESSION[:2], "data=custom", "data._target_=sets.stream", "task=regression"],
            r"^error: the training set is an iterable dataset \(Stream\) without __len__: say how many batches make "
            r"an epoch with data\.steps_per_epoch=N$",
        ),
        (
            [*REGRESSION[:2], "data=custom", "data._target_=sets.labels", "task=classification", "data.num_classes=2"],
            r"^error: the targets are float32\[2\]: task=classification needs integer class labels \(int64\);",
        ),
        (
            [
                *REGRESSION[:2],
                *("data=custom", "data._target_=sets.with_lambda", "task=regression"),
                *("loader=workers", "loader.num_workers=2", "loader.multiprocessing_context=spawn"),
            ],
            r"^error: the training set cannot be sent to spawn loader workers \(\w+Error: .*lambda.*\): define it at "
            r"the top level of an importable module",
        ),
        (
            ["model=custom", "model._target_=nets.Tiny", "data=custom", "data._target_=sets.make"],
            r"^error: the targets are float32\[2\]: task=classification needs integer class labels",
        ),
    ],
    ids=[
        "module missing",
        "attribute missing",
        "factory raises",
        "unknown keyword",
        "not a module",
        "no datasets",
        "items not tensors",
        "iterable without length",
        "float labels for classification",
        "unpicklable for spawn",
        "regression data under the default task",
    ],
)
def test_a_bad_piece_is_one_line_and_exit_2_with_no_run_opened(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], error: str
) -> None:
    use_project(tmp_path, monkeypatch)
    code = run_main(monkeypatch, *args, *TINY)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    import re

    assert re.search(error, err), err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


def test_a_model_whose_output_does_not_fit_the_loss_names_both_shapes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = use_project(tmp_path, monkeypatch)
    (folder / "wide.py").write_text(
        "import torch\n\nclass Column(torch.nn.Module):\n"
        "    def __init__(self, in_shape):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(in_shape[0], 1)\n\n    def forward(self, x):\n        return self.fc(x)\n"
    )
    code = run_main(monkeypatch, "model=custom", "model._target_=wide.Column", *CUSTOM_DATA, *TINY)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "error: task=regression needs outputs of the targets' shape: outputs [2, 1] against targets [2] would "
        "broadcast in mse_loss and train on the wrong loss: squeeze the model's last dimension"
    ), err
    assert not (tmp_path / "mlflow.db").exists()


def test_debug_shows_the_traceback_of_the_users_exception(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    use_project(tmp_path, monkeypatch)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code = run_main(monkeypatch, "--debug", "model=custom", "model._target_=nets.broken", *CUSTOM_DATA, *TINY)
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback (most recent call last)" in err and 'raise ValueError(f"width {width}' in err
    assert err.rstrip().endswith(
        "error: model._target_=nets.broken raised ValueError: width 32 is too wide for this "
        "test at nets.py:32 in broken (--debug shows the traceback)"
    )
