"""python -m pipeline.gpu_check (scripts/gpu_check.sh on a fresh machine): its dry run runs the whole plan on the
CPU, prints every row and writes the numbers;
goals are judged where they mean something; a failing row does not stop the rest; missing packages are named."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pipeline.gpucheck import goals as gpu_goals
from pipeline.gpucheck import overheads as gpu_overheads
from pipeline.gpucheck import training as gpu_training

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"  # a fresh GPU machine's entry: python -m pipeline.gpu_check
ROW_KEYS = {"key", "name", "value", "unit", "goal", "status", "detail", "raw"}
TOP_KEYS = {
    "schema",
    "command",
    "dry_run",
    "started",
    "seconds",
    "machine",
    "pipeline",
    "missing_optional",
    "augment",
    "plan",
    "summary",
    "rows",
}
DRY_SKIPPED = {  # row key -> the reason's start: what has no meaning on a CPU, or would take minutes there
    "resnet50_tf32": "precision.tf32 acts on CUDA GPUs only",
    "resnet50_fp16": "float16 autocast on a CPU is emulated",
    "resnet50_bf16_channels_last_compile": "inductor takes minutes to compile ResNet-50 on a CPU",
    "input_gpu_util": "dry run: no GPU is read",
    "nvml_read_cost": "dry run: no GPU is read",
    "gputil_read_cost": "dry run: no GPU is read",
    "nvml_busy_util": "dry run: no GPU is read",
    "gputil_busy_util": "dry run: no GPU is read",
    "memory_snapshot": "trainer.memory_snapshot acts on CUDA GPUs only",
}
MEASURED = ["mlp", "resnet50_fp32", "resnet50_bf16", "resnet50_bf16_channels_last", "input_vs_synthetic"]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    """``python -m pipeline.gpu_check``'s module, so that main() runs in this process."""
    import pipeline.gpucheck.check

    return pipeline.gpucheck.check


def rows_by_key(document: dict) -> dict[str, dict]:
    return {row["key"]: row for row in document["rows"]}


