"""Checkpoints: written atomically, found again by ``resume=latest``, a path or an MLflow run id.

A checkpoint holds everything needed to continue as if nothing happened: model, optimizer and
GradScaler state, torch's RNG states, the data order's generator state at the start of the
epoch, the epoch and step counters, the micro-batch size and the MLflow run id. It is written
to a temporary file in the same folder and renamed over ``last.pt``: a reader sees the previous
checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import PipelineError

LAST = "last.pt"


class CheckpointError(PipelineError):
    """``resume=...`` names no usable checkpoint."""


@dataclass(frozen=True)
class Position:
    """Where training stands: ``epoch`` (1-based) is the one in progress, ``batch`` batches of it done."""

    epoch: int
    batch: int
    step: int  # global optimizer steps done


def save(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)  # our own files: RNG states are numpy/bytes


def find(resume: str, *, folder: Path) -> Path:
    """The checkpoint ``resume`` names: ``latest`` (newest under ``folder``), a file path, or a run id.

    Raises:
        CheckpointError: nothing matches, with where it looked.
    """
    if resume == "latest":
        candidates = sorted(folder.glob(f"*/{LAST}"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise CheckpointError(f"resume=latest: no checkpoint under {folder}/*/{LAST} (checkpoint.dir={folder})")
        return candidates[-1]
    as_path = Path(resume).expanduser()
    if as_path.is_file():
        return as_path
    by_run = folder / resume / LAST
    if by_run.is_file():
        return by_run
    raise CheckpointError(f"resume={resume}: neither a checkpoint file nor a run id with {folder}/{resume}/{LAST}")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Writes a run's checkpoints to ``folder/last.pt`` at the positions the loop reports.

    ``order`` is the data-order generator: its state at the start of the epoch in progress goes
    into every mid-epoch checkpoint, so a resumed run shuffles that epoch the same way and skips
    the batches already done.
    """

    def __init__(
        self, *, folder: Path, every_n_steps: int, enabled: bool, order: torch.Generator, contents: Any
    ) -> None:
        self.path = folder / LAST
        self.every_n_steps, self.enabled, self.order = every_n_steps, enabled, order
        self.contents = contents  # () -> dict: model, optimizer, scaler, micro-batch, run id, config
        self._epoch_order = order.get_state()

    def epoch_started(self) -> None:
        self._epoch_order = self.order.get_state()

    def step_done(self, position: Position) -> None:
        if self.every_n_steps and position.step % self.every_n_steps == 0:
            self.write(position)

    def write(self, position: Position) -> Path | None:
        if not self.enabled:
            return None
        order = self.order.get_state() if position.batch == 0 else self._epoch_order
        return save(self.path, {**self.contents(), "position": position, "order": order, "rng": rng_state()})
