"""Checkpoints and resume: atomic checkpoints and their lock, ``resume=``/``fork=`` and what may continue, the run's
start point (fresh or resumed), and the command a stop prints."""
