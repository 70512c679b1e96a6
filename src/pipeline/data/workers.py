"""Loader workers that die, stop or get a signal: how their faults are told apart, said and cleaned up.

``EpochLoader`` (``pipeline.data.loaders``) watches each ``next()`` with ``Watchdog`` and turns PyTorch's worker
errors into ``LoaderError``; ``worker_faults`` does the same wherever PyTorch's SIGCHLD handler raises them.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from torch.utils.data import DataLoader

from pipeline.common.errors import PipelineError
from pipeline.common.messages import brief

log = logging.getLogger(__name__)


class LoaderError(PipelineError):
    """A loader worker died or stopped answering: PyTorch's message, and what to do about it."""


WORKER_FAULTS = ("DataLoader worker", "DataLoader timed out")  # PyTorch's messages for dead and silent workers
WATCHDOG_GRACE_S = 1.0  # the watchdog fires this long after loader.timeout, so PyTorch's own timeout speaks first


def is_worker_fault(err: BaseException) -> bool:
    """Whether ``err`` is PyTorch's word for a loader worker that died or stopped answering."""
    return isinstance(err, RuntimeError) and any(fault in str(err) for fault in WORKER_FAULTS)


@contextlib.contextmanager
def worker_faults() -> Iterator[None]:
    """Within it (as a decorator too), a loader worker's death is a ``LoaderError`` wherever it surfaces.

    PyTorch's SIGCHLD handler raises a dead worker's ``RuntimeError`` in the main thread wherever it is when the
    worker dies (``optimizer.step``, the forward pass), not only inside the loader's ``next()``.
    """
    try:
        yield
    except RuntimeError as err:
        if not is_worker_fault(err):
            raise
        raise LoaderError(describe_fault(str(err), None)) from err


@contextlib.contextmanager
def deaths_expected_while(expected: Callable[[], bool]) -> Iterator[None]:
    """Within it, a loader worker's death that PyTorch's SIGCHLD handler notices while ``expected()`` is logged,
    not raised.

    A SIGTERM sent to the whole process group (SLURM's time limit, ``kill -- -PGID``) reaches the workers too: the
    training process stops at a step boundary and closes the run, but the workers die of the same signal a moment
    later, and PyTorch's handler raised their deaths wherever the main thread then was, closing the run included:
    the stop became an internal error. Outside a stop (``expected()`` false) a death raises as before.
    """
    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        yield  # Windows has no SIGCHLD (nor PyTorch's handler); signals reach the main thread only
        return
    from torch.utils.data._utils import signal_handling

    signal_handling._set_SIGCHLD_handler()  # PyTorch's, set once per process: installed now so that ours wraps it
    pytorch_handler = signal.getsignal(signal.SIGCHLD)

    def handler(signum: int, frame: Any) -> None:
        if not callable(pytorch_handler):
            return
        try:
            pytorch_handler(signum, frame)
        except RuntimeError as err:
            if not (is_worker_fault(err) and expected()):
                raise
            log.info("a loader worker ended with the stop: %s", " ".join(str(err).split()))

    signal.signal(signal.SIGCHLD, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGCHLD) is handler:
            signal.signal(signal.SIGCHLD, pytorch_handler)


def kill_workers(batches: Iterator[Any]) -> None:
    """Kill a failed iterator's worker processes: a stopped one (SIGSTOP) ignores the SIGTERM PyTorch sends at
    shutdown, and Python joins its children on the way out, so the process would wait until it is continued."""
    workers = [worker for worker in getattr(batches, "_workers", []) if worker.is_alive()]
    if not workers:
        return
    if getattr(batches, "_worker_pids_set", False):  # else PyTorch's SIGCHLD handler raises these deaths again
        from torch.utils.data._utils import signal_handling

        signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False  # type: ignore[attr-defined]
    _kill(workers)


def _kill(workers: Iterable[Any]) -> None:
    """SIGKILL the worker processes still alive (it ends a stopped one too), each waited for up to 5 s."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)


def describe_fault(message: str, timeout: float | None) -> str:
    first = " ".join(message.split())[:300]
    if "timed out" in first:
        fix = f"a worker took longer than loader.timeout={timeout or 0:g} s for one batch: a stuck or stopped worker"
    else:
        fix = "a worker process died (killed by the OOM killer or a signal, or crashed in native code)"
    return (
        f"{first} — {fix}. {_memory_hint()}, try fewer loader.num_workers, or loader.num_workers=0 to see the "
        f"error in the main process"
    )


def _memory_hint() -> str:
    """Where to look for the memory a worker ran out of: on Linux batches pass through /dev/shm, which containers
    keep small; Windows and macOS have no such folder."""
    if sys.platform.startswith("linux"):
        return "Check memory (dmesg, free) and /dev/shm"
    if sys.platform == "darwin":
        return "Check memory (Activity Monitor)"
    return "Check memory (Task Manager)"


class Watchdog:
    """Raises ``LoaderError`` in the main thread when one ``next()`` on the loader takes longer than ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.active = (
            seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        )
        self._previous: Any = None

    def __enter__(self) -> Watchdog:
        if self.active:
            self._previous = signal.signal(signal.SIGALRM, self._fire)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _fire(self, signum: int, frame: Any) -> None:
        raise LoaderError(
            f"no batch arrived within loader.timeout ({self.seconds - WATCHDOG_GRACE_S:g} s, plus "
            f"{WATCHDOG_GRACE_S:g} s grace): a loader worker is stuck or stopped (SIGSTOP, a debugger, a hung file "
            f"system). Try loader.num_workers=0 to find the cause"
        )


