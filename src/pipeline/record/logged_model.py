"""The trained model back out: an MLflow 3 logged model in the run, with a signature, an input example, the class
names and the run's final validation metrics.

    python -m pipeline tracking.log_model=true      # the default; false logs no model
    model = mlflow.pytorch.load_model("runs:/<run id>/model")

The model is saved by ``mlflow.pytorch.log_model`` with ``serialization_format="pickle"`` (cloudpickle): loading
gives back the user's own class, with its methods, and it takes keyword and dict inputs as the run did. The class
must be importable where it is loaded, so the file (or the top package) of a class from the user's own code is
shipped with the model (``code_paths``) and found by ``load_model`` wherever it runs. The other serialisation,
``pt2`` (``torch.export``), loads as a ``torch.fx.GraphModule`` rather than the user's class and takes only tensor
inputs, so it is not used. Pickle runs code when loaded: load models from stores you trust.

What it costs: about 0.1 s a call, because the pip requirements are passed (torch, numpy, cloudpickle at this run's
versions) instead of inferred, which MLflow does by running the model in a subprocess (about 3-9 s), and two of
MLflow's checks that can tell this run nothing are skipped (``_self_checks_skipped``: about 1 s and 0.7 s). The model's
val metrics are linked to it (the UI's Models column shows them) by writing the run's own last points again with the
model's id: MLflow keeps one point per (key, value, time, step), so the run's history does not change.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pipeline

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


def log_model(
    client: Any,
    *,
    uri: str,
    experiment_id: str,
    run_id: str,
    model: Any,
    card: ModelCard,
    mask: Callable[[str], str] = lambda text: text,
) -> str:
    """Log ``model`` to run ``run_id`` and link its metrics; returns the URI that loads it (``runs:/<id>/model``).
    The tags MLflow gives a logged model from its context (the user, the source, git) pass through ``mask``, as the
    run's own do.

    Raises:
        MlflowException, OSError: the store refused the model (the caller decides what that costs the run).
    """
    import mlflow
    import mlflow.pytorch
    from mlflow.entities import Metric
    from mlflow.tracking.context import registry

    model.eval()
    signature = _signature(card)
    example = _numpy(card.inputs) if signature is not None else None
    with _quiet(), _fluent_store(uri, experiment_id), _self_checks_skipped():
        info = mlflow.pytorch.log_model(
            model,
            name=NAME,
            run_id=run_id,
            serialization_format="pickle",
            code_paths=code_paths(model) or None,
            pip_requirements=requirements(),
            signature=signature,
            input_example=example,
            metadata={**card.metadata, "serialization": "pickle (cloudpickle): the class itself, its code shipped"},
            tags={key: mask(str(value)) for key, value in registry.resolve_tags().items()},  # ours win over MLflow's
        )
    linked = []
    for key in card.metrics:
        history = client.get_metric_history(run_id, key)
        if history:
            last = max(history, key=lambda m: (m.step, m.timestamp))
            linked.append(Metric(key, last.value, last.timestamp, last.step, model_id=info.model_id))
    if linked:
        client.log_batch(run_id, metrics=linked)
    return f"runs:/{run_id}/{NAME}"


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
    """The user's code the pickled model needs to load: the file of each class in it that comes from outside this
    package and the installed libraries (its top package's folder, for a module inside a package)."""
    found: dict[str, None] = {}
    for module in model.modules():
        name = type(module).__module__
        path = _source(type(module))
        if path is None or _installed(path) or name == "__main__":
            continue
        root = Path(path)
        for _ in name.split("."):  # nets (/p/nets.py) -> /p; mypkg.models.nets (/p/mypkg/models/nets.py) -> /p
            root = root.parent
        found[str(root / name.split(".")[0]) if "." in name else path] = None
    return list(found)


def _source(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None


def _installed(path: str) -> bool:
    here = str(Path(pipeline.__file__).resolve().parent)
    resolved = str(Path(path).resolve())
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return resolved.startswith(here) or "site-packages" in resolved or any(resolved.startswith(p) for p in prefixes)


def _numpy(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
    if isinstance(value, Mapping):
        return {k: _numpy(v) for k, v in value.items()}
    return None


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
