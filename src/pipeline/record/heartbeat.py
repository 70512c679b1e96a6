"""A RUNNING run's proof of life: the ``process.heartbeat`` tag, refreshed while its process lives.

A process killed by SIGKILL, the OOM killer or a power cut leaves its run RUNNING. Whether its process is gone
cannot be told from its host name and pid: two machines may share a host name (cloned VMs) and a container has
pids of its own. So every run the tracker opens beats: ``Heartbeat`` (a daemon thread the ``MlflowTracker`` starts
with its writer and stops before it records the run's end) sets the tag ``process.heartbeat`` to the time, in
seconds since the epoch, when the run opens and then every ``BEAT_EVERY_S`` seconds, whatever the training thread
is doing (a long evaluation, a checkpoint write). ``python -m pipeline.stale`` closes only runs whose heartbeat is
older than its threshold (10 minutes: several missed beats), from any machine.

A beat the store refuses (a server that is down, a locked SQLite file) is skipped without a word: the next one
comes a minute later, and a run whose store stays down for longer than ``stale``'s threshold looks stopped to it.
One beat costs one tag write (milliseconds). ``stop()`` returns once no beat is in flight and none can start (a
hung server: after at most ``STOP_WITHIN_S``), so none lands after the run's end. Clocks are compared
across machines: they must agree within minutes (NTP).

``identity_tags`` adds to ``process.host``/``pid``/``started`` what tells one machine's processes from another's:
the kernel's boot id (``/proc/sys/kernel/random/boot_id``, new at every boot, the same in every container of that
kernel) and the pid namespace (``/proc/self/ns/pid``). Only where both match this process's may ``stale`` look the
pid up, as extra evidence. On systems without them (macOS, Windows) the tags are absent and only heartbeats count.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.common.messages import brief

log = logging.getLogger(__name__)

TAG = "process.heartbeat"
BEAT_EVERY_S = 60.0  # at most one beat a minute: one tag write, and what "stale" allows for missed beats is 10x that
STOP_WITHIN_S = 30.0  # how long stop() waits for a beat in flight (MLflow's shortened retries take seconds)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
PID_NAMESPACE = Path("/proc/self/ns/pid")


def boot_id() -> str | None:
    """This kernel's boot id (a UUID, new at every boot); None where the system has none."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace, e.g. ``pid:[4026531836]``; None where the system has none."""
    try:
        return os.readlink(PID_NAMESPACE)
    except OSError:
        return None


def identity_tags() -> dict[str, str]:
    """``process.boot_id`` and ``process.pid_ns`` of this process, those the system has."""
    found = {"process.boot_id": boot_id(), "process.pid_ns": pid_namespace()}
    return {key: value for key, value in found.items() if value}


def same_pid_space(tags: dict[str, str]) -> bool:
    """Whether the run's process ran under this kernel boot and in this pid namespace: only then does its pid
    name a process this one can look up."""
    here = identity_tags()
    return len(here) == 2 and all(tags.get(key) == value for key, value in here.items())


def last_beat(tags: dict[str, str]) -> float | None:
    """The run's last heartbeat in seconds since the epoch; None when it has none (or an unreadable one)."""
    try:
        return float(tags[TAG])
    except (KeyError, ValueError):
        return None


class Heartbeat:
    """Sets ``process.heartbeat`` on one run now and every ``BEAT_EVERY_S`` seconds, from a daemon thread, until
    ``stop()``."""

    def __init__(self, client: Any, run_id: str, *, every_s: float | None = None) -> None:
        self.client, self.run_id = client, run_id
        self.every_s = BEAT_EVERY_S if every_s is None else every_s  # read when made: tests shorten it
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Beat now (on the new thread) and then every ``every_s`` seconds."""
        self._thread = threading.Thread(target=self._run, name="pipeline-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, within_s: float = STOP_WITHIN_S) -> None:
        """No beat starts after this returns; one in flight is waited for, up to ``within_s`` (a server past its
        deadline: not at all, and a beat that lands late sets a tag, nothing more)."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=within_s)

    def beat(self) -> str | None:
        """Write one beat; the value written, or None when the store refused it (skipped: the next one retries)."""
        value = f"{time.time():.3f}"
        try:
            self.client.set_tag(self.run_id, TAG, value)
        except Exception as err:  # the tracker's own writes warn about a failing store; a beat adds nothing to it
            log.debug("heartbeat of run %s skipped (%s)", self.run_id, brief(err))
            return None
        return value

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.beat()
            self._stopping.wait(self.every_s)
