"""Where a run came from, and what it is called: versions, device, git commit, the overrides as typed.

These become MLflow tags, using MLflow's own system tag names where they exist so the UI's
Source, commit and description fields fill in. Reading them has no side effects: a cuDNN that
refuses the GPU is recorded as such (the doctor's report explains it), not raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import hashlib
import os
import platform
import re
import shlex
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import pipeline
from pipeline import __version__
from pipeline.common import usercode
from pipeline.common.targets import resolve, source_file
from pipeline.config import DATALOADER, RESIDENT, DataConfig, RunConfig, target_label
from pipeline.config.design import REPEAT_KEYS  # named last among the swept values
from pipeline.config.schema import MAX_TAG_KEY
from pipeline.engine.building.devices import DeviceChoice, cudnn_version
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.record.heartbeat import identity_tags


def run_tags(
    choice: DeviceChoice, policy: PrecisionPolicy, overrides: Sequence[str], backends: dict[str, str]
) -> dict[str, str]:
    """The tags every run carries."""
    tags = {
        **source_tags(),
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
    """Who started a run, from where, in which process, with which code: the tags a sweep's parent run shares. The
    pipeline's own code (``pipeline_tags``) and the launch folder's checkout (``git_tags``) are read apart: either
    may be outside git, and neither tells the other's state."""
    return {
        "mlflow.source.name": "python -m pipeline",
        "mlflow.source.type": "LOCAL",
        "mlflow.user": _user(),
        **process_tags(),
        **pipeline_tags(Path(pipeline.__file__).parent),
        **git_tags(),
    }


def pipeline_tags(package: Path) -> dict[str, str]:
    """The code of the pipeline that runs, wherever it is installed from: its version, a hash of its source files
    (``pipeline.source_sha256``) and, when ``package`` is tracked in a git checkout (an editable install of a clone),
    that checkout's commit and local changes (``pipeline.git.*``, as ``git_tags`` reads them)."""
    tags = {"pipeline.version": __version__, "pipeline.source_sha256": source_hash(package)}
    if _git(["ls-files", "--", "."], str(package)):  # a wheel in a venv inside a checkout is no file of that checkout
        checkout = git_tags(str(package), outputs=False)
        tags |= {f"pipeline.git.{k.rsplit('.', 1)[-1]}": v for k, v in checkout.items() if "branch" not in k}
    return tags


