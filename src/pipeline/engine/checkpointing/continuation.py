"""A resume continues the run's own configuration: the overrides it started with (kept in its checkpoint), plus
only what is typed now, which wins key by key. ``python -m pipeline resume=<run id>`` alone restores the run as it
was; a default never shortens it (a resumed run ends with fewer epochs or steps only when they are typed now).

``continued`` runs before Hydra composes the run's config (``pipeline.__main__.main``), on the command line's
overrides; ``continue_command`` is the command a stopped run prints.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pipeline.common.secrets import MASK
from pipeline.config import RunConfig, load
from pipeline.engine.checkpointing.checkpoint import Checkpointer, CheckpointError, Position
from pipeline.engine.checkpointing.checkpoint import load as load_checkpoint
from pipeline.engine.checkpointing.resume import locate
from pipeline.engine.stopping import Stopped

NOT_KEPT = ("resume", "fork")  # how this process started, not the run's configuration
LENGTH = ("trainer.epochs", "trainer.max_steps")


def key_of(override: str) -> str:
    """``trainer.epochs`` for ``trainer.epochs=3``, ``+model.width=2`` and ``~model.width``."""
    return override.partition("=")[0].lstrip("+~")


def own_overrides(overrides: Sequence[str]) -> list[str]:
    """What a run's checkpoint keeps of the overrides that configured it: all but ``resume=`` and ``fork=``."""
    return [o for o in overrides if key_of(o) not in NOT_KEPT]


def merged(started: Sequence[str], typed_now: Sequence[str]) -> list[str]:
    """The run's overrides with those typed now in place of any of the same key (typed ones last, as typed). A group
    chosen now (``data=digits``) also replaces the run's own keys inside that group (``data.num_samples=4000``): they
    belonged to the option it had, and the comparison with the checkpoint then names the group's change."""
    typed_keys = {key_of(o) for o in typed_now}
    groups = tuple(f"{key}." for key in typed_keys if "." not in key)
    return [*(o for o in started if key_of(o) not in typed_keys and not key_of(o).startswith(groups)), *typed_now]


def continued(typed_now: Sequence[str]) -> tuple[list[str], list[str]]:
    """The overrides a resume runs with, and the run's own overrides for its next checkpoint.

    Args:
        typed_now: the overrides typed now (a ``resume=`` among them).

    Returns:
        ``(merged, own)``: the run's recorded overrides with those typed now in their place, and the same without
        ``resume=``/``fork=``. A checkpoint written before overrides were kept gives ``typed_now`` alone.

    Raises:
        CheckpointError: no such checkpoint; a recorded override whose value was masked (a secret) and is not
            typed again; or a length shorter than the run was started with that is not typed now.
    """
    saved = load_checkpoint(locate(load(typed_now)))
    started = saved.get("overrides")
    typed_keys = {key_of(o) for o in typed_now}
    masked_keys = [key_of(o) for o in started or () if MASK in o and key_of(o) not in typed_keys]
    if masked_keys:
        keys = ", ".join(masked_keys)
        raise CheckpointError(
            f"run {saved['run_id'] or saved['run_name']} was started with {keys} set to a secret, which is never "
            f"recorded: type {' '.join(f'{k}=...' for k in masked_keys)} again with the resume"
        )
    overrides = merged(started or (), typed_now)
    _check_length(saved, load(overrides), typed_keys=typed_keys)
    return overrides, own_overrides(overrides)


def _check_length(saved: Mapping[str, Any], cfg: RunConfig, *, typed_keys: set[str]) -> None:
    """Refuse a resume that would end the run earlier than it was started to, unless that is typed now."""
    started_with = saved["config"]["trainer"]
    lengths_now = {"trainer.epochs": cfg.trainer.epochs, "trainer.max_steps": cfg.trainer.max_steps}
    shorter = {
        key: (started_with[key.split(".")[1]], value)
        for key, value in lengths_now.items()
        if key not in typed_keys and _ends_earlier(key, started_with[key.split(".")[1]], value)
    }
    if shorter:
        listed = "; ".join(f"{k}={a} when it started, {b} now" for k, (a, b) in shorter.items())
        run = saved["run_id"] or saved["run_name"]
        raise CheckpointError(
            f"resume would end run {run} earlier than it was started to ({listed}, from a default): type "
            f"{' '.join(f'{k}={a}' for k, (a, _) in shorter.items())} to keep its length, or the shorter value to "
            f"end it there"
        )


def _ends_earlier(key: str, was: int, now: int) -> bool:
    if key == "trainer.epochs":
        return now < was
    return now > 0 and (was <= 0 or now < was)  # max_steps: -1 = no limit


def continue_command(run: str, own: Sequence[str]) -> str:
    """The command that continues a stopped run: its id, and where its checkpoints are when that was typed
    (the rest of its configuration comes back from the checkpoint)."""
    where = [o for o in own if key_of(o) == "checkpoint.dir"]
    return shlex.join(["python", "-m", "pipeline", f"resume={run}", *where])


@contextlib.contextmanager
def stop_says_how_to_continue(saver: Checkpointer, own: list[str], *, resumed: bool) -> Iterator[None]:
    """A stop leaves the command that continues the run on ``Stopped.command``, once a checkpoint of it exists
    (written now, or the one this resume started from)."""
    try:
        yield
    except Stopped as stop:
        if saver.enabled and (saver.last is not None or resumed):
            stop.command = continue_command(saver.path.parent.name, own)
        raise


class MidwayCheckpoints:
    """An epoch's mid-epoch checkpoints: the checkpointer says which steps are its own (``checkpoint.every_n_steps``).
    Each is written after the metrics up to it: if the process dies now, a resume continues from a step whose
    metrics are all in the record (a write that fails is kept for later)."""

    def __init__(self, saver: Checkpointer, tracker: Any, position: Callable[[int], Position]) -> None:
        self.saver, self.tracker, self.position = saver, tracker, position

    def due(self, step: int) -> bool:
        return self.saver.due(step)

    def save(self, step: int) -> None:
        self.tracker.flush()
        self.saver.write(self.position(step))
