"""The run's record in MLflow: the run from its opening to its end (``lifecycle``: ``open_tracker``), the store
under concurrency and failure (``store``, ``runs``, ``filesystems``) and whether a URI can work before a run starts
(``reachability``), the tracker that writes metrics off the training thread (``tracking``), a server that stopped
answering (``outage``) and what survives a store that is down (``outbox``), the dataset and the trained model in the
run (``dataset_input``, ``logged_model``), liveness (``heartbeat``) and runs left RUNNING by a dead process
(``stale``). Never imports the engine.
"""
