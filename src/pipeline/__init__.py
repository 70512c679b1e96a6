"""pipeline: train PyTorch models on the device you meant, and measure what each change buys.

Run it with ``python -m pipeline`` (see the README and docs/); ``pipeline.train.train`` is the library entry.

The package's layers, from the bottom (docs/development.md; ``make test`` enforces them): ``common``, ``record``,
``config``, ``engine`` with ``parallel``, ``data`` and ``monitor``, ``report``, ``experiments`` and
``diagnostics``, then ``train`` (one run, start to end) and the entry points: ``__main__`` and ``commands``.
"""

import os

__version__ = "0.1.0"

# python -m pipeline.<command> (doctor, compare, autotune, stale, outbox, bench, gpu_check, launch): the thin modules in
# commands/ are found as pipeline.<command>, so the top of the package shows its layers, not one file per command
__path__.append(os.path.join(os.path.dirname(__file__), "commands"))
