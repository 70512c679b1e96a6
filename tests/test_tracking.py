"""The MLflow record, read back through the MLflow client: params, tags, metrics, artifacts, status; and the
tracker's buffer and writer thread under blocked, failing and locked writes (faults injected into log_batch)."""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

import pipeline.record.lifecycle as lifecycle
import pipeline.record.tracking as tracking
from pipeline.config import RunConfig, flatten
from pipeline.engine.building.provenance import git_tags
from pipeline.engine.session import Hooks
from pipeline.record.store import connect
from pipeline.record.tracking import FLUSH_AT, MlflowTracker
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


@pytest.fixture(scope="module")
def store_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def recorded_overrides(store_folder: Path) -> list[str]:
    return [
        "device=cpu",
        f"tracking.uri=sqlite:///{store_folder / 'mlflow.db'}",
        "trainer.epochs=2",
        "trainer.max_steps=30",
        "trainer.log_every_n_steps=5",
        "+tracking.tags.team=vision",
    ]


@pytest.fixture(scope="module")
def recorded(store_folder: Path, recorded_overrides: list[str]) -> tuple[MlflowClient, str, RunConfig]:
    """One tiny tracked run shared by the read-back tests (a store costs seconds to create)."""
    from pipeline.config import load

    cfg = load(recorded_overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(store_folder)
        result = train(cfg, overrides=recorded_overrides, echo=False)
    return MlflowClient(f"sqlite:///{store_folder / 'mlflow.db'}"), result.run_id, cfg


def test_every_config_key_is_a_param(recorded: tuple[MlflowClient, str, RunConfig]) -> None:
    client, run_id, cfg = recorded
    params = client.get_run(run_id).data.params
    assert set(params) == set(flatten(cfg.to_dict()))
    assert (
        params["loader.batch_size"] == "64"
        and params["model._target_"] == "pipeline.engine.models.mlp"
        and params["amp"] == "false"
    )
    assert params["model.hidden_sizes"] == "[512]" and params["device.index"] == "null"


def test_tags_say_where_and_how_it_ran(
    recorded: tuple[MlflowClient, str, RunConfig], recorded_overrides: list[str]
) -> None:
    client, run_id, _ = recorded
    tags = client.get_run(run_id).data.tags
    assert tags["mlflow.runName"] == "mlp-digits-cpu-bs64-w0"
    assert tags["device.type"] == "cpu" and tags["device.name"] and tags["precision"] == "fp32"
    assert tags["torch.version"].startswith("2.") and tags["mlflow.source.name"] == "python -m pipeline"
    assert tags["overrides"] == shlex.join(recorded_overrides)  # as typed, in order, quoted for a shell
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
    # the writer's clock out of the way: an epoch slower than its period (a busy machine) would add a timed write
    monkeypatch.setattr(tracking, "WRITE_EVERY_S", 3600.0)
    overrides = ["trainer.epochs=3", "trainer.max_steps=-1", "trainer.log_every_n_steps=1", "tracking.log_model=false"]
    result = train(make_cfg(*overrides), echo=False)
    assert result.steps == 3 * 45  # 1,438 samples at batch 32, one train/loss value per step
    assert len(writes) <= 3 + 1  # one write per epoch, plus the end
    history = MlflowClient(store_uri).get_metric_history(result.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, result.steps + 1))


