"""Datasets, read from files (or made in memory) into one shape: uint8 images, int64 labels.

Every source yields ``(image, label)`` with the image a ``uint8`` tensor ``[C, H, W]``; scaling
to float and normalising happen on the device, on whole batches (``loaders.Normalize``), which
also makes host-to-device copies four times smaller than float32 would.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from pipeline.config import DataConfig
from pipeline.errors import DatasetError

log = logging.getLogger(__name__)

SPLIT_SEED = 0  # fixed, so train/val splits never depend on trainer.seed

# Per-channel mean/std of the training pixels in [0, 1] (the usual published values).
_STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's
}


@dataclass(frozen=True)
class DataSpec:
    """What a run trains on: enough to build the model and to record the dataset in MLflow."""

    name: str
    in_shape: tuple[int, int, int]
    num_classes: int
    train_size: int
    val_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str  # where it came from: a folder, or how it was made
    digest: str  # 8 hex digits that change when the samples change


@dataclass
class DataBundle:
    spec: DataSpec
    train: Dataset
    val: Dataset


def load_data(cfg: DataConfig) -> DataBundle:
    """Read (or make) the configured dataset.

    Raises:
        DatasetError: files are missing and could not be downloaded, or the folder is unusable.
    """
    if cfg.name == "digits":
        return _digits(cfg)
    if cfg.name in ("mnist", "fashion_mnist", "cifar10"):
        return _torchvision(cfg)
    if cfg.name == "imagefolder":
        return _imagefolder(cfg)
    return _synthetic(cfg)


def tensor_bundle(
    name: str,
    *,
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
    num_classes: int,
    source: str,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> DataBundle:
    """Wrap in-memory uint8 images ``[N, C, H, W]`` and labels; mean/std default to the train split's."""
    images, labels = train
    if mean is None or std is None:
        pixels = images.float().div_(255)
        mean = tuple(pixels.mean(dim=(0, 2, 3)).tolist())
        std = tuple(pixels.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist())
    spec = DataSpec(
        name=name,
        in_shape=tuple(images.shape[1:]),
        num_classes=num_classes,
        train_size=len(labels),
        val_size=len(val[1]),
        mean=mean,
        std=std,
        source=source,
        digest=_tensor_digest(*train, *val),
    )
    return DataBundle(spec, TensorDataset(*train), TensorDataset(*val))


def _digits(cfg: DataConfig) -> DataBundle:
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0  # 0..16 ink levels
    size = cfg.image_size or 28
    pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
    images = (pixels.clamp(0, 1) * 255).round().to(torch.uint8)
    labels = torch.from_numpy(digits.target).long()
    train_idx, val_idx = split_indices(len(labels), cfg.val_fraction or 0.2)
    return tensor_bundle(
        "digits",
        train=(images[train_idx], labels[train_idx]),
        val=(images[val_idx], labels[val_idx]),
        num_classes=10,
        source="sklearn.datasets.load_digits",
    )


def split_indices(n: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed-seed shuffle of ``range(n)`` cut into train and val indices."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = max(1, round(n * val_fraction))
    return order[n_val:], order[:n_val]


def _torchvision(cfg: DataConfig) -> DataBundle:
    import torchvision.datasets as tvd

    cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10}[cfg.name]
    root = Path(cfg.root or "data")
    try:
        train, val = (cls(str(root), train=split, download=cfg.download) for split in (True, False))
    except (RuntimeError, OSError) as err:
        folder, expected = expected_files(cfg.name, root)
        how = "the download failed" if cfg.download else "data.download=false"
        cause = " ".join(str(err).split())[:400]  # torchvision's messages span lines
        raise DatasetError(
            f"data={cfg.name}: files missing under {folder} and {how} ({cause}). Expected: {', '.join(expected)}. "
            f"Put them there (or point data.root at the folder that holds {folder.name}/)."
        ) from err
    if cfg.name == "cifar10":
        images = [torch.from_numpy(d.data).permute(0, 3, 1, 2).contiguous() for d in (train, val)]
        labels = [torch.tensor(d.targets, dtype=torch.long) for d in (train, val)]
    else:
        images = [d.data.unsqueeze(1) for d in (train, val)]
        labels = [d.targets.long() for d in (train, val)]
    mean, std = _STATS[cfg.name]
    return tensor_bundle(
        cfg.name,
        train=(images[0], labels[0]),
        val=(images[1], labels[1]),
        num_classes=len(train.classes),
        source=str(root.resolve()),
        mean=mean,
        std=std,
    )


def expected_files(name: str, root: Path) -> tuple[Path, list[str]]:
    """The folder torchvision reads ``name`` from, and the files it needs there."""
    import torchvision.datasets as tvd

    if name == "cifar10":
        cls = tvd.CIFAR10
        return root / cls.base_folder, [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST}[name]
    return root / cls.__name__ / "raw", [Path(url).stem for url, _ in cls.resources]


def _imagefolder(cfg: DataConfig) -> DataBundle:
    from torchvision import datasets, transforms

    root = Path(cfg.root or "")
    if not root.is_dir():
        raise DatasetError(f"data.root={str(root)!r} is not a folder (data=imagefolder needs one sub-folder per class)")
    size, channels = cfg.image_size or 64, cfg.channels or 3
    steps = [transforms.Resize((size, size))]
    if channels == 1:
        steps.append(transforms.Grayscale(1))
    steps.append(transforms.PILToTensor())
    try:
        folder = datasets.ImageFolder(str(root), transform=transforms.Compose(steps))
    except (FileNotFoundError, OSError) as err:
        raise DatasetError(f"data=imagefolder: {err} (expected {root}/<class>/<image>.png|jpg)") from err
    train_idx, val_idx = split_indices(len(folder), cfg.val_fraction or 0.2)
    listing = "\n".join(f"{Path(p).relative_to(root)}:{Path(p).stat().st_size}" for p, _ in folder.samples)
    mean, std = _STATS["imagefolder"] if channels == 3 else ((0.5,), (0.25,))
    spec = DataSpec(
        name="imagefolder",
        in_shape=(channels, size, size),
        num_classes=len(folder.classes),
        train_size=len(train_idx),
        val_size=len(val_idx),
        mean=mean,
        std=std,
        source=str(root.resolve()),
        digest=hashlib.sha256(listing.encode()).hexdigest()[:8],
    )
    return DataBundle(spec, Subset(folder, train_idx.tolist()), Subset(folder, val_idx.tolist()))


def _synthetic(cfg: DataConfig) -> DataBundle:
    shape = tuple(cfg.shape or (1, 28, 28))
    classes, n_train, n_val = cfg.num_classes or 10, cfg.num_samples or 10_000, cfg.val_samples or 1_000
    gen = torch.Generator().manual_seed(SPLIT_SEED)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=gen)
        return images, torch.randint(0, classes, (n,), generator=gen)

    train, val = make(n_train), make(n_val)
    return tensor_bundle(
        "synthetic",
        train=train,
        val=val,
        num_classes=classes,
        mean=(0.5,) * shape[0],
        std=(0.2887,) * shape[0],
        source=f"synthetic: uniform uint8 {list(shape)}, {classes} classes, seed {SPLIT_SEED}",
    )


def _tensor_digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:8]
