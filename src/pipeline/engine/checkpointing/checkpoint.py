"""Checkpoints on disk: written atomically, with a small ``state.json`` beside them, under a lock.

A checkpoint holds everything needed to continue as if nothing happened: model, optimizer, schedule and
GradScaler state, torch's RNG states, the epoch/batch/step position (the data order is a
function of the seed and the epoch, see ``pipeline.data.loaders.EpochOrder``), the micro-batch size, the
config that made it, the class names and the MLflow run id, all of them tensors and plain values, so that
``torch.load(path, weights_only=True)`` reads it anywhere, without this package. It is written to a temporary file
in the same folder and renamed over ``last.pt``: a reader sees the previous checkpoint or the new one, never half
of one. Beside it, ``state.json`` says in a few hundred bytes whose run it is, where it stands and whether that run
finished, so ``resume=latest`` can choose without loading every checkpoint; and ``run.lock`` is held by the process
training that run (the OS releases it when the process dies, even by SIGKILL), so two processes never train the
same run; it is refused on a filesystem whose locks only this machine sees (``pipeline.record.filesystems``: NFS
``nolock``, Lustre without ``-o flock``...), while the checkpoints themselves may be on any. Finding and checking a
checkpoint for ``resume=`` is ``pipeline.engine.checkpointing.resume``'s job.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import socket
import time
import uuid
import warnings
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.common.atomic import UnwritableFolder, write_atomic
from pipeline.common.errors import PipelineError
from pipeline.common.messages import brief
from pipeline.common.secrets import mask_text
from pipeline.common.uris import absolute
from pipeline.config import CheckpointConfig, TrackingConfig
from pipeline.engine.outputs import make_writable
from pipeline.engine.stopping import Stopped
from pipeline.parallel.overlap import unwrap
from pipeline.record.filesystems import check_lock_folder

LAST = "last.pt"
STATE = "state.json"
LOCK = "run.lock"
HOLDER = "run.lock.holder"  # who holds run.lock, written once it is taken (filelock truncates the lock file itself)
FORMAT = 3  # 3: plain values only, and the schedule; 2: the data order is (seed, epoch); 1: a generator state
WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")  # torch.save on a full disk


class CheckpointError(PipelineError):
    """A checkpoint cannot be written, read or resumed; the message names the file and what to do."""


@dataclass(frozen=True)
class Position:
    """Where training stands: ``epoch`` (1-based) is the one in progress, ``batch`` batches of it done."""

    epoch: int
    batch: int
    step: int  # global optimizer steps done


def save(path: Path, payload: dict[str, Any] | bytes) -> Path:
    """Write ``payload`` (a dict for ``torch.save``, or bytes) atomically (``pipeline.common.atomic``).

    Raises:
        CheckpointError: the folder cannot be written or the disk is full (the previous file stays whole).
    """

    def write(f: Any) -> None:
        if isinstance(payload, bytes):
            f.write(payload)
        else:
            torch.save(payload, f)

    try:
        return write_atomic(path, write)
    except UnwritableFolder as err:
        raise CheckpointError(f"cannot write checkpoints to {path.parent}: {err.strerror or err}") from err
    except (OSError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not any(s in str(err) for s in WRITE_FAILURES):
            raise  # not the file system: a bug to see in full
        raise CheckpointError(f"writing {path} failed: {_why(err, path.parent)}; the previous one is intact") from err


def _why(err: BaseException, folder: Path) -> str:
    if isinstance(err, OSError) and err.errno != errno.ENOSPC:
        return err.strerror or str(err)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return brief(err, limit=200)
    return f"the disk is full ({free / 1e6:,.0f} MB free in {folder}): free space or set checkpoint.dir elsewhere"


def load(path: Path) -> dict[str, Any]:
    """A checkpoint's payload.

    Raises:
        CheckpointError: not a readable checkpoint (truncated, another file) or one from an older pipeline.
    """
    try:
        # weights_only: tensors and plain values only (a crafted file's pickle could run any code); format 2 held
        # Position objects, allowed here so that such a file is refused below for its format, not as foreign
        with torch.serialization.safe_globals([Position]), warnings.catch_warnings():
            # a plain pickle (not torch.save's) draws torch's warning before the refusal below says it in one line
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        foreign = re.search(r"GLOBAL (\S+) was not an allowed global", str(err))
        if foreign is None:
            raise CheckpointError(
                f"{path} is not a readable checkpoint ({_first_sentence(err)}): {_UNREADABLE}"
            ) from err
        raise CheckpointError(
            f"{path} holds {foreign[1]}, which no checkpoint holds: refused without loading it (a crafted file could "
            f"run code); resume only from checkpoints this pipeline wrote, or start a new run"
        ) from None
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as err:
        raise CheckpointError(f"{path} is not a readable checkpoint ({_first_sentence(err)}): {_UNREADABLE}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        version = payload.get("format", 1) if isinstance(payload, dict) else "none"
        raise CheckpointError(
            f"{path} was written by an older pipeline or another program (checkpoint format {version}, this one "
            f"reads {FORMAT}): start a new run"
        )
    if isinstance(payload.get("position"), dict):  # saved as a plain dict: readable without this package
        payload["position"] = Position(**payload["position"])
    return payload


_UNREADABLE = (
    "it may be truncated (a copy cut short) or another file; resume from another checkpoint or start a new run"
)


def _first_sentence(err: BaseException) -> str:
    return brief(err, limit=len(str(err)), with_type=False).split(". ")[0][:200]  # torch's messages run long


def read_state(folder: Path) -> dict[str, Any] | None:
    """A checkpoint folder's ``state.json``, or None when it is missing or unreadable."""
    try:
        return json.loads((folder / STATE).read_text())
    except (OSError, ValueError):
        return None


