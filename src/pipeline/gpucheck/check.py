"""Check the pipeline's speed goals on an NVIDIA GPU: one table, a verdict per goal, the raw numbers as JSON.

    sh scripts/gpu_check.sh                           # a fresh GPU machine, from a checkout: about 6 minutes
    python -m pipeline.gpu_check                      # the same where the pipeline is installed
    python -m pipeline.gpu_check --out results.json   # where the raw numbers go (default gpu_check.json)
    python -m pipeline.gpu_check --only resnet,oom    # some steps (see STEPS below; compile runs last)
    python -m pipeline.gpu_check --dry-run            # the same plan at tiny sizes on the CPU, in well under a minute

``scripts/gpu_check.sh`` runs it from a checkout, installed or not (``src/`` first on the path), with whichever
Python has torch. It needs torch and torchvision (any CUDA build) and, from the pipeline's own dependencies, only
hydra-core, omegaconf, psutil, pyyaml, tqdm and numpy; whatever is missing is named with the ``pip install`` that
adds it. nvidia-ml-py and GPUtil are optional (their rows are skipped without them). MLflow is needed only by the
``profile`` step, whose two runs record into a store in the check's temporary folder to read their artifacts back
(its rows are skipped without it); every other run is ``tracking=none``. No run writes a checkpoint, and all train
on synthetic data made in memory, so nothing is downloaded and nothing is left behind but the JSON file.

The runs are ``pipeline.train.train`` in this process, with configs from ``pipeline.config.load`` and
``trainer.max_steps`` bounding their length; images/s is each run's steady state (``RunResult.breakdown``: every
epoch's first step, with its warm-up and compilation, left out). The comparisons against a bare loop reuse the
harness (``pipeline.gpucheck.harness``, which the project's benchmarks use too). Every row is guarded: one that fails
is an ERROR row and the rest still run. The exit status is 0 when every goal is met, 1 when a goal is missed or a
row failed, 2 when the check cannot start (a missing package, no GPU without ``--dry-run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import json
import math
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pipeline
from pipeline.common.cli import Parser, command
from pipeline.common.markdown import markdown_table
from pipeline.gpucheck.goals import (
    DRY_PLAN,
    GPU_PLAN,
    Context,
    Row,
)
from pipeline.gpucheck.overheads import augment_available, step_input, step_overhead, step_sampler
from pipeline.gpucheck.profiling import step_profile
from pipeline.gpucheck.training import (
    step_doctor,
    step_mlp,
    step_oom,
    step_resnet,
)

# module -> what to pip install. The pipeline's other dependencies are not imported by these runs.
REQUIRED = {
    "torch": "torch",
    "torchvision": "torchvision",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "psutil": "psutil",
    "yaml": "pyyaml",
    "tqdm": "tqdm",
    "numpy": "numpy",
}
OPTIONAL = {"pynvml": "nvidia-ml-py", "GPUtil": "GPUtil"}  # without them the NVML / GPUtil rows are skipped
OPTIONAL_ROWS = {"nvidia-ml-py": "NVML", "GPUtil": "GPUtil", "setuptools": "GPUtil's distutils on Python 3.12+"}
# step -> what it measures and about how many seconds it takes on a recent GPU; they run in this order (compiling,
# the longest and least predictable, last) and their rows are shown in ROW_ORDER's
STEPS = {
    "doctor": ("the doctor's checks", 5),
    "mlp": ("the MLP's epoch on resident MNIST-shaped data", 15),
    "resnet": ("ResNet-50 in fp32, TF32, AMP bf16, AMP fp16 and + channels_last", 60),
    "input": ("uint8 images augmented on the device against a ready batch", 40),
    "oom": ("a batch too large for the card", 40),
    "profile": ("torch.profiler on ResNet-50 steps; the allocator's snapshot at an out-of-memory error", 40),
    "sampler": ("NVML against GPUtil", 15),
    "overhead": ("the pipeline against a bare loop", 60),
    "compile": ("ResNet-50 AMP bf16 + channels_last + torch.compile (compiling takes minutes)", 150),
}


def missing_dependencies() -> tuple[list[str], list[str]]:
    """The pip names of the required and of the optional packages that cannot be imported here.

    GPUtil 1.4 imports ``distutils``, gone from Python 3.12's standard library: there setuptools provides it.
    """
    required = [pip for module, pip in REQUIRED.items() if importlib.util.find_spec(module) is None]
    optional = [pip for module, pip in OPTIONAL.items() if importlib.util.find_spec(module) is None]
    if "GPUtil" not in optional and sys.version_info >= (3, 12) and importlib.util.find_spec("distutils") is None:
        optional.append("setuptools")
    return required, optional


def dependency_message(required: list[str], optional: list[str], *, mlflow: bool = True) -> str:
    """What to install, as commands to copy: a line for what the check cannot run without, one for what only
    some rows need, and (``mlflow=False``) a word that MLflow, missing, costs only the profile step's rows."""
    lines = []
    if required:
        torch_note = (
            " (torch and torchvision: the build for this machine's CUDA, see https://pytorch.org/get-started/locally/)"
            if {"torch", "torchvision"} & set(required)
            else ""
        )
        lines.append(f"error: the GPU check needs {', '.join(required)}: pip install {' '.join(required)}{torch_note}")
    if optional:
        rows = ", ".join(f"{pip} ({OPTIONAL_ROWS[pip]})" for pip in optional)
        lines.append(f"note: rows skipped for want of {rows}: pip install {' '.join(optional)}")
    if not mlflow:
        lines.append(
            "note: mlflow is not installed: the profile rows, which read a run's artifacts back, are skipped; the "
            "other runs record nothing (tracking=none)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Rows, goals and the plan


# ---------------------------------------------------------------------------------------------
# The steps


RUNNERS: dict[str, Callable[[Context], list[Row]]] = {
    "doctor": step_doctor,
    "mlp": step_mlp,
    "resnet": step_resnet,
    "input": step_input,
    "oom": step_oom,
    "profile": step_profile,
    "sampler": step_sampler,
    "overhead": step_overhead,
    "compile": lambda ctx: step_resnet(ctx, compiled=True),
}
ROW_ORDER = [  # the table's order: the issue's
    "doctor",
    "mlp",
    "resnet50_fp32",
    "resnet50_tf32",
    "resnet50_bf16",
    "resnet50_fp16",
    "resnet50_bf16_channels_last",
    "mfu",
    "resnet50_bf16_channels_last_compile",
    "input_vs_synthetic",
    "input_gpu_util",
    "oom_fallback",
    "profile_trace",
    "memory_snapshot",
    "nvml_read_cost",
    "gputil_read_cost",
    "nvml_busy_util",
    "gputil_busy_util",
    "pipeline_vs_bare",
]


def in_table_order(rows: list[Row]) -> list[Row]:
    """Rows in ``ROW_ORDER``; a step skipped whole (its key is the step's) where its first row would be."""
    first_row = {"resnet": "resnet50_fp32", "input": "input_vs_synthetic", "oom": "oom_fallback"}
    first_row["profile"] = "profile_trace"
    first_row.update(
        sampler="nvml_read_cost", overhead="pipeline_vs_bare", compile="resnet50_bf16_channels_last_compile"
    )
    place = {key: i for i, key in enumerate(ROW_ORDER)}
    return sorted(rows, key=lambda r: place.get(r.key, place.get(first_row.get(r.key, ""), len(place))))


# ---------------------------------------------------------------------------------------------
# Output


def number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


def table(rows: list[Row]) -> str:
    body = [[r.name, number(r.value), r.unit, str(r.goal or "—"), r.status, r.detail] for r in rows]
    return "\n".join(markdown_table(["check", "value", "unit", "goal", "result", "detail"], body))


def plain(value: Any) -> Any:
    """JSON without NaN or infinities (which json.dumps writes, and most readers refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


@command("python -m pipeline.gpu_check")
def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    required, optional = missing_dependencies()
    message = dependency_message(required, optional, mlflow=importlib.util.find_spec("mlflow") is not None)
    if message:
        print(message, file=sys.stderr)
    if required:
        return 2
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if args.budget_s is not None:
        plan = dataclasses.replace(plan, budget_s=args.budget_s)
    if not plan.dry and not _cuda_or_say_why():
        return 2
    from pipeline.gpucheck.harness import machine_facts, quiet_logs  # lazy: torch (~1.4 s), checked for first

    started = datetime.datetime.now(datetime.timezone.utc)
    facts = machine_facts()
    _print_heading(plan, facts, started)
    logs = contextlib.nullcontext() if args.verbose else quiet_logs()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, logs:
        ctx = Context(plan, args.compile_mode, Path(tmp))
        rows = _run_steps(ctx, names)
        seconds = ctx.elapsed()
    rows = in_table_order(rows)
    print(table(rows))
    counts = Counter(r.status for r in rows)
    print(f"\n{', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}; {seconds:.0f} s")
    command = " ".join(["python -m pipeline.gpu_check", *(argv if argv is not None else sys.argv[1:])])
    document = _document(command, plan, facts, started, seconds, optional, rows)
    Path(args.out).write_text(json.dumps(plain(document), indent=2) + "\n")
    print(f"raw numbers: {args.out}")
    return 1 if counts["FAIL"] or counts["ERROR"] else 0


def _parse(argv: list[str] | None) -> Any:
    parser = Parser(prog="python -m pipeline.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same plan at tiny sizes on the CPU (no GPU needed)")
    parser.add_argument("--out", default="gpu_check.json", help="where to write the raw numbers (JSON)")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of: {', '.join(STEPS)}")
    parser.add_argument("--compile-mode", default="default", help="trainer.compile_mode of the compile row")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="skip a step expected to end past this many seconds (default 480)"
    )
    parser.add_argument("--verbose", action="store_true", help="show the runs' log messages (warnings included)")
    args = parser.parse_args(argv)
    unknown = [n.strip() for n in args.only.split(",") if n.strip() and n.strip() not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)}")
    return args


def _cuda_or_say_why() -> bool:
    """Whether a CUDA GPU is usable; if not, why, on stderr (the doctor's finding)."""
    import torch

    if torch.cuda.is_available():
        return True
    from pipeline.machine import doctor  # lazy: torch (~1.4 s), checked for first

    finding = doctor.main_finding()
    print(
        "error: no usable CUDA GPU here"
        + (f" ({finding})" if finding else " (python -m pipeline.doctor says why)")
        + "; --dry-run checks the plan on the CPU",
        file=sys.stderr,
    )
    return False


def _print_heading(plan: Any, facts: dict[str, Any], started: datetime.datetime) -> None:
    gpu = f"{facts['gpu']} ({facts.get('gpu_memory_gb')} GB)" if facts["gpu"] else "no GPU"
    mode = "dry run: tiny sizes on the CPU; speed goals are shown, not judged" if plan.dry else "full sizes"
    print(
        f"# GPU check ({mode})\n\n{started:%Y-%m-%d %H:%M} UTC · {gpu} · {facts['cpu']}, {facts['cpus']} CPUs · "
        f"Python {facts['python']}, torch {facts['torch']} (CUDA {facts['torch_cuda']})\n",
        flush=True,
    )


def _run_steps(ctx: Context, names: list[str]) -> list[Row]:
    """The chosen steps' rows, in the plan's order; a step expected to end past the budget is a SKIP row."""
    rows: list[Row] = []
    for step in [s for s in STEPS if s in names]:
        what, estimate_s = STEPS[step]
        if not ctx.plan.dry and ctx.elapsed() + estimate_s > ctx.plan.budget_s:
            reason = f"time budget: {ctx.elapsed():.0f} s gone, about {estimate_s} s more needed (--budget-s)"
            rows.append(Row(step, f"{step}: {what}", None, "", "", "SKIP", reason))
            continue
        began = time.perf_counter()
        print(f"[gpu_check] {step}: {what} ...", file=sys.stderr, flush=True)
        rows += RUNNERS[step](ctx)
        print(f"[gpu_check] {step}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    return rows


def _document(
    command: str,
    plan: Any,
    facts: dict[str, Any],
    started: datetime.datetime,
    seconds: float,
    optional: list[str],
    rows: list[Row],
) -> dict[str, Any]:
    """The raw numbers' JSON document (schema 1): its ``summary`` counts the rows by result."""
    return {
        "schema": 1,
        "command": command,
        "dry_run": plan.dry,
        "started": started.isoformat(timespec="seconds"),
        "seconds": seconds,
        "machine": facts,
        "pipeline": str(Path(pipeline.__file__).resolve().parent),
        "missing_optional": optional,
        "augment": augment_available(),
        "plan": asdict(plan),
        "summary": dict(Counter(r.status for r in rows)),
        "rows": [asdict(r) for r in rows],
    }


if __name__ == "__main__":
    sys.exit(main())
