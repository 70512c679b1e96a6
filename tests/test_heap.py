"""A short-lived command pauses the cyclic collector while it reads, and leaves it as it found it; a run pauses it
while it starts and closes, and trains with it on."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import pipeline.engine.run as run_module
import pipeline.engine.session as session_module
from helpers import freeze_the_heap
from pipeline.common.heap import collector_paused, collector_running
from pipeline.config import RunConfig
from pipeline.report import logbook
from pipeline.train import train


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # what a test froze back to the collector, then the session's heap frozen again, as conftest did
    gc.enable()
    freeze_the_heap()


def test_no_collection_runs_inside_and_the_collector_is_back_after() -> None:
    passes: list[int] = []
    gc.callbacks.append(lambda phase, info: passes.append(info["generation"]) if phase == "start" else None)
    try:
        with collector_paused():
            assert not gc.isenabled()
            cycles = []
            for _ in range(50_000):  # cycles enough to start many passes of an enabled collector
                a: list[object] = []
                a.append(a)
                cycles.append(a)
            assert passes == []
        assert gc.isenabled() and gc.get_freeze_count() > 50_000  # what was alive: frozen, walked by no pass
    finally:
        gc.callbacks.pop()


def test_an_error_inside_still_gives_the_collector_back_and_a_disabled_one_stays_off() -> None:
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def _full_passes() -> tuple[list[int], Callable[[str, dict[str, int]], None]]:
    """A list that collects the generation of every collector pass that starts, and the callback that fills it."""
    passes: list[int] = []

    def started(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            passes.append(2)

    return passes, started


def _collected(obj: object) -> bool:
    """Whether the collector walks `obj`: a frozen object sits in no generation `gc.get_objects` lists."""
    return any(o is obj for o in gc.get_objects())


def test_a_pause_without_freeze_leaves_every_object_to_the_collector() -> None:
    alive: list[object] = [[]]  # a container made before the pause and alive after it
    with collector_paused(freeze=False):
        assert not gc.isenabled()
    assert gc.isenabled() and _collected(alive)
    with collector_paused():  # the test can fail: the same object after a pause that freezes is the collector's no more
        pass
    assert not _collected(alive)


def test_frozen_objects_that_die_inside_a_pause_leave_it_without_a_freeze() -> None:
    # the freeze count is not a witness: a frozen object freed by its reference count leaves it at any time
    doomed: list[object] = [[]]
    gc.freeze()
    frozen = gc.get_freeze_count()
    with collector_paused(freeze=False):
        del doomed
    assert gc.get_freeze_count() < frozen


def test_running_inside_a_pause_makes_one_full_pass_first_then_runs_and_pauses_again() -> None:
    passes, started = _full_passes()
    with collector_paused(freeze=False):
        gc.callbacks.append(started)
        try:
            with collector_running():
                assert gc.isenabled() and passes == [2]  # the pass the pause saved, once, before the block
            assert not gc.isenabled()
        finally:
            gc.callbacks.remove(started)
    assert gc.isenabled()


def test_running_changes_nothing_outside_a_pause_or_where_the_collector_was_off() -> None:
    passes, started = _full_passes()
    gc.callbacks.append(started)
    try:
        with collector_running():
            assert gc.isenabled() and passes == []
        gc.disable()  # a caller's own choice: training does not turn the collector on behind its back
        with collector_paused(freeze=False), collector_running():
            assert not gc.isenabled() and passes == []
        assert not gc.isenabled()
    finally:
        gc.callbacks.remove(started)


def test_a_run_starts_and_closes_without_the_collector_and_trains_with_it(
    make_cfg: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    collector_on: dict[str, bool] = {}  # at the first call of each step of the run
    full_passes_before: dict[str, int] = {}
    passes, started = _full_passes()

    def spy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            collector_on.setdefault(name, gc.isenabled())
            full_passes_before.setdefault(name, len(passes))
            return original(*args, **kwargs)

        return call

    monkeypatch.setattr(session_module, "build", spy("build", session_module.build))
    monkeypatch.setattr(run_module, "train_epoch", spy("train_epoch", run_module.train_epoch))
    monkeypatch.setattr(logbook, "conclude", spy("conclude", logbook.conclude))
    frozen = gc.get_freeze_count()
    gc.callbacks.append(started)
    try:
        train(make_cfg(), echo=False)
    finally:
        gc.callbacks.remove(started)
    assert collector_on == {"build": False, "train_epoch": True, "conclude": False}
    assert (
        full_passes_before["build"] == 0 and full_passes_before["train_epoch"] == 1
    )  # start-up's one, then training's
    # as it was: nothing of this run frozen (frozen objects the run let go of leave the count: the tests freeze theirs)
    assert gc.isenabled() and gc.get_freeze_count() <= frozen


@pytest.mark.slow
def test_a_command_freezes_what_is_alive_once_its_exit_handlers_ran(tmp_path: Path) -> None:
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print(gc.get_freeze_count() > 0, flush=True))  # registered first: runs last\n"
        "from pipeline.common.heap import frozen_at_exit\n"
        "frozen_at_exit()\n"
        "frozen_at_exit()\n"
        "atexit.register(lambda: print(gc.get_freeze_count(), flush=True))  # registered after: runs before\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.split() == ["0", "True"]
