"""Resuming: which checkpoint ``resume=`` names and whether this config may continue it
(``pipeline.engine.checkpointing.start.restore`` puts it back).

Continuing the same MLflow run (the default) may change only how the run runs (``RUNTIME``:
its length, logging, monitoring, loader workers, the device), never what it computes, so the
run's params stay true to everything it trained; anything else is refused in one line that lists
the keys. ``fork=true`` continues the checkpoint in a new MLflow run whose params are the new
config: it may change the hyper-parameters, and it is the only way to train a FINISHED run
further, since a finished run is never changed. Neither may change the shapes (``STRUCTURAL``):
the weights would not fit. Every refusal happens before any data is loaded or any run opened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pipeline.common import usercode
from pipeline.common.uris import absolute
from pipeline.config import RunConfig, flatten
from pipeline.engine.checkpointing.checkpoint import (
    LAST,
    CheckpointError,
    RunLock,
    load,
    read_state,
    store_id,
)
from pipeline.engine.checkpointing.start import FreshStart, Resumed, describe_changes
from pipeline.record import outbox

log = logging.getLogger("pipeline.engine.resume")  # the name its lines have always shown

# Keys whose change makes a checkpoint unusable: the weights', the optimizer state's or the data's shape,
# or what "batch N of the epoch" means.
STRUCTURAL = ("model.", "data.name", "data.shape", "data.image_size", "data.channels", "data.num_classes")
STRUCTURAL_KEYS = ("optimizer._target_", "scheduler._target_", "data._target_", "loader.batch_size")
# What continuing the same run may change: how it runs, not what it computes (prefixes and keys).
RUNTIME = (
    "trainer.epochs",
    "trainer.max_steps",
    "trainer.progress",
    "trainer.log_every_n_steps",
    "trainer.profile",  # and trainer.profile_steps: what is measured, not what is computed
    "trainer.memory_snapshot",
    "monitor.",
    "checkpoint.",
    "loader.num_workers",
    "loader.pin_memory",
    "loader.persistent_workers",
    "loader.prefetch_factor",
    "loader.timeout",
    "loader.resident",  # the same EpochOrder either way
    "loader.prefetch_to_device",  # the same batches, copied ahead
    "loader.multiprocessing_context",  # the same batches, from workers started another way
    "tracking.log_model",  # what the record keeps of the model, not what is trained
    "tracking.model_format",
    "oom.",  # micro-batching keeps the effective batch
    "device.",
    "tracking.tags.",
    "fork",
)
# Not compared: ``resume`` differs by definition; ``model.zero_init_residual`` says only how fresh weights start (a
# resume loads them), and checkpoints from before it hold no such key.
NOT_COMPARED = ("resume", "model.zero_init_residual")
# Keys added after a checkpoint format, with the value that behaves as runs did before them: a checkpoint
# written without the key compares as if it held this value.
ADDED_LATER = {
    "data.augment": "none",
    "data.augment_padding": 4,
    "loader.prefetch_to_device": "auto",
    "loader.multiprocessing_context": "auto",
    "trainer.compile_mode": "default",
    "trainer.profile": False,
    "trainer.profile_steps": 3,
    "trainer.memory_snapshot": "off",
    "loader.shuffle": True,
    "data.batch_dim": 0,
    "task.outputs": "logits",
    "task.shift_labels": False,
    "tracking.model_format": "pickle",
}


def find(
    resume: str, *, folder: Path, experiment: str, store: str, gone: Callable[[str], bool] = lambda run_id: False
) -> Path:
    """The checkpoint ``resume`` names: ``latest``, a file path, or a run id (a folder under ``folder``).

    ``latest`` is the newest checkpoint of a run that did not finish, in this ``experiment`` and
    tracking ``store``, that no process is training now and that ``gone(run_id)`` does not say was deleted
    from the store (``run_gone``); the choice is logged with its reason, and so is each run passed over.

    Raises:
        CheckpointError: nothing matches, with where it looked and what it found instead.
    """
    if resume == "latest":
        return _latest(folder, experiment=experiment, store=store, gone=gone)
    as_path = Path(resume).expanduser()
    if as_path.is_file():
        return as_path
    by_run = folder / resume / LAST
    if by_run.is_file():
        return by_run
    raise CheckpointError(f"resume={resume}: neither a checkpoint file nor a run id with {folder}/{resume}/{LAST}")


def _latest(folder: Path, *, experiment: str, store: str, gone: Callable[[str], bool]) -> Path:
    states = []
    for path in folder.glob(f"*/{LAST}"):
        state = read_state(path.parent)
        if state is not None:
            states.append((path, state))
    ours = [(p, s) for p, s in states if s.get("experiment") == experiment and s.get("store") == store]
    unfinished = [(p, s) for p, s in ours if s.get("status") != "finished"]
    idle = sorted(
        [(p, s) for p, s in unfinished if RunLock(p.parent).free()], key=lambda item: -item[1].get("written", 0.0)
    )
    deleted = []
    for _path, state in idle:
        if not (state.get("run_id") and gone(state["run_id"])):
            break
        deleted.append(state["run_id"])
        log.warning("resume=latest: passed over run %s: deleted from the tracking store", state["run_id"])
    idle = idle[len(deleted) :]
    if idle:
        path, state = idle[0]
        p = state["position"]
        log.warning(
            "resume=latest: continuing run %s (%s at epoch %d, batch %d, step %d, %s), the newest unfinished "
            "checkpoint of experiment '%s' under %s",
            state.get("run_id") or path.parent.name,
            state.get("status", "stopped"),
            p["epoch"],
            p["batch"],
            p["step"],
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.get("written", 0.0))),
            experiment,
            folder,
        )
        return path
    where = f"under {folder}/*/{LAST} for experiment '{experiment}' in this tracking store"
    if deleted and len(deleted) == len(unfinished):
        raise CheckpointError(
            f"resume=latest: no unfinished run {where} is left ({len(deleted)} deleted from the tracking store: "
            f"{', '.join(deleted)}): restore one (mlflow runs restore --run-id ID) and resume it, or start a new run"
        )
    if unfinished:
        busy = ", ".join(_describe(p, s) for p, s in unfinished)
        raise CheckpointError(f"resume=latest: every unfinished run {where} is being trained right now ({busy})")
    if ours:
        listed = ", ".join(_describe(p, s) for p, s in sorted(ours, key=lambda i: -i[1].get("written", 0.0))[:5])
        raise CheckpointError(
            f"resume=latest: no unfinished run {where}; finished: {listed}. A finished run is never changed: "
            f"to train one further, name it and start a new run from it (resume=<run id> fork=true)"
        )
    others = len(states) - len(ours)
    raise CheckpointError(
        f"resume=latest: no checkpoint {where} (checkpoint.dir={folder}"
        + (f"; {others} belong to other experiments or stores: name one with resume=<run id or path>" if others else "")
        + ")"
    )


def _describe(path: Path, state: Mapping[str, Any]) -> str:
    p = state.get("position", {})
    return f"{state.get('run_id') or path.parent.name} ({state.get('status')}, step {p.get('step')})"


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs between a checkpoint's config and this run's: ``{key: (saved, now)}``."""
    keys = (set(saved) | set(current)) - set(NOT_COMPARED)
    was = {k: saved.get(k, ADDED_LATER.get(k)) for k in keys}
    return {k: (was[k], current.get(k)) for k in sorted(keys) if was[k] != current.get(k)}


