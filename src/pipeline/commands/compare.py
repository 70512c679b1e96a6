"""``python -m pipeline.compare``: compare runs and sweeps as one table (``pipeline.experiments.compare.cli``;
``--help`` for the options)."""

import sys

from pipeline.experiments.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
