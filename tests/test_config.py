"""Composition and validation: every option composes; every bad input names key, value and remedy."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from pipeline.common.errors import OverrideError
from pipeline.config import ConfigError, RunConfig, compose, config_dir, flatten, from_dictconfig, load
from pipeline.config.compose import _build


def config_groups() -> list[str]:
    """The folders of conf/ whose options fill a key of the run's config: all but Hydra's own and those whose
    options are ``# @package _global_`` (experiment, ladder, design, hparams_search set keys across groups)."""
    return sorted(
        folder.name
        for folder in config_dir().iterdir()
        if folder.is_dir()
        and folder.name != "hydra"
        and not any(p.read_text().startswith("# @package _global_") for p in folder.glob("*.yaml"))
    )


GROUPS = config_groups()
# options that need another key set to be valid on their own
NEEDS = {
    "data=imagefolder": ["data.root=some/folder"],
    "data=custom": ["data._target_=sets.make"],
    "model=custom": ["model._target_=nets.Tiny"],
    "model=torchvision": ["model.arch=resnet34"],
    "model=timm": ["model.arch=resnet18d"],
    "task=custom": ["task.loss._target_=losses.huber"],
    "optimizer=custom": ["optimizer._target_=RMSprop"],
    "scheduler=custom": ["scheduler._target_=ExponentialLR"],
    "step=custom": ["step._target_=hooks.tbptt"],
    "precision=fp16": ["amp=true"],
    "precision=bf16": ["amp=true"],
}


def all_options() -> list[str]:
    return [f"{g}={p.stem}" for g in GROUPS for p in sorted((config_dir() / g).glob("*.yaml"))]


def test_every_group_has_options_and_every_option_file_is_found() -> None:
    options = all_options()
    assert {o.split("=")[0] for o in options} == set(GROUPS)
    # every group of the run's config has its folder, and every such folder is a group of the run's config
    hints = typing.get_type_hints(RunConfig)
    assert set(GROUPS) == {f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])}
    assert {"monitor", "oom", "checkpoint"} <= set(GROUPS)
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


def test_defaults_are_the_set_up_recipes_baseline() -> None:
    cfg = load()
    assert (cfg.model._target_, cfg.model.keywords, cfg.data.name) == (
        "pipeline.engine.models.mlp",
        {"hidden_sizes": [512]},
        "digits",
    )
    assert (cfg.task.name, cfg.optimizer._target_, cfg.optimizer.keywords) == (
        "classification",
        "torch.optim.SGD",
        {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0},
    )
    assert cfg.scheduler._target_ is None
    assert (cfg.loader.batch_size, cfg.trainer.epochs, cfg.amp, cfg.device.name) == (64, 5, False, "auto")
    assert cfg.tracking.uri == "sqlite:///mlflow.db" and cfg.tracking.experiment == "pipeline"


def test_amp_switch_is_top_level_as_typed() -> None:
    cfg = load(["model=resnet50", "amp=true"])
    assert cfg.amp is True and cfg.model.label == "resnet50" and cfg.precision.dtype == "auto"


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
        (["optimizer.lr=0"], r"optimizer\.lr=0 .* > 0"),
        (["optimizer.lr=-1"], r"optimizer\.lr=-1"),
        (["optimizer.momentum=1"], r"optimizer\.momentum=1 .* \[0, 1\)"),
        (["optimizer=custom", "optimizer._target_=my-sgd"], r"optimizer\._target_='my-sgd' .* dotted path"),
        (["model=custom"], r"model\._target_ is required"),
        (["model=custom", "model._target_=nets"], r"model\._target_='nets' .* a dotted path such as mymodule\.MyNet"),
        (["data=custom"], r"data\._target_ is required"),
        (["data=custom", "data._target_=sets.make", "data.steps_per_epoch=0"], r"data\.steps_per_epoch=0"),
        (["+data._target_=sets.make"], r"data\._target_='sets\.make' .* null with data=digits"),
        (["task=custom"], r"task\.loss\._target_ is required"),
        (["task=regression", "+task.primary=val/mae"], r"task\.primary='val/mae' .* null with task=regression"),
        (["+scheduler.gamma=0.5"], r"scheduler\.gamma=0\.5 .* no keywords with scheduler=none"),
        (["loader.num_workers=-1"], r"loader\.num_workers=-1 .* >= 0"),
        (["data=imagefolder"], r"data\.root is required"),
        (["trainer.epochs=0"], r"trainer\.epochs=0"),
        (["trainer.max_steps=0"], r"trainer\.max_steps=0 .* -1 \(no limit\)"),
        (["loader.pin_memory=maybe"], r"loader\.pin_memory='maybe' .* true or false or one of 'auto'"),
        (["amp=1"], r"amp=1 .* true or false"),
        (["precision=fp16"], r"precision\.dtype='fp16' .* amp=true"),
        (["loader.persistent_workers=true"], r"loader\.persistent_workers=True .*loader\.num_workers=0"),
        (["loader.prefetch_factor=2"], r"loader\.prefetch_factor=2 .*loader\.num_workers=0"),
        (["loader=resident", "loader.num_workers=2"], r"loader\.num_workers=2 .*loader\.resident=true"),
        (["device=cpu", "device.index=1"], r"device\.index=1 .*only cuda"),
        (["+trainer.lr=0.1"], r"trainer\.lr=0\.1 .* it moved to optimizer\.lr"),
        (["+loader.bogus=1"], r"loader\.bogus=1 .* one of the loader keys: batch_size"),
        (["+surprise=1"], r"surprise=1 .* top-level keys"),
        (["data=synthetic", "data.shape=[28,28]"], r"data\.shape=\[28, 28\] .* \[channels, height, width\]"),
        (["trainer.profile=true", "trainer.profile_steps=0"], r"trainer\.profile_steps=0 .* an integer >= 1$"),
        (
            ["trainer.profile_steps=5"],
            r"trainer\.profile_steps=5 .* 3 while trainer\.profile=false \(add trainer\.profile",
        ),
        (["trainer.memory_snapshot=always"], r"trainer\.memory_snapshot='always' .* one of 'off', 'on_oom'$"),
        (
            ["device=cuda", "tracking=none", "trainer.memory_snapshot=on_oom"],
            r"trainer\.memory_snapshot='on_oom' .* off while tracking\.enabled=false \(the snapshot is kept as an",
        ),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_allowed(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load(overrides)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["model=nope"],
            r"^model=nope is not an option: expected one of custom, mlp, resnet18, resnet50, timm, torchvision$",
        ),
        (["trainer.lr=0.1"], r"^trainer\.lr moved: use optimizer\.lr$"),
        (["trainer.optimizer=adamw"], r"^trainer\.optimizer moved: use optimizer=sgd\|adamw\|adam\|custom"),
        (["data=imagenet"], r"^data=imagenet is not an option: expected one of .*digits.*synthetic"),
        (["loader.bogus=1"], r"^loader\.bogus is not a config key of loader"),
        (["loader.batch_size=[1"], r"^cannot parse the overrides 'loader\.batch_size=\[1'"),
    ],
)
def test_unknown_options_and_keys_are_one_line_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(OverrideError, match=match) as info:
        compose(overrides)
    assert "\n" not in str(info.value)


