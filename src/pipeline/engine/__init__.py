"""Training one run. ``session`` enters everything a run holds open and ``run`` trains its epochs; the rest is in
rooms: ``hot`` (the step, the epoch loop, the micro-batch policy: it reads no config, writes no record and watches no
machine), ``building`` (``build`` makes the device, data, model, precision and loaders the config names),
``checkpointing`` (checkpoints, resume, the start point) and ``observe`` (profiling, the memory snapshot, progress, the
replay check). ``models`` and ``optim`` stay at the root: the config names their factories by path. Never imports the
doctor (``machine``), the report, experiments or the entry points.
"""
