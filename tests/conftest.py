"""Shared fixtures: every test runs in its own empty folder with its own MLflow store."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy
import torch
from mlflow.store.tracking import sqlalchemy_store

from helpers import TINY, StepClock, freeze_the_heap
from pipeline.common.uris import sqlite_path, sqlite_uri
from pipeline.config import RunConfig, load


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist (``make test``: two workers), each worker gets its share of the cores for torch's threads, and
    the processes it starts inherit it (``OMP_NUM_THREADS``, unless set already): two workers of one thread each on
    two cores, not two of two threads contending (an in-process training test took ~20% more wall time and CPU that
    way, spinning in OpenMP). A worker's tests see one thread count; one that sets its own gets it back
    (``_isolated``)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        share = str(max(1, (os.cpu_count() or 1) // int(workers)))
        torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", share)))


@pytest.fixture(scope="session")
def _cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the session (the measured CPU peak, ``pipeline.monitor.peaks``): measured once per
    test process, never written to the home folder of whoever runs the tests."""
    return tmp_path_factory.mktemp("cache")


def _no_fsync(connection: object, record: object) -> None:
    if not isinstance(connection, sqlite3.Connection):
        return
    # Without waiting: on a store another process holds locked, the pragma would wait SQLite's 5 s busy timeout
    # for every connection MLflow retries (the locked-store test took 150 s instead of 5); that connection keeps
    # its fsyncs instead.
    (waits_ms,) = connection.execute("PRAGMA busy_timeout").fetchone()
    connection.execute("PRAGMA busy_timeout=0")
    try:
        connection.execute("PRAGMA synchronous=OFF")
    except sqlite3.OperationalError:
        pass
    finally:
        connection.execute(f"PRAGMA busy_timeout={int(waits_ms)}")


@pytest.fixture(scope="session", autouse=True)
def _heap_frozen_after_the_imports() -> None:
    """What the imports made, frozen once (``freeze_the_heap``); the modules a run imports on its way are imported
    first, so their objects are frozen too."""
    import matplotlib.figure  # noqa: F401  (a run's plots)
    import mlflow.pyfunc
    import mlflow.pytorch  # noqa: F401
    import torch._dynamo  # noqa: F401  (the FLOP counter and the memory estimate's meta forward)

    freeze_the_heap()


@pytest.fixture(scope="session", autouse=True)
def _sqlite_without_fsync() -> Iterator[None]:
    """SQLite in this process writes without waiting for the disk (``PRAGMA synchronous=OFF``): a store a test
    throws away needs no durability through a power cut, and on a virtual disk each commit's fsync took tens of ms
    (a tracked 3-step run 2.5-2.9 s, 0.9-1.4 s without). Locking between processes, which the tests of concurrent
    writers check, is unchanged. Processes the tests start write as a user's run does."""
    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "connect", _no_fsync)
    yield
    sqlalchemy.event.remove(sqlalchemy.engine.Engine, "connect", _no_fsync)


MADE_BY_MLFLOW = sqlalchemy_store.SqlAlchemyStore


class StoreTemplate:
    """One empty SQLite store, made and migrated by MLflow once per test process, copied wherever a test opens a
    store that does not exist yet. MLflow's migrations take 2 to 6 s on 2 cores for every new store, and the suite
    opens hundreds; a copy takes a millisecond and holds the same tables, at the same schema version."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path: Path | None = None

    def copy_to(self, path: Path) -> None:
        if self.path is None:
            self.path = self.folder / "mlflow.db"
            uri = sqlite_uri(self.path)
            store = MADE_BY_MLFLOW(uri, str(self.folder / "mlruns"))
            store.engine.dispose()  # every connection closed: the file holds all, with no journal beside it
            MADE_BY_MLFLOW._engine_map.pop(uri, None)
        shutil.copyfile(self.path, path)


@pytest.fixture(scope="session")
def _store_template(tmp_path_factory: pytest.TempPathFactory) -> StoreTemplate:
    return StoreTemplate(tmp_path_factory.mktemp("store-template"))


@pytest.fixture(autouse=True)
def _stores_from_the_template(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, _store_template: StoreTemplate
) -> None:
    """Every new SQLite store this process opens starts as a copy of the template (``StoreTemplate``), its Default
    experiment's artifact folder set as MLflow sets it for that store. Tests marked ``migrates`` check the store's
    creation itself and get MLflow's own. Processes the tests start make their stores as a user's run does."""
    if request.node.get_closest_marker("migrates"):
        return

    class FromTemplate(MADE_BY_MLFLOW):
        def __init__(self, db_uri: str, default_artifact_root: str) -> None:
            path = sqlite_path(db_uri)
            # where MLflow itself would fail (no such folder, no write access), it is left to fail as it does
            copied = path is not None and not path.exists() and os.access(path.parent, os.W_OK)
            if copied:
                _store_template.copy_to(path)
            super().__init__(db_uri, default_artifact_root)
            if copied:
                with self.engine.begin() as connection:
                    connection.execute(
                        sqlalchemy.text("UPDATE experiments SET artifact_location = :at WHERE experiment_id = 0"),
                        {"at": str(self._get_artifact_location(0))},
                    )

    monkeypatch.setattr(sqlalchemy_store, "SqlAlchemyStore", FromTemplate)


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache_home: Path) -> Iterator[None]:
    """Run in tmp_path (mlflow.db, mlruns/, outputs/ land there) with no inherited tracking URI and a cache folder of
    the session's, and take back the logging handlers a test added (Hydra's entry point points some at a captured,
    later closed, stream), the ``HYDRA_FULL_ERROR=1`` that an in-process ``--debug`` sets (a later test in the
    same worker would get tracebacks instead of one-line errors) and torch's thread count."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(_cache_home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    threads = torch.get_num_threads()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    if torch.get_num_threads() != threads:  # the benchmarks set their own (--threads)
        torch.set_num_threads(threads)


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first (in their files' order), then the rest: with two workers (``make test``), the minutes-long
    subprocess and server tests start at once, side by side, and the many short tests fill in the end, so neither
    worker is left alone with a long test while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
