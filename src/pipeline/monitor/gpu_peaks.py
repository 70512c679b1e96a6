"""TEMPORARY stand-in until the table lands from branch i27-peaks (never merged as is)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class GpuPeak:
    card: str
    tflops: Mapping[str, float]
    source: str
    note: str = ""


TABLE: tuple[GpuPeak, ...] = (GpuPeak("H100 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4}, "stand-in"),)


def gpu_peak(device_name: str) -> GpuPeak | None:
    return TABLE[0] if device_name == "NVIDIA H100 80GB HBM3" else None


def unknown_reason(device_name: str) -> str:
    return f"no MFU: {device_name!r} is not in pipeline's table of GPU peaks"
