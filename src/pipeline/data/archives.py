"""The published datasets' files (MNIST, Fashion-MNIST, CIFAR-10), read and checked here, not by torchvision.

A damaged file stops the run with its name and what is wrong with it (torchvision fails with a
bare assert, or an ``IndexError`` mid-training); missing files are listed with the folder they
belong in. Each file is read once, as torchvision would read it; downloading is torchvision's.
A pickle is a program (unpickling CIFAR-10's batches may run any code they name), so each is
unpickled only once its bytes have the published MD5.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.common.errors import DatasetError
from pipeline.common.messages import brief

Split = tuple[torch.Tensor, torch.Tensor]  # uint8 images [N, C, H, W], int64 labels [N]


def read_published(name: str, root: Path, *, download: bool) -> tuple[tuple[Split, Split], int]:
    """The train and validation splits of ``name`` under ``root``, and its number of classes.

    Raises:
        DatasetError: files missing (and not downloaded), or damaged; the message names them.
    """
    folder, expected = expected_files(name, root)
    gz = name != "cifar10"  # MNIST's idx files are published gzipped and read either way; CIFAR's are not
    missing = [f for f in expected if _find(folder / f, gz=gz) is None]
    if missing and download:
        try:
            _download(name, root)
        except (RuntimeError, OSError) as err:  # URLError is an OSError
            cause = " ".join(str(err).split())[:400]  # torchvision's messages span lines
            raise DatasetError(_missing(name, root, missing, f"the download failed ({cause})")) from err
        missing = [f for f in expected if _find(folder / f, gz=gz) is None]
    if missing:
        how = "the download did not bring them" if download else "data.download=false"
        raise DatasetError(_missing(name, root, missing, how))
    read = _read_cifar10 if name == "cifar10" else _read_mnist
    return read(name, folder)


def expected_files(name: str, root: Path) -> tuple[Path, list[str]]:
    """The folder torchvision reads ``name`` from, and the files it needs there."""
    import torchvision.datasets as tvd

    if name == "cifar10":
        cls = tvd.CIFAR10
        return root / cls.base_folder, [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST}[name]
    return root / cls.__name__ / "raw", [Path(url).stem for url, _ in cls.resources]


def _find(path: Path, *, gz: bool = True) -> Path | None:
    """``path``, or (``gz``) its gzipped copy ``path.gz`` as MNIST's files are published, if either is a file."""
    for candidate in (path, path.with_name(f"{path.name}.gz"))[: 2 if gz else 1]:
        if candidate.is_file():
            return candidate
    return None


def _missing(name: str, root: Path, missing: list[str], how: str) -> str:
    folder, expected = expected_files(name, root)
    holder = folder.relative_to(root).parts[0]  # MNIST, FashionMNIST, cifar-10-batches-py
    gz = " (each may be gzipped, .gz)" if name != "cifar10" else ""
    message = (
        f"data={name}: files missing under {folder} and {how}: {', '.join(missing)}{gz}. "
        f"Put them there (or point data.root at the folder that holds {holder}/)"
    )
    return message + _found_inside(folder, root, expected[0])


def _found_inside(folder: Path, root: Path, first: str) -> str:
    """A hint when data.root points into the dataset's own folder (at MNIST/raw, say) rather than above it."""
    inner, here = folder.relative_to(root).parts, root.absolute()
    for depth in range(len(inner), 0, -1):  # data.root=.../MNIST/raw, then data.root=.../MNIST
        files = here.joinpath(*inner[depth:])
        if here.parts[-depth:] == inner[:depth] and _find(files / first) is not None:
            return f"; found them in {files}: use data.root={here.parents[depth - 1]}"
    return ""


def _download(name: str, root: Path) -> None:
    """torchvision's download alone: its constructors would also read every file (bare asserts on a bad one)."""
    import torchvision.datasets as tvd

    cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10}[name]
    dataset = cls.__new__(cls)
    dataset.root = str(root)  # all that download() reads besides the class's URLs and checksums
    dataset.download()


def _damaged(name: str, path: Path, what: str) -> DatasetError:
    return DatasetError(
        f"data={name}: {path}: {what}; delete it and rerun with data.download=true to fetch it again, "
        "or copy a good one there"
    )


_IDX_MAGIC = {"images": 0x00000803, "labels": 0x00000801}  # 0x08 = uint8 values, then 3 or 1 dimensions


def _read_mnist(name: str, folder: Path) -> tuple[tuple[Split, Split], int]:
    """The train and t10k idx files of MNIST or Fashion-MNIST, checked: header, sizes, counts, labels 0..9."""
    splits: list[Split] = []
    for split in ("train", "t10k"):
        images_path, images = _read_idx(name, folder / f"{split}-images-idx3-ubyte", "images")
        labels_path, labels = _read_idx(name, folder / f"{split}-labels-idx1-ubyte", "labels")
        if len(labels) != len(images):
            raise _damaged(
                name,
                labels_path,
                f"{len(labels)} labels for the {len(images)} images in {images_path.name}: the two files must hold "
                "the same samples",
            )
        _check_labels(name, labels_path, labels, 10)
        if splits and images.shape[1:] != splits[0][0].shape[2:]:
            size, train_size = "x".join(map(str, images.shape[1:])), "x".join(map(str, splits[0][0].shape[2:]))
            raise _damaged(name, images_path, f"{size} images, but the training images are {train_size}")
        splits.append((images.unsqueeze(1), labels.long()))
    return (splits[0], splits[1]), 10


