"""The bottleneck verdict: what held the run back, how sure that is, and what to try.

The classes, on the steady-state step-time split (``input`` = waiting for the batch plus copying it to the
device; ``overhead`` = the pipeline's own work between steps), in the spirit of TensorFlow's profiler (XProf):

- ``input``:    input >= ``INPUT_HIGH_PCT`` (20%) of step time: *highly* input-bound; >= ``INPUT_MODERATE_PCT`` (5%),
  when no overhead rule applies: *moderately*.
- ``overhead``: overhead >= ``OVERHEAD_BOUND_PCT`` (15%), or MFU under ``IDLE_MFU_PCT`` (10%) with the device mostly
  idle: a GPU busy under ``IDLE_GPU_PCT`` on average, or, on a CPU, a profile whose steps spent at least
  ``OUTSIDE_IDLE_PCT`` of their time outside any operator (Python between small kernels).
- ``compute``:  the rest. From ``LOW_MFU_PCT`` of the device's peak on, the arithmetic itself is the limit; under it the
  run is compute-bound *at low MFU*, and the profile names where the time goes.
- ``unknown`` ("cannot tell"): other processes kept the machine busy (``pipeline.monitor.BUSY_OTHERS_PCT``), or the
  steady epochs disagree (their classes differ and the deciding share spreads over ``DISAGREE_SPREAD_PCT`` points);
  the message still says which way the shares lean.

The confidence is ``high`` when two or more steady epochs agree, ``medium`` with one, ``low`` for ``unknown``; the
message says which measurement decided and the epochs' spread. When MFU is low the run profiles a few steps by itself
(``pipeline.engine.observe.profiling.AutoProfiler``); the operator groups it found (``pipeline.report.operators``) are
named with their share of step time and their hints, and recorded as ``verdict.top_ops``.

The hints are concrete overrides chosen from the run's own configuration. On a CPU they are the ones that raise MFU
there (a larger batch, torch's threads, ``trainer.compile=true``, ``amp=true`` where the start-up amp check measured
it faster); a GPU comes after them, as a fact about this machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.config import RunConfig
from pipeline.engine.building.amp_check import AmpProbe, has_amx
from pipeline.engine.hot.timing import Breakdown
from pipeline.engine.observe.profiling import LOW_MFU_PCT
from pipeline.engine.results import EpochResult, steady_epochs
from pipeline.monitor import UtilSummary
from pipeline.report.operators import OperatorGroup

INPUT_HIGH_PCT = 20.0
INPUT_MODERATE_PCT = 5.0
OVERHEAD_BOUND_PCT = 15.0
IDLE_MFU_PCT = 10.0
IDLE_GPU_PCT = 50.0
OUTSIDE_IDLE_PCT = 50.0
DISAGREE_SPREAD_PCT = 5.0
INPUT_WITH_IDLE_GPU_PCT = 15.0  # the copies' share above which pinned memory is the first hint on a GPU
HIGH_MFU_PCT = 50.0  # from here on little is left to win by tuning the loop (LOW_MFU_PCT: engine/observe/profiling)
OVERHEAD_PCT = 10.0  # the pipeline's own work named in the evidence (with how to cut it) from this share on

LABELS = {
    "input-high": "highly input-bound",
    "input-moderate": "moderately input-bound",
    "overhead": "overhead-bound",
    "compute": "compute-bound",
}


@dataclass(frozen=True)
class Verdict:
    bottleneck: str  # input | overhead | compute | unknown
    message: str  # the printed line: the class, its confidence, the evidence, then what to try
    confidence: str = "medium"  # high | medium | low
    top_ops: str = ""  # the operator groups named, with their shares ("" when none was profiled)

    def tags(self) -> dict[str, str]:
        """The run's tags: ``bottleneck`` (as before) and ``verdict.*``, which ``pipeline.compare`` shows per row."""
        return {
            "bottleneck": self.bottleneck,
            "bottleneck.hint": self.message,
            "verdict.class": self.bottleneck,
            "verdict.confidence": self.confidence,
            "verdict.top_ops": self.top_ops or "none profiled",
        }


