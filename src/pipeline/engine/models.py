"""The models: the guides' MLP and torchvision ResNets, shaped by the data they train on."""

from __future__ import annotations

import math

import torch
from torch import nn

from pipeline.config import ModelConfig

SMALL_IMAGE_PX = 64  # below this, ResNet's 7x7/2 stem + max-pool would shrink 28 px inputs to 7 px


def build_model(cfg: ModelConfig, *, in_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Build the configured model for inputs of ``in_shape`` (channels, height, width).

    Args:
        cfg: the model group.
        in_shape: one sample's shape, from the data.
        num_classes: the number of outputs, from the data.
    """
    if cfg.name == "mlp":
        return mlp(math.prod(in_shape), cfg.hidden_sizes or [], num_classes)
    return resnet(
        cfg.name,
        in_channels=in_shape[0],
        image_px=min(in_shape[1:]),
        num_classes=num_classes,
        stem=cfg.stem or "auto",
    )


def mlp(in_features: int, hidden_sizes: list[int], num_classes: int) -> nn.Sequential:
    """Flatten, then Linear+ReLU per hidden size, then a Linear to the classes (784-512-10 on MNIST)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for hidden in hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def resnet(name: str, *, in_channels: int, image_px: int, num_classes: int, stem: str) -> nn.Module:
    """A randomly initialised torchvision ResNet with its stem adapted to the input.

    ``stem=small`` (the default below 64 px) replaces the 7x7 stride-2 convolution and the max-pool
    by one 3x3 stride-1 convolution, as CIFAR ResNets do, so 28-32 px images keep their detail.
    """
    import torchvision

    net = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    small = stem == "small" or (stem == "auto" and image_px < SMALL_IMAGE_PX)
    if small:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return net


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_optimizer(name: str, params, *, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """SGD with momentum (the guides' choice) or AdamW."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
