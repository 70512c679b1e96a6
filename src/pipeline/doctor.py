"""``python -m pipeline.doctor``: why the GPU is not used (``pipeline.machine.doctor``; ``--help`` for the
options)."""

import sys

from pipeline.machine.doctor import main

if __name__ == "__main__":
    sys.exit(main())
