"""Run the benchmark suite from a checkout: ``.venv/bin/python scripts/bench.py [--quick] [--only ...]``.

The same as ``python -m pipeline.bench``; see BENCHMARKS.md for what it measures and the latest results.
"""

import sys

from pipeline.benchmarks.bench import main

if __name__ == "__main__":
    sys.exit(main())
