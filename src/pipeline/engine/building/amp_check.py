"""Does amp pay off on this CPU, for this model? Measured before training, the same way every time.

    python -m pipeline amp=true device=cpu        # the check runs at start-up; its verdict is in the summary

On a CPU, autocast pays off only where the hardware computes the narrow format: Intel's AMX (``amx_bf16``)
makes a ResNet-50 step about 4× faster in bfloat16, while an AMD EPYC without it runs the same step about 10×
*slower*. Nothing about the CPU's name says which; the check times the run's own model in both formats:

- the batch is the run's own, capped by a fixed amount of arithmetic (``PROBE_FLOPS``, from the model's counted
  FLOPs per sample, never from a timing), so identical configurations always time the same batch;
- after one untimed step each (oneDNN builds its kernels on first use), float32 and amp steps run in
  interleaved pairs (A B, B A, ...) until ``PAIRS`` pairs or the budget; the speed is the median of the pairs'
  ratios (``pipeline.common.stats.paired_ratio``), so a burst of load from elsewhere slows both sides of a pair alike;
- the verdict has a dead band (``SAME``): amp is *faster* from 1.10×, *slower* from 1/1.10, else *about the
  same*, so repeats on a quiet machine (within ±15% of each other) never contradict each other, and give one
  verdict unless the true ratio sits right at 1.10 or 1/1.10 (the summary prints the ratio itself too);
- the CPU's flags (``amx_bf16``, ``avx512_bf16``) are read, not assumed, and the advice says which it has.

The summary, the warning at start-up and the bottleneck hint (``pipeline.report.verdict``) all follow the measurement.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.common.stats import paired_ratio
from pipeline.data.structures import call_model, count, take
from pipeline.engine.building import flops
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.hot.timing import seconds

log = logging.getLogger("pipeline.engine.amp_check")  # the name its lines have always shown

PROBE_FLOPS = 8e9  # arithmetic of one float32 step the probe's batch is sized to (~0.1 s on a few cores)
PROBE_MIN_BATCH = 2  # BatchNorm in train mode needs more than one value per channel
PAIRS = 7  # interleaved float32/amp pairs at most; the median of their ratios is the speed
MIN_CALL_S = 0.05  # a timed measurement repeats a short step until it lasts this long (jitter is milliseconds)
MAX_REPEATS = 100
BUDGET_S = 10.0  # no pair starts that would end later (the warm-ups always run)
SAME = 1.10  # amp within this factor of float32's speed either way is "about the same"
_FORMATS = {"bf16": "bfloat16", "fp16": "float16"}
StepLoss = Callable[[nn.Module, Any, Any], torch.Tensor]  # (model, inputs, targets) -> scalar: one step's loss


def model_loss(loss: Callable[[Any, Any], torch.Tensor]) -> StepLoss:
    """A loss of (outputs, targets) as a step's: the model called on the inputs, then the loss."""
    return lambda model, inputs, targets: loss(call_model(model, inputs), targets)


