"""Every command of the package keeps one contract (``pipeline.common.cli``): a user's error is one line on stderr and
exit 2; a bug is one short line and exit 1, its traceback only under ``--debug``. Run in-process through each
command's real ``main``; a few real processes check the ``python -m`` path itself."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from bench import suite as bench
from pipeline.autotune import cli as autotune_cli
from pipeline.autotune import tuning
from pipeline.experiments.compare import cli as compare_cli
from pipeline.machine import doctor
from pipeline.record import outbox, stale

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check() -> Callable[[list[str]], int]:
    from pipeline.gpucheck.check import main

    return main


def stderr(capsys: pytest.CaptureFixture[str]) -> str:
    """What the command said on stderr, less MLflow's own INFO lines as it makes a new store's tables."""
    err = capsys.readouterr().err
    return "".join(line for line in err.splitlines(keepends=True) if " INFO mlflow." not in line)


def exit_code(main: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


COMMANDS: dict[str, Callable[[], Callable[[list[str]], int]]] = {
    "compare": lambda: compare_cli.main,
    "autotune": lambda: autotune_cli.main,
    "tune": lambda: tuning.main,
    "stale": lambda: stale.main,
    "outbox": lambda: outbox.main,
    "bench": lambda: bench.main,
    "doctor": lambda: doctor.main,
    "gpu_check": _gpu_check,
}

BAD_INPUT = [
    ("compare", ["--min-effect", "nan"], "--min-effect nan: expected a share from 0 to 10"),
    ("compare", ["--min-effect", "-5"], "--min-effect -5.0: expected a share from 0 to 10"),
    ("compare", ["--out", "{file}"], "a file is in the way; name a folder"),
    ("compare", ["--last", "0"], "--last N needs N >= 1"),
    ("compare", ["--ui", "not a url"], "--ui not a url: expected the UI's address"),
    ("compare", ["--nope"], "unrecognized arguments: --nope"),
    ("autotune", ["--warmup", "0"], "--warmup must be >= 1"),
    ("autotune", ["--budget-s", "-1"], "--budget-s must be > 0"),
    ("autotune", ["loader.batch_size=0"], "loader.batch_size=0 is not allowed"),
    ("autotune", ["trainer.seed=36893488147419103232"], "trainer.seed=36893488147419103232 is not allowed"),
    ("tune", ["--warmup", "0"], "--warmup must be >= 1"),
    ("tune", ["--budget-s", "inf"], "--budget-s must be a finite number of seconds > 0"),
    ("tune", ["loader.batch_size=0"], "loader.batch_size=0 is not allowed"),
    ("tune", ["--config-dir", "{missing}"], "no such folder"),
    ("stale", ["--nope"], "unrecognized arguments: --nope"),
    ("stale", ["--uri", "http://[::1"], "tracking.uri=http://[::1 is not a valid URI (Invalid IPv6 URL)"),
    ("compare", ["--uri", "http://127.0.0.1:99999"], "is not a valid URI (Port out of range 0-65535)"),
    ("compare", ["--runs", ",,,"], "--runs ,,,: no run id given"),
    ("autotune", ["--budget-s", "inf"], "--budget-s must be a finite number of seconds > 0"),
    ("outbox", ["{sent}"], "already imported"),
    ("outbox", ["{missing}"], "error: "),
    ("outbox", [], "the following arguments are required: file"),
    ("bench", ["--only", "nope"], "unknown benchmark(s) ['nope']"),
    ("bench", ["--repeats", "0"], "--repeats must be >= 1"),
    ("bench", ["--threads", "0"], "--threads must be >= 1"),
    ("doctor", ["--nope"], "unrecognized arguments: --nope"),
    ("gpu_check", ["--nope"], "unrecognized arguments: --nope"),
]


@pytest.mark.parametrize(("command", "argv", "message"), BAD_INPUT, ids=[f"{c}{a}" for c, a, _ in BAD_INPUT])
def test_every_commands_bad_input_is_one_line_on_stderr_and_exit_2(
    command: str,
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "run.jsonl.sent").write_text("{}")
    argv = [
        a.format(file=tmp_path / "afile", missing=tmp_path / "none.jsonl", sent=tmp_path / "run.jsonl.sent")
        for a in argv
    ]
    assert exit_code(COMMANDS[command](), argv) == 2
    err = stderr(capsys)
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err


def test_a_bug_in_a_command_is_one_short_line_and_exit_1_with_the_traceback_under_debug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a bug in selecting runs")

    monkeypatch.setattr("pipeline.experiments.compare.cli.select", broken)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # the store exists: the bug, not a missing store, ends the command
    assert exit_code(compare_cli.main, ["--uri", uri]) == 1
    err = stderr(capsys)
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("internal error: KeyError at test_commands.py:") and "--debug" in err
    assert exit_code(compare_cli.main, ["--uri", uri, "--debug"]) == 1
    err = stderr(capsys)
    assert err.startswith("Traceback (most recent call last)") and "a bug in selecting runs" in err


def test_an_autotune_that_measured_nothing_records_a_failed_run_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert autotune_cli.main(["device=cpu", f"tracking.uri={store}", "--budget-s", "0.001"]) == 2
    err = stderr(capsys)
    assert err.count("\n") == 1 and err.startswith("error: nothing was measured in the 0.001 s budget")
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("pipeline-autotune").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("NothingMeasured: nothing was measured")
    assert "autotune.winner" not in run.data.tags


def test_compare_refuses_an_out_folder_it_cannot_write_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def unwritable(result: object, folder: Path) -> list[Path]:
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr("pipeline.experiments.compare.cli.write", unwritable)
    monkeypatch.setattr(
        "pipeline.experiments.compare.cli.select",
        lambda *a, **k: SimpleNamespace(runs=[], note="", objective=None, parent=None),
    )
    monkeypatch.setattr("pipeline.experiments.compare.cli.report", lambda *a, **k: object())
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    assert exit_code(compare_cli.main, ["--uri", uri, "--out", str(tmp_path / "ro")]) == 2
    err = stderr(capsys)
    assert err == f"error: --out {tmp_path / 'ro'}: cannot write the files there (Permission denied)\n"


def test_a_bug_during_a_run_is_one_line_exit_1_and_the_run_is_recorded_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.__main__ import main

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug after training")

    monkeypatch.setattr("pipeline.report.logbook.conclude", broken)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setattr(sys, "argv", ["pipeline", "device=cpu", "trainer.max_steps=2", f"tracking.uri={store}"])
    assert exit_code(lambda argv: main(), []) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "internal error" in line]
    assert line.startswith("internal error: ZeroDivisionError at test_commands.py:") and "a bug after training" in line
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["error"] == "ZeroDivisionError: a bug after training"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("pipeline", ["trainer.seed=36893488147419103232", "--debug"], "error: trainer.seed=36893488147419103232"),
        (
            "pipeline.compare",
            ["--min-effect", "nan"],
            "error: python -m pipeline.compare: --min-effect nan",
        ),
        ("pipeline.outbox", ["missing.jsonl"], "error: "),
    ],
)
def test_the_python_m_entry_points_keep_the_contract_in_a_real_process(
    tmp_path: Path, module: str, argv: list[str], message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


def test_an_out_of_memory_error_autotune_does_not_handle_ends_it_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def exhausted(self: object) -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory: you tried")

    monkeypatch.setattr("pipeline.autotune.cli.Trials.probe", exhausted)
    monkeypatch.chdir(tmp_path)
    assert exit_code(autotune_cli.main, ["device=cpu", "--no-track"]) == 2
    err = stderr(capsys)
    assert err.count("\n") == 1 and err.startswith("error: out of memory ([enforce fail at alloc_cpu.cpp:116]")


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("http://127.0.0.1:abc", "is not a valid URI (Port could not be cast to integer value as 'abc')"),
        (  # a driver that is not installed (the dev extra brings psycopg and psycopg2 for the team-server tests)
            "postgresql+pg8000://u:pw@127.0.0.1:1/db",
            "needs the database driver 'pg8000', which is not installed: pip install pg8000",
        ),
        ("mysql://u:pw@127.0.0.1:1/db", "needs the database driver 'MySQLdb', which is not installed: pip install"),
    ],
)
def test_a_tracking_uri_no_store_can_be_at_is_refused_before_the_run(uri: str, message: str) -> None:
    from pipeline.record.reachability import check_reachable
    from pipeline.record.store import TrackingUnavailable

    with pytest.raises(TrackingUnavailable, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        check_reachable(uri)
    assert "pw" not in str(info.value)  # the password is masked in the message


def test_sigterm_ends_a_command_in_one_line_with_the_signals_exit_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import signal

    monkeypatch.setattr("pipeline.experiments.compare.cli.select", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    before = signal.getsignal(signal.SIGTERM)
    assert exit_code(compare_cli.main, ["--uri", uri]) == 143
    assert stderr(capsys) == "python -m pipeline.compare: stopped by SIGTERM\n"
    assert signal.getsignal(signal.SIGTERM) is before  # put back


ENTRY_MODULES = {  # python -m pipeline.<command>: the module it runs, and the implementation whose main that calls
    "gpu_check": ("pipeline.gpu_check", "pipeline.gpucheck.check"),
    "compare": ("pipeline.compare", "pipeline.experiments.compare.cli"),
    "autotune": ("pipeline.autotune.__main__", "pipeline.autotune.cli"),  # a package: python -m runs its __main__
    "doctor": ("pipeline.doctor", "pipeline.machine.doctor"),
    "stale": ("pipeline.stale", "pipeline.record.stale"),
    "outbox": ("pipeline.outbox", "pipeline.record.outbox"),
    "launch": ("pipeline.launch", "pipeline.parallel.launch"),
}


def test_every_command_is_a_thin_module_loaded_once_from_its_own_file() -> None:
    """``python -m pipeline.<command>`` runs a real file of the package (``pipeline/doctor.py``; a package's
    ``__main__.py``), found without a folder added to the package's search path, loaded as one module object, and
    calling its implementation's ``main``: no copy."""
    import importlib
    import importlib.util
    from pathlib import Path

    import pipeline

    folder = Path(pipeline.__file__).parent
    assert [Path(p) for p in pipeline.__path__] == [folder]
    for name, (module, implementation) in ENTRY_MODULES.items():
        spec = importlib.util.find_spec(f"pipeline.{name}")
        assert spec is not None and spec.origin is not None
        runs = f"pipeline.{name}.__main__" if spec.submodule_search_locations else f"pipeline.{name}"  # as runpy does
        assert runs == module
        thin = importlib.import_module(module)
        assert Path(thin.__file__).is_relative_to(folder) and Path(thin.__file__).parent in (folder, folder / name)
        assert [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == thin.__file__] == [thin]
        assert thin.main is importlib.import_module(implementation).main
        assert len(Path(thin.__file__).read_text().splitlines()) <= 12


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ENTRY_MODULES))
def test_every_command_answers_help_in_a_real_process(tmp_path: Path, name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"pipeline.{name}", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout, proc.stdout