def check_dir(cfg: CheckpointConfig) -> None:
    """Fail at start, not at the end of the first epoch, when checkpoints cannot be written to ``checkpoint.dir``.

    Raises:
        CheckpointError: the folder cannot be made or written (a file in the way, read-only, no space).
        NetworkFilesystem: the folder is on a filesystem whose locks stay on one machine
        (``pipeline.record.filesystems``).
    """
    if not cfg.enabled:
        return
    folder = Path(cfg.dir)
    check_lock_folder(folder.absolute(), setting=f"checkpoint.dir={cfg.dir}")  # run.lock is taken there
    try:
        make_writable(folder)
    except OSError as err:
        raise CheckpointError(
            f"checkpoint.dir={cfg.dir}: cannot write checkpoints there ({err.strerror or err}): choose a writable "
            f"folder, or checkpoint.enabled=false"
        ) from err


def store_id(cfg: TrackingConfig) -> str:
    """The tracking store a run records into, as ``state.json`` keeps it (absolute, credentials masked)."""
    return mask_text(absolute(cfg.uri)) if cfg.enabled else "none"


class RunLock:
    """The exclusive right to train the run whose checkpoints live in ``folder`` (``run.lock``, an OS file lock).

    Raises ``CheckpointError`` at ``acquire`` when another process (or another run in this one) holds it.
    """

    def __init__(self, folder: Path) -> None:
        from filelock import FileLock

        self.folder = folder
        self._lock = FileLock(str(folder / LOCK), timeout=0)

    def acquire(self) -> RunLock:
        from filelock import Timeout

        check_lock_folder(self.folder.absolute())  # NetworkFilesystem is no CheckpointError: free() lets it through
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        except Timeout:
            state = read_state(self.folder) or {}
            holder = self._holder()
            who = f" (pid {holder['pid']} on {holder['host']})" if holder else " (it is starting)"
            raise CheckpointError(
                f"run {state.get('run_id') or self.folder.name} is being trained by another process right now{who}: "
                f"wait for it to end, or stop it first"
            ) from None
        except OSError as err:
            raise CheckpointError(
                f"checkpoint.dir: cannot write to {self.folder} ({err.strerror or err}); choose a writable folder"
            ) from err
        try:
            holder = {"pid": os.getpid(), "host": socket.gethostname()}
            save(self.folder / HOLDER, json.dumps(holder).encode())
        except BaseException:
            self._lock.release()
            raise
        return self

    def _holder(self) -> dict[str, Any] | None:
        """The pid and host the holder wrote beside the lock; None in the moment before it has written them."""
        try:
            holder = json.loads((self.folder / HOLDER).read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) and {"pid", "host"} <= holder.keys() else None

    def free(self) -> bool:
        """Whether no one holds the lock now (probes by taking and releasing it)."""
        try:
            self.acquire()
        except CheckpointError:
            return False
        self.release()
        return True

    def release(self) -> None:
        if self._lock.is_locked:  # the holder file is ours while we hold the lock
            (self.folder / HOLDER).unlink(missing_ok=True)
        self._lock.release()


