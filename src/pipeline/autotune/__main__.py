"""``python -m pipeline.autotune [overrides] [--budget-s S] [--batch-size] ...``: see ``pipeline.autotune``.

``main`` lives in ``pipeline.autotune.cli``, not here: the package imports it, and a ``__main__`` already imported
under its own name would make ``python -m`` warn.
"""

import sys

from pipeline.autotune.cli import main

if __name__ == "__main__":
    sys.exit(main())
