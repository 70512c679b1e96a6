"""Creating an MLflow run exactly once, over a network that may lose the answer.

MLflow's HTTP client repeats a request whose answer did not arrive (a dropped connection, a proxy's 502, 503 or
504; up to ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` times), POST requests included. Most of the pipeline's writes are
safe to repeat (a metric point is stored once per key, step, timestamp and value; params, tags and artifacts are
overwritten with the same value), but ``create_run`` is not: a team server that made the run and then died (or a
proxy that gave up waiting) before answering makes a second run when the request comes again. The run the caller
never heard of stays RUNNING forever in the team's experiment, with nothing in it.

``create_run`` therefore tags each creation with a random token (``CREATION_TAG``) and, once it has its answer,
ends (KILLED) and deletes any other run carrying the same token (MLflow's deletion: the run moves to the
experiment's trash). It costs one search of the experiment per run created. A first request that the server is
still working on when the search runs is not found; a proxy's timeout shorter than the server's work can still
leave one. A server that stops answering during the search costs only the clean-up (a warning): the run is made.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from pipeline.common.messages import brief
from pipeline.record.store import retrying, server_down

log = logging.getLogger(__name__)

CREATION_TAG = "pipeline.creation"  # a token only this creation's run carries


def create_run(client: Any, experiment_id: str, *, run_name: str, tags: Mapping[str, str]) -> Any:
    """``client.create_run(experiment_id, run_name=..., tags=...)``, leaving one run however often the request was
    sent; returns MLflow's ``Run``."""
    token = uuid.uuid4().hex
    tagged = {**tags, CREATION_TAG: token}
    run = retrying(lambda: client.create_run(experiment_id, run_name=run_name, tags=tagged))
    where = f"tags.`{CREATION_TAG}` = '{token}'"
    try:
        twins = retrying(lambda: client.search_runs([experiment_id], where), what="reading runs")
        for twin in twins:
            if twin.info.run_id != run.info.run_id:  # a repeated request's first run: its answer never came
                retrying(lambda twin=twin: client.set_terminated(twin.info.run_id, "KILLED"))  # never left RUNNING
                retrying(lambda twin=twin: client.delete_run(twin.info.run_id))
                log.info("run %s was made by a request sent twice (its answer was lost); deleted", twin.info.run_id)
    except Exception as err:
        if not server_down(err):
            raise
        log.warning(
            "could not look for a second run made by a repeated request (the server stopped answering: %s); "
            "look for runs tagged %s=%s",
            brief(err),
            CREATION_TAG,
            token,
        )
    return run
