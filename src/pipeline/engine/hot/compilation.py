"""torch.compile as a run uses it: a fresh state per run, no silent eager fallback, and every compilation counted.

    python -m pipeline trainer.compile=true                       # compile/graphs, compile/recompiles, time/compile_s
    python -m pipeline -m 'model.hidden_sizes=[64],[128],[256]' trainer.compile=true   # every job compiles

- ``fresh()``: dynamo's caches are per process. The jobs of an in-process sweep (the basic and interleaved
  sweepers, Optuna) share one, and each new model's graphs count towards the same code object's recompile limit
  (``torch._dynamo.config.recompile_limit``, 8): job #3 of a five-model sweep used to run eagerly while its run
  said ``trainer.compile=true``. ``train`` starts every compiled run from a reset.
- ``compile_model``: ``torch.compile`` with ``fail_on_recompile_limit_hit``, so hitting the limit raises
  (``RecompileLimit``, one line) instead of falling back to eager with a warning.
- ``CompileWatch``: what dynamo compiled since it was made, read from a process-wide callback (``count``: every
  compilation, forward or backward; ``recompiles``: a frame compiled again after a guard failed; ``graphs``:
  dynamo's own count of graphs). The loop compares ``count`` before and after a step: a step that compiled (the
  first, and a later one whose batch had a new shape: the last, smaller batch of an epoch, or the out-of-memory
  fallback's half) is kept out of the steady-state throughput like an epoch's first step
  (``pipeline.engine.hot.timing``).

Marking the batch dimension dynamic up front (``dynamic=True``) would avoid the last batch's recompile but makes
every step run the dynamic graph; ``python -m bench --only compile`` measures the two side by side.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from pipeline.common.errors import PipelineError
from pipeline.common.metric_names import COMPILE_GRAPHS, COMPILE_RECOMPILES

_lock = threading.Lock()
_totals = {"compiles": 0, "recompiles": 0}


class RecompileLimit(PipelineError):
    """torch.compile would have run a model eagerly: more input shapes than its recompile limit allows."""


def fresh() -> None:
    """Forget every compiled graph, guard and cache entry of this process: the run compiles from scratch."""
    torch._dynamo.reset()


def compile_model(model: nn.Module, *, mode: str) -> nn.Module:
    """``torch.compile(model, mode=mode)``: compiled lazily, at the first forward of each new input shape.

    ``dynamic`` stays at torch's default (None): the first batch shape compiles a static graph, and a second
    shape (the last, smaller batch of an epoch, or the out-of-memory fallback's halved micro-batch) recompiles
    once with that dimension marked dynamic, which then serves every later size but 1. Hitting the recompile
    limit raises (``fail_on_recompile_limit_hit``): a run never says it compiled while running eagerly.

    Args:
        model: the model, on its device, already in its memory format and wrapped for DDP if any.
        mode: ``trainer.compile_mode``: default, reduce-overhead (adds CUDA graphs), max-autotune or
            max-autotune-no-cudagraphs.
    """
    _listen()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return cast(nn.Module, torch.compile(model, mode=mode))  # a module's compiled form is a module


def allow_models(models: int) -> None:
    """Raise dynamo's recompile limit for ``models`` live compiled models of one class (the autotuner's candidates):
    the limit counts graphs per code object, and every instance compiles the same forward."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * models)


def _listen() -> None:
    """Count dynamo's compilations for this process (``torch._dynamo.callback_handler``); again after a ``fresh()``,
    since ``torch._dynamo.reset`` forgets the callbacks too."""
    from torch._dynamo.callback import callback_handler

    with _lock:
        if _on_compile not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_compile)


def _on_compile(args: object) -> None:
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "")
    frame_compile = str(getattr(args, "compile_id", "")).split("/")[-1]  # "frame/nth compile of that frame"
    with _lock:
        _totals["compiles"] += 1
        if trigger == "DYNAMO" and frame_compile.isdigit() and int(frame_compile) > 0:
            _totals["recompiles"] += 1


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass
class CompileWatch:
    """What was compiled since this watch was made (``start``)."""

    compiles_at_start: int = 0
    recompiles_at_start: int = 0
    graphs_at_start: int = 0

    @classmethod
    def start(cls) -> CompileWatch:
        _listen()
        return cls(_totals["compiles"], _totals["recompiles"], _graphs())

    @property
    def count(self) -> int:
        """Compilations so far (forward and backward): a step that changed it compiled."""
        return _totals["compiles"] - self.compiles_at_start

    @property
    def recompiles(self) -> int:
        return _totals["recompiles"] - self.recompiles_at_start

    @property
    def graphs(self) -> int:
        return _graphs() - self.graphs_at_start

    def metrics(self) -> dict[str, float]:
        return {COMPILE_GRAPHS: float(self.graphs), COMPILE_RECOMPILES: float(self.recompiles)}


class NoCompile:
    """The watch of an eager run: nothing is ever compiled, and reading it costs nothing."""

    count = 0
    recompiles = 0
    graphs = 0

    def metrics(self) -> dict[str, float]:
        return {}


NO_COMPILE = NoCompile()


def hit_recompile_limit(err: BaseException) -> bool:
    from torch._dynamo.exc import FailOnRecompileLimitHit

    return isinstance(err, FailOnRecompileLimitHit)


def recompile_limit_error(step: int | None) -> RecompileLimit:
    """The one-line error for a recompile limit hit at training step ``step`` (None: in evaluation)."""
    limit = torch._dynamo.config.recompile_limit
    where = f"at step {step}" if step is not None else "in evaluation"
    return RecompileLimit(
        f"torch.compile reached its recompile limit ({limit} graphs for the model's forward) {where}: "
        "the model met more input shapes than that, and a run never continues eagerly while it says "
        "trainer.compile=true. Use one batch shape (loader.drop_last=true), or trainer.compile=false"
    )
