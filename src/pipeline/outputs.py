"""Hydra's output folders (``hydra.run.dir``, ``hydra.sweep.dir``), made before anything else is.

Hydra makes them itself once a run or a sweep has begun, and a folder it cannot make (a read-only working
directory, a path through a file) ends in its traceback, after a sweep's parent run was opened. The ``sweep``
callback (``pipeline.sweep.SweepCallback``) makes them first, and says in one line what is wrong.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline.errors import ConfigError


def make_output_folder(hydra: DictConfig, key: str) -> Path:
    """Make Hydra's output folder ``key`` (``hydra.run.dir`` or ``hydra.sweep.dir``), relative to where the command
    was launched; returns it, absolute.

    Raises:
        ConfigError: the folder cannot be made or written to, naming why and what to do.
    """
    value = str(hydra.run.dir if key == "hydra.run.dir" else hydra.sweep.dir)
    folder = Path(str(hydra.runtime.cwd), value)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{id(folder)}"
        probe.touch()  # a folder that exists may still be read-only (a mount, permissions)
        probe.unlink()
    except OSError as err:
        reason = f"{err.strerror or type(err).__name__}: {err.filename or folder}"
        raise ConfigError(
            key,
            value,
            f"a folder that can be made and written to ({reason}); launch from a folder you can write to, or set "
            f"{key}=<a writable folder>",
        ) from None
    return folder
