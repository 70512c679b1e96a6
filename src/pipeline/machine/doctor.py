"""Why is training not on the GPU? ``python -m pipeline.doctor [--json]`` checks and says what to do.

Each check is PASS, WARN, FAIL or INFO, with its evidence and, for WARN and FAIL, the fix as a
command or a setting. The exit status is 1 when any check FAILs. Facts come from torch, NVML
(nvidia-ml-py), ``nvidia-smi``, ``nvcc`` and the OS's own list of display adapters (Windows:
Win32_VideoController, macOS: system_profiler, Linux: ``/sys/class/drm``), read through
``pipeline.machine.platforms``; each source may be missing, and its absence is itself evidence. Nothing
here imports MLflow or Hydra, so it answers in seconds. The facts are gathered by ``facts``; the checks of
the GPU and its software stack are here, those of the machine around it in ``host_checks``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import torch

from pipeline.common.cli import Parser, command
from pipeline.common.messages import brief
from pipeline.machine.facts import (
    Check,
    Facts,
    gather,
    gather_speed,
    kernel_for,
    nvidia_adapters,
    version_tuple,
    wheel_for,
)
from pipeline.machine.host_checks import (
    cpu_bf16_check,
    cpu_peak_check,
    hybrid_check,
    loading_check,
    monitoring_checks,
    mps_check,
)
from pipeline.machine.platforms import (
    cudnn_text,
)
from pipeline.monitor.gpu import normalize_uuid


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
        out += [cpu_bf16_check(facts), cpu_peak_check(facts)]
    out += _order_checks(facts)
    out.append(hybrid_check(facts))
    if facts.system == "Darwin":
        out.append(mps_check(facts))
    out += monitoring_checks(facts, nvidia_seen)
    out.append(loading_check(facts))
    return out


def _nvidia_seen(facts: Facts) -> bool:
    """An NVIDIA GPU that a CUDA build of torch could use: listed by the driver, or by the OS outside macOS."""
    return bool(facts.nvidia_gpus) or (facts.system != "Darwin" and bool(nvidia_adapters(facts)))


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
            f"{facts.adapter_source} lists {'; '.join(nvidia_adapters(facts))}, but the NVIDIA driver lists no GPU "
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
    if facts.driver_cuda and version_tuple(facts.driver_cuda) < version_tuple(facts.torch_cuda):
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
    torch_major = version_tuple(facts.torch_cuda)[0]
    if version_tuple(toolkit.cuda)[0] != torch_major:
        evidence += (
            f", which need a Toolkit {torch_major}.x: with this one they fail with 'The detected CUDA version "
            f"({toolkit.cuda}) mismatches the version that was used to compile PyTorch ({facts.torch_cuda})'"
        )
    elif version_tuple(toolkit.cuda) != version_tuple(facts.torch_cuda):
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
        same = bool(bundled and theirs) and version_tuple(bundled)[0] == version_tuple(theirs)[0]
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
            brief(err),
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
