"""Training-only augmentation on the device: per-sample crops and flips in one batched pass, the same after an
out-of-memory replay and after a resume, recorded with the run, never applied to evaluation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from mlflow import MlflowClient
from torch import nn

import pipeline.engine.building.build as build_module
from helpers import sigterm_at_step, without_first_batch_check, without_replay_check
from pipeline.config import ConfigError, DataConfig, RunConfig, load
from pipeline.data import CropFlip, Normalize, load_data, make_augment
from pipeline.data.augment import Draws
from pipeline.engine.building.provenance import run_name
from pipeline.engine.stopping import Stopped
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]
CPU = torch.device("cpu")


def augmenter(kind: str, shape: tuple[int, int, int], *, seed: int = 3, padding: int = 4, **shard: int) -> CropFlip:
    cfg = DataConfig("synthetic", augment=kind, augment_padding=padding)
    augment = make_augment(cfg, in_shape=shape, seed=seed, device=CPU, **shard)
    assert isinstance(augment, CropFlip), f"data.augment={kind} built no augmenter"
    return augment


def images(n: int, shape: tuple[int, int, int], seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def one_at_a_time(batch: torch.Tensor, draws: Draws, padding: int) -> torch.Tensor:
    """The obvious per-sample loop that the batched gathers must equal."""
    out = []
    for i, image in enumerate(batch):
        if draws.shifts is not None:
            dy, dx = draws.shifts[i].tolist()
            h, w = image.shape[1:]
            image = F.pad(image, (padding,) * 4)[:, dy : dy + h, dx : dx + w]
        if draws.flips is not None and bool(draws.flips[i]):
            image = image.flip(-1)
        out.append(image)
    return torch.stack(out)


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (3, 12, 20)], ids=["mnist", "cifar10", "folder"])
@pytest.mark.parametrize("kind", ["crop", "flip", "crop_flip"])
def test_the_batched_augmentation_equals_augmenting_each_sample_alone(kind: str, shape: tuple[int, int, int]) -> None:
    augment = augmenter(kind, shape)
    batch = images(64, shape)
    draws = augment.draw(64, step=5)
    out = augment(batch, 5)
    assert out.dtype == torch.uint8 and out.shape == batch.shape
    assert torch.equal(out, one_at_a_time(batch, draws, padding=4))
    if draws.shifts is not None:  # every sample its own offset, over the whole range 0..2*padding
        assert (int(draws.shifts.min()), int(draws.shifts.max())) == (0, 8)
        assert len({tuple(s) for s in draws.shifts.tolist()}) > 30
    if draws.flips is not None:  # and its own flip
        assert 10 < int(draws.flips.sum()) < 54


def test_a_crop_moves_the_image_and_fills_with_zeros_and_a_flip_mirrors_the_crop() -> None:
    image = torch.arange(1, 10, dtype=torch.uint8).view(1, 1, 3, 3)  # [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    shifts = torch.tensor([[0, 2]])  # rows from the padded top, columns from two pixels in: down 1, left 1
    crop = augmenter("crop", (1, 3, 3), padding=1).apply(image, Draws(shifts, None))
    assert crop.view(3, 3).tolist() == [[0, 0, 0], [2, 3, 0], [5, 6, 0]]
    both = augmenter("crop_flip", (1, 3, 3), padding=1).apply(image, Draws(shifts, torch.tensor([[True]])))
    assert both.view(3, 3).tolist() == [[0, 0, 0], [0, 3, 2], [0, 6, 5]]


def test_the_draws_depend_on_the_seed_and_the_step_alone() -> None:
    batch = images(32, (3, 8, 8))
    first = augmenter("crop_flip", (3, 8, 8), seed=7)
    at_step_9 = first(batch, 9)
    first(batch, 10)
    torch.manual_seed(123)
    torch.rand(1000)  # other random draws in the process change nothing
    fresh = augmenter("crop_flip", (3, 8, 8), seed=7)  # as a resumed run makes it
    assert torch.equal(fresh(batch, 9), at_step_9)
    assert not torch.equal(fresh(batch, 10), at_step_9)
    assert not torch.equal(augmenter("crop_flip", (3, 8, 8), seed=8)(batch, 9), at_step_9)


def test_ddp_ranks_augment_their_share_as_one_process_augments_the_global_batch() -> None:
    """Rank r trains every world-th sample of the global batch (EpochOrder): its draws are those samples'."""
    batch = images(24, (1, 6, 6))
    whole = augmenter("crop_flip", (1, 6, 6), padding=2)(batch, 4)
    for rank in (0, 1, 2):
        mine = augmenter("crop_flip", (1, 6, 6), padding=2, rank=rank, world=3)(batch[rank::3], 4)
        assert torch.equal(mine, whole[rank::3])


