"""Observation: the profiler riding on the step timer and what it found, the memory snapshot at an out-of-memory error,
the progress bar and lines, and the step time with free data (the replay check)."""
