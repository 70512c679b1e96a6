"""Numeric precision: the autocast dtype, the GradScaler, and the CUDA backend switches.

``amp=true`` runs forward and loss under ``torch.autocast``. ``precision.dtype=auto`` picks
bfloat16 where the device computes it natively (CPUs, Ampere and newer GPUs) and float16
elsewhere; float16 needs a GradScaler so small gradients do not underflow to zero.

On a CPU, autocast only pays off where the hardware computes the narrow format (AMX); elsewhere
bfloat16 convolutions can run ten times slower than float32. ``probe_cpu_amp`` times one training
step of the run's own model in both formats before training, and ``amp_advice`` turns a slower
amp into a warning: ``python -m pipeline amp=true device=cpu`` shows it at the start.
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

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import PrecisionConfig, TrainerConfig, cuda_only_expected
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_FORMATS = {"fp16": "float16", "bf16": "bfloat16"}

_AMP_SLOWDOWN = 10.0  # the worst seen: a bf16 ResNet-50 step on AVX-512 without AMX, 17.0 s vs 1.7 s
_PROBE_MIN_BATCH = 2  # BatchNorm in train mode needs more than one value per channel
_REPEATS = 3  # timed calls per measurement when they fit; the median is kept
_ADVISE_BELOW = 0.95  # amp at less than this fraction of float32's speed earns a warning


@dataclass(frozen=True)
class PrecisionPolicy:
    """How one run computes: ``dtype`` is the autocast dtype, or None for plain float32."""

    device_type: str
    dtype: torch.dtype | None

    @property
    def uses_scaler(self) -> bool:
        return self.dtype == torch.float16

    @property
    def label(self) -> str:
        """``fp32``, ``amp-bf16`` or ``amp-fp16``: short enough for run names and tags."""
        if self.dtype is None:
            return "fp32"
        return "amp-" + ("bf16" if self.dtype == torch.bfloat16 else "fp16")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def make_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler that is a pass-through unless float16 needs it, so the loop has no branch."""
        return torch.amp.GradScaler(self.device_type, enabled=self.uses_scaler)


def resolve_precision(cfg: PrecisionConfig, *, amp: bool, device: torch.device) -> PrecisionPolicy:
    """The policy for ``amp`` and ``precision.dtype`` on ``device`` (config already validated)."""
    if not amp:
        return PrecisionPolicy(device.type, None)
    if cfg.dtype != "auto":
        return PrecisionPolicy(device.type, _DTYPES[cfg.dtype])
    return PrecisionPolicy(device.type, torch.bfloat16 if bf16_native(device) else torch.float16)


