"""Models take their input size and class count from the data; small images get a small stem."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.config import ModelConfig, load
from pipeline.engine.models import build_model, count_parameters

MLP, RESNET = "pipeline.engine.models.mlp", "pipeline.engine.models.resnet"


def resnet(arch: str, stem: str) -> ModelConfig:
    return ModelConfig(RESNET, {"arch": arch, "stem": stem})


def test_mlp_is_the_set_up_recipes_784_512_10_network_on_mnist_shapes() -> None:
    model = build_model(ModelConfig(MLP, {"hidden_sizes": [512]}), in_shape=(1, 28, 28), num_classes=10)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 512), (512, 10)]
    assert count_parameters(model) == 784 * 512 + 512 + 512 * 10 + 10
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_mlp_input_size_follows_the_data() -> None:
    model = build_model(ModelConfig(MLP, {"hidden_sizes": [64, 32]}), in_shape=(3, 32, 32), num_classes=7)
    assert model[1].in_features == 3 * 32 * 32
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnet_on_small_greyscale_images_gets_a_small_stem(name: str) -> None:
    model = build_model(resnet(name, "auto"), in_shape=(1, 28, 28), num_classes=10)
    assert model.conv1.in_channels == 1 and model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    assert model.fc.out_features == 10
    model.eval()
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_resnet_on_large_images_keeps_the_imagenet_stem_with_adapted_channels() -> None:
    model = build_model(resnet("resnet18", "auto"), in_shape=(1, 96, 96), num_classes=4)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.in_channels == 1
    assert isinstance(model.maxpool, nn.MaxPool2d)


def test_stem_can_be_forced() -> None:
    model = build_model(resnet("resnet18", "imagenet"), in_shape=(3, 32, 32), num_classes=10)
    assert model.conv1.kernel_size == (7, 7)
    model = build_model(resnet("resnet18", "small"), in_shape=(3, 224, 224), num_classes=10)
    assert model.conv1.kernel_size == (3, 3)


def test_resnet50_has_its_known_size() -> None:
    model = build_model(resnet("resnet50", "imagenet"), in_shape=(3, 224, 224), num_classes=1000)
    assert count_parameters(model) == 25_557_032


def plain_blocks(model: nn.Module) -> list[nn.Module]:
    """The residual blocks without a downsample: those whose output has their input's shape."""
    blocks = [m for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for m in layer]
    return [b for b in blocks if b.downsample is None]


def passes_through(block: nn.Module) -> bool:
    """Whether the block returns its (non-negative, post-ReLU) input unchanged: it starts as the identity."""
    x = torch.rand(2, block.conv1.in_channels, 4, 4)
    with torch.no_grad():
        return torch.equal(block.eval()(x), x)


def test_every_residual_block_of_the_builtin_resnet50_starts_as_the_identity() -> None:
    """model=resnet50 zero-initialises each block's last BatchNorm scale: in torchvision's own init its first epoch
    on the digits diverged and ended predicting one class for every sample (val/acc 0.086, below chance)."""
    model = build_model(load(["model=resnet50"]).model, in_shape=(1, 28, 28), num_classes=10)
    assert len(plain_blocks(model)) == 12 and all(passes_through(b) for b in plain_blocks(model))


def test_the_builtin_resnet18_keeps_torchvisions_own_init_which_learns_faster_there() -> None:
    model = build_model(load(["model=resnet18"]).model, in_shape=(1, 28, 28), num_classes=10)
    assert len(plain_blocks(model)) == 5 and not any(passes_through(b) for b in plain_blocks(model))
    assert all(bool((b.bn2.weight == 1).all()) for b in model.layer1)


def test_a_resnet_checkpoint_from_before_zero_init_residual_resumes_whatever_it_says_now() -> None:
    """How fresh weights start is moot to a resume, which loads them: no value of the key refuses a checkpoint."""
    from pipeline.engine.checkpointing.resume import config_changes

    saved = {"model._target_": RESNET, "model.arch": "resnet50"}
    for now in (True, False):
        assert config_changes(saved, {**saved, "model.zero_init_residual": now}) == {}
    assert config_changes(saved, {**saved, "model.arch": "resnet18"}) == {"model.arch": ("resnet50", "resnet18")}
