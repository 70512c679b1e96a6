"""Sweeps that finish: one parent MLflow run per sweep, its jobs nested under it, failures recorded and listed."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient

from helpers import cli, run_main
from pipeline.config import config_dir, load
from pipeline.engine.building.provenance import sweep_run_name, with_overrides
from pipeline.experiments import compare, sweep

TINY = ["trainer.epochs=1", "trainer.max_steps=2", "monitor.plots=false", "device=cpu"]  # batch size set per test
CONF = config_dir()


def sweep_runs(tmp_path: Path) -> tuple[Any, list[Any]]:
    """The sweep's parent run and its jobs' runs, by job number (one sweep per store in these tests)."""
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["1"])
    (parent,) = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    children = [r for r in runs if r is not parent]
    return parent, sorted(children, key=lambda r: int(r.data.tags["sweep.job"]))


def artifact(tmp_path: Path, run: Any, path: str) -> str:
    return MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").download_artifacts(run.info.run_id, path, str(tmp_path))


def outcomes(tmp_path: Path) -> dict[int, dict[str, Any]]:
    """The jobs' outcome files (jobs/<n>.json in the one sweep folder)."""
    (folder,) = tmp_path.glob("multirun/*/*")
    files = sorted((folder / "jobs").glob("*.json"), key=lambda p: int(p.stem))
    return {int(p.stem): json.loads(p.read_text()) for p in files}


@pytest.mark.parametrize(
    ("derived", "swept", "name"),
    [
        ("mlp-digits-cpu-bs32-w0", {"loader.batch_size": "32", "loader.num_workers": "0"}, "bs32-w0-mlp-digits-cpu"),
        (
            "mlp-digits-cpu-bs32-w0",
            {"loader.batch_size": "32", "optimizer.lr": "0.01"},
            "bs32-lr0.01-mlp-digits-cpu-w0",
        ),
        (
            "mlp-digits-cpu-bs32-w0",
            {"optimizer": "adamw", "loader": "workers"},
            "optimizer=adamw-loader=workers-mlp-digits-cpu-bs32-w0",
        ),
        ("mlp-digits-cpu-bs32-w0", {"device": "auto"}, "device=auto-mlp-digits-cpu-bs32-w0"),  # auto would read cpu
        ("mlp-digits-cpu-amp-bf16-bs32-w0", {"device": "cpu", "amp": "true"}, "cpu-amp-bf16-mlp-digits-bs32-w0"),
        ("mlp-digits-cpu-bs32-w0", {"trainer.seed": "1", "amp": "false"}, "fp32-seed1-mlp-digits-cpu-bs32-w0"),
        (
            "mlp-digits-cpu-bs32-w0",
            {"optimizer.lr": "0.0029813770307052724"},
            "lr0.00298138~b9a7-mlp-digits-cpu-bs32-w0",  # cut to 6 digits, with a hash of what the cut lost
        ),
        ("mlp-digits-cpu-bs32-w0", {"optimizer.lr": "0.001000000"}, "lr0.001-mlp-digits-cpu-bs32-w0"),  # lossless
        (
            "mlp-digits-cpu-bs32-w0",
            {"optimizer.lr": "0.1", "other.lr": "1e-05"},
            "optimizer.lr0.1-other.lr1e-05-mlp-digits-cpu-bs32-w0",
        ),
        ("my-own-name", {"optimizer.lr": "0.1"}, "lr0.1-my-own-name"),  # not a derived name: kept whole, after
    ],
)
def test_a_jobs_name_starts_with_what_the_sweep_varies(derived: str, swept: dict[str, str], name: str) -> None:
    assert sweep_run_name(derived, swept) == name


def test_numbers_cut_short_in_a_name_never_collide() -> None:
    names = {sweep_run_name("mlp-digits-cpu-bs32-w0", {"optimizer.momentum": v}) for v in ("0.9", "0.9000001")}
    assert len(names) == 2 and "momentum0.9-mlp-digits-cpu-bs32-w0" in names


