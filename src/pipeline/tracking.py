"""Recording runs in MLflow, or nowhere.

``open_tracker(cfg.tracking, run_name=...)`` is a context manager yielding a ``Tracker``: an
``MlflowTracker`` bound to one run id (every call names the run explicitly, so other threads
can log to it too), or a ``NullTracker`` when ``tracking.enabled=false``, so the training code
has no ``if tracking:`` branches. Metrics are buffered and written with one ``log_batch`` per
epoch: a synchronous ``log_metric`` costs about 3.5 ms on SQLite, longer than an MLP step.
The write is synchronous on purpose: between epochs it stays out of every epoch's timing,
where a background writer would compete with training for the CPUs and the GIL.

The run ends FINISHED when the block completes, KILLED on Ctrl-C or a stop request (SIGTERM),
and FAILED (with the error as the ``error`` tag) on any other exception; never left RUNNING.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol
from urllib.parse import urlparse

from pipeline.config import TrackingConfig
from pipeline.data.sources import DataSpec
from pipeline.secrets import mask_text, mask_value
from pipeline.stopping import Stopped
from pipeline.store import absolute, connect, retrying

log = logging.getLogger(__name__)

FLUSH_AT = 500  # buffered metrics that trigger a write; log_batch takes at most 1,000
PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch call
UI_URL = "http://127.0.0.1:5000"


class Tracker(Protocol):
    run_id: str | None
    experiment_id: str | None
    write_s: float  # seconds spent writing metrics so far

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_dataset(self, spec: DataSpec, context: str) -> None: ...
    def log_figure(self, make: Callable[[], Any], artifact_file: str) -> None: ...
    def flush(self) -> None: ...
    def describe(self) -> list[str]: ...


class NullTracker:
    """Stands in when tracking is off: accepts everything, records nothing."""

    run_id: str | None = None
    experiment_id: str | None = None
    write_s = 0.0

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_dataset(self, spec: DataSpec, context: str) -> None:
        pass

    def log_figure(self, make: Callable[[], Any], artifact_file: str) -> None:
        pass  # the figure is never drawn

    def flush(self) -> None:
        pass

    def describe(self) -> list[str]:
        return ["tracking off (tracking.enabled=false): nothing recorded"]


class MlflowTracker:
    """One MLflow run, written through ``MlflowClient`` with its run id."""

    def __init__(self, client: Any, *, uri: str, experiment_id: str, experiment: str, run_id: str) -> None:
        self.client, self.uri = client, uri
        self.experiment_id, self.experiment, self.run_id = experiment_id, experiment, run_id
        self._pending: list[Any] = []
        self._lock = threading.Lock()  # the buffer is shared with sampler threads
        self.write_s = 0.0  # seconds spent writing metrics

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + PARAMS_PER_BATCH])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._lock:
            self._pending.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
            full = len(self._pending) >= FLUSH_AT
        if full:
            self.flush()

    def flush(self) -> None:
        """Write the buffered metrics now, in batches of up to 1,000 (the loop calls this between
        epochs, so the write never lands inside an epoch's timing; ``write_s`` adds up its cost)."""
        start = time.perf_counter()
        with self._lock:
            pending, self._pending = self._pending, []
            for i in range(0, len(pending), 1000):
                chunk = pending[i : i + 1000]
                retrying(lambda chunk=chunk: self.client.log_batch(self.run_id, metrics=chunk))
        self.write_s += time.perf_counter() - start

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_figure(self, make: Callable[[], Any], artifact_file: str) -> None:
        """Draw the figure ``make()`` returns and store it as a PNG artifact."""
        import matplotlib.pyplot as plt

        figure = make()
        try:
            self.client.log_figure(self.run_id, figure, artifact_file)
        finally:
            plt.close(figure)

    def log_dataset(self, spec: DataSpec, context: str) -> None:
        """Record the dataset as a run input, so the runs table's Dataset column names it."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        local = spec.source.startswith("/")
        dataset = Dataset(
            name=spec.name,
            digest=spec.digest,
            source_type="local" if local else "code",
            source=json.dumps({"uri": spec.source} if local else {"tags": {"origin": spec.source}}),
            schema=json.dumps(
                {
                    "image": {"dtype": "uint8", "shape": list(spec.in_shape)},
                    "label": {"dtype": "int64", "classes": spec.num_classes},
                }
            ),
            profile=json.dumps({"train_samples": spec.train_size, "val_samples": spec.val_size}),
        )
        self.client.log_inputs(
            self.run_id, datasets=[DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, context)])]
        )

    def describe(self) -> list[str]:
        """Where the run is and how to look at it (printed in the run's summary)."""
        parsed = urlparse(self.uri)
        base = (  # links without user:password@: the browser asks for credentials itself
            parsed._replace(netloc=parsed.netloc.rpartition("@")[2]).geturl().rstrip("/")
            if parsed.scheme in ("http", "https")
            else UI_URL
        )
        lines = [f"MLflow run {self.run_id} in experiment '{self.experiment}' ({mask_text(self.uri)})"]
        if parsed.scheme not in ("http", "https", "databricks"):
            lines.append(f"  open the UI:  mlflow ui --backend-store-uri {self.uri}")
        lines += [
            f"  this run:     {base}/#/experiments/{self.experiment_id}/runs/{self.run_id}",
            f"  all runs:     {base}/#/experiments/{self.experiment_id}/runs?workflowType=machine_learning",
        ]
        return lines


@contextmanager
def open_tracker(
    cfg: TrackingConfig, *, run_name: str, tags: Mapping[str, str] | None = None, run_id: str | None = None
) -> Iterator[Tracker]:
    """Open a run (or a do-nothing tracker), and end it with the status the block earned.

    ``tags`` are all the run's tags (``tracking.tags`` included), already masked by the caller.
    ``run_id`` continues that run (resuming) instead of creating one.
    """
    if not cfg.enabled:
        yield NullTracker()
        return
    # our summary prints the run's links, credentials removed; MLflow's own print would repeat them with credentials
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    uri = absolute(cfg.uri)
    client, experiment_id = connect(uri, cfg.experiment)
    all_tags = {k: mask_value(k, v) for k, v in (tags or {}).items()}  # a last guard; callers mask env values
    if run_id is None:
        run_id = retrying(lambda: client.create_run(experiment_id, run_name=run_name, tags=all_tags)).info.run_id
    else:
        experiment_id = client.get_run(run_id).info.experiment_id
        retrying(lambda: client.update_run(run_id, status="RUNNING"))
    tracker = MlflowTracker(client, uri=uri, experiment_id=experiment_id, experiment=cfg.experiment, run_id=run_id)
    if all_tags:
        tracker.set_tags(all_tags)
    status = "FAILED"
    try:
        yield tracker
        status = "FINISHED"
    except (KeyboardInterrupt, Stopped):
        status = "KILLED"
        raise
    except BaseException as err:
        tracker.set_tags({"error": mask_text(f"{type(err).__name__}: {err}")[:5000]})
        raise
    finally:
        try:
            tracker.flush()
        finally:
            retrying(lambda: client.set_terminated(tracker.run_id, status))


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)  # null, true, [512], as typed in YAML
    return text[:6000]  # MLflow's limit for a param value
