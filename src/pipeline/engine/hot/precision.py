"""Numeric precision: the autocast dtype and the GradScaler (``pipeline.engine.building.precision_setup`` chooses them
from the config, with the CUDA backend switches).

``amp=true`` runs forward and loss under ``torch.autocast``. ``precision.dtype=auto`` picks
bfloat16 where the device computes it natively (CPUs, Ampere and newer GPUs) and float16
elsewhere; float16 needs a GradScaler so small gradients do not underflow to zero.

On a CPU, autocast only pays off where the hardware computes the narrow format (AMX); elsewhere
bfloat16 convolutions can run ten times slower than float32: ``pipeline.engine.building.amp_check`` measures it
for the run's own model before training.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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


def bf16_native(device: torch.device) -> bool:
    """Whether autocast to bfloat16 is supported natively (Ampere+ on CUDA; always on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"
