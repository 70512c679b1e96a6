"""``python -m pipeline.autotune``: the fastest loader settings for this run (``pipeline.experiments.autotune.cli``;
``--help`` for the options)."""

import sys

from pipeline.experiments.autotune.cli import main

if __name__ == "__main__":
    sys.exit(main())
