"""The doctor on Windows and macOS, the CUDA Toolkit and cuDNN: recorded outputs of the OS tools (tests/recorded/)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from helpers import fake_command
from pipeline.machine.doctor import checks, main, report
from pipeline.machine.facts import Check, Facts, NvidiaGpu, gather
from pipeline.machine.platforms import (
    Probe,
    Ran,
    cudnn_file_version,
    cudnn_text,
    display_adapters,
    find_nvidia_smi,
    find_toolkit,
    parse_nvcc,
    parse_system_profiler_json,
    parse_win32_video,
    shadowing_cudnn,
    windows_smi_paths,
)

RECORDED = Path(__file__).parent / "recorded"
RTX3060 = NvidiaGpu(0, "NVIDIA GeForce RTX 3060 Laptop GPU", "GPU-5f3c1a9e-8d2b-4c7e-9a61-2b7d0e4f3c18", 6144)
HYBRID_ADAPTERS = [
    "Intel(R) UHD Graphics (Intel Corporation, driver 31.0.101.4032)",
    "NVIDIA GeForce RTX 3060 Laptop GPU (NVIDIA, driver 31.0.15.3640)",
]


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


@dataclass
class Recorded(Probe):
    """A machine that answers commands with recorded outputs and remembers what it was asked.

    ``answers`` maps the start of a command line (program name, then arguments) to its output; an
    answer starting with "!" is the error instead. The longest matching start wins; anything else
    is "not found".
    """

    answers: dict[str, str] = field(default_factory=dict)
    on_path: dict[str, str] = field(default_factory=dict)  # what `which` finds
    mac: str = ""
    arch: str = "x86_64"
    asked: list[tuple[str, ...]] = field(default_factory=list)

    def run(self, argv: list[str], *, timeout_s: float | None = None) -> Ran:
        self.asked.append(tuple(argv))
        line = " ".join([Path(argv[0]).name, *argv[1:]])
        for start in sorted(self.answers, key=len, reverse=True):
            if line.startswith(start):
                answer = self.answers[start]
                return Ran(tuple(argv), error=answer[1:]) if answer.startswith("!") else Ran(tuple(argv), answer)
        return Ran(tuple(argv), error="not found")

    def which(self, name: str) -> str | None:
        return self.on_path.get(name)

    def os_version(self) -> str:
        return self.mac if self.system == "Darwin" else "11 (10.0.22631)"

    def machine(self) -> str:
        return self.arch


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build of torch that sees no GPU, and no NVML: what a laptop on battery shows."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", None)


def by_name(facts: Facts) -> dict[str, Check]:
    return {c.name: c for c in checks(facts, smoke=False)}


def windows(tmp_path: Path, **answers: str) -> Recorded:
    return Recorded(
        system="Windows",
        environ={"PATH": "", "SystemRoot": str(tmp_path / "Windows"), "ProgramFiles": str(tmp_path / "Program Files")},
        root=tmp_path,
        answers={"powershell": recorded("win32_video_hybrid_laptop.json"), **answers},
    )


# Windows


def test_a_windows_hybrid_laptop_whose_nvidia_gpu_torch_cannot_use_gets_the_graphics_settings_and_charger_advice(
    tmp_path: Path, no_cuda: None
) -> None:
    probe = windows(tmp_path)
    facts = gather(probe)
    assert probe.asked[0][:3] == ("powershell", "-NoProfile", "-Command")
    assert "Win32_VideoController" in probe.asked[0][3] and "ConvertTo-Json" in probe.asked[0][3]
    assert (facts.adapters, facts.adapter_source) == (HYBRID_ADAPTERS, "Win32_VideoController")
    found = by_name(facts)
    hybrid = found["graphics adapters"]
    assert hybrid.status == "WARN"
    assert "neither torch nor the NVIDIA driver can use it" in hybrid.evidence
    assert "AMD and Intel (integrated) GPUs are not CUDA devices" in hybrid.evidence
    assert hybrid.fix.startswith("plug in the charger: on battery the discrete GPU may be disabled")
    assert "Settings > System > Display > Graphics" in hybrid.fix and "set it to High performance" in hybrid.fix
    assert "Manage 3D settings > Preferred graphics processor > High-performance NVIDIA processor" in hybrid.fix
    assert "prime-select" not in hybrid.fix
    nvidia = found["NVIDIA GPU"]
    assert nvidia.status == "WARN"
    assert nvidia.evidence.startswith(
        "Win32_VideoController lists NVIDIA GeForce RTX 3060 Laptop GPU (NVIDIA, driver 31.0.15.3640), "
        "but the NVIDIA driver lists no GPU"
    )
    assert "nvidia-smi not on PATH, System32 or NVSMI" in nvidia.evidence


def test_the_windows_advice_is_not_given_when_torch_uses_the_nvidia_gpu() -> None:
    torch_gpu = {"index": 0, "name": RTX3060.name, "capability": [8, 6], "memory_mb": 6144, "uuid": RTX3060.uuid}
    facts = Facts(system="Windows", adapters=HYBRID_ADAPTERS, torch_cuda="12.4", torch_gpus=[torch_gpu])
    check = by_name(facts)["graphics adapters"]
    assert check.status == "INFO" and check.fix == ""


def test_windows_without_dev_shm_says_there_is_nothing_to_size(tmp_path: Path, no_cuda: None) -> None:
    facts = gather(windows(tmp_path))
    assert facts.shm_mb is None
    check = by_name(facts)["data loading"]
    assert check.status == "INFO" and check.fix == ""
    assert "no /dev/shm on Windows (workers pass batches through the OS's shared memory" in check.evidence


def test_one_adapter_is_an_object_not_a_list_in_powershells_json() -> None:
    assert parse_win32_video(recorded("win32_video_single_adapter.json")) == [
        "NVIDIA GeForce RTX 3060 (NVIDIA, driver 31.0.15.3640)"
    ]
    assert parse_win32_video("\ufeff" + recorded("win32_video_hybrid_laptop.json")) == HYBRID_ADAPTERS
    assert parse_win32_video("") == []
    with pytest.raises(ValueError):
        parse_win32_video("Get-CimInstance : Access denied")


def test_a_hung_or_missing_powershell_is_evidence_not_a_crash(tmp_path: Path) -> None:
    hung = windows(tmp_path, powershell="!timed out after 5 s")
    assert display_adapters(hung) == ([], "Win32_VideoController", "powershell: timed out after 5 s")
    garbled = windows(tmp_path, powershell="Get-CimInstance : Access denied")
    adapters, _, error = display_adapters(garbled)
    assert adapters == [] and error is not None and error.startswith("powershell printed no adapter list")
    facts = Facts(system="Windows", adapter_source="Win32_VideoController", adapter_error="powershell: not found")
    assert "none listed (powershell: not found)" in by_name(facts)["graphics adapters"].evidence


def test_the_real_probe_reports_a_missing_or_hung_command_instead_of_raising() -> None:
    probe = Probe(timeout_s=0.2)
    assert probe.run(["pipeline-no-such-command"]).error == "not found"
    assert probe.run([sys.executable, "-c", "import time; time.sleep(5)"]).error == "timed out after 0.2 s"
    failed = probe.run([sys.executable, "-c", "import sys; sys.exit('driver not loaded')"])
    assert failed.error == "exit status 1: driver not loaded" and not failed.ok


def test_nvidia_smi_is_found_in_system32_when_it_is_not_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    smi = tmp_path / "Windows" / "System32" / "nvidia-smi.exe"
    smi.parent.mkdir(parents=True)
    smi.touch()
    probe = windows(
        tmp_path,
        **{
            "nvidia-smi.exe --query-gpu": recorded("nvidia-smi_query_rtx3060_laptop.csv"),
            "nvidia-smi.exe": recorded("nvidia-smi_rtx3060_laptop_windows.txt"),
        },
    )
    facts = gather(probe)
    assert (facts.nvidia_smi, facts.nvidia_smi_on_path) == (str(smi), False)
    assert (str(smi),) in probe.asked  # run by its full path
    assert (facts.driver_version, facts.driver_cuda, facts.nvidia_gpus) == ("536.40", "12.2", [RTX3060])
    found = by_name(facts)
    assert found["NVIDIA GPU"].status == "PASS" and "NVIDIA GeForce RTX 3060 Laptop GPU (6144 MiB)" in (
        found["NVIDIA GPU"].evidence
    )
    gputil = found["GPU monitoring (GPUtil)"]
    assert gputil.status == "WARN" and gputil.evidence == f"nvidia-smi is at {smi}, which is not on PATH"
    assert gputil.fix == f"add {smi.parent} to PATH, or use monitor=nvml"


def test_nvidia_smi_falls_back_to_nvsmi_and_is_looked_for_there_only_on_windows(tmp_path: Path) -> None:
    probe = windows(tmp_path)
    system32, nvsmi = windows_smi_paths(probe.environ)
    assert system32 == tmp_path / "Windows" / "System32" / "nvidia-smi.exe"
    assert nvsmi == tmp_path / "Program Files" / "NVIDIA Corporation" / "NVSMI" / "nvidia-smi.exe"
    assert find_nvidia_smi(probe) == (None, False)
    nvsmi.parent.mkdir(parents=True)
    nvsmi.touch()
    assert find_nvidia_smi(probe) == (str(nvsmi), False)
    linux = Recorded(system="Linux", environ=probe.environ)
    assert find_nvidia_smi(linux) == (None, False)
    on_path = Recorded(system="Windows", environ=probe.environ, on_path={"nvidia-smi": r"C:\tools\nvidia-smi.exe"})
    assert find_nvidia_smi(on_path) == (r"C:\tools\nvidia-smi.exe", True)


# macOS


def macos(answer: str, *, version: str = "14.5", arch: str = "arm64") -> Recorded:
    return Recorded(system="Darwin", environ={"PATH": ""}, mac=version, arch=arch, answers={"system_profiler": answer})


def test_an_apple_m2_reports_mps_and_the_macos_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    probe = macos(recorded("system_profiler_apple_m2.json"))
    probe.root = tmp_path
    facts = gather(probe)
    assert probe.asked[0] == ("system_profiler", "SPDisplaysDataType", "-json")
    assert (facts.os_version, facts.machine, facts.mps, facts.mps_built) == ("14.5", "arm64", True, True)
    assert facts.adapters == ["Apple M2 (Apple)"] and facts.cudnn_shadows == []
    found = by_name(facts)
    mps = found["Apple MPS"]
    assert mps.status == "PASS"
    assert mps.evidence.startswith("macOS 14.5 on arm64; torch.backends.mps.is_available() = True, is_built() = True")
    assert "device=auto picks mps" in found["graphics adapters"].evidence
    assert "training runs on the CPU or Apple MPS" in found["NVIDIA GPU"].evidence
    assert "cuDNN on the library path" not in found  # no CUDA on macOS: nothing to shadow
    assert "no /dev/shm on macOS" in found["data loading"].evidence


def test_an_intel_mac_with_a_radeon_on_an_old_macos_is_told_mps_needs_12_3() -> None:
    adapters, source, error = display_adapters(macos(recorded("system_profiler_intel_amd.json")))
    assert adapters == ["Intel UHD Graphics 630 (Intel)", "AMD Radeon Pro 5500M (AMD)"]
    assert (source, error) == ("system_profiler SPDisplaysDataType", None)
    facts = Facts(system="Darwin", os_version="11.7.10", machine="x86_64", adapters=adapters, mps_built=True)
    found = by_name(facts)
    assert found["Apple MPS"].status == "WARN"
    assert found["Apple MPS"].fix == "MPS needs macOS 12.3 or later: update macOS, or train with device=cpu"
    assert "not CUDA devices: PyTorch cannot train on them except through MPS on macOS" in (
        found["graphics adapters"].evidence
    )
    unbuilt = by_name(Facts(system="Darwin", os_version="14.5", mps_built=False))["Apple MPS"]
    assert unbuilt.status == "WARN" and unbuilt.fix.startswith("this torch build has no MPS")


def test_system_profiler_without_json_is_read_as_text() -> None:
    probe = Recorded(
        system="Darwin",
        answers={
            "system_profiler SPDisplaysDataType -json": "!exit status 1: unrecognized option -json",
            "system_profiler SPDisplaysDataType": recorded("system_profiler_apple_m2.txt"),
        },
    )
    assert display_adapters(probe) == (["Apple M2 (Apple)"], "system_profiler SPDisplaysDataType", None)
    assert probe.asked == [
        ("system_profiler", "SPDisplaysDataType", "-json"),
        ("system_profiler", "SPDisplaysDataType"),
    ]


def test_an_nvidia_gpu_in_a_mac_is_pointed_to_mps_not_to_a_cuda_wheel() -> None:
    text = '{"SPDisplaysDataType": [{"sppci_model": "NVIDIA GeForce GT 750M", "spdisplays_vendor": "NVIDIA (0x10de)"}]}'
    adapters = parse_system_profiler_json(text)
    assert adapters == ["NVIDIA GeForce GT 750M (NVIDIA)"]
    found = by_name(Facts(system="Darwin", os_version="10.15.7", adapters=adapters, torch_cuda=None))
    assert found["graphics adapters"].status == "WARN"
    assert "macOS has had no NVIDIA CUDA driver since 10.13" in found["graphics adapters"].evidence
    assert found["graphics adapters"].fix.startswith("train with device=mps")
    assert found["torch build"].status == "INFO"  # no "install a CUDA wheel" on a Mac
    assert found["NVIDIA GPU"].status == "INFO"


# Linux: PRIME


def test_a_linux_laptop_in_the_prime_intel_profile_is_told_to_switch_it(tmp_path: Path, no_cuda: None) -> None:
    for card, vendor in [("card0", "0x8086"), ("card1", "0x10de"), ("card0-eDP-1", "0x8086")]:
        (tmp_path / "sys/class/drm" / card / "device").mkdir(parents=True)
        (tmp_path / "sys/class/drm" / card / "device/vendor").write_text(vendor + "\n")
    probe = Recorded(
        system="Linux",
        environ={"PATH": "", "__NV_PRIME_RENDER_OFFLOAD": "1"},
        root=tmp_path,
        on_path={"prime-select": "/usr/bin/prime-select"},
        answers={"prime-select query": "intel\n"},
    )
    facts = gather(probe)
    assert (facts.adapters, facts.prime) == (["card0: Intel", "card1: NVIDIA"], "intel")
    check = by_name(facts)["graphics adapters"]
    assert check.status == "WARN" and "PRIME profile (prime-select query): intel" in check.evidence
    assert "__NV_PRIME_RENDER_OFFLOAD=1 (moves rendering only; CUDA does not need it)" in check.evidence
    assert check.fix.startswith("the PRIME profile 'intel' unloads the NVIDIA driver: sudo prime-select on-demand")
    assert "CUDA does not need it" in check.fix and "Settings > System" not in check.fix


# The CUDA Toolkit


def fake_nvcc(folder: Path) -> Path:
    return fake_command(folder, "nvcc", f"cat <<'EOF'\n{recorded('nvcc_11.6.txt')}EOF\n")


def test_nvcc_older_than_torchs_cuda_is_information_that_the_driver_matters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvcc = fake_nvcc(tmp_path / "bin")
    fake_command(
        tmp_path / "bin", "nvidia-smi", f"cat <<'EOF'\n{recorded('nvidia-smi_rtx3060_laptop_windows.txt')}EOF\n"
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    facts = gather(Probe(root=tmp_path))
    assert (facts.toolkit.nvcc, facts.toolkit.cuda, facts.toolkit.build) == (str(nvcc), "11.6", "11.6.124")
    check = by_name(facts)["CUDA Toolkit (nvcc)"]
    assert check.status == "INFO" and check.fix == ""
    assert check.evidence.startswith(f"nvcc at {nvcc} is CUDA 11.6.124; torch {torch.__version__} carries its own")
    assert "CUDA 12.4 runtime; the driver supports CUDA 12.2" in check.evidence
    assert "For training only the driver matters (it must support 12.4: 'driver vs runtime')" in check.evidence
    assert "which need a Toolkit 12.x" in check.evidence
    assert "'The detected CUDA version (11.6) mismatches the version that was used to compile PyTorch (12.4)'" in (
        check.evidence
    )


def test_nvcc_is_found_through_cuda_home_and_a_cuda_home_without_it_is_said(tmp_path: Path) -> None:
    nvcc = fake_nvcc(tmp_path / "cuda-11.6" / "bin")
    probe = Probe(system="Linux", environ={"PATH": "", "CUDA_HOME": str(tmp_path / "cuda-11.6")})
    toolkit = find_toolkit(probe)
    assert (toolkit.nvcc, toolkit.cuda, toolkit.env) == (str(nvcc), "11.6", {"CUDA_HOME": str(tmp_path / "cuda-11.6")})
    empty = find_toolkit(Probe(system="Linux", environ={"PATH": "", "CUDA_PATH": str(tmp_path / "nothing")}))
    assert empty.cuda is None and empty.error == f"no nvcc on PATH, nor in bin/ of CUDA_PATH={tmp_path / 'nothing'}"
    nothing = Recorded(system="Linux", environ={"PATH": ""})
    assert find_toolkit(nothing).error is None and nothing.asked == []  # nothing to run, nothing run


def test_nvcc_versions_parse_and_a_same_major_toolkit_is_said_to_build_extensions() -> None:
    assert parse_nvcc(recorded("nvcc_11.6.txt")) == ("11.6", "11.6.124")
    assert parse_nvcc("Cuda compilation tools, release 13.0, V13.0.88") == ("13.0", "13.0.88")
    assert parse_nvcc("command not found") == (None, None)
    facts = Facts(torch_cuda="12.4", driver_cuda="12.6")
    facts.toolkit.nvcc, facts.toolkit.cuda, facts.toolkit.build = "/usr/local/cuda/bin/nvcc", "12.1", "12.1.105"
    evidence = by_name(facts)["CUDA Toolkit (nvcc)"].evidence
    assert evidence.endswith("which this Toolkit builds (torch warns of the minor version mismatch with 12.4)")
    none = by_name(Facts(torch_cuda="12.4"))["CUDA Toolkit (nvcc)"]
    assert none.status == "INFO" and "not needed to train" in none.evidence


# cuDNN outside torch


def test_a_cudnn_on_ld_library_path_warns_with_both_versions_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stray = tmp_path / "opt" / "cudnn" / "lib"
    stray.mkdir(parents=True)
    for name in ["libcudnn.so.8", "libcudnn.so.8.9.2", "libcudnn_ops_infer.so.8", "libcublas.so.11"]:
        (stray / name).touch()
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{tmp_path / 'empty'}:{stray}")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    facts = gather(Probe(system="Linux", root=tmp_path))
    assert facts.cudnn_shadows == [
        {
            "folder": str(stray),
            "variable": "LD_LIBRARY_PATH",
            "files": ["libcudnn.so.8", "libcudnn.so.8.9.2", "libcudnn_ops_infer.so.8"],
            "version": "8.9.2",
        }
    ]
    check = by_name(facts)["cuDNN on the library path"]
    assert check.status == "WARN"
    assert f"{stray} on LD_LIBRARY_PATH holds libcudnn.so.8, libcudnn.so.8.9.2, libcudnn_ops_infer.so.8" in (
        check.evidence
    )
    assert "(cuDNN 8.9.2), which could shadow the cuDNN 9.1.0 bundled with torch" in check.evidence
    assert check.fix.startswith(f"remove {stray} from LD_LIBRARY_PATH: torch does not need it")


def test_torchs_own_folder_and_a_same_major_cudnn_are_not_warnings(tmp_path: Path) -> None:
    own, same = tmp_path / "torch" / "lib", tmp_path / "conda" / "lib"
    for folder, name in [(own, "libcudnn.so.9"), (same, "libcudnn.so.9.1.0")]:
        folder.mkdir(parents=True)
        (folder / name).touch()
    probe = Probe(system="Linux", environ={"LD_LIBRARY_PATH": f"{own}:{same}:{own}"})
    shadows = shadowing_cudnn(probe, [own])
    assert [s["folder"] for s in shadows] == [str(same)]
    check = by_name(Facts(system="Linux", torch_cuda="12.4", cudnn=90100, cudnn_shadows=shadows))[
        "cuDNN on the library path"
    ]
    assert check.status == "INFO" and "the same major version, harmless while that holds" in check.evidence
    clean = by_name(Facts(system="Linux", torch_cuda="12.4", cudnn=90100))["cuDNN on the library path"]
    assert (clean.status, clean.evidence) == ("PASS", "no cuDNN on LD_LIBRARY_PATH besides torch's own (cuDNN 9.1.0)")


def test_a_cudnn_dll_on_the_windows_path_is_found_with_its_version(tmp_path: Path) -> None:
    toolkit_bin = tmp_path / "CUDA" / "v11.6" / "bin"
    toolkit_bin.mkdir(parents=True)
    for name in ["cudnn64_8.dll", "cudnn_ops_infer64_8.dll", "cudart64_110.dll"]:
        (toolkit_bin / name).touch()
    probe = Probe(system="Windows", environ={"PATH": f"{tmp_path / 'Windows'};{toolkit_bin}"})
    shadows = shadowing_cudnn(probe, [])
    assert shadows == [
        {
            "folder": str(toolkit_bin),
            "variable": "PATH",
            "files": ["cudnn64_8.dll", "cudnn_ops_infer64_8.dll"],
            "version": "8",
        }
    ]
    check = by_name(Facts(system="Windows", torch_cuda="12.4", cudnn=90100, cudnn_shadows=shadows))[
        "cuDNN on the library path"
    ]
    assert (
        check.status == "WARN" and "(cuDNN 8), which could shadow the cuDNN 9.1.0 bundled with torch" in check.evidence
    )
    assert check.fix.startswith(f"remove {toolkit_bin} from PATH")


def test_a_cudnn_that_torch_refuses_because_of_the_path_gets_the_path_fix() -> None:
    shadow = {"folder": "/opt/cudnn/lib", "variable": "LD_LIBRARY_PATH", "files": ["libcudnn.so.8"], "version": "8"}
    error = "cuDNN version incompatibility: PyTorch was compiled against (9, 1, 0) but found runtime version (8, 9, 2)."
    check = by_name(Facts(system="Linux", torch_cuda="12.4", cudnn_error=error, cudnn_shadows=[shadow]))["cuDNN"]
    assert check.status == "FAIL" and check.fix.startswith("remove the folders named under 'cuDNN on the library path'")


def test_cudnn_versions_read_from_file_names_and_from_torch() -> None:
    assert [cudnn_file_version(n) for n in ["cudnn64_8.dll", "cudnn_graph64_9.dll", "libcudnn.so.8.9.2"]] == [
        "8",
        "9",
        "8.9.2",
    ]
    assert cudnn_file_version("libcudnn.so") is None
    assert (cudnn_text(90100), cudnn_text(8902), cudnn_text(None)) == ("9.1.0", "8.9.2", None)


# The JSON report


def test_the_json_report_carries_the_new_facts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_nvcc(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    main(["--json"])
    document = json.loads(capsys.readouterr().out)
    facts = document["facts"]
    assert facts["toolkit"]["cuda"] == "11.6" and facts["toolkit"]["build"] == "11.6.124"
    assert facts["system"] and facts["machine"] and "mps_built" in facts and "cudnn_shadows" in facts
    assert "CUDA Toolkit (nvcc)" in {c["name"] for c in document["checks"]}


def test_the_report_of_a_windows_laptop_serialises_its_adapters_and_nvidia_smi(tmp_path: Path, no_cuda: None) -> None:
    document = json.loads(json.dumps(report(gather(windows(tmp_path)), smoke=False)))
    facts = document["facts"]
    assert facts["system"] == "Windows" and facts["os_version"] == "11 (10.0.22631)"
    assert facts["adapters"] == HYBRID_ADAPTERS and facts["adapter_source"] == "Win32_VideoController"
    assert facts["nvidia_smi"] is None and facts["shm_mb"] is None
    statuses = {c["name"]: c["status"] for c in document["checks"]}
    assert statuses["graphics adapters"] == "WARN" and statuses["data loading"] == "INFO"


def test_a_gpu_torch_uses_passes_even_when_the_drivers_tools_cannot_be_read() -> None:
    torch_gpu = {"index": 0, "name": RTX3060.name, "capability": [8, 6], "memory_mb": 6144, "uuid": RTX3060.uuid}
    facts = Facts(
        system="Windows",
        adapters=HYBRID_ADAPTERS,
        torch_cuda="12.4",
        torch_gpus=[torch_gpu],
        nvml_error="ModuleNotFoundError: No module named 'pynvml'",
    )
    check = by_name(facts)["NVIDIA GPU"]
    assert check.status == "PASS"
    assert check.evidence == (
        "torch sees 0: NVIDIA GeForce RTX 3060 Laptop GPU (6144 MiB); the driver's own tools not read "
        "(ModuleNotFoundError: No module named 'pynvml'; nvidia-smi not on PATH, System32 or NVSMI)"
    )