def test_a_keyword_of_a_target_group_needs_no_plus_new_or_not() -> None:
    """Issue 36 (14): one command line of research code needed twelve +model.x=..."""
    cfg = load(["model=custom", "model._target_=nets.Tiny", "model.width=3", "+model.depth=2"])
    assert cfg.model.keywords == {"width": 3, "depth": 2}
    more = load(["step=custom", "step._target_=hooks.tbptt", "step.window=4", "optimizer.betas=[0.9,0.95]"])
    assert more.step.keywords == {"window": 4} and more.optimizer.keywords["betas"] == [0.9, 0.95]
    assert load(["data=custom", "data._target_=sets.make", "data.n=10"]).data.keywords == {"n": 10}


@pytest.mark.parametrize("blank", ["''", "'   '", "'\t'"])
def test_a_blank_experiment_name_is_refused(blank: str) -> None:
    with pytest.raises(ConfigError, match=r"^tracking\.experiment='(?:\s|\\t)*' is not allowed: expected a non-empty"):
        load([f"tracking.experiment={blank}"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["optimizer.lr=inf"],
        ["optimizer.lr=nan"],
        ["optimizer.momentum=nan"],
        ["optimizer.weight_decay=inf"],
        ["data=imagefolder", "data.root=x", "data.val_fraction=nan"],
        ["monitor.interval_s=inf"],
        ["loader=workers", "loader.timeout=inf"],
        ["optimizer.lr=1e999"],  # too large for a float: Hydra reads it as inf
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
    assert flat["model._target_"] == "pipeline.engine.models.mlp"
    assert flat["model.hidden_sizes"] == [512]
    assert flat["optimizer.lr"] == 0.01 and flat["scheduler._target_"] is None
    assert flat["amp"] is False
    assert flat["tracking.tags"] == {}
    assert all(not isinstance(v, dict) or not v for v in flat.values())


def test_from_dictconfig_accepts_plain_mappings_and_returns_frozen_records() -> None:
    cfg = from_dictconfig(load().to_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.loader.batch_size = 1  # type: ignore[misc]


def test_a_custom_group_passes_every_other_key_as_a_keyword_and_records_it_back_among_its_keys() -> None:
    cfg = load(["model=custom", "model._target_=nets.Tiny", "+model.width=64", "+model.layers=[8,4]"])
    assert (cfg.model._target_, cfg.model.keywords) == ("nets.Tiny", {"width": 64, "layers": [8, 4]})
    assert cfg.to_dict()["model"] == {"_target_": "nets.Tiny", "width": 64, "layers": [8, 4]}
    assert cfg.model.label == "Tiny"
    assert from_dictconfig(cfg.to_dict()) == cfg  # the record composes back into the same config


def test_custom_data_keeps_its_own_keys_and_hands_the_others_to_the_factory() -> None:
    cfg = load(["data=custom", "data._target_=sets.make", "+data.root=here", "+data.n=10", "data.num_classes=3"])
    assert cfg.data.keywords == {"root": "here", "n": 10}
    assert (cfg.data.root, cfg.data.num_classes, cfg.data.target_key) == (None, 3, "target")


def test_a_keyword_left_at_missing_is_required() -> None:
    with pytest.raises(ConfigError, match=r"^model\.arch is required"):
        load(["model=torchvision"])


def test_a_data_key_the_chosen_source_does_not_have_is_still_refused() -> None:
    """The data group's own keys are no factory's keywords: data.num_samples on the digits would be ignored."""
    with pytest.raises(OverrideError, match=r"^data\.num_samples is not a key of data yet"):
        compose(["data=digits", "data.num_samples=4000"])
    assert load(["data=synthetic", "data.num_samples=4000"]).data.num_samples == 4000
    with pytest.raises(ConfigError, match=r"^data\.bogus=1 is not allowed: expected one of the data keys"):
        load(["data=digits", "data.bogus=1"])
