"""Shared fixtures: every test runs in its own empty folder with its own MLflow store."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers import TINY, StepClock
from pipeline.config import RunConfig, load


@pytest.fixture(scope="session")
def _cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the session (the measured CPU peak, ``pipeline.monitor.peaks``): measured once per
    test process, never written to the home folder of whoever runs the tests."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache_home: Path) -> Iterator[None]:
    """Run in tmp_path (mlflow.db, mlruns/, outputs/ land there) with no inherited tracking URI and a cache folder of
    the session's, and take back the logging handlers a test added (Hydra's entry point points some at a captured,
    later closed, stream)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(_cache_home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def store_uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def make_cfg(store_uri: str) -> Callable[..., RunConfig]:
    """``make_cfg("model=resnet18", tiny=True)``: the validated config, tracking into tmp_path."""

    def make(*overrides: str, tiny: bool = True) -> RunConfig:
        base = ["device=cpu", f"tracking.uri={store_uri}", *(TINY if tiny else [])]
        return load([*base, *overrides])

    return make


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    """The step timer's clock, faked for the test (``StepClock``)."""
    import pipeline.engine.timing as timing_module

    fake = StepClock()
    monkeypatch.setattr(timing_module, "time", fake)
    return fake
