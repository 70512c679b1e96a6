"""Composition and validation: every option composes; every bad input names key, value and remedy."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.common.errors import OverrideError
from pipeline.config import ConfigError, compose, config_dir, flatten, from_dictconfig, load
from pipeline.config.compose import _build

GROUPS = ["device", "model", "precision", "loader", "data", "trainer", "tracking"]
# options that need another key set to be valid on their own
NEEDS = {
    "data=imagefolder": ["data.root=some/folder"],
    "precision=fp16": ["amp=true"],
    "precision=bf16": ["amp=true"],
}


def all_options() -> list[str]:
    return [f"{g}={p.stem}" for g in GROUPS for p in sorted((config_dir() / g).glob("*.yaml"))]


def test_every_group_has_options_and_every_option_file_is_found() -> None:
    options = all_options()
    assert {o.split("=")[0] for o in options} == set(GROUPS)
    assert "model=resnet50" in options and "data=digits" in options and "device=cuda" in options


@pytest.mark.parametrize("option", all_options())
def test_every_option_composes_and_validates(option: str) -> None:
    cfg = load([option, *NEEDS.get(option, [])])
    group, name = option.split("=")
    node = getattr(cfg, group)
    if hasattr(node, "name"):
        assert node.name == name


def test_every_option_key_is_commented() -> None:
    for path in config_dir().rglob("*.yaml"):
        if path.name == "config.yaml":
            continue
        for line in path.read_text().splitlines():
            if line and not line.startswith((" ", "#")) and ":" in line:
                has_comment = "#" in line
                key = line.split(":")[0]
                assert has_comment or key == "name", f"{path.relative_to(config_dir())}: '{key}' has no comment"


def test_defaults_are_the_guides_baseline() -> None:
    cfg = load()
    assert (cfg.model.name, cfg.model.hidden_sizes, cfg.data.name) == ("mlp", [512], "digits")
    assert (cfg.loader.batch_size, cfg.trainer.epochs, cfg.amp, cfg.device.name) == (64, 5, False, "auto")
    assert cfg.tracking.uri == "sqlite:///mlflow.db" and cfg.tracking.experiment == "pipeline"


def test_amp_switch_is_top_level_as_typed() -> None:
    cfg = load(["model=resnet50", "amp=true"])
    assert cfg.amp is True and cfg.model.name == "resnet50" and cfg.precision.dtype == "auto"


def test_tracking_uri_environment_variable_beats_the_default_but_not_an_explicit_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/elsewhere.db")
    assert load().tracking.uri == "sqlite:////tmp/elsewhere.db"
    assert load(["tracking.uri=sqlite:///mine.db"]).tracking.uri == "sqlite:///mine.db"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["loader.batch_size=abc"], r"loader\.batch_size='abc' is not allowed: expected an integer"),
        (["loader.batch_size=0"], r"loader\.batch_size=0 .* >= 1"),
        (["loader.batch_size=-3"], r"loader\.batch_size=-3"),
        (["trainer.lr=0"], r"trainer\.lr=0\.0 .* > 0"),
        (["trainer.lr=-1"], r"trainer\.lr=-1\.0"),
        (["loader.num_workers=-1"], r"loader\.num_workers=-1 .* >= 0"),
        (["data=imagefolder"], r"data\.root is required"),
        (["trainer.epochs=0"], r"trainer\.epochs=0"),
        (["trainer.max_steps=0"], r"trainer\.max_steps=0 .* -1 \(no limit\)"),
        (["trainer.optimizer=adam"], r"trainer\.optimizer='adam' .* one of 'sgd', 'adamw'"),
        (["loader.pin_memory=maybe"], r"loader\.pin_memory='maybe' .* true or false or one of 'auto'"),
        (["amp=1"], r"amp=1 .* true or false"),
        (["precision=fp16"], r"precision\.dtype='fp16' .* amp=true"),
        (["loader.persistent_workers=true"], r"loader\.persistent_workers=True .*loader\.num_workers=0"),
        (["loader.prefetch_factor=2"], r"loader\.prefetch_factor=2 .*loader\.num_workers=0"),
        (["loader=resident", "loader.num_workers=2"], r"loader\.num_workers=2 .*loader\.resident=true"),
        (["device=cpu", "device.index=1"], r"device\.index=1 .*only cuda"),
        (["model.hidden_sizes=[]"], r"model\.hidden_sizes=\[\] .* non-empty list"),
        (["model.hidden_sizes=[512,x]"], r"model\.hidden_sizes\[1\]='x' .* an integer"),
        (["+loader.bogus=1"], r"loader\.bogus=1 .* one of the loader keys: batch_size"),
        (["+surprise=1"], r"surprise=1 .* top-level keys"),
        (["data=synthetic", "data.shape=[28,28]"], r"data\.shape=\[28, 28\] .* \[channels, height, width\]"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_allowed(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load(overrides)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["model=nope"], r"^model=nope is not an option: expected one of mlp, resnet18, resnet50$"),
        (["data=imagenet"], r"^data=imagenet is not an option: expected one of .*digits.*synthetic"),
        (["loader.bogus=1"], r"^loader\.bogus is not a config key of loader"),
        (["loader.batch_size=[1"], r"^cannot parse the overrides 'loader\.batch_size=\[1'"),
    ],
)
def test_unknown_options_and_keys_are_one_line_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(OverrideError, match=match) as info:
        compose(overrides)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("blank", ["''", "'   '", "'\t'"])
def test_a_blank_experiment_name_is_refused(blank: str) -> None:
    with pytest.raises(ConfigError, match=r"^tracking\.experiment='(?:\s|\\t)*' is not allowed: expected a non-empty"):
        load([f"tracking.experiment={blank}"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.lr=inf"],
        ["trainer.lr=nan"],
        ["trainer.momentum=nan"],
        ["trainer.weight_decay=inf"],
        ["data=imagefolder", "data.root=x", "data.val_fraction=nan"],
        ["monitor.interval_s=inf"],
        ["loader=workers", "loader.timeout=inf"],
        ["trainer.lr=1e999"],  # too large for a float: Hydra reads it as inf
    ],
    ids=" ".join,
)
def test_every_float_key_must_be_finite(overrides: list[str]) -> None:
    key = overrides[-1].split("=")[0].replace(".", r"\.")
    with pytest.raises(ConfigError, match=rf"^{key}=(inf|nan) is not allowed: expected a finite number$"):
        load(overrides)


def test_a_float_key_can_opt_out_of_the_finite_rule() -> None:
    @dataclasses.dataclass(frozen=True)
    class Limits:
        budget_s: float = dataclasses.field(metadata={"nonfinite": True})  # inf = no limit
        rate: float = 1.0

    assert _build(Limits, {"budget_s": float("inf")}, prefix="limits.").budget_s == float("inf")
    with pytest.raises(ConfigError, match=r"limits\.rate=inf .* a finite number"):
        _build(Limits, {"budget_s": 1.0, "rate": float("inf")}, prefix="limits.")


def test_an_unresolvable_interpolation_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="tracking.run_name"):
        load(["tracking.run_name=${oc.env:PIPELINE_TEST_UNSET_VARIABLE}"])


def test_flatten_gives_dotted_keys_for_every_leaf() -> None:
    flat = flatten(load().to_dict())
    assert flat["loader.batch_size"] == 64
    assert flat["model.name"] == "mlp"
    assert flat["model.hidden_sizes"] == [512]
    assert flat["amp"] is False
    assert flat["tracking.tags"] == {}
    assert all(not isinstance(v, dict) or not v for v in flat.values())


def test_from_dictconfig_accepts_plain_mappings_and_returns_frozen_records() -> None:
    cfg = from_dictconfig(load().to_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.loader.batch_size = 1  # type: ignore[misc]