def test_runs_whose_typed_configurations_differ_never_share_a_name() -> None:
    derived = "mlp-digits-cpu-bs64-w0"
    sgd = with_overrides(derived, [])
    adamw = with_overrides(derived, ["optimizer=adamw", "optimizer.lr=1e-3"])
    assert sgd == derived and adamw == "mlp-digits-cpu-bs64-w0-optimizer=adamw-lr1e-3"
    shown_or_bookkeeping = ["loader.batch_size=64", "trainer.seed=3", "tracking.experiment=x", "+tracking.tags.a=b"]
    assert with_overrides(derived, shown_or_bookkeeping) == derived  # the name shows these, or they change nothing
    swept = with_overrides(
        "lr0.1-" + derived, ["optimizer.lr=0.1", "trainer.epochs=2", "+model.width=8"], ["optimizer.lr"]
    )
    assert swept == "lr0.1-mlp-digits-cpu-bs64-w0-width8"  # a swept key is at the front once; the length, never
    shown = with_overrides(derived, [f"+model.layer{i}=1024" for i in range(8)])  # a target's keywords: short form
    assert shown == derived + "-" + "-".join(f"layer{i}1024" for i in range(8))
    long = with_overrides(derived, [f"+model.layer{i}=1024" for i in range(12)])
    path = with_overrides(derived, ["data.root=~/pictures"])
    assert re.fullmatch(derived + r"-kw[0-9a-f]{6}", long) and re.fullmatch(derived + r"-cfg[0-9a-f]{6}", path)
    assert long != with_overrides(derived, [f"+model.layer{i}=2048" for i in range(12)])


def test_the_keywords_of_a_research_model_show_in_its_name_in_short_form() -> None:
    """Issue 36 (13): twelve keywords became cfgde124d, and an LSTM and a Transformer run differed by class alone."""
    typed = ["model=custom", "model._target_=lm.Transformer", "model.emsize=64", "model.nhead=2", "optimizer.lr=5"]
    name = with_overrides("Transformer-corpus-cpu-bs20-w0", [*typed, "model.dropout=0.2", "trainer.epochs=3"])
    assert name == "Transformer-corpus-cpu-bs20-w0-emsize64-nhead2-lr5-dropout0.2"


@pytest.mark.parametrize("name", ["mnist_gpu", "cifar10_resnet18_gpu", "digits_quick"])
def test_an_experiment_file_holds_only_differences_under_the_command_that_runs_it(name: str) -> None:
    lines = (CONF / "experiment" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith("# ") and lines[2] == f"#   python -m pipeline experiment={name}"
    defaults = next(i for i, line in enumerate(lines) if line.startswith("defaults:"))
    assert lines[defaults + 1].startswith("  - override /")
    default, chosen = load([]).to_dict(), load([f"experiment={name}"]).to_dict()
    assert chosen["tracking"]["tags"] == {"experiment": name}  # the experiment's keys win over config.yaml's
    assert chosen != default


def test_the_gpu_experiment_sets_the_data_device_and_loader_it_names() -> None:
    cfg = load(["experiment=mnist_gpu", "trainer.epochs=2"])  # an override still applies on top
    assert (cfg.data.name, cfg.device.name, cfg.loader.resident, cfg.amp) == ("mnist", "cuda", True, True)
    assert (cfg.loader.batch_size, cfg.optimizer._target_, cfg.optimizer.lr, cfg.trainer.epochs) == (
        256,
        "torch.optim.AdamW",
        1e-3,
        2,
    )
    assert cfg.model == load([]).model  # what the file does not name stays the default


def hydra_config(*overrides: str) -> Any:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True).hydra


