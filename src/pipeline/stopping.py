"""Clean stops: SIGTERM (a cluster's scheduler) and Ctrl-C end the run at a step boundary.

``StopRequests`` turns both signals into a flag the loop reads after each step (a plain
attribute read, no system call); the run then writes a checkpoint, is marked KILLED in MLflow,
and the process exits 143 (SIGTERM) or 130 (Ctrl-C), as shells and schedulers expect.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """Training stopped on request; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} at a step boundary")


class StopRequests:
    """Within ``with StopRequests() as stop:``, SIGTERM and SIGINT set ``stop.signum``; a second one
    while the first is being handled kills as usual (the default handler is put back)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # asked twice: stop waiting for the step boundary
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signum = signum
        log.warning(
            "%s received: stopping after the current step and writing a checkpoint", signal.Signals(signum).name
        )
