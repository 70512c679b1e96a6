"""Faults injected into a real ``torchrun`` job (on ``PYTHONPATH`` in tests/test_distributed.py).

Python imports ``sitecustomize`` at start-up, before ``pipeline``; this one patches the loop only when
``PIPELINE_FAULT`` names a fault, and only on the rank it names:

- ``oom:<rank>:<max samples>[@<step>]``: that rank's forward and backward raise CUDA's out-of-memory error for any
  micro-batch larger than ``max samples`` (a card that fits that many), every time, from ``step`` on (default 1:
  the first step, where the micro-batch is being found; a later step is an overlapped one).
- ``sigterm:<rank>:<step>``: that rank sends itself SIGTERM once, as it finishes ``step``.
- ``oom_backward:<rank>:<step>``: that rank's overlapped backward of ``step`` (the all-reduce inside it) raises
  CUDA's out-of-memory error when it reaches the first parameter's gradient, the last one backward computes.
- ``sigterm-torchrun:<rank>:<step>``: as that rank finishes ``step``, it sends SIGTERM to its torchrun (its parent
  process, one "node" of a multi-node job) and waits until torchrun has passed the signal back to it, so that the
  job is still training when the stop arrives.
- ``abort_at_exit:<rank>:``: that rank aborts (SIGABRT) in C's exit handlers, where C++'s static destructors run
  after the interpreter's teardown, as Gloo's threads once did after a run that had succeeded ("terminate called
  without an active exception").
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

        from pipeline.engine.hot import loop
        from pipeline.engine.hot import step as step_module

        if kind == "oom":
            real = step_module.forward_backward
            fits, _, first = value.partition("@")

            def forward_backward(state, images, labels, **kwargs):  # type: ignore[no-untyped-def]
                if state.micro.micro_batch > int(fits) and state.step + 1 >= int(first or 1):
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
                return real(state, images, labels, **kwargs)

            step_module.forward_backward = forward_backward
        elif kind == "sigterm":
            real_add = loop.LossWindow.add

            def add(self, loss, samples, step):  # type: ignore[no-untyped-def]
                real_add(self, loss, samples, step)
                if step == int(value):
                    os.kill(os.getpid(), signal.SIGTERM)

            loop.LossWindow.add = add
        elif kind == "oom_backward":
            from pipeline.parallel import overlap

            real_backward = overlap.backward_reduced

            def out_of_memory(grad):  # type: ignore[no-untyped-def]
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

            def backward_reduced(model, loss, *, step, **kwargs):  # type: ignore[no-untyped-def]
                if step == int(value):
                    next(model.parameters()).register_hook(out_of_memory)
                return real_backward(model, loss, step=step, **kwargs)

            overlap.backward_reduced = backward_reduced
        elif kind == "abort_at_exit":
            import ctypes

            libc = ctypes.CDLL(None)  # C's exit handlers, where C++'s destructors run, after the interpreter's own
            libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
        elif kind == "sigterm-torchrun":
            import time

            real_add_ = loop.LossWindow.add

            def add_(self, loss, samples, step):  # type: ignore[no-untyped-def]
                real_add_(self, loss, samples, step)
                if step == int(value):
                    os.kill(os.getppid(), signal.SIGTERM)
                    stop = signal.getsignal(signal.SIGTERM).__self__  # the run's StopRequests, which torchrun signals
                    deadline = time.monotonic() + 60
                    while stop.signum is None and time.monotonic() < deadline:
                        time.sleep(0.01)

            loop.LossWindow.add = add_
