"""Several runs at once: sweeps and their parent run (``sweep``), comparing runs (``compare``) and tuning the
loader (``autotune``).
"""