def payload(state: Any, **extra: Any) -> dict[str, Any]:
    """What a checkpoint holds of a ``loop.TrainState``, plus ``extra`` (run id, name, config)."""
    return {
        "model": unwrap(state.model).state_dict(),  # behind torch.compile's and DDP's wrappers
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),  # {} for scheduler=none
        "scaler": state.scaler.state_dict(),
        "micro_batch": state.micro.micro_batch,
        "step_state": plain_state(state.context.state),  # a step hook's ctx.state ({}: none)
        **extra,
    }


PLAIN = (torch.Tensor, int, float, bool, str, type(None))


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """A step hook's ``ctx.state`` as a checkpoint keeps it: tensors and plain values, in tuples, lists and dicts (what
    ``torch.load(weights_only=True)`` reads back).

    Raises:
        CheckpointError: naming the entry that holds something else, and what a checkpoint can keep.
    """

    def check(value: Any, where: str) -> None:
        if isinstance(value, PLAIN):
            return
        if isinstance(value, dict) and all(isinstance(k, str | int) for k in value):
            for key, item in value.items():
                check(item, f"{where}[{key!r}]")
            return
        if type(value) in (tuple, list):
            for index, item in enumerate(value):
                check(item, f"{where}[{index}]")
            return
        raise CheckpointError(
            f"{where} holds a {type(value).__module__}.{type(value).__qualname__}: a checkpoint keeps tensors, "
            f"numbers, strings and tuples, lists and dicts of them (what torch.load(weights_only=True) reads); keep "
            f"the rest outside ctx.state, or set checkpoint.enabled=false"
        )

    for key, value in state.items():
        check(value, f"ctx.state[{key!r}]")
    return dict(state)


