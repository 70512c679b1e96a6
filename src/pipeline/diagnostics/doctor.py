"""Why is training not on the GPU? ``python -m pipeline.doctor [--json]`` checks and says what to do.

Each check is PASS, WARN, FAIL or INFO, with its evidence and, for WARN and FAIL, the fix as a
command or a setting. The exit status is 1 when any check FAILs. Facts come from torch, NVML
(nvidia-ml-py), ``nvidia-smi``, ``nvcc`` and the OS's own list of display adapters (Windows:
Win32_VideoController, macOS: system_profiler, Linux: ``/sys/class/drm``), read through
``pipeline.diagnostics.platforms``; each source may be missing, and its absence is itself evidence. Nothing
here imports MLflow or Hydra, so it answers in seconds.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.common.cli import Parser, command
from pipeline.config import DeviceConfig
from pipeline.diagnostics.platforms import (
    Probe,
    Toolkit,
    cudnn_text,
    display_adapters,
    find_nvidia_smi,
    find_toolkit,
    prime_profile,
    shadowing_cudnn,
    vendor_of,
)
from pipeline.engine.devices import cudnn_version, resolve_device
from pipeline.monitor.gpu import normalize_uuid

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
            p = torch.cuda.get_device_properties(i)
            facts.torch_gpus.append(
                {
                    "index": i,
                    "name": p.name,
                    "capability": [p.major, p.minor],
                    "memory_mb": p.total_memory // 2**20,
                    "uuid": str(getattr(p, "uuid", "")),
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
        facts.gputil_error = f"{type(err).__name__}: {err}"
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
    """Time bfloat16 against float32 on the CPU for a matmul and a convolution: about a second.

    Only the doctor's own run (and ``report(smoke=True)``) pays for this, never the report
    attached to each training run. Fills ``facts.cpu_bf16_*`` and the CPU's bfloat16 flags.
    """
    from pipeline.engine.amp_check import cpu_flags

    flags = cpu_flags()  # the amp check's reading of the CPU's flags: one reader of /proc/cpuinfo
    facts.cpu_avx512_bf16, facts.cpu_amx = (None, None) if flags is None else _bf16_flags(flags)
    start = time.perf_counter()
    rng = torch.Generator().manual_seed(0)  # leaves the global stream alone when called in-process
    a, b = torch.randn(1024, 1024, generator=rng), torch.randn(1024, 1024, generator=rng)
    x, w = torch.randn(8, 64, 56, 56, generator=rng), torch.randn(64, 64, 3, 3, generator=rng)
    facts.cpu_bf16_matmul_speed = _bf16_speed(torch.matmul, (a, b), until=start + 0.3)
    conv = torch.nn.functional.conv2d
    facts.cpu_bf16_conv_speed = _bf16_speed(lambda x, w: conv(x, w, padding=1), (x, w), until=start + 1.0)
    return facts


def _bf16_speed(op: Any, args: tuple[torch.Tensor, ...], *, until: float) -> float:
    """float32's time over bfloat16's for ``op(*args)``: the median of interleaved pairs' ratios, as the amp check
    measures (``pipeline.engine.amp_check.time_pairs``); inputs are cast beforehand, so only compute counts."""
    from pipeline.common.stats import paired_ratio
    from pipeline.engine.amp_check import time_pairs

    narrow = tuple(t.bfloat16() for t in args)
    warm, (fp32, bf16) = time_pairs(lambda: op(*args), lambda: op(*narrow), pairs=5, until=until)
    return paired_ratio(fp32, bf16) if fp32 else warm[0] / warm[1]


def _bf16_flags(flags: frozenset[str]) -> tuple[bool, bool]:
    """(avx512_bf16, amx_bf16) among the CPU's x86 flags."""
    return "avx512_bf16" in flags, "amx_bf16" in flags


