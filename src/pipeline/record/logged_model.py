"""The trained model back out: an MLflow 3 logged model in the run, with a signature, an input example, the class
names and the run's validation metrics.

    python -m pipeline tracking.log_model=final        # the default: the trained model (false: none)
    python -m pipeline tracking.log_model=checkpoints  # one at every epoch's checkpoint too, step = the epoch
    python -m pipeline tracking.model_format=pt2       # torch.export's graph: no code needed to load it
    model = mlflow.pytorch.load_model("runs:/<run id>/model")  # the newest; models:/<model id> any one

``pickle`` (the default) saves the model with ``mlflow.pytorch.log_model(serialization_format="pickle")``
(cloudpickle): loading gives back the user's own class, with its methods, and it takes keyword and dict inputs as the
run did. Its classes must import where it is loaded, so every module of the user's that the run imported (from the
launch folder, ``PYTHONPATH`` or a target's folder: ``pipeline.common.usercode.imported``), a model file's sibling
``helpers.py`` included, is shipped with it (``code_paths``; MLflow's ``infer_code_paths`` is a pyfunc option that
``mlflow.pytorch`` does not take, and it costs a subprocess of seconds). Pickle runs code when loaded: load models
from stores you trust. ``pt2`` is ``torch.export``'s program, made by MLflow from the run's input example with the
batch dimension left free: it loads as a ``torch.fx.GraphModule`` without any of the user's code (a team server
that refuses pickle still loads it) and takes tensor inputs only. ``auto`` logs ``pt2`` where the model exports
with its input example, else ``pickle``; the run's tag ``model.format`` says which.

With ``checkpoints`` every epoch's model is logged at its checkpoint under the same name, ``step`` the epoch, and
MLflow links the epoch's metrics to it (``mlflow.search_logged_models(order_by=[{"field_name": "metrics.val/loss"}])``
finds the best); ``runs:/<id>/model`` loads the newest. The final model of ``final`` gets the run's last validation
metrics linked.

What it costs: about 0.05 s a call (pickle; pt2 about 0.1 s and its export), because the pip requirements are
passed (torch, numpy, cloudpickle at this run's versions) instead of inferred, which MLflow does by running the model
in a subprocess (about 3-9 s), and two of MLflow's checks that can tell this run nothing are skipped
(``_self_checks_skipped``: about 1 s and 0.7 s). The model's val metrics are linked to it (the UI's Models column
shows them) by writing the run's own last points again with the model's id: MLflow keeps one point per (key, value,
time, step), so the run's history does not change.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.common.errors import ConfigError
from pipeline.common.messages import brief
from pipeline.common.usercode import imported, installed

log = logging.getLogger(__name__)

NAME = "model"  # runs:/<run id>/model
# MLflow's functions that _self_checks_skipped replaces for the call: (module, name)
SELF_CHECKS = (
    ("mlflow.utils.environment", "warn_dependency_requirement_mismatches"),
    ("mlflow.models.utils", "_validate_serving_input"),
)


@dataclass(frozen=True)
class ModelCard:
    """What is logged beside the weights: an example the model takes, what it gives, and what its outputs mean."""

    inputs: Any  # a few samples as the model takes them: a tensor, or a dict of tensors (keyword inputs)
    outputs: Any  # the model's output for them (a tensor, or anything it returns)
    metadata: Mapping[str, Any]  # class names, the task, how inputs were prepared
    metrics: Sequence[str]  # the run's metrics that describe the model (its final val/...)

    def masked(self, mask: Callable[[str], str]) -> ModelCard:
        """The card with every string of its metadata masked (class names come from the user's data)."""
        return ModelCard(self.inputs, self.outputs, _mask_tree(self.metadata, mask), self.metrics)


def _mask_tree(value: Any, mask: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, Mapping):
        return {mask(str(k)): _mask_tree(v, mask) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mask_tree(v, mask) for v in value]
    return value


@dataclass(frozen=True)
class Logged:
    """A logged model: the URI that loads it and the format it was saved in."""

    uri: str
    form: str  # pickle | pt2


@dataclass(frozen=True)
class Destination:
    """Where a model is logged: the run ``run_id`` of experiment ``experiment_id`` in the store at ``uri``."""

    uri: str
    experiment_id: str
    run_id: str


def log_model(
    client: Any,
    to: Destination,
    *,
    model: Any,
    card: ModelCard,
    mask: Callable[[str], str] = lambda text: text,
    form: str = "pickle",
    step: int | None = None,
) -> Logged:
    """Log ``model`` to the run ``to`` in ``form`` (``pickle``, ``pt2``, or ``auto``: pt2 where it exports) and link
    its metrics: MLflow's own link of the metrics logged at ``step`` (a checkpoint's epoch), or, without a step, the
    run's last points of ``card.metrics``. The tags MLflow gives a logged model from its context (the user, the source,
    git) pass through ``mask``, as the run's own do.

    Raises:
        MlflowException, OSError: the store refused the model (the caller decides what that costs the run).
        ModelExportError: ``pt2`` asked for, and the model does not export with its input example.
    """
    model.eval()
    used = "pickle" if form == "pickle" else "pt2"
    try:
        info = _log(model, card, to, mask=mask, form=used, step=step)
    except ModelExportError as err:
        if form == "pt2":
            raise
        log.info("the model does not export (%s): logged with pickle (tracking.model_format=auto)", err)
        used = "pickle"
        info = _log(model, card, to, mask=mask, form=used, step=step)
    if step is None:
        _link_last_points(client, to.run_id, card.metrics, info.model_id)
    return Logged(f"runs:/{to.run_id}/{NAME}", used)


class ModelExportError(Exception):
    """``torch.export`` could not make a program of the model with its input example."""


def _log(
    model: Any, card: ModelCard, to: Destination, *, mask: Callable[[str], str], form: str, step: int | None
) -> Any:
    import mlflow
    import mlflow.pytorch
    from mlflow.tracking.context import registry

    signature, example = _pt2_signature(card) if form == "pt2" else (_signature(card), None)
    if form != "pt2" and signature is not None:
        example = _numpy(card.inputs)
    how = "pt2 (torch.export): a graph, no code needed" if form == "pt2" else "pickle (cloudpickle): the class itself"
    with _quiet(), _fluent_store(to.uri, to.experiment_id), _self_checks_skipped():
        try:
            return mlflow.pytorch.log_model(
                model,
                name=NAME,
                run_id=to.run_id,
                step=step or 0,
                serialization_format=form,
                code_paths=(code_paths(model) or None) if form == "pickle" else None,
                pip_requirements=requirements(),
                signature=signature,
                input_example=example,
                metadata={**card.metadata, "serialization": how},
                tags={
                    key: mask(str(value)) for key, value in registry.resolve_tags().items()
                },  # ours win over MLflow's
            )
        except Exception as err:
            if form != "pt2" or _store_error(err):
                raise
            raise ModelExportError(brief(err, first_line=True)) from err


def _store_error(err: BaseException) -> bool:
    from mlflow.exceptions import MlflowException

    return isinstance(err, MlflowException | OSError)


def _link_last_points(client: Any, run_id: str, keys: Sequence[str], model_id: str) -> None:
    """The run's last point of each of ``keys`` written again with the model's id (the UI's Models column)."""
    from mlflow.entities import Metric

    linked = []
    for key in keys:
        history = client.get_metric_history(run_id, key)
        if history:
            last = max(history, key=lambda m: (m.step, m.timestamp))
            linked.append(Metric(key, last.value, last.timestamp, last.step, model_id=model_id))
    if linked:
        client.log_batch(run_id, metrics=linked)


def check_format(form: str, card_inputs: Any) -> None:
    """Refuse ``tracking.model_format=pt2`` for a model whose input example is not tensors (before the run opens).

    Raises:
        ConfigError: naming the key and what the model takes.
    """
    import torch

    tensors = isinstance(card_inputs, torch.Tensor)
    if form == "pt2" and not tensors:
        what = type(card_inputs).__name__ if card_inputs is not None else "no input example"
        raise ConfigError(
            "tracking.model_format",
            "pt2",
            f"pickle or auto for this model (called with {what}): torch.export's format, as MLflow saves it, takes "
            f"one tensor input",
        )


def requirements() -> list[str]:
    """What loading needs, at this process's versions (passed, so MLflow does not infer them in a subprocess)."""
    import cloudpickle
    import numpy
    import torch

    versions = {
        "torch": torch.__version__.split("+")[0],
        "numpy": numpy.__version__,
        "cloudpickle": cloudpickle.__version__,
    }
    return [f"{package}=={version}" for package, version in versions.items()]


def code_paths(model: Any) -> list[str]:
    """The user's code the pickled model needs to load: every module of the user's the run imported (a model's file
    may import a sibling), and the file of each class in the model that comes from outside this package and the
    installed libraries; a module inside a package as its top package's folder."""
    found: dict[str, None] = {}
    for name, path in imported().items():
        found[_shipped(name, path)] = None
    for module in model.modules():
        name, path = type(module).__module__, _source(type(module))
        if path is not None and not installed(path) and name != "__main__":
            found[_shipped(name, path)] = None
    return list(found)


def _shipped(name: str, path: str) -> str:
    """What ships module ``name`` (its file ``path``): the file, or its top package's folder (``mypkg.models.nets``
    in /p/mypkg/models/nets.py -> /p/mypkg)."""
    if "." not in name:
        return path
    root = Path(path)
    for _ in name.split("."):
        root = root.parent
    if Path(path).name == "__init__.py":
        root = root.parent
    return str(root / name.split(".")[0])


def _source(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None


def _numpy(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
    if isinstance(value, Mapping):
        return {k: _numpy(v) for k, v in value.items()}
    return None


def _pt2_signature(card: ModelCard) -> tuple[Any, Any]:
    """A pt2 model's signature and example: one tensor input, its batch dimension free (-1, from the example's 2)."""
    import torch

    if not isinstance(card.inputs, torch.Tensor):
        raise ModelExportError(f"its input is {type(card.inputs).__name__}, not one tensor")
    return _signature(card), _numpy(card.inputs)


def _signature(card: ModelCard) -> Any:
    """The signature of a tensor or keyword-tensor input (and a tensor output); None for other structures."""
    from mlflow.models import infer_signature

    inputs = _numpy(card.inputs)
    if inputs is None or (isinstance(inputs, dict) and any(v is None for v in inputs.values())):
        return None
    outputs = _numpy(card.outputs)
    return infer_signature(inputs, outputs if not isinstance(outputs, dict) else None)


@contextlib.contextmanager
def _fluent_store(uri: str, experiment_id: str) -> Iterator[None]:
    """Point MLflow's fluent API, which ``log_model`` writes through (not ``client``), at this run's store and
    experiment (else the model lands in experiment 0), for this call only: through the two environment variables it
    reads on every call, put back after, so that nothing later in this process (a sweep's next job in another
    folder) or in a child process inherits them (``mlflow.set_tracking_uri`` and ``set_experiment`` would stay)."""
    saved = {key: os.environ.get(key) for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_ID=experiment_id)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _self_checks_skipped() -> Iterator[None]:
    """Two checks ``log_model`` runs that can tell this run nothing, skipped for this call (``SELF_CHECKS``):

    - the requirements it is handed, against this environment, to warn of a mismatch, by mapping every installed
      distribution's files to its modules (``importlib_metadata.packages_distributions``): about 1 s on 2 cores,
      85% of ``log_model``. Ours are this process's own versions (``requirements``), so it can find nothing;
    - the input example served: the model loaded back through ``mlflow.pyfunc`` in this process and run on it,
      about 0.7 s of imports (the scoring server's) in a process that loads no other model. Its only outcome is a
      warning, which ``_quiet`` keeps at ERROR, and in this process the model's classes import whatever was shipped.
      The tests check it instead: tests/test_logged_model.py serves a logged model's example through
      ``mlflow.pyfunc``, tests/test_user_project.py loads one in a fresh process without the user's code.

    Neither writes anything to the model. A name MLflow no longer has costs its time, nothing else; the test of this
    fails on such an MLflow, so the time comes back knowingly."""
    import importlib

    saved = []
    for module_name, name in SELF_CHECKS:
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for module, name, check in saved:
            setattr(module, name, check)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """MLflow's notes on pickle and on dict examples it cannot validate are said once, in the module docstring."""
    loggers = [logging.getLogger(name) for name in ("mlflow.pytorch", "mlflow.models", "mlflow.models.model")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
