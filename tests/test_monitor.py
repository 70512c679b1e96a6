"""The sampler and its GPU backends: every fault costs one warning and an empty field, never training."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from helpers import fake_command
from pipeline.monitor import BUSY_OTHERS_PCT, GpuTarget, RankCpu, Sampler, job_summary, summarize, system_metrics
from pipeline.monitor.gpu import GpuReading, GputilBackend, NoGpu, NvmlBackend, open_backend
from pipeline.monitor.sampler import Sample

TARGET = GpuTarget(0, "GPU-1234abcd-0000-1111-2222-333344445555")
CSV = (  # what `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` prints for GPUtil
    "0, GPU-1234abcd-0000-1111-2222-333344445555, {util}, 16384, 1024, 15360, 550.54, Tesla T4, [N/A], Disabled, "
    "Enabled, 61"
)


def fake_smi(tmp_path: Path, body: str) -> Path:
    """Put an `nvidia-smi` shell script first on PATH; returns the folder."""
    return fake_command(tmp_path / "bin", "nvidia-smi", body + "\n").parent


def use_path(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")


def warnings_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_sampler_reads_cpu_and_ram_logs_system_metrics_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[tuple[dict[str, float], int]] = []
    sampler = Sampler(interval_s=0.05, log_metrics=lambda m, s: logged.append((m, s))).start()
    time.sleep(0.3)
    sampler.stop()
    assert not sampler.alive and "pipeline-sampler" not in {t.name for t in threading.enumerate()}
    assert len(sampler.samples) >= 3 and len(logged) == len(sampler.samples)
    steps = [step for _, step in logged]
    assert steps == sorted(set(steps)) and steps[0] >= 1
    metrics = logged[0][0]
    assert set(metrics) == {
        "system/cpu_utilization_percentage",
        "system/process_cpu_utilization_percentage",
        "system/system_memory_usage_megabytes",
        "system/system_memory_usage_percentage",
    }
    assert (
        0 <= metrics["system/cpu_utilization_percentage"] <= 100 and metrics["system/system_memory_usage_megabytes"] > 0
    )


def test_sampler_stops_within_one_interval_even_with_a_long_interval() -> None:
    sampler = Sampler(interval_s=30.0).start()
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 5.0 and not sampler.alive
    assert len(sampler.samples) == 1  # the closing reading: short runs still get their figures


def test_a_sample_that_raises_stops_sampling_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Exploding(NoGpu):
        def __init__(self) -> None:
            self.reads = 0
            self.tried = threading.Event()

        def read(self) -> list[GpuReading]:
            self.reads += 1
            self.tried.set()
            raise RuntimeError("sensor fell off")

    gpu = Exploding()
    sampler = Sampler(interval_s=0.02, gpu=gpu).start()
    assert gpu.tried.wait(timeout=10)  # the thread's first reading has failed (or is failing)
    sampler.stop()  # joins the thread, so its warning is logged by now
    assert not sampler.alive and sampler.samples == []
    assert gpu.reads == 1  # stop() does not take a closing reading once sampling has failed
    assert sum("sensor fell off" in w for w in warnings_in(caplog)) == 1


def test_process_cpu_counts_a_busy_child_process_across_readings() -> None:
    busy = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        sampler = Sampler(interval_s=1.0, children=True)
        readings = []
        for _ in range(4):  # the first reading primes the child's counters; the next three cover 0.2 s each
            readings.append(sampler.read().process_cpu_pct)
            time.sleep(0.2)
        # One busy core is 100; the test process itself sleeps (~0), so the figure is the child's work. 10 leaves
        # room for a machine shared with other jobs (at load 7 on 2 cores the child got 33-38)
        assert max(readings[1:]) > 10, readings
    finally:
        child.kill()
        child.wait()


def test_process_cpu_forgets_children_that_have_exited(monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[int] = []  # the pid of every process a reading asked for its CPU time
    cpu_percent = psutil.Process.cpu_percent

    def counted(self: psutil.Process, interval: float | None = None) -> float:
        measured.append(self.pid)
        return cpu_percent(self, interval)

    monkeypatch.setattr(psutil.Process, "cpu_percent", counted)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    sampler = Sampler(interval_s=1.0, children=True)
    try:
        sampler.read()
        assert child.pid in measured
    finally:
        child.kill()
        child.wait()
    measured.clear()
    sampler.read()
    assert child.pid not in measured and os.getpid() in measured


def test_gpu_readings_become_mlflow_system_metric_names() -> None:
    sample = Sample(
        1.0,
        50.0,
        120.0,
        2000.0,
        25.0,
        [
            GpuReading(
                1,
                util_pct=80.0,
                mem_used_mb=4000.0,
                mem_total_mb=16000.0,
                temp_c=70.0,
                power_w=150.0,
                power_limit_w=300.0,
            )
        ],
    )
    metrics = system_metrics(sample)
    assert metrics["system/gpu_1_utilization_percentage"] == 80.0
    assert metrics["system/gpu_1_memory_usage_megabytes"] == 4000.0
    assert metrics["system/gpu_1_memory_usage_percentage"] == 25.0
    assert metrics["system/gpu_1_power_usage_percentage"] == 50.0
    assert metrics["system/gpu_1_temperature_celsius"] == 70.0


def test_empty_gpu_fields_are_left_out_not_logged_as_zero() -> None:
    metrics = system_metrics(Sample(0.0, 1.0, 1.0, 1.0, 1.0, [GpuReading(0, mem_used_mb=5.0)]))
    assert "system/gpu_0_utilization_percentage" not in metrics and "system/gpu_0_memory_usage_megabytes" in metrics


def test_summaries_give_mean_p95_and_peak() -> None:
    window = [
        Sample(float(i), 10.0, 10.0, 1.0, 1.0, [GpuReading(0, util_pct=float(u), mem_used_mb=float(m))])
        for i, (u, m) in enumerate(zip(range(0, 101, 5), range(100, 121), strict=True))
    ]
    summary = summarize(window)
    assert summary.gpu_util_mean_pct == 50.0 and summary.gpu_util_p95_pct == 95.0 and summary.gpu_mem_peak_mb == 120.0
    assert summary.metrics()["gpu/util_mean_pct"] == 50.0 and summary.cpu_mean_pct == 10.0
    assert summarize([]).metrics() == {}


class FakeNvml:
    """An NVML binding whose utilisation query is NotSupported (as on MIG slices)."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self) -> None:
        self.shut = False

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return {"h0": "GPU-ffff", "h1": TARGET.uuid}[handle]

    def nvmlDeviceGetUtilizationRates(self, handle: str):
        raise self.NVMLError_NotSupported("Not Supported")

    def nvmlDeviceGetMemoryInfo(self, handle: str):
        return SimpleNamespace(used=3e9, total=16e9)

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        return 64

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return 120_000

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: str) -> int:
        return 300_000


