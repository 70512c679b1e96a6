"""Files written whole or not at all: a reader, a crash or a full disk leaves the old file or the new one.

The one writer for every file the pipeline replaces (checkpoints, outbox files, a sweep's job files): a temporary
file in the target's folder is written, flushed and fsynced, renamed over the target (atomic within one folder, on
the shared filesystems ``pipeline.record.filesystems`` accepts too), and the folder is fsynced so that the rename itself
survives a power cut.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class UnwritableFolder(OSError):
    """The target's folder cannot be made or written in (nothing was written)."""


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> Path:
    """Replace ``path`` with what ``write`` writes to the binary file it is given; the folder is made if missing.

    Raises:
        UnwritableFolder: the folder cannot be made or a file created in it.
        OSError, or whatever ``write`` raises: the write failed; ``path`` is as it was, no temporary file is left.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise UnwritableFolder(err.errno, err.strerror or str(err), str(path.parent)) from err
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    """``write_atomic`` for UTF-8 text."""
    data = text.encode("utf-8")
    return write_atomic(path, lambda f: f.write(data))


def fsync_folder(folder: Path) -> None:
    """Make the folder's entries (a rename into it) durable, where the platform can: Windows cannot open a folder,
    and some filesystems refuse to fsync one; the rename is then as durable as they make it."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