def _nvml(facts: Facts) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # the library is missing (no driver), or nvidia-ml-py is not installed
        facts.nvml_error = f"{type(err).__name__}: {err}"
        return
    try:
        facts.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        version = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040
        facts.driver_cuda = f"{version // 1000}.{version % 1000 // 10}"
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            facts.nvidia_gpus.append(
                NvidiaGpu(
                    i,
                    _text(pynvml.nvmlDeviceGetName(h)),
                    _text(pynvml.nvmlDeviceGetUUID(h)),
                    pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20,
                )
            )
    except Exception as err:
        facts.nvml_error = f"{type(err).__name__}: {err}"
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


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or "")[:2]) or (0,)


def wheel_for(driver_cuda: str | None) -> str:
    """The newest PyTorch wheel index whose CUDA the driver supports."""
    fitting = [v for v in WHEEL_CUDA if _version(v) <= _version(driver_cuda)] if driver_cuda else []
    cuda = (fitting[-1] if fitting else WHEEL_CUDA[0]).replace(".", "")
    return f"pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cu{cuda}"


def checks(facts: Facts, *, smoke: bool = True) -> list[Check]:
    """Every check, in the order a person would work through them.

    ``smoke=False`` skips the allocations on each device (a training run attaching its report
    should not create a CUDA context on GPUs it does not use).
    """
    out: list[Check] = [_nvidia_check(facts)]
    nvidia_seen = _nvidia_seen(facts)
    out += _build_checks(facts, nvidia_seen)
    out.append(_toolkit_check(facts))
    out += _device_checks(facts, smoke=smoke)
    out += _cudnn_path_checks(facts)
    if smoke:
        out.append(_cpu_bf16_check(facts))
    out += _order_checks(facts)
    out.append(_hybrid_check(facts))
    if facts.system == "Darwin":
        out.append(_mps_check(facts))
    out += _monitoring_checks(facts, nvidia_seen)
    out.append(_loading_check(facts))
    return out


def _nvidia_adapters(facts: Facts) -> list[str]:
    return [a for a in facts.adapters if vendor_of(a) == "NVIDIA"]


def _nvidia_seen(facts: Facts) -> bool:
    """An NVIDIA GPU that a CUDA build of torch could use: listed by the driver, or by the OS outside macOS."""
    return bool(facts.nvidia_gpus) or (facts.system != "Darwin" and bool(_nvidia_adapters(facts)))


def _smi_where(facts: Facts) -> str:
    if not facts.nvidia_smi:
        return "not on PATH" + (", System32 or NVSMI" if facts.system == "Windows" else "")
    return f"at {facts.nvidia_smi}" + ("" if facts.nvidia_smi_on_path else " (not on PATH)")


def _nvidia_check(facts: Facts) -> Check:
    if facts.nvidia_gpus:
        names = ", ".join(f"{g.index}: {g.name} ({g.memory_mb} MiB)" for g in facts.nvidia_gpus)
        return Check(
            "NVIDIA GPU", "PASS", f"driver {facts.driver_version or '?'} (CUDA {facts.driver_cuda or '?'}); {names}"
        )
    how = f"{facts.nvml_error or 'NVML lists no GPU'}; nvidia-smi {_smi_where(facts)}"
    if facts.torch_gpus:  # the driver works (torch uses it); only its tools could not be read
        names = ", ".join(f"{g['index']}: {g['name']} ({g['memory_mb']} MiB)" for g in facts.torch_gpus)
        return Check("NVIDIA GPU", "PASS", f"torch sees {names}; the driver's own tools not read ({how})")
    if _nvidia_seen(facts):  # the OS lists the card, the driver does not
        return Check(
            "NVIDIA GPU",
            "WARN",
            f"{facts.adapter_source} lists {'; '.join(_nvidia_adapters(facts))}, but the NVIDIA driver lists no GPU "
            f"({how})",
            "install (or reinstall) the NVIDIA driver from nvidia.com; on a laptop see 'graphics adapters' below",
        )
    return Check(
        "NVIDIA GPU",
        "INFO",
        f"no NVIDIA GPU found ({how}): training runs on the CPU{' or Apple MPS' if facts.mps else ''}, "
        "and device=auto chooses that",
    )