@dataclass(frozen=True)
class Mfu:
    """A run's model FLOPs utilisation and the peak's dtype, as the verdict reads it."""

    pct: float
    dtype: str  # fp32, tf32, bf16, fp16

    def words(self) -> str:
        return f"{self.pct:.0f}% of its {self.dtype} peak (MFU)"


@dataclass(frozen=True)
class Evidence:
    """What the verdict reads: the run's steady-state shares (and each steady epoch's), the GPU's utilisation, the
    MFU, the machine's business and what the profile found."""

    data_wait_pct: float
    h2d_pct: float
    overhead_pct: float = 0.0
    gpu_util_pct: float | None = None
    mfu: Mfu | None = None
    busy: str = ""  # how busy other processes kept the machine ("" when they did not)
    epochs: Sequence[tuple[float, float]] = ()  # each steady epoch's (input %, overhead %)
    groups: Sequence[OperatorGroup] = ()  # the profile's operator groups, largest first
    profiled: str = ""  # "steps 51-53 profiled" or why no step was

    @property
    def input_pct(self) -> float:
        return self.data_wait_pct + self.h2d_pct

    def device_idle(self) -> bool:
        """The device mostly idle: a GPU busy under ``IDLE_GPU_PCT``, or a CPU profile mostly outside operators."""
        if self.gpu_util_pct is not None:
            return self.gpu_util_pct < IDLE_GPU_PCT
        return any(g.name == "outside operators" and g.share_pct >= OUTSIDE_IDLE_PCT for g in self.groups)


def data_wait_words(resident: bool) -> str:
    """What the data-wait share counts: the loader's next batch, or, with ``loader.resident=true`` (no loader),
    cutting the batch out of the tensors kept on the device (indexing, normalising, any on-device augmentation)."""
    return "cutting batches from the resident tensors" if resident else "waiting for data"


def classify(*, input_pct: float, overhead_pct: float, mfu_pct: float | None = None, idle: bool = False) -> str:
    """``input-high``, ``overhead``, ``input-moderate`` or ``compute``, by the rules in the module docstring."""
    if input_pct >= INPUT_HIGH_PCT:
        return "input-high"
    if overhead_pct >= OVERHEAD_BOUND_PCT or (mfu_pct is not None and mfu_pct < IDLE_MFU_PCT and idle):
        return "overhead"
    if input_pct >= INPUT_MODERATE_PCT:
        return "input-moderate"
    return "compute"


def _deciding(kind: str) -> str:
    return {"input-high": "input", "input-moderate": "input", "overhead": "overhead"}.get(kind, "input")


def agreement(evidence: Evidence, kind: str) -> tuple[str, str]:
    """The confidence (``high``, ``medium``, or ``low`` when the steady epochs disagree) and its words: the deciding
    share's range over the steady epochs."""
    if len(evidence.epochs) < 2:
        return "medium", "one steady epoch"
    index = 1 if _deciding(kind) == "overhead" else 0
    shares = [epoch[index] for epoch in evidence.epochs]
    spread = f"{_deciding(kind)} {min(shares):.0f}-{max(shares):.0f}% over {len(shares)} epochs"
    kinds = {classify(input_pct=i, overhead_pct=o) for i, o in evidence.epochs}
    if len(kinds) > 1 and max(shares) - min(shares) >= DISAGREE_SPREAD_PCT:
        return "low", spread
    return "high", spread


@dataclass(frozen=True)
class RunFacts:
    """What the run was, as the verdict reads it: the device it trained on, its precision, whether its model has
    2-D convolutions (only then is ``channels_last`` worth a try), its model FLOPs utilisation when it has one, and
    on a CPU what the start-up amp check measured (``pipeline.engine.building.amp_check``)."""

    device_type: str  # cuda, cpu, mps
    precision: str  # the precision policy's label: fp32, amp-bf16, amp-fp16
    convolutional: bool = True
    mfu: Mfu | None = None
    amp_check: AmpProbe | None = None


