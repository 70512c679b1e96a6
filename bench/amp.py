"""amp against float32, measured side by side (``python -m bench --only amp``): ResNet-50 steps under
autocast against float32 steps in interleaved pairs, and the MLP run end to end with ``amp=true`` against
``amp=false``. On a CPU the answer depends on the hardware (AMX or not): the rows say what this machine does.
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

from pipeline.common.stats import paired_ratio
from pipeline.engine.building.amp_check import probe_cpu_amp
from pipeline.engine.models import resnet
from pipeline.gpucheck.harness import (
    QUICK,
    Row,
    Sizes,
    interleaved,
    pipeline_epoch,
)


def bench_amp(sizes: Sizes, work: Path) -> list[Row]:
    """amp=true against float32 on this machine's training device (bfloat16 on CPUs), for the MLP's epochs
    and for ResNet-50's convolutions, with what the run's own start-up check estimates beside it."""
    return [*bench_amp_mlp(sizes, work), *bench_amp_resnet(sizes)]


def bench_amp_resnet(sizes: Sizes) -> list[Row]:
    """One ResNet-50 training step (small stem, 28 px, batch 16) in float32 and under autocast, interleaved,
    against the run's start-up check (``amp_check.probe_cpu_amp``) at its own batch."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        return []
    torch.manual_seed(0)
    model = resnet("resnet50", (1, 28, 28), 10, stem="small").train()
    batch = 4 if sizes is QUICK else 16
    images, labels = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))

    def step(dtype: torch.dtype | None) -> float:
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        return time.perf_counter() - start

    step_s = interleaved({"fp32": lambda: step(None), "bf16": lambda: step(torch.bfloat16)}, sizes)
    speed = paired_ratio(step_s["fp32"], step_s["bf16"])
    probe = probe_cpu_amp(model, (images, labels), dtype=torch.bfloat16)
    return [
        Row(
            f"bf16 autocast / float32 speed, ResNet-50 step, batch {batch}, cpu",
            f"{speed:.2f}",
            "(info)",
            None,
            f"median step {median(step_s['bf16']):.2f} s with amp, {median(step_s['fp32']):.2f} s without; the run's "
            f"start-up check: {probe.describe()}",
        )
    ]


def bench_amp_mlp(sizes: Sizes, work: Path) -> list[Row]:
    """amp=true against float32 for the MLP's epochs on this machine's training device."""
    data = ["data=synthetic", f"data.num_samples={sizes.samples}", "data.val_samples=500", "loader=resident"]
    variants = {
        "fp32": lambda: pipeline_epoch(data, work / "amp.db"),
        "amp": lambda: pipeline_epoch([*data, "amp=true"], work / "amp.db"),
    }
    epoch_s = interleaved(variants, sizes)
    speed = paired_ratio(epoch_s["fp32"], epoch_s["amp"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [
        Row(
            f"amp=true / float32 speed, MLP, batch 64, {device}",
            f"{speed:.2f}",
            "(info)",
            None,
            f"median epoch {median(epoch_s['amp']):.2f} s with amp, {median(epoch_s['fp32']):.2f} s without; below 1 "
            "= amp is slower here",
        )
    ]