def source_hash(package: Path) -> str:
    """A hash of every ``.py`` file under ``package``, its path and bytes, in a stable order: the same code hashes
    alike in any folder, and an edit anywhere (a clone's local change, a patched install) hashes otherwise.
    About 150 files: a few ms."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py"), key=lambda p: p.relative_to(package).as_posix()):
        if "__pycache__" not in path.parts:
            digest.update(f"{path.relative_to(package).as_posix()}\0".encode())
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def process_tags() -> dict[str, str]:
    """The process training the run, so a run it left RUNNING (SIGKILL) can be found: ``pipeline.record.stale``. The
    boot id and pid namespace (``pipeline.record.heartbeat.identity_tags``) say whether its pid can be looked up."""
    import psutil

    return {
        "process.host": socket.gethostname(),
        "process.pid": str(os.getpid()),
        "process.started": f"{psutil.Process().create_time():.2f}",
        **identity_tags(),
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


# Where a swept key's value shows in the derived name (``run_name``): the part it moves to the front.
SHOWN_AS = {
    "model": "model",
    "model.name": "model",
    "model._target_": "model",
    "model.arch": "model",
    "data._target_": "data",
    "data": "data",
    "data.name": "data",
    "device": "device",  # unless auto, which the name shows resolved (device=auto and device=cpu both say cpu)
    "device.name": "device",
    "amp": "precision",
    "precision": "precision",
    "precision.dtype": "precision",
    "loader.batch_size": "batch",
    "loader.num_workers": "loader",
    "loader.resident": "loader",
}
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", re.IGNORECASE)
DERIVED = re.compile(
    r"^(?P<model>[^-]+)-(?P<data>[^-]+)-(?P<device>[^-]+)(?:-(?P<precision>amp-[^-]+))?-(?P<batch>bs\d+)"
    r"-(?P<loader>w\d+|resident)$"
)


def run_name(cfg: RunConfig, *, device_type: str, precision: str) -> str:
    """A readable name that differs wherever comparable runs differ: ``resnet50-cifar10-cuda-amp-bf16-bs128-w4``."""
    data = cfg.data.name if cfg.data._target_ is None else target_label(cfg.data._target_)
    parts = [cfg.model.label, data, device_type]
    if precision != "fp32":
        parts.append(precision)
    parts.append(f"bs{cfg.loader.batch_size}")
    parts.append("resident" if cfg.loader.resident else f"w{cfg.loader.num_workers}")
    return "-".join(parts)


def sweep_run_name(name: str, swept: Mapping[str, str]) -> str:
    """``name`` with what the sweep varies first, so that jobs differ in the first characters the UI shows.

    ``mlp-digits-cpu-bs32-w0`` with ``optimizer.lr=0.01`` and ``loader.batch_size=32`` swept becomes
    ``bs32-lr0.01-mlp-digits-cpu-w0``: each swept value in the order typed (the seed and other repeat keys last),
    as the derived name shows it (``bs32``, ``amp-bf16`` or ``fp32``) or as ``lr0.01`` / ``optimizer=adamw``, then
    the rest of the name; a long number is cut to 6 significant digits (``lr0.00298138``).

    Args:
        name: the derived name (``run_name``).
        swept: the swept keys (dotted, or a group's name) and this job's value of each, as typed.
    """
    shown = DERIVED.match(name)
    parts = shown.groupdict() if shown else {}
    parts["precision"] = parts.get("precision") or ("fp32" if shown else None)
    leaves = [key.rsplit(".", 1)[-1] for key in swept]
    front, moved = [], set()
    for key in sorted(swept, key=lambda k: k.lstrip("+~") in REPEAT_KEYS):  # stable: the order typed otherwise
        value, where = swept[key], SHOWN_AS.get(key.lstrip("+~"))
        if where and parts.get(where) and not (where == "device" and value == "auto"):
            if where not in moved:
                front.append(parts[where])
                moved.add(where)
            continue
        leaf = key.rsplit(".", 1)[-1]
        label = leaf if leaves.count(leaf) == 1 else key  # optimizer.lr and other.lr both swept: the full keys
        front.append(f"{label}{_short(value)}" if NUMBER.fullmatch(value) else f"{label}={value}")
    rest = [parts[p] for p in DERIVED.groupindex if p not in moved and parts.get(p) and parts[p] != "fp32"]
    return "-".join([*front, *(rest if shown else [name])])


def _short(number: str) -> str:
    """A number as typed, or to 6 significant digits when longer (Optuna's ``0.0029813770307052724``), with a short
    hash of the value as typed where those digits lose some of it: ``0.9`` and ``0.9000001`` never share a name."""
    if len(number) <= 8:
        return number
    short = f"{float(number):.6g}"
    return short if float(short) == float(number) else f"{short}~{_digest(number, 4)}"


def _digest(text: str, size: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:size]


# Overrides a name never carries: what names, places or watches a run (its bookkeeping), and Hydra's own
UNNAMED_PREFIXES = ("tracking.", "monitor.", "checkpoint.", "hydra.", "hydra/")
UNNAMED = frozenset({"trainer.progress", "resume", "fork", "tracking", "monitor", "checkpoint"})
# ... and how long it trains and how often it logs: a run's length is its own column in compare, not its name
UNNAMED |= {"trainer.epochs", "trainer.max_steps", "trainer.log_every_n_steps"}
NAME_TAIL = 40  # the most characters the typed overrides add to a name; longer, a hash of them
KEYWORD_TAIL = 100  # ... and the keywords of the user's targets (emsize64-nhead2), shown before any hash
KEYWORD_GROUPS = ("model.", "data.", "optimizer.", "scheduler.", "step.")  # whose other keys are a target's keywords
SAFE = re.compile(r"[\w.=+,~-]+")  # a tail that is also a safe folder name (the run's checkpoints)


def with_overrides(name: str, overrides: Sequence[str], swept: Sequence[str] = ()) -> str:
    """``name`` followed by the typed overrides it does not show: two runs whose configurations differ never
    share a name (``mlp-digits-cpu-bs64-w0-optimizer=adamw-lr1e-3``). The seed, bookkeeping, the run's length,
    the keys the name shows and a sweep's ``swept`` keys (already at its front) are left out. The keywords of the
    user's targets come first, each short (``lr5-emsize64``, a list's brackets dropped), as long as they fit
    ``KEYWORD_TAIL`` characters; the other overrides then, up to ``NAME_TAIL``; a part longer than its room, or one
    no folder may be named, becomes ``kw`` or ``cfg`` and a short hash of those overrides.

    Args:
        name: the derived (or sweep) name.
        overrides: the run's overrides as typed, secrets masked.
        swept: the keys a sweep varies (``SweepJob.values``), without ``+``/``~``.
    """
    keywords: list[tuple[str, str]] = []  # (override, its token)
    others: list[tuple[str, str]] = []
    tokens: list[str] = []
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        if not sep or key in swept or key in SHOWN_AS or key in REPEAT_KEYS or _unnamed(key):
            continue
        leaf = key.rsplit(".", 1)[-1]
        shown = value.strip("[]()").replace(" ", "")
        token = f"{leaf}{_short(value)}" if NUMBER.fullmatch(value) else f"{leaf}={shown}"
        (keywords if _keyword(key) else others).append((override, token))
        tokens.append(token)
    parts = [_tail(keywords, KEYWORD_TAIL, "kw"), _tail(others, NAME_TAIL, "cfg")]
    if parts == ["-".join(t for _, t in keywords), "-".join(t for _, t in others)]:  # nothing hashed: as typed
        parts = tokens
    return "-".join([name, *filter(None, parts)])


FIXED_KEYS = {f"data.{f.name}" for f in dataclasses.fields(DataConfig)} | {"scheduler.interval", "scheduler.monitor"}


def _keyword(key: str) -> bool:
    """A keyword of one of the user's targets (``model.emsize``), not a key of the pipeline's (``data.root``)."""
    return key.startswith(KEYWORD_GROUPS) and key not in FIXED_KEYS and not key.endswith("._target_")


def _tail(kept: list[tuple[str, str]], room: int, mark: str) -> str:
    """The tokens of ``kept`` joined, or ``mark`` and a hash of their overrides where they do not fit ``room``."""
    if not kept:
        return ""
    tail = "-".join(token for _, token in kept)
    if len(tail) > room or not SAFE.fullmatch(tail):
        tail = mark + _digest("\n".join(sorted(o for o, _ in kept)), 6)
    return tail


def _unnamed(key: str) -> bool:
    return key in UNNAMED or key.startswith(UNNAMED_PREFIXES)


def code_tags(prefix: str, obj: Any, *, target: str) -> dict[str, str]:
    """Where a user's object came from: ``<prefix>.class`` (module and class of ``obj``, when given),
    ``<prefix>.file`` (the file its ``_target_`` is defined in) and ``<prefix>.file_sha256`` (a hash of that file's
    bytes): the provenance of code that lives outside this package, beside the launch folder's own git commit
    (``git_tags``). Targets of this package or of installed libraries carry no file."""
    tags = {}
    if obj is not None:
        tags[f"{prefix}.class"] = f"{type(obj).__module__}.{type(obj).__qualname__}"
    try:
        made_by = resolve(target, key=prefix)
    except Exception:  # it resolved when the object was made; a module changed since is no reason to fail a run
        made_by = type(obj) if obj is not None else None
    path = source_file(made_by) if made_by is not None else None
    if path and not usercode.installed(path):
        tags[f"{prefix}.file"] = path
        with contextlib.suppress(OSError):  # a file gone since it was imported: the path and class still say a lot
            tags[f"{prefix}.file_sha256"] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return tags


@dataclass(frozen=True)
class UserCode:
    """The user's code a run imported (``pipeline.common.usercode.imported``: every module from the launch folder,
    ``PYTHONPATH`` or a target's folder, outside site-packages): a hash of each file and one over them all. The
    record tags both; a checkpoint keeps them, and a resume refuses to continue the same run on changed code."""

    files: dict[str, str]  # path (relative to the launch folder where it is inside) -> sha256 of its bytes (16 hex)

    @classmethod
    def imported(cls) -> UserCode:
        paths = sorted(set(usercode.imported().values()))
        return cls({_shown(path): usercode.file_hash(path) for path in paths})

    @property
    def digest(self) -> str:
        """One hash over every file's path and bytes' hash."""
        text = "".join(f"{path}\0{sha}\0" for path, sha in sorted(self.files.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def tags(self) -> dict[str, str]:
        """``code.sha256`` (the digest) and ``code.file.<path>`` (each file's hash); nothing without user code."""
        if not self.files:
            return {}
        return {"code.sha256": self.digest, **{f"code.file.{p}"[:MAX_TAG_KEY]: h for p, h in self.files.items()}}


def _shown(path: str) -> str:
    here = os.getcwd()
    return os.path.relpath(path, here) if path.startswith(here + os.sep) else path


def describe_loader(cfg: RunConfig) -> str:
    """The record's ``loader``: the built-in backends as they always were, another by its name."""
    if cfg.loader.backend_name not in (DATALOADER, RESIDENT):
        return f"{cfg.loader.backend_name}, batch {cfg.loader.batch_size}"
    if cfg.loader.resident:
        return f"resident, batch {cfg.loader.batch_size}"
    return f"DataLoader, {cfg.loader.num_workers} worker(s), batch {cfg.loader.batch_size}"


def _cudnn() -> str:
    version, error = cudnn_version()
    if error:
        return f"error: {error}"[:500]
    return str(version) if version is not None else "none"


# What the tools write into the launch folder (.gitignore and make clean list them too): a user's checkout that does
# not ignore them would otherwise mark every later run as having local changes.
OUTPUTS = ("mlruns", "mlflow.db", "mlflow.db.lock", "unsent_metrics", "checkpoints", "outputs", "multirun", "compare")


def git_tags(cwd: str | None = None, *, outputs: bool = True) -> dict[str, str]:
    """The commit of the checkout the run was launched from, whether it had local changes, and which: ``git.diff``
    is a hash of them (the diff against the commit and the untracked files' names), so that runs of one commit
    with different edits are never taken for repeats of each other (``pipeline.experiments.compare``).

    Ignored files are no changes (``git status``), nor are the tools' own untracked outputs in the launch folder
    (``OUTPUTS``; ``outputs=False`` counts them, for a checkout that is not the launch folder)."""
    commit = _git(["rev-parse", "HEAD"], cwd)
    if commit is None:
        return {}
    status = _git(["status", "--porcelain"], cwd) or ""
    if outputs:
        prefix = _git(["rev-parse", "--show-prefix"], cwd) or ""
        ours = {f"?? {prefix}{name}" for name in OUTPUTS} | {f"?? {prefix}{name}/" for name in OUTPUTS}
        status = "\n".join(line for line in status.splitlines() if line not in ours)
    tags = {"mlflow.source.git.commit": commit, "git.dirty": str(bool(status)).lower()}
    if status:
        diff = _git(["diff", "HEAD", "--binary"], cwd) or ""
        tags["git.diff"] = hashlib.sha256(f"{diff}\n{status}".encode()).hexdigest()[:12]
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
