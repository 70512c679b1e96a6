"""``python -m pipeline.compare``: compare runs and sweeps as one table (``pipeline.experiments.compare.cli``;
``--help`` for the options)."""

import sys

from pipeline.common.heap import collector_paused
from pipeline.experiments.compare.cli import main  # light (0.1 s): MLflow is imported inside main

if __name__ == "__main__":
    with collector_paused():  # a process of its own, which keeps all it reads until it exits
        code = main()
    sys.exit(code)
