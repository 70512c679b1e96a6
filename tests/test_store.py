"""The MLflow store under concurrency and failure."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers import run_main
from pipeline.common.secrets import mask_text
from pipeline.common.uris import sqlite_path
from pipeline.config import load
from pipeline.record.reachability import check_reachable
from pipeline.record.store import DiskFull, TrackingUnavailable, connect, disk_full, retrying, store_lock

HOLD_LOCK = (  # a second process: takes SQLite's exclusive lock, says so, holds it until its stdin closes
    "import sqlite3, sys; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
    "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); sys.stdin.read()"
)


@contextlib.contextmanager
def locked_by_another_process(database: Path) -> Iterator[None]:
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE IF NOT EXISTS experiments (name TEXT)")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(database)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        yield
    finally:
        holder.communicate(timeout=30)  # closes its stdin: the lock goes with the process


def read_only(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``folder`` made read-only; as root, whom file modes do not stop, ``os.access`` answers as for a user."""
    folder.mkdir(exist_ok=True)
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(
            "pipeline.record.reachability.os.access",
            lambda path, mode: real(path, mode) and not (mode & os.W_OK and Path(path).resolve() == folder.resolve()),
        )
    return folder


def a_folder(tmp: Path, mp: pytest.MonkeyPatch, stack: contextlib.ExitStack) -> str:
    (tmp / "runs").mkdir()
    return f"sqlite:///{tmp / 'runs'}"


def not_sqlite(tmp: Path, mp: pytest.MonkeyPatch, stack: contextlib.ExitStack) -> str:
    (tmp / "notes.db").write_text("these are notes, not a database\n")
    return f"sqlite:///{tmp / 'notes.db'}"


def read_only_folder(tmp: Path, mp: pytest.MonkeyPatch, stack: contextlib.ExitStack) -> str:
    return f"sqlite:///{read_only(tmp / 'shared', mp) / 'mlflow.db'}"


def read_only_artifacts(tmp: Path, mp: pytest.MonkeyPatch, stack: contextlib.ExitStack) -> str:
    read_only(tmp / "mlruns", mp)  # the store's folder is writable; MLflow's artifact folder is not
    return f"sqlite:///{tmp / 'mlflow.db'}"


def locked(tmp: Path, mp: pytest.MonkeyPatch, stack: contextlib.ExitStack) -> str:
    mp.setattr("pipeline.record.store.RETRIES", 2)  # wait 0.15 s, not MLflow's 13: the other process never lets go
    stack.enter_context(locked_by_another_process(tmp / "busy.db"))
    return f"sqlite:///{tmp / 'busy.db'}"


def full_disk(tmp: Path, mp: pytest.MonkeyPatch, stack: contextlib.ExitStack) -> str:
    real = shutil.disk_usage
    mp.setattr("pipeline.record.store.shutil.disk_usage", lambda path: real(path)._replace(free=3 * 2**20))
    return f"sqlite:///{tmp / 'mlflow.db'}"


def environment_garbage(tmp: Path, mp: pytest.MonkeyPatch, stack: contextlib.ExitStack) -> None:
    mp.setenv("MLFLOW_TRACKING_URI", "garbage")  # the default tracking.uri reads it
    return None


BAD_STORES: dict[str, tuple[Callable[..., str | None] | str, str]] = {
    "a folder": (
        a_folder,
        r"names the folder .*runs, not a database file: use tracking.uri=sqlite:///.*runs/mlflow\.db",
    ),
    "a file that is not SQLite": (not_sqlite, r"notes\.db is not an SQLite database .*point tracking.uri at a new"),
    "a missing file store": (
        "file:///nonexistent",
        r"file:///nonexistent is a file: URI.*tracking.uri=sqlite:///mlflow\.db",
    ),
    "garbage from the environment": (
        environment_garbage,
        r"^tracking\.uri=garbage \(from MLFLOW_TRACKING_URI\) is a plain path, not a URI.*MLFLOW_TRACKING_URI=sqlite:///",
    ),
    "an unknown scheme": ("foo://alice:s3cret@x", r"^tracking\.uri=foo://alice:\*\*\*@x has an unknown scheme 'foo'"),
    "a read-only folder": (read_only_folder, r"shared is read-only, and SQLite writes mlflow\.db and its journal"),
    "read-only artifacts": (read_only_artifacts, r"artifacts to .*mlruns, and .*mlruns is read-only: launch from"),
    "a locked database": (locked, r"busy\.db is locked by another process .*fuser"),
    "a full disk": (full_disk, r"only 3 MB free on the disk holding the tracking store .*a run needs at least"),
}


