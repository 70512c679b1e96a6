"""pipeline: train PyTorch models on the device you meant, and measure what each change buys.

Run it with ``python -m pipeline`` (see the README and docs/); ``pipeline.train.train`` is the library entry.

One package per layer (docs/development.md; ``make test`` enforces them with import-linter), from the bottom:
``common``; ``config``; ``data``, ``monitor`` and ``parallel`` (independent of each other); ``record``; ``engine``;
``machine`` (the doctor); ``report``; ``train``, ``autotune`` and ``experiments`` (independent of each other);
``gpucheck`` (the one-shot GPU check); then the entry points: ``__main__`` (``python -m pipeline``) and one thin
module per command (``python -m pipeline.doctor``, ``.compare``, ``.stale``, ``.outbox``, ``.gpu_check``, ``.launch``,
``.tune``; ``.autotune`` is ``autotune/__main__.py``). The engine is in rooms: ``engine.hot`` (the hot path),
``engine.building``, ``engine.checkpointing``, ``engine.observe``, and at its root the run (``session``, ``run``).
The project's own benchmarks are not in the package: ``bench/`` at the checkout's root (``python -m bench``).
"""

__version__ = "0.1.0"
