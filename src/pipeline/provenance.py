"""Where a run came from, and what it is called: versions, device, git commit, the overrides as typed.

These become MLflow tags, using MLflow's own system tag names where they exist so the UI's
Source, commit and description fields fill in. Reading them has no side effects: a cuDNN that
refuses the GPU is recorded as such (the doctor's report explains it), not raised.
"""

from __future__ import annotations

import getpass
import os
import platform
import re
import shlex
import socket
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipeline import __version__
from pipeline.config import RunConfig
from pipeline.devices import DeviceChoice, cudnn_version
from pipeline.precision import PrecisionPolicy


def run_tags(
    choice: DeviceChoice, policy: PrecisionPolicy, overrides: Sequence[str], backends: dict[str, str]
) -> dict[str, str]:
    """The tags every run carries."""
    tags = {
        **source_tags(),
        "pipeline.version": __version__,
        "overrides": shlex.join(overrides) if overrides else "(none)",
        "device.type": choice.type,
        "device.name": choice.name,
        "device.reason": choice.reason,
        "precision": policy.label,
        "tf32": backends["tf32"],
        "cudnn_benchmark": backends["cudnn_benchmark"],
        "python.version": platform.python_version(),
        "torch.version": torch.__version__,
        "torch.cuda": torch.version.cuda or "none (CPU-only build)",
        "torch.cudnn": _cudnn(),
        "platform": platform.platform(terse=True),
    }
    return tags


def source_tags() -> dict[str, str]:
    """Who started a run, from where, in which process and checkout: the tags a sweep's parent run shares."""
    return {
        "mlflow.source.name": "python -m pipeline",
        "mlflow.source.type": "LOCAL",
        "mlflow.user": _user(),
        **process_tags(),
        **git_tags(),
    }


def process_tags() -> dict[str, str]:
    """The process training the run, so a run it left RUNNING (SIGKILL) can be found: ``pipeline.stale``."""
    import psutil

    return {
        "process.host": socket.gethostname(),
        "process.pid": str(os.getpid()),
        "process.started": f"{psutil.Process().create_time():.2f}",
    }


def environment_tags(environment: dict[str, Any], device: torch.device) -> dict[str, str]:
    """The key facts of the doctor's report as tags: driver, its CUDA, cuDNN, the device's compute capability."""
    facts = environment["facts"]
    tags = {"driver.version": facts["driver_version"] or "none", "driver.cuda": facts["driver_cuda"] or "none"}
    if device.type == "cuda":
        gpu = next(g for g in facts["torch_gpus"] if g["index"] == (device.index or 0))
        tags["device.capability"] = "sm_{}{}".format(*gpu["capability"])
        tags["torch.cudnn"] = str(facts["cudnn"] or f"error: {facts['cudnn_error']}")
    return tags


# Swept keys whose value the derived name shows as it is: a sweep over them needs nothing added to the name.
NAMED_KEYS = frozenset(
    {"model", "model.name", "data", "data.name", "loader.batch_size", "loader.num_workers", "loader.resident", "amp"}
)
# Shown unless the value is auto, which the name shows resolved (device=auto and device=cpu can both say cpu).
NAMED_UNLESS_AUTO = frozenset({"device", "device.name", "precision", "precision.dtype"})
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", re.IGNORECASE)


def run_name(cfg: RunConfig, *, device_type: str, precision: str) -> str:
    """A readable name that differs wherever comparable runs differ: ``resnet50-cifar10-cuda-amp-bf16-bs128-w4``."""
    parts = [cfg.model.name, cfg.data.name, device_type]
    if precision != "fp32":
        parts.append(precision)
    parts.append(f"bs{cfg.loader.batch_size}")
    parts.append("resident" if cfg.loader.resident else f"w{cfg.loader.num_workers}")
    return "-".join(parts)


def sweep_run_name(name: str, swept: Mapping[str, str]) -> str:
    """``name`` plus the swept values it does not show, so that every job of a sweep has its own name.

    ``mlp-digits-cpu-bs32-w0`` with ``trainer.lr=0.01`` swept becomes ``mlp-digits-cpu-bs32-w0-lr0.01``; a swept
    ``loader.batch_size`` adds nothing (``bs32`` shows it); ``trainer.optimizer=adamw`` adds ``optimizer=adamw``;
    a long number is cut to 6 significant digits (``lr0.00298138``).

    Args:
        name: the derived name (``run_name``).
        swept: the swept keys (dotted, or a group's name) and this job's value of each, as typed.
    """
    leaves = [key.rsplit(".", 1)[-1] for key in swept]
    parts = [name]
    for key, value in swept.items():
        if key in NAMED_KEYS or (key in NAMED_UNLESS_AUTO and value != "auto"):
            continue
        leaf = key.rsplit(".", 1)[-1]
        label = leaf if leaves.count(leaf) == 1 else key  # trainer.lr and other.lr both swept: the full keys
        parts.append(f"{label}{_short(value)}" if NUMBER.fullmatch(value) else f"{label}={value}")
    return "-".join(parts)


def _short(number: str) -> str:
    """A number as typed, or to 6 significant digits when longer (Optuna's ``0.0029813770307052724``)."""
    return number if len(number) <= 8 else f"{float(number):.6g}"


def describe_loader(cfg: RunConfig) -> str:
    if cfg.loader.resident:
        return f"resident, batch {cfg.loader.batch_size}"
    return f"DataLoader, {cfg.loader.num_workers} worker(s), batch {cfg.loader.batch_size}"


def _cudnn() -> str:
    version, error = cudnn_version()
    if error:
        return f"error: {error}"[:500]
    return str(version) if version is not None else "none"


def git_tags(cwd: str | None = None) -> dict[str, str]:
    """The commit of the checkout the run was launched from, and whether it had local changes."""
    commit = _git(["rev-parse", "HEAD"], cwd)
    if commit is None:
        return {}
    tags = {
        "mlflow.source.git.commit": commit,
        "git.dirty": str(bool(_git(["status", "--porcelain"], cwd))).lower(),
    }
    branch = _git(["rev-parse", "--abbrev-ref", "HEAD"], cwd)
    if branch and branch != "HEAD":
        tags["mlflow.source.git.branch"] = branch
    return tags


def _git(args: list[str], cwd: str | None) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