def _build_checks(facts: Facts, nvidia_seen: bool) -> list[Check]:
    if facts.torch_cuda is None:
        if nvidia_seen:
            return [
                Check(
                    "torch build",
                    "FAIL",
                    f"torch {facts.torch_version} is a CPU-only build, but an NVIDIA GPU "
                    f"is present (driver CUDA {facts.driver_cuda or '?'})",
                    wheel_for(facts.driver_cuda),
                )
            ]
        return [Check("torch build", "INFO", f"torch {facts.torch_version}, CPU-only build")]
    found = [
        Check(
            "torch build",
            "PASS",
            f"torch {facts.torch_version} built for CUDA {facts.torch_cuda}; "
            f"kernels for {' '.join(facts.arch_list) or '?'}",
        )
    ]
    if facts.driver_cuda and _version(facts.driver_cuda) < _version(facts.torch_cuda):
        found.append(
            Check(
                "driver vs runtime",
                "FAIL",
                f"the driver supports CUDA up to {facts.driver_cuda}, torch needs "
                f"{facts.torch_cuda} ('CUDA driver version is insufficient' / 'Driver is older than runtime')",
                f"update the NVIDIA driver to one for CUDA {facts.torch_cuda}, or: {wheel_for(facts.driver_cuda)}",
            )
        )
    elif facts.driver_cuda:
        found.append(
            Check("driver vs runtime", "PASS", f"driver CUDA {facts.driver_cuda} >= torch's CUDA {facts.torch_cuda}")
        )
    return found


def _toolkit_check(facts: Facts) -> Check:
    """nvcc's CUDA beside torch's and the driver's, and which of them matters (for training: the driver's)."""
    toolkit = facts.toolkit
    extensions = "the Toolkit matters only for compiling CUDA extensions (torch.utils.cpp_extension)"
    if toolkit.cuda is None:
        where = toolkit.error or "nvcc not on PATH, CUDA_PATH and CUDA_HOME unset"
        return Check(
            "CUDA Toolkit (nvcc)",
            "INFO",
            f"no CUDA Toolkit found ({where}): not needed to train, pip and conda builds of torch carry their own "
            f"CUDA runtime; {extensions}",
        )
    found = f"nvcc at {toolkit.nvcc} is CUDA {toolkit.build or toolkit.cuda}"
    if facts.torch_cuda is None:
        return Check(
            "CUDA Toolkit (nvcc)",
            "INFO",
            f"{found}, but torch is a CPU-only build: installing a Toolkit does not give torch CUDA "
            f"(see 'torch build'); {extensions}",
        )
    driver = f"the driver supports CUDA {facts.driver_cuda}" if facts.driver_cuda else "the driver's CUDA is unknown"
    evidence = (
        f"{found}; torch {facts.torch_version} carries its own CUDA {facts.torch_cuda} runtime; {driver}. "
        f"For training only the driver matters (it must support {facts.torch_cuda}: 'driver vs runtime'); "
        f"nvcc's version is not used. {extensions[0].upper()}{extensions[1:]}"
    )
    torch_major = _version(facts.torch_cuda)[0]
    if _version(toolkit.cuda)[0] != torch_major:
        evidence += (
            f", which need a Toolkit {torch_major}.x: with this one they fail with 'The detected CUDA version "
            f"({toolkit.cuda}) mismatches the version that was used to compile PyTorch ({facts.torch_cuda})'"
        )
    elif _version(toolkit.cuda) != _version(facts.torch_cuda):
        evidence += f", which this Toolkit builds (torch warns of the minor version mismatch with {facts.torch_cuda})"
    else:
        evidence += ", which this Toolkit builds"
    return Check("CUDA Toolkit (nvcc)", "INFO", evidence)