@pytest.mark.parametrize("case", BAD_STORES)
def test_a_store_that_cannot_work_is_refused_in_one_line_before_any_data_is_loaded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, case: str
) -> None:
    make, expected = BAD_STORES[case]
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with contextlib.ExitStack() as stack:
        uri = make(tmp_path, monkeypatch, stack) if callable(make) else make
        resolved = uri or load().tracking.uri
        with pytest.raises(TrackingUnavailable, match=expected) as info:
            check_reachable(resolved)
        assert "\n" not in str(info.value) and "s3cret" not in str(info.value)

        monkeypatch.setattr("pipeline.engine.building.build.load_data", lambda *a, **k: pytest.fail("data was loaded"))
        assert run_main(monkeypatch, "device=cpu", *([f"tracking.uri={uri}"] if uri else [])) == 2
    err = capsys.readouterr().err
    assert err == f"error: {info.value}\n"
    assert not (tmp_path / "mlflow.db").exists()  # no store was made
    assert not (tmp_path / "mlruns").exists() or case == "read-only artifacts"


def test_a_usable_store_passes_the_checks_and_they_leave_nothing_behind(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    check_reachable(uri)  # no file yet: SQLite makes it
    connect(uri, "pipeline")
    check_reachable(uri)  # a real MLflow store, with tables
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]


def test_an_old_file_store_is_opened_when_mlflow_is_told_to(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_reachable(f"file://{tmp_path / 'mlruns'}")
    with pytest.raises(TrackingUnavailable, match="needs the folder .*nowhere to exist and be writable"):
        check_reachable(f"file://{tmp_path / 'nowhere' / 'mlruns'}")


@pytest.mark.slow
def test_a_lock_taken_after_the_start_check_fails_in_one_line_rather_than_a_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("pipeline.record.store.RETRIES", 0)  # SQLite itself waits 5 s per attempt
    with (
        locked_by_another_process(tmp_path / "mlflow.db"),
        pytest.raises(TrackingUnavailable, match=r"mlflow\.db is locked by another process"),
    ):
        connect(f"sqlite:///{tmp_path / 'mlflow.db'}", "pipeline")


def enospc_naming_the_file(self: object, local_file: str, artifact_path: str | None = None) -> None:
    _, destination = self._get_destination_artifact_path(local_file, artifact_path)  # type: ignore[attr-defined]
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), destination)


def enospc_mid_write(self: object, local_file: str, artifact_path: str | None = None) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # write() names no file


@pytest.mark.parametrize(
    ("write", "named"),
    [
        (enospc_naming_the_file, r"while writing /\S+/mlruns/1/[0-9a-f]+/artifacts/config\.yaml \(\d+ MB free\)"),
        (enospc_mid_write, r"on one of /\S+/mlflow\.db \(\d+ MB free\), /\S+/mlruns \(\d+ MB free\), /\S+/checkpoints"),
    ],
    ids=["the file named", "no file named"],
)
def test_a_disk_that_fills_up_mid_run_stops_it_in_one_line_naming_where(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    write: Callable[..., None],
    named: str,
) -> None:
    monkeypatch.setattr("mlflow.store.artifact.local_artifact_repo.LocalArtifactRepository.log_artifact", write)
    assert run_main(monkeypatch, "device=cpu", "trainer.epochs=1", "trainer.max_steps=1") == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: no space left on the device ") and "checkpoint.dir" in err
    assert re.search(named, err), err
    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    assert run.info.status == "FAILED"


