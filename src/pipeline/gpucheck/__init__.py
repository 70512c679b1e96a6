"""The one-shot check of the speed goals on an NVIDIA GPU (``python -m pipeline.gpu_check``, which
``scripts/gpu_check.sh`` runs on a fresh machine): ``check``, its ``goals``, and the steps in ``training``,
``overheads`` and ``profiling``, measured the way ``harness`` says (which the project's own benchmarks, ``bench/`` in
a checkout, import too). The top layer below the entry points: nothing else in the package imports it.
"""
