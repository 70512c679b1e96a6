"""``trainer.memory_snapshot=on_oom``: what filled a CUDA device's memory when it ran out.

    python -m pipeline model=resnet50 loader.batch_size=1024 trainer.memory_snapshot=on_oom

From the run's start the CUDA caching allocator records its history (each allocation and free with its Python
stack, the last ``MAX_ENTRIES`` kept); at the run's first out-of-memory error, in training or in evaluation, the
out-of-memory fallback (``pipeline.engine.hot.memory.MicroBatcher.diagnose``) calls the snapshot while the failed step's
memory is still held, and the allocator's snapshot goes to the run as ``memory/snapshot.pickle``: drop it on
https://pytorch.org/memory_viz to see every live block, where it was allocated, and the history that led there.
Once per run; the fallback then recovers as it always does (or, with ``oom.enabled=false``, the run ends).

Recording costs host time at every allocation and free (a Python stack is captured), and memory for the history:
leave it off unless an out-of-memory error needs explaining. CUDA only (refused on cpu and mps at validation), and
only with tracking on: the snapshot is kept in the run's record. Under torchrun, rank 0's.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.common.messages import brief

if TYPE_CHECKING:
    from pipeline.record.lifecycle import Tracker

log = logging.getLogger("pipeline.engine.snapshot")  # the name its lines have always shown

MAX_ENTRIES = 100_000  # allocator events kept (older ones dropped): bounds the history's host memory
ARTIFACT = "memory/snapshot.pickle"


class OomSnapshot:
    """Records the allocator's history while the run records (``recording``); called at an out-of-memory error,
    keeps the allocator's snapshot in the run, once.

    Args:
        device: the training device (CUDA).
        record: ``torch.cuda.memory._record_memory_history`` (tests pass a fake).
        take: ``torch.cuda.memory._snapshot`` (tests pass a fake).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        record: Callable[..., None] | None = None,
        take: Callable[..., Any] | None = None,
    ) -> None:
        self.device = device
        self._record = record or torch.cuda.memory._record_memory_history
        self._take = take or torch.cuda.memory._snapshot
        self._tracker: Tracker | None = None
        self.kept = False

    @contextlib.contextmanager
    def recording(self, tracker: Tracker) -> Iterator[None]:
        """The allocator records its history while the block runs; a snapshot taken then goes to ``tracker``."""
        self._record(enabled="all", context="all", stacks="python", max_entries=MAX_ENTRIES, device=self.device)
        self._tracker = tracker
        try:
            yield
        finally:
            self._tracker = None
            self._record(enabled=None, device=self.device)  # stops recording, frees the history

    def __call__(self) -> None:
        """An out-of-memory error happened: keep the allocator's snapshot in the run, the first time."""
        if self.kept or self._tracker is None:
            return
        self.kept = True
        try:
            with tempfile.TemporaryDirectory(prefix="pipeline-memory-") as folder:
                path = Path(folder) / Path(ARTIFACT).name
                with path.open("wb") as file:
                    pickle.dump(self._take(self.device), file)
                self._tracker.log_file(path, str(Path(ARTIFACT).parent))
        except Exception as err:  # a diagnosis must never stand in the way of the recovery it explains
            log.warning("the allocator's snapshot was not kept (%s)", brief(err))
            return
        log.warning(
            "out of memory: the allocator's snapshot is %s in the run's artifacts; open it on "
            "https://pytorch.org/memory_viz",
            ARTIFACT,
        )


class NoSnapshot:
    """``trainer.memory_snapshot=off``: nothing recorded, nothing kept."""

    def recording(self, tracker: Tracker) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __call__(self) -> None:
        pass


NO_SNAPSHOT = NoSnapshot()


def make_snapshot(trainer: Any, device: torch.device) -> OomSnapshot | NoSnapshot:
    """The run's snapshot at an out-of-memory error (``trainer.memory_snapshot=on_oom``), or none."""
    return OomSnapshot(device) if trainer.memory_snapshot == "on_oom" else NO_SNAPSHOT
