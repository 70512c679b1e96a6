"""Building the run: device, precision and backend switches, the first batch checked, memory needs estimated, the CPU
amp check, model FLOPs, the run's name and tags; ``build(cfg) -> Setup`` in the order that fails fastest."""
