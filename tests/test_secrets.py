"""Secrets stay out of the record: environment values, secret-looking keys, credentials in URIs."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipeline.config import compose
from pipeline.secrets import MASK, env_keys, mask_overrides, mask_text, mask_tree
from test_cli import cli, run_main

SECRET = "hunter2-7Q9zX"


def test_credentials_in_uris_are_masked_anywhere_in_text() -> None:
    assert mask_text("push to https://alice:hunter2@host/x and s3://k:v@b") == (
        "push to https://alice:***@host/x and s3://k:***@b"
    )
    assert mask_text("sqlite:///mlflow.db") == "sqlite:///mlflow.db"


def test_secret_looking_keys_and_environment_values_are_masked_in_trees() -> None:
    tree = {
        "tracking": {"uri": "http://u:p@h", "tags": {"api_key": "abc", "team": "vision", "Token": "t"}},
        "data": {"root": "/from/env"},
        "loader": {"batch_size": 64},
    }
    masked = mask_tree(tree, sensitive={"data.root"})
    assert masked == {
        "tracking": {"uri": "http://u:***@h", "tags": {"api_key": MASK, "team": "vision", "Token": MASK}},
        "data": {"root": MASK},
        "loader": {"batch_size": 64},
    }


def test_overrides_as_typed_are_masked() -> None:
    assert mask_overrides(
        [
            "loader.batch_size=8",
            "+tracking.tags.db_password=pw",
            "data.root=${oc.env:HOME}",
            "tracking.uri=http://a:b@h:5000",
            "data.root=/x",
        ],
        sensitive={"data.root"},
    ) == [
        "loader.batch_size=8",
        f"+tracking.tags.db_password={MASK}",
        f"data.root={MASK}",
        "tracking.uri=http://a:***@h:5000",
        f"data.root={MASK}",
    ]


def test_env_keys_are_found_before_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_TEST_ROOT", "/secret/place")
    keys = env_keys(compose(["data=mnist", "data.root=${oc.env:PIPELINE_TEST_ROOT}"]))
    assert "data.root" in keys and "tracking.uri" in keys  # the default URI reads MLFLOW_TRACKING_URI
    assert "loader.batch_size" not in keys


def store_contains(folder: Path, needle: str) -> list[str]:
    """Every file under ``folder`` whose bytes contain ``needle`` (the SQLite file included)."""
    return [str(p) for p in folder.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_a_secret_from_the_environment_appears_nowhere_in_the_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PIPELINE_TEST_SECRET", SECRET)
    args = [
        "device=cpu",
        "trainer.max_steps=2",
        "trainer.epochs=1",
        "+tracking.tags.team=${oc.env:PIPELINE_TEST_SECRET}",
        f"+tracking.tags.api_token={SECRET}",
    ]
    assert run_main(monkeypatch, *args) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(experiment_ids=["1"])
    assert run.data.tags["team"] == MASK and run.data.tags["api_token"] == MASK
    config = yaml.safe_load(
        Path(
            MlflowClient("sqlite:///mlflow.db").download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "dl"))
        ).read_text()
    )
    assert config["tracking"]["tags"] == {"team": MASK, "api_token": MASK}
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "mlruns").is_dir()
    assert SECRET.encode() not in (tmp_path / "mlflow.db").read_bytes()
    assert store_contains(tmp_path / "mlruns", SECRET) == []


@pytest.mark.slow
def test_credentials_in_a_server_uri_appear_nowhere_in_the_store(tmp_path: Path) -> None:
    port = 5123
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{server_dir / 'mlflow.db'}",
            "--default-artifact-root",
            str(server_dir / "artifacts"),
            "--workers",
            "1",
        ],
        cwd=server_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        proc = cli(
            "device=cpu",
            "trainer.max_steps=2",
            "trainer.epochs=1",
            f"tracking.uri=http://alice:{SECRET}@127.0.0.1:{port}",
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert SECRET not in proc.stdout and "alice:***@" in proc.stdout
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert store_contains(server_dir, SECRET) == []
