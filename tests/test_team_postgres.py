"""The team server as teams deploy it: ``mlflow server`` with its runs in PostgreSQL and the artifacts it is sent
in a folder (``--artifacts-destination``), under load (four runs and a sweep at once) and through a crash (SIGKILL,
restarted on the same port), with every run, param, metric point and artifact checked to arrive exactly once.

One PostgreSQL cluster and one server for the module (``tests/servers.py``); skipped, with how to install it, where
PostgreSQL or MLflow's drivers for it are missing. Runs under load are real ``python -m pipeline`` processes; the
crash is injected into an in-process run at chosen points, so what each side holds at that moment is known.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from mlflow import MlflowClient
from mlflow.entities import Run, ViewType
from mlflow.exceptions import MlflowException

from pipeline.config import RunConfig, flatten, load
from pipeline.record import outbox
from pipeline.record.runs import create_run
from pipeline.record.tracking import MlflowTracker
from pipeline.train import train
from servers import MlflowServer, answer_lost, mlflow_server, postgres, postgres_missing

MakeCfg = Callable[..., RunConfig]
RUNS = 4  # concurrent training processes, besides the sweep: five writers at once (eight cost the suite ~70 CPU-s)
SWEEP_SEEDS = (1, 2)  # the sweep's two jobs retrain the seeds of two runs: the same values, or a defect
EPOCHS, STEPS_PER_EPOCH = 2, 3  # 96 synthetic samples in batches of 32; train/loss at every step
SMALL = [
    "device=cpu",
    "data=synthetic",
    "data.num_samples=96",
    "data.val_samples=100",
    "loader.batch_size=32",
    f"trainer.epochs={EPOCHS}",
    "trainer.log_every_n_steps=1",
    "monitor.plots=false",  # the artifacts left are config.yaml, overrides.txt and environment.json
]
# metrics whose presence or count depends on the machine's speed: the utilisation sampler's readings, the automatic
# profile of a run whose MFU is low only when its few steps fit the run's time budget, and the replay check's figures
# only when a replayed step fits its own
SAMPLED = ("system/", "cpu/", "gpu/", "profile/", "perf/replay_", "time/replay_s")
ARTIFACTS = ["config.yaml", "environment.json", "overrides.txt"]
WITHIN_S = 600  # the whole load, on a busy two-core machine; about 20 s alone on a quiet one


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """``mlflow server --backend-store-uri postgresql://mlflow@127.0.0.1:<port>/mlflow`` (the password in
    PGPASSWORD, as a deployment would keep it out of the command line) with proxied artifacts."""
    missing = postgres_missing()
    if missing is not None:
        pytest.skip(missing)
    folder = tmp_path_factory.mktemp("team")
    with postgres(folder / "db") as db, mlflow_server(folder / "server", backend=db.uri, env=db.env) as started:
        yield started


def pipeline_process(folder: Path, *overrides: str) -> subprocess.Popen[bytes]:
    """``python -m pipeline`` in its own folder (Hydra's outputs/ and the checkpoints apart); its output goes to
    ``output.txt`` there (a file, not a pipe nobody reads while the others are waited for)."""
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["OMP_NUM_THREADS"] = "1"  # five processes on two cores: torch's default of one thread per core each thrashes
    with (folder / "output.txt").open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline", *overrides], cwd=folder, env=env, stdout=output, stderr=subprocess.STDOUT
        )


@contextlib.contextmanager
def all_ended(processes: Iterable[subprocess.Popen[bytes]]) -> Iterator[None]:
    """Kill whichever of ``processes`` still runs when the block ends (a failed assertion, a timeout)."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def expected_params(*overrides: str) -> dict[str, str]:
    """What a run of these overrides records as params: its whole config under dotted keys, as MLflow's text."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in flatten(load(overrides).to_dict()).items()}


def histories(client: MlflowClient, run: Run) -> dict[str, list[tuple[int, float]]]:
    """Every metric of ``run`` as the store holds it: (step, value) pairs, sorted by step, repeats kept."""
    keys = run.data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in keys}


def differs(one: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The keys whose values differ, with both values (None: missing)."""
    return {k: (one.get(k), other.get(k)) for k in one.keys() | other.keys() if one.get(k) != other.get(k)}


def steps(history: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in history]


def per_epoch(output: str, name: str) -> list[float]:
    """A figure each epoch's line prints (``epoch 1/2: ... val/acc 0.0938``), in epoch order."""
    return [float(v) for v in re.findall(rf"epoch \d+/\d+: .*{re.escape(name)} ([0-9.]+)", output)]


@pytest.mark.slow
def test_four_runs_and_a_sweep_at_once_land_every_run_param_metric_point_and_artifact_exactly_once(
    server: MlflowServer, tmp_path: Path
) -> None:
    common = [*SMALL, f"tracking.uri={server.uri}", "tracking.experiment=load"]
    seeds = range(1, RUNS + 1)
    runs = {seed: pipeline_process(tmp_path / f"run{seed}", *common, f"trainer.seed={seed}") for seed in seeds}
    swept = ",".join(map(str, SWEEP_SEEDS))
    sweep = pipeline_process(tmp_path / "sweep", "-m", *common, f"trainer.seed={swept}")
    with all_ended([*runs.values(), sweep]):
        for process in [*runs.values(), sweep]:
            process.wait(timeout=WITHIN_S)
    outputs = {seed: (tmp_path / f"run{seed}" / "output.txt").read_text() for seed in seeds}
    for seed, process in runs.items():
        assert process.returncode == 0, outputs[seed][-3000:]
    assert sweep.returncode == 0, (tmp_path / "sweep" / "output.txt").read_text()[-3000:]

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("load")  # None (no such experiment) fails on its id below
    found = client.search_runs([experiment.experiment_id], max_results=1000)
    [parent] = [r for r in found if r.data.tags.get("sweep.role") == "parent"]
    trained = [r for r in found if r is not parent]
    alone = {r.info.run_id: r for r in trained if "mlflow.parentRunId" not in r.data.tags}
    jobs = [r for r in trained if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    # runs: one per process and one per job, none lost, none twice, each ended
    assert sorted(int(r.data.params["trainer.seed"]) for r in alone.values()) == list(range(1, RUNS + 1))
    assert sorted(int(r.data.params["trainer.seed"]) for r in jobs) == list(SWEEP_SEEDS)
    assert len(found) == RUNS + len(SWEEP_SEEDS) + 1
    assert {r.info.status for r in found} == {"FINISHED"}
    for seed, output in outputs.items():  # each process wrote to the run it announced
        run_id = re.search(r"MLflow run ([0-9a-f]{32}) in experiment 'load'", output)
        assert run_id is not None and alone[run_id[1]].data.params["trainer.seed"] == str(seed)

    # params: the whole config of each run, exactly; the dataset input once
    for run in trained:
        seed = run.data.params["trainer.seed"]
        assert run.data.params == expected_params(*common, f"trainer.seed={seed}")
        assert len(run.inputs.dataset_inputs) == 1

    # metric points: every step once in every run, and the values the run computed
    steps_total = EPOCHS * STEPS_PER_EPOCH
    stored = {r.info.run_id: histories(client, r) for r in trained}
    layouts = {run_id: {k: steps(h) for k, h in metrics.items()} for run_id, metrics in stored.items()}
    for layout in layouts.values():  # the sampler's readings: all their keys at the same ticks, each tick once
        [ticks] = {tuple(s) for k, s in layout.items() if k.startswith("system/")}
        assert list(ticks) == sorted(set(ticks))
    timed = {run_id: {k: s for k, s in lay.items() if not k.startswith(SAMPLED)} for run_id, lay in layouts.items()}
    layout = next(iter(timed.values()))
    differences = {run_id: differs(other, layout) for run_id, other in timed.items() if other != layout}
    assert differences == {}  # a point lost in one run shows here
    assert layout["train/loss"] == list(range(1, steps_total + 1))
    for key in ("val/acc", "val/loss", "train/epoch_loss", "throughput/samples_per_s", "time/epoch_s"):
        assert layout[key] == list(range(1, EPOCHS + 1)), key
    assert layout["time/total_s"] == [EPOCHS]
    assert all(len(set(s)) == len(s) for lay in layouts.values() for s in lay.values())  # no step of a metric twice
    for run_id, metrics in stored.items():
        if run_id in alone:
            output = outputs[int(alone[run_id].data.params["trainer.seed"])]
            assert [round(v, 4) for _, v in metrics["val/acc"]] == per_epoch(output, "val/acc")
            assert [round(v, 4) for _, v in metrics["val/loss"]] == per_epoch(output, "val/loss")
    for job in jobs:  # the same seed and config as a run trained alone: the same trajectory, point for point
        [twin] = [r for r in alone.values() if r.data.params["trainer.seed"] == job.data.params["trainer.seed"]]
        assert stored[job.info.run_id]["train/loss"] == stored[twin.info.run_id]["train/loss"]

    # artifacts: each run's three files, in its own folder of the server's store, and the sweep's comparison
    for run in trained:  # and the automatic profile's folder where it ran (see SAMPLED)
        profiled = ["profile"] if "profile/steps" in layouts[run.info.run_id] else []
        assert sorted(f.path for f in client.list_artifacts(run.info.run_id)) == sorted(ARTIFACTS + profiled)
        kept = server.folder / "artifacts" / experiment.experiment_id / run.info.run_id / "artifacts"
        assert sorted(p.name for p in kept.iterdir()) == sorted(ARTIFACTS + profiled)
        config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / run.info.run_id))
        assert f"seed: {run.data.params['trainer.seed']}\n" in Path(config).read_text()
    assert "compare" in {f.path for f in client.list_artifacts(parent.info.run_id)}


