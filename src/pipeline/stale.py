"""``python -m pipeline.stale``: runs left RUNNING by a process that died, listed or closed
(``pipeline.record.stale``; ``--help`` for the options)."""

import sys

from pipeline.record.stale import main

if __name__ == "__main__":
    sys.exit(main())
