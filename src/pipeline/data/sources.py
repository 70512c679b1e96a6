"""Datasets, read from files (or made in memory) into one shape: uint8 images, int64 labels; or the user's own.

Every built-in source yields ``(image, label)`` with the image a ``uint8`` tensor ``[C, H, W]``; scaling
to float and normalising happen on the device, on whole batches (``loaders.Normalize``), which
also makes host-to-device copies four times smaller than float32 would. ``data=custom`` is the user's
factory (``pipeline.data.custom``): its items reach the model as they are.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from pipeline.common.device_memory import FLOAT32, check_data
from pipeline.common.errors import DatasetError
from pipeline.config import DataConfig, target_label
from pipeline.data import custom, structures
from pipeline.data.archives import read_published
from pipeline.data.images import image_folder

log = logging.getLogger(__name__)

SPLIT_SEED = 0  # fixed, so train/val splits never depend on trainer.seed
DIGITS_SAMPLES, DIGITS_SIDE = 1797, 28  # scikit-learn's 8x8 digits, upsampled to 28x28 unless data.image_size
DIGITS_SCAN = 8  # the side of the bundled images, as scanned
MIN_VAL_SAMPLES = 100  # fewer, and val/acc moves in steps over 1%: too coarse to compare runs by

DIGITS_CLASSES = tuple(str(d) for d in range(10))
CLASSES = {  # the published datasets' class names, in label order
    "mnist": DIGITS_CLASSES,
    "fashion_mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
}

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
    in_shape: tuple[int, ...] | None  # one sample's input (None: keyword inputs, or no tensor)
    num_classes: int | None  # None: not a classification dataset, or unknown
    train_size: int | None  # None: an iterable dataset without a length
    val_size: int | None
    mean: tuple[float, ...] | None  # None: the user's data, handed to the model as it is (no Normalize)
    std: tuple[float, ...] | None
    source: str  # where it came from: a folder, or how it was made
    digest: str  # 8 hex digits that change when the samples change
    classes: tuple[str, ...] | None = None  # the class names, in label order
    class_to_idx: dict[str, int] | None = None  # an image folder's sub-folder -> label
    inputs: str = "uint8 images"  # what a batch's inputs are, for the record (structures.describe)
    iterable: bool = False  # an IterableDataset: no sampler, each rank and worker reads its own share
    sample_bytes: int | None = None  # a user's sample as its batches hold it (None: built-in, or not tensors alone)

    @property
    def builtin(self) -> bool:
        """A built-in source: uint8 images normalised and augmented on the device."""
        return self.mean is not None

    @property
    def resident_bytes(self) -> int | None:
        """Both splits held whole (``loader.resident=true``): uint8 pixels and int64 labels for a built-in source, the
        first batch's bytes per sample for a user's; None where nothing can be held: an iterable dataset, or items
        that are not tensors alone."""
        if self.iterable or self.train_size is None or self.val_size is None:
            return None
        per = math.prod(self.in_shape or ()) + 8 if self.builtin else self.sample_bytes
        return None if per is None else (self.train_size + self.val_size) * per


@dataclass
class DataBundle:
    spec: DataSpec
    train: Dataset
    val: Dataset
    collate: Callable[[list[Any]], Any] | None = None  # None: torch's default (built-in sources)
    split_batch: Callable[[Any, int], list[Any]] | None = None  # the user's hook for the OOM fallback
    first: tuple[Any, Any] | None = None  # the first training items as a batch (data=custom; built-ins: first_batch)


def load_data(cfg: DataConfig, *, batch_size: int | None = None, long_targets: bool = False) -> DataBundle:
    """Read (or make) the configured dataset; the user's factory receives ``batch_size`` where it names it, and their
    integer targets become int64 with ``long_targets`` (``pipeline.data.custom``).

    Raises:
        DatasetError: files are missing and could not be downloaded, or the folder is unusable.
    """
    if cfg.name == "custom":
        return _custom(cfg, batch_size=batch_size, long_targets=long_targets)
    _check_room(cfg)
    if cfg.name == "digits":
        bundle = _digits(cfg)
    elif cfg.name in ("mnist", "fashion_mnist", "cifar10"):
        bundle = _torchvision(cfg)
    elif cfg.name == "imagefolder":
        bundle = _imagefolder(cfg)
    else:
        bundle = _synthetic(cfg)
    _warn_few_val(cfg, bundle.spec)
    return bundle


def _check_room(cfg: DataConfig) -> None:
    """Refuse data the config makes too large for the host's memory, before it is made
    (``pipeline.common.device_memory``)."""
    if cfg.name == "digits":
        side = cfg.image_size or DIGITS_SIDE
        needs = DIGITS_SAMPLES * side * side * (FLOAT32 + 1)  # the upsampled floats, then the uint8 images
        check_data(
            f"data=digits at data.image_size={side}",
            needs,
            f"use a smaller data.image_size (the default is {DIGITS_SIDE})",
        )
    elif cfg.name == "synthetic":
        shape, n_train, n_val = _synthetic_sizes(cfg)
        samples = n_train + n_val
        check_data(
            f"data=synthetic with {samples:,} samples of {list(shape)}",
            samples * math.prod(shape),
            "use fewer data.num_samples or data.val_samples, or a smaller data.shape",
        )


def _warn_few_val(cfg: DataConfig, spec: DataSpec) -> None:
    """Warn when val/acc is too coarse to tell runs apart: with n samples it moves in steps of 1/n."""
    n = spec.val_size
    if n is None or spec.train_size is None or n >= MIN_VAL_SAMPLES:
        return
    if cfg.name == "synthetic":
        fix = f"data.val_samples >= {MIN_VAL_SAMPLES}"
    elif cfg.name in ("digits", "imagefolder"):
        total = spec.train_size + n
        least = math.ceil(MIN_VAL_SAMPLES / total * 1000) / 1000
        fix = f"data.val_fraction >= {least:g}" if least < 1 else f"more than {total} samples"
    else:
        fix = f"a test split of {MIN_VAL_SAMPLES} or more samples"
    log.warning(
        "only %d validation sample%s: val/acc moves in steps of %s%% (1/%d), too coarse to compare runs by; "
        "hold out at least %d (%s)",
        n,
        "" if n == 1 else "s",
        f"{100 / n:.3g}",
        n,
        MIN_VAL_SAMPLES,
        fix,
    )


def tensor_bundle(
    name: str,
    *,
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
    num_classes: int,
    source: str,
    mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
    classes: tuple[str, ...] | None = None,
) -> DataBundle:
    """Wrap in-memory uint8 images ``[N, C, H, W]`` and labels; ``mean_std``: each channel's mean and standard
    deviation, on a 0-1 scale, that normalise them (none: the train split's)."""
    images, labels = train
    if mean_std is None:
        pixels = images.float().div_(255)
        mean = tuple(pixels.mean(dim=(0, 2, 3)).tolist())
        std = tuple(pixels.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist())
    else:
        mean, std = mean_std
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
        classes=classes,
    )
    return DataBundle(spec, TensorDataset(*train), TensorDataset(*val))


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as ``load_digits`` gives them: ``(images [1797, 8, 8] float, labels int)``.

    Read from the CSV that ships inside scikit-learn, without importing ``sklearn.datasets``: that import costs
    1-3 s (the rest of the library and what it imports), longer than the default run's whole training. ``load_digits``
    reads the same file, and is used if a future scikit-learn moves it.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    folders = spec.submodule_search_locations if spec else None
    bundled = Path(folders[0], "datasets", "data", "digits.csv.gz") if folders else None
    if bundled is None or not bundled.is_file():
        log.debug("scikit-learn's digits.csv.gz not found: reading the digits through sklearn.datasets")
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target
    table = np.loadtxt(bundled, delimiter=",")
    return table[:, :-1].reshape(-1, DIGITS_SCAN, DIGITS_SCAN), table[:, -1].astype(int)


