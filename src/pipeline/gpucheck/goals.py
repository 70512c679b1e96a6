"""The GPU check's plan and its rows: the sizes of a full run on the GPU and of a dry run on the CPU (``Plan``), the
goal each row is judged against (``GOALS``: speed goals on the GPU sizes only), one ``Row`` per measurement, and
``guarded``, which turns a measurement that fails into an ERROR row so that the others still run.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common.messages import brief


@dataclass(frozen=True)
class Goal:
    """A row's target from the issue. ``functional`` goals (it survives, nothing fails) are judged in a dry run
    too; speed goals only on the GPU, where the sizes are the real ones."""

    op: str  # ">=", "<=" or "=="
    target: float
    text: str  # as the table shows it
    functional: bool = False

    def met(self, value: float) -> bool:
        if self.op == ">=":
            return value >= self.target
        if self.op == "<=":
            return value <= self.target
        return value == self.target


@dataclass
class Row:
    key: str  # stable, for reading the JSON
    name: str
    value: float | None
    unit: str
    goal: str = ""
    status: str = "INFO"  # PASS | FAIL | INFO | SKIP | ERROR
    detail: str = ""
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The sizes: the issue's on the GPU, tiny ones for ``--dry-run`` on the CPU."""

    dry: bool
    device: str
    image_px: int  # ResNet-50's square input
    batch: int  # ResNet-50's batch
    steps_per_epoch: int  # of ResNet-50 runs; the dataset is this many batches
    epochs: int
    mlp_samples: int  # MNIST-shaped: 60,000 training images as MNIST has
    mlp_val: int
    overhead_samples: int  # pipeline / bare loop: MLP epochs of this many samples
    overhead_repeats: int
    busy_s: float  # the bare ResNet-50 loop's length (NVML and GPUtil sample during it)
    budget_s: float  # steps that would start past this are skipped

    def judge(self, value: float | None, goal: Goal | None) -> str:
        if value is None or goal is None or (self.dry and not goal.functional):
            return "INFO"
        return "PASS" if goal.met(value) else "FAIL"


GPU_PLAN = Plan(False, "cuda", 224, 256, 12, 2, 60_000, 10_000, 60_000, 5, 8.0, 480.0)


DRY_PLAN = Plan(True, "cpu", 32, 4, 3, 2, 512, 128, 2_000, 1, 0.5, 300.0)


GOALS = {
    "mlp": Goal("<=", 0.5, "<= 0.5 s"),
    "resnet50_bf16_channels_last": Goal(">=", 3000, ">= 3000 img/s"),
    "resnet50_bf16_channels_last_compile": Goal(">=", 4500, ">= 4500 img/s"),
    "input_vs_synthetic": Goal(">=", 0.9, ">= 0.9"),
    "input_gpu_util": Goal(">=", 90, ">= 90%"),
    "doctor": Goal("==", 0, "0 FAIL", functional=True),
    "oom_fallback": Goal(">=", 1, "survives", functional=True),
    "mfu": Goal(">=", 0.01, "> 0: the card is in the table", functional=True),
    "profile_trace": Goal("==", 1, "trace + busy % recorded", functional=True),
    "memory_snapshot": Goal("==", 1, "kept, run recovered", functional=True),
    "pipeline_vs_bare": Goal(">=", 0.98, ">= 0.98"),
}


DRY_GPU = "dry run: no GPU is read"


COMMON = ["tracking=none", "checkpoint.enabled=false", "monitor.plots=false", "trainer.progress=false"]


BF16 = ["amp=true", "precision=bf16"]
BF16_CL = [*BF16, "trainer.channels_last=true"]
AUGMENT = ["data.augment=crop_flip"]  # the input row's augmentation; applied when this checkout has data.augment


@dataclass
class Context:
    """What one step leaves for a later one."""

    plan: Plan
    compile_mode: str
    work: Path
    started: float = field(default_factory=time.perf_counter)
    images_per_s: dict[str, float] = field(default_factory=dict)  # row key -> img/s
    peak_mb: dict[str, float] = field(default_factory=dict)  # row key -> the allocator's peak during that run
    busy: dict[str, Any] = field(default_factory=dict)  # the bare loop's readings per GPU backend
    mfu: dict[str, tuple[float | None, str]] = field(default_factory=dict)  # row key -> MFU %, its peak or why none

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def guarded(key: str, name: str, unit: str, make: Callable[[], Row]) -> Row:
    """``make()``, or an ERROR row saying what went wrong: one failing measurement never stops the others."""
    try:
        return make()
    except Exception as err:
        return Row(
            key,
            name,
            None,
            unit,
            goal=GOALS[key].text if key in GOALS else "",
            status="ERROR",
            detail=brief(err, first_line=True),
            raw={"error": brief(err, limit=len(str(err))), "traceback": traceback.format_exc(limit=8)},
        )
    finally:
        from pipeline.gpucheck.harness import release  # lazy: torch (~1.4 s), checked for first

        release()
