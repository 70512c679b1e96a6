"""``python -m pipeline.bench``: what the pipeline costs, measured (``pipeline.diagnostics.bench``; ``--help`` for
the options)."""

import sys

from pipeline.diagnostics.bench import main

if __name__ == "__main__":
    sys.exit(main())
