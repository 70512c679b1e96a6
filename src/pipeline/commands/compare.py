"""``python -m pipeline.compare``: compare runs and sweeps as one table (``pipeline.experiments.compare.cli``;
``--help`` for the options)."""

import sys

from pipeline.common.heap import collector_paused

if __name__ == "__main__":
    with collector_paused():  # from the imports on: a process of its own, which keeps all it reads until it exits
        from pipeline.experiments.compare.cli import main

        code = main()
    sys.exit(code)
