"""Checkpoints: written atomically, found again by ``resume=latest``, a path or an MLflow run id.

A checkpoint holds everything needed to continue as if nothing happened: model, optimizer and
GradScaler state, torch's RNG states, the epoch/batch/step position (the data order is a
function of the seed and the epoch, see ``data.loaders.EpochOrder``), the micro-batch size, the
config that made it and the MLflow run id. It is written to a temporary file in the same folder
and renamed over ``last.pt``: a reader sees the previous checkpoint or the new one, never half
of one. Beside it, ``state.json`` says in a few hundred bytes whose run it is, where it stands
and whether that run finished, so ``resume=latest`` can choose without loading every checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.config import RunConfig, TrackingConfig, flatten
from pipeline.errors import PipelineError
from pipeline.secrets import mask_text
from pipeline.stopping import Stopped
from pipeline.store import absolute

log = logging.getLogger(__name__)

LAST = "last.pt"
STATE = "state.json"
FORMAT = 2  # 2: the data order is (seed, epoch); format 1 carried a generator state instead

# Keys whose change makes a checkpoint unusable: the weights', the optimizer state's or the data's shape,
# or what "batch N of the epoch" means. Any other change is allowed, listed and tagged.
STRUCTURAL = ("model.", "data.name", "data.shape", "data.image_size", "data.channels", "data.num_classes")
STRUCTURAL_KEYS = ("trainer.optimizer", "loader.batch_size")
NOT_COMPARED = ("resume",)  # differs by definition


class CheckpointError(PipelineError):
    """``resume=...`` names no usable checkpoint."""


@dataclass(frozen=True)
class Position:
    """Where training stands: ``epoch`` (1-based) is the one in progress, ``batch`` batches of it done."""

    epoch: int
    batch: int
    step: int  # global optimizer steps done


def save(path: Path, payload: dict[str, Any] | bytes) -> Path:
    """Write ``payload`` (a dict for ``torch.save``, or bytes) atomically: temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(payload, bytes):
                f.write(payload)
            else:
                torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: Path) -> dict[str, Any]:
    """A checkpoint's payload.

    Raises:
        CheckpointError: written by an older pipeline whose data order cannot be reproduced.
    """
    payload = torch.load(path, map_location="cpu", weights_only=False)  # our own files: RNG states are bytes
    if payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} was written by an older pipeline (checkpoint format {payload.get('format', 1)}, this one reads "
            f"{FORMAT}): its data order cannot be reproduced; start a new run"
        )
    return payload


def read_state(folder: Path) -> dict[str, Any] | None:
    """A checkpoint folder's ``state.json``, or None when it is missing or unreadable."""
    try:
        return json.loads((folder / STATE).read_text())
    except (OSError, ValueError):
        return None


def find(resume: str, *, folder: Path, experiment: str, store: str) -> Path:
    """The checkpoint ``resume`` names: ``latest``, a file path, or a run id (a folder under ``folder``).

    ``latest`` is the newest checkpoint of a run that did not finish, in this ``experiment`` and
    tracking ``store``, whose process is not still running; the choice is logged with its reason.

    Raises:
        CheckpointError: nothing matches, with where it looked and what it found instead.
    """
    if resume == "latest":
        return _latest(folder, experiment=experiment, store=store)
    as_path = Path(resume).expanduser()
    if as_path.is_file():
        return as_path
    by_run = folder / resume / LAST
    if by_run.is_file():
        return by_run
    raise CheckpointError(f"resume={resume}: neither a checkpoint file nor a run id with {folder}/{resume}/{LAST}")


