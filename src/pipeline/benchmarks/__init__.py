"""The project measuring itself: the benchmark suite (``python -m pipeline.bench``: ``bench`` and its
``bench_*`` parts, measured the way ``harness`` says) and the one-shot check of the speed goals on an NVIDIA GPU
(``python -m pipeline.gpu_check``: ``gpu_check``, its ``gpu_goals``, and the steps in ``gpu_training``,
``gpu_overheads`` and ``gpu_profile``). The top layer below the entry points: nothing else imports it.
"""
