"""Clean stops: SIGTERM (a cluster's scheduler), Ctrl-C and, on Windows, Ctrl-Break end the run at a step boundary.

``StopRequests`` turns these signals into a flag the loop reads after each step (a plain
attribute read, no system call); the run then writes a checkpoint, is marked KILLED in MLflow,
and the process exits 128 + the signal's number: 143 (SIGTERM) or 130 (Ctrl-C), as shells and
schedulers expect, 149 (Ctrl-Break). A second request during training stops at once, and the run
is still closed as KILLED.

Windows delivers only Ctrl-C (SIGINT) and Ctrl-Break (SIGBREAK) to a console program: Python
defines SIGTERM there, but nothing sends it (``taskkill /F`` ends the process outright, as SIGKILL
does), so a stop there is Ctrl-C or Ctrl-Break in the run's console.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType

from pipeline.common.errors import Interruption
from pipeline.common.signals import signal_name

log = logging.getLogger(__name__)

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGBREAK")  # SIGBREAK: Windows' Ctrl-Break, absent elsewhere


def stop_signals() -> tuple[int, ...]:
    """The stop signals this platform's ``signal`` module defines, read when called (not at import)."""
    return tuple(getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name))


class Stopped(Interruption):
    """Training stopped on request; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, *, at_once: bool = False, checkpoints: bool = True) -> None:
        self.signum, self.at_once, self.checkpoints = signum, at_once, checkpoints
        self.exit_code = 128 + signum
        self.command: str | None = None  # the command that continues the run, once a checkpoint of it exists
        how = "at a step boundary"
        if at_once:
            how = "at once (asked twice), mid-step" + (": the last checkpoint stays" if checkpoints else "")
        super().__init__(f"stopped by {signal_name(signum)} {how}")

    def advice(self, resume: str | None = None) -> str:
        """How to go on: the whole command that continues the run (its configuration comes back from its
        checkpoint), or why there is none (``checkpoint.enabled=false``, or no checkpoint written yet)."""
        if not self.checkpoints:
            return "no checkpoint was written (checkpoint.enabled=false): the run cannot be resumed"
        if resume is not None:
            return f"continue it with: python -m pipeline resume={resume}"
        if self.command is None:
            return "no checkpoint was written yet: nothing to resume"
        return f"continue it with: {self.command}"


class StopRequests:
    """Within ``with StopRequests() as stop:``, SIGTERM, SIGINT and SIGBREAK (where it exists) become requests.

    The first sets ``stop.signum``: the loop stops at the next step boundary and writes a checkpoint.
    A second one while training (inside ``stop.interruptible()``) stops at once: ``Stopped`` is raised
    where the program is, and the run is still closed as KILLED with its last checkpoint. Any other
    time (building, writing the checkpoint, closing the run) further requests are only acknowledged,
    so the run's closing is never cut short; SIGKILL remains the way to abandon it.

    Args:
        checkpoints: whether the run writes checkpoints (``checkpoint.enabled``), for what the warnings promise.
    """

    def __init__(self, *, checkpoints: bool = True) -> None:
        self.checkpoints = checkpoints
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._interruptible = False

    def requested(self) -> bool:
        return self.signum is not None

    def adopt(self, signum: int) -> None:
        """A stop another rank received (DDP): this process stops as if the signal had reached it too."""
        if self.signum is None and signum:
            self.signum = signum

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """The stretch (training) where a second request raises ``Stopped`` at once."""
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in stop_signals():
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal_name(signum)
        if self.signum is None:
            self.signum = signum
            then = "writing a checkpoint" if self.checkpoints else "no checkpoint (checkpoint.enabled=false)"
            log.warning("%s received: stopping after the current step, %s", name, then)
        elif self._interruptible:
            self._interruptible = False  # once: the closing that follows is not cut short
            log.warning("%s received again: stopping now, mid-step", name)
            raise Stopped(signum, at_once=True, checkpoints=self.checkpoints)
        else:
            log.warning("%s received: already stopping, the run is being closed (kill -9 abandons it)", name)


@contextlib.contextmanager
def workers_stopped_too(stop: StopRequests) -> Iterator[None]:
    """Within it, a loader fault while a stop request is pending is taken for the stop: a SIGTERM sent to the whole
    process group (SLURM's time limit, ``kill -- -PGID``) kills the workers too, and their deaths can surface
    anywhere in a step. The run ends KILLED, as stopped, but writes no checkpoint from a step that may be half done:
    the last checkpoint stands, and a resume replays from it."""
    # lazy: pipeline.data imports torch (~1.4 s); __main__ imports Stopped before it checks the config
    from pipeline.data.workers import LoaderError

    try:
        yield
    except LoaderError as err:
        if not stop.requested():
            raise
        log.warning(
            "the loader's workers ended with the %s sent to the whole process group; stopping without a new "
            "checkpoint (the last one stands)",
            signal_name(stop.signum or 0),
        )
        raise Stopped(stop.signum or 0, checkpoints=stop.checkpoints) from err