def bf16_native(device: torch.device) -> bool:
    """Whether autocast to bfloat16 is supported natively (Ampere+ on CUDA; always on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


def configure_backends(
    precision: PrecisionConfig, trainer: TrainerConfig, device: torch.device, *, amp: bool
) -> dict[str, str]:
    """Check the trainer's device switches against the device chosen, set the process-wide CUDA ones for this run;
    returns them for the record.

    A CUDA-only switch (``trainer.cudnn_benchmark``, ``trainer.compile_mode=reduce-overhead``) on another device
    is refused, not ignored: a run that says it autotuned cuDNN or used CUDA graphs and did not would be a false
    record. ``device=cpu`` and ``mps`` are refused at validation already; this catches ``device=auto`` having
    chosen one. ``precision.tf32`` stays a silent no-op off CUDA: it is on by default, for every device.
    ``trainer.channels_last`` without amp earns a warning only: float32 convolutions in NHWC are often slower
    (on GPUs the layout pays off for tensor cores under autocast), but not always, so it is worth measuring.

    Raises:
        ConfigError: a CUDA-only switch on a device that is not CUDA.
    """
    cuda_only = trainer.cuda_only()
    if cuda_only and device.type != "cuda":
        key, value = next(iter(cuda_only.items()))
        raise ConfigError(key, value, cuda_only_expected(key, device.type) + f" (device={device.type} was chosen)")
    if trainer.channels_last and not amp:
        log.warning(
            "trainer.channels_last=true without amp=true: NHWC pays off for tensor-core convolutions under "
            "autocast and is often slower in float32; add amp=true, or compare both layouts on this device"
        )
    if device.type != "cuda":
        return {"tf32": "n/a", "cudnn_benchmark": "n/a"}
    torch.backends.cuda.matmul.allow_tf32 = precision.tf32
    torch.backends.cudnn.allow_tf32 = precision.tf32
    torch.backends.cudnn.benchmark = trainer.cudnn_benchmark
    return {"tf32": str(precision.tf32).lower(), "cudnn_benchmark": str(trainer.cudnn_benchmark).lower()}


@dataclass(frozen=True)
class Timing:
    """How long one call of a function took, as ``measure`` found it."""

    seconds: float  # median of the timed calls; the warm-up's own time when none fitted
    warm: bool  # False: only the warm-up ran, so ``seconds`` includes first-use costs (an overestimate)


def measure(fn: Callable[[], object], *, until: float, repeats: int = _REPEATS) -> Timing:
    """Median seconds of ``fn`` over up to ``repeats`` calls after one untimed warm-up call.

    The warm-up always runs: oneDNN builds its kernels on first use, so a first call can be many
    times slower than the rest. The first timed call runs if ``until`` (a ``time.perf_counter``
    value) has not passed; each further one only if the call before it says it will end by then.
    So a measurement overruns ``until`` by at most one call.

    Args:
        fn: The work to time; it must finish before returning (CPU work does).
        until: The ``time.perf_counter()`` value to finish by.
        repeats: The most timed calls.

    Returns:
        The median of the timed calls, or the warm-up's time with ``warm=False`` when none fitted.
    """
    start = time.perf_counter()
    fn()
    last = time.perf_counter() - start
    times: list[float] = []
    while len(times) < repeats:
        now = time.perf_counter()
        if now > until or (times and now + last > until):
            break
        fn()
        last = time.perf_counter() - now
        times.append(last)
    if not times:
        return Timing(last, warm=False)
    return Timing(statistics.median(times), warm=True)


@dataclass(frozen=True)
class AmpProbe:
    """One training step of the run's model timed in float32 and under CPU autocast."""

    fp32_s: float  # seconds for one forward+backward step in float32, at ``batch``
    amp_s: float  # the same under autocast; nan when the budget ran out before amp could run
    batch: int  # the probe's batch (the first images of the run's first batch)
    dtype: str  # the autocast format: "bf16" or "fp16"
    partial: bool  # the budget ran out before a clean measurement (e.g. one amp step exceeded it)

    @property
    def speed(self) -> float:
        """amp's speed relative to float32: below 1, amp is slower."""
        return self.fp32_s / self.amp_s


def probe_batch(per_sample_s: float, n: int, left_s: float) -> int:
    """The largest batch up to ``n`` whose float32 and amp steps fit in ``left_s`` seconds.

    Each format costs a warm-up and one timed step, time is taken to grow linearly with the batch
    (small batches cost more per sample, so this errs short), and amp is assumed to be as much as
    ``_AMP_SLOWDOWN`` times slower than float32.

    Args:
        per_sample_s: Seconds per sample of one float32 step at a small batch.
        n: The most samples there are.
        left_s: Seconds left in the probe's budget.

    Returns:
        A batch from 1 to ``n``.
    """
    if per_sample_s <= 0:
        return n
    fits = int(left_s / (2 * (1 + _AMP_SLOWDOWN) * per_sample_s))
    return max(1, min(n, fits))


