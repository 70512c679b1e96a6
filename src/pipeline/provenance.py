"""Where a run came from: versions, device, git commit, the overrides as typed.

These become MLflow tags, using MLflow's own system tag names where they exist so the UI's
Source, commit and description fields fill in.
"""

from __future__ import annotations

import getpass
import platform
import shlex
import subprocess
from collections.abc import Sequence

import torch

from pipeline import __version__
from pipeline.devices import DeviceChoice
from pipeline.precision import PrecisionPolicy


def run_tags(
    choice: DeviceChoice, policy: PrecisionPolicy, overrides: Sequence[str], backends: dict[str, str]
) -> dict[str, str]:
    """The tags every run carries."""
    tags = {
        "mlflow.source.name": "python -m pipeline",
        "mlflow.source.type": "LOCAL",
        "mlflow.user": _user(),
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
        "torch.cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "platform": platform.platform(terse=True),
    }
    tags.update(git_tags())
    return tags


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
