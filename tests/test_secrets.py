"""Secrets stay out of the record: environment values, secret-looking keys, credentials in URIs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from files import truncate, write_image, write_image_folder, write_mnist
from helpers import TINY, cli, run_main
from pipeline.common.errors import ConfigError, PipelineError
from pipeline.common.secrets import MASK, env_keys, env_values, is_secret_key, mask_overrides, mask_text, mask_tree
from pipeline.config import RunConfig, compose, flatten, load
from pipeline.train import train
from servers import mlflow_server

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
    assert "data.root" in keys and "loader.batch_size" not in keys
    assert "tracking.uri" not in keys  # MLFLOW_TRACKING_URI is unset: the URI is the default written in the config
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert "tracking.uri" in env_keys(compose())


@pytest.mark.parametrize(
    "key",
    [
        "db.password",
        "pwd",
        "passwd",
        "pass",
        "db_pass",
        "passphrase",
        "apikey",
        "api_key",
        "apiKey",
        "X-Api-Key",
        "access_key",
        "AWS_SECRET_ACCESS_KEY",
        "client_secret",
        "bearer",
        "token",
        "authToken",
        "hf_token",
        "Authorization",
        "private_key",
        "credentials",
    ],
)
def test_keys_named_like_passwords_tokens_and_api_keys_are_secret(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "model.stem",
        "loader.pin_memory",
        "trainer.compile",
        "path",
        "data.root",
        "bypass",
        "passes",
        "compass",
        "tokenizer",
        "max_tokens",
        "author",
        "key",
        "sort_key",
        "monkey",
        "keyboard",
    ],
)
def test_harmless_keys_that_share_letters_with_secret_ones_are_not_secret(key: str) -> None:
    assert not is_secret_key(key)


def test_no_key_of_the_default_config_looks_secret() -> None:
    assert [k for k in flatten(load().to_dict()) if is_secret_key(k)] == []


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("curl -H 'X-Api-Key: abc123' https://h/x", "curl -H 'X-Api-Key: ***' https://h/x"),
        ("Authorization: Bearer eyJhbGciOi.J9", "Authorization: Bearer ***"),
        ("GET https://h/v1?token=abc&page=2 failed", "GET https://h/v1?token=***&page=2 failed"),
        ("retry with access_key=AKIA123, region=eu", "retry with access_key=***, region=eu"),
        ('{"password": "pw", "user": "bob"}', '{"password": "***", "user": "bob"}'),
        ("sent Bearer abc.def-ghi to the server", "sent Bearer *** to the server"),
        ("bypass=1 passes: 3 tokenizer=bpe", "bypass=1 passes: 3 tokenizer=bpe"),
    ],
)
def test_header_style_secrets_inside_a_value_are_masked_and_the_rest_kept(text: str, masked: str) -> None:
    assert mask_text(text) == masked


def test_values_from_the_environment_are_masked_anywhere_in_text() -> None:
    values = frozenset({"hunter2-long", "/data/private/set"})
    text = "FileNotFoundError: /data/private/set/MNIST/raw missing; run hunter2-long"
    assert mask_text(text, values) == f"FileNotFoundError: {MASK}/MNIST/raw missing; run {MASK}"
    assert mask_text("nothing to hide", values) == "nothing to hide"


def test_env_values_are_the_values_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PIPELINE_TEST_SECRET", SECRET)
    monkeypatch.setenv("PIPELINE_TEST_ROOT", f"{tmp_path}/data/")
    monkeypatch.setenv("PIPELINE_TEST_SHORT", "on")
    monkeypatch.setenv("PIPELINE_TEST_DEVICE", "cpu")
    monkeypatch.setenv("PIPELINE_TEST_STEPS", "7")
    cfg = load(
        [
            "data=mnist",
            "data.root=${oc.env:PIPELINE_TEST_ROOT}",
            "tracking.run_name=${oc.env:PIPELINE_TEST_SECRET}",
            "+tracking.tags.short=${oc.env:PIPELINE_TEST_SHORT}",
            "device.name=${oc.env:PIPELINE_TEST_DEVICE}",
            "trainer.max_steps='${oc.decode:${oc.env:PIPELINE_TEST_STEPS}}'",
        ]
    )
    assert {"data.root", "tracking.run_name", "tracking.tags.short", "device.name"} <= cfg.env_keys
    values = env_values(cfg)
    assert SECRET in values and f"{tmp_path}/data/" in values
    assert f"{tmp_path}/data" in values  # as data/sources.py resolves it, without the trailing slash
    assert not values & {"on", "cpu", "7", "sqlite:///mlflow.db"}  # too short, a choice, a number, the default URI


def test_an_experiment_named_from_the_environment_is_refused_without_showing_the_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PIPELINE_TEST_SECRET", SECRET)
    cfg = load(["tracking.experiment=${oc.env:PIPELINE_TEST_SECRET}"])
    with pytest.raises(ConfigError, match=r"tracking.experiment='\*\*\*' is not allowed: expected a name") as err:
        env_values(cfg)
    assert SECRET not in str(err.value)
    env_values(load(["tracking.experiment=${oc.env:PIPELINE_TEST_UNSET,fallback}"]))  # the default: not refused
    env_values(load(["tracking=none", "tracking.experiment=${oc.env:PIPELINE_TEST_SECRET}"]))  # never stored: allowed


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


# Each case: the overrides that read the secret from the environment, and the variables to set.
Case = Callable[[Path], tuple[list[str], dict[str, str]]]


def failing_path(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """An image folder with a cut-short JPEG: it passes the load-time check and fails to decode while training,
    after the run opened, with an error that names its path."""
    root = write_image_folder(tmp_path / SECRET, per_class=3)
    truncate(write_image(root / "cat" / "big.jpg", size=64), keep=0.9)
    overrides = [
        "data=imagefolder",
        "data.root=${oc.env:PIPELINE_TEST_SECRET}",
        "data.image_size=16",
        "loader.batch_size=4",
    ]
    return overrides, {"PIPELINE_TEST_SECRET": str(root)}


def run_name(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    return ["tracking.run_name=${oc.env:PIPELINE_TEST_SECRET}"], {"PIPELINE_TEST_SECRET": SECRET}


def tag(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """A tag read from $USER: MLflow's own mlflow.user tag (and the runs table's user_id) would repeat it."""
    return ["+tracking.tags.owner=${oc.env:USER}"], {"USER": SECRET, "LOGNAME": SECRET}  # getpass reads LOGNAME first


def dataset_source(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    write_mnist(tmp_path / SECRET, n_train=128, n_val=32)
    overrides = ["data=mnist", "data.download=false", "data.root=${oc.env:PIPELINE_TEST_SECRET}"]
    return overrides, {"PIPELINE_TEST_SECRET": str(tmp_path / SECRET)}


@pytest.mark.parametrize("case", [failing_path, run_name, tag, dataset_source], ids=lambda case: case.__name__)
def test_a_value_from_the_environment_appears_nowhere_in_the_record(
    case: Case, make_cfg: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, store_uri: str
) -> None:
    overrides, environment = case(tmp_path)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    cfg = make_cfg(*overrides)
    if case is failing_path:
        with pytest.raises((OSError, PipelineError), match=SECRET):  # the user's own terminal sees the real path
            train(cfg, overrides=overrides, echo=False)
    else:
        result = train(cfg, overrides=overrides, echo=False)
        assert result.steps == 3
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    tags = run.data.tags
    if case is failing_path:
        assert run.info.status == "FAILED" and MASK in tags["error"]
    if case is run_name:  # the run used the real name (the terminal's summary); the record holds ***
        assert result.run_name == SECRET and run.info.run_name == MASK
        assert f"run {MASK}:" in tags["mlflow.note.content"]
    if case is tag:
        assert tags["owner"] == MASK and tags["mlflow.user"] == MASK
    if case is dataset_source:  # it trained on the files it found there; the record says mnist from ***
        (dataset,) = [i.dataset for i in run.inputs.dataset_inputs]
        assert dataset.name == "mnist" and MASK in dataset.source
    assert SECRET.encode() not in (tmp_path / "mlflow.db").read_bytes()
    assert store_contains(tmp_path / "mlruns", SECRET) == []


def test_a_tracking_uri_from_the_environment_is_used_but_not_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = tmp_path / f"{SECRET}.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")  # read by tracking.uri's default
    result = train(load(["device=cpu", *TINY]), echo=False)
    run = MlflowClient(f"sqlite:///{store}").get_run(result.run_id)  # the run is in the store it named
    assert run.data.params["tracking.uri"] == MASK
    assert f"in experiment 'pipeline' ({MASK})" in run.data.tags["mlflow.note.content"]
    assert SECRET.encode() not in store.read_bytes()
    assert store_contains(tmp_path / "mlruns", SECRET) == []


@pytest.mark.slow
def test_credentials_in_a_server_uri_appear_nowhere_in_the_store(tmp_path: Path) -> None:
    with mlflow_server(tmp_path / "server") as server:
        proc = cli(
            "device=cpu",
            "trainer.max_steps=2",
            "trainer.epochs=1",
            f"tracking.uri=http://alice:{SECRET}@127.0.0.1:{server.port}",
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert SECRET not in proc.stdout and "alice:***@" in proc.stdout
    assert server.files_containing(SECRET) == []  # the SQLite store and the artifacts sent to it, once it stopped


def test_a_relative_tracking_uri_from_the_environment_is_masked_in_its_absolute_form_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///sk-test-XYZ123.db")  # relative: made absolute to be used
    result = train(load(["device=cpu", *TINY]), echo=False)
    run = MlflowClient(f"sqlite:///{tmp_path / 'sk-test-XYZ123.db'}").get_run(result.run_id)
    recorded = [*run.data.tags.values(), *run.data.params.values(), run.info.run_name]
    assert [text for text in recorded if "sk-test-XYZ123" in text] == []
    assert f"({MASK})" in run.data.tags["mlflow.note.content"]
    assert store_contains(tmp_path / "mlruns", "sk-test-XYZ123") == []
