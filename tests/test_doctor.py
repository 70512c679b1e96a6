"""The doctor: each failure mode of the CPU-vs-GPU set-up recipe, in a fake environment; the report attached to runs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import fake_command
from pipeline.config import DeviceConfig
from pipeline.engine.building import amp_check
from pipeline.engine.building.devices import DeviceError, resolve_device
from pipeline.machine import doctor
from pipeline.machine.doctor import checks, main, main_finding, render, report
from pipeline.machine.facts import (
    Check,
    Facts,
    NvidiaGpu,
    _bf16_flags,
    gather,
    gather_speed,
    kernel_for,
    wheel_for,
)

T4 = NvidiaGpu(0, "Tesla T4", "GPU-aaaa", 15360)


def by_name(facts: Facts) -> dict[str, object]:
    return {c.name: c for c in checks(facts, smoke=False)}


class FakeNvml:
    """nvidia-ml-py with one GPU and a driver for CUDA ``cuda`` (e.g. 12040)."""

    class NVMLError(Exception):
        pass

    def __init__(self, cuda: int = 12040) -> None:
        self.cuda = cuda

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return "h0"

    def nvmlDeviceGetName(self, h: str) -> bytes:
        return b"Tesla T4"

    def nvmlDeviceGetUUID(self, h: str) -> str:
        return "GPU-aaaa"

    def nvmlDeviceGetMemoryInfo(self, h: str):
        return SimpleNamespace(total=15360 * 2**20)


def test_no_gpu_at_all_passes_with_an_informative_note(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "INFO  NVIDIA GPU" in out and "no NVIDIA GPU found" in out and "training runs on the CPU" in out
    assert "PASS  compute on CPU" in out and out.rstrip().endswith("no check failed")


def test_json_output_parses_and_matches_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert main([]) == 0
    table = capsys.readouterr().out
    for check in document["checks"]:
        if check["name"] == "CPU bfloat16":  # timed afresh in each run: on a busy machine it may cross 0.9x
            assert re.search(r"(INFO|WARN)  CPU bfloat16", table)
            continue
        assert f"{check['status']:<4}  {check['name']}" in table
    assert document["facts"]["torch_version"] == torch.__version__
    assert document["facts"]["cpu_bf16_matmul_speed"] > 0 and document["facts"]["cpu_bf16_conv_speed"] > 0


def test_cpu_only_torch_with_a_gpu_present_fails_with_the_matching_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(cuda=12040))
    facts = gather()
    assert facts.driver_cuda == "12.4" and facts.nvidia_gpus == [T4]
    check = by_name(facts)["torch build"]
    assert check.status == "FAIL" and "CPU-only build, but an NVIDIA GPU is present" in check.evidence
    assert check.fix.endswith("--index-url https://download.pytorch.org/whl/cu124")
    assert main([]) == 1


def test_device_cuda_on_that_machine_fails_with_the_doctors_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    with pytest.raises(DeviceError, match=r"The doctor finds torch build: .*CPU-only build.*whl/cu124"):
        resolve_device(DeviceConfig("cuda", 0), explain=main_finding)


def test_the_doctor_reads_the_start_method_without_fixing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing.context

    monkeypatch.setattr(multiprocessing.context._default_context, "_actual_context", None)  # nothing chosen yet
    facts = gather()
    assert multiprocessing.get_start_method(allow_none=True) is None  # still free for the program to choose
    assert facts.start_method == f"{multiprocessing.get_all_start_methods()[0]} (the default)"


def test_a_cudnn_that_refuses_the_gpu_is_a_tag_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.engine.building.devices import DeviceChoice
    from pipeline.engine.building.provenance import run_tags
    from pipeline.engine.hot.precision import PrecisionPolicy

    def refuse() -> int:
        raise RuntimeError("cuDNN version 92400 is not compatible with devices with SM < 7.5")

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", refuse)
    choice = DeviceChoice(torch.device("cpu"), "cpu", "test")
    tags = run_tags(choice, PrecisionPolicy("cpu", None), [], {"tf32": "n/a", "cudnn_benchmark": "n/a"})
    assert tags["torch.cudnn"] == "error: cuDNN version 92400 is not compatible with devices with SM < 7.5"


def test_a_driver_older_than_the_runtime_fails_with_both_remedies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(cuda=12040))
    check = by_name(gather())["driver vs runtime"]
    assert check.status == "FAIL" and "supports CUDA up to 12.4, torch needs 13.0" in check.evidence
    assert "update the NVIDIA driver" in check.fix and "whl/cu124" in check.fix


def test_a_compute_capability_missing_from_the_arch_list_predicts_no_kernel_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(cuda=12040))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_50", "sm_60", "sm_70", "sm_80", "sm_90"])
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(name="Tesla K80", major=3, minor=7, total_memory=11441 * 2**20, uuid="aaaa"),
    )
    check = by_name(gather())["kernels for the GPU"]  # gathering does not raise, whatever cuDNN thinks of it
    assert check.status == "FAIL" and "no kernel image is available for execution on the device" in check.evidence
    assert "sm_37" in check.evidence and "Tesla K80" in check.evidence


def test_a_cudnn_that_refuses_the_gpu_is_a_failed_check() -> None:
    error = "cuDNN version 92400 is not compatible with devices with SM < 7.5."
    check = by_name(Facts(torch_cuda="12.4", cudnn_error=error))["cuDNN"]
    assert check.status == "FAIL" and check.evidence == error and "older torch" in check.fix


def test_ptx_of_the_same_major_version_counts_as_a_kernel() -> None:
    assert kernel_for((8, 6), ["sm_80", "sm_90"]) is False
    assert kernel_for((8, 6), ["sm_80", "compute_80"]) is True
    assert kernel_for((9, 0), ["sm_80", "compute_80"]) is False
    assert kernel_for((7, 5), ["sm_75"]) is True


def test_reordered_visible_devices_warn_with_the_mapping() -> None:
    torch_gpus = [
        {"index": 0, "name": "B", "capability": [8, 6], "memory_mb": 1, "uuid": "bbbb"},
        {"index": 1, "name": "A", "capability": [8, 6], "memory_mb": 1, "uuid": "aaaa"},
    ]
    nvidia = [NvidiaGpu(0, "A", "GPU-aaaa", 1), NvidiaGpu(1, "B", "GPU-bbbb", 1)]
    facts = Facts(
        torch_cuda="12.4",
        driver_cuda="12.4",
        nvidia_gpus=nvidia,
        torch_gpus=torch_gpus,
        arch_list=["sm_86"],
        env={"CUDA_VISIBLE_DEVICES": "1,0"},
    )
    check = by_name(facts)["GPU numbering"]
    assert check.status == "WARN"
    assert check.evidence == "torch 0 = nvidia-smi 1; torch 1 = nvidia-smi 0 (CUDA_VISIBLE_DEVICES=1,0)"


def test_hybrid_graphics_say_the_integrated_gpu_is_not_a_cuda_device() -> None:
    facts = Facts(adapters=["card0: Intel", "card1: NVIDIA"], nvidia_gpus=[T4], torch_cuda="12.4", driver_cuda="12.4")
    check = by_name(facts)["graphics adapters"]
    assert "card0: Intel; card1: NVIDIA" in check.evidence and "not CUDA devices" in check.evidence
    assert "device=auto picks" in check.evidence


def test_monitoring_reports_why_gputil_cannot_work() -> None:
    facts = Facts(
        nvidia_gpus=[T4],
        torch_cuda="12.4",
        driver_cuda="12.4",
        nvidia_smi="/usr/bin/nvidia-smi",
        gputil_error="ModuleNotFoundError: No module named 'distutils'",
    )
    found = by_name(facts)
    assert found["GPU monitoring (NVML)"].status == "PASS"
    gputil = found["GPU monitoring (GPUtil)"]
    assert gputil.status == "WARN" and "distutils" in gputil.evidence and "setuptools" in gputil.fix


def test_a_small_shared_memory_warns_about_loader_workers() -> None:
    check = by_name(Facts(shm_mb=64, cpus=8))["data loading"]
    assert check.status == "WARN" and "/dev/shm 64 MiB" in check.evidence and "--shm-size" in check.fix


@pytest.mark.parametrize(("cpus", "sweep"), [(2, "loader.num_workers=0,1,2"), (8, "loader.num_workers=0,7,14")])
def test_the_worker_advice_sets_no_limit_a_sweep_would_contradict(cpus: int, sweep: str) -> None:
    """The README sweeps loader.num_workers=0,2,4 on any machine: the doctor says what the CPUs suggest and that a
    sweep measures the rest, never that more workers than that are not sensible."""
    evidence = by_name(Facts(shm_mb=4096, cpus=cpus))["data loading"].evidence
    assert "sensible" not in evidence and sweep in evidence and f"{cpus - 1} loader worker(s)" in evidence


def test_nvidia_smi_is_read_when_nvml_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_command(
        tmp_path,
        "nvidia-smi",
        'if [ "$1" = "--query-gpu=index,name,uuid,memory.total" ]; then\n'
        '  echo "0, Tesla T4, GPU-aaaa, 15360"; exit 0\n'
        "fi\n"
        'echo "| NVIDIA-SMI 550.54    Driver Version: 550.54    CUDA Version: 12.4 |"\n',
    )
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    facts = gather()
    assert (facts.driver_version, facts.driver_cuda, facts.nvidia_gpus) == ("550.54", "12.4", [T4])


def test_a_broken_driver_in_nvidia_smi_is_evidence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_command(
        tmp_path,
        "nvidia-smi",
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n',
    )
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    facts = gather()
    assert "couldn't communicate with the NVIDIA driver" in (facts.nvml_error or "")
    assert "couldn't communicate" in by_name(facts)["NVIDIA GPU"].evidence


def test_wheel_choice_follows_the_drivers_cuda() -> None:
    assert wheel_for("12.2").endswith("cu121") and wheel_for("13.1").endswith("cu130")
    assert wheel_for(None).endswith("cu118")


def test_render_lists_fixes_under_their_checks() -> None:
    text = render(checks(Facts(torch_cuda=None, nvidia_gpus=[T4], driver_cuda="12.4"), smoke=False))
    assert "FAIL  torch build" in text and "fix: pip install --force-reinstall torch" in text
    assert text.rstrip().endswith("1 check(s) failed")


def cpu_bf16(matmul: float, conv: float, *, amx: bool | None = False) -> Check:
    facts = Facts(cpu_bf16_matmul_speed=matmul, cpu_bf16_conv_speed=conv, cpu_avx512_bf16=True, cpu_amx=amx)
    return {c.name: c for c in checks(facts, smoke=True)}["CPU bfloat16"]


def test_bfloat16_slower_than_float32_on_the_cpu_warns_to_train_with_amp_false() -> None:
    check = cpu_bf16(0.48, 0.11)
    assert check.status == "WARN"
    assert check.evidence.startswith(
        "bfloat16 runs at 0.48x float32 for a single 1024x1024 matmul and 0.11x for a 3x3 convolution "
        "(avx512_bf16: yes, AMX: no): what the hardware does with one large op"
    )
    assert check.fix == "amp=true will be slower than float32 on this CPU: train with amp=false here, or on a GPU"
    assert cpu_bf16(1.5, 0.85).status == "WARN"  # either format being slow is enough


def test_bfloat16_at_least_nearly_as_fast_as_float32_is_information_only() -> None:
    check = cpu_bf16(2.2, 0.95, amx=None)
    assert check.status == "INFO" and check.fix == ""
    assert (
        "2.20x float32 for a single 1024x1024 matmul and 0.95x for a 3x3 convolution (avx512_bf16: yes, AMX: unknown)"
        in (check.evidence)
    )


def test_the_cpu_bfloat16_check_comes_only_with_the_smoke_tests() -> None:
    facts = Facts(cpu_bf16_matmul_speed=0.5, cpu_bf16_conv_speed=0.1)
    assert "CPU bfloat16" not in by_name(facts)
    unmeasured = {c.name: c for c in checks(Facts(), smoke=True)}["CPU bfloat16"]
    assert unmeasured.status == "INFO" and "not measured" in unmeasured.evidence


def test_the_report_attached_to_runs_does_not_time_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[Facts] = []
    monkeypatch.setattr(doctor, "gather_speed", lambda facts: timed.append(facts) or facts)
    monkeypatch.setattr(amp_check, "time_pairs", lambda *a, **k: pytest.fail("the run's report timed something"))
    document = report(smoke=False)
    assert timed == [] and document["facts"]["cpu_bf16_conv_speed"] is None
    assert "CPU bfloat16" not in [c["name"] for c in document["checks"]]
    report(smoke=True)
    assert len(timed) == 1  # the patched function is the one the doctor's full run calls


def test_gather_speed_divides_float32_time_by_bfloat16_time_for_each_operation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured = iter([([0.01, 0.012], [0.02, 0.02]), ([0.03, 0.03, 0.03], [0.3, 0.3, 0.3])])  # matmul, then conv
    dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def fake_pairs(first, second, *, pairs: int, until: float):
        dtypes.append((first().dtype, second().dtype))
        fp32, bf16 = next(measured)
        return [1.0, 1.0], (fp32, bf16)

    monkeypatch.setattr(amp_check, "time_pairs", fake_pairs)
    facts = gather_speed(Facts())
    assert dtypes == [(torch.float32, torch.bfloat16)] * 2
    assert facts.cpu_bf16_matmul_speed == pytest.approx(0.55) and facts.cpu_bf16_conv_speed == pytest.approx(0.1)


def test_cpu_flags_are_read_from_cpuinfo_and_unknown_without_it(tmp_path: Path) -> None:
    cpus = {
        "amx": "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n",
        "avx512": "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n",
        "arm": "processor\t: 0\nFeatures\t: fp asimd bf16\n",
    }
    read = {}
    for name, text in cpus.items():
        (tmp_path / name).write_text(text)
        flags = amp_check.cpu_flags(str(tmp_path / name))
        read[name] = None if flags is None else _bf16_flags(flags)
    assert read == {"amx": (True, True), "avx512": (True, False), "arm": None}  # Arm lists "Features" instead
    assert amp_check.cpu_flags(str(tmp_path / "missing")) is None
