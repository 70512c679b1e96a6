"""Shared utilities every layer may use: the errors a user can fix (``errors``: ``PipelineError``) and how an error
reads to them (``messages``: ``brief``, ``best_effort``), the one atomic file writer (``atomic``), the one Markdown
table writer (``markdown``), statistics (``stats``), secrets masked everywhere (``secrets``), tracking URIs as MLflow
reads them (``uris``), a device's memory (``device_memory``: ``is_oom``, the free memory), signal names
(``signals``), every metric name written or read (``metric_names``), the user's ``_target_`` objects (``targets``),
the garbage collector in short commands (``heap``) and the contract every command keeps with its user (``cli``).
Imports nothing else of the package.
"""
