"""Faults injected into a real ``torchrun`` job (on ``PYTHONPATH`` in tests/test_distributed.py).

Python imports ``sitecustomize`` at start-up, before ``pipeline``; this one patches the loop only when
``PIPELINE_FAULT`` names a fault, and only on the rank it names:

- ``oom:<rank>:<max samples>``: that rank's forward and backward raise CUDA's out-of-memory error for any
  micro-batch larger than ``max samples`` (a card that fits that many), every time.
- ``sigterm:<rank>:<step>``: that rank sends itself SIGTERM once, as it finishes ``step``.
"""

from __future__ import annotations

import os

FAULT = os.environ.get("PIPELINE_FAULT", "")
RANK = os.environ.get("RANK")

if FAULT and RANK is not None:
    kind, rank, value = FAULT.split(":")
    if rank == RANK:
        import signal

        import torch

        from pipeline import loop

        if kind == "oom":
            real = loop.forward_backward

            def forward_backward(state, images, labels, **kwargs):  # type: ignore[no-untyped-def]
                if state.micro.micro_batch > int(value):
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
                return real(state, images, labels, **kwargs)

            loop.forward_backward = forward_backward
        elif kind == "sigterm":
            real_add = loop.LossWindow.add

            def add(self, loss, samples, step):  # type: ignore[no-untyped-def]
                real_add(self, loss, samples, step)
                if step == int(value):
                    os.kill(os.getpid(), signal.SIGTERM)

            loop.LossWindow.add = add