def probe_cpu_amp(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, dtype: torch.dtype, budget_s: float = 3.0
) -> AmpProbe:
    """Time one training step of ``model`` in float32 and under CPU autocast to ``dtype``.

    A float32 step at batch 2 sizes the probe: the batch is then the largest that lets both
    formats finish within ``budget_s`` even if amp is ten times slower. The steps run on a copy of
    the model in train mode, with the torch random stream forked, so the run sees the same weights,
    BatchNorm statistics, gradients and random numbers as if no probe had run. When a step runs
    past the budget the probe stops there and says it is ``partial``.

    Args:
        model: The run's model, on the CPU.
        images: An already-normalised float32 batch on the CPU (the run's first, after ``prepare``).
        labels: Its int64 class labels; the loss is ``F.cross_entropy``.
        dtype: The autocast dtype the run would use (``torch.bfloat16`` or ``torch.float16``).
        budget_s: About how many seconds the probe may take; it overruns by at most one step.

    Returns:
        The seconds per step of each format at the probe's batch.
    """
    deadline = time.perf_counter() + budget_s
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        copied = _bare_copy(model)
        batch = min(_PROBE_MIN_BATCH, len(images))
        fp32 = measure(_train_step(copied, images[:batch], labels[:batch], None), until=deadline, repeats=1)
        if not fp32.warm:  # one float32 step took the whole budget: an amp step may take ten times that
            return AmpProbe(fp32.seconds, math.nan, batch, name, partial=True)
        batch = max(batch, probe_batch(fp32.seconds / batch, len(images), deadline - time.perf_counter()))
        fp32, amp = measure_pair(
            _train_step(copied, images[:batch], labels[:batch], None),
            _train_step(copied, images[:batch], labels[:batch], dtype),
            until=deadline,
        )
    return AmpProbe(fp32.seconds, amp.seconds, batch, name, partial=not (fp32.warm and amp.warm))


def measure_pair(
    first: Callable[[], object], second: Callable[[], object], *, until: float, repeats: int = _REPEATS
) -> tuple[Timing, Timing]:
    """``measure`` for two functions whose times are compared: one warm-up each, then rounds of one
    timed call each in alternating order (A B, B A, ...), so a burst of load from elsewhere on the
    machine slows both alike instead of one. A round starts only if it should end by ``until``.
    """
    fns, last = (first, second), [0.0, 0.0]
    times: tuple[list[float], list[float]] = ([], [])
    for i, fn in enumerate(fns):
        start = time.perf_counter()
        fn()
        last[i] = time.perf_counter() - start
    for round_ in range(repeats):
        if time.perf_counter() + last[0] + last[1] > until:
            break
        for i in (0, 1) if round_ % 2 == 0 else (1, 0):
            start = time.perf_counter()
            fns[i]()
            last[i] = time.perf_counter() - start
            times[i].append(last[i])
    if not times[0]:
        return Timing(last[0], warm=False), Timing(last[1], warm=False)
    return Timing(statistics.median(times[0]), warm=True), Timing(statistics.median(times[1]), warm=True)


def _bare_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in train mode without forward/backward hooks: the probe times the model's own
    compute, and whatever the hooks count or record (tests, profilers) never sees the probe's steps."""
    copied = copy.deepcopy(model).train()
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
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype | None
) -> Callable[[], None]:
    """One forward and backward step, as the loop runs it (no optimizer step: it costs the same in both)."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        cast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with cast:
            loss = F.cross_entropy(model(images), labels)
        loss.backward()

    return step


def amp_advice(probe: AmpProbe) -> str | None:
    """A one-sentence warning when amp is slower than float32 on this CPU, else None.

    Also None when the probe never timed amp (``amp_s`` is nan): there is nothing to advise on.
    """
    if not probe.speed < _ADVISE_BELOW:
        return None
    cold = " (its first step, kernel creation included: the probe ran out of time)" if probe.partial else ""
    return (
        f"amp=true ({probe.dtype} autocast) runs {probe.speed:.2f}x the speed of float32 on this CPU: one training "
        f"step took {_seconds(probe.amp_s)}{cold} vs {_seconds(probe.fp32_s)} at batch {probe.batch} (measured "
        f"before training). amp=false is faster here; {_FORMATS[probe.dtype]} needs AMX (or a GPU) to pay off "
        "on the CPU."
    )


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.1f} s"
    return f"{value * 1000:.0f} ms" if value >= 0.01 else f"{value * 1000:.2f} ms"


def check_cpu_amp(
    policy: PrecisionPolicy, model: nn.Module, batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> AmpProbe | None:
    """With amp=true on the CPU, time the run's model in both formats before training and warn if amp is slower.

    ``batch()`` gives the normalised images and labels to time with; it is called only when the
    check runs. The run still trains as asked; the warning gives the measured ratio and the faster
    override. Returns None (and measures nothing) on other devices and without amp.
    """
    if policy.device_type != "cpu" or policy.dtype is None:
        return None
    probe = probe_cpu_amp(model, *batch(), dtype=policy.dtype)
    advice = amp_advice(probe)
    if advice:
        log.warning(advice)
    return probe