def _cudnn_path_checks(facts: Facts) -> list[Check]:
    """A cuDNN on PATH (Windows) or LD_LIBRARY_PATH (Linux) that the loader may take instead of torch's own."""
    if facts.torch_cuda is None or facts.system not in ("Windows", "Linux"):
        return []
    variable = "PATH" if facts.system == "Windows" else "LD_LIBRARY_PATH"
    bundled = cudnn_text(facts.cudnn)
    if not facts.cudnn_shadows:
        return [
            Check(
                "cuDNN on the library path",
                "PASS",
                f"no cuDNN on {variable} besides torch's own ({'cuDNN ' + bundled if bundled else 'version unknown'})",
            )
        ]
    out = []
    for shadow in facts.cudnn_shadows:
        theirs = shadow["version"]
        same = bool(bundled and theirs) and _version(bundled)[0] == _version(theirs)[0]
        evidence = (
            f"{shadow['folder']} on {shadow['variable']} holds {', '.join(shadow['files'][:3])}"
            f"{' …' if len(shadow['files']) > 3 else ''} (cuDNN {theirs or 'of unknown version'}), which could "
            f"shadow the cuDNN {bundled or '(version unknown)'} bundled with torch"
        )
        if same:
            evidence += ": the same major version, harmless while that holds"
        else:
            evidence += " ('Could not load library cudnn…', 'Unable to find cuDNN' or 'cuDNN version incompatibility')"
        out.append(
            Check(
                "cuDNN on the library path",
                "INFO" if same else "WARN",
                evidence,
                ""
                if same
                else f"remove {shadow['folder']} from {shadow['variable']}: torch does not need it (it loads its "
                "own cuDNN); if the folder must stay, move the cudnn files out of it",
            )
        )
    return out


