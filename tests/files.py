"""Dataset files written by tests: MNIST-format idx files, CIFAR-10 pickles, folders of PNGs."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image

MNIST_FILES = {
    "train-images-idx3-ubyte": ("images", True),
    "train-labels-idx1-ubyte": ("labels", True),
    "t10k-images-idx3-ubyte": ("images", False),
    "t10k-labels-idx1-ubyte": ("labels", False),
}


def idx_bytes(array: np.ndarray) -> bytes:
    """The idx format: magic (0, 0, dtype 0x08 = uint8, ndim), big-endian dims, then the bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def mnist_arrays(n_train: int, n_val: int, seed: int = 0) -> dict[bool, tuple[np.ndarray, np.ndarray]]:
    """Images whose brightest row encodes the label, so a model can learn them."""
    rng = np.random.default_rng(seed)
    out = {}
    for train, n in ((True, n_train), (False, n_val)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
        images[np.arange(n), labels * 2 + 4, :] = 255
        out[train] = (images, labels)
    return out


def write_mnist(root: Path, folder: str = "MNIST", n_train: int = 256, n_val: int = 64, gz: bool = False) -> Path:
    """Write the four idx files torchvision reads into ``root/folder/raw``; returns that folder."""
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    arrays = mnist_arrays(n_train, n_val)
    for name, (kind, train) in MNIST_FILES.items():
        images, labels = arrays[train]
        data = idx_bytes(images if kind == "images" else labels)
        if gz:
            (raw / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (raw / name).write_bytes(data)
    return raw


def write_cifar10(root: Path, per_batch: int = 20, n_val: int = 20) -> dict[str, str]:
    """Write cifar-10-batches-py/ with tiny batches; returns {file name: md5} for the integrity check."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_val if name == "test_batch" else per_batch
        batch = {
            "data": rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8),
            "labels": rng.integers(0, 10, n).tolist(),
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": classes}))
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def write_image_folder(
    root: Path, classes: tuple[str, ...] = ("cat", "dog", "fox"), per_class: int = 6, size: int = 20
) -> Path:
    """One sub-folder of PNGs per class, each class a different colour."""
    rng = np.random.default_rng(0)
    for i, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for j in range(per_class):
            pixels = rng.integers(0, 30, (size, size, 3), dtype=np.uint8)
            pixels[..., i % 3] = 200
            Image.fromarray(pixels).save(root / name / f"{j}.png")
    return root


# Damaged inputs: each writes one bad file (or folder) and returns its path, for tests/test_bad_data.py.


def truncate(path: Path, keep: float = 0.5) -> Path:
    """Cut ``path`` to its first ``keep`` share of bytes, as an interrupted copy or download leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def write_random_bytes(path: Path, size: int = 1000, seed: int = 0) -> Path:
    """Replace ``path`` with ``size`` random bytes (0 writes an empty file)."""
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


def write_idx(path: Path, array: np.ndarray, magic: int | None = None) -> Path:
    """Replace ``path`` with an idx file of ``array``; ``magic`` overrides the first four bytes."""
    data = idx_bytes(array)
    if magic is not None:
        data = struct.pack(">I", magic) + data[4:]
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def write_pickle(path: Path, obj: object) -> Path:
    """Replace ``path`` with ``obj`` pickled, e.g. a CIFAR-10 batch with a key missing."""
    path.write_bytes(pickle.dumps(obj))
    return path


def write_image(path: Path, size: int = 20, seed: int = 0) -> Path:
    """One random RGB image; the suffix picks the format (.png, .jpg)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return path
