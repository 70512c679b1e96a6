"""Where a run's code came from: the pipeline's own (its version, its checkout, a hash of its source files) apart from
the launch folder's git state, and the tool's own outputs never counted as local changes; then what compare makes of
them (two rows for two codes) and where it writes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

import pipeline
from pipeline.engine.building.provenance import git_tags, pipeline_tags, source_hash, source_tags
from pipeline.experiments import compare
from pipeline.experiments.compare import ComparedRun, group
from pipeline.experiments.compare.cli import default_out
from pipeline.experiments.compare.reporting import FILES

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ["mlflow.db", "mlflow.db.lock", "mlruns/0/meta.yaml", "unsent_metrics/r.jsonl", "checkpoints/r/last.pt"]
OUTPUTS += ["outputs/2026-01-01/x.log", "multirun/2026-01-01/0/x.log", "compare/compare.md"]


def git(folder: Path, *args: str) -> str:
    run = subprocess.run(["git", *args], cwd=folder, check=True, capture_output=True, text=True)
    return run.stdout.strip()


def committed(folder: Path, files: dict[str, str]) -> Path:
    """A git repository in ``folder`` with ``files`` committed."""
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    git(folder, "init", "-q")
    git(folder, "add", "-A")
    git(folder, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    return folder


def write(folder: Path, names: list[str]) -> None:
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("written by a run")


# ---- the pipeline's own code ----


def test_the_source_hash_changes_with_any_python_file_of_the_package_and_nothing_else(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    write(package, ["__init__.py", "engine/loop.py"])
    first = source_hash(package)
    assert len(first) == 16 and source_hash(package) == first
    write(package, ["__pycache__/loop.cpython-312.pyc", "notes.txt"])  # not source: the same code
    assert source_hash(package) == first
    (package / "engine" / "loop.py").write_text("import time\ntime.sleep(0.005)  # 5 ms a step\n")
    patched = source_hash(package)
    assert patched != first
    (package / "engine" / "loop.py").rename(package / "engine" / "step.py")  # the same bytes under another name
    assert source_hash(package) not in (first, patched)


def test_the_pipelines_checkout_is_read_where_the_package_lives_not_in_the_launch_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkout = committed(tmp_path / "checkout", {"src/pkg/__init__.py": "x = 1\n", "README.md": "r"})
    package = checkout / "src" / "pkg"
    (tmp_path / "launch").mkdir()
    monkeypatch.chdir(tmp_path / "launch")  # outside git
    tags = pipeline_tags(package)
    assert tags["pipeline.git.commit"] == git(checkout, "rev-parse", "HEAD") and tags["pipeline.git.dirty"] == "false"
    assert tags["pipeline.source_sha256"] == source_hash(package) and "pipeline.git.diff" not in tags
    assert git_tags() == {}  # the launch folder's own state: none
    (package / "__init__.py").write_text("x = 2\n")
    changed = pipeline_tags(package)
    assert changed["pipeline.git.dirty"] == "true" and len(changed["pipeline.git.diff"]) == 12
    assert changed["pipeline.source_sha256"] != tags["pipeline.source_sha256"]


def test_a_package_installed_in_an_ignored_folder_of_a_checkout_is_not_that_checkouts_code(tmp_path: Path) -> None:
    site = ".venv/lib/python3.12/site-packages/pkg"
    repo = committed(tmp_path / "project", {".gitignore": ".venv/\n", "train.py": "1"})
    write(repo, [f"{site}/__init__.py"])
    tags = pipeline_tags(repo / site)
    assert sorted(tags) == ["pipeline.source_sha256", "pipeline.version"]  # no checkout: the hash says which code


def test_every_run_carries_the_running_pipelines_code_whatever_the_launch_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # outside git
    tags = source_tags()
    package = Path(pipeline.__file__).parent
    assert tags["pipeline.source_sha256"] == source_hash(package) and tags["pipeline.version"] == pipeline.__version__
    assert tags["pipeline.git.commit"] == git(package, "rev-parse", "HEAD")  # this checkout's
    assert "mlflow.source.git.commit" not in tags and "git.dirty" not in tags


# ---- the launch folder: ignored files and the tool's own outputs are no local changes ----


def test_files_in_an_ignored_folder_are_no_local_changes(tmp_path: Path) -> None:
    repo = committed(tmp_path, {".gitignore": "runs/\n", "train.py": "1"})
    write(repo, [f"runs/{i}/{j}.txt" for i in range(10) for j in range(10)])
    assert git_tags(str(repo))["git.dirty"] == "false"
    write(repo, ["new.py"])  # not ignored: a change
    assert git_tags(str(repo))["git.dirty"] == "true"


@pytest.mark.parametrize("launch", [".", "experiments/a"])
def test_the_tools_own_outputs_in_the_launch_folder_are_no_local_changes(tmp_path: Path, launch: str) -> None:
    repo = committed(tmp_path, {"train.py": "1", "experiments/a/notes.md": "n"})  # a user's project: no .gitignore
    folder = repo / launch
    write(folder, OUTPUTS)
    tags = git_tags(str(folder))
    assert tags["git.dirty"] == "false" and "git.diff" not in tags
    write(folder, ["compare.py"])  # the user's own new file, not a folder of the tool's: a change
    assert git_tags(str(folder))["git.dirty"] == "true"
    (folder / "compare.py").unlink()
    write(repo, ["experiments/mlflow.db"] if launch == "." else ["mlflow.db"])  # outside the launch folder: a change
    assert git_tags(str(folder))["git.dirty"] == "true"


# ---- compare: the code defines rows, and its files land beside the store ----


def code_run(run_id: str, seed: int, source: str) -> ComparedRun:
    """A run launched outside git: no commit, only the pipeline's code tags."""
    tags = {"pipeline.version": "0.1.0", "pipeline.source_sha256": source, "device.type": "cpu", "device.name": "cpu"}
    params = {"model._target_": "pipeline.engine.models.mlp", "loader.batch_size": "64", "trainer.seed": str(seed)}
    return ComparedRun(run_id, "mlp-digits-cpu-bs64-w0", "FINISHED", params, {"throughput/samples_per_s": 1e3}, tags)


