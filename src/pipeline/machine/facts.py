"""What the doctor knows about the machine before it judges anything (``gather``): torch's build, the NVIDIA driver
through NVML and ``nvidia-smi``, each GPU, the CUDA toolkit, cuDNN, the display adapters the OS lists
(``pipeline.machine.platforms``), the CPU's flags and, asked for separately, its bfloat16 speed
(``gather_speed``). Each source may be missing; its absence is itself a fact.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import platform
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.common.messages import brief
from pipeline.common.stats import paired_ratio
from pipeline.engine.building import amp_check
from pipeline.engine.building.devices import cpu_name, cudnn_version
from pipeline.machine.platforms import (
    Probe,
    Toolkit,
    display_adapters,
    find_nvidia_smi,
    find_toolkit,
    prime_profile,
    shadowing_cudnn,
    vendor_of,
)
from pipeline.monitor.peaks import WINDOW_DTYPES, cpu_peaks, measure_window

# CUDA versions of PyTorch's wheel indexes (download.pytorch.org/whl/cuXYZ), newest last
WHEEL_CUDA = ["11.8", "12.1", "12.4", "12.6", "12.8", "12.9", "13.0"]


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS | WARN | FAIL | INFO
    evidence: str
    fix: str = ""


@dataclass
class NvidiaGpu:
    index: int  # NVML / nvidia-smi index (PCI order)
    name: str
    uuid: str
    memory_mb: int


@dataclass
class Facts:
    """What the machine says, gathered once; the checks only read it."""

    torch_version: str = torch.__version__
    torch_cuda: str | None = None
    cuda_available: bool = False
    torch_gpus: list[dict[str, Any]] = field(default_factory=list)  # index, name, capability, memory_mb, uuid
    arch_list: list[str] = field(default_factory=list)
    cudnn: int | None = None
    cudnn_error: str | None = None
    bf16: bool | None = None
    nvml_error: str | None = None
    driver_version: str | None = None
    driver_cuda: str | None = None  # the newest CUDA the driver supports, e.g. "12.4"
    nvidia_gpus: list[NvidiaGpu] = field(default_factory=list)
    nvidia_smi: str | None = None  # its path: on PATH, or where the Windows driver installs it
    nvidia_smi_on_path: bool = True  # False when found only in System32 or NVSMI (GPUtil runs it by name)
    system: str = field(default_factory=platform.system)  # "Linux", "Windows", "Darwin"
    os_version: str = ""  # macOS 14.5, Windows 10 (10.0.22631), the Linux kernel
    machine: str = ""  # x86_64, arm64
    adapters: list[str] = field(default_factory=list)  # display adapters as the OS lists them
    adapter_source: str = "/sys/class/drm"  # Win32_VideoController, system_profiler SPDisplaysDataType
    adapter_error: str | None = None  # why the OS's list could not be read
    prime: str | None = None  # `prime-select query` on Linux: nvidia, on-demand, intel
    prime_offload: str | None = None  # __NV_PRIME_RENDER_OFFLOAD as set (rendering only; CUDA ignores it)
    mps: bool = False
    mps_built: bool | None = None
    toolkit: Toolkit = field(default_factory=Toolkit)  # nvcc's CUDA: matters only for compiling extensions
    cudnn_shadows: list[dict[str, Any]] = field(default_factory=list)  # cuDNN on PATH / LD_LIBRARY_PATH
    gputil_error: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cpus: int = 1
    shm_mb: int | None = None
    start_method: str = ""
    # bfloat16's speed relative to float32 on the CPU; measured only by gather_speed (about a second)
    cpu_bf16_matmul_speed: float | None = None  # 1024x1024 matmul
    cpu_bf16_conv_speed: float | None = None  # 3x3 convolution, batch 8, 64 -> 64 channels, 56x56
    cpu_avx512_bf16: bool | None = None  # from /proc/cpuinfo; None where it does not exist
    cpu_amx: bool | None = None  # amx_bf16: the tile unit that makes bfloat16 pay off on the CPU
    # the CPU's measured matmul peak per dtype (TFLOP/s; pipeline.monitor.peaks), measured again by gather_speed
    cpu_peak_tflops: dict[str, float] = field(default_factory=dict)
    cpu_peak_refused: str = ""  # why gather_speed's measurement was refused (the machine was busy): not cached


def gather(probe: Probe | None = None) -> Facts:
    """Read every source; none of them raising stops the others.

    Args:
        probe: the OS, environment, commands and files to read (tests pass recorded ones).
    """
    probe = probe or Probe()
    facts = Facts(
        torch_cuda=torch.version.cuda,
        cpus=os.cpu_count() or 1,
        system=probe.system,
        os_version=probe.os_version(),
        machine=probe.machine(),
    )
    facts.cuda_available = torch.cuda.is_available()
    facts.arch_list = list(torch.cuda.get_arch_list()) if torch.version.cuda else []
    if facts.cuda_available:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            facts.torch_gpus.append(
                {
                    "index": i,
                    "name": props.name,
                    "capability": [props.major, props.minor],
                    "memory_mb": props.total_memory // 2**20,
                    "uuid": str(getattr(props, "uuid", "")),
                }
            )
        with contextlib.suppress(Exception):  # the GPU may be unusable: the compute check says so
            facts.bf16 = torch.cuda.is_bf16_supported()
    if facts.torch_cuda:  # without a GPU too: a cuDNN on LD_LIBRARY_PATH that torch refuses shows here
        facts.cudnn, facts.cudnn_error = cudnn_version()
    _nvml(facts)
    facts.nvidia_smi, facts.nvidia_smi_on_path = find_nvidia_smi(probe)
    if facts.nvidia_smi and not facts.nvidia_gpus:
        _smi(facts, probe)
    facts.adapters, facts.adapter_source, facts.adapter_error = display_adapters(probe)
    facts.prime = prime_profile(probe)
    facts.prime_offload = probe.environ.get("__NV_PRIME_RENDER_OFFLOAD")
    mps = getattr(torch.backends, "mps", None)
    facts.mps = bool(mps and mps.is_available())
    facts.mps_built = bool(mps and mps.is_built()) if mps else None
    facts.toolkit = find_toolkit(probe)
    facts.cudnn_shadows = shadowing_cudnn(probe, torch_lib_dirs()) if facts.torch_cuda else []
    try:
        import GPUtil  # noqa: F401  (1.4.0 imports distutils)
    except Exception as err:  # ModuleNotFoundError: distutils on Python 3.12+, or GPUtil missing
        facts.gputil_error = brief(err)
    facts.env = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER") if k in os.environ}
    shm = probe.path("/dev/shm")  # Linux only: Windows and macOS workers share memory without it
    if shm.is_dir():
        with contextlib.suppress(OSError):
            facts.shm_mb = shutil.disk_usage(shm).total // 2**20
    # get_start_method() without allow_none would fix the method for the whole process: read, never set
    facts.start_method = multiprocessing.get_start_method(allow_none=True) or (
        f"{multiprocessing.get_all_start_methods()[0]} (the default)"
    )
    return facts


def gather_speed(facts: Facts) -> Facts:
    """Time bfloat16 against float32 on the CPU for a matmul and a convolution, and measure the CPU's matmul peaks
    again: under two seconds.

    Only the doctor's own run (and ``report(smoke=True)``) pays for this, never the report
    attached to each training run. Fills ``facts.cpu_bf16_*``, the CPU's bfloat16 flags, ``cpu_peak_tflops`` and
    ``cpu_peak_refused``.
    """
    flags = amp_check.cpu_flags()  # the amp check's reading of the CPU's flags: one reader of /proc/cpuinfo
    facts.cpu_avx512_bf16, facts.cpu_amx = (None, None) if flags is None else _bf16_flags(flags)
    start = time.perf_counter()
    rng = torch.Generator().manual_seed(0)  # leaves the global stream alone when called in-process
    a, b = torch.randn(1024, 1024, generator=rng), torch.randn(1024, 1024, generator=rng)
    x, w = torch.randn(8, 64, 56, 56, generator=rng), torch.randn(64, 64, 3, 3, generator=rng)
    facts.cpu_bf16_matmul_speed = _bf16_speed(torch.matmul, (a, b), until=start + 0.3)
    conv = torch.nn.functional.conv2d
    facts.cpu_bf16_conv_speed = _bf16_speed(lambda x, w: conv(x, w, padding=1), (x, w), until=start + 1.0)
    found = cpu_peaks(WINDOW_DTYPES, cpu=cpu_name(), refresh=True, measure=measure_window)
    facts.cpu_peak_tflops = {dtype: found.figures[dtype].tflops for dtype in WINDOW_DTYPES if dtype in found.figures}
    facts.cpu_peak_refused = found.refused
    return facts


def _bf16_speed(op: Any, args: tuple[torch.Tensor, ...], *, until: float) -> float:
    """float32's time over bfloat16's for ``op(*args)``: the median of interleaved pairs' ratios, as the amp check
    measures (``pipeline.engine.building.amp_check.time_pairs``); inputs are cast beforehand, so only compute counts."""
    narrow = tuple(t.bfloat16() for t in args)
    warm, (fp32, bf16) = amp_check.time_pairs(lambda: op(*args), lambda: op(*narrow), pairs=5, until=until)
    return paired_ratio(fp32, bf16) if fp32 else warm[0] / warm[1]


def _bf16_flags(flags: frozenset[str]) -> tuple[bool, bool]:
    """(avx512_bf16, amx_bf16) among the CPU's x86 flags."""
    return "avx512_bf16" in flags, "amx_bf16" in flags


