"""Image folders (``data=imagefolder``): checked before any run starts, and every decode error naming its file."""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.common.errors import DatasetError
from pipeline.common.messages import brief

log = logging.getLogger(__name__)


def image_folder(root: Path, *, size: int, channels: int) -> Any:
    """torchvision's ``ImageFolder`` of ``root`` (one sub-folder per class), resized to ``size`` px, checked.

    Raises:
        DatasetError: not a folder, fewer than two classes or images, an empty class, a damaged image.
    """
    from torchvision import datasets, transforms

    if not root.is_dir():
        raise DatasetError(f"data.root={str(root)!r} is not a folder (data=imagefolder needs one sub-folder per class)")
    steps = [transforms.Resize((size, size))]
    if channels == 1:
        steps.append(transforms.Grayscale(1))
    steps.append(transforms.PILToTensor())
    try:  # allow_empty: an empty class folder is reported below, by its path
        folder = datasets.ImageFolder(
            str(root), transform=transforms.Compose(steps), loader=_ImageLoader(), allow_empty=True
        )
    except (FileNotFoundError, OSError) as err:
        raise DatasetError(f"data=imagefolder: {err} (expected {root}/<class>/<image>.png|jpg)") from err
    _check_classes(folder, root)
    _check_images([path for path, _ in folder.samples])
    return folder


def _check_classes(folder: Any, root: Path) -> None:
    """At least two class folders, none of them without images, and two images in all."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    counts = Counter(folder.targets)
    empty = [name for i, name in enumerate(folder.classes) if counts[i] == 0]
    if empty:
        others = f" (so do {', '.join(empty[1:])})" if len(empty) > 1 else ""
        raise DatasetError(
            f"data=imagefolder: class folder {root / empty[0]} holds no images{others} ({', '.join(IMG_EXTENSIONS)}): "
            f"add some, or move it out of {root}"
        )
    if len(folder) < 2:
        raise DatasetError(
            f"data=imagefolder: {root} holds {len(folder)} image in total: need at least 2, one to train on and one "
            "to validate"
        )
    if len(folder.classes) < 2:
        raise DatasetError(
            f"data=imagefolder: {root} has only one class folder ({folder.classes[0]}/): a classifier needs at least "
            "2 classes, one sub-folder of images each"
        )


def _check_images(paths: list[str]) -> None:
    """Open each image and ``verify()`` it, so a damaged file stops the run before it starts.

    Cost: no pixels are decoded; verify() reads a PNG through all its chunks (their CRCs; a cut-short
    file shows) and a JPEG's header only. About 30 us a small image and 80 us a 150 KB PNG with the
    files in the page cache (a decode costs 2-10x more): ~2 s per 60,000 images, plus a cold disk's
    read time. What verify() cannot see (a cut-short JPEG) fails when decoded, naming the file too
    (``_ImageLoader``).
    """
    from PIL import Image

    started = time.perf_counter()
    for path in paths:
        try:
            with Image.open(path) as image:
                image.verify()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise DatasetError(
                f"data=imagefolder: {path}: cannot be read as an image ({_cause(err)}): delete or replace it"
            ) from err
    seconds = time.perf_counter() - started
    if seconds > 1:
        log.info("data=imagefolder: checked %d images in %.1f s", len(paths), seconds)


def _cause(err: BaseException) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(err, UnidentifiedImageError):  # its message repeats the path as a file object's repr
        return "not in a format Pillow can open"
    return brief(err, limit=200)


class UndecodableImage(DatasetError):
    """An image that fails to decode, raised in whichever process decodes it.

    A DataLoader worker's error reaches the main process as ``type(err)(text)`` with text
    "Caught UndecodableImage in DataLoader worker process 0.\\nOriginal Traceback ..."; this keeps
    only the original one-line message from its last line, so the CLI still prints one line.
    """

    def __init__(self, message: str) -> None:
        if "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit("\n", 1)[-1].split(f"{UndecodableImage.__name__}: ", 1)[-1]
        super().__init__(message)


class _ImageLoader:
    """ImageFolder's loader, with a decode error naming the file (a class, so worker processes can unpickle it)."""

    def __call__(self, path: str) -> Any:
        from PIL import Image
        from torchvision.datasets.folder import default_loader

        try:
            return default_loader(path)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise UndecodableImage(
                f"data=imagefolder: {path}: cannot be decoded as an image ({_cause(err)}): delete or replace it"
            ) from err
