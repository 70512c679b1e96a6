"""``python -m pipeline.outbox``: metrics a run could not send, sent again (``pipeline.record.outbox``; ``--help``
for the options)."""

import logging
import sys

from pipeline.record.outbox import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