def _nvml(facts: Facts) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # the library is missing (no driver), or nvidia-ml-py is not installed
        facts.nvml_error = brief(err)
        return
    try:
        facts.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        version = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040
        facts.driver_cuda = f"{version // 1000}.{version % 1000 // 10}"
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            facts.nvidia_gpus.append(
                NvidiaGpu(
                    i,
                    _text(pynvml.nvmlDeviceGetName(handle)),
                    _text(pynvml.nvmlDeviceGetUUID(handle)),
                    pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20,
                )
            )
    except Exception as err:
        facts.nvml_error = brief(err)
    finally:
        with contextlib.suppress(Exception):  # already failed above; the facts say so
            pynvml.nvmlShutdown()


def _smi(facts: Facts, probe: Probe) -> None:
    """nvidia-smi's own view, when NVML could not be read in-process."""
    smi = facts.nvidia_smi or "nvidia-smi"
    out = probe.run([smi], timeout_s=10)
    if not out.ok:
        facts.nvml_error = (facts.nvml_error or "") + f"; nvidia-smi: {out.error}"
        return
    if match := re.search(r"Driver Version:\s*([\d.]+)", out.output):
        facts.driver_version = match.group(1)
    if match := re.search(r"CUDA Version:\s*([\d.]+)", out.output):
        facts.driver_cuda = match.group(1)
    query = probe.run([smi, "--query-gpu=index,name,uuid,memory.total", "--format=csv,noheader,nounits"], timeout_s=10)
    for line in query.output.strip().splitlines() if query.ok else []:
        with contextlib.suppress(ValueError):  # a line of another shape ("No devices were found")
            index, name, uuid, memory = (part.strip() for part in line.split(","))
            facts.nvidia_gpus.append(NvidiaGpu(int(index), name, uuid, int(float(memory))))


