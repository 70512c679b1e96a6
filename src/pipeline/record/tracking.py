"""Recording runs in MLflow, or nowhere.

``pipeline.record.lifecycle.open_tracker(cfg.tracking, run_name=...)`` is a context manager yielding a ``Tracker``: an
``MlflowTracker`` bound to one run id (every call names the run explicitly, so other threads can log to it too), or a
``NullTracker`` when ``tracking.enabled=false``, so the training code has no ``if tracking:`` branches.

Metrics are buffered: ``log_metrics`` only appends under a lock held for the append, on every thread (the training loop
and the utilisation sampler), and never writes; a synchronous ``log_metric`` costs about 3.5 ms on SQLite, longer than
an MLP step, and a write can take seconds when the store is busy or down. The training thread writes the buffer with
``flush()`` between epochs, out of every epoch's timing (``write_s`` adds up that cost). A writer thread owned by the
tracker also writes it every ``WRITE_EVERY_S`` seconds, or as soon as it passes ``FLUSH_AT``, so a long epoch still
shows live metrics in the UI; it costs one ``log_batch`` of a few hundred metrics per interval (milliseconds of CPU and
GIL; ``background_write_s``).

A failed write keeps its metrics: they go back in front of the buffer, one warning says the store is failing, and the
next write retries them. If the store still refuses them when the run ends, they go to
``./unsent_metrics/<run_id>.jsonl`` with the run's final status, and the one command that imports them is printed
(``python -m pipeline.outbox``, see ``pipeline.record.outbox``). A tracking server that stops answering
(``pipeline.record.store.server_down``) never stops training either: tags it could not take are kept and written with
the run's end (or its outbox file), and an artifact (a plot, config.yaml) it could not take is named in a warning and
left out; once it has not answered for ``outage.DEADLINE_S`` the training thread stops asking it
(``pipeline.record.outage``: the run pays at most about a minute). Any other failed write (a full disk, a refused
request) still raises.

Nothing secret is sent: ``open_tracker(..., secret_values=env_values(cfg))`` hands the tracker the values read from
environment variables, and every string it writes (params, tags, the run's name, the ``error`` tag and the summary note,
text artifacts, the dataset input, texts drawn in figures) and every line it logs is masked with them and with
``pipeline.common.secrets.mask_text``'s patterns. Metric keys are names chosen in the code, not values, and are sent as
they are.

The run ends FINISHED when the block completes, KILLED on Ctrl-C or a stop request (SIGTERM), and FAILED (with the error
as the ``error`` tag) on any other exception; never left RUNNING unless the store is unreachable, and then the outbox
file holds the status to set. The block's exception always propagates unchanged: a failing end-of-run write never
replaces it.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from pipeline.common.messages import brief
from pipeline.common.secrets import mask_text, mask_value
from pipeline.common.uris import run_page, ui_base
from pipeline.record import outbox
from pipeline.record.dataset_input import dataset_inputs
from pipeline.record.heartbeat import Heartbeat
from pipeline.record.logged_model import Destination, Logged, ModelCard, ModelExportError, log_model
from pipeline.record.outage import Outage
from pipeline.record.store import retrying, server_down

if TYPE_CHECKING:  # an annotation only: importing pipeline.data would load torch for a type
    from pipeline.data.sources import DataSpec

log = logging.getLogger(__name__)

FLUSH_AT = 500  # buffered metrics that wake the writer thread early
METRICS_PER_BATCH = 1000  # MLflow's limit per log_batch call
WRITE_EVERY_S = 10.0  # the writer thread's period: how stale the UI's live metrics may get
STOP_WITHIN_S = 30.0  # how long a run's end waits for a write in flight ("database is locked" retries take ~13 s)
PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch call


class MlflowTracker:
    """One MLflow run, written through ``MlflowClient`` with its run id.

    ``start()`` starts the writer thread; ``end(status)`` stops it and records how the run ended.
    Without ``start()`` (benchmarks, tests) metrics are written only by ``flush()``. Every string it sends
    and logs is masked with ``secret_values`` (``pipeline.common.secrets.env_values``).
    """

    def __init__(
        self,
        client: Any,
        *,
        uri: str,
        experiment_id: str,
        experiment: str,
        run_id: str,
        secret_values: Collection[str] = frozenset(),
    ) -> None:
        self.client, self.uri = client, uri
        self.secret_values = frozenset(secret_values)
        self.experiment_id, self.experiment, self.run_id = experiment_id, experiment, run_id
        self._pending: list[Any] = []  # Metric records not yet written, in logging order
        self._inflight: list[Any] = []  # the batch a write holds now; the outbox takes it if that write hangs
        self._lock = threading.Lock()  # guards the two lists; held for an append or a swap, never for a write
        self._write_lock = threading.Lock()  # one write at a time: a put-back cannot land behind a later batch
        self._due = threading.Event()  # wakes the writer: the buffer passed FLUSH_AT, or the run is ending
        self._closing = threading.Event()
        self._writer: threading.Thread | None = None
        self._heartbeat = Heartbeat(client, run_id)  # process.heartbeat from start() on: pipeline.record.stale reads it
        self._outage = Outage()  # since when the server has not answered: past its deadline, no more waiting on it
        self._failing = False  # one warning per outage, not one per failed write (read under _write_lock)
        self._unsent_tags: dict[str, str] = {}  # masked tags a down server did not take; sent with the run's end
        # a resumed run's last stored step per metric, read once by ``log_only_new_steps`` (None: not read)
        self._floors: dict[str, int] | None = None
        self.write_s = 0.0  # seconds the calling thread spent in flush()
        self.background_write_s = 0.0  # seconds the writer thread spent writing

    def start(self) -> MlflowTracker:
        """Start the writer thread and the heartbeat (daemons: a hung write never holds a process that must exit)."""
        self._writer = threading.Thread(target=self._run, name="pipeline-tracking-writer", daemon=True)
        self._writer.start()
        self._heartbeat.start()
        return self

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, self.mask_value(k, _param_text(v))[:6000]) for k, v in params.items()]  # MLflow's limit
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + PARAMS_PER_BATCH])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set ``tags`` (masked); a server that does not answer gets them with the run's end instead."""
        masked = {k: self.mask_value(k, str(v)) for k, v in tags.items()}
        try:
            self._send_tags(masked)
        except Exception as err:
            if not server_down(err):
                raise
            self._unsent_tags.update(masked)
            log.warning(
                "tags %s could not be written to %s (%s); kept for the run's end", ", ".join(masked), *self._why(err)
            )

    def _send_tags(self, masked: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        if masked:
            tags = [RunTag(k, v) for k, v in masked.items()]
            self._outage.call(lambda: self.client.log_batch(self.run_id, tags=tags))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer ``metrics`` at ``step``; safe from any thread, and never waits for a write."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        floors = self._floors or {}
        records = [Metric(k, float(v), now, step) for k, v in metrics.items() if step > floors.get(k, -1)]
        if not records:
            return
        with self._lock:
            self._pending.extend(records)
            due = len(self._pending) >= FLUSH_AT
        if due:
            self._due.set()  # the writer thread writes; the caller may be the training thread mid-epoch

    def flush(self) -> None:
        """Write the buffered metrics now, on the calling thread (the loop calls this between epochs, so the write
        never lands inside an epoch's timing; ``write_s`` adds up its cost, waiting for a background write included).
        A failed write does not raise: its metrics stay buffered for the next write."""
        start = time.perf_counter()
        try:
            self._write()
        finally:
            self.write_s += time.perf_counter() - start

    def end(self, status: str, *, tags: Mapping[str, str] | None = None) -> Path | None:
        """Stop the writer, write what is left, then ``tags`` and the final ``status``.

        What the store still refuses goes to an outbox file, announced by a warning and, on stderr, the
        command that imports it.

        Returns:
            The outbox file's path, or None when the store took everything.
        """
        unsent = self._close()
        end_time = int(time.time() * 1000)
        # masked now: the outbox file holds them too
        left = {**self._unsent_tags, **{k: self.mask_value(k, str(v)) for k, v in (tags or {}).items()}}
        try:
            self._send_tags(left)
            left, self._unsent_tags = {}, {}
            retrying(
                lambda: self._outage.call(lambda: self.client.set_terminated(self.run_id, status, end_time=end_time))
            )
        except Exception as err:
            log.warning(
                "the run's end (%s) could not be written to %s (%s)",
                status,
                *self._why(err),
            )
        else:
            if not unsent:
                return None
        points = [outbox.Point(m.key, m.value, m.timestamp, m.step) for m in unsent]
        record = outbox.Outbox(self.run_id, self.experiment_id, self.uri, status, end_time, left, points)
        path = outbox.save(record, outbox.fresh_path(self.run_id))
        log.warning(
            "%d metrics and the run's status %s are kept in %s until they are imported", len(points), status, path
        )
        print(f"import the unsent metrics into MLflow with: {outbox.command(path)}", file=sys.stderr, flush=True)
        return path

    def _close(self) -> list[Any]:
        """Stop the writer thread and write what is left; returns the metrics that could not be written."""
        self._closing.set()
        self._due.set()
        stop_by = time.monotonic() + self._outage.left_s(STOP_WITHIN_S)  # both threads together: a down server's
        self._heartbeat.stop(within_s=self._outage.left_s(STOP_WITHIN_S))  # deadline is not waited for twice
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join(timeout=max(0.0, stop_by - time.monotonic()))
            if writer.is_alive():  # it holds the write lock: take its batch too rather than wait any longer
                with self._lock:
                    stuck, self._inflight, self._pending = self._inflight + self._pending, [], []
                log.warning(
                    "a metric write has not returned after %.0f s; its metrics go to the outbox too "
                    "(they appear twice if that write lands later)",
                    STOP_WITHIN_S,
                )
                return stuck
        self.flush()
        with self._lock:
            left, self._pending = self._pending, []
        return left

    def _run(self) -> None:
        while not self._closing.is_set():
            self._due.wait(WRITE_EVERY_S)
            self._due.clear()
            if self._closing.is_set():
                return  # _close() writes the rest on its caller's thread
            start = time.perf_counter()
            written = self._write(gate=False)  # off the training thread: it keeps asking a down server
            self.background_write_s += time.perf_counter() - start
            if not written:
                self._closing.wait(WRITE_EVERY_S)  # a store that is down is asked again later, not in a busy loop

    def _write(self, *, gate: bool = True) -> bool:
        """Write everything buffered; True when it all went. The buffer lock is held only to swap the buffer
        out and to put back what failed, in front, so the history keeps its logging order. With ``gate`` (the
        training thread), nothing is tried, or waited for, once a down server's deadline has passed."""
        if gate and not self._write_lock.acquire(timeout=self._outage.left_s(-1)):  # -1: wait while none is known
            return False
        if not gate:
            self._write_lock.acquire()
        try:
            with self._lock:
                batch, self._pending = self._pending, []
                self._inflight = batch
            written = 0
            try:
                for i in range(0, len(batch), METRICS_PER_BATCH):
                    chunk = batch[i : i + METRICS_PER_BATCH]
                    send = lambda chunk=chunk: self.client.log_batch(self.run_id, metrics=chunk)  # noqa: E731
                    retrying(lambda send=send: self._outage.call(send, gate=gate))
                    written = i + len(chunk)
            except BaseException as err:  # kept and retried: the store may be back at the next write
                with self._lock:
                    self._pending[:0] = batch[written:]
                    self._inflight = []
                    kept = len(self._pending)
                if not isinstance(err, Exception):
                    raise  # Ctrl-C mid-write: the metrics stay buffered for the run's end (KILLED)
                if not self._failing:
                    log.warning(
                        "metrics could not be written to %s (%s); %d kept, retried in %.0f s or at the next flush",
                        *self._why(err),
                        kept,
                        WRITE_EVERY_S,
                    )
                self._failing = True
                return False
            with self._lock:
                self._inflight = []
            if self._failing and batch:
                log.info("metrics are being written to %s again", self.mask(self.uri))
                self._failing = False
            return True
        finally:
            self._write_lock.release()

    def mask(self, text: str) -> str:
        """``text`` as the record may hold it: secret values, URI credentials and ``token=...`` pairs masked."""
        return mask_text(text, self.secret_values)

    def mask_value(self, key: str, value: str) -> str:
        """A param's or tag's value: all of it when the key looks secret (``api_token``), else ``mask(value)``."""
        return mask_value(key, value, values=self.secret_values)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._send_artifact(lambda: self.client.log_text(self.run_id, self.mask(text), artifact_file), artifact_file)

    def log_file(self, path: Path, artifact_dir: str) -> None:  # a gzipped trace, a pickle: sent as it is, unmasked
        self._send_artifact(lambda: self.client.log_artifact(self.run_id, str(path), artifact_dir), path.name)

    def log_figure(self, make: Callable[[], Any], artifact_file: str) -> None:
        """Draw the figure ``make()`` returns (a ``matplotlib.figure.Figure`` made without pyplot, so nothing keeps
        it once sent), its texts masked (the run's name is a title), as a PNG artifact."""
        from matplotlib.text import Text

        figure = make()
        for text in figure.findobj(Text):
            shown = text.get_text()
            if self.mask(shown) != shown:
                text.set_text(self.mask(shown))
        self._send_artifact(lambda: self.client.log_figure(self.run_id, figure, artifact_file), artifact_file)

    def _send_artifact(self, send: Callable[[], Any], artifact_file: str) -> None:
        """Upload an artifact; one that a server that does not answer cannot take is left out, with a warning
        (the outbox file holds metrics and tags, not files)."""
        try:
            self._outage.call(send)
        except Exception as err:
            if not server_down(err):
                raise
            log.warning(
                "artifact %s could not be written to %s (%s); the run goes on without it",
                artifact_file,
                *self._why(err),
            )

    def _why(self, err: BaseException) -> tuple[str, str]:  # the URI and the error for a warning, both masked
        return self.mask(self.uri), self.mask(brief(err))

    def log_dataset(self, spec: DataSpec, context: str) -> None:
        """Record the dataset as a run input, so the runs table's Dataset column names it."""
        inputs = dataset_inputs(spec, context, mask=self.mask)
        # runs starting together record the same dataset: the store may refuse the slower one's insert of its row
        retrying(lambda: self.client.log_inputs(self.run_id, datasets=inputs), what="recording the dataset")

    def last_step(self, key: str) -> int | None:
        """The highest step the store holds for metric ``key`` (None if none): what a resumed run finds there.
        Answered from what ``log_only_new_steps`` read, once it has: the store is not asked again."""
        if self._floors is not None:
            return self._floors.get(key)
        self.flush()
        return self._stored_last_step(key)

    def log_only_new_steps(self) -> None:
        """Resuming this run: from now on each metric is logged only at steps after the last one the store holds
        for it. The steps a resume trains again (those after its checkpoint) come from the same deterministic
        trajectory, so the points its earlier process wrote stand and each step keeps one point per metric.
        Call before anything is logged (one history read per metric the run has)."""
        self.flush()
        keys = retrying(lambda: self.client.get_run(self.run_id)).data.metrics
        floors = {key: self._stored_last_step(key) for key in keys}
        self._floors = {key: step for key, step in floors.items() if step is not None}

    def _stored_last_step(self, key: str) -> int | None:
        return max((m.step for m in retrying(lambda: self.client.get_metric_history(self.run_id, key))), default=None)

    def log_model(self, model: Any, card: ModelCard, *, form: str = "pickle", step: int | None = None) -> Logged | None:
        """The model as one of the run's logged models (``pipeline.record.logged_model``), in ``form``, its metrics
        linked (those logged at ``step``, a checkpoint's epoch; without one the run's last). A store that refuses it,
        or a model that does not export as ``pt2`` asked, costs the run nothing else: a warning, and None."""
        from mlflow.exceptions import MlflowException

        self.flush()  # the metrics are in the store before they are linked to the model
        if self._outage.over():  # a model is many requests: none is made to a server past its deadline
            log.warning("the trained model was not logged: %s has not answered; the checkpoint holds it", self.uri)
            return None
        try:
            return log_model(
                self.client,
                Destination(self.uri, self.experiment_id, self.run_id),
                model=model,
                card=card.masked(self.mask),
                mask=self.mask,
                form=form,
                step=step,
            )
        except (MlflowException, OSError, ModelExportError) as err:
            log.warning(
                "the trained model was not logged to MLflow (%s): the checkpoint still holds it", self.mask(str(err))
            )
            return None

    def describe(self) -> list[str]:
        """Where the run is and how to look at it (printed in the run's summary)."""
        parsed, base = urlparse(self.uri), ui_base(self.uri)
        lines = [f"MLflow run {self.run_id} in experiment '{self.experiment}' ({mask_text(self.uri)})"]
        if parsed.scheme not in ("http", "https", "databricks"):
            lines.append(f"  open the UI:  mlflow ui --backend-store-uri {self.uri}")
        lines += [
            f"  this run:     {base}/{run_page(self.experiment_id, self.run_id)}",
            f"  all runs:     {base}/{run_page(self.experiment_id)}",
        ]
        return lines


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)  # null, true, [512], as typed in YAML
