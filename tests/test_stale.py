"""Runs left RUNNING by a process that is gone are found and closed: ``python -m pipeline.stale``."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from helpers import at_training_step
from pipeline.config import RunConfig
from pipeline.record import heartbeat, outbox
from pipeline.record.heartbeat import TAG, identity_tags
from pipeline.record.stale import judge, main, pid_evidence
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


OTHER_BOOT = "00000000-0000-4000-8000-000000000000"  # what a twin VM, or this machine before a reboot, has


def running_with(client: MlflowClient, run_id: str, tags: dict[str, str | None]) -> None:
    """Make a finished run look RUNNING with ``tags`` (None deletes one): what a process left behind."""
    for key, value in tags.items():
        if value is None:
            client.delete_tag(run_id, key)
        else:
            client.set_tag(run_id, key, value)
    client.update_run(run_id, status="RUNNING")


def left_running(client: MlflowClient, name: str, tags: dict[str, str]) -> str:
    """A RUNNING run with ``tags`` and nothing else (stale reads only tags): what a process left behind."""
    experiment = client.get_experiment_by_name("pipeline")
    experiment_id = experiment.experiment_id if experiment else client.create_experiment("pipeline")
    return client.create_run(experiment_id, run_name=name, tags=tags).info.run_id


def here(pid: int, started: str = "1.00", **more: str | None) -> dict[str, str | None]:
    """Process tags of a process on this machine, under this boot and in this pid namespace."""
    process = {"process.host": socket.gethostname(), "process.pid": str(pid), "process.started": started}
    return process | identity_tags() | more


def beat_ago(seconds: float) -> str:
    return f"{time.time() - seconds:.3f}"


def test_runs_are_judged_by_heartbeat_and_only_those_whose_heartbeat_stopped_are_closed(
    store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(store_uri)
    me = psutil.Process()
    live = here(me.pid, f"{me.create_time():.2f}")
    twin = {"process.boot_id": OTHER_BOOT, TAG: beat_ago(11 * 60)}
    ids = [
        left_running(client, "r0", here(dead_pid())),  # before heartbeats (or a sweep's parent), SIGKILLed here
        left_running(client, "r1", live | {TAG: beat_ago(3600)}),  # its store was down for an hour: its pid lives
        left_running(client, "r2", here(me.pid, f"{me.create_time():.2f}", **twin)),  # a twin's pid is not ours
        left_running(client, "r3", {"process.host": "elsewhere", "process.pid": "1", TAG: beat_ago(30)}),
    ]
    assert main(["--uri", store_uri]) == 0
    out = capsys.readouterr().out
    assert "4 RUNNING run(s)" in out and "2 stale (no heartbeat for over 10 min" in out and "--close" in out
    assert f"gone    {ids[0]}  r0" in out and f"alive   {ids[1]}  r1" in out
    assert f"gone    {ids[2]}  r2" in out and f"alive   {ids[3]}  r3" in out
    assert "last heartbeat 11 min ago" in out and "heartbeat 30 s ago" in out
    assert main(["--uri", store_uri, "--close"]) == 0
    assert "marked 2 run(s) KILLED" in capsys.readouterr().out
    statuses = [client.get_run(i).info.status for i in ids]
    assert statuses == ["KILLED", "RUNNING", "KILLED", "RUNNING"]
    assert client.get_run(ids[0]).data.tags["closed_by"].startswith("python -m pipeline.stale: no heartbeat; pid ")


def test_a_live_run_on_a_twin_host_with_a_fresh_heartbeat_is_never_closed(
    store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same host name, a pid that is no process here: the old rule closed it; another boot id says it is not ours."""
    client = MlflowClient(store_uri)
    run_id = left_running(client, "twin", here(dead_pid(), **{"process.boot_id": OTHER_BOOT, TAG: beat_ago(45)}))
    assert main(["--uri", store_uri, "--close"]) == 0
    out = capsys.readouterr().out
    assert f"alive   {run_id}" in out and "heartbeat 45 s ago" in out and "marked 0 run(s) KILLED" in out
    assert client.get_run(run_id).info.status == "RUNNING"


