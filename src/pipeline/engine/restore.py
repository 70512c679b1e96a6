"""Putting a checkpoint back into a run's training state, once ``pipeline.engine.resume`` has found and checked it:
weights, optimizer, schedule, scaler, micro-batch, a step hook's state, step and random state, with this config's
hyper-parameters.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pipeline.common.messages import brief
from pipeline.config import OptimizerConfig, flatten
from pipeline.engine.checkpoint import CheckpointError, set_rng_state
from pipeline.parallel.overlap import unwrap

if TYPE_CHECKING:
    from pipeline.engine.start import Resumed  # its own module imports this one

log = logging.getLogger(__name__)


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
