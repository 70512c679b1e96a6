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


def compile_model(model: nn.Module, *, mode: str) -> nn.Module:
    """``torch.compile(model, mode=mode)``: compiled lazily, at the first forward of each new input shape.

    ``dynamic`` stays at torch's default (None): the first batch shape compiles a static graph, and a second
    shape (the last, smaller batch of an epoch, or the out-of-memory fallback's halved micro-batch) recompiles
    once with that dimension marked dynamic, which then serves every later size (but 1, which torch specialises
    again). So halving 256 -> 128 -> 64
    costs one recompile, not one per size, and stays far below dynamo's recompile limit
    (``torch._dynamo.config.recompile_limit``, 8 graphs per frame). Hitting that limit would not raise either:
    unless ``fail_on_recompile_limit_hit`` is set, dynamo falls back to running the frame eagerly, with a
    warning. A recompile's time falls in the step that needs it; the first step's, which holds the compilation
    proper, is kept out of the steady-state throughput and recorded as ``time/compile_s``
    (``pipeline.record.compile_seconds``).

    Args:
        model: the model, on its device, already in its memory format and wrapped for DDP if any.
        mode: ``trainer.compile_mode``: default, reduce-overhead (adds CUDA graphs), max-autotune or
            max-autotune-no-cudagraphs.
    """
    return torch.compile(model, mode=mode)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_optimizer(name: str, params, *, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """SGD with momentum (the guides' choice) or AdamW."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
