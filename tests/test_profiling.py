"""trainer.profile=true: torch.profiler over a few steps after warm-up and compiling, kept out of the steady state; a
Chrome trace and the top operators in the run's record; on CUDA the GPU's busy and idle time, from intervals."""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mlflow import MlflowClient
from torch.autograd import DeviceType

import pipeline.engine.observe.profiling as profiling
from helpers import StepClock
from pipeline.config import RunConfig, load
from pipeline.engine.hot.timing import Breakdown, WallTimer
from pipeline.engine.observe.profile_report import GpuBusy, gaps, gpu_busy, merged, overlap
from pipeline.engine.observe.profiling import NO_PROFILER, StepProfiler, make_profiler
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


# --- the GPU's busy and idle time: a pure function of intervals ---


def test_intervals_merge_overlap_and_leave_gaps() -> None:
    assert merged([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6)]) == [(0, 4), (5, 7)]
    assert overlap([(0, 4), (5, 7)], [(3, 6)]) == [(3, 4), (5, 6)]
    assert gaps([(1, 2), (3, 5)], [(0, 4), (6, 8)]) == [(0, 1), (2, 3), (6, 8)]


def test_gpu_time_in_the_profiled_steps_splits_into_busy_idle_on_the_host_and_idle_for_data() -> None:
    # two steps of 10 us; kernels overlap each other and run past the last step's end (clipped there)
    steps = [(0, 10), (10, 20)]
    kernels = [(1, 4), (3, 6), (12, 15), (19, 25)]
    waits = [(10, 12), (13, 14)]  # the second wait is hidden by a kernel: the GPU was not idle then
    busy = gpu_busy(kernels, steps, waits)
    # busy: 1-6, 12-15, 19-20 = 9 of 20; idle 0-1, 6-12, 15-19 = 11, of which 10-12 while waiting for data
    assert busy == GpuBusy(pytest.approx(45.0), pytest.approx(45.0), pytest.approx(10.0))
    assert busy.busy_pct + busy.idle_host_pct + busy.idle_data_pct == pytest.approx(100.0)
    assert gpu_busy([], steps, waits) == GpuBusy(0.0, pytest.approx(85.0), pytest.approx(15.0))  # both waits idle
    assert gpu_busy([(0, 20)], steps, waits) == GpuBusy(100.0, 0.0, 0.0)
    assert gpu_busy(kernels, [], waits) is None


# --- when the profiler runs, and what the timer leaves out ---


class FakeProfiler:
    """Stands in for ``torch.profiler.profile``: its start and stop cost time on the step timer's clock."""

    def __init__(self, clock: StepClock) -> None:
        self.clock, self.started, self.stopped = clock, 0, 0

    def start(self) -> None:
        self.started += 1
        self.clock.spend(2.0)

    def stop(self) -> None:
        self.stopped += 1
        self.clock.spend(3.0)


def run_epoch(timer: Any, compiled: list[bool], step: list[int], clock: StepClock) -> Breakdown:
    """One epoch as the loop drives its timer: a step per entry (whether it compiled), 0.1 s of compute each."""
    timer.start()
    for did_compile in timer.batches(compiled):
        timer.copied()
        clock.spend(0.1)
        step[0] += 1
        timer.done(8, compiled=did_compile)
    return timer.finish()


def fake_profiler(clock: StepClock) -> tuple[StepProfiler, list[FakeProfiler], list[int]]:
    made: list[FakeProfiler] = []

    def make() -> FakeProfiler:
        made.append(FakeProfiler(clock))
        return made[-1]

    return StepProfiler(3, torch.device("cpu"), make=make), made, [0]


def test_profiling_starts_after_the_first_step_and_its_steps_and_costs_stay_out_of_the_steady_state(
    clock: StepClock,
) -> None:
    profiler, made, step = fake_profiler(clock)
    apart: list[int] = []  # the run's time estimate hears of each profiled step too
    timer = profiler.wrap(WallTimer(), step=lambda: step[0], apart=lambda: apart.append(step[0]))
    b = run_epoch(timer, [False] * 8, step, clock)
    assert profiler.labels == ["step 2", "step 3", "step 4"] and apart == [2, 3, 4]
    assert [(p.started, p.stopped) for p in made] == [(1, 1)]
    # steps 5-8 are the steady state, at 0.1 s each; the profiler's 2 s start and 3 s stop are the profiled steps'
    assert (b.steady_steps, b.profiled_steps, b.compile_steps) == (4, 3, 0)
    assert b.step_s == pytest.approx(0.4) and b.profiled_steps_s == pytest.approx(5.3)


