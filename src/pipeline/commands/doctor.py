"""``python -m pipeline.doctor``: why the GPU is not used (``pipeline.diagnostics.doctor``; ``--help`` for the
options)."""

import sys

from pipeline.diagnostics.doctor import main

if __name__ == "__main__":
    sys.exit(main())