@pytest.mark.slow  # the whole plan at tiny sizes: eight training runs, ResNet-50 among them (~25 s alone)
def test_the_dry_run_prints_every_row_of_the_plan_and_writes_its_numbers(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())

    assert set(document) == TOP_KEYS and document["dry_run"] is True and document["schema"] == 1
    assert document["pipeline"] == str(SCRIPT.parents[1] / "src" / "pipeline")  # the checkout's, not a copy
    assert [row["key"] for row in document["rows"]] == gpu_check.ROW_ORDER
    assert all(set(row) == ROW_KEYS for row in document["rows"])
    rows = rows_by_key(document)

    table = [line for line in printed.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == ["check", "value", "unit", "goal", "result", "detail"] and len(table) == 1 + len(rows)
    for line, row in zip(table[1:], document["rows"], strict=True):
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        assert cells[0] == row["name"] and cells[2] == row["unit"] and cells[4] == row["status"]
        assert cells[3] == (row["goal"] or "—")

    assert {key: row["detail"][: len(DRY_SKIPPED[key])] for key, row in rows.items() if row["status"] == "SKIP"} == (
        DRY_SKIPPED
    )
    assert not [row for row in document["rows"] if row["status"] in ("ERROR", "FAIL")]
    for key in MEASURED:  # measured, but speed goals are not judged at tiny sizes
        assert rows[key]["status"] == "INFO" and rows[key]["value"] > 0, key
    assert rows["resnet50_bf16_channels_last"]["goal"] == ">= 3000 img/s"
    assert rows["resnet50_bf16_channels_last_compile"]["goal"] == ">= 4500 img/s"
    assert (rows["mlp"]["goal"], rows["input_vs_synthetic"]["goal"], rows["input_gpu_util"]["goal"]) == (
        "<= 0.5 s",
        ">= 0.9",
        ">= 90%",
    )
    assert rows["pipeline_vs_bare"]["goal"] == ">= 0.98" and rows["pipeline_vs_bare"]["value"] > 0
    mfu = rows["mfu"]  # a functional goal: on the CPU, against its measured peak
    assert mfu["status"] == "PASS" and mfu["value"] == rows["resnet50_bf16_channels_last"]["raw"]["mfu_pct"] > 0
    assert mfu["detail"].startswith("this CPU's bf16 peak (measured matmul, ")

    mlp = rows["mlp"]["raw"]
    assert rows["mlp"]["value"] == pytest.approx(mlp["train_s"] + mlp["eval_s"])
    assert len(mlp["eval_s_per_epoch"]) == 2 and mlp["eval_s"] == mlp["eval_s_per_epoch"][-1]

    oom = rows["oom_fallback"]  # a functional goal: judged in a dry run too
    assert oom["status"] == "PASS" and oom["raw"]["oom_events"] == [16, 8] and oom["raw"]["micro_batch"] == 4
    assert oom["raw"]["steps"] == 6 and oom["value"] == pytest.approx(oom["raw"]["samples_per_s"])
    assert "micro-batch 16 -> 8 -> 4 after 2 out-of-memory event(s)" in oom["detail"]

    profiled = rows["profile_trace"]  # a functional goal: the trace holds the profiled steps (no GPU: no busy %)
    assert profiled["status"] == "PASS" and profiled["value"] is None
    assert profiled["raw"]["metrics"]["profile/steps"] == 2 and "ranges step 2, step 3" in profiled["detail"]

    doctor = rows["doctor"]
    failed = sum(check["status"] == "FAIL" for check in doctor["raw"]["checks"])
    assert doctor["value"] == failed and doctor["status"] == ("PASS" if failed == 0 else "FAIL")
    assert document["summary"] == {s: sum(r["status"] == s for r in document["rows"]) for s in document["summary"]}


@pytest.mark.parametrize(
    ("plan", "key", "value", "expected"),
    [
        ("GPU_PLAN", "resnet50_bf16_channels_last", 3100.0, "PASS"),
        ("GPU_PLAN", "resnet50_bf16_channels_last", 2900.0, "FAIL"),
        ("GPU_PLAN", "mlp", 0.5, "PASS"),
        ("GPU_PLAN", "mlp", 0.51, "FAIL"),
        ("GPU_PLAN", "input_gpu_util", None, "INFO"),  # nothing measured: nothing judged
        ("DRY_PLAN", "resnet50_bf16_channels_last", 2900.0, "INFO"),  # tiny sizes: a speed means nothing
        ("DRY_PLAN", "oom_fallback", 0.0, "FAIL"),  # surviving means something at any size
        ("DRY_PLAN", "doctor", 0.0, "PASS"),
    ],
)
def test_speed_goals_are_judged_on_the_gpu_sizes_only_and_functional_goals_everywhere(
    gpu_check: ModuleType, plan: str, key: str, value: float | None, expected: str
) -> None:
    assert getattr(gpu_goals, plan).judge(value, gpu_goals.GOALS[key]) == expected


def test_a_failing_measurement_is_an_error_row_and_the_others_still_run(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = gpu_training.train_run

    def failing_for_the_mlp(overrides: list[str], hooks: object = None):
        if "model=mlp" in overrides:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")
        return real(overrides, hooks)

    monkeypatch.setattr(gpu_training, "train_run", failing_for_the_mlp)
    out = tmp_path / "check.json"
    # an ERROR row fails the check; the step after it (the cheapest that measures something) still runs
    assert gpu_check.main(["--dry-run", "--only", "mlp,overhead", "--out", str(out)]) == 1
    rows = rows_by_key(json.loads(out.read_text()))
    assert list(rows) == ["mlp", "pipeline_vs_bare"]
    assert rows["mlp"]["status"] == "ERROR" and rows["mlp"]["value"] is None
    assert rows["mlp"]["detail"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "failing_for_the_mlp" in rows["mlp"]["raw"]["traceback"]
    assert rows["pipeline_vs_bare"]["status"] == "INFO" and rows["pipeline_vs_bare"]["value"] > 0
    assert re.search(r"\| ERROR +\| RuntimeError: CUDA error: an illegal memory access", capsys.readouterr().out)


def test_missing_packages_are_named_with_the_pip_command_before_anything_runs(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    absent = {"hydra", "omegaconf", "GPUtil", "mlflow"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "error: the GPU check needs hydra-core, omegaconf: pip install hydra-core omegaconf",
        "note: rows skipped for want of GPUtil (GPUtil): pip install GPUtil",
        "note: mlflow is not installed: the profile rows, which read a run's artifacts back, are skipped; the other "
        "runs record nothing (tracking=none)",
    ]
    assert captured.out == "" and not out.exists()


def test_without_mlflow_the_profile_rows_are_skipped_saying_why(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.gpucheck import profiling as gpu_profile

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    rows = gpu_profile.step_profile(gpu_goals.Context(gpu_goals.GPU_PLAN, "default", tmp_path))
    assert [(row.key, row.status) for row in rows] == [("profile_trace", "SKIP"), ("memory_snapshot", "SKIP")]
    assert all(row.detail.startswith("mlflow is not installed") for row in rows)


def test_torch_missing_points_at_the_build_for_the_machines_cuda(gpu_check: ModuleType) -> None:
    message = gpu_check.dependency_message(["torch", "torchvision", "tqdm"], [])
    assert message.startswith("error: the GPU check needs torch, torchvision, tqdm: pip install torch torchvision tqdm")
    assert "https://pytorch.org/get-started/locally/" in message


def test_gputil_on_python_3_12_without_distutils_asks_for_setuptools(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "distutils" else real(name, *a))
    monkeypatch.setattr(gpu_check.sys, "version_info", (3, 12, 1))
    required, optional = gpu_check.missing_dependencies()
    assert required == [] and "setuptools" in optional
    assert gpu_check.dependency_message([], ["setuptools"]) == (
        "note: rows skipped for want of setuptools (GPUtil's distutils on Python 3.12+): pip install setuptools"
    )


def test_without_a_gpu_the_full_check_refuses_and_names_the_dry_run(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "check.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no usable CUDA GPU here") and "--dry-run checks the plan on the CPU" in err


def test_unknown_steps_are_refused(gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--dry-run", "--only", "mlp,nope"])
    assert info.value.code == 2 and "unknown step(s) ['nope']" in capsys.readouterr().err


def test_a_step_skipped_whole_is_shown_where_its_rows_would_be(gpu_check: ModuleType) -> None:
    rows = [
        gpu_check.Row("pipeline_vs_bare", "p", 1.0, "x"),
        gpu_check.Row("compile", "compile: ...", None, "", status="SKIP"),  # over the time budget
        gpu_check.Row("doctor", "d", 0.0, "FAIL"),
        gpu_check.Row("resnet50_bf16_channels_last", "r", 1.0, "img/s"),
    ]
    ordered = [r.key for r in gpu_check.in_table_order(rows)]
    assert ordered == ["doctor", "resnet50_bf16_channels_last", "compile", "pipeline_vs_bare"]


@pytest.mark.slow
def test_the_dry_run_works_through_the_shell_entry_from_any_folder(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["PYTHON"] = sys.executable
    done = subprocess.run(
        ["sh", str(SCRIPT), "--dry-run", "--only", "doctor,mlp", "--out", "check.json"],  # the rest: above
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| check " in done.stdout and "| result " in done.stdout
    assert "[gpu_check] mlp:" in done.stderr  # progress goes to stderr, the table to stdout
    document = json.loads((tmp_path / "check.json").read_text())
    assert [row["key"] for row in document["rows"]][:2] == ["doctor", "mlp"]
    assert {row["status"] for row in document["rows"][:2]} <= {"PASS", "INFO"}
    assert document["pipeline"] == str(ROOT / "src" / "pipeline")  # this checkout's, ahead of any installed copy
    assert document["command"].startswith("python -m pipeline.gpu_check --dry-run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.json"]  # no mlflow.db, checkpoints or outputs


@pytest.mark.slow
def test_with_only_torch_installed_the_shell_entry_names_what_to_install(tmp_path: Path) -> None:
    """A fresh GPU machine has torch and torchvision, not the pipeline's other packages: the shell entry runs the
    check from the checkout and says in two lines what to pip install, with no traceback."""
    site_packages = Path(torch.__file__).resolve().parents[1]
    only = tmp_path / "site-packages"  # this environment's packages, less the pipeline's own dependencies
    only.mkdir()
    absent = ("hydra", "omegaconf", "mlflow", "psutil", "yaml", "_yaml", "pyyaml", "gputil", "pipeline", "__editable__")
    for entry in site_packages.iterdir():
        if not entry.name.lower().startswith(absent) and entry.suffix != ".pth":
            (only / entry.name).symlink_to(entry)
    python = tmp_path / "python"  # without site: only PYTHONPATH, which the entry puts after the checkout's src/
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PYTHON=str(python), PYTHONPATH=str(only))
    done = subprocess.run(
        ["sh", str(SCRIPT), "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    first = done.stderr.splitlines()[0]
    needed = "hydra-core, omegaconf, psutil, pyyaml"
    assert first == f"error: the GPU check needs {needed}: pip install {needed.replace(',', '')}"
    assert "note: mlflow is not installed: the profile rows" in done.stderr


class FakeNvml:
    """A GPU backend that reads a fixed utilisation."""

    name = "nvml"

    def __init__(self, util: float) -> None:
        self.util = util

    def read(self) -> list:
        from pipeline.monitor.gpu import GpuReading

        return [GpuReading(0, util_pct=self.util)]

    def close(self) -> None:
        pass


def test_a_poller_keeps_its_backends_utilisation_readings_until_stopped(gpu_check: ModuleType) -> None:
    with gpu_overheads.Poller(FakeNvml(87.5), interval_s=0.01) as poller:
        for _ in range(500):  # until a reading arrives (at most 5 s on a very busy machine)
            if poller.values:
                break
            threading.Event().wait(0.01)
    count = len(poller.values)
    threading.Event().wait(0.05)
    assert count >= 1 and set(poller.values) == {87.5} and len(poller.values) == count  # stopped: no more readings


def test_on_the_gpu_the_sampler_rows_report_each_backends_cost_and_busy_utilisation(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The GPU path without a GPU: the harness's sampler readings and the busy loop's pollers are stood in for."""
    from pipeline.gpucheck import harness

    monkeypatch.setattr(
        harness,
        "sampler_readings",
        lambda sizes: [
            harness.Row("sampler reading, psutil (CPU, RAM)", "120 µs", "(info)", None, "per reading"),
            harness.Row("sampler reading, nvml", "85 µs", "(info)", None, "per reading of one GPU"),
            harness.Row(
                "sampler reading, gputil", "n/a", "(info)", None, "ModuleNotFoundError: No module named 'GPUtil'"
            ),
        ],
    )
    ctx = gpu_check.Context(gpu_check.GPU_PLAN, "default", tmp_path)
    ctx.busy = {"why": {"gputil": "ModuleNotFoundError: No module named 'GPUtil'"}, "nvml": [90.0, 100.0, 95.0]}
    rows = {row.key: row for row in gpu_check.step_sampler(ctx)}
    assert list(rows) == ["nvml_read_cost", "gputil_read_cost", "nvml_busy_util", "gputil_busy_util"]
    assert (rows["nvml_read_cost"].value, rows["nvml_read_cost"].unit, rows["nvml_read_cost"].status) == (
        85.0,
        "µs",
        "INFO",
    )
    assert rows["gputil_read_cost"].status == "SKIP" and "No module named 'GPUtil'" in rows["gputil_read_cost"].detail
    assert rows["nvml_busy_util"].value == pytest.approx(95.0) and rows["nvml_busy_util"].raw["readings"] == [
        90.0,
        100.0,
        95.0,
    ]
    assert rows["gputil_busy_util"].status == "SKIP" and "GPUtil" in rows["gputil_busy_util"].detail
    ctx.busy = {}  # --only sampler: the busy loop never ran
    rows = {row.key: row for row in gpu_check.step_sampler(ctx)}
    assert rows["nvml_busy_util"].status == "SKIP" and "did not run" in rows["nvml_busy_util"].detail


def test_a_card_missing_from_the_table_fails_the_mfu_row_with_the_reason(gpu_check: ModuleType) -> None:
    from pipeline.gpucheck.training import mfu_row

    ctx = gpu_goals.Context(gpu_goals.GPU_PLAN, "default", Path("."))
    ctx.mfu["resnet50_bf16_channels_last"] = (None, "no MFU: 'NVIDIA Some Future GPU' is not in pipeline's table")
    row = mfu_row(ctx)
    assert (row.value, row.status) == (0.0, "FAIL") and row.detail.startswith("no MFU: 'NVIDIA Some Future GPU'")
    ctx.mfu["resnet50_bf16_channels_last"] = (41.5, "this GPU's bf16 peak (H200 SXM datasheet)")
    assert (mfu_row(ctx).value, mfu_row(ctx).status) == (41.5, "PASS")


def test_the_snapshot_row_reads_the_pickles_strings_without_unpickling_it() -> None:
    import pickle

    from pipeline.gpucheck.profiling import pickled_strings

    class Trap:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (sys.exit, (3,))  # would end the test process if anything unpickled it

    snapshot = {"segments": [{"blocks": []}], "device_traces": [[{"action": "alloc"}]], "trap": Trap()}
    held = pickled_strings(pickle.dumps(snapshot))
    assert {"segments", "device_traces", "action", "alloc"} <= held and "exit" in held
