"""Shared utilities every layer may use: errors (``PipelineError``), the one atomic file writer (``atomic``), the
one Markdown table writer (``markdown``), statistics (``stats``), secrets masked everywhere (``secrets``),
tracking URIs as MLflow reads them (``uris``) and the contract every command keeps with its user (``cli``).
Imports nothing else of the package.
"""