@dataclass(frozen=True)
class Profiled:
    """What the run's profile found (``pipeline.report.operators``): its operator groups, largest first, and which
    steps it covered ("profile of steps 51-53") or why the run profiled none ("" when nothing was said)."""

    groups: Sequence[OperatorGroup] = ()
    words: str = ""


def busy_words(u: UtilSummary) -> str:
    """``the machine was busy (others used 60% of its CPUs)``: what the summary and the verdict say of it."""
    return f"the machine was busy (others used {u.others_cpu_pct or 0.0:.0f}% of its CPUs)"


def judge(
    cfg: RunConfig,
    run: RunFacts,
    breakdown: Breakdown,
    utilisation: UtilSummary,
    *,
    epochs: Sequence[EpochResult] = (),
    profile: Profiled = Profiled(),
    cpus: int | None = None,
) -> Verdict:
    """The verdict with its confidence, its evidence and a hint made of concrete overrides, from the run's step-time
    ``breakdown`` (``run_breakdown``: its steady steps pooled) and its machine's ``utilisation``. ``epochs``: the run's
    epochs; the steady ones' shares say how sure the verdict is, and under DDP the rank that waited most for its data
    sets the data-wait share (a straggler holds every rank back). ``cpus``: the CPUs the hints count (none: the
    machine's)."""
    mfu, busy = run.mfu, busy_words(utilisation) if utilisation.busy else ""
    shares = [
        (s.breakdown.data_wait_pct + s.breakdown.h2d_pct, s.breakdown.overhead_pct) for s in steady_epochs(list(epochs))
    ]
    e = Evidence(
        data_wait_pct=max([breakdown.data_wait_pct] + [epoch.slowest_rank_wait_pct for epoch in epochs]),
        h2d_pct=breakdown.h2d_pct,
        overhead_pct=breakdown.overhead_pct,
        gpu_util_pct=utilisation.gpu_util_mean_pct,
        mfu=mfu,
        busy=busy,
        epochs=shares,
        groups=profile.groups,
        profiled=profile.words,
    )
    kind = classify(
        input_pct=e.input_pct, overhead_pct=e.overhead_pct, mfu_pct=mfu.pct if mfu else None, idle=e.device_idle()
    )
    confidence, spread = agreement(e, kind)
    label = LABELS[kind]
    if kind == "compute" and mfu is not None and mfu.pct < LOW_MFU_PCT:
        label = "compute-bound at low MFU"
    if busy or confidence == "low":
        why = busy or f"the steady epochs disagree, {spread}"
        head, bottleneck, confidence = f"cannot tell: {why}; the shares lean {label}", "unknown", "low"
    else:
        head, bottleneck = label, kind.split("-")[0]
        head += f" ({confidence} confidence: {spread}; decided by {decided_by(kind, e)})"
    hint = _hint(kind, cfg, e, run, cpus=cpus or os.cpu_count() or 1)
    top = " · ".join(f"{g.name} {g.share_pct:.0f}%" for g in profile.groups)
    return Verdict(bottleneck, f"{head}: {_evidence(cfg, e)} — {hint}{_bookkeeping(cfg, e)}", confidence, top)


def decided_by(kind: str, e: Evidence) -> str:
    """Which measurement decided the class."""
    if kind.startswith("input") or (kind == "overhead" and e.overhead_pct >= OVERHEAD_BOUND_PCT):
        return "the step-time split"
    if kind == "overhead":
        return "MFU with the device mostly idle" + (" in the profile" if e.gpu_util_pct is None else "")
    return "the step-time split and MFU" if e.mfu is not None else "the step-time split"


