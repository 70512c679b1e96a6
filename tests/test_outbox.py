"""A store unreachable at the end of a run: the outbox file, and importing it with ``python -m pipeline.outbox``."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

import pipeline.record.lifecycle as lifecycle
from pipeline.config import TrackingConfig
from pipeline.record import outbox
from pipeline.record.lifecycle import open_tracker
from pipeline.record.store import connect

SECRET = "s3cr3t-pw"
SERVER = f"http://alice:{SECRET}@127.0.0.1:9"  # what the run was configured with; never reached
LOGGED = [("train/loss", 1.0, 1), ("train/loss", 0.5, 2), ("train/loss", 0.25, 3), ("val/acc", 0.875, 1)]  # by key


class DownClient:
    """The real ``MlflowClient`` of a store that accepts the run's start, then goes down at the first metric write."""

    def __init__(self, real: MlflowClient) -> None:
        self.real, self.up = real, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def log_batch(self, run_id: str, metrics=(), params=(), tags=(), synchronous=None) -> None:
        self.up = self.up and not metrics
        if not self.up:
            raise ConnectionError(f"cannot reach {SERVER}")  # errors can quote the URI, credentials included
        self.real.log_batch(run_id, params=params, tags=tags)

    def set_terminated(self, run_id: str, status: str | None = None, end_time: int | None = None) -> None:
        raise ConnectionError("the tracking server is not answering")


@pytest.fixture
def down(store_uri: str, monkeypatch: pytest.MonkeyPatch) -> MlflowClient:
    """Runs opened on ``SERVER`` land in the real store at ``store_uri``, which then goes down; returns its client."""
    real, _ = connect(store_uri, "offline")
    monkeypatch.setattr(
        lifecycle, "connect", lambda uri, experiment: (DownClient(real), connect(store_uri, experiment)[1])
    )
    return real


def log_and_end(*, fail: bool = False) -> str:
    """Open a run on ``SERVER``, log ``LOGGED`` (with a flush that fails between), optionally raise; its run id."""
    with open_tracker(TrackingConfig(enabled=True, uri=SERVER, experiment="offline"), run_name="offline") as tracker:
        for key, value, step in LOGGED[:3]:
            tracker.log_metrics({key: value}, step)
        tracker.flush()  # fails: kept for the end
        key, value, step = LOGGED[3]
        tracker.log_metrics({key: value}, step)
        if fail:
            raise RuntimeError("evaluation exploded")
    return tracker.run_id


def history(client: MlflowClient, run_id: str) -> list[tuple[str, float, int]]:
    keys = sorted({key for key, _, _ in LOGGED})  # each key's history in step order, like LOGGED
    return [(k, m.value, m.step) for k in keys for m in client.get_metric_history(run_id, k)]


