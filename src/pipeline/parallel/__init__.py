"""Several processes: torchrun's and SLURM's ranks (``distributed``, ``slurm``), the gradient all-reduce overlapped
with backward (``overlap``), and torchrun quiet when stopped (``launch``).
"""