def rng_state(device: torch.device) -> dict[str, Any]:
    """torch's CPU generator and, on CUDA, the training device's own (no other GPU is touched)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def untracked_id(run_name: str) -> str:
    """The id of a run that has no MLflow run (``tracking=none``), its checkpoint folder's name: the name (cut to
    fit a file name), the time and a random part, so that two runs of one name started together differ."""
    return f"{run_name[:200]}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class Kept:
    """What a run's checkpoints keep besides its training state: the run's id and name, its ``config`` (masked; a
    resume compares it), the job's ``world_size`` (a position inside an epoch counts this job's per-rank batches),
    the data's ``classes``, the run's own ``overrides`` (masked; a resume restores them,
    ``pipeline.engine.checkpointing.continuation``) and the user's ``code`` files with their hashes (a resume compares
    them)."""

    run_id: str | None
    run_name: str
    config: Mapping[str, Any]
    world_size: int = 1
    classes: list[str] | None = None
    overrides: list[str] = field(default_factory=list)
    code: dict[str, str] = field(default_factory=dict)

    def contents(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_name": self.run_name,
            "config": self.config,
            "world_size": self.world_size,
            "classes": self.classes,
            "overrides": list(self.overrides),
            "code": dict(self.code),
        }


class Checkpointer:
    """Writes a run's checkpoint to ``folder/last.pt`` and its ``state.json`` beside it, holding its ``RunLock``.

    Args:
        folder: the run's own folder (``checkpoint.dir/<run id>``).
        enabled: false = ``write`` does nothing and returns None (and nothing is locked).
        contents: makes the payload: model, optimizer, scaler, micro-batch, run id, config.
        device: the training device (whose RNG state is saved).
        scope: what ``resume=latest`` matches on: the run id, name, experiment and tracking store.
        lock: the run's lock when the caller already holds it (resuming); else it is taken here.
        every: a mid-epoch checkpoint every this many steps (0 = none): ``due``.
    """

    def __init__(
        self,
        *,
        folder: Path,
        enabled: bool,
        contents: Callable[[], dict[str, Any]],
        device: torch.device,
        scope: Mapping[str, Any],
        lock: RunLock | None = None,
        every: int = 0,
    ) -> None:
        self.path = folder / LAST
        self.enabled, self.contents, self.device = enabled, contents, device
        self.scope, self.every = dict(scope), every
        self.last: Position | None = None
        self.finished = False  # mark("finished"): the run's training is over
        # the caller's lock (resuming) is the caller's to release; one taken here (fails at start, not later) is ours
        self._own_lock = RunLock(folder).acquire() if lock is None and enabled else None

    @classmethod
    def for_run(
        cls,
        settings: CheckpointConfig,
        tracking: TrackingConfig,
        kept: Kept,
        *,
        state: Any,
        device: torch.device,
        lock: RunLock | None = None,
        write: bool = True,
    ) -> Checkpointer:
        """The checkpointer of one run: ``checkpoint.dir/<run id>/`` (or ``<name>-<time>`` untracked), holding
        ``state`` (a ``loop.TrainState``) and what ``kept`` names, in ``tracking``'s store. ``write=False`` (DDP ranks
        other than 0) writes nothing."""
        return cls(
            folder=Path(settings.dir) / (kept.run_id or untracked_id(kept.run_name)),
            enabled=settings.enabled and write,
            contents=lambda: payload(state, **kept.contents()),
            device=device,
            scope={
                "run_id": kept.run_id,
                "run_name": kept.run_name,
                "experiment": tracking.experiment,
                "store": store_id(tracking),
            },
            lock=lock,
            every=settings.every_n_steps,
        )

    def due(self, step: int) -> bool:
        """Whether ``step`` ends with a mid-epoch checkpoint (``checkpoint.every_n_steps``; 0 = never)."""
        return bool(self.every) and step % self.every == 0

    def write(self, position: Position, *, status: str = "running") -> Path | None:
        """Save the run at ``position``; ``status`` (running, stopped, failed, finished) is for ``resume=latest``."""
        if not self.enabled:
            return None
        if position == self.last:  # a mid-epoch checkpoint was just written here: only the status changes
            self._write_state(position, status)
            return self.path
        contents = {**self.contents(), "format": FORMAT, "position": asdict(position), "rng": rng_state(self.device)}
        save(self.path, contents)
        self._write_state(position, status)
        self.last = position
        return self.path

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        """An error that ends the run leaves its last checkpoint resumable, marked ``failed`` (one after its training
        finished, in the record's end, leaves it ``finished``); the lock is freed."""
        try:
            if err is not None and not isinstance(err, Stopped) and not self.finished:
                self.mark("failed")
        finally:
            if self._own_lock is not None:
                self._own_lock.release()

    def mark(self, status: str) -> None:
        """Change the status of the last checkpoint written (``finished`` at the end of a run's training)."""
        self.finished = status == "finished"
        if self.enabled and self.last is not None:
            self._write_state(self.last, status)

    def _write_state(self, position: Position, status: str) -> None:
        import psutil

        state = {
            **self.scope,
            "status": status,
            "position": asdict(position),
            "written": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_started": psutil.Process().create_time(),
        }
        save(self.path.parent / STATE, json.dumps(state, indent=1).encode())