def torch_lib_dirs() -> list[Path]:
    """Where torch loads its bundled cuDNN from: torch/lib (Windows wheels), nvidia/cudnn (Linux pip wheels)."""
    package = Path(torch.__file__).parent
    return [package / "lib", package.parent / "nvidia" / "cudnn" / "lib", package.parent / "nvidia" / "cudnn" / "bin"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def version_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or "")[:2]) or (0,)


def wheel_for(driver_cuda: str | None) -> str:
    """The newest PyTorch wheel index whose CUDA the driver supports."""
    fitting = [v for v in WHEEL_CUDA if version_tuple(v) <= version_tuple(driver_cuda)] if driver_cuda else []
    cuda = (fitting[-1] if fitting else WHEEL_CUDA[0]).replace(".", "")
    return f"pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cu{cuda}"


def kernel_for(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether torch ships code this GPU can run: its own sm_XY, or PTX of an older (same-major) compute_XY."""
    major, minor = capability
    if f"sm_{major}{minor}" in arch_list:
        return True
    ptx = [a for a in arch_list if a.startswith("compute_")]
    return any(int(a[8:]) // 10 == major and int(a[8:]) % 10 <= minor for a in ptx if a[8:].isdigit())


def nvidia_adapters(facts: Facts) -> list[str]:
    return [a for a in facts.adapters if vendor_of(a) == "NVIDIA"]
