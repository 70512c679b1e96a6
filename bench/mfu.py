"""MFU as the pipeline reports it, for two models on this machine (``python -m bench --only mfu``).

The set-up recipe's MLP (784-512-10 at batch 64) moves a lot of data for little arithmetic: each weight is read
for 64 multiply-adds a step. A wider MLP at a larger batch (784-2048-2048-10 at batch 256) does more arithmetic per
byte, so the same device should spend more of its time at its peak. Both run the pipeline itself (one epoch on
resident synthetic data, interleaved round by round), and the row reads the ``perf/mfu_pct`` each run computes
against the device's peak (a CPU's measured matmul peak, ``pipeline.monitor.peaks``): the claim is that the wider
model's MFU is higher, as the median of the per-round ratios.
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median

from pipeline.common.stats import paired_ratio
from pipeline.gpucheck.harness import Row, Sizes, interleaved, pipeline_run

NARROW = ["model=mlp", "model.hidden_sizes=[512]", "loader.batch_size=64"]
WIDE = ["model=mlp", "model.hidden_sizes=[2048,2048]", "loader.batch_size=256"]


def bench_mfu(sizes: Sizes, work: Path) -> list[Row]:
    """The wider MLP's MFU against the recipe's, each run's own ``perf/mfu_pct``, interleaved."""
    samples = max(sizes.samples // 6, 2_000)  # the wide MLP needs 14x the arithmetic a sample
    data = ["data=synthetic", f"data.num_samples={samples}", "data.val_samples=256", "loader=resident"]
    mfu: dict[str, list[float]] = {"recipe": [], "wide": []}
    peak: list[str] = []

    def run(name: str, model: list[str]) -> float:
        start = time.perf_counter()
        result = pipeline_run([*data, *model, "tracking.enabled=false"], work / "mfu.db")
        value = result.flops.mfu_pct(result.epochs[-1].samples_per_s)
        if value is None:
            raise RuntimeError(f"no MFU for the {name} MLP: {result.flops.why_none()}")
        mfu[name].append(value)
        peak[:] = [result.flops.peak.what + f", {result.flops.peak.tflops:.3g} TFLOP/s"]
        return time.perf_counter() - start

    interleaved({"recipe": lambda: run("recipe", NARROW), "wide": lambda: run("wide", WIDE)}, sizes)
    kept = {name: values[-sizes.repeats :] for name, values in mfu.items()}  # the warm-up round's dropped
    ratio = paired_ratio(kept["wide"], kept["recipe"])  # the wide MLP's MFU as a multiple of the recipe's
    return [
        Row(
            "MFU, 784-2048-2048-10 at batch 256 / the recipe's 784-512-10 at batch 64",
            f"{ratio:.2f}x",
            "> 1",
            ratio > 1,
            f"median MFU {median(kept['wide']):.0f}% against {median(kept['recipe']):.0f}% "
            f"({len(kept['wide'])} interleaved rounds; {samples:,} samples an epoch); against {peak[0]}",
        )
    ]
