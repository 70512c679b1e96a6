"""Where a run starts: ``FreshStart`` (step 0, a new MLflow run) or ``Resumed`` (a checkpoint to continue, in the
same run or, ``fork=true``, a new one): a null-object pair, so the orchestrator (``pipeline.train``) asks its start
point instead of testing whether it resumed. ``pipeline.engine.checkpointing.resume.start_point`` picks one. A resumed
run puts its checkpoint back into the training state (``restore``): weights, optimizer, schedule, scaler, micro-batch, a
step hook's state, step and random state, with this config's hyper-parameters."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.common.messages import brief
from pipeline.common.metric_names import TRAIN_LOSS
from pipeline.config import OptimizerConfig, flatten
from pipeline.engine.checkpointing.checkpoint import CheckpointError, Position, RunLock, set_rng_state
from pipeline.monitor import CLOCK_KEY
from pipeline.parallel.overlap import unwrap

log = logging.getLogger("pipeline.engine.start")  # the name its lines have always shown


class FreshStart:
    """A run from step 0: nothing to restore, lock or describe, a new MLflow run."""

    position = Position(1, 0, 0)
    run_id: str | None = None  # a new MLflow run is opened
    lock: RunLock | None = None
    same_run = False  # a new run: it records its params, config and environment
    from_checkpoint = False  # a stop before the first checkpoint leaves nothing to continue

    def __enter__(self) -> FreshStart:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def restore(self, state: Any, device: torch.device, optimizer: OptimizerConfig) -> None:
        pass  # fresh weights, as built

    def record_tags(self, tracker: Any, overrides: list[str]) -> dict[str, Any]:
        return {}

    def run_tags(self, tags: dict[str, Any]) -> dict[str, Any]:
        return tags

    def continue_record(self, tracker: Any) -> None:
        pass

    def sampler_after(self, tracker: Any) -> int:
        return 0  # the utilisation timeline's steps start at 0


@dataclass
class Resumed:
    """A checkpoint that this run may continue, and how."""

    path: Path
    saved: dict[str, Any]  # the checkpoint's payload
    changes: dict[str, tuple[Any, Any]]  # dotted key -> (checkpoint's value, this run's)
    fork: bool  # continue in a new MLflow run
    lock: RunLock | None  # held while the same run trains (None for a fork: the source is only read)

    def __enter__(self) -> Resumed:
        return self

    def __exit__(self, *exc: object) -> None:
        """The run ended (or never started): let others train it again."""
        if self.lock is not None:
            self.lock.release()

    @property
    def position(self) -> Position:
        return self.saved["position"]

    @property
    def same_run(self) -> bool:
        """The same MLflow run continues (not a fork): its params are fixed, its record only grows."""
        return not self.fork

    from_checkpoint = True  # a stop before the next checkpoint leaves this one to continue from

    def restore(self, state: Any, device: torch.device, optimizer: OptimizerConfig) -> None:
        """Weights, optimizer, schedule, scaler, micro-batch, step and RNG back into ``state``
        (``restore``)."""
        restore(state, self, device, optimizer)

    def record_tags(self, tracker: Any, overrides: list[str]) -> dict[str, Any]:
        """``tags``, with the run's highest logged ``train/loss`` step read from ``tracker``."""
        return self.tags(overrides, logged_step=tracker.last_step(TRAIN_LOSS))

    def run_tags(self, tags: dict[str, Any]) -> dict[str, Any]:
        """The run's tags: the same run keeps the overrides it started with (``resume.overrides`` holds these)."""
        return {k: v for k, v in tags.items() if k != "overrides"} if self.same_run else tags

    def continue_record(self, tracker: Any) -> None:
        if self.same_run:
            tracker.log_only_new_steps()  # steps trained again after the checkpoint keep their first points

    def sampler_after(self, tracker: Any) -> int:
        """The step the utilisation timeline continues after: the same run's last, else 0."""
        return (tracker.last_step(CLOCK_KEY) or 0) if self.same_run else 0

    @property
    def run_id(self) -> str | None:
        """The MLflow run to continue; None for a fork (a new run is opened)."""
        return None if self.fork else self.saved["run_id"]

    @property
    def source(self) -> str:
        return self.saved["run_id"] or self.saved["run_name"]

    def tags(self, overrides: list[str], *, logged_step: int | None) -> dict[str, Any]:
        """What the record says about this resume: where it continued and what changed.

        Args:
            overrides: the command line of this resume, as typed (masked).
            logged_step: the run's highest ``train/loss`` step in the store; above the checkpoint's step, steps
                a writer logged before the process died are trained again but not logged again
                (``Tracker.log_only_new_steps``): said so.
        """
        step, changed = self.position.step, describe_changes(self.changes) or "(nothing)"
        if self.fork:  # a new run with its own params, starting where its source stopped
            return {"forked_from": self.source, "forked_at_step": step, "fork.changed": changed}
        tags = {"resumed_at_step": step, "resume.overrides": " ".join(overrides), "resume.changed": changed}
        if logged_step is not None and logged_step > step:
            tags["resume.replayed_steps"] = (
                f"{step + 1}-{logged_step}: trained again after resuming, not logged again (the points logged "
                "before stand)"
            )
        return tags


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def restore(state: Any, resumed: Resumed, device: torch.device, optimizer_cfg: OptimizerConfig) -> None:
    """Put a checkpoint back into a ``loop.TrainState``: weights, optimizer, schedule, scaler, micro-batch, step, RNG.

    The optimizer's hyper-parameters are this run's (``check_resumable`` let them differ only for a fork); a fork's
    new ``optimizer.lr`` under a schedule scales the schedule (its base and its current rate) by new / old.
    The data order needs nothing: it is the epoch's (``pipeline.data.loaders.EpochOrder``).

    Raises:
        CheckpointError: the states do not fit this model, optimizer or schedule (named with the file).
    """
    saved = resumed.saved
    try:
        unwrap(state.model).load_state_dict(saved["model"])  # whatever either side wrapped
        state.optimizer.load_state_dict(saved["optimizer"])
        state.scheduler.load_state_dict(saved["scheduler"])
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        first = brief(err, first_line=True, with_type=False)
        raise CheckpointError(
            f"{resumed.path} does not fit this model, optimizer and schedule ({first}): resume with the config it "
            f"was written with, or start a new run"
        ) from err
    _hyperparameters(state, optimizer_cfg, was=flatten(saved["config"]).get("optimizer.lr"))
    if saved["scaler"] and state.scaler.is_enabled():  # a disabled GradScaler saves {} and loads nothing
        state.scaler.load_state_dict(saved["scaler"])
    state.micro.micro_batch = saved["micro_batch"]
    state.context.state.update(saved.get("step_state", {}))  # a step hook's, mid-epoch (an epoch start empties it)
    state.step = saved["position"].step
    set_rng_state(saved["rng"], device)
    log.info("resuming %s at %s from %s", f"run {resumed.source}", resumed.position, resumed.path)


def _hyperparameters(state: Any, cfg: OptimizerConfig, *, was: Any) -> None:
    """This config's optimizer keywords on the loaded optimizer (a fork may change them)."""
    for group in state.optimizer.param_groups:
        group.update({k: v for k, v in cfg.keywords.items() if k in group and k != "lr"})
    lr = cfg.lr
    if lr is None:
        return
    if state.scheduler.inner is None:
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        return
    if isinstance(was, int | float) and was > 0 and was != lr:  # the schedule decides the rate: scale it
        ratio = lr / was
        for group in state.optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        if hasattr(state.scheduler.inner, "base_lrs"):
            state.scheduler.inner.base_lrs = [base * ratio for base in state.scheduler.inner.base_lrs]
