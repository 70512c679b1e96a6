"""Training one run: what ``build`` makes (device, data, model, precision, loader), the step loop (``loop``) with
its out-of-memory recovery (``memory``), timing and stops, ``torch.compile`` (``compilation``), checkpoints and
resume. Never imports the doctor (``machine``), the report, experiments or the entry points.
"""