def test_an_unreachable_store_at_the_end_leaves_an_outbox_file_and_prints_its_command(
    down: MlflowClient, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pipeline.record.tracking"):
        run_id = log_and_end()
    path = tmp_path / "unsent_metrics" / f"{run_id}.jsonl"
    text = path.read_text()
    header, *points = (json.loads(line) for line in text.splitlines())
    assert header == {
        "outbox": 1,
        "run_id": run_id,
        "experiment_id": down.get_experiment_by_name("offline").experiment_id,
        "tracking_uri": "http://alice:***@127.0.0.1:9",
        "status": "FINISHED",
        "end_time": header["end_time"],
        "tags": {},
    }
    assert [(p["key"], p["value"], p["step"]) for p in points] == LOGGED
    assert all(isinstance(p["timestamp"], int) and p["timestamp"] <= header["end_time"] for p in points)
    assert SECRET not in text
    err = capsys.readouterr().err
    assert (
        err.count("python -m pipeline.outbox") == 1
        and f"python -m pipeline.outbox unsent_metrics/{run_id}.jsonl" in err
    )
    assert SECRET not in err and SECRET not in caplog.text
    assert down.get_run(run_id).info.status == "RUNNING"  # until the outbox is imported
    assert history(down, run_id) == []


def test_the_outbox_command_imports_the_metrics_and_status_once(
    down: MlflowClient, store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = log_and_end()
    path = Path("unsent_metrics") / f"{run_id}.jsonl"  # relative, as printed: the command runs where the run did
    end_time = json.loads(path.read_text().splitlines()[0])["end_time"]
    assert outbox.main([str(path), "--uri", store_uri]) == 0
    run = down.get_run(run_id)
    assert history(down, run_id) == LOGGED
    assert run.info.status == "FINISHED" and run.info.end_time == end_time  # the run's end, not the import's
    assert not path.exists() and Path(f"{path}.sent").exists()
    capsys.readouterr()
    assert outbox.main([str(path), "--uri", store_uri]) == 0
    assert "already sent" in capsys.readouterr().out
    assert history(down, run_id) == LOGGED  # no point twice


def test_a_failing_run_keeps_its_error_when_the_store_is_down_at_the_end(down: MlflowClient, store_uri: str) -> None:
    with pytest.raises(RuntimeError, match="^evaluation exploded$"):
        log_and_end(fail=True)
    (path,) = Path("unsent_metrics").glob("*.jsonl")
    header = json.loads(path.read_text().splitlines()[0])
    assert header["status"] == "FAILED" and header["tags"] == {"error": "RuntimeError: evaluation exploded"}
    assert outbox.main([str(path), "--uri", store_uri]) == 0
    run = down.get_run(header["run_id"])
    assert run.info.status == "FAILED" and run.data.tags["error"] == "RuntimeError: evaluation exploded"


def test_an_outbox_with_a_masked_uri_needs_uri_to_be_imported(
    down: MlflowClient, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = log_and_end()
    path = Path("unsent_metrics") / f"{run_id}.jsonl"
    capsys.readouterr()  # the run's own notice
    assert outbox.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--uri" in err and err.count("\n") == 1
    assert path.exists()  # nothing was sent


def test_an_import_that_fails_part_way_keeps_only_what_is_left(
    store_uri: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    client, experiment = connect(store_uri, "offline")
    run_id = client.create_run(experiment).info.run_id
    points = [outbox.Point("system/cpu_utilization_percentage", float(i), 1_000 + i, i) for i in range(1_500)]
    path = outbox.save(outbox.Outbox(run_id, experiment, store_uri, "KILLED", 9_999, {}, points), Path("box.jsonl"))
    original, calls = MlflowClient.log_batch, []

    def second_fails(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        calls.append(len(metrics))
        if len(calls) == 2:
            raise ConnectionError("the tracking server is not answering")
        return original(self, run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)

    monkeypatch.setattr(MlflowClient, "log_batch", second_fails)
    assert outbox.main([str(path)]) == 1
    assert "not answering" in capsys.readouterr().err
    assert calls == [1_000, 500] and len(outbox.load(path).points) == 500  # the first 1,000 are in the store
    assert outbox.main([str(path)]) == 0
    history = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert [m.step for m in history] == list(range(1_500))
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_missing_outbox_file_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert outbox.main(["unsent_metrics/nope.jsonl"]) == 2
    assert capsys.readouterr().err == "error: unsent_metrics/nope.jsonl: no such file\n"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["not json"], "box.jsonl line 1: not JSON"),
        (['{"run_id": "abc"}'], "box.jsonl line 1: not an outbox header"),
        (
            ['{"outbox": 1, "run_id": "abc", "status": "FINISHED", "end_time": 1}', '{"key": "a", "value": "x"}'],
            "box.jsonl line 2: a metric needs a key, a numeric value",
        ),
    ],
)
def test_a_malformed_outbox_file_names_the_line_and_exits_2(
    lines: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    Path("box.jsonl").write_text("\n".join(lines) + "\n")
    assert outbox.main(["box.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_a_second_outbox_for_the_same_run_does_not_overwrite_the_first(tmp_path: Path) -> None:
    first = outbox.save(outbox.Outbox("r1", "1", "sqlite:///x.db", "FINISHED", 1), outbox.fresh_path("r1"))
    second = outbox.fresh_path("r1")
    assert first == Path("unsent_metrics/r1.jsonl") and second == Path("unsent_metrics/r1-2.jsonl")


def moved_on_run(store_uri: str) -> tuple[MlflowClient, str, Path]:
    """A run whose first process was killed while the store was down (its outbox file says KILLED at ``t0`` and
    holds train/loss at step 3), then resumed: the resumed process logged steps 3 and 4 and ended FINISHED later."""
    client, experiment = connect(store_uri, "offline")
    run_id = client.create_run(experiment, start_time=1_000).info.run_id
    for step, (value, stamp) in enumerate([(1.0, 1_100), (0.5, 1_200)], start=1):  # written by the first process
        client.log_metric(run_id, "train/loss", value, timestamp=stamp, step=step)
    for step, (value, stamp) in enumerate([(0.3, 5_300), (0.2, 5_400)], start=3):  # by the resumed one
        client.log_metric(run_id, "train/loss", value, timestamp=stamp, step=step)
    client.set_terminated(run_id, "FINISHED", end_time=6_000)
    points = [outbox.Point("train/loss", 0.5, 1_200, 2), outbox.Point("train/loss", 0.25, 1_300, 3)]
    error = {"error": "Stopped: SIGTERM"}  # a tag the first process could not send
    box = outbox.Outbox(run_id, experiment, store_uri, "KILLED", 1_400, error, points)
    return client, run_id, outbox.save(box, outbox.fresh_path(run_id))


def test_an_import_never_rewrites_a_run_that_finished_after_the_file_was_written(
    store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client, run_id, path = moved_on_run(store_uri)
    assert outbox.main([str(path)]) == 0
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time == 6_000  # the resumed run's end, kept
    assert "error" not in run.data.tags
    steps = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == [(1, 1.0), (2, 0.5), (3, 0.3), (4, 0.2)]  # no point twice, no second step 3
    out = capsys.readouterr().out
    assert f"run {run_id} ended FINISHED after this file was written" in out and "kept" in out
    assert not path.exists() and Path(f"{path}.sent").exists()


def test_an_import_leaves_a_run_that_another_process_trains_now_running(store_uri: str) -> None:
    client, experiment = connect(store_uri, "offline")
    run_id = client.create_run(experiment).info.run_id
    client.set_tag(run_id, "process.started", f"{(time.time() + 60):.2f}")  # a resume started after the file
    points = [outbox.Point("val/acc", 0.5, 1_300, 1)]
    path = outbox.save(outbox.Outbox(run_id, experiment, store_uri, "KILLED", 1_400, {}, points), Path("box.jsonl"))
    assert outbox.main([str(path)]) == 0
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and run.info.end_time is None
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val/acc")] == [(1, 0.5)]


def test_an_outbox_file_for_a_deleted_run_says_restore_it_or_delete_the_file_and_exits_2(
    store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client, experiment = connect(store_uri, "offline")
    run_id = client.create_run(experiment).info.run_id
    client.delete_run(run_id)
    points = [outbox.Point("val/acc", 0.5, 1_300, 1)]
    path = outbox.save(outbox.Outbox(run_id, experiment, store_uri, "KILLED", 1_400, {}, points), Path("box.jsonl"))
    capsys.readouterr()  # MLflow's notes on making the store
    assert outbox.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: run {run_id} was deleted") and err.count("\n") == 1, err
    assert "mlflow runs restore --run-id" in err and "delete box.jsonl" in err and "refused" not in err
    assert path.exists()


def test_an_outbox_import_into_a_missing_store_creates_none(capsys: pytest.CaptureFixture[str]) -> None:
    points = [outbox.Point("val/acc", 0.5, 1_300, 1)]
    path = outbox.save(outbox.Outbox("r1", "1", "sqlite:///gone.db", "KILLED", 1_400, {}, points), Path("box.jsonl"))
    assert outbox.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no MLflow store at sqlite:///") and err.count("\n") == 1, err
    assert not Path("gone.db").exists()


def test_an_import_into_a_server_that_is_down_is_one_line_in_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from servers import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there: MLflow itself would retry for minutes
    path = outbox.save(outbox.Outbox("r1", "1", uri, "KILLED", 1_400, {}, []), tmp_path / "box.jsonl")
    assert outbox.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: tracking.uri={uri} cannot be reached")
    assert path.exists()  # the file keeps its metrics for the import that works
