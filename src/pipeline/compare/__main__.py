"""``python -m pipeline.compare``: see ``pipeline.compare`` for what it does, ``--help`` for its options."""

import sys

from pipeline.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