def test_runs_of_two_pipeline_codes_launched_outside_git_are_two_rows_labelled_by_the_code() -> None:
    one, other = "1a2b3c4d5e6f7a8b", "9f8e7d6c5b4a3f2e"
    runs = [code_run("a0", 0, one), code_run("b0", 0, other), code_run("a1", 1, one)]
    rows = group(runs)
    assert [[r.id for r in row.runs] for row in rows] == [["a0", "a1"], ["b0"]]
    assert [row.name for row in rows] == [
        f"mlp-digits-cpu-bs64-w0 @code {one[:8]}",
        f"mlp-digits-cpu-bs64-w0 @code {other[:8]}",
    ]


@pytest.mark.parametrize(
    ("uri", "folder"),
    [
        ("sqlite:////srv/team/mlflow.db", "/srv/team/compare"),
        ("sqlite:///mlflow.db", "compare"),
        ("file:///srv/team/mlruns", "/srv/team/compare"),
        ("./mlruns", "compare"),
        ("http://127.0.0.1:5000", "compare"),
        ("postgresql://u@db/mlflow", "compare"),
    ],
)
def test_compares_files_go_beside_the_store(uri: str, folder: str) -> None:
    assert default_out(uri) == Path(folder)


def test_compare_writes_beside_the_store_into_a_folder_no_checkout_sees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = committed(tmp_path / "project", {"train.py": "1"})  # a user's project: no .gitignore
    store = repo / "runs" / "mlflow.db"
    store.parent.mkdir()
    client = MlflowClient(f"sqlite:///{store}")
    run = client.create_run(client.create_experiment("pipeline"), run_name="one")
    client.log_metric(run.info.run_id, "throughput/samples_per_s", 1000.0)
    client.set_terminated(run.info.run_id)
    monkeypatch.chdir(repo)
    assert compare.main(["--uri", f"sqlite:///{store}", "--runs", run.info.run_id]) == 0
    assert sorted(p.name for p in (store.parent / "compare").iterdir()) == sorted([".gitignore", *FILES])
    assert f"wrote {store.parent / 'compare' / 'compare.md'}" in capsys.readouterr().out
    assert not (repo / "compare").exists()
    seen = git(repo, "status", "--porcelain", "--untracked-files=all")  # the store is the user's to ignore
    assert "runs/mlflow.db" in seen and "compare" not in seen


# ---- end to end: the code that ran, from a launch folder outside git ----


@pytest.mark.slow
def test_two_runs_from_a_folder_outside_git_with_patched_pipeline_code_are_two_rows(tmp_path: Path) -> None:
    patched = tmp_path / "patched"
    shutil.copytree(ROOT / "src" / "pipeline", patched / "src" / "pipeline", ignore=shutil.ignore_patterns("*.pyc"))
    (patched / "conf").symlink_to(ROOT / "conf")  # the config tree beside src/, as in a checkout
    loop = patched / "src" / "pipeline" / "engine" / "hot" / "loop.py"
    loop.write_text(loop.read_text() + "\n# patched: the same behaviour, other code\n")
    launch, uri = tmp_path / "launch", f"sqlite:///{tmp_path / 'mlflow.db'}"
    launch.mkdir()
    for source in (ROOT / "src", patched / "src"):
        env = {**os.environ, "PYTHONPATH": str(source)}
        args = ["device=cpu", f"tracking.uri={uri}", "trainer.epochs=1", "trainer.max_steps=3"]
        subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=launch, env=env, check=True, capture_output=True)
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.compare", "--uri", uri, "--last", "2", "--out", str(tmp_path / "cmp")],
        cwd=launch,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("mlp-digits-cpu")]  # the terminal's table
    assert len(rows) == 2 and all("@code" in row for row in rows), out  # a long name is cut in its middle here
    markdown = (tmp_path / "cmp" / "compare.md").read_text()
    rows = [line for line in markdown.splitlines() if line.startswith("| mlp-digits-cpu")]
    assert len(rows) == 2 and all("@code " in row for row in rows), markdown
