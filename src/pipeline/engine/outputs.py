"""Hydra's output folders (``hydra.run.dir``, ``hydra.sweep.dir``), made before anything else is.

Hydra makes them itself once a run or a sweep has begun, and a folder it cannot make (a read-only working
directory, a path through a file) ends in its traceback, after a sweep's parent run was opened. The ``sweep``
callback (``pipeline.experiments.sweep.SweepCallback``) makes them first, and says in one line what is wrong.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.common.errors import ConfigError
from pipeline.common.messages import brief

if TYPE_CHECKING:
    from omegaconf import DictConfig


def make_writable(folder: Path) -> None:
    """Make ``folder`` (and its parents) and prove a file can be written in it: a folder that exists may still be
    read-only (a mount, permissions, a full disk). The one check of this kind (output folders, checkpoints).

    Raises:
        OSError: it cannot be made or written to.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):  # a create and a delete: the cheapest proof of writing
        pass


def make_output_folder(hydra: DictConfig, key: str) -> Path:
    """Make Hydra's output folder ``key`` (``hydra.run.dir`` or ``hydra.sweep.dir``), relative to where the command
    was launched; returns it, absolute.

    Raises:
        ConfigError: the folder cannot be made or written to, naming why and what to do.
    """
    value = str(hydra.run.dir if key == "hydra.run.dir" else hydra.sweep.dir)
    folder = Path(str(hydra.runtime.cwd), value)
    try:
        make_writable(folder)
    except OSError as err:
        reason = f"{err.strerror}: {err.filename or folder}" if err.strerror else brief(err)
        raise ConfigError(
            key,
            value,
            f"a folder that can be made and written to ({reason}); launch from a folder you can write to, or set "
            f"{key}=<a writable folder>",
        ) from None
    return folder
