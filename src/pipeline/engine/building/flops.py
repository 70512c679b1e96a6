"""Model FLOPs and MFU: how much arithmetic a training step needs, and what share of the device's peak it reaches.

Model FLOPs are counted as MFU defines them (PaLM, appendix B; nanoGPT's ``estimate_mfu``): 3 × the forward pass's
FLOPs, the backward pass taking about two forwards (the gradients of the inputs and of the weights). The forward is
counted once per run, by ``torch.utils.flop_counter.FlopCounterMode``, during the forward that ``build`` already runs
on the first two samples to check them (``pipeline.engine.building.inputs``): no extra step, nothing on the hot path.
The counter counts matmuls, convolutions and attention (2 FLOPs a multiply-add); element-wise work (activations,
normalisation, the optimizer) is left out, as MFU leaves it out.

These are the FLOPs the *model* needs, not those the chip executes: autograd skips some (the first layer's input
gradient, frozen weights' gradients), recomputation adds some, and a kernel may do more than the arithmetic needs.
So MFU is comparable across runs, implementations and devices; hardware FLOPs utilisation would not be.

``MFU = flops_per_sample × samples/s ÷ peak``, the peak being the device's in the dtype the run computes in
(``pipeline.monitor.peaks``: a GPU's datasheet figure, a CPU's measured matmul peak). Reported per epoch as
``perf/tflops`` and ``perf/mfu_pct``, once as ``perf/flops_per_sample``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.common.metric_names import PERF_MFU_PCT, PERF_TFLOPS
from pipeline.data.structures import call_model
from pipeline.monitor.peaks import Peak

FORWARD_AND_BACKWARD = 3  # the backward pass costs about two forwards
# Under this share of the device's peak a run leaves most of it unused (well-tuned training reaches 40-60% of a GPU's
# dense peak: nanoGPT's GPT-2 on an A100, about 40%): the verdict looks for where the time goes, and a run profiles
# a few steps by itself to find it (``pipeline.engine.observe.profiling.AutoProfiler``).


@dataclass
class Counted:
    """The FLOPs of the forward passes run inside ``counting()`` (set when the block ends)."""

    forward: int = 0


@contextlib.contextmanager
def counting() -> Iterator[Counted]:
    """Count the FLOPs of whatever runs inside (``FlopCounterMode``: by the shapes of each op, whatever the dtype)."""
    from torch.utils.flop_counter import FlopCounterMode

    counted = Counted()
    counter = FlopCounterMode(display=False)
    with counter:
        yield counted
    counted.forward = int(counter.get_total_flops())


def forward_flops(model: nn.Module, inputs: object) -> int:
    """FLOPs of one forward of ``model`` on ``inputs``, in eval mode (the mode is put back) and without gradients."""
    training = model.training
    try:
        with counting() as counted, torch.no_grad():
            call_model(model.eval(), inputs)
    finally:
        model.train(training)
    return counted.forward


def per_sample(forward: int, samples: int) -> float | None:
    """Model FLOPs of one training sample from a counted forward of ``samples`` samples; None when nothing the
    counter knows ran (a model of element-wise ops only, or one it cannot see into)."""
    return FORWARD_AND_BACKWARD * forward / samples if forward > 0 and samples > 0 else None


@dataclass(frozen=True)
class ModelFlops:
    """A run's model FLOPs per sample and the peak it is measured against; turns samples/s into TFLOP/s and MFU."""

    per_sample: float | None
    peak: Peak

    def tflops(self, samples_per_s: float) -> float | None:
        return self.per_sample * samples_per_s / 1e12 if self.per_sample is not None else None

    def mfu_pct(self, samples_per_s: float) -> float | None:
        achieved = self.tflops(samples_per_s)
        if achieved is None or not self.peak.tflops:
            return None
        return 100.0 * achieved / self.peak.tflops

    def metrics(self, samples_per_s: float) -> dict[str, float]:
        """An epoch's ``perf/tflops`` and ``perf/mfu_pct`` (those it has)."""
        values = {PERF_TFLOPS: self.tflops(samples_per_s), PERF_MFU_PCT: self.mfu_pct(samples_per_s)}
        return {k: v for k, v in values.items() if v is not None}

    def tags(self) -> dict[str, str]:
        """The record of what MFU is read against: ``perf.peak`` (its words), ``perf.peak_tflops``, ``perf.dtype``,
        and for a measured peak ``perf.peak_measured``, the time of the measurement (by which ``pipeline.compare``
        tells whether rows' MFU share one); ``perf.no_mfu`` (why) when there is none."""
        tags = {"perf.dtype": self.peak.dtype}
        if self.peak.tflops:
            tags.update({"perf.peak": self.peak.what, "perf.peak_tflops": f"{self.peak.tflops:.4g}"})
        if self.peak.measured_at:
            tags["perf.peak_measured"] = self.peak.measured_at
        if self.why_none():
            tags["perf.no_mfu"] = self.why_none()
        return tags

    def why_none(self) -> str:
        """Why the run has no MFU ("" when it has one)."""
        if self.per_sample is None:
            return "no MFU: the FLOP counter found no matmul or convolution in the model's forward"
        return self.peak.reason if not self.peak.tflops else ""

    def describe(self, samples_per_s: float) -> str:
        """The summary's words: ``54% of this CPU's fp32 peak (MFU): 0.108 of 0.201 TFLOP/s (measured matmul,
        2 thread(s)); 2.44 MFLOP a sample``, or what was achieved and why there is no MFU."""
        achieved = self.tflops(samples_per_s)
        if achieved is None:
            return self.why_none()
        work = f"{flops_words(self.per_sample or 0)} a sample"
        mfu, peak = self.mfu_pct(samples_per_s), self.peak
        if mfu is None:
            return f"{achieved:.3g} TFLOP/s ({work}); {self.why_none()}"
        said = (
            f"{mfu:.0f}% of {peak.holder}'s {peak.dtype} peak (MFU): {achieved:.3g} of {peak.tflops:.3g} TFLOP/s "
            f"({peak.basis}); {work}"
        )
        if mfu > 100 and peak.measured:  # measured once and cached: a busy machine's figure stays too low
            said += (
                "; over 100%: the cached peak is lower than this run reached (measured while the machine was "
                "busier?): python -m pipeline.doctor measures it again"
            )
        return said


def flops_words(flops: float) -> str:
    """``2.4 MFLOP``, ``12.3 GFLOP``: FLOPs in the unit a person reads."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.0f} FLOP"