def test_full_disks_are_told_from_other_errors() -> None:
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(RuntimeError("(sqlite3.OperationalError) database or disk is full"))
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as cause:
            raise RuntimeError("could not save") from cause
    except RuntimeError as wrapped:
        assert disk_full(wrapped)
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not disk_full(RuntimeError("database is locked"))
    message = str(DiskFull.explain(RuntimeError("database or disk is full"), uri="sqlite:////data/mlflow.db"))
    assert message.startswith("no space left on the device while writing /data/mlflow.db")


def test_sqlite_paths_are_read_from_the_uri() -> None:
    assert sqlite_path("sqlite:///mlflow.db") == Path("mlflow.db")
    assert sqlite_path("sqlite:////tmp/runs/mlflow.db") == Path("/tmp/runs/mlflow.db")
    assert sqlite_path("http://127.0.0.1:5000") is None and sqlite_path("sqlite:///:memory:") is None


def test_database_is_locked_is_retried_and_other_errors_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.record.store.time.sleep", lambda s: None)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "written"

    assert retrying(flaky) == "written" and len(calls) == 3
    calls.clear()

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("no such table: runs")

    with pytest.raises(RuntimeError, match="no such table"):
        retrying(broken)
    assert len(calls) == 1


def test_a_row_another_run_inserted_first_is_retried_and_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight runs starting together against a PostgreSQL-backed server: two inserted the same dataset row, and the
    slower one's run died of the unique key (seen in tests/test_team_postgres.py's load test); the repeat finds it."""
    from types import SimpleNamespace

    from pipeline.data.sources import DataSpec
    from pipeline.record.tracking import MlflowTracker

    monkeypatch.setattr("pipeline.record.store.time.sleep", lambda s: None)
    calls: list[str] = []

    def log_inputs(run_id: str, datasets: list) -> None:
        calls.append(datasets[0].dataset.name)
        if len(calls) == 1:
            raise RuntimeError(
                "BAD_REQUEST: (psycopg.errors.UniqueViolation) duplicate key value violates unique constraint "
                '"dataset_pk" DETAIL:  Key (experiment_id, name, digest)=(1, synthetic, ab54edfa) already exists.'
            )

    tracker = SimpleNamespace(client=SimpleNamespace(log_inputs=log_inputs), run_id="r1", mask=lambda text: text)
    spec = DataSpec("synthetic", (1, 28, 28), 10, 96, 100, (0.5,), (0.25,), "code", "ab54edfa")
    MlflowTracker.log_dataset(tracker, spec, "train")  # type: ignore[arg-type]
    assert calls == ["synthetic", "synthetic"]


def test_a_store_that_stays_locked_gives_up_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.record.store.time.sleep", lambda s: None)

    def locked() -> None:
        raise RuntimeError("database is locked")

    with pytest.raises(RuntimeError, match="database is locked"):
        retrying(locked)


def test_an_unreachable_server_fails_fast_with_the_remedy() -> None:
    with pytest.raises(TrackingUnavailable, match=r"tracking.uri=http://127.0.0.1:9 cannot be reached .*mlflow server"):
        check_reachable("http://127.0.0.1:9", timeout_s=2)


def test_a_sqlite_store_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TrackingUnavailable, match="does not exist"):
        check_reachable(f"sqlite:///{tmp_path / 'nowhere' / 'mlflow.db'}")
    check_reachable(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the file itself may be missing


def test_the_cli_refuses_an_unreachable_tracking_uri_before_loading_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(monkeypatch, "device=cpu", "tracking.uri=http://user:secret@127.0.0.1:9") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tracking.uri=http://user:***@127.0.0.1:9 cannot be reached") and "secret" not in err


def test_credentials_in_uris_are_redacted() -> None:
    assert mask_text("https://alice:s3cr3t@mlflow.example.org") == "https://alice:***@mlflow.example.org"
    assert mask_text("sqlite:///mlflow.db") == "sqlite:///mlflow.db"


def test_the_store_lock_sits_beside_the_database(tmp_path: Path) -> None:
    with store_lock(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        assert (tmp_path / "mlflow.db.lock").exists()


@pytest.mark.slow
def test_four_processes_starting_together_on_a_fresh_store_all_land_their_runs(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    args = [
        "trainer.epochs=1",
        "trainer.max_steps=2",
        "device=cpu",
        "tracking.experiment=together",
        "monitor.plots=false",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args, f"tracking.run_name=job{i}", f"hydra.run.dir=outputs/{i}"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert [code for code, _ in results] == [0, 0, 0, 0], [err[-2000:] for _, err in results]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("together")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["job0", "job1", "job2", "job3"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert len(client.search_experiments()) == 2  # Default and "together": no duplicate experiments


PLAIN_CLIENT = "import sys; from mlflow import MlflowClient; print(len(MlflowClient(sys.argv[1]).search_experiments()))"


@pytest.mark.migrates
def test_a_plain_mlflow_client_opening_a_fresh_store_while_the_run_creates_it_breaks_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race, injected: at the run's first migration step (an ALTER TABLE) a second process, a plain MLflow
    client that takes no lock of ours, opens the same fresh ``mlflow.db`` and runs to its end; the run's migration
    then goes on. It used to die with an alembic error (``duplicate column name``)."""
    import sqlalchemy

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plain: list[subprocess.CompletedProcess[str]] = []

    def second_client(conn, cursor, statement, *args) -> None:
        if not plain and statement.lstrip().upper().startswith("ALTER TABLE"):
            plain.append(subprocess.run([sys.executable, "-c", PLAIN_CLIENT, uri], capture_output=True, text=True))

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", second_client)
    try:
        client, experiment = connect(uri, "raced")
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", second_client)
    assert len(plain) == 1 and plain[0].returncode == 0, plain[0].stderr[-2000:]
    assert plain[0].stdout.strip() == "1"  # it found (or made) a whole store: the Default experiment
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "loss", 1.0)
    assert [e.name for e in MlflowClient(uri).search_experiments()] == ["raced", "Default"]
    assert not [p.name for p in tmp_path.iterdir() if p.name not in {"mlflow.db", "mlflow.db.lock", "mlruns"}]
    default = MlflowClient(uri).get_experiment("0")  # made under another name, its artifacts still go to ./mlruns
    assert default.artifact_location == str(tmp_path / "mlruns" / "0")  # what a plain MlflowClient writes


