"""The project measuring itself, outside the package: ``python -m bench`` from a checkout's root (``--help`` for the
options). ``suite`` holds the suite and its command, the ``amp``, ``claims``, ``ddp``, ``compare``, ``mfu`` and
``tune`` modules its other rows; every one measures the way ``pipeline.gpucheck.harness`` says. It imports
``pipeline`` as a user's code would; nothing in ``pipeline`` imports it, and the wheel does not ship it.
"""
