"""``python -m pipeline.launch``: torchrun, quiet when stopped (``pipeline.parallel.launch``; ``--help`` for the
options)."""

import sys

from pipeline.parallel.launch import main

if __name__ == "__main__":
    sys.exit(main())
