"""The run a training writes to, from its opening to its end: ``open_tracker`` makes the MLflow run exactly once (or
reopens it for ``resume=``), hands out its tracker and ends the run with the block's outcome (FINISHED, KILLED on a
stop, FAILED with the error, masked); ``Tracker`` is what training writes through, and ``NullTracker`` stands in
when tracking is off and on DDP ranks other than 0.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.common.errors import ConfigError, Interruption
from pipeline.common.messages import brief
from pipeline.common.secrets import MASK, mask_text, mask_value
from pipeline.common.uris import absolute
from pipeline.config import TrackingConfig
from pipeline.record import outbox
from pipeline.record.outage import HTTP_RETRIES, REQUEST_TIMEOUT_S
from pipeline.record.runs import create_run
from pipeline.record.store import connect, retrying
from pipeline.record.tracking import MlflowTracker

if TYPE_CHECKING:  # an annotation only: importing pipeline.data would load torch for a type
    from pipeline.data.sources import DataSpec
    from pipeline.record.logged_model import Logged, ModelCard

log = logging.getLogger(__name__)


class Tracker(Protocol):
    run_id: str | None
    experiment_id: str | None
    write_s: float  # seconds the calling (training) thread spent in flush() so far
    background_write_s: float  # seconds the tracker's writer thread spent writing so far

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_file(self, path: Path, artifact_dir: str) -> None: ...
    def log_dataset(self, spec: DataSpec, context: str) -> None: ...
    def log_figure(self, make: Callable[[], Any], artifact_file: str) -> None: ...
    def log_model(self, model: Any, card: ModelCard, *, form: str = ..., step: int | None = ...) -> Logged | None: ...
    def flush(self) -> None: ...
    def last_step(self, key: str) -> int | None: ...
    def log_only_new_steps(self) -> None: ...
    def describe(self) -> list[str]: ...


class NullTracker:
    """Stands in when tracking is off: accepts everything, records nothing."""

    run_id: str | None = None
    experiment_id: str | None = None
    write_s = 0.0
    background_write_s = 0.0

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_file(self, path: Path, artifact_dir: str) -> None:
        pass

    def log_dataset(self, spec: DataSpec, context: str) -> None:
        pass

    def log_figure(self, make: Callable[[], Any], artifact_file: str) -> None:
        pass  # the figure is never drawn

    def log_model(self, model: Any, card: ModelCard, *, form: str = "pickle", step: int | None = None) -> Logged | None:
        return None

    def flush(self) -> None:
        pass

    def last_step(self, key: str) -> int | None:
        return None

    def log_only_new_steps(self) -> None:
        pass

    def describe(self) -> list[str]:
        return ["tracking off (tracking.enabled=false): nothing recorded"]


@contextmanager
def open_tracker(
    cfg: TrackingConfig,
    *,
    run_name: str,
    tags: Mapping[str, str] | None = None,
    run_id: str | None = None,
    secret_values: Collection[str] = frozenset(),
) -> Iterator[Tracker]:
    """Open a run (or a do-nothing tracker), and end it with the status the block earned.

    ``tags`` are all the run's tags (``tracking.tags`` included). ``run_id`` continues that run (resuming)
    instead of creating one, removing the tags that said how it ended before (``outbox.FAILURE_TAGS``).
    ``secret_values`` (``pipeline.common.secrets.env_values``) are masked in everything the run records, its name and
    the error that ends it included; ``cfg.uri`` is used as it is.

    Raises:
        ConfigError: the experiment's name holds a secret value (``env_values`` refuses that first).
    """
    if not cfg.enabled:
        yield NullTracker()
        return
    # our summary prints the run's links, credentials removed; MLflow's own print would repeat them with credentials
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # MLflow retries a request to a server 7 times with growing pauses, about 4 minutes per write while a server is
    # down, and the training thread writes between epochs: two quick retries (about 3 s), then the tracker's own
    # retries (the writer thread, the next flush, the run's end, the outbox file) take over. Yours win if set.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(HTTP_RETRIES))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    # a hung server holds a request for MLflow's 120 s: 10 s bounds one write (pipeline.record.outage.CALL_BOUND_S)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))
    secret_values = frozenset(secret_values)
    if mask_text(cfg.experiment, secret_values) != cfg.experiment:  # the store keeps experiment names unmasked
        raise ConfigError("tracking.experiment", MASK, "a name that holds no value read from the environment")
    uri = absolute(cfg.uri)
    client, experiment_id = connect(uri, cfg.experiment)
    all_tags = {k: mask_value(k, str(v), values=secret_values) for k, v in (tags or {}).items()}
    if run_id is None:
        name = mask_text(run_name, secret_values)
        run_id = create_run(client, experiment_id, run_name=name, tags=all_tags).info.run_id  # once, answer lost or not
    else:
        run = retrying(lambda: client.get_run(run_id))
        experiment_id = run.info.experiment_id
        retrying(lambda: client.update_run(run_id, status="RUNNING"))
        for key in set(outbox.FAILURE_TAGS) & run.data.tags.keys():  # how it ended before: no longer true
            retrying(lambda key=key: client.delete_tag(run_id, key))
    tracker = MlflowTracker(
        client,
        uri=uri,
        experiment_id=experiment_id,
        experiment=cfg.experiment,
        run_id=run_id,
        secret_values=secret_values,
    )
    if all_tags:
        tracker.set_tags(all_tags)
    tracker.start()
    try:
        yield tracker
    except (KeyboardInterrupt, Interruption):
        _end_under(tracker, "KILLED")
        raise
    except BaseException as err:
        _end_under(tracker, "FAILED", tags={"error": tracker.mask(brief(err, limit=5000))})
        raise
    tracker.end("FINISHED")  # raises only if the outbox cannot be written: then metrics would be lost


def _end_under(tracker: MlflowTracker, status: str, *, tags: Mapping[str, str] | None = None) -> None:
    """End the run while the block's exception propagates: a failure here is logged, never raised over it."""
    try:
        tracker.end(status, tags=tags)
    except Exception as err:  # no traceback: its text could hold a secret value; the run's own error follows
        log.error(
            "the run's end (%s) could not be recorded (%s); the run's own error follows",
            status,
            tracker.mask(brief(err)),
        )
