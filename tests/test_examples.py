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
    assert folders == ["char_transformer", "diabetes_regression", "dict_batches", "image_folder_cnn", "word_lm"]
    assert all(readme_command(EXAMPLES / name)[:3] == ["python", "-m", "pipeline"] for name in folders)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "metric"),
    [
        ("image_folder_cnn", "val/acc"),
        ("diabetes_regression", "val/mae"),
        ("char_transformer", "val/perplexity"),
        ("dict_batches", "val/acc"),
    ],  # word_lm: its own test below, against its plain script
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


@pytest.mark.slow
def test_the_word_lm_trains_as_its_plain_script_does_and_keeps_every_record(tmp_path: Path) -> None:
    """Issue 36's first Done-when: the recurrent language model of the usual research kind, through step=custom, gives
    the plain PyTorch script's validation perplexity (within 2%; the same numbers, here) after 3 epochs, with the
    pipeline's summary, step-time split, MFU, record and logged model."""
    folder = tmp_path / "word_lm"
    shutil.copytree(EXAMPLES / "word_lm", folder, ignore=shutil.ignore_patterns("mlflow.db*", "mlruns", "outputs"))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    run = subprocess.run(
        [sys.executable, *readme_command(folder)[1:]], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    plain = subprocess.run(
        [sys.executable, "plain.py"], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and plain.returncode == 0, run.stderr[-3000:] + plain.stderr[-3000:]
    reference = [float(line.split()[-1]) for line in plain.stdout.splitlines() if line.startswith("epoch")]
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (record,) = client.search_runs(["1"])
    history = sorted((m.step, m.value) for m in client.get_metric_history(record.info.run_id, "val/perplexity"))
    assert len(reference) == 3 and [v for _, v in history] == pytest.approx(reference, rel=0.02)
    for line in ("step time ", "compute  ", "of this CPU's fp32 peak (MFU)", "model out   mlflow.pytorch.load_model("):
        assert line in run.stdout, run.stdout
    params, tags = record.data.params, record.data.tags
    assert params["step._target_"] == "lm.tbptt" and params["trainer.clip_grad_norm"] == "0.25"
    assert tags["model.class"] == "model.RecurrentLM" and "perf/mfu_pct" in record.data.metrics
    lrs = [m.value for m in client.get_metric_history(record.info.run_id, "train/lr")]
    assert lrs[0] == 20.0 and "train/grad_norm" in record.data.metrics
    (model,) = client.search_logged_models(["1"])
    assert "val/perplexity" in {m.key for m in model.metrics}


@pytest.mark.slow
def test_the_word_lm_trains_under_torchrun_each_rank_a_stream_of_its_own(tmp_path: Path) -> None:
    """Two gloo ranks, each reading a contiguous share of whole batches in corpus order, its hidden state its own,
    the gradients averaged before they are clipped."""
    folder = tmp_path / "word_lm"
    shutil.copytree(EXAMPLES / "word_lm", folder, ignore=shutil.ignore_patterns("mlflow.db*", "mlruns", "outputs"))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "pipeline"]
    args = [*readme_command(folder)[3:], "trainer.epochs=2", "device=cpu", "monitor.plots=false"]
    run = subprocess.run([*torchrun, *args], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "distributed 2 ranks over gloo, batch 20 per rank, 40 in all" in run.stdout
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (record,) = client.search_runs(["1"])
    history = sorted((m.step, m.value) for m in client.get_metric_history(record.info.run_id, "val/perplexity"))
    assert len(history) == 2 and history[-1][1] < history[0][1]
