"""Which changes ``python -m pipeline.tune`` tries, from what the probe measured: the plan of candidates.

The probe's step split is classified by the verdict's rules (``pipeline.report.verdict.classify``). What each class
implies:

- input share >= ``INPUT_MODERATE_PCT`` (5%): the loader candidates of ``python -m pipeline.autotune`` (workers,
  pinned memory on CUDA, ``loader.resident``, prefetch);
- any class but *highly* input-bound: the changes that make the step itself faster, each alone: ``amp=true`` (the
  autocast dtype probed on this device first: bf16 on a CPU, bf16 or else fp16 on CUDA),
  ``trainer.channels_last=true`` when the model's input is 4-D and it has 2-D convolutions,
  ``trainer.compile=true``, and, when the run micro-batches (``oom.micro_batch_size`` under ``loader.batch_size``),
  larger micro-batches up to the whole batch: the effective batch, and so the optimisation, stay the same.

A change the run has already is not a candidate; one the device cannot use is listed with the reason
(``Plan.skipped``) and never timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.autotune.candidates import Candidate, Machine, candidates
from pipeline.common.messages import brief
from pipeline.config import RunConfig
from pipeline.report.verdict import INPUT_MODERATE_PCT


@dataclass(frozen=True)
class Probe:
    """The user's configuration as measured first: what decides the plan."""

    samples_per_s: float
    data_wait_pct: float
    h2d_pct: float
    compute_pct: float
    overhead_pct: float
    mfu_pct: float | None  # None: the model's FLOPs or the device's peak are unknown
    bottleneck: str  # ``classify``'s: input-high | input-moderate | overhead | compute

    @property
    def input_pct(self) -> float:
        return self.data_wait_pct + self.h2d_pct


@dataclass(frozen=True)
class Plan:
    candidates: list[Candidate]  # the user's configuration first
    skipped: list[tuple[Candidate, str]] = field(default_factory=list)  # never timed, with the reason


def plan(
    cfg: RunConfig,
    probe: Probe,
    machine: Machine,
    *,
    device: torch.device,
    input_dims: int | None,
    convolutional: bool = True,
) -> Plan:
    """The candidates the probe's class implies (module docstring), the user's configuration first.

    Args:
        cfg: the user's configuration.
        probe: what it measured.
        machine: what the loader candidates depend on.
        device: where it trains (the autocast dtype is probed there).
        input_dims: the dimensions of the model's input tensor (with the batch), None when it takes no tensor.
        convolutional: the model has 2-D convolutions (only then is channels_last a candidate).
    """
    current = Candidate(cfg.loader)  # as ``Trials.probe`` built it
    found, skipped = [current], []
    if probe.input_pct >= INPUT_MODERATE_PCT:
        found += [c for c in candidates(cfg.loader, machine) if c.loader != cfg.loader]
    if probe.bottleneck != "input-high":
        step, skipped = step_changes(cfg, device=device, input_dims=input_dims, convolutional=convolutional)
        found += step
    return Plan(found, skipped)


def step_changes(
    cfg: RunConfig, *, device: torch.device, input_dims: int | None, convolutional: bool = True
) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """amp, channels_last, compile and the micro-batches this run can try; and those it cannot, with why."""
    found, skipped = [], []
    if not cfg.amp:
        amp = _change(cfg, "amp", ("amp", True))
        why = autocast_unusable(device)
        if why:
            skipped.append((amp, why))
        else:
            found.append(amp)
    if not cfg.trainer.channels_last and input_dims == 4 and convolutional:
        found.append(_change(cfg, "channels_last", ("trainer.channels_last", True)))
    found += micro_batches(cfg)
    if not cfg.trainer.compile:  # last: its build (the first step compiles) is the dearest
        found.append(_change(cfg, "compile", ("trainer.compile", True)))
    return found, skipped


def micro_batches(cfg: RunConfig) -> list[Candidate]:
    """Doubled micro-batches from the run's own up to ``loader.batch_size``, when the run micro-batches: none
    otherwise (a larger *batch* would change the optimisation, which this tool never does)."""
    micro, batch = cfg.oom.micro_batch_size, cfg.loader.batch_size
    if micro is None or micro >= batch:
        return []
    sizes, size = [], micro * 2
    while size < batch:
        sizes.append(size)
        size *= 2
    sizes.append(batch)
    return [_change(cfg, f"micro-batch={size}", ("oom.micro_batch_size", size)) for size in sizes]


def autocast_dtype(device: torch.device) -> torch.dtype:
    """The dtype ``amp=true`` autocasts to here (``precision.dtype=auto``): bf16 on a CPU; on CUDA bf16 where the
    card supports it, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16


def autocast_unusable(device: torch.device) -> str:
    """Why ``amp=true`` cannot be tried on ``device`` ("" when it can): a small linear layer's forward and backward
    under autocast, in the dtype amp would use, must run and give finite gradients (some CPUs' torch builds refuse
    bf16 autocast, MPS lacks it on older torch)."""
    dtype = autocast_dtype(device)
    name = str(dtype).removeprefix("torch.")
    try:
        layer = torch.nn.Linear(8, 8).to(device)
        with torch.autocast(device.type, dtype=dtype):
            out = layer(torch.randn(4, 8, device=device))
        out.float().sum().backward()
    except (RuntimeError, TypeError, ValueError) as err:
        return f"{name} autocast does not run on {device.type} here ({brief(err)})"
    if out.dtype != dtype:
        return f"autocast on {device.type} computed in {str(out.dtype).removeprefix('torch.')}, not {name}"
    if not bool(torch.isfinite(layer.weight.grad).all()):
        return f"{name} autocast gave non-finite gradients on {device.type}"
    return ""


def _change(cfg: RunConfig, name: str, change: tuple[str, Any]) -> Candidate:
    return Candidate(cfg.loader, changes=(change,), name=name)


def input_dims(example: Any) -> int | None:
    """The dimensions of the model's first tensor input in ``Setup.example`` (``(args, kwargs)``), or None."""
    args, kwargs = example
    first = next((v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)), None)
    return None if first is None else first.dim()
