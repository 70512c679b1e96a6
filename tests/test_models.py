"""Models take their input size and class count from the data; small images get a small stem."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.config import ModelConfig
from pipeline.engine.models import build_model, count_parameters

MLP, RESNET = "pipeline.engine.models.mlp", "pipeline.engine.models.resnet"


def resnet(arch: str, stem: str) -> ModelConfig:
    return ModelConfig(RESNET, {"arch": arch, "stem": stem})


def test_mlp_is_the_guides_784_512_10_network_on_mnist_shapes() -> None:
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
