"""The loader backends by name (``loader.backend``, ``pipeline.data.backends``): the built-in ones, one of the tests'
own trained with end to end, and the names the registry refuses."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch.utils.data import TensorDataset

import toy_loader
from helpers import LEAN
from pipeline.config import ConfigError, RunConfig, load
from pipeline.data import DevicePrefetcher, Place, Split, backends, make_batches, register
from pipeline.data.prefetch import InlineCopies
from pipeline.report.summary import format_summary
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]
CPU = torch.device("cpu")


@pytest.fixture
def toy() -> Iterator[list[toy_loader.ToyBatches]]:
    """``loader.backend=toy`` registered for the test alone; the batches it makes."""
    before = dict(backends.BACKENDS)
    toy_loader.MADE.clear()
    register(toy_loader.NAME, toy_loader.make)
    yield toy_loader.MADE
    backends.BACKENDS.clear()
    backends.BACKENDS.update(before)


def test_a_registered_backend_makes_the_batches_of_a_whole_run(make_cfg: MakeCfg, toy: list) -> None:
    # digits: 1,438 training samples (23 batches of 64), 359 validation samples (6 batches)
    cfg = make_cfg("loader.backend=toy", "loader.batch_size=64", "trainer.epochs=2", *LEAN, tiny=False)
    result = train(cfg, echo=False)
    trained, validated = toy
    assert (trained.served, validated.served) == (2 * 23, 2 * 6)  # every batch came through the toy backend
    assert trained.epochs == [1, 2] and trained.closed and validated.closed
    assert result.steps == 2 * 23 and result.loader_kind == "toy" and result.loader == "toy, batch 64"
    assert "waiting for data" in format_summary(result)  # a backend is on the host unless it registers otherwise


def test_an_unknown_backend_is_a_config_error_naming_the_key_and_the_known_names(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"loader.backend='nope' .* one of auto, dataloader, resident \(others"):
        train(make_cfg("loader.backend=nope", "tracking=none"), echo=False)


def test_resident_true_belongs_to_the_resident_backend() -> None:
    with pytest.raises(ConfigError, match=r"loader.resident=True .* false with loader.backend=toy"):
        load(["loader=resident", "loader.backend=toy"])
    with pytest.raises(ConfigError, match=r"loader.resident=False .* true with loader.backend=resident"):
        load(["loader.backend=resident"])
    assert load(["loader=resident", "loader.backend=resident"]).loader.backend_name == "resident"
    assert load(["loader=workers"]).loader.backend_name == "dataloader"


def test_each_built_in_backend_says_its_kind_and_a_prefetcher_says_its_loaders() -> None:
    data = TensorDataset(torch.zeros(10, 1, 2, 2, dtype=torch.uint8), torch.arange(10))
    kinds = {}
    for option in ("default", "resident"):
        batches = make_batches(Split(data, train=True), load([f"loader={option}"]).loader, Place(CPU, seed=0))
        kinds[option] = (batches.kind, DevicePrefetcher(batches, InlineCopies(CPU)).kind)
    assert kinds == {"default": ("dataloader", "dataloader"), "resident": ("resident", "resident")}
    assert (backends.on_device("resident"), backends.on_device("dataloader"), backends.on_device("")) == (
        True,
        False,
        False,
    )


def test_a_taken_name_is_refused(toy: list) -> None:
    for name in ("auto", "resident", toy_loader.NAME):
        with pytest.raises(ValueError, match=f"loader backend '{name}' is taken"):
            register(name, lambda split, cfg, place: None)  # type: ignore[arg-type,return-value]
    register(toy_loader.NAME, toy_loader.make)  # the same backend again changes nothing