def check_resumable(changes: Mapping[str, tuple[Any, Any]], *, fork: bool, run: str) -> None:
    """Refuse what the checkpoint (or, continuing the same run, its record) cannot survive.

    Raises:
        CheckpointError: naming every such key, with both values.
    """
    structural = {k: v for k, v in changes.items() if k.startswith(STRUCTURAL) or k in STRUCTURAL_KEYS}
    if structural:
        reasons = dict.fromkeys(_why_structural(key) for key in structural)
        raise CheckpointError(
            f"cannot resume run {run}: {_listed(structural)}; {' and '.join(reasons)}: drop these overrides, or "
            f"start a new run without resume="
        )
    if fork:
        return
    computed = {k: v for k, v in changes.items() if not (k.startswith(RUNTIME) or k in RUNTIME)}
    if computed:
        raise CheckpointError(
            f"resume continues run {run} as it was configured, and its params must stay true: "
            f"{_listed(computed)}. Drop these overrides, or add fork=true to continue its weights in a new run "
            f"with these values"
        )


def _why_structural(key: str) -> str:
    """Why a change of ``key`` (a ``STRUCTURAL`` one) leaves the checkpoint unusable, in a few words."""
    if key.startswith("model."):
        return "the checkpoint's weights belong to the model it was written with"
    if key.startswith("data."):
        return "the run trained on other data"
    if key == "loader.batch_size":
        return "its position counts batches of the checkpoint's size"
    return f"its {key.split('.')[0]} state fits only the one it was written with"


def _edits(edited: Mapping[str, tuple[str, str]]) -> str:
    return "; ".join(f"{path}: {then} then, {now} now" for path, (then, now) in edited.items())