def test_with_compile_profiling_starts_after_the_steps_that_compiled(clock: StepClock) -> None:
    profiler, _, step = fake_profiler(clock)
    b = run_epoch(profiler.wrap(WallTimer(), step=lambda: step[0]), [True, True, False] + [False] * 4, step, clock)
    assert profiler.labels == ["step 4", "step 5", "step 6"]
    assert (b.compile_steps, b.profiled_steps, b.steady_steps) == (1, 3, 2)


def test_an_epoch_that_ends_inside_the_window_keeps_what_was_profiled_and_says_so(
    clock: StepClock, caplog: pytest.LogCaptureFixture
) -> None:
    profiler, made, step = fake_profiler(clock)
    timer = profiler.wrap(WallTimer(), step=lambda: step[0])
    with caplog.at_level(logging.WARNING, logger="pipeline.engine.profiling"):
        first = run_epoch(timer, [False] * 3, step, clock)
    second = run_epoch(timer, [False] * 5, step, clock)  # once per run: nothing more is profiled
    assert profiler.labels == ["step 2", "step 3"] and len(made) == 1 and made[0].stopped == 1
    assert (first.profiled_steps, second.profiled_steps, second.steady_steps) == (2, 0, 4)
    assert "trainer.profile_steps=3, but the epoch ended after 2 profiled step(s)" in caplog.text


def test_an_epoch_without_a_step_after_its_warm_up_leaves_profiling_to_the_next(clock: StepClock) -> None:
    profiler, made, step = fake_profiler(clock)
    timer = profiler.wrap(WallTimer(), step=lambda: step[0])
    run_epoch(timer, [False], step, clock)  # started after the only step, stopped unused at the epoch's end
    assert profiler.labels == [] and [(p.started, p.stopped) for p in made] == [(1, 1)]
    b = run_epoch(timer, [False] * 5, step, clock)  # its first step (step 2) warms up again
    assert profiler.labels == ["step 3", "step 4", "step 5"] and b.profiled_steps == 3


def test_a_run_with_no_step_to_profile_says_so(clock: StepClock, caplog: pytest.LogCaptureFixture) -> None:
    profiler, _, step = fake_profiler(clock)
    run_epoch(profiler.wrap(WallTimer(), step=lambda: step[0]), [False], step, clock)
    with caplog.at_level(logging.WARNING, logger="pipeline.engine.profiling"):
        assert profiler.record() is None and profiler.record() is None
    assert caplog.text.count("trainer.profile=true, but no step was profiled") == 1


def test_profile_and_auto_profile_false_make_no_profiler_and_leave_the_loop_as_it_was(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a profiler was made with trainer.profile=false trainer.auto_profile=false")

    monkeypatch.setattr(torch.profiler, "profile", refused)
    monkeypatch.setattr(profiling, "StepProfiler", refused)
    monkeypatch.setattr(profiling, "AutoProfiler", refused)
    monkeypatch.setattr(profiling, "ProfiledTimer", refused)
    timer = WallTimer()
    off = load(["trainer.auto_profile=false"]).trainer
    assert make_profiler(off, torch.device("cpu"), mfu_pct=lambda speed: None) is NO_PROFILER
    assert NO_PROFILER.wrap(timer, step=lambda: 0) is timer
    result = train(make_cfg("tracking=none", "trainer.max_steps=5", "trainer.auto_profile=false"), echo=False)
    assert result.profile is None and result.breakdown.profiled_steps == 0 and result.breakdown.steady_steps == 4


# --- a real profiled run on the CPU, read back from the store ---


def test_a_profiled_cpu_run_records_a_chrome_trace_and_the_top_operators(
    make_cfg: MakeCfg, store_uri: str, tmp_path: Path
) -> None:
    cfg = make_cfg("trainer.profile=true", "trainer.max_steps=8", "monitor.plots=false", "tracking.log_model=false")
    result = train(cfg, echo=False)
    assert (result.profile.steps, result.profile.first, result.profile.clock) == (3, 2, "CPU")
    b = result.breakdown
    assert (b.steps, b.profiled_steps, b.steady_steps) == (8, 3, 4)  # the first step and the profiled ones left out

    client = MlflowClient(store_uri)
    run_id = result.run_id
    assert {a.path for a in client.list_artifacts(run_id, "profile")} == {
        "profile/trace.json.gz",
        "profile/operators.md",
    }
    packed = Path(client.download_artifacts(run_id, "profile/trace.json.gz", str(tmp_path)))
    events = json.loads(gzip.decompress(packed.read_bytes()))["traceEvents"]
    steps = {e["name"]: e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("step ")}
    assert sorted(steps) == ["step 2", "step 3", "step 4"]
    assert sum(e.get("name") == "data wait" for e in events) == 3  # each profiled step's wait for its batch
    step = steps["step 3"]
    inside = [e for e in events if e.get("ph") == "X" and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
    assert {"aten::addmm", "aten::mm"} <= {e["name"] for e in inside}  # forward and backward of step 3

    table = Path(client.download_artifacts(run_id, "profile/operators.md", str(tmp_path))).read_text()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines() if line[:1] == "|"]
    assert rows[0] == ["operator", "calls", "self CPU ms", "% of the profiled steps"]
    body = rows[2:]
    assert 5 <= len(body) <= 20 and {"aten::addmm", "aten::mm"} <= {row[0] for row in body}
    shares, times = [float(row[3]) for row in body], [float(row[2]) for row in body]
    assert 0 < sum(shares) <= 100 and times == sorted(times, reverse=True)

    run = client.get_run(run_id)
    assert run.data.metrics["profile/steps"] == 3 and run.data.metrics["profile/step_ms"] > 0
    assert not [key for key in run.data.metrics if key.startswith("perf/gpu")]  # no GPU here
    note = run.data.tags["mlflow.note.content"]
    assert "profile     steps 2-4 under torch.profiler" in note and "profile/trace.json.gz" in note
    top = next(line for line in note.splitlines() if "top self CPU:" in line)
    assert top.count(" · ") == 4  # the first five operators; the artifact has twenty


# --- the CUDA path, with a fake profiler's events ---


def event(name: str, start: float, end: float, *, device: str = "cpu", kind: str = "cpu_op", **more: Any) -> Any:
    on = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=end), device_type=on, activity_type=kind, **more
    )


