"""Numeric precision: the autocast dtype, the GradScaler, and the CUDA backend switches.

``amp=true`` runs forward and loss under ``torch.autocast``. ``precision.dtype=auto`` picks
bfloat16 where the device computes it natively (CPUs, Ampere and newer GPUs) and float16
elsewhere; float16 needs a GradScaler so small gradients do not underflow to zero.

On a CPU, autocast only pays off where the hardware computes the narrow format (AMX); elsewhere
bfloat16 convolutions can run ten times slower than float32: ``pipeline.engine.amp_check`` measures it
for the run's own model before training.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from pipeline.common.errors import ConfigError
from pipeline.config import PrecisionConfig, TrainerConfig, cuda_only_expected

log = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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
