"""Every project under ``examples/`` trains with the one command its README gives, and learns: its validation
metric after the last epoch is better than after the first."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LOWER_IS_BETTER = {"val/loss", "val/mae", "val/rmse", "val/perplexity"}


def readme_command(folder: Path) -> list[str]:
    """The README's one command: the first line of a code block that runs ``python -m pipeline``."""
    for line in (folder / "README.md").read_text().splitlines():
        if line.startswith("python -m pipeline"):
            return shlex.split(line)
    raise AssertionError(f"{folder / 'README.md'} gives no python -m pipeline command")


def test_every_example_has_a_readme_with_its_command() -> None:
    folders = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    assert folders == ["char_transformer", "diabetes_regression", "dict_batches", "image_folder_cnn"]
    assert all(readme_command(EXAMPLES / name)[:3] == ["python", "-m", "pipeline"] for name in folders)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "metric"),
    [
        ("image_folder_cnn", "val/acc"),
        ("diabetes_regression", "val/mae"),
        ("char_transformer", "val/perplexity"),
        ("dict_batches", "val/acc"),
    ],
)
def test_an_example_trains_from_its_readme_and_its_validation_metric_improves(
    tmp_path: Path, name: str, metric: str
) -> None:
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns("mlflow.db*", "mlruns", "outputs", "shapes"))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    command = readme_command(folder)
    proc = subprocess.run(
        [sys.executable, *command[1:]], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (run,) = client.search_runs(["1"])
    assert run.data.tags["task.primary"] == metric
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric))
    first, last = history[0][1], history[-1][1]
    assert len(history) >= 2 and (last < first if metric in LOWER_IS_BETTER else last > first), history
    (model,) = client.search_logged_models(["1"])
    assert metric in {m.key for m in model.metrics}
