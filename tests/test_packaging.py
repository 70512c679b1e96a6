"""The wheel ships the config tree, and an installed wheel finds it without the source checkout."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline import config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_ships_conf_and_the_installed_package_composes_from_it(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("pipeline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"pipeline/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected <= names and "pipeline/conf/config.yaml" in names and "pipeline/__main__.py" in names
    assert {"pipeline/doctor.py", "pipeline/autotune/__main__.py"} <= names  # python -m pipeline.doctor, .autotune
    assert "hydra_plugins/pipeline_sweeper/interleaved_sweeper.py" in names  # the default sweeper (conf/design/)
    assert {"pipeline/gpu_check.py", "pipeline/gpucheck/check.py", "pipeline/gpucheck/harness.py"} <= names
    benchmarks = [n for n in names if n.split("/")[:2] in (["pipeline", "benchmarks"], ["pipeline", "bench.py"])]
    assert benchmarks == [] and not [n for n in names if n.startswith("bench/")]  # python -m bench: a checkout's

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    probe = (
        "import pipeline.config as c; d = c.config_dir(); cfg = c.load(['model=resnet50']);"
        "print(c.__file__); print(d); print(cfg.model.label);"
        "print(c.sweep_jobs(['loader.batch_size=32,64', 'trainer.seed=1,2']))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1] == str(site / "pipeline" / "conf") and out[2] == "resnet50"
    jobs = ast.literal_eval(out[3])
    rounds = [jobs[:2], jobs[2:]]  # round by round: each seed's round runs every batch size once
    assert [{job[1] for job in r} for r in rounds] == [{"trainer.seed=1"}, {"trainer.seed=2"}]
    assert all(sorted(job[0] for job in r) == ["loader.batch_size=32", "loader.batch_size=64"] for r in rounds)
    assert jobs == config.sweep_jobs(["loader.batch_size=32,64", "trainer.seed=1,2"])  # the checkout's order


def test_the_linter_sees_every_python_file_of_the_package_and_the_tests() -> None:
    """An exclude pattern that matches a package folder (``data`` once hid ``src/pipeline/data/``) is caught here."""
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    seen = {Path(line.strip()).resolve() for line in listed.splitlines() if line.strip().endswith(".py")}
    ours = {p.resolve() for folder in ("src", "tests", "scripts", "bench") for p in (ROOT / folder).rglob("*.py")}
    ours = {p for p in ours if "__pycache__" not in p.parts}
    assert ours and sorted(map(str, ours - seen)) == []


def test_every_folder_the_tools_write_into_the_launch_folder_is_ignored_and_cleaned() -> None:
    # a written file git sees would mark every later run of this checkout git.dirty=true (issue 26, item 5)
    written = ["mlruns", "mlflow.db", "unsent_metrics", "checkpoints", "outputs", "multirun", "compare"]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *(f"{name}/file" for name in written)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert sorted(p.split("/")[0] for p in ignored) == sorted(written)
    clean = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("\trm -rf"))
    assert set(written) <= set(clean.split()[2:]), clean
