"""Several runs at once: sweeps, their parent run and their files (``sweep``, ``sweep_parent``, ``sweep_files``)
and comparing runs (``compare``).
"""