@pytest.mark.migrates
def test_a_run_opening_a_store_that_a_plain_mlflow_client_is_still_migrating_retries_and_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: a plain client made ``mlflow.db`` and has its first tables; the run, opening it, migrates
    too, and at the run's first ALTER TABLE the plain client finishes first. The run's step then fails (``duplicate
    column name``) and the open is repeated: it finds the whole store."""
    import sqlalchemy
    from mlflow.store.db.base_sql_model import Base
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    engine = sqlalchemy.create_engine(uri)
    InitialBase.metadata.create_all(engine)  # where a plain client is, an instant into making the store
    engine.dispose()
    plain: list[subprocess.CompletedProcess[str]] = []

    def plain_client_finishes(conn, cursor, statement, *args) -> None:
        if not plain and statement.lstrip().upper().startswith("ALTER TABLE"):
            plain.append(subprocess.run([sys.executable, "-c", PLAIN_CLIENT, uri], capture_output=True, text=True))

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", plain_client_finishes)
    try:
        client, experiment = connect(uri, "raced")
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", plain_client_finishes)
    assert len(plain) == 1 and plain[0].returncode == 0, plain[0].stderr[-2000:]
    assert set(Base.metadata.tables) <= set(sqlalchemy.inspect(sqlalchemy.create_engine(uri)).get_table_names())
    assert client.get_experiment(experiment).name == "raced"
