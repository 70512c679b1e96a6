"""The MLflow record, read back through the MLflow client: params, tags, metrics, artifacts, status."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

import pipeline.train as train_module
from pipeline.config import RunConfig, flatten
from pipeline.provenance import git_tags
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[MlflowClient, str, RunConfig]:
    """One tiny tracked run shared by the read-back tests (a store costs seconds to create)."""
    from pipeline.config import load

    folder = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    overrides = [
        "device=cpu",
        f"tracking.uri={uri}",
        "trainer.epochs=2",
        "trainer.max_steps=30",
        "trainer.log_every_n_steps=5",
        "+tracking.tags.team=vision",
    ]
    cfg = load(overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        result = train(cfg, overrides=overrides, echo=False)
    return MlflowClient(uri), result.run_id, cfg


def test_every_config_key_is_a_param(recorded: tuple[MlflowClient, str, RunConfig]) -> None:
    client, run_id, cfg = recorded
    params = client.get_run(run_id).data.params
    assert set(params) == set(flatten(cfg.to_dict()))
    assert params["loader.batch_size"] == "64" and params["model.name"] == "mlp" and params["amp"] == "false"
    assert params["model.hidden_sizes"] == "[512]" and params["device.index"] == "null"


def test_tags_say_where_and_how_it_ran(recorded: tuple[MlflowClient, str, RunConfig]) -> None:
    client, run_id, _ = recorded
    tags = client.get_run(run_id).data.tags
    assert tags["mlflow.runName"] == "mlp-digits-cpu-bs64-w0"
    assert tags["device.type"] == "cpu" and tags["device.name"] and tags["precision"] == "fp32"
    assert tags["torch.version"].startswith("2.") and tags["mlflow.source.name"] == "python -m pipeline"
    assert "tracking.log_every_n_steps" not in tags["overrides"] and "trainer.max_steps=30" in tags["overrides"]
    assert tags["team"] == "vision"
    assert "val/acc" in tags["mlflow.note.content"] and "samples/s" in tags["mlflow.note.content"]


def test_metrics_cover_loss_accuracy_time_and_throughput(recorded: tuple[MlflowClient, str, RunConfig]) -> None:
    client, run_id, _ = recorded
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == [5, 10, 15, 20, 25, 30]
    for key in ("train/epoch_loss", "val/loss", "val/acc", "time/epoch_s", "throughput/samples_per_s"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2], key
    assert run.data.metrics["time/total_s"] > 0
    assert 0 <= run.data.metrics["val/acc"] <= 1 and run.data.metrics["throughput/samples_per_s"] > 0


def test_artifacts_hold_the_resolved_config_and_the_overrides(
    recorded: tuple[MlflowClient, str, RunConfig], tmp_path: Path
) -> None:
    client, run_id, cfg = recorded
    assert yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read_text()) == (
        cfg.to_dict()
    )
    overrides = Path(client.download_artifacts(run_id, "overrides.txt", str(tmp_path))).read_text().splitlines()
    assert "trainer.max_steps=30" in overrides


def test_dataset_is_recorded_as_a_run_input(recorded: tuple[MlflowClient, str, RunConfig]) -> None:
    client, run_id, _ = recorded
    inputs = client.get_run(run_id).inputs.dataset_inputs
    assert len(inputs) == 1
    dataset = inputs[0].dataset
    assert dataset.name == "digits" and len(dataset.digest) == 8
    assert {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == "train"


def test_metrics_are_written_in_batches_not_per_step(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    writes: list[int] = []
    original = MlflowClient.log_batch

    def counting(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        if metrics:
            writes.append(len(metrics))
        return original(self, run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)

    monkeypatch.setattr(MlflowClient, "log_batch", counting)
    result = train(make_cfg("trainer.epochs=3", "trainer.max_steps=-1", "trainer.log_every_n_steps=1"), echo=False)
    assert result.steps == 3 * 45  # 1,438 samples at batch 32, one train/loss value per step
    assert len(writes) <= 3 + 1  # one write per epoch, plus the end
    history = MlflowClient(store_uri).get_metric_history(result.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, result.steps + 1))


def test_a_failing_run_is_marked_failed_with_the_error(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("evaluation exploded")

    monkeypatch.setattr(train_module, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation exploded"):
        train(make_cfg(), echo=False)
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == "RuntimeError: evaluation exploded"
    assert "train/loss" in run.data.metrics or run.data.params  # what was logged before the failure is kept


def test_ctrl_c_marks_the_run_killed(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(make_cfg(), echo=False)
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "KILLED"


def test_tracking_off_writes_no_store(make_cfg: MakeCfg, tmp_path: Path) -> None:
    result = train(make_cfg("tracking=none"), echo=False)
    assert result.run_id is None
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


def test_runs_land_in_the_named_experiment_and_are_comparable(make_cfg: MakeCfg, store_uri: str) -> None:
    for bs in (16, 32):
        train(make_cfg("tracking.experiment=sweep", f"loader.batch_size={bs}"), echo=False)
    client = MlflowClient(store_uri)
    experiment = client.get_experiment_by_name("sweep")
    runs = client.search_runs([experiment.experiment_id], filter_string="params.`loader.batch_size` = '16'")
    assert len(runs) == 1 and runs[0].data.tags["mlflow.runName"] == "mlp-digits-cpu-bs16-w0"


def test_git_tags_record_the_commit_and_whether_the_tree_was_dirty(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    tags = git_tags(str(tmp_path))
    assert tags["mlflow.source.git.commit"] == git("rev-parse", "HEAD") and tags["git.dirty"] == "false"
    (tmp_path / "a.txt").write_text("2")
    assert git_tags(str(tmp_path))["git.dirty"] == "true"


def test_git_tags_are_absent_outside_a_repository(tmp_path: Path) -> None:
    assert git_tags(str(tmp_path)) == {}


def test_the_doctors_report_is_attached_as_environment_json(
    recorded: tuple[MlflowClient, str, RunConfig], tmp_path: Path
) -> None:
    client, run_id, _ = recorded
    report = json.loads(Path(client.download_artifacts(run_id, "environment.json", str(tmp_path))).read_text())
    assert {c["name"] for c in report["checks"]} >= {"NVIDIA GPU", "torch build", "data loading"}
    assert report["facts"]["torch_version"].startswith("2.")
    tags = client.get_run(run_id).data.tags
    assert tags["driver.version"] == (report["facts"]["driver_version"] or "none")
    assert tags["driver.cuda"] == (report["facts"]["driver_cuda"] or "none")
