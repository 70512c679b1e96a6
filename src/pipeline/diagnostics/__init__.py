"""Why the GPU is not used, and what the pipeline costs: the doctor (``doctor``, ``platforms``) and the
benchmarks (``bench``, ``bench_claims``, ``bench_ddp``).
"""
