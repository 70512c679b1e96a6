"""The run's record in MLflow: the store under concurrency and failure (``store``, ``runs``, ``filesystems``),
the tracker that writes metrics off the training thread (``tracking``), what survives a store that is down
(``outbox``), liveness (``heartbeat``) and runs left RUNNING by a dead process (``stale``). Never imports the
engine.
"""
