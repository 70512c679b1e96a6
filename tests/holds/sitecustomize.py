"""Holds a real ``python -m pipeline`` in one phase until a signal arrives (on ``PYTHONPATH`` in
tests/test_resume.py's Ctrl-C tests), so that the test signals it there, not after a guessed sleep.

``PIPELINE_HOLD`` names the phase: ``imports`` (the entry point importing Hydra), ``compose`` (the config's
composition), ``build`` (the run being built), ``memory`` (the memory estimate), ``first_step`` (the first
training step, until the stop is requested) or ``teardown`` (closing, after the run). The process prints
``holding at <phase>`` on stderr once it is there.
"""

from __future__ import annotations

import os
import sys

PHASE = os.environ.get("PIPELINE_HOLD", "")
if PHASE:  # a process stuck on its way to the hold (or in it) prints every thread's stack and ends: the test says where
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("PIPELINE_HOLD_LIMIT_S", "100")), exit=True)


def hold(until: object = None) -> None:
    import time

    print(f"holding at {PHASE}", file=sys.stderr, flush=True)
    while until is None or not until():  # a signal's KeyboardInterrupt ends it, or ``until``
        time.sleep(0.02)


def held(fn, until: object = None):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        hold(until)
        return fn(*args, **kwargs)

    return wrapper


if PHASE == "imports":
    import importlib.abc

    class _HoldOmegaConf(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name == "omegaconf":
                sys.meta_path.remove(self)
                hold()
            return None

    sys.meta_path.insert(0, _HoldOmegaConf())
elif PHASE == "compose":
    import pipeline.config

    pipeline.config.load = held(pipeline.config.load)
elif PHASE in ("build", "memory"):
    import pipeline.engine.building.build as build_module

    if PHASE == "build":
        build_module.build = held(build_module.build)
    else:
        build_module.check_training = held(build_module.check_training)
elif PHASE == "first_step":
    import signal

    from pipeline.engine.hot import loop

    def stop_requested() -> bool:
        stop = getattr(signal.getsignal(signal.SIGINT), "__self__", None)  # the run's StopRequests
        return stop is not None and stop.signum is not None

    loop.train_epoch = held(loop.train_epoch, until=stop_requested)
elif PHASE == "teardown":
    import pipeline.experiments.sweep as sweep

    sweep.end_unfinished = held(sweep.end_unfinished)
