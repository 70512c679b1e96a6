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
from pipeline.engine.building.devices import cpu_name
from pipeline.monitor import peaks

STAND_IN_PEAK_TFLOPS = 1.0  # what runs in the tests read MFU against, in every dtype: about 5x this test machine's


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
    """One cache folder for the session, never the home folder of whoever runs the tests. It holds a stand-in CPU
    peak (``STAND_IN_PEAK_TFLOPS``, ``pipeline.monitor.peaks``) for every thread count a test or the processes it
    starts may use: a measurement on a machine busy with the suite's other worker is refused, and a run's MFU would
    come and go with the load. The measurement itself is tested against caches of the tests' own
    (``test_cpu_peaks.py``)."""
    home = tmp_path_factory.mktemp("cache")
    at = peaks.torch_installed_at() + 1.0  # after torch's files were installed: valid, whatever the clock says
    figures = {dtype: peaks.Figure(STAND_IN_PEAK_TFLOPS, at) for dtype in peaks.CPU_DTYPES}
    stored = {peaks.machine_key(cpu_name(), threads=n): figures for n in range(1, (os.cpu_count() or 1) + 1)}
    peaks.write_cache(home / "pipeline" / "cpu_peaks.json", stored)
    return home


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
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine counts as quiet whatever other processes do: the suite's other worker shares its two CPUs, and a
    verdict asserted from a run would otherwise read "cannot tell" whenever that worker is busy."""
    import pipeline.monitor.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "BUSY_OTHERS_PCT", 101.0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    """The step timer's clock, faked for the test (``StepClock``)."""
    import pipeline.engine.hot.timing as timing_module

    fake = StepClock()
    monkeypatch.setattr(timing_module, "time", fake)
    return fake


SLOW_WEIGHT = 20  # a slow test against a quick one, roughly (~10 s, against under 0.5 s)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each worker's share of the tests starts with its share of the slow ones. ``--dist worksteal`` hands each worker
    an equal count of this order, one contiguous slice each, and an idle worker takes the tail of another's queue.
    So the test files are dealt out whole (their module-scoped servers and shared runs are set up once), heaviest
    first, to the lighter share, and quick tests move from the end of a share to even out the counts; the order is
    the shares one after the other, each its slow tests (subprocesses, servers), then its quick ones. Both workers
    start on slow tests side by side, and the short tests come last, where stealing evens the workers out in small
    pieces (a plain slow-first order gave the first slice every slow test: one worker ran them in turn, and the last
    was taken over whole)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def weight(tests: list[pytest.Item]) -> int:
        return sum(SLOW_WEIGHT if item.get_closest_marker("slow") else 1 for item in tests)

    dealt: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for tests in sorted(files.values(), key=weight, reverse=True):  # stable: equal weights keep the files' order
        min(dealt, key=weight).extend(tests)
    shares = [Share(tests) for tests in dealt]
    sizes = [len(items) // workers + (k < len(items) % workers) for k in range(workers)]
    sizes.reverse()  # xdist's split: len // workers to the first, the remainder to the last ones
    moved = [item for share, size in zip(shares, sizes, strict=True) for item in share.cut_to(size)]
    for share, size in zip(shares, sizes, strict=True):
        share.fill_to(size, moved)
    items[:] = [item for share in shares for item in (*share.slow, *share.quick)]


class Share:
    """One worker's first slice of the tests: its slow ones, then its quick ones."""

    def __init__(self, tests: list[pytest.Item]) -> None:
        self.slow = [item for item in tests if item.get_closest_marker("slow")]
        self.quick = [item for item in tests if not item.get_closest_marker("slow")]

    def cut_to(self, size: int) -> list[pytest.Item]:
        """The tests over ``size``, taken from the end (quick ones first)."""
        cut = []
        while len(self.slow) + len(self.quick) > size:
            cut.append((self.quick or self.slow).pop())
        return cut

    def fill_to(self, size: int, spare: list[pytest.Item]) -> None:
        while len(self.slow) + len(self.quick) < size:
            self.quick.append(spare.pop())