@pytest.mark.parametrize(
    ("name", "metric", "searched"),
    [
        ("accuracy_optuna", "val/acc", {"optimizer.lr", "loader.batch_size"}),
        ("throughput_optuna", "throughput/samples_per_s", {"loader.batch_size", "loader.num_workers", "amp"}),
    ],
)
def test_a_search_config_makes_optuna_maximise_its_metric(name: str, metric: str, searched: set[str]) -> None:
    path = CONF / "hparams_search" / f"{name}.yaml"
    assert path.read_text().splitlines()[2] == f"#   python -m pipeline hparams_search={name}"
    hydra = hydra_config(f"hparams_search={name}")
    assert hydra.sweeper._target_.endswith(".OptunaSearchSweeper") and hydra.sweeper.direction == "maximize"
    assert set(hydra.sweeper.params) == searched and hydra.mode.name == "MULTIRUN"
    assert hydra.callbacks.sweep.optimized_metric == metric
    load([f"hparams_search={name}"])  # the job's config still validates


def test_the_parallel_launcher_config_runs_two_joblib_processes_without_a_schema_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launcher = hydra_config("hydra/launcher=parallel").launcher
    assert launcher._target_.endswith(".ParallelLauncher") and (launcher.n_jobs, launcher.backend) == (2, "loky")
    assert [str(w.message) for w in caught if "schema" in str(w.message)] == []


def test_an_unknown_optimized_metric_stops_the_sweep_before_any_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["-m", "loader.batch_size=32,64", "hydra.callbacks.sweep.optimized_metric=loss", *TINY]
    assert run_main(monkeypatch, *args) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: hydra.callbacks.sweep.optimized_metric='loss' is not allowed: expected one of 'primary', "
        "'throughput/samples_per_s' or a val/<name> metric; no job was started\n"
    )
    assert not (tmp_path / "mlflow.db").exists() and list(tmp_path.glob("multirun/*/*/jobs")) == []