def test_nvml_matches_by_uuid_and_a_not_supported_field_is_empty_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = FakeNvml()
    backend = NvmlBackend([TARGET], nvml=nvml)
    readings = [backend.read() for _ in range(5)]
    assert readings[0] == [
        GpuReading(
            0, util_pct=None, mem_used_mb=3000.0, mem_total_mb=16000.0, temp_c=64.0, power_w=120.0, power_limit_w=300.0
        )
    ]
    assert backend.handles == [(0, "h1")]  # NVML's index 1 is torch's device 0
    assert len([w for w in warnings_in(caplog) if "utilization" in w]) == 1
    backend.close()
    assert nvml.shut


def test_gputil_reads_nvidia_smi_and_converts_units(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_path(monkeypatch, fake_smi(tmp_path, f"echo '{CSV.format(util=41)}'"))
    (reading,) = GputilBackend([TARGET], timeout_s=5).read()
    assert reading.index == 0 and reading.util_pct == pytest.approx(41.0) and reading.temp_c == 61.0
    assert reading.mem_used_mb == pytest.approx(1024 * 1.048576) and reading.power_w is None


def test_gputil_n_a_fields_are_empty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_path(monkeypatch, fake_smi(tmp_path, f"echo '{CSV.format(util='[N/A]')}'"))
    (reading,) = GputilBackend([TARGET], timeout_s=5).read()
    assert reading.util_pct is None and reading.mem_used_mb is not None


def test_gputil_driver_error_is_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    body = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9'
    use_path(monkeypatch, fake_smi(tmp_path, body))
    backend = GputilBackend([TARGET], timeout_s=5)
    assert [backend.read() for _ in range(3)] == [[], [], []]
    assert len([w for w in warnings_in(caplog) if "GPUtil could not read nvidia-smi" in w]) == 1


def test_gputil_without_nvidia_smi_warns_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    backend = GputilBackend([TARGET], timeout_s=5)
    assert backend.read() == [] and backend.read() == []
    assert len([w for w in warnings_in(caplog) if "lists none of this run's GPUs" in w]) == 1


@pytest.mark.slow
def test_a_hung_nvidia_smi_costs_one_timeout_and_is_killed_at_close(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    use_path(monkeypatch, fake_smi(tmp_path, "sleep 60"))
    backend = GputilBackend([TARGET], timeout_s=0.3)
    started = time.monotonic()
    assert backend.read() == [] and backend.read() == []  # the second does not start another call
    assert time.monotonic() - started < 2.0
    assert len([w for w in warnings_in(caplog) if "did not answer" in w]) == 1
    assert [c for c in psutil.Process().children(recursive=True) if c.name() in ("nvidia-smi", "sleep")]
    backend.close()
    time.sleep(0.2)
    assert not [c for c in psutil.Process().children(recursive=True) if c.is_running() and c.status() != "zombie"]


def test_a_blocked_gputil_import_falls_back_to_no_gpu_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "GPUtil", None)  # as on Python 3.12 without distutils
    backend = open_backend("gputil", [TARGET], timeout_s=1)
    assert isinstance(backend, NoGpu) and backend.read() == []
    messages = warnings_in(caplog)
    assert any("through gputil is unavailable" in m for m in messages)
    assert any("GPU utilisation will not be recorded" in m for m in messages)


def test_auto_without_an_nvidia_driver_tries_nvml_then_gputil(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as without a driver, even on a host where NVML works
    monkeypatch.setitem(sys.modules, "GPUtil", None)
    backend = open_backend("auto", [TARGET], timeout_s=1)
    assert isinstance(backend, NoGpu)
    messages = warnings_in(caplog)
    assert any("through nvml is unavailable" in m for m in messages)
    assert any("through gputil is unavailable" in m for m in messages)


def test_cpu_runs_open_no_gpu_backend_and_warn_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert isinstance(open_backend("auto", [], timeout_s=1), NoGpu)
    assert warnings_in(caplog) == []


def test_the_first_readings_are_real_ones_not_psutils_meaningless_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil keeps cpu_percent's last reading per thread: primed on the caller's thread only, the sampler's first
    reading was psutil's meaningless 0.0, so a first (or just-resumed) epoch logged cpu/util_mean_pct 0.0. A fake
    psutil that answers 0.0 to each thread's first call, as the real one does, and 37.0 after."""
    seen: set[int] = set()

    def cpu_percent(interval: float | None = None) -> float:
        first = threading.get_ident() not in seen
        seen.add(threading.get_ident())
        return 0.0 if first else 37.0

    monkeypatch.setattr("pipeline.monitor.sampler.psutil.cpu_percent", cpu_percent)
    sampler = Sampler(interval_s=0.01).start()
    deadline = time.monotonic() + 5.0
    while len(sampler.samples) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert len(sampler.samples) >= 2 and sampler.samples[0].cpu_pct == 37.0


def machine(monkeypatch: pytest.MonkeyPatch, *, cpus: int, usable: set[int] | None) -> None:
    """A machine of ``cpus`` CPUs on which this process may use ``usable`` (None: an OS without affinity)."""
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    if usable is None:
        monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    else:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: usable, raising=False)


def readings(machine_pct: float, run_pct: float, n: int = 4) -> list[Sample]:
    return [Sample(float(t), machine_pct, run_pct, 1000.0, 20.0) for t in range(n)]


def test_the_runs_own_cpu_is_a_share_of_the_cpus_it_may_use_and_the_rest_of_the_machine_is_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    machine(monkeypatch, cpus=8, usable={0, 1})
    summary = summarize(readings(50.0, 70.0))  # 0.7 of a core; half of the machine's 8 CPUs busy
    assert (summary.cpus, summary.machine_cpus, summary.run_cpu_pct) == (2, 8, 35.0)
    assert summary.others_cpu_pct == 50.0 - 70.0 / 8 and summary.busy
    assert summary.metrics()["cpu/run_util_mean_pct"] == 35.0 and summary.metrics()["cpu/util_mean_pct"] == 50.0
    assert summary.tags() == {"machine.busy": "true", "machine.others_cpu_pct": "41"}


def test_without_an_affinity_the_run_may_use_every_cpu_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    machine(monkeypatch, cpus=4, usable=None)
    summary = summarize(readings(30.0, 100.0))
    assert (summary.cpus, summary.run_cpu_pct, summary.others_cpu_pct, summary.busy) == (4, 25.0, 5.0, False)
    assert summary.tags() == {"machine.busy": "false", "machine.others_cpu_pct": "5"}


def test_others_never_go_below_zero_when_the_runs_reading_comes_out_above_the_machines() -> None:
    summary = summarize(readings(30.0, 70.0), cpus=2, machine_cpus=2)  # sampled a moment apart: 35% > 30%
    assert summary.others_cpu_pct == 0.0 and not summary.busy


@pytest.mark.parametrize(("machine_pct", "busy"), [(BUSY_OTHERS_PCT + 10.0, True), (BUSY_OTHERS_PCT + 9.0, False)])
def test_the_machine_is_busy_from_the_threshold_of_others_on(machine_pct: float, busy: bool) -> None:
    summary = summarize(readings(machine_pct, 20.0), cpus=2, machine_cpus=2)  # the run: 10% of the machine
    assert summary.busy is busy


def test_a_ddp_jobs_ranks_on_this_machine_count_as_the_run_not_as_others() -> None:
    rank0 = summarize(readings(60.0, 80.0), cpus=2, machine_cpus=8)
    alone = rank0.others_cpu_pct
    ranks = [
        RankCpu("node-a", 80.0, frozenset({0, 1})),
        RankCpu("node-a", 90.0, frozenset({1, 2, 3})),
        RankCpu("node-b", 100.0, frozenset({0, 1})),  # another machine: its CPUs are not this one's
    ]
    job = job_summary(rank0, ranks, host="node-a")
    assert (job.process_cpu_mean_pct, job.cpus) == (170.0, 4)
    assert job.others_cpu_pct == 60.0 - 170.0 / 8 < alone
    assert job_summary(rank0, ranks[:1], host="node-a") == rank0  # one process: nothing to add
    no_affinity = [RankCpu("node-a", 80.0, None), RankCpu("node-a", 90.0, None)]
    assert job_summary(rank0, no_affinity, host="node-a").cpus == 8
