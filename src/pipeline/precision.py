"""Numeric precision: the autocast dtype, the GradScaler, and the CUDA backend switches.

``amp=true`` runs forward and loss under ``torch.autocast``. ``precision.dtype=auto`` picks
bfloat16 where the device computes it natively (CPUs, Ampere and newer GPUs) and float16
elsewhere; float16 needs a GradScaler so small gradients do not underflow to zero.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pipeline.config import PrecisionConfig, TrainerConfig

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


def configure_backends(precision: PrecisionConfig, trainer: TrainerConfig, device: torch.device) -> dict[str, str]:
    """Set the process-wide CUDA switches for this run; returns them for the record.

    They are left alone on other devices, where they mean nothing.
    """
    if device.type != "cuda":
        return {"tf32": "n/a", "cudnn_benchmark": "n/a"}
    torch.backends.cuda.matmul.allow_tf32 = precision.tf32
    torch.backends.cudnn.allow_tf32 = precision.tf32
    torch.backends.cudnn.benchmark = trainer.cudnn_benchmark
    return {"tf32": str(precision.tf32).lower(), "cudnn_benchmark": str(trainer.cudnn_benchmark).lower()}