def _digits(cfg: DataConfig) -> DataBundle:
    import torch.nn.functional as F

    images_8x8, targets = digits_arrays()
    pixels = torch.from_numpy(images_8x8).float().unsqueeze(1) / 16.0  # 0..16 ink levels
    size = cfg.image_size or DIGITS_SIDE
    pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
    images = (pixels.clamp(0, 1) * 255).round().to(torch.uint8)
    labels = torch.from_numpy(targets).long()
    train_idx, val_idx = split_indices(len(labels), cfg.val_fraction or 0.2)
    return tensor_bundle(
        "digits",
        train=(images[train_idx], labels[train_idx]),
        val=(images[val_idx], labels[val_idx]),
        num_classes=10,
        source="sklearn.datasets.load_digits",
        classes=tuple(str(d) for d in range(10)),
    )


def split_indices(n: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed-seed shuffle of ``range(n)`` cut into train and val indices, neither of them empty.

    Raises:
        DatasetError: ``val_fraction`` of ``n`` samples leaves none to train on, or ``n < 2``.
    """
    if n < 2:
        raise DatasetError(f"{n} sample(s): need at least 2, one to train on and one to validate")
    n_val = max(1, round(n * val_fraction))  # at least one: val is never empty
    if n_val >= n:
        most = math.floor((n - 1) / n * 10_000) / 10_000  # rounds n * most down to n - 1 at most
        raise DatasetError(
            f"data.val_fraction={val_fraction} holds out {n_val} of the {n} samples and leaves none to train on: "
            f"use a value <= {most} (the default is 0.2)"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    return order[n_val:], order[:n_val]


def _torchvision(cfg: DataConfig) -> DataBundle:
    """MNIST, Fashion-MNIST or CIFAR-10 from ``data.root``, downloaded by torchvision when missing (``archives``)."""
    root = Path(cfg.root or "data").expanduser()
    (train, val), num_classes = read_published(cfg.name, root, download=bool(cfg.download))
    return tensor_bundle(
        cfg.name,
        train=train,
        val=val,
        num_classes=num_classes,
        source=str(root.resolve()),
        mean_std=_STATS[cfg.name],
        classes=CLASSES.get(cfg.name),
    )


def _imagefolder(cfg: DataConfig) -> DataBundle:
    root = Path(cfg.root or "").expanduser()
    size, channels = cfg.image_size or 64, cfg.channels or 3
    folder = image_folder(root, size=size, channels=channels)
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
        classes=tuple(folder.classes),
        class_to_idx=dict(folder.class_to_idx),
    )
    return DataBundle(spec, Subset(folder, train_idx.tolist()), Subset(folder, val_idx.tolist()))


def _synthetic_sizes(cfg: DataConfig) -> tuple[tuple[int, ...], int, int]:
    """data=synthetic's sample shape, training and validation samples (defaults: MNIST's shape, 10,000, 1,000)."""
    return tuple(cfg.shape or (1, 28, 28)), cfg.num_samples or 10_000, cfg.val_samples or 1_000


def _synthetic(cfg: DataConfig) -> DataBundle:
    shape, n_train, n_val = _synthetic_sizes(cfg)
    classes = cfg.num_classes or 10
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
        mean_std=((0.5,) * shape[0], (0.2887,) * shape[0]),
        source=f"synthetic: uniform uint8 {list(shape)}, {classes} classes, seed {SPLIT_SEED}",
    )


def _custom(cfg: DataConfig, *, batch_size: int | None, long_targets: bool) -> DataBundle:
    """The user's datasets (``pipeline.data.custom``), described by their first batch (one sample's shape: the
    batch's without ``data.batch_dim``)."""
    made = custom.load(cfg, batch_size=batch_size, long_targets=long_targets)
    inputs = made.first[0]
    sample = (
        tuple(d for i, d in enumerate(inputs.shape) if i != cfg.batch_dim) if isinstance(inputs, torch.Tensor) else None
    )
    spec = DataSpec(
        name=target_label(cfg._target_),
        in_shape=sample,
        num_classes=made.num_classes,
        train_size=_length(made.train),
        val_size=_length(made.val),
        mean=None,
        std=None,
        source=made.source,
        digest=made.digest,
        classes=made.classes,
        class_to_idx=made.class_to_idx,
        inputs=structures.describe(inputs),
        iterable=made.iterable,
        sample_bytes=structures.sample_bytes(made.first),
    )
    return DataBundle(spec, made.train, made.val, made.collate, made.split_batch, made.first)


def _length(dataset: Any) -> int | None:
    """A dataset's ``len()``; None for an iterable dataset that has none."""
    try:
        return len(dataset)
    except TypeError:
        return None


def _tensor_digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:8]