def test_a_fresh_heartbeat_from_a_pid_gone_from_this_machine_is_closed_at_once(
    store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILLed before its first checkpoint: same host, boot and pid namespace, its pid gone: no need to wait
    10 minutes for its heartbeat to age."""
    client = MlflowClient(store_uri)
    pid = dead_pid()
    run_id = left_running(client, "killed", here(pid, **{TAG: beat_ago(5)}))
    assert main(["--uri", store_uri, "--close"]) == 0
    out = capsys.readouterr().out
    assert f"gone    {run_id}" in out and f"pid {pid} on {socket.gethostname()}: no such process" in out
    age = re.search(r"heartbeat (\d+) s ago", out)
    assert age and 5 <= int(age.group(1)) <= 30 and "marked 1 run(s) KILLED" in out  # 5 s, and the test's own time
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_fresh_heartbeat_from_a_pid_gone_in_another_pid_namespace_is_not_closed(
    store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(store_uri)
    run_id = left_running(client, "boxed", here(dead_pid(), **{"process.pid_ns": "pid:[1]", TAG: beat_ago(5)}))
    assert main(["--uri", store_uri, "--close"]) == 0
    assert f"alive   {run_id}" in capsys.readouterr().out
    assert client.get_run(run_id).info.status == "RUNNING"


def test_runs_from_another_machine_without_a_heartbeat_are_unknown_and_never_closed() -> None:
    older = {"process.host": socket.gethostname(), "process.pid": str(dead_pid()), "process.started": "1.00"}
    assert judge(older, after_s=600)[0] == "unknown"  # no boot id: the same host name proves nothing
    assert judge({**older, "process.boot_id": OTHER_BOOT}, after_s=600)[0] == "unknown"
    assert judge({**older, **identity_tags(), "process.pid_ns": "pid:[1]"}, after_s=600)[0] == "unknown"
    assert judge({}, after_s=600) == ("unknown", "no heartbeat and no process tags (recorded by an older pipeline)")


def test_the_threshold_is_an_option_and_must_span_missed_beats(
    store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(store_uri)
    run_id = left_running(client, "quiet", {"process.boot_id": OTHER_BOOT, TAG: beat_ago(11 * 60)})
    assert main(["--uri", store_uri, "--close", "--after", "60"]) == 0
    assert "0 stale (no heartbeat for over 60 min" in capsys.readouterr().out
    assert client.get_run(run_id).info.status == "RUNNING"
    with pytest.raises(SystemExit) as exited:
        main(["--uri", store_uri, "--after", "0.5"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--after 0.5" in err and "a run beats every 60 s" in err


@pytest.mark.parametrize("after", ["nan", "inf", "-5", "0"])
def test_a_threshold_that_is_not_a_positive_number_of_minutes_is_refused_in_one_line(
    after: str, store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--after nan`` compared false with everything: it closed a twin host's run whose heartbeat was 17 s old."""
    client = MlflowClient(store_uri)
    run_id = left_running(client, "twin", {"process.boot_id": OTHER_BOOT, TAG: beat_ago(17)})
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["--uri", store_uri, "--close", "--after", after])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--after {after}" in err and "error:" in err
    assert client.get_run(run_id).info.status == "RUNNING"