def _latest(folder: Path, *, experiment: str, store: str) -> Path:
    states = []
    for path in folder.glob(f"*/{LAST}"):
        state = read_state(path.parent)
        if state is not None:
            states.append((path, state))
    ours = [(p, s) for p, s in states if s.get("experiment") == experiment and s.get("store") == store]
    unfinished = [(p, s) for p, s in ours if s.get("status") != "finished"]
    idle = [(p, s) for p, s in unfinished if not _process_alive(s)]
    if idle:
        path, state = max(idle, key=lambda item: item[1].get("written", 0.0))
        p = state["position"]
        log.warning(
            "resume=latest: continuing run %s (%s at epoch %d, batch %d, step %d, %s), the newest unfinished "
            "checkpoint of experiment '%s' under %s",
            state.get("run_id") or path.parent.name,
            state.get("status", "stopped"),
            p["epoch"],
            p["batch"],
            p["step"],
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.get("written", 0.0))),
            experiment,
            folder,
        )
        return path
    where = f"under {folder}/*/{LAST} for experiment '{experiment}' in this tracking store"
    if unfinished:
        busy = ", ".join(_describe(p, s) for p, s in unfinished)
        raise CheckpointError(f"resume=latest: every unfinished run {where} is still training ({busy})")
    if ours:
        listed = ", ".join(_describe(p, s) for p, s in sorted(ours, key=lambda i: -i[1].get("written", 0.0))[:5])
        raise CheckpointError(
            f"resume=latest: no unfinished run {where}; finished: {listed}. To train one of them further, "
            f"name it (resume=<run id>) and raise trainer.epochs or trainer.max_steps"
        )
    others = len(states) - len(ours)
    raise CheckpointError(
        f"resume=latest: no checkpoint {where} (checkpoint.dir={folder}"
        + (f"; {others} belong to other experiments or stores: name one with resume=<run id or path>" if others else "")
        + ")"
    )


def _describe(path: Path, state: Mapping[str, Any]) -> str:
    p = state.get("position", {})
    return f"{state.get('run_id') or path.parent.name} ({state.get('status')}, step {p.get('step')})"


def _process_alive(state: Mapping[str, Any]) -> bool:
    """Whether the process that wrote ``state`` is still running (same host, pid and start time)."""
    if state.get("status") != "running" or state.get("host") != socket.gethostname():
        return False
    import psutil

    try:
        return abs(psutil.Process(state["pid"]).create_time() - state["process_started"]) < 1.0
    except (psutil.Error, KeyError, TypeError):
        return False


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs between a checkpoint's config and this run's: ``{key: (saved, now)}``."""
    keys = (set(saved) | set(current)) - set(NOT_COMPARED)
    return {k: (saved.get(k), current.get(k)) for k in sorted(keys) if saved.get(k) != current.get(k)}


def check_resumable(changes: Mapping[str, tuple[Any, Any]]) -> None:
    """Refuse changes a checkpoint cannot survive.

    Raises:
        CheckpointError: naming every such key, with both values.
    """
    structural = {k: v for k, v in changes.items() if k.startswith(STRUCTURAL) or k in STRUCTURAL_KEYS}
    if structural:
        listed = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, a, b in _rows(structural))
        raise CheckpointError(
            f"cannot resume with a different model, data shape, optimizer or batch size ({listed}): "
            f"drop these overrides to continue the run, or start a new run without resume="
        )


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in _rows(changes))


def _rows(changes: Mapping[str, tuple[Any, Any]]) -> list[tuple[str, Any, Any]]:
    return [(k, a, b) for k, (a, b) in changes.items()]


def store_id(cfg: TrackingConfig) -> str:
    """The tracking store a run records into, as ``state.json`` keeps it (absolute, credentials masked)."""
    return mask_text(absolute(cfg.uri)) if cfg.enabled else "none"


def resume_point(cfg: RunConfig, recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint ``cfg.resume`` names, checked against this run's config, with ``changes`` added.

    Runs before any data is loaded or any MLflow run is opened, so a refusal changes nothing.

    Raises:
        CheckpointError: no such checkpoint; a change it cannot survive; or nothing left to train.
    """
    path = find(
        cfg.resume or "latest",
        folder=Path(cfg.checkpoint.dir),
        experiment=cfg.tracking.experiment,
        store=store_id(cfg.tracking),
    )
    payload = load(path)
    changes = config_changes(flatten(payload["config"]), flatten(recorded))
    check_resumable(changes)
    position, t = payload["position"], cfg.trainer
    if position.epoch > t.epochs or 0 < t.max_steps <= position.step:
        raise CheckpointError(
            f"resume={cfg.resume}: run {payload['run_id'] or payload['run_name']} has trained {position.step} steps "
            f"(epoch {position.epoch if position.batch else position.epoch - 1} done"
            f"{'' if not position.batch else ' in part'}); nothing to do with trainer.epochs={t.epochs} "
            f"trainer.max_steps={t.max_steps}: raise one of them to train further"
        )
    if changes:
        log.warning("resume: changed since the checkpoint: %s", describe_changes(changes))
    return {**payload, "changes": changes}


