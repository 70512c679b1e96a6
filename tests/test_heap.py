"""A short-lived command pauses the cyclic collector while it reads, and leaves it as it found it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from pipeline.common.heap import collector_paused


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # the frozen objects back to the collector: the rest of the suite runs as before
    gc.enable()


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
