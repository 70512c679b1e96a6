"""The models: any callable the ``model`` group's ``_target_`` names, shaped by the data it trains on.

    python -m pipeline model=mlp                                  # pipeline.engine.models.mlp
    python -m pipeline model=torchvision model.arch=efficientnet_b0 model.weights=DEFAULT
    python -m pipeline model=custom model._target_=nets.Tiny model.width=64

The built-in options are factories here (the recipe's MLP, torchvision ResNets with stems adapted to small images,
any torchvision or timm architecture), called the same way as the user's: the group's other keys as keywords, plus
``in_shape`` and ``num_classes`` from the data where the signature names them and the group does not set them.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.common.errors import PipelineError
from pipeline.common.messages import brief
from pipeline.common.targets import TargetError, instantiate, resolve
from pipeline.config import ModelConfig

log = logging.getLogger(__name__)

SMALL_IMAGE_PX = 64  # below this, ResNet's 7x7/2 stem + max-pool would shrink 28 px inputs to 7 px
BUILTIN = "pipeline.engine.models."  # factories whose models can be made on the meta device (footprint)


class WeightsError(PipelineError):
    """Pretrained weights that cannot be found or do not fit; the message says where to put the file."""


def build_model(cfg: ModelConfig, *, in_shape: tuple[int, ...] | None, num_classes: int | None) -> nn.Module:
    """The model ``model._target_`` makes, for inputs of ``in_shape`` and ``num_classes`` outputs (None: unknown).

    Raises:
        TargetError: the target cannot be imported, takes no such keyword, raised, needs a value the data does not
            give, or made something that is no ``nn.Module``.
    """
    supplied = {k: v for k, v in (("in_shape", in_shape), ("num_classes", num_classes)) if v is not None}
    _check_required(cfg, supplied)
    model = instantiate(cfg._target_, cfg.keywords, key="model", supplied=supplied)
    if not isinstance(model, nn.Module):
        raise TargetError(
            f"model._target_={cfg._target_} returned a {type(model).__module__}.{type(model).__qualname__}, not a "
            f"torch.nn.Module"
        )
    return model


def _check_required(cfg: ModelConfig, supplied: dict[str, Any]) -> None:
    """A factory that needs ``in_shape`` or ``num_classes`` where the data gives none: say which key sets it."""
    try:
        parameters = inspect.signature(resolve(cfg._target_, key="model")).parameters
    except (TypeError, ValueError):
        return
    for name, fix in (
        ("num_classes", "data.num_classes=N (or a `classes` attribute on the dataset)"),
        ("in_shape", "the shape as a keyword"),
    ):
        p = parameters.get(name)
        if p is not None and p.default is p.empty and name not in supplied and name not in cfg.keywords:
            raise TargetError(
                f"model._target_={cfg._target_} needs {name}, which the data does not give: set {fix}, or "
                f"model.{name}=..."
            )


def mlp(in_shape: tuple[int, ...], num_classes: int, hidden_sizes: list[int]) -> nn.Sequential:
    """Flatten, then Linear+ReLU per hidden size, then a Linear to the classes (784-512-10 on MNIST)."""
    if not hidden_sizes or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden_sizes):
        raise TargetError(f"model.hidden_sizes={hidden_sizes!r}: expected a non-empty list of sizes >= 1")
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(in_shape)
    for hidden in hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def resnet(
    arch: str, in_shape: tuple[int, ...], num_classes: int, stem: str = "auto", zero_init_residual: bool = False
) -> nn.Module:
    """A randomly initialised torchvision ResNet with its stem adapted to the input.

    ``stem=small`` (the default below 64 px) replaces the 7x7 stride-2 convolution and the max-pool
    by one 3x3 stride-1 convolution, as CIFAR ResNets do, so 28-32 px images keep their detail.

    ``zero_init_residual=True`` starts each residual block's last BatchNorm scale at zero, so every block begins as
    the identity (Goyal et al. 2017). ``conf/model/resnet50.yaml`` sets it: in torchvision's own init ResNet-50's
    first epoch on the digits diverged and predicted one class for every sample; ResNet-18 learns faster without it
    (the measurements: docs/configuration.md).
    """
    import torchvision

    if stem not in ("auto", "imagenet", "small"):
        raise TargetError(f"model.stem={stem!r}: expected one of 'auto', 'imagenet', 'small'")
    if len(in_shape) != 3:
        raise TargetError(f"model.arch={arch}: a ResNet takes [C, H, W] images, not inputs of shape {list(in_shape)}")
    in_channels, image_px = in_shape[0], min(in_shape[1:])
    make = getattr(torchvision.models, arch)
    net = make(weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
    small = stem == "small" or (stem == "auto" and image_px < SMALL_IMAGE_PX)
    if small:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return net


def torchvision_model(arch: str, in_shape: tuple[int, ...], num_classes: int, weights: str | None = None) -> nn.Module:
    """Any torchvision classification architecture by name (``torchvision.models.get_model``).

    ``weights``: None (random init), a weights name (``DEFAULT``, ``IMAGENET1K_V1``, or ``ResNet18_Weights.DEFAULT``:
    downloaded into torch's hub cache when missing), or a path to a ``state_dict`` file. With weights, the classifier
    is replaced where the data's classes differ from theirs; the first convolution follows the data's channels.

    Raises:
        TargetError: no such architecture; ``WeightsError``: no such weights, or offline without their file.
    """
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if arch not in known:
        near = [name for name in known if name.startswith(arch[:4])][:8] or known[:8]
        raise TargetError(f"model.arch={arch!r} is no torchvision classification model: e.g. {', '.join(near)}")
    if weights is None:
        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    elif Path(weights).expanduser().is_file():
        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        _load_state_dict(model, Path(weights).expanduser())
    else:
        model = _pretrained(arch, weights)
        replace_classifier(model, num_classes)
    fit_input_channels(model, in_shape[0])
    return model


def _pretrained(arch: str, name: str) -> nn.Module:
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(arch)
        chosen = torchvision.models.get_weight(name) if "." in name else enum[name]
    except (KeyError, ValueError) as err:
        options = ", ".join(["DEFAULT", *(w.name for w in enum)]) if "enum" in locals() else "DEFAULT"
        raise WeightsError(f"model.weights={name!r}: no such weights for {arch} (one of {options})") from err
    try:
        return torchvision.models.get_model(arch, weights=chosen)
    except OSError as err:  # URLError is an OSError: no network, or the server refused
        file = Path(torch.hub.get_dir()) / "checkpoints" / Path(chosen.url).name
        raise WeightsError(
            f"model.weights={name}: {arch}'s weights are not in the hub cache and could not be downloaded "
            f"({brief(err)}): put {chosen.url} at {file}, or use model.weights=/path/to/state_dict.pt"
        ) from err


def _load_state_dict(model: nn.Module, path: Path) -> None:
    """``path``'s tensors into ``model``; a classifier of another class count is left at its initial values."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    own = model.state_dict()
    skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
    missing = [k for k in missing if k not in skipped]
    if missing or unexpected:
        first = (missing or unexpected)[0]
        raise WeightsError(
            f"model.weights={path}: does not fit this architecture ({len(missing)} missing, {len(unexpected)} "
            f"unexpected keys, e.g. {first})"
        )
    if skipped:
        log.warning("model.weights=%s: %s did not fit the data's classes and train from scratch", path, skipped)


def replace_classifier(model: nn.Module, num_classes: int) -> None:
    """The last ``nn.Linear`` (the classifier of torchvision's and timm's models) replaced by one with
    ``num_classes`` outputs, unless it has that many already."""
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not named:
        raise WeightsError(f"{type(model).__name__} has no Linear classifier to fit to {num_classes} classes")
    name, last = named[-1]
    if last.out_features != num_classes:
        _set(model, name, nn.Linear(last.in_features, num_classes, bias=last.bias is not None))


def fit_input_channels(model: nn.Module, channels: int) -> None:
    """The first convolution taking ``channels`` inputs (pretrained weights: averaged over their channels)."""
    first = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)
    if first is None or first[1].in_channels == channels:
        return
    name, conv = first
    shape: dict[str, Any] = {"kernel_size": conv.kernel_size, "stride": conv.stride, "padding": conv.padding,
                             "dilation": conv.dilation}  # fmt: skip
    new = nn.Conv2d(channels, conv.out_channels, groups=conv.groups, bias=conv.bias is not None, **shape)
    with torch.no_grad():
        new.weight.copy_(conv.weight.mean(dim=1, keepdim=True).expand_as(new.weight))
        if conv.bias is not None and new.bias is not None:
            new.bias.copy_(conv.bias)
    _set(model, name, new)