def test_no_augmentation_is_no_augmenter_at_all() -> None:
    assert make_augment(DataConfig("digits"), in_shape=(1, 28, 28), seed=0, device=CPU) is None


@pytest.mark.parametrize("option", ["digits", "mnist", "fashion_mnist", "cifar10", "imagefolder", "synthetic"])
def test_every_dataset_trains_unaugmented_by_default(option: str) -> None:
    cfg = load([f"data={option}", "data.root=some/folder"] if option == "imagefolder" else [f"data={option}"])
    assert (cfg.data.augment, cfg.data.augment_padding) == ("none", 4)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["data.augment=mirror"], r"data.augment='mirror' is not allowed: expected one of 'none', 'crop', 'flip'"),
        (["data.augment_padding=-1"], r"data.augment_padding=-1 is not allowed: expected an integer >= 0"),
        (["data.augment=crop", "data.augment_padding=0"], r"data.augment_padding=0 .* >= 1 with data.augment=crop"),
        (["data.augment=crop_flip", "data.augment_padding=1.5"], r"data.augment_padding=1.5 .* an integer"),
    ],
)
def test_impossible_augmentation_values_name_the_key(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load(overrides)


def test_a_flip_needs_no_padding() -> None:
    assert load(["data=fashion_mnist", "data.augment=flip", "data.augment_padding=0"]).data.augment == "flip"


@pytest.mark.parametrize("data", ["digits", "mnist"])
@pytest.mark.parametrize("kind", ["flip", "crop_flip"])
def test_flipping_digits_is_refused_naming_the_dataset_and_what_to_use(data: str, kind: str) -> None:
    with pytest.raises(ConfigError) as info:
        load([f"data={data}", f"data.augment={kind}"])
    message = str(info.value)
    assert message.startswith(f"data.augment='{kind}' is not allowed: expected none or crop for data={data}")
    assert "a mirrored digit is another symbol or none" in message


@pytest.mark.parametrize("data", ["fashion_mnist", "cifar10", "synthetic"])
def test_flipping_clothes_photos_and_noise_is_allowed(data: str) -> None:
    assert load([f"data={data}", "data.augment=crop_flip"]).data.augment == "crop_flip"


def test_padding_as_wide_as_the_images_is_refused_when_the_image_size_is_known(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"data.augment_padding=28 .* at most 27 for these 28x28 images"):
        train(make_cfg("tracking=none", "data.augment=crop", "data.augment_padding=28"), echo=False)


def watch_training_inputs(monkeypatch: pytest.MonkeyPatch, train_inputs: list, eval_inputs: list, oom_above: int):
    """Record what the model receives; raise a fake out-of-memory error for training inputs over ``oom_above``."""
    original = build_module.build_model
    without_first_batch_check(monkeypatch)  # faults in the run only
    without_replay_check(monkeypatch)

    def build(*args, **kwargs):
        model = original(*args, **kwargs)

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            (train_inputs if module.training else eval_inputs).append(inputs[0].detach().clone())
            if module.training and inputs[0].shape[0] > oom_above:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

        model.register_forward_pre_hook(hook)
        return model

    monkeypatch.setattr(build_module, "build_model", build)


def count_augmentations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    original = CropFlip.__call__

    def counted(self: CropFlip, batch: torch.Tensor, step: int) -> torch.Tensor:
        out = original(self, batch, step)
        calls.append((step, batch.clone(), out.clone()))
        return out

    monkeypatch.setattr(CropFlip, "__call__", counted)
    return calls


def test_an_out_of_memory_replay_trains_the_same_augmented_pixels(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 runs out of memory with all 32 samples and is replayed in two micro-batches of 16: they must hold
    exactly the pixels of the failed attempt, augmented once for the batch, not once per attempt."""
    seen: list[torch.Tensor] = []
    watch_training_inputs(monkeypatch, seen, [], oom_above=16)
    calls = count_augmentations(monkeypatch)
    cfg = make_cfg("tracking=none", "data.augment=crop", "loader.batch_size=32", "trainer.max_steps=2")
    result = train(cfg, echo=False)

    assert [len(x) for x in seen] == [32, 16, 16, 16, 16] and [e.micro_batch for e in result.oom_events] == [32]
    assert torch.equal(torch.cat(seen[1:3]), seen[0])  # the replay: the failed attempt's pixels, exactly
    assert [step for step, _, _ in calls] == [1, 2]  # once per batch, with the step it trains
    _, raw, augmented = calls[0]
    assert not torch.equal(augmented, raw)  # the crop did move the pixels
    spec = load_data(cfg.data).spec
    assert torch.equal(Normalize(spec.mean, spec.std, device=CPU)(augmented), seen[0])  # what the model trained on


def test_evaluation_sees_the_validation_images_unaugmented(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch) -> None:
    evaluated: list[torch.Tensor] = []
    watch_training_inputs(monkeypatch, [], evaluated, oom_above=1_000)
    cfg = make_cfg("tracking=none", "data.augment=crop", "data.augment_padding=2", "trainer.max_steps=1")
    train(cfg, echo=False)
    data = load_data(cfg.data)
    expected = Normalize(data.spec.mean, data.spec.std, device=CPU)(data.val.tensors[0])
    assert torch.equal(torch.cat(evaluated), expected)


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()])


def test_a_resumed_run_augments_every_batch_as_the_uninterrupted_run_did(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["data.augment=crop", "trainer.epochs=2", "trainer.max_steps=-1", "loader.batch_size=256"]  # 6 steps/epoch
    with monkeypatch.context() as patch:
        whole_calls = count_augmentations(patch)
        whole = train(make_cfg(*base, "tracking.experiment=whole"), echo=False)
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 8)
        with pytest.raises(Stopped):
            train(make_cfg(*base), echo=False)
    with monkeypatch.context() as patch:
        resumed_calls = count_augmentations(patch)
        resumed = train(make_cfg(*base, "resume=latest"), echo=False)
    assert [step for step, _, _ in whole_calls] == list(range(1, 13))
    assert [step for step, _, _ in resumed_calls] == list(range(9, 13))
    for (_, _, again), (_, _, before) in zip(resumed_calls, whole_calls[8:], strict=True):
        assert torch.equal(again, before)  # the same batch, augmented the same way
    assert resumed.steps == whole.steps == 12 and torch.equal(weights(resumed.model), weights(whole.model))


def test_the_augmentation_is_recorded_in_the_params_and_leaves_the_run_name_alone(
    make_cfg: MakeCfg, store_uri: str
) -> None:
    cfg = make_cfg("data.augment=crop", "data.augment_padding=3", "trainer.max_steps=1")
    result = train(cfg, echo=False)
    params = MlflowClient(store_uri).get_run(result.run_id).data.params
    assert (params["data.augment"], params["data.augment_padding"]) == ("crop", "3")
    assert result.run_name == run_name(make_cfg(), device_type="cpu", precision="fp32") == "mlp-digits-cpu-bs32-w0"
