"""The doctor's checks of the machine around the GPU: a hybrid laptop's display adapters (which GPU the display
and the application use), Apple's MPS, GPU monitoring (NVML, GPUtil), the CPU's bfloat16 speed, its measured
matmul peaks (what a CPU run's MFU is read against) and the data loading basics (CPUs, ``/dev/shm``, the start
method).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.config import DeviceConfig
from pipeline.engine.building.devices import resolve_device
from pipeline.machine.facts import Check, Facts, nvidia_adapters, version_tuple
from pipeline.machine.platforms import (
    vendor_of,
)
from pipeline.monitor.peaks import CPU_MATMUL_N, cache_file

# bfloat16 below this fraction of float32's speed makes amp=true on the CPU a slowdown
CPU_BF16_SLOW = 0.9


def hybrid_check(facts: Facts) -> Check:
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
    nvidia = nvidia_adapters(facts)
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


def mps_check(facts: Facts) -> Check:
    version = f"macOS {facts.os_version or '?'} on {facts.machine or '?'}"
    evidence = f"{version}; torch.backends.mps.is_available() = {facts.mps}, is_built() = {facts.mps_built}"
    if facts.mps:
        return Check("Apple MPS", "PASS", evidence + ": train with device=mps (device=auto picks it)")
    if not facts.mps_built:
        fix = "this torch build has no MPS: pip install --force-reinstall torch (the macOS arm64 wheels include it)"
    elif version_tuple(facts.os_version) < (12, 3):
        fix = "MPS needs macOS 12.3 or later: update macOS, or train with device=cpu"
    else:
        fix = "MPS needs a Metal GPU (Apple silicon, or AMD on an Intel Mac): train with device=cpu"
    return Check("Apple MPS", "WARN", evidence, fix)


def monitoring_checks(facts: Facts, nvidia_seen: bool) -> list[Check]:
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


def cpu_bf16_check(facts: Facts) -> Check:
    known = {True: "yes", False: "no", None: "unknown"}
    flags = f"avx512_bf16: {known[facts.cpu_avx512_bf16]}, AMX: {known[facts.cpu_amx]}"
    matmul, conv = facts.cpu_bf16_matmul_speed, facts.cpu_bf16_conv_speed
    if matmul is None or conv is None:
        return Check("CPU bfloat16", "INFO", f"speed not measured (gather_speed did not run); {flags}")
    slow = min(matmul, conv) < CPU_BF16_SLOW
    return Check(
        "CPU bfloat16",
        "WARN" if slow else "INFO",
        f"bfloat16 runs at {matmul:.2f}x float32 for a single 1024x1024 matmul and {conv:.2f}x for a 3x3 "
        f"convolution ({flags}): what the hardware does with one large op; a model's step also casts its weights "
        "every step, which costs most at small batches, so amp=true times the run's own model at start-up",
        "amp=true will be slower than float32 on this CPU: train with amp=false here, or on a GPU" if slow else "",
    )


def cpu_peak_check(facts: Facts) -> Check:
    """What MFU is read against on this CPU: its measured matmul peaks, cached for the runs; a WARN when the
    measurement just taken was refused because the machine was busy."""
    import torch

    refused = facts.cpu_peak_refused
    if not facts.cpu_peak_tflops:
        if not refused:
            return Check("CPU peak (MFU)", "INFO", "not measured (gather_speed did not run)")
        return Check(
            "CPU peak (MFU)",
            "WARN",
            f"not measured: {refused}. Nothing is cached, so CPU runs report no MFU (and say why)",
            "run python -m pipeline.doctor again when the machine is quiet",
        )
    figures = ", ".join(f"{dtype} {tflops:.3g} TFLOP/s" for dtype, tflops in facts.cpu_peak_tflops.items())
    how = (
        f"the fastest matmul of up to {CPU_MATMUL_N}x{CPU_MATMUL_N} at {torch.get_num_threads()} thread(s), the best "
        f"of the quiet measurements cached in {cache_file()}; a CPU run's MFU is its model FLOPs per second over this"
    )
    if refused:
        return Check(
            "CPU peak (MFU)",
            "WARN",
            f"{figures}: {how}. Measured again now but refused, not cached: {refused}",
            "run python -m pipeline.doctor again when the machine is quiet",
        )
    return Check("CPU peak (MFU)", "INFO", f"{figures}: {how}. Measured again now, on a quiet machine")


def loading_check(facts: Facts) -> Check:
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
        f"{facts.cpus} CPUs ({_workers_advice(facts.cpus)}); {shm}; start method {facts.start_method}",
        "worker processes pass batches through /dev/shm: give it >= 1 GiB (docker run --shm-size=2g) "
        "or keep loader.num_workers=0 / loader.resident=true"
        if small
        else "",
    )


def _workers_advice(cpus: int) -> str:
    """What the CPU count says about loader workers, in the words the README's sweep uses: a worker per CPU the
    training process leaves free, and a sweep (``loader.num_workers=0,2,4``) to measure what more would do."""
    free = max(cpus - 1, 1)
    return (
        f"{free} loader worker(s) leave the training process a CPU of its own; a sweep such as "
        f"loader.num_workers=0,{free},{2 * free} measures what more would do"
    )