def test_a_failing_run_is_marked_failed_with_the_error(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    def broken(seconds: float) -> None:
        raise RuntimeError("evaluation exploded")

    with pytest.raises(RuntimeError, match="evaluation exploded"):
        train(make_cfg("trainer.log_every_n_steps=1"), echo=False, hooks=Hooks(evaluated=broken))
    client = MlflowClient(store_uri)
    (run,) = client.search_runs(experiment_ids=["1"])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == "RuntimeError: evaluation exploded"
    history = client.get_metric_history(run.info.run_id, "train/loss")  # logged before the failure, kept
    assert [m.step for m in history] == [1, 2, 3]


def test_ctrl_c_marks_the_run_killed(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str) -> None:
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(make_cfg(), echo=False, hooks=Hooks(evaluated=interrupted))
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
    assert "git.diff" not in tags
    (tmp_path / "a.txt").write_text("2")
    two = git_tags(str(tmp_path))
    assert two["git.dirty"] == "true" and len(two["git.diff"]) == 12
    assert git_tags(str(tmp_path))["git.diff"] == two["git.diff"]  # the same edit, the same hash
    (tmp_path / "a.txt").write_text("3")
    assert git_tags(str(tmp_path))["git.diff"] != two["git.diff"]  # another edit of the same commit: another row


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


# The tracker's buffer and writer thread, on a real store with faults injected into log_batch.

WRITER = "pipeline-tracking-writer"


class HookedClient:
    """The real ``MlflowClient``, with every metric write shown to ``hook`` first (to block, fail or record it)."""

    def __init__(self, real: MlflowClient, hook: Callable[[list[Any]], None]) -> None:
        self.real, self.hook = real, hook
        self.written = threading.Event()  # set once metrics are in the store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def log_batch(self, run_id: str, metrics=(), params=(), tags=(), synchronous=None) -> None:
        if metrics:
            self.hook(list(metrics))
        self.real.log_batch(run_id, metrics=metrics, params=params, tags=tags)
        if metrics:
            self.written.set()


def new_run(store_uri: str, hook: Callable[[list[Any]], None]) -> tuple[MlflowClient, MlflowTracker]:
    """A run in a real SQLite store and a tracker on it whose metric writes pass through ``hook``."""
    client, experiment = connect(store_uri, "unit")
    run_id = client.create_run(experiment).info.run_id
    tracker = MlflowTracker(
        HookedClient(client, hook), uri=store_uri, experiment_id=experiment, experiment="unit", run_id=run_id
    )
    return client, tracker


def steps(client: MlflowClient, run_id: str, key: str = "train/loss") -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


def test_log_metrics_returns_while_a_write_is_blocked_in_the_store(store_uri: str) -> None:
    entered, release = threading.Event(), threading.Event()

    def block(metrics: list[Any]) -> None:
        entered.set()
        release.wait(10)

    client, tracker = new_run(store_uri, block)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    flusher = threading.Thread(target=tracker.flush)
    flusher.start()
    try:
        assert entered.wait(5), "the flush never reached log_batch"
        logger = threading.Thread(target=tracker.log_metrics, args=({"train/loss": 0.5}, 2))
        logger.start()
        logger.join(5)  # a deadlock guard: an append takes microseconds
        assert not logger.is_alive(), "log_metrics waited for the write in flight"
    finally:
        release.set()
        flusher.join(5)
    tracker.flush()
    assert steps(client, tracker.run_id) == [1, 2]


def test_metrics_logged_past_flush_at_on_another_thread_are_written_by_the_writer_thread(
    store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracking, "WRITE_EVERY_S", 3600.0)  # only passing FLUSH_AT can wake the writer
    writers: list[str] = []
    wrote = threading.Event()

    def record(metrics: list[Any]) -> None:
        writers.append(threading.current_thread().name)
        wrote.set()

    client, tracker = new_run(store_uri, record)
    tracker.start()

    def sample() -> None:
        for tick in range(FLUSH_AT):
            tracker.log_metrics({"system/cpu_utilization_percentage": 50.0}, tick)

    sampler = threading.Thread(target=sample, name="pipeline-sampler")
    sampler.start()
    sampler.join(5)
    assert wrote.wait(5), "passing FLUSH_AT did not wake the writer thread"
    tracker.end("FINISHED")
    assert writers == [WRITER]  # one write, of all FLUSH_AT metrics, never on the sampler's thread
    assert steps(client, tracker.run_id, "system/cpu_utilization_percentage") == list(range(FLUSH_AT))


def test_the_writer_thread_shows_live_metrics_without_a_flush_and_stops_with_the_run(
    store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracking, "WRITE_EVERY_S", 0.05)
    writers: list[str] = []
    client, tracker = new_run(store_uri, lambda metrics: writers.append(threading.current_thread().name))
    tracker.start()
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    assert tracker.client.written.wait(5), "the writer thread never wrote"
    assert steps(client, tracker.run_id) == [1]  # in the store mid-epoch, before any flush
    assert tracker.write_s == 0.0  # the training thread paid nothing for it
    tracker.end("FINISHED")
    assert writers == [WRITER] and tracker.background_write_s > 0
    assert WRITER not in [t.name for t in threading.enumerate()]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_a_failed_write_keeps_its_metrics_for_the_next_flush_and_warns_once(
    store_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    batches: list[list[int]] = []

    def down_twice(metrics: list[Any]) -> None:
        batches.append([m.step for m in metrics])
        if len(batches) <= 2:
            raise ConnectionError("the tracking server is not answering")

    client, tracker = new_run(store_uri, down_twice)
    with caplog.at_level(logging.WARNING, logger="pipeline.record.tracking"):
        for step in (1, 2, 3):
            tracker.log_metrics({"train/loss": 1.0 / step}, step)
            tracker.flush()  # fails twice without raising into the loop, then writes all three
    assert batches == [[1], [1, 2], [1, 2, 3]]
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "train/loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, 1 / 3),
    ]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not answering" in warnings[0].getMessage()


def test_metrics_logged_during_a_failed_write_stay_behind_the_ones_it_puts_back(store_uri: str) -> None:
    entered, release = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def fail_first(metrics: list[Any]) -> None:
        batches.append([m.step for m in metrics])
        if len(batches) == 1:
            entered.set()
            release.wait(10)
            raise ConnectionError("the tracking server is not answering")

    client, tracker = new_run(store_uri, fail_first)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    tracker.log_metrics({"train/loss": 0.5}, step=2)
    flusher = threading.Thread(target=tracker.flush)
    flusher.start()
    try:
        assert entered.wait(5), "the flush never reached log_batch"
        logger = threading.Thread(target=tracker.log_metrics, args=({"train/loss": 0.25}, 3))
        logger.start()
        logger.join(5)  # a deadlock guard
        assert not logger.is_alive(), "log_metrics waited for the write in flight"
    finally:
        release.set()
        flusher.join(5)
    tracker.flush()
    assert batches == [[1, 2], [1, 2, 3]]  # put back in front, in order
    assert steps(client, tracker.run_id) == [1, 2, 3]


def test_a_locked_database_is_retried_within_the_same_write_without_a_warning(
    store_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def locked_once(metrics: list[Any]) -> None:
        calls.append(len(metrics))
        if len(calls) == 1:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")

    client, tracker = new_run(store_uri, locked_once)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    with caplog.at_level(logging.WARNING, logger="pipeline.record.tracking"):
        tracker.flush()
    assert calls == [1, 1] and steps(client, tracker.run_id) == [1]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_ctrl_c_during_a_flush_keeps_its_metrics_for_the_runs_end(store_uri: str) -> None:
    calls: list[int] = []

    def interrupted_once(metrics: list[Any]) -> None:
        calls.append(len(metrics))
        if len(calls) == 1:
            raise KeyboardInterrupt

    client, tracker = new_run(store_uri, interrupted_once)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    with pytest.raises(KeyboardInterrupt):
        tracker.flush()
    tracker.end("KILLED")
    assert calls == [1, 1] and steps(client, tracker.run_id) == [1]
    assert client.get_run(tracker.run_id).info.status == "KILLED"


# Masking: every string the tracker sends to MLflow, and every line it logs, without the secret values.

SECRET = "hunter2-7Q9zX"


class RecordingClient:
    """Stands in for ``MlflowClient``: keeps every call as text (a figure as the texts drawn in it)."""

    def __init__(self, fail_metrics: Exception | None = None) -> None:
        self.sent: list[str] = []
        self.fail_metrics = fail_metrics

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: self.sent.append(repr((name, args, kwargs)))

    def log_batch(self, run_id: str, metrics=(), params=(), tags=(), synchronous=None) -> None:
        if metrics and self.fail_metrics:
            raise self.fail_metrics
        self.sent.append(repr(("log_batch", list(metrics), list(params), list(tags))))

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
        from matplotlib.text import Text

        self.sent.append(repr(("log_figure", [t.get_text() for t in figure.findobj(Text)])))


def test_every_string_the_tracker_sends_is_masked_with_the_secret_values() -> None:
    from matplotlib.figure import Figure

    from pipeline.data.sources import DataSpec

    client = RecordingClient()
    tracker = MlflowTracker(
        client, uri="sqlite:///x.db", experiment_id="1", experiment="unit", run_id="r1", secret_values={SECRET}
    )
    tracker.log_params({"data.root": f"/data/{SECRET}", "optimizer.lr": 0.1, "tracking.tags.pwd": "open-sesame"})
    tracker.set_tags({"mlflow.note.content": f"run {SECRET}: 1 epoch", "hint": "curl -H 'X-Api-Key: abc123'"})
    tracker.log_text(f"data:\n  root: /data/{SECRET}\n", "config.yaml")
    spec = DataSpec(SECRET, (1, 28, 28), 10, 8, 2, (0.1,), (0.3,), source=f"/data/{SECRET}", digest="0badf00d")
    tracker.log_dataset(spec, context="train")

    def figure() -> Any:
        fig = Figure()
        fig.subplots().set_title(SECRET)
        return fig

    tracker.log_figure(figure, "plots/x.png")
    tracker.end("FAILED", tags={"error": f"NotADirectoryError: /data/{SECRET}/ckpt"})
    sent = "\n".join(client.sent)
    assert SECRET not in sent and "open-sesame" not in sent and "abc123" not in sent
    calls = [line.split(",")[0] for line in client.sent]
    assert calls.count("('log_batch'") == 3 and {"('log_text'", "('log_inputs'", "('log_figure'"} <= set(calls)
    assert all("***" in line for line in client.sent if not line.startswith("('set_terminated'"))
    assert "0.1" in sent and "/data/***/ckpt" in sent  # the rest stays readable


def test_the_trackers_own_warnings_never_show_a_secret_value(caplog: pytest.LogCaptureFixture) -> None:
    client = RecordingClient(fail_metrics=ConnectionError(f"cannot reach https://{SECRET}.example.org"))
    tracker = MlflowTracker(
        client,
        uri=f"https://{SECRET}.example.org",
        experiment_id="1",
        experiment="unit",
        run_id="r1",
        secret_values={SECRET},
    )
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    with caplog.at_level(logging.INFO, logger="pipeline.record.tracking"):
        tracker.flush()
    assert "cannot reach" in caplog.text and SECRET not in caplog.text


def test_open_tracker_refuses_an_experiment_named_after_a_secret_value_before_touching_the_store(
    tmp_path: Path,
) -> None:
    from pipeline.common.errors import ConfigError
    from pipeline.config import TrackingConfig

    cfg = TrackingConfig(enabled=True, uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment=f"team-{SECRET}")
    with (
        pytest.raises(ConfigError, match=r"tracking.experiment='\*\*\*'") as err,
        lifecycle.open_tracker(cfg, run_name="r", secret_values={SECRET}),
    ):
        pass
    assert SECRET not in str(err.value) and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("uri", ["sqlite:///:memory:", "sqlite://", "sqlite:///:memory:?cache=shared"])
def test_an_in_memory_store_is_refused_in_one_line(uri: str) -> None:
    from pipeline.common.errors import ConfigError
    from pipeline.config import load

    match = (
        r"^tracking\.uri='sqlite:.*' is not allowed: expected a database file.* records the run nowhere.*tracking=none"
    )
    with pytest.raises(ConfigError, match=match) as err:
        load([f"tracking.uri='{uri}'"])
    assert "\n" not in str(err.value)
    load(["tracking=none", f"tracking.uri='{uri}'"])  # not used: nothing to refuse


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("tracking.run_name='   '", r"^tracking\.run_name='   ' is not allowed: expected a non-empty name or null"),
        ("tracking.experiment=" + "e" * 501, r"^tracking\.experiment='e{501}' .* at most 500 characters"),
        ("tracking.run_name=" + "r" * 251, r"^tracking\.run_name='r{251}' .* at most 250 characters"),
        ("+tracking.tags." + "k" * 251 + "=v", r"^tracking\.tags\.k{251}='v' .* keys of at most 250 characters"),
        ("+tracking.tags.k=" + "v" * 8001, r"^tracking\.tags\.k='v{40}\.\.\.' .* values of at most 8000 characters"),
        ("tracking.run_name='a\nb'", r"^tracking\.run_name='a\\nb' .* a name on one line, without control"),
    ],
)
def test_blank_and_over_long_names_are_refused_before_any_data_loads(override: str, match: str) -> None:
    from pipeline.common.errors import ConfigError
    from pipeline.config import load

    with pytest.raises(ConfigError, match=match) as err:
        load([override])
    assert "\n" not in str(err.value)


def test_the_length_limits_are_mlflows_own() -> None:
    from mlflow.store.tracking.dbmodels.models import SqlRun
    from mlflow.utils import validation

    from pipeline.config import schema as config

    assert config.MAX_EXPERIMENT_NAME == validation.MAX_EXPERIMENT_NAME_LENGTH
    assert config.MAX_TAG_KEY == validation.MAX_ENTITY_KEY_LENGTH
    assert config.MAX_TAG_VALUE == validation.MAX_TAG_VAL_LENGTH
    assert SqlRun.name.type.length == config.MAX_RUN_NAME


def test_an_override_key_too_long_for_a_file_name_is_one_line() -> None:
    from pipeline.common.errors import OverrideError
    from pipeline.config import load

    with pytest.raises(OverrideError, match=r"^\+foo\.x+\.\.\.: not a config key \(too long\)$"):
        load(["+foo." + "x" * 300 + "=1"])