def kernel_for(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether torch ships code this GPU can run: its own sm_XY, or PTX of an older (same-major) compute_XY."""
    major, minor = capability
    if f"sm_{major}{minor}" in arch_list:
        return True
    ptx = [a for a in arch_list if a.startswith("compute_")]
    return any(int(a[8:]) // 10 == major and int(a[8:]) % 10 <= minor for a in ptx if a[8:].isdigit())


def _device_checks(facts: Facts, *, smoke: bool) -> list[Check]:
    out = []
    for gpu in facts.torch_gpus:
        cap = tuple(gpu["capability"])
        label = f"CUDA device {gpu['index']}: {gpu['name']} (sm_{cap[0]}{cap[1]}, {gpu['memory_mb']} MiB)"
        if facts.arch_list and not kernel_for(cap, facts.arch_list):
            out.append(
                Check(
                    "kernels for the GPU",
                    "FAIL",
                    f"{label}: torch has no kernels for sm_{cap[0]}{cap[1]} "
                    f"(it has {' '.join(facts.arch_list)}); expect 'no kernel image is available for execution "
                    f"on the device'",
                    "install a torch build that supports this GPU: newer wheels for new GPUs, "
                    "an older torch (or a source build) for GPUs torch has dropped",
                )
            )
            continue
        out.append(_smoke(gpu["index"], label) if smoke else Check("kernels for the GPU", "PASS", label))
    if facts.cudnn_error:
        out.append(
            Check(
                "cuDNN",
                "FAIL",
                facts.cudnn_error,
                "remove the folders named under 'cuDNN on the library path' from "
                f"{facts.cudnn_shadows[0]['variable']}: torch brings its own cuDNN"
                if facts.cudnn_shadows
                else "install a torch build whose cuDNN supports this GPU (older GPUs need an older torch)",
            )
        )
    if facts.torch_gpus:
        bf16 = {True: "supported", False: "not supported (amp uses float16 + GradScaler)", None: "unknown"}[facts.bf16]
        out.append(
            Check(
                "cuDNN and number formats",
                "INFO",
                f"cuDNN {facts.cudnn or 'missing'}; bfloat16 {bf16}; TF32 matmul "
                f"{torch.backends.cuda.matmul.allow_tf32}, cuDNN {torch.backends.cudnn.allow_tf32} "
                "(precision.tf32 sets both for runs)",
            )
        )
    if smoke:
        out.append(_smoke(None, "CPU"))
    return out


def _smoke(index: int | None, label: str) -> Check:
    """A tiny allocation and matmul on the device: catches installs that report available but fail."""
    device = torch.device("cpu") if index is None else torch.device("cuda", index)
    try:
        x = torch.ones(64, 64, device=device)
        value = float((x @ x).sum())
        if index is not None:
            torch.cuda.synchronize(device)
    except Exception as err:
        return Check(
            f"compute on {label}",
            "FAIL",
            f"{type(err).__name__}: {' '.join(str(err).split())[:300]}",
            "reinstall the NVIDIA driver and a matching torch build; see the checks above",
        )
    ok = value == 64 * 64 * 64
    return Check(
        f"compute on {label}",
        "PASS" if ok else "FAIL",
        f"64x64 matmul = {value:.0f} (expected 262144)",
        "" if ok else "results are wrong: reinstall the driver and torch",
    )


def _order_checks(facts: Facts) -> list[Check]:
    if not facts.torch_gpus or not facts.nvidia_gpus:
        return []
    by_uuid = {normalize_uuid(g.uuid): g for g in facts.nvidia_gpus}
    pairs, differ = [], False
    for gpu in facts.torch_gpus:
        nv = by_uuid.get(normalize_uuid(gpu["uuid"]))
        pairs.append(f"torch {gpu['index']} = nvidia-smi {nv.index if nv else '?'}")
        differ |= nv is None or nv.index != gpu["index"]
    env = ", ".join(f"{k}={v}" for k, v in facts.env.items()) or "CUDA_VISIBLE_DEVICES unset"
    return [
        Check(
            "GPU numbering",
            "WARN" if differ else "PASS",
            f"{'; '.join(pairs)} ({env})",
            "torch's device.index is not nvidia-smi's: pick by the torch number (listed here), or set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID"
            if differ
            else "",
        )
    ]


def _hybrid_check(facts: Facts) -> Check:
    """The adapters as the OS lists them, and, where an NVIDIA one is listed but unusable, this OS's remedy."""
    choice = resolve_device(DeviceConfig("auto"))
    adapters = "; ".join(facts.adapters) or "none listed" + (f" ({facts.adapter_error})" if facts.adapter_error else "")
    evidence = (
        f"display adapters ({facts.adapter_source}): {adapters}. device=auto picks {choice.device} ({choice.reason})."
    )
    vendors = {vendor_of(a) for a in facts.adapters}
    if vendors & {"AMD", "Intel"}:
        evidence += " AMD and Intel (integrated) GPUs are not CUDA devices: PyTorch cannot train on them" + (
            " except through MPS on macOS." if facts.system == "Darwin" else "."
        )
    if "Microsoft" in vendors:
        evidence += " 'Microsoft Basic Display Adapter' is a GPU running without its own driver."
    if facts.prime:
        evidence += f" PRIME profile (prime-select query): {facts.prime}."
    if facts.prime_offload:
        evidence += f" __NV_PRIME_RENDER_OFFLOAD={facts.prime_offload} (moves rendering only; CUDA does not need it)."
    nvidia = _nvidia_adapters(facts)
    if not nvidia:
        return Check("graphics adapters", "INFO", evidence)
    if facts.system == "Darwin":
        return Check(
            "graphics adapters",
            "WARN",
            evidence + " macOS has had no NVIDIA CUDA driver since 10.13, and torch has no CUDA build for macOS.",
            "train with device=mps (Apple silicon, or an AMD GPU on macOS 12.3+) or device=cpu; for CUDA, use "
            "Linux or Windows",
        )
    if facts.torch_gpus:
        return Check("graphics adapters", "INFO", evidence)
    if facts.nvidia_gpus:  # the driver has the card: the build, the driver's CUDA or CUDA_VISIBLE_DEVICES is why
        return Check(
            "graphics adapters",
            "INFO",
            f"{evidence} The NVIDIA driver lists the GPU, so graphics switching is not what keeps torch off it: "
            "see 'torch build', 'driver vs runtime' and CUDA_VISIBLE_DEVICES.",
        )
    return Check(
        "graphics adapters",
        "WARN",
        f"{evidence} An NVIDIA adapter is listed, but neither torch nor the NVIDIA driver can use it.",
        _hybrid_fix(facts),
    )


def _hybrid_fix(facts: Facts) -> str:
    """What makes a hybrid laptop's NVIDIA GPU usable, in this OS's own words."""
    if facts.system == "Windows":
        return (
            "plug in the charger: on battery the discrete GPU may be disabled (vendor power modes such as Eco or "
            "battery saver switch it off); in Settings > System > Display > Graphics add "
            f"{Path(sys.executable).name} ({sys.executable}) and set it to High performance; in the NVIDIA Control "
            "Panel, Manage 3D settings > Preferred graphics processor > High-performance NVIDIA processor; "
            "then run the doctor again"
        )
    if facts.prime and facts.prime.startswith("intel"):
        return (
            "the PRIME profile 'intel' unloads the NVIDIA driver: sudo prime-select on-demand (or nvidia), then "
            "reboot. __NV_PRIME_RENDER_OFFLOAD=1 only moves rendering to the NVIDIA GPU; CUDA does not need it"
        )
    return (
        "load the NVIDIA driver (lsmod | grep nvidia; nvidia-smi must list the GPU)"
        + ("; with nvidia-prime: sudo prime-select on-demand and reboot" if facts.prime else "")
        + "; plug in the charger if firmware powers the discrete GPU off on battery"
    )


def _mps_check(facts: Facts) -> Check:
    version = f"macOS {facts.os_version or '?'} on {facts.machine or '?'}"
    evidence = f"{version}; torch.backends.mps.is_available() = {facts.mps}, is_built() = {facts.mps_built}"
    if facts.mps:
        return Check("Apple MPS", "PASS", evidence + ": train with device=mps (device=auto picks it)")
    if not facts.mps_built:
        fix = "this torch build has no MPS: pip install --force-reinstall torch (the macOS arm64 wheels include it)"
    elif _version(facts.os_version) < (12, 3):
        fix = "MPS needs macOS 12.3 or later: update macOS, or train with device=cpu"
    else:
        fix = "MPS needs a Metal GPU (Apple silicon, or AMD on an Intel Mac): train with device=cpu"
    return Check("Apple MPS", "WARN", evidence, fix)


def _monitoring_checks(facts: Facts, nvidia_seen: bool) -> list[Check]:
    if not nvidia_seen:
        return [Check("GPU monitoring", "INFO", "no NVIDIA GPU: runs record CPU and RAM utilisation only")]
    nvml = Check(
        "GPU monitoring (NVML)",
        "PASS" if not facts.nvml_error else "WARN",
        "nvidia-ml-py reads the GPU in-process" if not facts.nvml_error else facts.nvml_error,
        "" if not facts.nvml_error else "pip install nvidia-ml-py (and a working driver); or monitor=gputil",
    )
    usable = not facts.gputil_error and facts.nvidia_smi and facts.nvidia_smi_on_path
    if usable:
        evidence, fix = "GPUtil imports and nvidia-smi is on PATH", ""
    elif facts.gputil_error:
        evidence, fix = facts.gputil_error, "pip install setuptools (GPUtil needs distutils), or use monitor=nvml"
    elif facts.nvidia_smi:  # found where the Windows driver puts it; GPUtil runs it by name
        evidence = f"nvidia-smi is at {facts.nvidia_smi}, which is not on PATH"
        fix = f"add {Path(facts.nvidia_smi).parent} to PATH, or use monitor=nvml"
    else:
        evidence, fix = (
            "nvidia-smi is not on PATH",
            "install the NVIDIA driver (it brings nvidia-smi), or use monitor=nvml",
        )
    gputil = Check("GPU monitoring (GPUtil)", "PASS" if usable else "WARN", evidence, fix)
    return [nvml, gputil]


# bfloat16 below this fraction of float32's speed makes amp=true on the CPU a slowdown
CPU_BF16_SLOW = 0.9


def _cpu_bf16_check(facts: Facts) -> Check:
    known = {True: "yes", False: "no", None: "unknown"}
    flags = f"avx512_bf16: {known[facts.cpu_avx512_bf16]}, AMX: {known[facts.cpu_amx]}"
    matmul, conv = facts.cpu_bf16_matmul_speed, facts.cpu_bf16_conv_speed
    if matmul is None or conv is None:
        return Check("CPU bfloat16", "INFO", f"speed not measured (gather_speed did not run); {flags}")
    slow = min(matmul, conv) < CPU_BF16_SLOW
    return Check(
        "CPU bfloat16",
        "WARN" if slow else "INFO",
        f"bfloat16 runs at {matmul:.2f}x float32 for a 1024x1024 matmul and {conv:.2f}x for a 3x3 convolution "
        f"({flags})",
        "amp=true will be slower than float32 on this CPU: train with amp=false here, or on a GPU" if slow else "",
    )


def _loading_check(facts: Facts) -> Check:
    if facts.shm_mb is not None:
        shm = f"/dev/shm {facts.shm_mb} MiB"
    elif facts.system in ("Windows", "Darwin"):
        os_name = "macOS" if facts.system == "Darwin" else facts.system
        shm = f"no /dev/shm on {os_name} (workers pass batches through the OS's shared memory: nothing to size)"
    else:
        shm = "no /dev/shm"
    small = facts.shm_mb is not None and facts.shm_mb < 1024
    return Check(
        "data loading",
        "WARN" if small else "INFO",
        f"{facts.cpus} CPUs (loader.num_workers up to {max(facts.cpus - 1, 1)} is sensible); {shm}; "
        f"start method {facts.start_method}",
        "worker processes pass batches through /dev/shm: give it >= 1 GiB (docker run --shm-size=2g) "
        "or keep loader.num_workers=0 / loader.resident=true"
        if small
        else "",
    )


def render(found: list[Check]) -> str:
    width = max(len(c.name) for c in found)
    lines = []
    for c in found:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.evidence}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    failed = sum(c.status == "FAIL" for c in found)
    lines.append(f"\n{failed} check(s) failed" if failed else "\nno check failed")
    return "\n".join(lines)


def report(facts: Facts | None = None, *, smoke: bool = True) -> dict[str, Any]:
    """The doctor's findings as one JSON-able document (also attached to runs as environment.json)."""
    facts = facts or gather()
    if smoke and facts.cpu_bf16_matmul_speed is None:
        gather_speed(facts)  # about a second; the report attached to runs (smoke=False) skips it
    return {"facts": asdict(facts), "checks": [asdict(c) for c in checks(facts, smoke=smoke)]}


def main_finding(facts: Facts | None = None) -> str:
    """The first failed check as one sentence with its fix (for errors raised elsewhere), or ''."""
    failed = [c for c in checks(facts or gather(), smoke=False) if c.status == "FAIL"]
    if not failed:
        return ""
    first = failed[0]
    return f"{first.name}: {first.evidence}" + (f" -> {first.fix}" if first.fix else "")


@command("python -m pipeline.doctor")
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m pipeline.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the checks and facts as JSON")
    args = parser.parse_args(argv)
    facts = gather_speed(gather())
    found = checks(facts)
    if args.json:
        print(json.dumps({"facts": asdict(facts), "checks": [asdict(c) for c in found]}, indent=2))
    else:
        print(render(found))
    return 1 if any(c.status == "FAIL" for c in found) else 0