class Crash:
    """Faults at chosen points of an in-process run of ``EPOCHS_CRASH`` epochs against ``server``:

    1. epoch 1's metrics are written (the flush that ends it) and the server is killed before it answers: a write
       the store holds that the run believes failed, so it sends it again later;
    2. at epoch 3's first step the server comes back on its port (the run's buffer is written at epoch 3's end);
    3. at epoch 4's first step it is killed again and stays down until the run has ended (the outbox file).
    """

    def __init__(self, server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.server = server
        self.events: list[str] = []
        log_batch, log_metrics = MlflowClient.log_batch, MlflowTracker.log_metrics

        def write_then_die(client: MlflowClient, run_id: str, metrics: Any = (), **kwargs: Any) -> Any:
            done = log_batch(client, run_id, metrics=metrics, **kwargs)
            if any(m.key == "val/acc" for m in metrics) and not self.events:
                self.at("killed after a write landed")
                lost = requests.exceptions.ConnectionError("('Connection aborted.', RemoteDisconnected(...))")
                raise MlflowException(f"API request failed with exception {lost}") from lost
            return done

        def at_step(tracker: MlflowTracker, metrics: Mapping[str, float], step: int) -> None:
            if "train/loss" in metrics and step == 2 * STEPS_PER_EPOCH + 1:
                self.at("restarted")
            if "train/loss" in metrics and step == 3 * STEPS_PER_EPOCH + 1:
                self.at("killed")
            log_metrics(tracker, metrics, step)

        monkeypatch.setattr(MlflowClient, "log_batch", write_then_die)
        monkeypatch.setattr(MlflowTracker, "log_metrics", at_step)

    def at(self, event: str) -> None:
        self.server.start() if event == "restarted" else self.server.kill()
        self.events.append(event)


EPOCHS_CRASH = 4


@pytest.mark.slow
def test_a_server_killed_and_restarted_mid_run_then_killed_again_loses_nothing_and_duplicates_nothing(
    server: MlflowServer,
    make_cfg: MakeCfg,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a dead server fails each write at once
    crash = Crash(server, monkeypatch)
    overrides = [*SMALL, f"trainer.epochs={EPOCHS_CRASH}", f"tracking.uri={server.uri}", "tracking.experiment=crash"]
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline.record.tracking"):
            result = train(make_cfg(*overrides, tiny=False), echo=False)
        assert crash.events == ["killed after a write landed", "restarted", "killed"]
        assert result.steps == EPOCHS_CRASH * STEPS_PER_EPOCH and len(result.epochs) == EPOCHS_CRASH
        assert "metrics could not be written" in caplog.text  # the first outage was met, and outlived
        path = Path("unsent_metrics") / f"{result.run_id}.jsonl"
        header, *points = (json.loads(line) for line in path.read_text().splitlines())
        assert header["status"] == "FINISHED"
        assert [p["step"] for p in points if p["key"] == "train/loss"] == [10, 11, 12]  # logged after the 2nd kill
        assert [p["step"] for p in points if p["key"] == "val/acc"] == [4]
    finally:
        if not server.healthy():
            server.start()  # the same port and store, as the file's header names them
    assert outbox.main([str(path)]) == 0

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("crash")  # None (no such experiment) fails on its id below
    [run] = client.search_runs([experiment.experiment_id])  # one run: no second one made by a retried request
    assert run.info.run_id == result.run_id and run.info.status == "FINISHED"
    stored = histories(client, run)
    assert steps(stored["train/loss"]) == list(range(1, EPOCHS_CRASH * STEPS_PER_EPOCH + 1))  # each step once
    assert stored["val/acc"] == [(e + 1, epoch.val_acc) for e, epoch in enumerate(result.epochs)]
    assert stored["train/epoch_loss"] == [(e + 1, epoch.train_loss) for e, epoch in enumerate(result.epochs)]
    assert all(len(set(steps(h))) == len(h) for h in stored.values())  # no step of any metric twice
    assert run.data.params == expected_params(*overrides)
    profiled = ["profile"] if "profile/steps" in stored else []  # the automatic profile, where it ran (see SAMPLED)
    assert sorted(f.path for f in client.list_artifacts(run.info.run_id)) == sorted(ARTIFACTS + profiled)
    assert {"bottleneck", "mlflow.note.content"} <= run.data.tags.keys()  # set while the server was down


@pytest.mark.slow
def test_a_run_whose_creation_answer_was_lost_on_the_way_is_created_once(
    server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # the pipeline's default: MLflow sends it again
    client = MlflowClient(server.uri)
    experiment = client.create_experiment("answer-lost")
    with answer_lost(server.uri, drop="/runs/create") as (uri, dropped):
        run = create_run(MlflowClient(uri), experiment, run_name="once", tags={"team": "vision"})
    assert dropped == ["/api/2.0/mlflow/runs/create"]  # the server made a run; its answer never came
    alive = client.search_runs([experiment])
    assert [(r.info.run_id, r.info.status, r.data.tags["team"]) for r in alive] == [
        (run.info.run_id, "RUNNING", "vision")
    ]
    [twin] = client.search_runs([experiment], run_view_type=ViewType.DELETED_ONLY)
    assert twin.info.status == "KILLED" and twin.info.run_name == "once"  # in the trash, and not left RUNNING


@pytest.mark.slow
def test_a_training_run_whose_creation_answer_was_lost_is_recorded_once(
    server: MlflowServer, make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    with answer_lost(server.uri, drop="/runs/create") as (uri, dropped):
        result = train(make_cfg(f"tracking.uri={uri}", "tracking.experiment=answer-lost-training"), echo=False)
    assert dropped == ["/api/2.0/mlflow/runs/create"]
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("answer-lost-training")  # None fails on its id below
    runs = client.search_runs([experiment.experiment_id])
    assert [(r.info.run_id, r.info.status) for r in runs] == [(result.run_id, "FINISHED")]


class SearchFails:
    """A client whose server made the run and then stopped answering, before the search for a twin."""

    def create_run(self, experiment_id: str, run_name: str, tags: Mapping[str, str]) -> Any:
        return SimpleNamespace(info=SimpleNamespace(run_id="r1", experiment_id=experiment_id, run_name=run_name))

    def search_runs(self, *args: Any) -> Any:
        down = requests.exceptions.ConnectionError("Connection refused")
        raise MlflowException(f"API request failed with exception {down}") from down


def test_a_server_that_stops_answering_before_the_search_for_a_twin_still_gives_the_run_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="pipeline.record.runs"):
        run = create_run(SearchFails(), "1", run_name="once", tags={})
    assert run.info.run_id == "r1"
    assert "could not look for a second run made by a repeated request" in caplog.text
    assert "look for runs tagged pipeline.creation=" in caplog.text
