"""pipeline: train PyTorch models on the device you meant, and measure what each change buys.

Run it with ``python -m pipeline`` (see the README and docs/); ``pipeline.train.train`` is the library entry.
"""

__version__ = "0.1.0"
