"""The hot path: what runs at every step and every evaluation pass (the step, the epoch loop, the micro-batch policy,
the losses between logging points, the task's loss and sums, the step hook, precision, compilation's recompile check,
the step timer). It reads no config, writes no record and watches no machine (a contract of ``[tool.importlinter]``):
building the run hands it values."""
