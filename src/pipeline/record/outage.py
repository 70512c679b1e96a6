"""A deadline on a tracking server that stopped answering, measured by a clock, not by retries.

A server SIGKILLed mid-run refuses connections; a hung one (or a busy machine) holds each request until
``MLFLOW_HTTP_REQUEST_TIMEOUT``. Each write pays MLflow's retries, and a run makes many writes (every epoch's
flush, tags, plots, the model, its end): a run ended 45 s after its server died on a quiet machine, 379 s on a
busy one. ``Outage`` starts its clock at the start of the first write that found the server down. From then on a
write on the training thread (``call``) runs only within ``DEADLINE_S`` of it; past that it fails at once with
``DeadlinePassed`` (a ``TimeoutError``: ``store.server_down`` reads it as a server that is down), and what it held
goes to the outbox as before. The tracker's background writer keeps trying (``gate=False``): a write that lands
ends the outage. ``pipeline.record.lifecycle`` bounds one request (``REQUEST_TIMEOUT_S``, MLflow's default is
120 s), so a write begun just before the deadline ends within ``CALL_BOUND_S``: the run pays at most
``DEADLINE_S + CALL_BOUND_S`` (58 s) plus the outbox write, however busy the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from pipeline.record.store import server_down

T = TypeVar("T")

DEADLINE_S = 25.0  # after the first write a down server failed, how long the training thread still tries it
REQUEST_TIMEOUT_S = 10  # MLFLOW_HTTP_REQUEST_TIMEOUT's default here: seconds without an answer that fail a request
HTTP_RETRIES = 2  # MLflow's retries of one request (its default: 7, about 4 minutes); backoff factor 1: 1 s and 2 s
CALL_BOUND_S = (HTTP_RETRIES + 1) * REQUEST_TIMEOUT_S + 3  # the longest one write can take, its pauses included


class DeadlinePassed(TimeoutError):
    """The server has not answered for longer than the deadline: this write is not tried."""


class Outage:
    """When the current outage began (None: the server answers) and whether its deadline has passed."""

    def __init__(self, *, deadline_s: float = DEADLINE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline_s, self.clock = deadline_s, clock
        self.since: float | None = None  # the start of the first write that found the server down

    def over(self) -> bool:
        """Whether the server has been down for longer than the deadline."""
        return self.since is not None and self.clock() - self.since >= self.deadline_s

    def left_s(self, default: float) -> float:
        """Seconds left before the deadline; ``default`` while no outage is known."""
        return default if self.since is None else max(0.0, self.since + self.deadline_s - self.clock())

    def call(self, send: Callable[[], T], *, gate: bool = True) -> T:
        """``send()``, timed: a failure that says the server is down starts the outage, an answer ends it.
        With ``gate``, past the deadline ``DeadlinePassed`` is raised without calling."""
        if gate and self.over():
            raise DeadlinePassed(f"the tracking server has not answered for over {self.deadline_s:.0f} s")
        started = self.clock()
        try:
            result = send()
        except Exception as err:
            if server_down(err) and self.since is None:
                self.since = started
            raise
        self.since = None
        return result