@dataclass(frozen=True)
class AmpProbe:
    """The run's model timed in float32 and under CPU autocast, as ``probe_cpu_amp`` found it."""

    fp32_s: float  # median seconds of one float32 training step at ``batch``
    amp_s: float  # the same under autocast
    speed: float  # amp's speed relative to float32: the median of the pairs' fp32/amp ratios (nan: no pair)
    batch: int
    pairs: int  # interleaved pairs timed (0: only the warm-ups ran, so the figures are first steps)
    dtype: str  # the autocast format: "bf16" or "fp16"
    amx: bool | None = None  # the CPU's flags include amx_bf16 (None: unknown on this OS)
    run_batch: int = 0  # the run's own batch (``batch`` is capped below it by ``PROBE_FLOPS``); 0: not known

    @property
    def measured(self) -> bool:
        return self.pairs > 0 and math.isfinite(self.speed)

    @property
    def verdict(self) -> str:
        """``faster``, ``slower``, ``same`` or ``unknown`` (nothing measured)."""
        if not self.measured:
            return "unknown"
        return "faster" if self.speed >= SAME else "slower" if self.speed <= 1 / SAME else "same"

    def describe(self) -> str:
        """The summary's line: ``bf16 autocast ran at 0.52x float32's speed (median of 5 pairs at batch 64, ...)``."""
        if not self.measured:
            return (
                f"{self.dtype} autocast was not measured: one float32 step at batch {self.batch} took "
                f"{seconds(self.fp32_s)} and the check's {BUDGET_S:g} s allowed no timed pair"
            )
        said = {
            "faster": "amp pays off here",
            "slower": "amp=false is faster here",
            "same": "about the same: either will do",
        }[self.verdict]
        capped = (
            f"; the run's batch is {self.run_batch}: autocast casts the weights every step, a cost larger batches "
            "share, so the run's own epochs may gain more"
            if self.batch < self.run_batch
            else ""
        )
        return (
            f"{self.dtype} autocast ran at {self.speed:.2f}x float32's speed on this CPU (median of {self.pairs} "
            f"interleaved pair(s) at batch {self.batch}: {seconds(self.amp_s)} vs {seconds(self.fp32_s)} a step, "
            f"before training{capped}): {said}"
        )


@cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (Linux's /proc/cpuinfo), None where the OS does not list them."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def has_amx() -> bool | None:
    flags = cpu_flags()
    return None if flags is None else "amx_bf16" in flags


def probe_batch(model: nn.Module, images: Any, run_batch: int, *, per_sample: float | None = None) -> int:
    """The run's batch, capped so that one float32 step is about ``PROBE_FLOPS`` of arithmetic.

    The FLOPs per sample are the run's own where it counted them (``per_sample``: a step hook's model takes more
    than its inputs), else counted on a 2-sample forward of ``model`` (in eval mode, on a copy): the same for every
    run of the same model and input, whatever the machine is doing.
    """
    if per_sample is None:
        sample = take(images, slice(0, PROBE_MIN_BATCH))
        per_sample = flops.per_sample(flops.forward_flops(model, sample), count(sample))
    fits = int(PROBE_FLOPS // per_sample) if per_sample else run_batch
    return max(PROBE_MIN_BATCH, min(run_batch, count(images), fits))


def probe_cpu_amp(
    model: nn.Module,
    batch: tuple[Any, Any],
    *,
    dtype: torch.dtype,
    budget_s: float = BUDGET_S,
    pairs: int = PAIRS,
    loss: StepLoss | None = None,
    per_sample: float | None = None,
) -> AmpProbe:
    """Time training steps of ``model`` in float32 and under CPU autocast to ``dtype``, in interleaved pairs.

    The steps run on a copy of the model in train mode without its hooks, with the torch random stream forked,
    so the run sees the same weights, BatchNorm statistics, gradients and random numbers as if no probe had run.

    Args:
        model: The run's model, on the CPU.
        batch: The images, already-normalised float32 on the CPU (the run's first batch, after ``prepare``), and
            their labels.
        loss: The run's step loss, ``loss(model, inputs, targets)`` (a step hook's, or ``model_loss`` of the task's;
            default cross-entropy on the model's outputs).
        per_sample: The run's training FLOPs per sample, where it counted them (``probe_batch``).
        dtype: The autocast dtype the run would use (``torch.bfloat16`` or ``torch.float16``).
        budget_s: No pair starts that would end after this many seconds (the two warm-ups always run).
        pairs: The most pairs.
    """
    images, labels = batch
    deadline = time.perf_counter() + budget_s
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        copied = _bare_copy(model)
        size = probe_batch(copied, images, count(labels), per_sample=per_sample)
        copied.train()
        cut = slice(0, size)
        step_loss = loss or model_loss(F.cross_entropy)
        fp32_step = _train_step(copied, take(images, cut), take(labels, cut), None, step_loss)
        amp_step = _train_step(copied, take(images, cut), take(labels, cut), dtype, step_loss)
        first, times = time_pairs(fp32_step, amp_step, pairs=pairs, until=deadline)
    if not times[0]:
        return AmpProbe(first[0], first[1], math.nan, size, 0, name, has_amx(), count(labels))
    fp32, amp = statistics.median(times[0]), statistics.median(times[1])
    ratio = paired_ratio(times[0], times[1])
    return AmpProbe(fp32, amp, ratio, size, len(times[0]), name, has_amx(), count(labels))


def time_pairs(
    first: Callable[[], object], second: Callable[[], object], *, pairs: int, until: float
) -> tuple[list[float], tuple[list[float], list[float]]]:
    """One untimed call of each (oneDNN builds its kernels on first use), then up to ``pairs`` timed pairs in
    alternating order (A B, B A, ...), so a burst of load from elsewhere slows both sides of a pair alike. A call
    too short to time against the scheduler's jitter (a small MLP's step takes 3 ms) is repeated until a timed
    measurement lasts ``MIN_CALL_S``; its seconds are per call. No pair starts that would end after ``until`` (a
    ``time.perf_counter`` value), judged by the last measurements.

    Returns:
        The two warm-up calls' seconds, and each function's timed seconds per call, pair by pair.
    """
    warm = [_timed(first), _timed(second)]
    calibrated = [_timed(first), _timed(second)]  # warm now: what one call costs
    repeats = [max(1, min(MAX_REPEATS, math.ceil(MIN_CALL_S / max(c, 1e-9)))) for c in calibrated]
    last = [c * r for c, r in zip(calibrated, repeats, strict=True)]
    times: tuple[list[float], list[float]] = ([], [])
    fns = (first, second)
    for pair in range(pairs):
        if time.perf_counter() + last[0] + last[1] > until:
            break
        for i in (0, 1) if pair % 2 == 0 else (1, 0):
            last[i] = _timed(fns[i], repeats[i])
            times[i].append(last[i] / repeats[i])
    return warm, times


def _timed(step: Callable[[], object], repeats: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return time.perf_counter() - start


def _bare_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` without forward/backward hooks: the probe times the model's own compute, and whatever
    the hooks count or record (tests, profilers) never sees the probe's steps."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        for hooks in (
            module._forward_pre_hooks,
            module._forward_hooks,
            module._backward_pre_hooks,
            module._backward_hooks,
        ):
            hooks.clear()
    return copied


def _train_step(
    model: nn.Module, images: Any, labels: Any, dtype: torch.dtype | None, loss: StepLoss
) -> Callable[[], None]:
    """One forward and backward step, as the loop runs it (no optimizer step: it costs the same in both)."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        cast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with cast:
            value = loss(model, images, labels)
        value.backward()

    return step


def amp_advice(probe: AmpProbe) -> str | None:
    """A warning when amp measured slower than float32 on this CPU, else None (faster, the same, or unmeasured)."""
    if probe.verdict != "slower":
        return None
    if probe.amx:
        why = f"this CPU has AMX (amx_bf16), yet this model's {_FORMATS[probe.dtype]} steps are slower here"
    elif probe.amx is None:
        why = f"{_FORMATS[probe.dtype]} pays off on a CPU only with AMX, and this OS does not say whether it has it"
    else:
        why = f"this CPU has no AMX (no amx_bf16 in its flags), so {_FORMATS[probe.dtype]} is not computed natively"
    return f"amp=true: {probe.describe()}; {why}. Train with amp=false, or on a GPU."


def check_cpu_amp(
    policy: PrecisionPolicy,
    model: nn.Module,
    batch: Callable[[], tuple[Any, Any]],
    loss: StepLoss | None = None,
    per_sample: float | None = None,
) -> AmpProbe | None:
    """With amp=true on the CPU, time the run's model in both formats before training and warn if amp is slower.

    ``batch()`` gives the normalised images and labels to time with, called only when the check runs. The run
    still trains as asked. Returns None (and measures nothing) on other devices and without amp.
    """
    if policy.device_type != "cpu" or policy.dtype is None:
        return None
    probe = probe_cpu_amp(model, batch(), dtype=policy.dtype, loss=loss, per_sample=per_sample)
    advice = amp_advice(probe)
    if advice:
        log.warning(advice)
    return probe
