"""``python -m pipeline.bench``: what the pipeline costs, measured (``pipeline.benchmarks.bench``; ``--help`` for
the options)."""

import sys

from pipeline.benchmarks.bench import main

if __name__ == "__main__":
    sys.exit(main())