def _read_idx(name: str, path: Path, kind: str) -> tuple[Path, torch.Tensor]:
    """One idx file (or its .gz), whose header must match its size: one read of the bytes, ~30 ms for 60,000 images."""
    path = _find(path) or path
    data = _read_bytes(name, path)
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:  # BadGzipFile is an OSError; a stream cut short raises EOFError
            raise _damaged(name, path, f"is not a complete gzip file ({err})") from err
    if not data:
        raise _damaged(name, path, "is empty (0 bytes)")
    magic, found = _IDX_MAGIC[kind], int.from_bytes(data[:4].ljust(4, b"\0"), "big")
    if found != magic:
        other = {v: k for k, v in _IDX_MAGIC.items()}.get(found)
        what = f"an idx {other} file" if other else f"not an MNIST-format {kind} file"
        raise _damaged(name, path, f"starts with 0x{found:08x} where an idx {kind} file has 0x{magic:08x}: {what}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    dims = struct.unpack(f">{ndim}I", data[4:header]) if len(data) >= header else ()
    size = header + math.prod(dims)
    if len(data) != size:
        cut = "is truncated" if len(data) < size else "is longer than its header says"
        raise _damaged(name, path, f"{cut}: {len(data)} bytes where its header (dims {list(dims)}) needs {size}")
    if size == header:
        what = "0 samples" if dims[0] == 0 else "images of 0 pixels"
        raise _damaged(name, path, f"holds {what} (header dims {list(dims)})")
    # a copy (bytearray), as torchvision makes: the tensor must own writable memory
    return path, torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header).view(*dims)


def _read_bytes(name: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:  # a folder named like the file, no permission
        raise DatasetError(f"data={name}: {path}: cannot be read ({err})") from err


def _check_labels(name: str, path: Path, labels: torch.Tensor, num_classes: int) -> None:
    bad = ((labels < 0) | (labels >= num_classes)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise _damaged(name, path, f"label {int(labels[i])} (sample {i}) is outside 0..{num_classes - 1}")


def _read_cifar10(name: str, folder: Path) -> tuple[tuple[Split, Split], int]:
    """The CIFAR-10 batches and batches.meta, checked: torchvision's checksums first, then keys, shapes, labels.

    Costs what torchvision's reader costs: one read, one MD5 and one unpickle of each file (~0.3 s).
    """
    import torchvision.datasets as tvd

    cls = tvd.CIFAR10
    meta_path = folder / cls.meta["filename"]
    meta = _unpickle(name, meta_path, cls.meta["md5"])
    key = cls.meta["key"]
    if not isinstance(meta, dict) or key not in meta:
        raise _damaged(name, meta_path, f"has no {key!r} key: not CIFAR-10's class list")
    num_classes = len(meta[key])
    splits = []
    for files in (cls.train_list, cls.test_list):
        parts = [_cifar_batch(name, folder / file, md5, num_classes) for file, md5 in files]
        splits.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return (splits[0], splits[1]), num_classes


def _cifar_batch(name: str, path: Path, md5: str, num_classes: int) -> Split:
    batch = _unpickle(name, path, md5)
    for key in ("data", "labels"):
        if not isinstance(batch, dict) or key not in batch:
            raise _damaged(name, path, f"has no {key!r} key: not a CIFAR-10 batch")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        shape = getattr(data, "shape", type(data).__name__)
        raise _damaged(name, path, f"its 'data' is {shape}, not N x 3072 uint8 (one 3x32x32 image per row)")
    if len(data) == 0:
        raise _damaged(name, path, "holds 0 images")
    if len(batch["labels"]) != len(data):
        raise _damaged(name, path, f"{len(batch['labels'])} labels for {len(data)} images")
    labels = torch.tensor(batch["labels"], dtype=torch.long)
    _check_labels(name, path, labels, num_classes)
    return torch.from_numpy(data).view(-1, 3, 32, 32), labels


def _unpickle(name: str, path: Path, md5: str) -> Any:
    """The object pickled in ``path``, once its bytes have the published checksum ``md5``.

    Unpickling runs whatever code the file names (a crafted ``__reduce__`` can write files or start programs), so
    only bytes that are the published ones are unpickled: the check comes first, on the same bytes (one read).
    """
    raw = _read_bytes(name, path)
    _check_md5(name, path, raw, md5)
    try:
        return pickle.loads(raw, encoding="latin1")  # verified: _check_md5 (CIFAR's pickles are Python 2's)
    except Exception as err:  # unpickling damaged bytes can raise almost any type: all mean "damaged"
        cause = brief(err, limit=200)
        raise _damaged(name, path, f"cannot be unpickled ({cause}): it is truncated or not a CIFAR-10 file") from err


def _check_md5(name: str, path: Path, raw: bytes, md5: str) -> None:
    """torchvision's integrity check, before anything is unpickled: it refuses any file but the published one."""
    digest = hashlib.md5(raw).hexdigest()
    if digest != md5:
        raise _damaged(name, path, f"its checksum (md5 {digest}) is not the published {md5}: damaged or another file")