def payload(state: Any, **extra: Any) -> dict[str, Any]:
    """What a checkpoint holds of a ``loop.TrainState``, plus ``extra`` (run id, name, config)."""
    return {
        "model": _module(state.model).state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "scaler": state.scaler.state_dict(),
        "micro_batch": state.micro.micro_batch,
        **extra,
    }


def restore(state: Any, saved: Mapping[str, Any], device: torch.device) -> None:
    """Put a checkpoint's states back into a ``loop.TrainState``: weights, optimizer, scaler, micro-batch,
    step, RNG. The data order needs nothing: it is the epoch's (``data.loaders.EpochOrder``)."""
    _module(state.model).load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    if saved["scaler"] and state.scaler.is_enabled():  # a disabled GradScaler saves {} and loads nothing
        state.scaler.load_state_dict(saved["scaler"])
    state.micro.micro_batch = saved["micro_batch"]
    state.step = saved["position"].step
    set_rng_state(saved["rng"], device)


def _module(model: torch.nn.Module) -> torch.nn.Module:
    """The model behind ``torch.compile``'s wrapper: checkpoints load whether or not either side compiled."""
    return getattr(model, "_orig_mod", model)


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


class Checkpointer:
    """Writes a run's checkpoint to ``folder/last.pt`` and its ``state.json`` beside it.

    Args:
        folder: the run's own folder (``checkpoint.dir/<run id>``).
        enabled: false = ``write`` does nothing and returns None.
        contents: makes the payload: model, optimizer, scaler, micro-batch, run id, config.
        device: the training device (whose RNG state is saved).
        scope: what ``resume=latest`` matches on: the run id, name, experiment and tracking store.
    """

    def __init__(
        self,
        *,
        folder: Path,
        enabled: bool,
        contents: Callable[[], dict[str, Any]],
        device: torch.device,
        scope: Mapping[str, Any],
    ) -> None:
        self.path = folder / LAST
        self.enabled, self.contents, self.device = enabled, contents, device
        self.scope = dict(scope)
        self.last: Position | None = None

    def write(self, position: Position, *, status: str = "running") -> Path | None:
        """Save the run at ``position``; ``status`` (running, stopped, failed, finished) is for ``resume=latest``."""
        if not self.enabled:
            return None
        if position == self.last:  # a mid-epoch checkpoint was just written here: only the status changes
            self._write_state(position, status)
            return self.path
        save(self.path, {**self.contents(), "format": FORMAT, "position": position, "rng": rng_state(self.device)})
        self._write_state(position, status)
        self.last = position
        return self.path

    @classmethod
    def for_run(
        cls,
        cfg: RunConfig,
        *,
        run_id: str | None,
        run_name: str,
        state: Any,
        device: torch.device,
        config: Mapping[str, Any],
    ) -> Checkpointer:
        """The checkpointer of one run: ``checkpoint.dir/<run id>/`` (or ``<name>-<time>`` untracked), holding
        ``state`` (a ``loop.TrainState``) and ``config`` (the masked config, compared on resume)."""
        folder = Path(cfg.checkpoint.dir) / (run_id or f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}")
        return cls(
            folder=folder,
            enabled=cfg.checkpoint.enabled,
            contents=lambda: payload(state, run_id=run_id, run_name=run_name, config=config),
            device=device,
            scope={
                "run_id": run_id,
                "run_name": run_name,
                "experiment": cfg.tracking.experiment,
                "store": store_id(cfg.tracking),
            },
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        """An error that ends the run leaves its last checkpoint resumable, marked ``failed`` (not running)."""
        if err is not None and not isinstance(err, Stopped):
            self.mark("failed")

    def mark(self, status: str) -> None:
        """Change the status of the last checkpoint written (``finished`` at the end of a run)."""
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