def _set(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent_name, _, attribute = dotted.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, module)


def timm_model(arch: str, in_shape: tuple[int, ...], num_classes: int, pretrained: bool = False) -> nn.Module:
    """A timm architecture by name (``timm.create_model``), for the data's channels and classes.

    Raises:
        TargetError: timm is not installed (one line with the ``pip install``), or no such architecture.
    """
    try:
        import timm
    except ImportError:
        raise TargetError("model=timm needs timm: pip install timm (or pip install -e '.[timm]')") from None
    if arch not in timm.list_models(pretrained=pretrained):
        raise TargetError(f"model.arch={arch!r} is no timm model{' with pretrained weights' if pretrained else ''}")
    return timm.create_model(arch, pretrained=pretrained, num_classes=num_classes, in_chans=in_shape[0])


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def has_convolutions(model: nn.Module) -> bool:
    """Whether ``model`` has 2-D convolutions, the layers ``channels_last`` lays their inputs out for."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


REGISTRIES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")  # a module's own, changed in place


def attributes_now(module: nn.Module) -> Callable[[], None]:
    """What puts ``module``'s attributes back as they are now: its ``__dict__`` (the objects its names are bound to)
    and, since a forward may register into them (a buffer made on first use), its parameter, buffer and sub-module
    registries. Tensors changed in place are not copied here (``pipeline.engine.observe.replay`` copies those it
    needs)."""
    attributes = dict(module.__dict__)
    registries = {name: copy.copy(attributes[name]) for name in REGISTRIES if name in attributes}

    def restore() -> None:
        module.__dict__.clear()
        module.__dict__.update(attributes)
        for name, entries in registries.items():
            registry = attributes[name]
            registry.clear()
            registry.update(entries)

    return restore
