"""``python -m pipeline.autotune``: the fastest loader settings for this run (``pipeline.autotune.cli``;
``--help`` for the options)."""

import sys

from pipeline.autotune.cli import main

if __name__ == "__main__":
    sys.exit(main())
