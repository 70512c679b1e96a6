"""The run's precision chosen from the config (``amp``, ``precision.dtype``) for its device, and the trainer's device
switches checked against that device and set (TF32, cuDNN's autotuner). Building the run calls these; the hot path
uses what they return (``pipeline.engine.hot.precision.PrecisionPolicy``) and never reads the config."""

from __future__ import annotations

import logging

import torch

from pipeline.common.errors import ConfigError
from pipeline.config import PrecisionConfig, TrainerConfig, cuda_only_expected
from pipeline.engine.hot.precision import DTYPES, PrecisionPolicy, bf16_native

log = logging.getLogger("pipeline.engine.precision")  # the name its warning has always carried


def resolve_precision(cfg: PrecisionConfig, *, amp: bool, device: torch.device) -> PrecisionPolicy:
    """The policy for ``amp`` and ``precision.dtype`` on ``device`` (config already validated)."""
    if not amp:
        return PrecisionPolicy(device.type, None)
    if cfg.dtype != "auto":
        return PrecisionPolicy(device.type, DTYPES[cfg.dtype])
    return PrecisionPolicy(device.type, torch.bfloat16 if bf16_native(device) else torch.float16)


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
