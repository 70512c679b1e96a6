"""Why is training not on the GPU? ``python -m pipeline.doctor [--json]`` checks and says what to do.

Each check is PASS, WARN, FAIL or INFO, with its evidence and, for WARN and FAIL, the fix as a
command or a setting. The exit status is 1 when any check FAILs. Facts come from torch, NVML
(nvidia-ml-py), ``nvidia-smi`` and, on Linux, ``/sys/class/drm``; each source may be missing, and
its absence is itself evidence. Nothing here imports MLflow or Hydra, so it answers in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.config import DeviceConfig
from pipeline.devices import cudnn_version, resolve_device
from pipeline.monitor.gpu import normalize_uuid

PCI_VENDORS = {"0x10de": "NVIDIA", "0x1002": "AMD", "0x8086": "Intel"}
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
    nvidia_smi: str | None = None  # its path, when on PATH
    adapters: list[str] = field(default_factory=list)  # display adapters seen in /sys/class/drm
    mps: bool = False
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


def gather() -> Facts:
    """Read every source; none of them raising stops the others."""
    facts = Facts(torch_cuda=torch.version.cuda, cpus=os.cpu_count() or 1)
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
        facts.cudnn, facts.cudnn_error = cudnn_version()
        with contextlib.suppress(Exception):  # the GPU may be unusable: the compute check says so
            facts.bf16 = torch.cuda.is_bf16_supported()
    _nvml(facts)
    facts.nvidia_smi = shutil.which("nvidia-smi")
    if facts.nvidia_smi and not facts.nvidia_gpus:
        _smi(facts)
    facts.adapters = _drm_adapters()
    facts.mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    try:
        import GPUtil  # noqa: F401  (1.4.0 imports distutils)
    except Exception as err:  # ModuleNotFoundError: distutils on Python 3.12+, or GPUtil missing
        facts.gputil_error = f"{type(err).__name__}: {err}"
    facts.env = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER") if k in os.environ}
    if Path("/dev/shm").is_dir():
        facts.shm_mb = shutil.disk_usage("/dev/shm").total // 2**20
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
    facts.cpu_avx512_bf16, facts.cpu_amx = _cpu_bf16_flags()
    start = time.perf_counter()
    rng = torch.Generator().manual_seed(0)  # leaves the global stream alone when called in-process
    a, b = torch.randn(1024, 1024, generator=rng), torch.randn(1024, 1024, generator=rng)
    x, w = torch.randn(8, 64, 56, 56, generator=rng), torch.randn(64, 64, 3, 3, generator=rng)
    facts.cpu_bf16_matmul_speed = _bf16_speed(torch.matmul, (a, b), until=start + 0.3)
    conv = torch.nn.functional.conv2d
    facts.cpu_bf16_conv_speed = _bf16_speed(lambda x, w: conv(x, w, padding=1), (x, w), until=start + 1.0)
    return facts


def _bf16_speed(op: Any, args: tuple[torch.Tensor, ...], *, until: float) -> float:
    """float32's time over bfloat16's for ``op(*args)``; inputs are cast beforehand, so only compute counts."""
    from pipeline.precision import measure  # the amp probe's timer: warm-up, median, deadline

    narrow = tuple(t.bfloat16() for t in args)
    now = time.perf_counter()
    fp32 = measure(lambda: op(*args), until=now + (until - now) / 4, repeats=5)  # bfloat16 may be 10x slower
    bf16 = measure(lambda: op(*narrow), until=until, repeats=5)
    return fp32.seconds / bf16.seconds


def _cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[bool | None, bool | None]:
    """(avx512_bf16, amx_bf16) from the CPU's flags; (None, None) without /proc/cpuinfo or its x86 flags."""
    try:
        text = cpuinfo.read_text()
    except OSError:  # macOS, Windows
        return None, None
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    if not match:  # Arm lists "Features" instead
        return None, None
    flags = set(match.group(1).split())
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