def _evidence(cfg: RunConfig, e: Evidence) -> str:
    words = f"{e.data_wait_pct:.0f}% of step time {data_wait_words(cfg.loader.resident)}, {e.h2d_pct:.0f}% copying it"
    if e.gpu_util_pct is not None:
        words += f", GPU busy {e.gpu_util_pct:.0f}% on average"
    if e.overhead_pct >= OVERHEAD_PCT:
        words += f", {e.overhead_pct:.0f}% the pipeline's own work between steps"
    if e.mfu is not None:
        words += f", {e.mfu.words()}"
    if e.groups:
        words += "; " + ", ".join(g.words() for g in e.groups) + f" ({e.profiled})"
    elif e.profiled:
        words += f"; {e.profiled}"
    return words


def _bookkeeping(cfg: RunConfig, e: Evidence) -> str:
    if e.overhead_pct < OVERHEAD_PCT:
        return ""
    every, log_every = cfg.checkpoint.every_n_steps, cfg.trainer.log_every_n_steps
    return f"; to cut the pipeline's own work, raise trainer.log_every_n_steps (now {log_every})" + (
        f" or checkpoint.every_n_steps (now {every})" if every else ""
    )


def _hint(kind: str, cfg: RunConfig, e: Evidence, run: RunFacts, *, cpus: int) -> str:
    """The class's hint: the loader's (an input-bound run) and the operator groups' (they name the step's waste)
    first, then the device's (a CPU's whatever the class: it does the loading and the arithmetic)."""
    device_type, precision = run.device_type, run.precision
    ops = "; ".join(g.hint for g in e.groups if g.hint and g.name != "outside operators")
    first = input_hint(cfg, device_type=device_type, h2d_pct=e.h2d_pct, cpus=cpus) if kind.startswith("input") else ""
    ops = "; ".join(filter(None, [first, ops]))
    if kind.startswith("input") and device_type != "cpu":  # a GPU waiting for its data: the data first and only
        return ops
    if device_type == "cpu":
        device = cpu_hint(cfg, precision=precision, amp_check=run.amp_check, mfu=e.mfu, cpus=cpus, overhead=kind)
    else:
        device = compute_hint(
            cfg, device_type=device_type, precision=precision, convolutional=run.convolutional, mfu=e.mfu
        )
    return f"{ops}; then {device}" if ops else device


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


def compute_hint(
    cfg: RunConfig,
    *,
    device_type: str,
    precision: str,
    convolutional: bool = True,
    mfu: Mfu | None = None,
) -> str:
    """What to try when a GPU computes most of the time; ``convolutional``: the model has 2-D convolutions
    (only then is ``channels_last`` worth a try); ``mfu``: how much of its peak the device reached."""
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


def cpu_hint(
    cfg: RunConfig, *, precision: str, amp_check: AmpProbe | None, mfu: Mfu | None, cpus: int, overhead: str
) -> str:
    """What raises MFU on this CPU, in the order to try it; a GPU after them, as a fact about this machine."""
    if mfu is not None and mfu.pct >= HIGH_MFU_PCT:
        steps = ["on this CPU the model's own arithmetic is the limit"]
    else:
        steps = [f"try loader.batch_size={cfg.loader.batch_size * 2} (more work for each operator)"]
        threads = torch.get_num_threads()
        if threads < cpus:
            steps.append(f"torch computes on {threads} of the {cpus} CPUs' threads: OMP_NUM_THREADS={cpus}")
        if not cfg.trainer.compile:
            steps.append("trainer.compile=true" + (" (fuses the small operators)" if overhead == "overhead" else ""))
    if precision != "fp32":
        steps.append(cpu_amp_hint(amp_check))
    elif amp_check is not None and amp_check.verdict == "faster":
        steps.append(f"amp=true ({amp_check.speed:.2f}x float32 measured at start)")
    elif has_amx():
        steps.append("this CPU has AMX (amx_bf16): try amp=true, whose start-up check measures what it gains")
    gpu = (
        "this machine has a CUDA GPU that torch can use: device=cuda"
        if torch.cuda.is_available()
        else "this machine has no GPU that torch can use: a GPU machine computes this arithmetic many times faster"
    )
    return "; ".join([*steps, gpu])


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