def average(key: str, *, device_us: float, device: str = "cpu", annotation: bool = False) -> Any:
    on = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    return SimpleNamespace(
        key=key,
        count=2,
        device_type=on,
        is_user_annotation=annotation,
        self_cpu_time_total=1.0,
        self_device_time_total=device_us,
    )


class FakeCudaProfiler:
    """A stopped CUDA profile of steps 2 and 3: what ``torch.profiler`` would hand back, in microseconds."""

    def __init__(self) -> None:
        self.started = self.stopped = 0

    def start(self) -> None:
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1

    def events(self) -> list[Any]:
        return [
            event("step 2", 0, 100, kind="user_annotation"),
            event("step 3", 100, 200, kind="user_annotation"),
            event("data wait", 0, 20, kind="user_annotation"),
            event("data wait", 100, 110, kind="user_annotation"),
            event("step 2", 0, 100, device="cuda", kind="gpu_user_annotation"),  # the range, on the device
            event("Memcpy HtoD (Pageable -> Device)", 20, 30, device="cuda", kind="gpu_memcpy"),
            event("ampere_sgemm_128x64_nn", 30, 90, device="cuda", kind="kernel"),
            event("ampere_sgemm_128x64_nn", 120, 180, device="cuda", kind="kernel"),
            event("vectorized_elementwise_kernel", 150, 195, device="cuda", kind="kernel"),
        ]

    def key_averages(self) -> list[Any]:
        return [
            average("aten::relu", device_us=25),
            average("aten::addmm", device_us=100),
            average("ampere_sgemm_128x64_nn", device_us=100, device="cuda"),  # counted in aten::addmm already
            average("step 2", device_us=100, annotation=True),
        ]

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(json.dumps({"traceEvents": [{"name": "step 2", "ph": "X", "ts": 0, "dur": 100}]}))


class FakeTracker:
    run_id = "r1"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.texts: dict[str, str] = {}
        self.metrics: list[tuple[dict[str, float], int]] = []

    def log_file(self, path: Path, artifact_dir: str) -> None:
        self.files[f"{artifact_dir}/{path.name}"] = path.read_bytes()

    def log_text(self, text: str, artifact_file: str) -> None:
        self.texts[artifact_file] = text

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.append((dict(metrics), step))


