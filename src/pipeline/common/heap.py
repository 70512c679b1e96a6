"""Python's cyclic garbage collector in a short-lived command that builds many objects and keeps them.

``python -m pipeline.compare`` over 1,000 runs makes some 100,000 objects (SQLAlchemy rows, MLflow entities, the
records) and keeps them all until the table is written; MLflow's import alone leaves a million more. The cyclic
collector, which runs as the heap grows, finds nothing to free among them, and its full passes took about 40% of
the command's time (11 passes: 3.7 s of 9.2 s for a bare ``search_runs`` of the same runs). Reference counting,
which frees almost everything, is untouched; the memory stays the same (357 against 361 MB at its peak).

A run is the same at its start and close: importing torch, scikit-learn, MLflow and Matplotlib leaves some 700,000
objects, none of them garbage, and the collector walked them all ten times (1.4-3.3 s, against 0.65-1.0 s for a bare
script's 400,000, on 2 busy cores); the interpreter's last collections at exit walked them again (3.1-3.8 s). So a
run pauses the collector until its training starts and again after it (``collector_paused(freeze=False)``, no
object frozen: a process that runs many in turn, a sweep or the tests, leaves none of them uncollectable), and the
command freezes what is alive at its exit (``frozen_at_exit``). Training runs with the collector on, as it was
(``collector_running``): its steps make garbage cycles all along.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import NoReturn

_BEFORE_PAUSE: list[bool] = []  # whether the collector was on before each open collector_paused block, innermost last


@contextmanager
def collector_paused(*, freeze: bool = True) -> Iterator[None]:
    """No cyclic collection while the block runs; then, with ``freeze``, what is alive is frozen (``gc.freeze``: the
    interpreter's last collection at exit walks none of it), and the collector is back as it was."""
    enabled = gc.isenabled()
    _BEFORE_PAUSE.append(enabled)
    gc.disable()
    try:
        yield
    finally:
        _BEFORE_PAUSE.pop()
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


@contextmanager
def collector_running() -> Iterator[None]:
    """The collector as it was before the innermost pause, while the block runs (a run's training), after one full
    pass over what the paused part left: the one pass it still needs comes here, before the first epoch's clock
    starts, not inside that epoch. Outside a pause, or where the collector was off before it, nothing changes."""
    if gc.isenabled() or not _BEFORE_PAUSE or not _BEFORE_PAUSE[-1]:
        yield
        return
    gc.collect()
    gc.enable()
    try:
        yield
    finally:
        gc.disable()


def frozen_at_exit() -> None:
    """Freeze what is alive when the process exits, after the exit handlers registered since, so that the
    interpreter's last collections walk none of it (for a command's own process: the operating system frees it)."""
    atexit.unregister(gc.freeze)  # once, however often a command's main() runs in one process (the tests)
    atexit.register(gc.freeze)


def exit_without_teardown(code: int) -> NoReturn:
    """End the process with ``code`` once Python's exit handlers have run and its output is flushed, skipping the
    interpreter's teardown and C's exit handlers, where C++'s destructors run.

    For a rank of a distributed job, whose run has finished and is recorded: Gloo's threads once aborted a rank
    there ("terminate called without an active exception", SIGABRT) after a run that had succeeded, and torchrun
    then failed the whole job. The operating system frees what the teardown would have.
    """
    atexit._run_exitfuncs()  # MLflow's, logging's: everything registered to run before the process ends
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            stream.flush()
    os._exit(code)
