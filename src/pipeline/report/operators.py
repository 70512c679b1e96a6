"""Where a profiled step's time went, in groups a user can act on, each with its hint.

The profiler ranks operators by self time (``pipeline.engine.observe.profile_report``); a name such as
``aten::_log_softmax`` or ``aten::copy_`` says little to someone who wrote ``F.log_softmax`` or ``x.transpose(0,
1).contiguous()``. The groups, each a share of the profiled steps' time:

- **softmax / log_softmax** (forward and backward). Two or more log_softmax calls a step is the tell-tale of a loss
  that applies log_softmax to outputs that already are log-probabilities (the loss's log_softmax of log-probabilities
  gives them back unchanged: the result is right, the time is wasted).
- **copies and layout changes**: ``copy_``, ``contiguous``, ``clone``, ``to``, transposes and permutes made dense.
- **host syncs**: ``.item()``, ``.cpu()``, ``.tolist()`` on a tensor (``_local_scalar_dense``); on a GPU each one
  waits for the device.
- **the optimizer**: its step and zero_grad, with everything they called.
- **many small operators**: operators whose calls take under ``SMALL_US`` each on average, when there are at least
  ``MANY_CALLS`` calls a step: the time goes to launching and dispatching them, not to arithmetic.
- **outside operators**: the step's time in no operator at all (Python, the step hook, the pipeline between them).

A group is named when it takes at least ``NAMED_PCT`` of the profiled steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NAMED_PCT = 5.0
SMALL_US = 10.0  # a call's mean self time under this: dispatch and launch, not arithmetic
MANY_CALLS = 100  # small calls a step before "many small operators" is a group

SOFTMAX = {
    "aten::_log_softmax",
    "aten::log_softmax",
    "aten::_softmax",
    "aten::softmax",
    "aten::_log_softmax_backward_data",
    "aten::_softmax_backward_data",
}
LOG_SOFTMAX_FORWARD = "aten::_log_softmax"
COPIES = {
    "aten::copy_",
    "aten::contiguous",
    "aten::clone",
    "aten::_to_copy",
    "aten::to",
    "aten::transpose",
    "aten::t",
    "aten::permute",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::as_strided",
    "aten::empty_strided",
    "aten::movedim",
}
SYNCS = {"aten::item", "aten::_local_scalar_dense", "aten::cpu", "aten::tolist"}


@dataclass(frozen=True)
class OperatorGroup:
    """One group's share of the profiled steps' time, what it holds and what to do about it."""

    name: str  # "log_softmax", "copies and layout changes", ...
    share_pct: float
    detail: str  # the evidence: "2 log_softmax calls a step" or the group's top operators
    hint: str  # "" when there is nothing to change (the loss's own log_softmax)

    def words(self) -> str:
        return f"{self.name} {self.share_pct:.0f}% of step time ({self.detail})"


def operator_groups(report: Any, *, outputs: str, device_type: str) -> list[OperatorGroup]:
    """The groups of ``report`` (a ``ProfileReport``) that take ``NAMED_PCT`` or more of the profiled steps, largest
    first; ``outputs``: the task's ``task.outputs`` (logits or log_probs), which decides the softmax hint."""
    ops = report.operators
    steps = max(report.steps, 1)
    groups = [
        _softmax(ops, steps, outputs=outputs),
        _members("copies and layout changes", ops, COPIES, _COPY_HINT),
        _members("host syncs", ops, SYNCS, _SYNC_HINT.format(device=device_type)),
        OperatorGroup("the optimizer", report.optimizer_pct, "its step and zero_grad", _OPTIMIZER_HINT),
        _small(ops, steps),
        _outside(ops),
    ]
    named = [g for g in groups if g is not None and g.share_pct >= NAMED_PCT]
    return sorted(named, key=lambda g: -g.share_pct)


def _softmax(ops: list[Any], steps: int, *, outputs: str) -> OperatorGroup | None:
    members = [op for op in ops if op.name in SOFTMAX]
    if not members:
        return None
    share = sum(op.share_pct for op in members)
    forward_calls = sum(op.calls for op in members if op.name == LOG_SOFTMAX_FORWARD) / steps
    if forward_calls >= 2 and outputs == "logits":
        hint = (
            "log_softmax runs twice a step: the model's outputs already are log-probabilities and the loss applies "
            "log_softmax again; set task.outputs=log_probs (the loss then takes them as they are)"
        )
        return OperatorGroup("log_softmax on log-probabilities", share, f"{forward_calls:.0f} calls a step", hint)
    # once a step on logits: the loss's own log_softmax, which the loss needs (no hint); more: the model's own too
    hint = "" if forward_calls <= 1 and outputs == "logits" else _SOFTMAX_HINT
    return OperatorGroup("softmax / log_softmax", share, f"{forward_calls:.0f} log_softmax calls a step", hint)


def _members(name: str, ops: list[Any], names: set[str], hint: str) -> OperatorGroup | None:
    members = [op for op in ops if op.name in names]
    if not members:
        return None
    top = ", ".join(f"{op.name.removeprefix('aten::')} {op.share_pct:.0f}%" for op in members[:3])
    return OperatorGroup(name, sum(op.share_pct for op in members), top, hint)


def _small(ops: list[Any], steps: int) -> OperatorGroup | None:
    small = [op for op in ops if op.calls and 1e3 * op.self_ms / op.calls < SMALL_US]
    calls = sum(op.calls for op in small) / steps
    if calls < MANY_CALLS:
        return None
    detail = f"{calls:.0f} calls a step under {SMALL_US:.0f} µs each"
    return OperatorGroup("many small operators", sum(op.share_pct for op in small), detail, _SMALL_HINT)


def _outside(ops: list[Any]) -> OperatorGroup:
    inside = sum(op.share_pct for op in ops)
    return OperatorGroup("outside operators", max(0.0, 100.0 - inside), "Python between them", _OUTSIDE_HINT)


_SOFTMAX_HINT = "a model that ends in softmax for a loss that takes logits computes it twice: return the logits"
_COPY_HINT = (
    "transposes and permutes made contiguous copy the tensor; keep one layout through the step (a batch-first "
    "model for batch-first data: data.batch_dim), or move the copy out of the step"
)
_SYNC_HINT = "read values with .item()/.cpu() every few steps, not every step ({device})"
_OPTIMIZER_HINT = (
    "a foreach or fused update (optimizer.foreach=true, where the optimizer takes it) runs fewer operators"
)
_SMALL_HINT = "trainer.compile=true fuses small operators; a larger loader.batch_size gives each more work"
_OUTSIDE_HINT = "Python between operators: a larger loader.batch_size, or trainer.compile=true"