def test_on_cuda_the_gpus_busy_and_idle_time_is_recorded_and_the_window_is_synchronised_at_both_ends(
    clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    fake = FakeCudaProfiler()
    profiler = StepProfiler(2, torch.device("cuda", 0), make=lambda: fake)
    tracker, step = FakeTracker(), [0]
    with profiler.recording(tracker):
        run_epoch(profiler.wrap(WallTimer(), step=lambda: step[0]), [False] * 5, step, clock)
        report = profiler.record()
    assert profiler.labels == ["step 2", "step 3"] and syncs == [torch.device("cuda", 0)] * 2
    # window 0-200 us; kernels 30-90 and 120-195 (the copy is no kernel): 135 busy; idle 65, 30 of it for data
    metrics, at = tracker.metrics[0]
    assert at == 3 and metrics == {
        "profile/steps": 2.0,
        "profile/step_ms": pytest.approx(0.1),
        "perf/gpu_busy_pct": pytest.approx(67.5),
        "perf/gpu_idle_host_pct": pytest.approx(17.5),
        "perf/gpu_idle_data_pct": pytest.approx(15.0),
    }
    # ranked by the time of the kernels each operator launched; the kernels' own rows and the ranges left out
    assert [(op.name, op.share_pct) for op in report.operators] == [("aten::addmm", 50.0), ("aten::relu", 12.5)]
    assert (
        "| operator" in tracker.texts["profile/operators.md"]
        and "self CUDA ms" in tracker.texts["profile/operators.md"]
    )
    trace = json.loads(gzip.decompress(tracker.files["profile/trace.json.gz"]))
    assert trace["traceEvents"][0]["name"] == "step 2"
    assert "GPU busy 68% of those steps, idle 18% waiting on the host, 15% waiting for data" in report.describe()
    assert report.describe()[-1] == "top self CUDA: aten::addmm 50.0% · aten::relu 12.5%"


def test_a_run_that_ends_with_an_error_inside_the_window_stops_the_profiler(
    clock: StepClock, caplog: pytest.LogCaptureFixture
) -> None:
    profiler, made, step = fake_profiler(clock)
    timer = profiler.wrap(WallTimer(), step=lambda: step[0])
    with pytest.raises(RuntimeError, match="a step failed"), profiler.recording(FakeTracker()):
        timer.start()
        for index, _ in enumerate(timer.batches([False] * 6)):
            if index == 2:
                raise RuntimeError("a step failed")
            step[0] += 1
            timer.done(8)
    assert [(p.started, p.stopped) for p in made] == [(1, 1)] and profiler.report is None
    assert "no step was profiled" not in caplog.text  # the error says what happened; no advice about max_steps


def test_a_run_stopped_after_its_window_still_records_it(clock: StepClock) -> None:
    """SIGTERM after the profiled steps: the run never concludes, the profile is recorded as it closes."""
    fake = FakeCudaProfiler()
    profiler, step, tracker = StepProfiler(2, torch.device("cpu"), make=lambda: fake), [0], FakeTracker()
    with pytest.raises(KeyboardInterrupt), profiler.recording(tracker):
        run_epoch(profiler.wrap(WallTimer(), step=lambda: step[0]), [False] * 4, step, clock)
        raise KeyboardInterrupt
    assert profiler.report is not None and profiler.report.steps == 2 and "profile/trace.json.gz" in tracker.files


def test_a_trace_that_cannot_be_written_costs_the_trace_not_the_run(
    clock: StepClock, caplog: pytest.LogCaptureFixture
) -> None:
    class FullDisk(FakeCudaProfiler):
        def export_chrome_trace(self, path: str) -> None:
            raise OSError(28, "No space left on device")

    profiler, step, tracker = StepProfiler(2, torch.device("cpu"), make=FullDisk), [0], FakeTracker()
    with profiler.recording(tracker):
        run_epoch(profiler.wrap(WallTimer(), step=lambda: step[0]), [False] * 4, step, clock)
        report = profiler.record()
    assert report.trace == "" and tracker.files == {} and tracker.metrics[0][0]["profile/steps"] == 2.0
    assert "no trace (it could not be written: No space left on device)" in report.describe()[0]
    assert "the profile's trace was not kept: OSError" in caplog.text


def test_a_cpu_profile_writes_nothing_to_the_terminal() -> None:
    """kineto prints "USDT: ... profiler_start" and "profiler_stop" (and, with a CUDA build of torch, an ERROR line
    about the missing GPU) straight to the process's stderr at every profile, the automatic one included: a user's
    terminal, or a test that reads the first line a run writes there."""
    probe = (
        "import torch\n"
        "from pipeline.engine.observe.profiling import _torch_profiler\n"
        "with _torch_profiler(torch.device('cpu')):\n"
        "    torch.nn.Linear(8, 8)(torch.randn(4, 8)).sum().backward()\n"
        "print('profiled')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "profiled\n", "")