def _smi(facts: Facts) -> None:
    """nvidia-smi's own view, when NVML could not be read in-process."""
    try:
        out = subprocess.run([facts.nvidia_smi or "nvidia-smi"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as err:
        facts.nvml_error = (facts.nvml_error or "") + f"; nvidia-smi failed: {err}"
        return
    text = out.stdout + out.stderr
    if out.returncode != 0:
        facts.nvml_error = (facts.nvml_error or "") + f"; nvidia-smi: {' '.join(text.split())[:200]}"
        return
    if match := re.search(r"Driver Version:\s*([\d.]+)", text):
        facts.driver_version = match.group(1)
    if match := re.search(r"CUDA Version:\s*([\d.]+)", text):
        facts.driver_cuda = match.group(1)
    try:
        query = subprocess.run(
            [
                facts.nvidia_smi or "nvidia-smi",
                "--query-gpu=index,name,uuid,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        for line in query.stdout.strip().splitlines():
            index, name, uuid, memory = (part.strip() for part in line.split(","))
            facts.nvidia_gpus.append(NvidiaGpu(int(index), name, uuid, int(float(memory))))
    except (OSError, subprocess.SubprocessError, ValueError):
        pass


def _drm_adapters() -> list[str]:
    adapters = []
    for vendor_file in sorted(Path("/sys/class/drm").glob("card[0-9]*/device/vendor")):
        if "-" in vendor_file.parent.parent.name:
            continue  # connectors (card0-HDMI-A-1) repeat their card
        vendor = vendor_file.read_text().strip()
        adapters.append(f"{vendor_file.parent.parent.name}: {PCI_VENDORS.get(vendor, vendor)}")
    return adapters


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
    out: list[Check] = []
    nvidia_seen = bool(facts.nvidia_gpus) or any("NVIDIA" in a for a in facts.adapters)
    if not nvidia_seen:
        how = facts.nvml_error or "NVML lists no GPU"
        out.append(
            Check(
                "NVIDIA GPU",
                "INFO",
                f"no NVIDIA GPU found ({how}; nvidia-smi "
                f"{'at ' + facts.nvidia_smi if facts.nvidia_smi else 'not on PATH'}): training runs on "
                f"the CPU{' or Apple MPS' if facts.mps else ''}, and device=auto chooses that",
            )
        )
    else:
        names = ", ".join(f"{g.index}: {g.name} ({g.memory_mb} MiB)" for g in facts.nvidia_gpus) or "seen in /sys"
        out.append(
            Check(
                "NVIDIA GPU", "PASS", f"driver {facts.driver_version or '?'} (CUDA {facts.driver_cuda or '?'}); {names}"
            )
        )
    out += _build_checks(facts, nvidia_seen)
    out += _device_checks(facts, smoke=smoke)
    if smoke:
        out.append(_cpu_bf16_check(facts))
    out += _order_checks(facts)
    out.append(_hybrid_check(facts, nvidia_seen))
    if platform.system() == "Darwin":
        out.append(
            Check(
                "Apple MPS",
                "PASS" if facts.mps else "WARN",
                f"torch.backends.mps.is_available() = {facts.mps}",
                "" if facts.mps else "install a torch build for macOS 12.3+ on Apple silicon",
            )
        )
    out += _monitoring_checks(facts, nvidia_seen)
    out.append(_loading_check(facts))
    return out


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
                "install a torch build whose cuDNN supports this GPU (older GPUs need an older torch)",
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


def _hybrid_check(facts: Facts, nvidia_seen: bool) -> Check:
    choice = resolve_device(DeviceConfig("auto"))
    adapters = "; ".join(facts.adapters) or "none listed in /sys/class/drm"
    integrated = [a for a in facts.adapters if "AMD" in a or "Intel" in a]
    note = " AMD and Intel (integrated) GPUs are not CUDA devices: PyTorch cannot train on them." if integrated else ""
    return Check(
        "graphics adapters",
        "INFO",
        f"display adapters: {adapters}. device=auto picks {choice.device} ({choice.reason}).{note}",
    )


def _monitoring_checks(facts: Facts, nvidia_seen: bool) -> list[Check]:
    if not nvidia_seen:
        return [Check("GPU monitoring", "INFO", "no NVIDIA GPU: runs record CPU and RAM utilisation only")]
    nvml = Check(
        "GPU monitoring (NVML)",
        "PASS" if not facts.nvml_error else "WARN",
        "nvidia-ml-py reads the GPU in-process" if not facts.nvml_error else facts.nvml_error,
        "" if not facts.nvml_error else "pip install nvidia-ml-py (and a working driver); or monitor=gputil",
    )
    usable = not facts.gputil_error and facts.nvidia_smi
    gputil = Check(
        "GPU monitoring (GPUtil)",
        "PASS" if usable else "WARN",
        "GPUtil imports and nvidia-smi is on PATH" if usable else (facts.gputil_error or "nvidia-smi is not on PATH"),
        "" if usable else "pip install setuptools (GPUtil needs distutils), or use monitor=nvml",
    )
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
    shm = f"/dev/shm {facts.shm_mb} MiB" if facts.shm_mb is not None else "no /dev/shm"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the checks and facts as JSON")
    args = parser.parse_args(argv)
    facts = gather_speed(gather())
    found = checks(facts)
    if args.json:
        print(json.dumps({"facts": asdict(facts), "checks": [asdict(c) for c in found]}, indent=2))
    else:
        print(render(found))
    return 1 if any(c.status == "FAIL" for c in found) else 0


if __name__ == "__main__":
    sys.exit(main())