def test_a_sweep_whose_store_cannot_work_starts_no_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "store").mkdir()  # a folder where the SQLite file should be
    args = ["-m", "loader.batch_size=32,64", f"tracking.uri=sqlite:///{tmp_path / 'store'}", *TINY]
    assert run_main(monkeypatch, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tracking.uri=") and err.endswith("; no job was started\n") and err.count("\n") == 1
    assert list(tmp_path.glob("multirun/*/*/jobs")) == []


def test_a_2x2_sweep_nests_four_named_runs_under_a_summarised_parent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    metric = "hydra.callbacks.sweep.optimized_metric=throughput/samples_per_s"
    assert run_main(monkeypatch, "-m", "loader.batch_size=32,64", "optimizer.lr=0.01,0.1", metric, *TINY) == 0
    parent, children = sweep_runs(tmp_path)
    sweep_id = parent.data.tags["sweep.id"]
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.failed"] == "0"
    assert parent.info.run_name == f"sweep-{sweep_id[:8]}: loader.batch_size=32,64 optimizer.lr=0.01,0.1"
    assert parent.data.tags["sweep.keys"] == "loader.batch_size,optimizer.lr"
    assert parent.data.tags["sweep.command"].startswith("python -m pipeline -m loader.batch_size=32,64 optimizer.lr=")
    assert [r.info.run_name for r in children] == [
        "bs32-lr0.01-mlp-digits-cpu-w0",
        "bs32-lr0.1-mlp-digits-cpu-w0",
        "bs64-lr0.01-mlp-digits-cpu-w0",
        "bs64-lr0.1-mlp-digits-cpu-w0",
    ]
    for number, run in enumerate(children):
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert (run.data.tags["sweep.id"], run.data.tags["sweep.job"]) == (sweep_id, str(number))
        assert run.data.tags["sweep.keys"] == "loader.batch_size,optimizer.lr"
    returned = outcomes(tmp_path)  # what each job handed the sweeper: the configured metric
    assert [returned[n]["value"] for n in range(4)] == pytest.approx(
        [r.data.metrics["throughput/samples_per_s"] for r in children]
    )
    markdown = Path(artifact(tmp_path, parent, "compare/compare.md")).read_text()
    rows = list(csv.DictReader(io.StringIO(Path(artifact(tmp_path, parent, "compare/compare.csv")).read_text())))
    assert [row["run"] for row in rows] == [r.info.run_name for r in children]
    assert [float(row["val_acc_median"]) for row in rows] == pytest.approx(
        [r.data.metrics["val/acc"] for r in children], rel=1e-5
    )
    assert [row["status"] for row in rows] == ["FINISHED"] * 4
    assert all(f"| {r.info.run_name} " in markdown for r in children)
    assert Path(artifact(tmp_path, parent, "compare/compare.png")).read_bytes().startswith(b"\x89PNG")
    note = parent.data.tags["mlflow.note.content"]  # narrow, its links relative to the UI's own page
    assert note.startswith(markdown.splitlines()[0])
    assert max(len(line) for line in note.splitlines() if not line.startswith("[")) < 200  # links show their text
    assert all(f"| {r.info.run_name} " in note for r in children) and "compare/compare.md" in note
    assert "\n[MLflow's compare page for these 4 runs](#/compare-runs?runs=" in note and "http" not in note
    out = capsys.readouterr().out
    assert f"sweep {sweep_id[:8]}: 4 job(s), 4 finished, 0 failed" in out and markdown.splitlines()[0] in out
    view = out[out.index(markdown.splitlines()[0]) : out.index("MLflow's compare page")].splitlines()  # the table
    assert all(any(line.startswith(f"{r.info.run_name}  ") for line in view) for r in children)
    assert max(len(line) for line in view) <= 160
    assert (
        f"this sweep:   http://127.0.0.1:5000/#/experiments/1/runs/{parent.info.run_id}?workflowType=machine_learning"
        in out
    )


def table_rows(printed: str) -> dict[str, dict[str, str]]:
    """The rows of the compare table a terminal shows, by row: each cell under its column's header."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("row "))
    end = lines.index("", start)
    headers = re.split(r"\s{2,}", lines[start])
    cells = [dict(zip(headers, re.split(r"\s{2,}", line.strip()), strict=True)) for line in lines[start + 1 : end]]
    return {row["row"]: row for row in cells}


def test_after_a_repeat_sweep_every_run_carries_its_row_and_verdict_as_compare_prints_them_and_the_parent_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The README's repeat sweep, 2 seeds a value: its end tags the jobs; compare afterwards prints the same table."""
    assert run_main(monkeypatch, "-m", "amp=false,true", "trainer.seed=1,2", "loader.batch_size=64", *TINY) == 0
    swept = capsys.readouterr().out
    parent, children = sweep_runs(tmp_path)  # read before compare runs: what the sweep's end wrote
    assert compare.main(["--uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    rows = table_rows(printed)
    assert list(rows) == ["fp32-mlp-digits-cpu-bs64-w0", "amp-bf16-mlp-digits-cpu-bs64-w0"]
    assert table_rows(swept) == rows and "; none changed)" in printed  # the sweep wrote what compare would
    assert rows["fp32-mlp-digits-cpu-bs64-w0"]["verdict"] == "baseline"
    assert rows["amp-bf16-mlp-digits-cpu-bs64-w0"]["verdict"] == "cannot tell: add repeats"  # 2 repeats never can
    for run in children:
        tags = run.data.tags
        row = rows[tags["compare.row"]]
        assert run.info.run_name == tags["compare.row"].replace("-mlp", f"-seed{run.data.params['trainer.seed']}-mlp")
        assert (tags["compare.verdict"], tags["compare.speedup"]) == (row["verdict"], row["speed-up [95% CI]"])
    assert [sum(r.data.tags["compare.row"] == name for r in children) for name in rows] == [2, 2]
    assert "compare.row" not in parent.data.tags
    held = Path(artifact(tmp_path, parent, "compare/compare.txt")).read_text()
    assert table_rows(held) == rows and held.split("\n\n")[1:3] == printed.split("\n\n")[1:3]  # the table whole


def test_a_job_whose_loss_turns_nan_is_recorded_failed_and_the_sweep_exits_2_listing_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["-m", "optimizer.lr=0.01,1e30,0.02", "trainer.epochs=1", "trainer.max_steps=3", "loader.batch_size=32"]
    assert run_main(monkeypatch, *args, "monitor.plots=false", "device=cpu") == 2
    parent, children = sweep_runs(tmp_path)
    assert [r.info.status for r in children] == ["FINISHED", "FAILED", "FINISHED"]  # the job after it still ran
    assert children[1].data.tags["error"].startswith("NonFiniteLoss: training loss became nan at step ")
    assert children[1].info.run_name == "lr1e+30-mlp-digits-cpu-bs32-w0"
    assert parent.info.status == "FAILED" and parent.data.tags["sweep.failed"] == "1"
    assert parent.data.tags["sweep.failures"].startswith("job #1 (optimizer.lr=1e+30 trainer.epochs=1 ")
    assert "NonFiniteLoss: training loss became nan" in parent.data.tags["sweep.failures"]
    err = capsys.readouterr().err
    listed = err[err.index("error: 1 of 3 sweep job(s) failed; the others ran and are recorded:") :].splitlines()
    assert len(listed) == 2 and listed[1].startswith("  job #1 (optimizer.lr=1e+30 ")
    assert "): NonFiniteLoss: training loss became nan at step" in listed[1]
    note = parent.data.tags["mlflow.note.content"]
    line = next(row for row in note.splitlines() if row.startswith("| lr1e+30-mlp-digits-cpu-bs32-w0 "))
    assert "FAILED" in line


@pytest.mark.slow
def test_a_job_that_fails_before_its_run_exists_gets_a_failed_run_and_the_sweep_exits_1(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    import pipeline.engine.session

    real_build = pipeline.engine.session.build

    def build(cfg: Any, *args: Any, **kwargs: Any) -> Any:  # a runtime failure, not the user's to fix: exit status 1
        if cfg.loader.batch_size == 64:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_build(cfg, *args, **kwargs)

    monkeypatch.setattr(pipeline.engine.session, "build", build)
    logged: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(sweep.log, "error", lambda msg, *args, **kw: logged.append((msg % args, kw)))
    assert run_main(monkeypatch, "-m", "loader.batch_size=32,64,16", *TINY) == 1
    parent, children = sweep_runs(tmp_path)
    assert [(r.info.run_name, r.info.status) for r in children] == [
        ("bs32-mlp-digits-cpu-w0", "FINISHED"),
        ("bs64-mlp-digits-cpu-w0", "FAILED"),  # made by the sweep for the job, named as train would have
        ("bs16-mlp-digits-cpu-w0", "FINISHED"),
    ]
    failed = children[1].data.tags
    assert failed["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert failed["mlflow.parentRunId"] == parent.info.run_id and failed["overrides"].startswith("loader.batch_size=64")
    assert parent.info.status == "FAILED"
    assert outcomes(tmp_path)[1] | {"overrides": None} == {
        "job": 1,
        "overrides": None,
        "status": "FAILED",
        "exit_code": 1,
        "error": "RuntimeError: CUDA error: an illegal memory access was encountered",
        "run_id": children[1].info.run_id,
        "run_name": "bs64-mlp-digits-cpu-w0",
        "value": None,
    }
    err = capsys.readouterr().err
    assert "  job #1 (loader.batch_size=64 trainer.epochs=1 " in err and err.rstrip().endswith(
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    ((message, extra),) = logged
    assert extra["exc_info"] is None  # the job's log says it in one line; --debug shows the traceback
    assert "failed: internal error: RuntimeError at test_sweep.py:" in message


@pytest.mark.slow
def test_a_sweep_with_tracking_off_records_nothing_but_still_lists_its_failures(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["-m", "optimizer.lr=0.01,1e30", "tracking=none", "trainer.epochs=1", "trainer.max_steps=3", "device=cpu"]
    assert run_main(monkeypatch, *args) == 2
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    assert [(o["status"], o["exit_code"]) for o in outcomes(tmp_path).values()] == [("FINISHED", 0), ("FAILED", 2)]
    err = capsys.readouterr().err
    assert "error: 1 of 2 sweep job(s) failed; the others ran and are recorded:\n  job #1 (optimizer.lr=1e+30 " in err


@pytest.mark.slow
def test_parallel_jobs_in_joblib_processes_on_a_fresh_store_lose_no_run(tmp_path: Path) -> None:
    sweep = ["loader.batch_size=32,64", "loader.num_workers=0,2"]  # workers: DataLoader processes inside loky's
    proc = cli("-m", "hydra/launcher=parallel", *sweep, *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validated against ConfigStore schema" not in proc.stderr
    parent, children = sweep_runs(tmp_path)
    assert [(r.info.run_name, r.info.status) for r in children] == [
        ("bs32-w0-mlp-digits-cpu", "FINISHED"),
        ("bs32-w2-mlp-digits-cpu", "FINISHED"),
        ("bs64-w0-mlp-digits-cpu", "FINISHED"),
        ("bs64-w2-mlp-digits-cpu", "FINISHED"),
    ]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.launcher"] == "parallel"
    job_pids = {r.data.tags["process.pid"] for r in children}
    assert parent.data.tags["process.pid"] not in job_pids and len(job_pids) == 2  # two worker processes


@pytest.mark.slow
def test_an_optuna_search_runs_its_trials_as_nested_runs_returning_val_acc(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert run_main(monkeypatch, "hparams_search=accuracy_optuna", "hydra.sweeper.n_trials=2", *TINY) == 0
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "FINISHED"
    assert (parent.data.tags["sweep.sweeper"], parent.data.tags["sweep.keys"]) == (
        "optuna",
        "optimizer.lr,loader.batch_size",
    )
    assert parent.info.run_name.endswith(
        "optimizer.lr=tag(log, interval(0.001, 0.3)) loader.batch_size=choice(32, 64, 128, 256)"
    )
    assert len(children) == 2 and {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    for run in children:
        assert 0.001 <= float(run.data.params["optimizer.lr"]) <= 0.3
        assert run.data.params["loader.batch_size"] in {"32", "64", "128", "256"}
        assert run.info.run_name.startswith("lr")  # what the search varies comes first
    assert children[0].info.run_name != children[1].info.run_name
    returned = outcomes(tmp_path)
    assert [returned[n]["value"] for n in (0, 1)] == pytest.approx(
        [r.data.metrics["val/acc"] for r in children], rel=1e-5
    )


@pytest.mark.slow
def test_a_stop_request_ends_the_sweep_and_its_parent_killed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import signal

    import pipeline.engine.session
    from pipeline.engine.stopping import Stopped

    real_build = pipeline.engine.session.build

    def build(cfg: Any, *args: Any, **kwargs: Any) -> Any:  # SIGTERM arriving during job 1
        if cfg.loader.batch_size == 64:
            raise Stopped(signal.SIGTERM)
        return real_build(cfg, *args, **kwargs)

    monkeypatch.setattr(pipeline.engine.session, "build", build)
    logged: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(sweep.log, "error", lambda msg, *args, **kw: logged.append((msg % args, kw)))
    assert run_main(monkeypatch, "-m", "loader.batch_size=32,64,16", *TINY) == 143
    parent, children = sweep_runs(tmp_path)
    assert [r.info.run_name for r in children] == ["bs32-mlp-digits-cpu-w0"]  # job 2 never started
    tags = parent.data.tags
    assert parent.info.status == "KILLED" and tags["sweep.failures"].startswith("job #1 (loader.batch_size=64")
    assert "Stopped: stopped by SIGTERM" in tags["sweep.failures"] and "sweep.incomplete" in tags
    assert (outcomes(tmp_path)[1]["status"], outcomes(tmp_path)[1]["exit_code"]) == ("KILLED", 143)


@pytest.mark.slow
def test_an_optuna_search_with_its_search_space_on_the_command_line_needs_no_m(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 36 (16): the search config sets hydra.mode=MULTIRUN; choice() typed beside it was refused as needing
    --multirun by the entry point's own check of plain overrides."""
    space = ["optimizer.lr=choice(0.01,1e30)", "loader.batch_size=choice(32,64)"]
    args = ["hparams_search=accuracy_optuna", "hydra.sweeper.n_trials=4", *space, *TINY, "monitor.plots=false"]
    code = run_main(monkeypatch, *args)
    assert "requires --multirun" not in capsys.readouterr().err
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == ("FAILED" if code else "FINISHED")
    assert len(children) == 4 and code == (2 if any(r.info.status == "FAILED" for r in children) else 0)
    for run in children:  # a diverging rate fails its trial; the others finish
        assert run.info.status == ("FAILED" if run.data.params["optimizer.lr"] == "1e+30" else "FINISHED")
        assert run.data.params["loader.batch_size"] in {"32", "64"}


def test_search_values_without_m_or_a_multirun_config_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(monkeypatch, "loader.batch_size=choice(32,64)") == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: loader.batch_size=choice(32,64) lists values to sweep: add -m")


@pytest.mark.slow
def test_an_optuna_search_whose_every_trial_fails_still_closes_its_parent_and_lists_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["hparams_search=accuracy_optuna", "hydra.sweeper.n_trials=2", "optimizer.lr=1e30", "trainer.max_steps=3"]
    assert run_main(monkeypatch, *args, "trainer.epochs=1", "monitor.plots=false", "device=cpu") == 2  # the user's
    parent, children = sweep_runs(tmp_path)
    assert [r.info.status for r in children] == ["FAILED", "FAILED"]
    assert parent.info.status == "FAILED" and parent.data.tags["sweep.failed"] == "2"
    err = capsys.readouterr().err
    assert "No trials are completed yet" not in err and "Traceback" not in err  # Optuna's error, as a traceback
    assert err.splitlines()[-3] == "error: all 2 sweep job(s) failed:"  # after each trial's own line, the list
    assert err.count("): NonFiniteLoss: training loss became nan") == 2


def test_only_rank_0_of_a_ddp_job_records_its_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.experiments.sweep import JOBS_DIR, Sweep, SweepJob, stopped

    job = SweepJob(Sweep(id="s", keys=(), metric="val/acc"), 3, ("loader.batch_size=8",), tmp_path)
    monkeypatch.setenv("RANK", "1")
    stopped(job, RuntimeError("stop"), 143)
    assert not (tmp_path / JOBS_DIR).exists()
    monkeypatch.setenv("RANK", "0")
    stopped(job, RuntimeError("stop"), 143)
    assert json.loads((tmp_path / JOBS_DIR / "3.json").read_text())["status"] == "KILLED"


def test_a_ddp_jobs_objective_and_summary_are_the_throughput_of_all_its_ranks() -> None:
    from pipeline.engine.hot.timing import Breakdown
    from pipeline.engine.results import EpochResult, RunResult
    from pipeline.experiments import sweep
    from pipeline.report.summary import format_summary

    steps = Breakdown(0.0, 0.0, 1.0, 9, 900, 0.1, 10, 1000)
    val = {"val/loss": 0.4, "val/acc": 0.9}
    epoch = EpochResult(1, 0.5, val, 1.2, 900.0, steps, {"throughput/global_samples_per_s": 1800.0})
    result = RunResult("r", "id", "cpu", "CPU", "fp32", "x", 10, 10, 1.0, epochs=[epoch], breakdown=steps)
    assert sweep.objective(result, "throughput/samples_per_s") == 1800.0  # what Optuna maximises: the job's
    assert "1,800 samples/s in 1 epoch (steady state, all ranks; rank 0 900;" in format_summary(result)
    alone = dataclasses.replace(result, epochs=[dataclasses.replace(epoch, ranks={})])
    assert sweep.objective(alone, "throughput/samples_per_s") == 900.0
    assert sweep.objective(result, "primary") == 0.9 and sweep.objective(result, "val/loss") == 0.4
    assert sweep.objective(result, "val/mae") is None  # a metric the run did not record: nothing for the sweeper