def leave_ctrl_c_to_the_trainer(worker_id: int) -> None:
    """A worker ignores SIGINT: Ctrl-C in a terminal reaches every process of the foreground group, and a worker
    killed by it failed the run (a ``LoaderError``) before the training process could stop it at a step boundary,
    with a checkpoint. SIGTERM keeps its default: PyTorch's last resort against a stuck worker is ``terminate()``
    (a SIGTERM sent to the whole group is met in ``pipeline.train`` instead)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class WatchedLoader(DataLoader):
    """A DataLoader whose workers, when it has any, are watched: a worker that dies or stops answering ends the
    epoch with a ``LoaderError`` rather than a traceback or a hang. ``loader.timeout`` bounds every wait for a batch,
    including the ones PyTorch's own timeout does not cover (receiving a batch's shared memory from a worker
    that was stopped, e.g. by SIGSTOP, after it announced the batch), through a SIGALRM watchdog
    in the main thread (two ``setitimer`` calls a batch, about a microsecond; Windows has no SIGALRM, so there
    PyTorch's timeout alone applies). Under spawn and forkserver the first batch also waits for the workers to
    start and import torch, seconds each: loader.timeout must cover that too.
    """

    _started: tuple[Any, ...] = ()  # the worker processes it started that may still run (``_remember``)
    _epoch: weakref.ref[Any] | None = None  # the last epoch's iterator of workers, while something holds it

    def close(self) -> None:
        """End the workers kept between epochs (``persistent_workers``) now, and any worker of an earlier epoch
        still there. Left to the garbage collector, the iterator's queues are closed before it asks its workers to
        stop, and each worker waits out PyTorch's 5 s shutdown timeout: 20 s at the next collection after a run with
        two workers per loader. A worker stopped (SIGSTOP) after its last batch outlives PyTorch's shutdown of its
        epoch (its SIGTERM waits for a SIGCONT), and Python's exit would join it for ever: it is killed here.

        An epoch ended by an error keeps its iterator alive in the error's traceback, its workers running and
        registered with PyTorch's SIGCHLD handler, which would raise their deaths (in place of that error) were they
        killed: that epoch is shut down as PyTorch does, which unregisters them first."""
        batches, self._iterator = self._iterator, None
        if batches is not None:
            cast(Any, batches)._shutdown_workers()  # only workers' iterators are kept: persistent_workers
        epoch, self._epoch = (self._epoch() if self._epoch is not None else None), None
        if epoch is not None:
            epoch._shutdown_workers()  # once: a no-op for an epoch that ended, or the persistent one just shut down
        started, self._started = self._started, ()
        _kill(started)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator watching DataLoader's iterator
        batches = super().__iter__()
        if self.num_workers == 0:
            return batches  # the main process loads: nothing to watch, nothing added per batch
        self._remember(batches._workers)  # type: ignore[attr-defined]
        self._epoch = weakref.ref(batches)
        return self._watched(batches)

    def _remember(self, workers: list[Any]) -> None:
        """Keep the worker processes this loader started for ``close``, less those that have ended (a new set each
        epoch without ``persistent_workers``; once with them)."""
        started = tuple(worker for worker in self._started if worker.exitcode is None)
        self._started = started + tuple(worker for worker in workers if worker not in started)

    def _watched(self, batches: Iterator[Any]) -> Iterator[Any]:
        watchdog = Watchdog(self.timeout + WATCHDOG_GRACE_S if self.timeout else 0.0)
        with watchdog:
            while True:
                try:
                    with watchdog.armed():
                        batch = next(batches)
                except StopIteration:
                    return
                except LoaderError:  # the watchdog's: a batch that never came
                    kill_workers(batches)
                    raise
                except RuntimeError as err:
                    if not is_worker_fault(err):
                        raise
                    kill_workers(batches)
                    raise LoaderError(describe_fault(str(err), self.timeout)) from err
                except (ConnectionError, EOFError) as err:
                    if "in DataLoader worker process" in str(err):  # the dataset's own error, re-raised from a worker
                        raise
                    # a worker that died while this process received a batch's shared memory from it: the socket
                    # passing the file descriptor is reset mid-receive, before PyTorch notices the death
                    kill_workers(batches)
                    lost = f"a loader worker's connection broke mid-batch ({brief(err)})"
                    raise LoaderError(describe_fault(lost, self.timeout)) from err
                yield batch
