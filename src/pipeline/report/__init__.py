"""What a run concludes and shows: its record at the start and the end (``logbook``), the summary block,
the bottleneck verdict and the utilisation and step-time plots.
"""