def _listed(changes: Mapping[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in changes.items())


def start_point(cfg: RunConfig, masked_config: Mapping[str, Any], group: Any) -> FreshStart | Resumed:
    """Where this run starts: the checkpoint ``resume=`` names (``shared_point``), or step 0."""
    return shared_point(cfg, masked_config, group) if cfg.resume else FreshStart()


def shared_point(cfg: RunConfig, masked_config: Mapping[str, Any], group: Any) -> Resumed:
    """``resume_point`` for every rank of a job: rank 0 finds and checks the checkpoint (and holds the run's
    lock); the others load the file it found. A refusal on rank 0 is raised on every rank."""
    found: list[Resumed] = []

    def find_on_rank_0() -> str:
        found.append(resume_point(cfg, masked_config, world_size=group.world_size))
        return str(found[0].path)

    path = Path(group.share(find_on_rank_0))
    return found[0] if found else Resumed(path, load(path), {}, cfg.fork, None)


def locate(cfg: RunConfig) -> Path:
    """The checkpoint ``cfg.resume`` names (``find``) in ``cfg``'s checkpoint folder, experiment and store."""
    uri = absolute(cfg.tracking.uri)
    gone = (lambda run_id: run_gone(uri, run_id)) if cfg.tracking.enabled else (lambda run_id: False)
    return find(
        cfg.resume or "latest",
        folder=Path(cfg.checkpoint.dir),
        experiment=cfg.tracking.experiment,
        store=store_id(cfg.tracking),
        gone=gone,
    )


def resume_point(cfg: RunConfig, masked_config: Mapping[str, Any], *, world_size: int = 1) -> Resumed:
    """The checkpoint ``cfg.resume`` names, checked against this run's config as its record keeps it
    (``masked_config``: secrets masked).

    Runs before any data is loaded or any MLflow run is opened, so a refusal changes nothing. For
    the same run, its ``RunLock`` is taken and held until the run ends.

    Raises:
        CheckpointError: no such checkpoint; a change it cannot survive; a finished, deleted or busy run;
            a run recorded in another store or experiment; or nothing left to train.
    """
    store = store_id(cfg.tracking)
    path = locate(cfg)
    saved = load(path)
    run = saved["run_id"] or saved["run_name"]
    state = read_state(path.parent) or {}
    if not cfg.fork:  # the same run continues only in the store and experiment that hold it
        elsewhere = {
            key: (state[field], now)
            for key, field, now in (
                ("tracking.experiment", "experiment", cfg.tracking.experiment),
                ("tracking.uri", "store", store),
            )
            if state.get(field, now) != now
        }
        if elsewhere:
            raise CheckpointError(
                f"run {run} is recorded elsewhere ({_listed(elsewhere)}): resume it with the tracking.uri and "
                f"tracking.experiment it was recorded with, or add fork=true to continue it in a new run here"
            )
    changes = config_changes(flatten(saved["config"]), flatten(masked_config))
    check_resumable(changes, fork=cfg.fork, run=run)
    edited = usercode.changed_since(saved.get("code", {}))
    if edited and not cfg.fork:
        raise CheckpointError(
            f"cannot resume run {run}: your code changed since its checkpoint ({_edits(edited)}), and the run's record "
            f"holds the code it trained with: undo the change, or add fork=true to continue its weights in a new run "
            f"(tagged with what changed)"
        )
    position, trainer = saved["position"], cfg.trainer
    saved_world = saved.get("world_size", 1)
    if saved_world != world_size and position.batch:
        raise CheckpointError(
            f"run {run} stopped inside epoch {position.epoch} with {saved_world} process(es), and its position "
            f"there counts their batches: resume it with {saved_world} process(es) "
            f"(torchrun --nproc_per_node={saved_world}); from the next epoch on the number may change"
        )
    if position.epoch > trainer.epochs or 0 < trainer.max_steps <= position.step:
        raise CheckpointError(
            f"resume={cfg.resume}: run {run} has trained {position.step} steps "
            f"(epoch {position.epoch if position.batch else position.epoch - 1} done"
            f"{'' if not position.batch else ' in part'}); nothing to do with trainer.epochs={trainer.epochs} "
            f"trainer.max_steps={trainer.max_steps}: raise one of them to train further"
        )
    lock = None
    if not cfg.fork:
        _check_unfinished(cfg, run_id=saved["run_id"], state=state, run=run)
        lock = RunLock(path.parent).acquire()
        if cfg.tracking.enabled and saved["run_id"]:
            try:
                outbox.import_pending(saved["run_id"], absolute(cfg.tracking.uri))
            except BaseException:
                lock.release()
                raise
    if changes:
        log.warning("resume: changed since the checkpoint: %s", describe_changes(changes))
    code = {f"code:{path}": hashes for path, hashes in edited.items()}  # a fork's record says so too
    return Resumed(path, saved, {**changes, **code}, cfg.fork, lock)


def _check_unfinished(cfg: RunConfig, *, run_id: str | None, state: Mapping[str, Any], run: str) -> None:
    """A run may be continued only if it exists and did not finish (a finished run is never changed)."""
    fork = "add fork=true to continue its weights in a new run (tagged forked_from)"
    status = state.get("status")
    if cfg.tracking.enabled and run_id:
        info = _run_info(absolute(cfg.tracking.uri), run_id)
        if info is None or info.lifecycle_stage == "deleted":
            raise CheckpointError(f"run {run} no longer exists in the tracking store (deleted?): {fork}")
        status = "finished" if info.status == "FINISHED" else status
    if status == "finished":
        raise CheckpointError(
            f"run {run} finished, and a finished run is never changed: nothing to do. To train it further, {fork}"
        )


def run_gone(uri: str, run_id: str) -> bool:
    """Whether the store at ``uri`` holds no such run, or holds it deleted (MLflow refuses to write to it)."""
    info = _run_info(uri, run_id)
    return info is None or info.lifecycle_stage == "deleted"


def _run_info(uri: str, run_id: str) -> Any:
    """The run's ``RunInfo``, None when the store does not know the run."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return MlflowClient(uri).get_run(run_id).info
    except MlflowException:
        return None
