"""The bottleneck verdict: is this run waiting for its input, or for its arithmetic?

The rules, on the steady-state step-time breakdown (``input`` = waiting for the batch plus
copying it to the device) and, when a GPU was sampled, its mean utilisation:

- ``input``:   input >= 30% of step time, or input >= 15% while the GPU is busy < 50% on average.
- ``compute``: input < 10% of step time (and, with a GPU, busy >= 50% or not measured).
- ``mixed``:   everything in between.

The pipeline's own work between steps (reading the loss back, checkpoints, the progress bar;
``time/overhead_pct``) is not input: it never makes a run input-bound. When it takes
``OVERHEAD_PCT`` or more of the step time, the verdict says so and how to reduce it.

The hint names the overrides to try next, chosen from the run's own loader and device. A compute-bound run is
judged by its MFU too (``pipeline.engine.flops``): under ``LOW_MFU_PCT`` of the device's peak it gets the changes
that raise it (amp, channels_last, compile, a larger batch); from ``HIGH_MFU_PCT`` on it is told that the model's
own arithmetic is the limit at this precision.

No rule reads a CPU utilisation: the machine's figure counts every process on it, so it says nothing of this run.
When other processes kept the machine busy (``pipeline.monitor.BUSY_OTHERS_PCT``), the evidence says so: the shares
then measure the contention as much as the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.config import RunConfig
from pipeline.engine.amp_check import AmpProbe, has_amx

INPUT_BOUND_PCT = 30.0
INPUT_WITH_IDLE_GPU_PCT = 15.0
IDLE_GPU_PCT = 50.0
COMPUTE_BOUND_PCT = 10.0
OVERHEAD_PCT = 10.0
# MFU bands: well-tuned training reaches 40-60% of a GPU's dense peak (nanoGPT's GPT-2 on an A100: about 40%);
# under 30% a run leaves most of the device unused, from 50% on little is left to win by tuning the training loop.
LOW_MFU_PCT = 30.0
HIGH_MFU_PCT = 50.0


@dataclass(frozen=True)
class Verdict:
    bottleneck: str  # input | compute | mixed
    message: str  # the printed line: the evidence, then what to try


def data_wait_words(resident: bool) -> str:
    """What the data-wait share counts: the loader's next batch, or, with ``loader.resident=true`` (no loader),
    cutting the batch out of the tensors kept on the device (indexing, normalising, any on-device augmentation)."""
    return "cutting batches from the resident tensors" if resident else "waiting for data"


def classify(*, data_wait_pct: float, h2d_pct: float, gpu_util_pct: float | None) -> str:
    """``input``, ``compute`` or ``mixed`` by the rules in the module docstring."""
    input_pct = data_wait_pct + h2d_pct
    gpu_idle = gpu_util_pct is not None and gpu_util_pct < IDLE_GPU_PCT
    if input_pct >= INPUT_BOUND_PCT or (gpu_idle and input_pct >= INPUT_WITH_IDLE_GPU_PCT):
        return "input"
    if input_pct < COMPUTE_BOUND_PCT and not gpu_idle:
        return "compute"
    return "mixed"


def judge(
    cfg: RunConfig,
    *,
    device_type: str,
    data_wait_pct: float,
    h2d_pct: float,
    gpu_util_pct: float | None,
    precision: str,
    overhead_pct: float = 0.0,
    cpus: int | None = None,
    amp_check: AmpProbe | None = None,
    convolutional: bool = True,
    mfu: Mfu | None = None,
    busy: str = "",
) -> Verdict:
    """The verdict with its evidence and a hint made of concrete overrides; on a CPU, what it says of amp follows
    ``amp_check`` (the start-up measurement of amp=true, ``pipeline.engine.amp_check``); ``mfu``: the run's model
    FLOPs utilisation, when it has one; ``busy``: how busy other processes kept the machine
    (``pipeline.report.summary.busy_words``), "" when they did not."""
    kind = classify(data_wait_pct=data_wait_pct, h2d_pct=h2d_pct, gpu_util_pct=gpu_util_pct)
    evidence = f"{data_wait_pct:.0f}% of step time {data_wait_words(cfg.loader.resident)}, {h2d_pct:.0f}% copying it"
    if gpu_util_pct is not None:
        evidence += f", GPU busy {gpu_util_pct:.0f}% on average"
    bookkeeping = ""
    if overhead_pct >= OVERHEAD_PCT:
        evidence += f", {overhead_pct:.0f}% the pipeline's own work between steps"
        bookkeeping = f"; to cut that, raise trainer.log_every_n_steps (now {cfg.trainer.log_every_n_steps})" + (
            f" or checkpoint.every_n_steps (now {cfg.checkpoint.every_n_steps})" if cfg.checkpoint.every_n_steps else ""
        )
    if busy:
        evidence += f"; {busy}, so this evidence is unreliable"
    if kind == "input":
        hint = input_hint(cfg, device_type=device_type, h2d_pct=h2d_pct, cpus=cpus or os.cpu_count() or 1)
    elif kind == "compute":
        hint = compute_hint(
            cfg, device_type=device_type, precision=precision, amp_check=amp_check, convolutional=convolutional, mfu=mfu
        )
    else:
        hint = (
            input_hint(cfg, device_type=device_type, h2d_pct=h2d_pct, cpus=cpus or os.cpu_count() or 1)
            + "; then "
            + compute_hint(
                cfg,
                device_type=device_type,
                precision=precision,
                amp_check=amp_check,
                convolutional=convolutional,
                mfu=mfu,
            )
        )
    label = {"input": "input-bound", "compute": "compute-bound", "mixed": "mixed"}[kind]
    return Verdict(kind, f"{label}: {evidence} — {hint}{bookkeeping}")


def input_hint(cfg: RunConfig, *, device_type: str, h2d_pct: float, cpus: int) -> str:
    loader = cfg.loader
    if loader.resident:
        return f"the data is already resident; try a larger batch (loader.batch_size={loader.batch_size * 2})"
    if device_type == "cpu":
        return f"try loader.resident=true (on the CPU, loader workers compete with training for the {cpus} CPUs)"
    pin = " loader.pin_memory=true" if device_type == "cuda" and loader.pin_memory is False else ""
    if device_type == "cuda" and h2d_pct >= INPUT_WITH_IDLE_GPU_PCT and pin:
        return f"try{pin} (pinned memory makes the copies asynchronous), or loader.resident=true"
    workers = min(4, cpus) if loader.num_workers == 0 else min(loader.num_workers * 2, cpus)
    if workers > loader.num_workers:
        more = f"loader.num_workers={workers}"
        more += " loader.persistent_workers=true" if not loader.persistent_workers else ""
        return f"try {more}{pin}, or loader.resident=true"
    return f"all {cpus} CPUs already load data; try loader.resident=true{pin}"


@dataclass(frozen=True)
class Mfu:
    """A run's model FLOPs utilisation and the peak's dtype, as the verdict reads it."""

    pct: float
    dtype: str  # fp32, tf32, bf16, fp16

    def words(self) -> str:
        return f"{self.pct:.0f}% of its {self.dtype} peak (MFU)"


def compute_hint(
    cfg: RunConfig,
    *,
    device_type: str,
    precision: str,
    amp_check: AmpProbe | None = None,
    convolutional: bool = True,
    mfu: Mfu | None = None,
) -> str:
    """What to try when the device computes most of the time; ``convolutional``: the model has 2-D convolutions
    (only then is ``channels_last`` worth a try); ``mfu``: how much of its peak the device reached."""
    if device_type == "cpu":
        return _cpu_compute_hint(precision, amp_check, mfu)
    steps = []
    if precision == "fp32":
        steps.append("amp=true")
    if convolutional and not cfg.trainer.channels_last:
        steps.append("trainer.channels_last=true")
    if not cfg.trainer.compile:
        steps.append("trainer.compile=true")
    steps.append(f"loader.batch_size={cfg.loader.batch_size * 2}")
    if mfu is not None and mfu.pct >= HIGH_MFU_PCT:
        limit = f"the device computes at {mfu.words()}: the model's own arithmetic is the limit at this precision"
        return limit + ("; amp=true computes in a narrower format, whose peak is higher" if precision == "fp32" else "")
    if mfu is not None and mfu.pct < LOW_MFU_PCT:
        return f"the device is busy but computes at only {mfu.words()}; to raise it try " + " ".join(steps)
    busy = f"the device is busy computing ({mfu.words()})" if mfu is not None else "the device is busy computing"
    return f"{busy}; to go faster try " + " ".join(steps)


def _cpu_compute_hint(precision: str, amp_check: AmpProbe | None, mfu: Mfu | None) -> str:
    hint = "the CPU does the arithmetic: train on a GPU (device=cuda)"
    if mfu is not None:
        hint = f"the CPU does the arithmetic, at {mfu.words()}: train on a GPU (device=cuda)"
        if mfu.pct >= HIGH_MFU_PCT:
            hint += "; on this CPU the model's own arithmetic is the limit"
    if precision != "fp32":
        return f"{hint}; {cpu_amp_hint(amp_check)}"

    if has_amx():
        hint += "; this CPU has AMX (amx_bf16): try amp=true, whose start-up check measures what it gains"
    return hint


def cpu_amp_hint(check: AmpProbe | None) -> str:
    """What the amp check measured, as the hint's advice on amp (never a rule of thumb against a measurement)."""
    if check is None or not check.measured:
        return "amp's effect on this CPU was not measured (see the amp check above)"
    speed = f"{check.speed:.2f}x float32 measured at start"
    return {
        "faster": f"amp pays off here ({speed}): keep amp=true",
        "slower": f"amp=false is faster here ({speed})",
        "same": f"amp makes little difference here ({speed})",
    }[check.verdict]