def test_the_heartbeat_beats_while_a_run_trains_and_stops_before_its_end(
    make_cfg: MakeCfg, store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the run's three training steps waits for a beat of its own, so the run lasts as long as the beats
    need, however fast the machine (beats 10 ms apart, the tag's millisecond resolution ten times over)."""
    monkeypatch.setattr(heartbeat, "BEAT_EVERY_S", 0.01)
    beats: list[float] = []
    beat, fresh = heartbeat.Heartbeat.beat, threading.Event()

    def counted(self: heartbeat.Heartbeat) -> str | None:
        value = beat(self)
        if value is not None:
            beats.append(float(value))
            fresh.set()
        return value

    def await_a_beat() -> None:
        fresh.clear()
        assert fresh.wait(30), "no heartbeat while the run trained"

    monkeypatch.setattr(heartbeat.Heartbeat, "beat", counted)
    for step in (1, 2, 3):
        at_training_step(monkeypatch, step, await_a_beat)
    run = MlflowClient(store_uri).get_run(train(make_cfg(), echo=False).run_id)
    assert len(beats) >= 3 and beats == sorted(set(beats))  # it beat again and again, each later than the last
    assert float(run.data.tags[TAG]) == beats[-1] <= run.info.end_time / 1000  # the last beat is stored, before the end
    assert run.data.tags["process.boot_id"] == heartbeat.boot_id()
    assert not [t for t in threading.enumerate() if t.name == "pipeline-heartbeat"]  # stopped with the run


def test_a_heartbeat_the_store_refuses_is_skipped_quietly_and_none_is_written_after_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Down:  # a tracking server that does not answer
        def __init__(self) -> None:
            self.calls, self.thrice = 0, threading.Event()

        def set_tag(self, run_id: str, key: str, value: str) -> None:
            self.calls += 1
            if self.calls == 3:
                self.thrice.set()
            raise ConnectionError("Connection refused")

    caplog.set_level(logging.INFO)
    client = Down()
    beating = heartbeat.Heartbeat(client, "r", every_s=0.001).start()
    assert client.thrice.wait(30)  # it went on beating after refusals
    thread = beating._thread
    beating.stop()
    assert thread is not None and not thread.is_alive()  # stop() returned: no beat can come any more
    assert beating.beat() is None  # a refused beat is None, never an exception
    assert caplog.records == []  # nothing said above DEBUG: the tracker's own writes report a store that is down


def test_a_reused_pid_is_a_gone_process() -> None:
    me = psutil.Process()
    assert pid_evidence(here(me.pid, "12.00"))[0] == "gone"
    assert pid_evidence(here(me.pid, f"{me.create_time():.2f}"))[0] == "alive"


def test_a_store_that_cannot_be_reached_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--uri", f"sqlite:///{tmp_path}/missing/mlflow.db"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow
def test_a_sigkilled_training_process_leaves_a_run_that_stale_closes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "device=cpu", "trainer.epochs=500", "monitor.plots=false"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("checkpoints/*/run.lock")):  # the run is open and training has started
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    client = MlflowClient(uri)
    (run,) = client.search_runs(experiment_ids=["1"])
    assert run.info.status == "RUNNING"  # what SIGKILL leaves behind
    assert main(["--uri", uri, "--close"]) == 0  # its heartbeat is fresh, but its pid is gone from this machine
    assert client.get_run(run.info.run_id).info.status == "KILLED"


def test_close_leaves_a_run_with_a_pending_outbox_file_to_its_import_and_names_it(
    make_cfg: MakeCfg, store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(store_uri)
    run_id = train(make_cfg(), echo=False).run_id
    running_with(client, run_id, {"process.pid": str(dead_pid()), TAG: beat_ago(3600)})  # its store was down at its end
    run = client.get_run(run_id)
    box = outbox.Outbox(run_id, run.info.experiment_id, store_uri, "FINISHED", run.info.end_time, {}, [])
    path = outbox.save(box, outbox.fresh_path(run_id))
    assert main(["--uri", store_uri, "--close"]) == 0
    out = capsys.readouterr().out
    assert f"{run_id}: not closed: {path} holds how it ended; import it with: python -m pipeline.outbox {path}" in out
    assert "marked 0 run(s) KILLED" in out
    assert client.get_run(run_id).info.status == "RUNNING"


def test_stale_in_a_folder_without_a_store_creates_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no MLflow store at sqlite:///") and err.count("\n") == 1, err
    assert not Path("mlflow.db").exists()
