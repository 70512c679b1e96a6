"""``python -m bench`` (from the checkout's root): what the pipeline costs, measured (``bench.suite``; ``--help`` for
the options)."""

import sys

from bench.suite import main

if __name__ == "__main__":
    sys.exit(main())
