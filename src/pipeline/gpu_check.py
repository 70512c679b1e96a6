"""``python -m pipeline.gpu_check``: the pipeline's speed goals checked on an NVIDIA GPU
(``pipeline.gpucheck.check``; ``--help`` for the options)."""

import sys

from pipeline.gpucheck.check import main

if __name__ == "__main__":
    sys.exit(main())
