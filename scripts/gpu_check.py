#!/usr/bin/env python3
"""Check the pipeline's speed goals on an NVIDIA GPU: one table, a verdict per goal, the raw numbers as JSON.

    python scripts/gpu_check.py                       # any machine with an NVIDIA GPU: about 6 minutes, no network
    python scripts/gpu_check.py --out results.json    # where the raw numbers go (default gpu_check.json)
    python scripts/gpu_check.py --only resnet,oom     # some steps (see STEPS below; compile runs last)
    python scripts/gpu_check.py --dry-run             # the same plan at tiny sizes on the CPU, in well under a minute

It runs from a checkout, installed or not: ``pipeline`` is imported from the ``src/`` folder beside this script.
It needs torch and torchvision (any CUDA build) and, from the pipeline's own dependencies, only hydra-core,
omegaconf, psutil, pyyaml, tqdm and numpy; whatever is missing is named with the ``pip install`` that adds it.
nvidia-ml-py and GPUtil are optional (their rows are skipped without them). MLflow is not needed: every run is
``tracking=none``, writes no checkpoint, and trains on synthetic data made in memory, so nothing is downloaded
and nothing is left behind but the JSON file.

The runs are ``pipeline.train.train`` in this process, with configs from ``pipeline.config.load`` and
``trainer.max_steps`` bounding their length; images/s is each run's steady state (``RunResult.breakdown``:
every epoch's first step, with its warm-up and compilation, left out). The comparisons against a bare loop
reuse ``pipeline.diagnostics.bench``'s helpers. Every row is guarded: one that fails is an ERROR row and the rest
still run.
The exit status is 0 when every goal is met, 1 when a goal is missed or a row failed, 2 when the check cannot
start (a missing package, no GPU without ``--dry-run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[1]
if sys.path[:1] != [str(CHECKOUT / "src")]:  # this checkout's pipeline, ahead of any installed copy (use_checkout)
    sys.path.insert(0, str(CHECKOUT / "src"))

from pipeline.common.cli import Parser, command  # noqa: E402

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
    some rows need, and (``mlflow=False``) a word that MLflow, missing, is not needed."""
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
        lines.append("note: mlflow is not installed, and not needed: the check records nothing (tracking=none)")
    return "\n".join(lines)


def use_checkout() -> None:
    """Import ``pipeline`` from this checkout's ``src/``, ahead of any installed copy."""
    src = str(CHECKOUT / "src")
    if sys.path[:1] != [src]:
        sys.path.insert(0, src)


# ---------------------------------------------------------------------------------------------
# Rows, goals and the plan


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
    "pipeline_vs_bare": Goal(">=", 0.98, ">= 0.98"),
}
DRY_GPU = "dry run: no GPU is read"
COMMON = ["tracking=none", "checkpoint.enabled=false", "monitor.plots=false", "trainer.progress=false"]
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

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def guarded(key: str, name: str, unit: str, make: Callable[[], Row]) -> Row:
    """``make()``, or an ERROR row saying what went wrong: one failing measurement never stops the others."""
    try:
        return make()
    except Exception as err:
        lines = str(err).strip().splitlines() or [""]
        return Row(
            key,
            name,
            None,
            unit,
            goal=GOALS[key].text if key in GOALS else "",
            status="ERROR",
            detail=f"{type(err).__name__}: {lines[0][:300]}",
            raw={"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8)},
        )
    finally:
        release()


def release() -> None:
    """Free what the last run left (its model, its data), so every run starts from the same free memory."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_run(overrides: list[str]) -> Any:
    """``python -m pipeline <overrides>`` in this process, printing nothing; returns its ``RunResult``."""
    from pipeline.config import load
    from pipeline.train import train

    return train(load(overrides), echo=False, quiet=True)


def peak_mb(plan: Plan) -> float | None:
    """The CUDA allocator's peak since the last run started (each run resets it), in MB."""
    import torch

    return torch.cuda.max_memory_allocated() / 1e6 if plan.device == "cuda" else None


def steady(result: Any) -> dict[str, Any]:
    """A run's steady-state figures, for the JSON."""
    b = result.breakdown
    return {
        "samples_per_s": b.samples_per_s,
        "steady_steps": b.steady_steps,
        "steps": result.steps,
        "first_step_s": b.first_step_s,
        "compute_pct": b.compute_pct,
        "data_wait_pct": b.data_wait_pct,
        "h2d_pct": b.h2d_pct,
        "overhead_pct": b.overhead_pct,
        "epoch_s": [e.seconds for e in result.epochs],
        "gpu_util_mean_pct": result.utilisation.gpu_util_mean_pct,
        "oom_events": [e.micro_batch for e in result.oom_events],
        "micro_batch": result.micro_batch,
        "precision": result.precision,
        "run_name": result.run_name,
    }


def resnet_overrides(
    plan: Plan, *extra: str, batch: int | None = None, epochs: int | None = None, samples: int | None = None
) -> list[str]:
    """ResNet-50 (ImageNet stem) on synthetic uint8 images kept on the device: ``samples`` of them (default
    ``plan.steps_per_epoch`` batches of ``plan.batch``) in batches of ``batch``, one validation batch per epoch."""
    cuda = ["trainer.cudnn_benchmark=true"] if plan.device == "cuda" else []  # fixed shapes; refused on a CPU
    return [
        f"device={plan.device}",
        "model=resnet50",
        "model.stem=imagenet",
        "data=synthetic",
        f"data.shape=[3,{plan.image_px},{plan.image_px}]",
        "data.num_classes=1000",
        f"data.num_samples={samples or plan.batch * plan.steps_per_epoch}",
        f"data.val_samples={plan.batch}",
        "loader=resident",
        f"loader.batch_size={batch or plan.batch}",
        f"trainer.epochs={epochs or plan.epochs}",
        *cuda,
        *COMMON,
        *extra,
    ]


# ---------------------------------------------------------------------------------------------
# The steps


def step_doctor(ctx: Context) -> list[Row]:
    """``python -m pipeline.doctor``'s checks, as one row: how many failed, and which warned or failed."""

    def make() -> Row:
        from pipeline.diagnostics import doctor

        report = doctor.report(smoke=True)
        counts = Counter(c["status"] for c in report["checks"])
        flagged = [
            f"{c['status']} {c['name']}: {c['evidence'][:80]}"
            for c in report["checks"]
            if c["status"] in ("WARN", "FAIL")
        ]
        summary = ", ".join(f"{counts[s]} {s}" for s in ("PASS", "WARN", "FAIL", "INFO"))
        value = float(counts["FAIL"])
        return Row(
            "doctor",
            "doctor (python -m pipeline.doctor)",
            value,
            "FAIL",
            GOALS["doctor"].text,
            ctx.plan.judge(value, GOALS["doctor"]),
            "; ".join([summary, *flagged]),
            {"checks": report["checks"], "facts": report["facts"]},
        )

    return [guarded("doctor", "doctor (python -m pipeline.doctor)", "FAIL", make)]


@contextlib.contextmanager
def timed_evaluations(seconds: list[float]) -> Iterator[None]:
    """Time each evaluation pass of the runs inside. ``evaluate`` ends with a host sync (its sums become
    numbers), so its wall clock is the device's time too."""
    import pipeline.train as train_module

    original = train_module.evaluate

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    train_module.evaluate = timed
    try:
        yield
    finally:
        train_module.evaluate = original


def step_mlp(ctx: Context) -> list[Row]:
    """The guides' MLP on MNIST-shaped data kept on the device: the second epoch's training plus its evaluation."""
    plan = ctx.plan
    name = f"MLP epoch, {plan.mlp_samples:,} MNIST-shaped samples, resident, batch 64, with evaluation"

    def make() -> Row:
        evaluations: list[float] = []
        with timed_evaluations(evaluations):
            result = train_run(
                [
                    f"device={plan.device}",
                    "model=mlp",
                    "data=synthetic",
                    "data.shape=[1,28,28]",
                    f"data.num_samples={plan.mlp_samples}",
                    f"data.val_samples={plan.mlp_val}",
                    "loader=resident",
                    "loader.batch_size=64",
                    "trainer.epochs=2",
                    *COMMON,
                ]
            )
        last = result.epochs[-1]
        value = last.seconds + evaluations[-1]
        return Row(
            "mlp",
            name,
            value,
            "s",
            GOALS["mlp"].text,
            plan.judge(value, GOALS["mlp"]),
            f"epoch 2: training {last.seconds:.3f} s + evaluation of {plan.mlp_val:,} {evaluations[-1]:.3f} s; "
            f"{last.samples_per_s:,.0f} samples/s steady",
            {**steady(result), "train_s": last.seconds, "eval_s": evaluations[-1], "eval_s_per_epoch": evaluations},
        )

    return [guarded("mlp", name, "s", make)]


BF16 = ["amp=true", "precision=bf16"]
BF16_CL = [*BF16, "trainer.channels_last=true"]


def resnet_variants(ctx: Context) -> list[tuple[str, str, list[str], str]]:
    """(row key, name, overrides, why it is skipped in a dry run or '') for the ResNet-50 ladder."""
    mode = ctx.compile_mode
    return [
        ("resnet50_fp32", "fp32", ["amp=false", "precision.tf32=false"], ""),
        ("resnet50_tf32", "TF32", ["amp=false", "precision.tf32=true"], "precision.tf32 acts on CUDA GPUs only"),
        ("resnet50_bf16", "AMP bf16", BF16, ""),
        (
            "resnet50_fp16",
            "AMP fp16",
            ["amp=true", "precision=fp16"],
            "float16 autocast on a CPU is emulated: it says nothing about a GPU's tensor cores",
        ),
        ("resnet50_bf16_channels_last", "AMP bf16 + channels_last", BF16_CL, ""),
        (
            "resnet50_bf16_channels_last_compile",
            f"AMP bf16 + channels_last + compile ({mode})",
            [*BF16_CL, "trainer.compile=true", f"trainer.compile_mode={mode}"],
            "inductor takes minutes to compile ResNet-50 on a CPU (tests/test_compile.py covers the compile path)",
        ),
    ]


def step_resnet(ctx: Context, *, compiled: bool = False) -> list[Row]:
    """ResNet-50 training images/s on synthetic images: fp32, TF32, AMP bf16, AMP fp16, + channels_last; or
    (``compiled``) AMP bf16 + channels_last + torch.compile, whose compile time is left out and reported."""
    plan, rows = ctx.plan, []
    for key, label, overrides, dry_skip in resnet_variants(ctx):
        if ("compile" in key) != compiled:
            continue
        name = f"ResNet-50 {plan.image_px} px, batch {plan.batch}, {label}"
        if plan.dry and dry_skip:
            rows.append(Row(key, name, None, "img/s", GOALS.get(key, Goal("", 0, "")).text, "SKIP", dry_skip))
            continue

        def make(key: str = key, name: str = name, overrides: list[str] = overrides) -> Row:
            result = train_run(resnet_overrides(plan, *overrides))
            figures = {**steady(result), "peak_mb": peak_mb(plan)}
            value = result.breakdown.samples_per_s
            ctx.images_per_s[key] = value
            if figures["peak_mb"] is not None:
                ctx.peak_mb[key] = figures["peak_mb"]
            detail = (
                f"{result.breakdown.steady_steps} steady steps, first step {result.breakdown.first_step_s:.1f} s, "
                f"{result.breakdown.compute_pct:.0f}% compute"
            )
            if figures["peak_mb"] is not None:
                detail += f", peak {figures['peak_mb']:,.0f} MB"
            if "compile" in key:
                from pipeline.report.run_record import compile_seconds

                figures["compile_s"] = compile_seconds([e.breakdown for e in result.epochs])
                if figures["compile_s"] is not None:
                    detail += f"; compiling took {figures['compile_s']:.0f} s (left out)"
            if result.oom_events:
                detail += f"; out of memory: micro-batch {result.micro_batch}"
            goal = GOALS.get(key)
            return Row(key, name, value, "img/s", goal.text if goal else "", plan.judge(value, goal), detail, figures)

        rows.append(guarded(key, name, "img/s", make))
    return rows


class Poller:
    """Reads one GPU backend every ``interval_s`` on its own thread; keeps the utilisation readings."""

    def __init__(self, backend: Any, interval_s: float) -> None:
        self.backend, self.interval_s = backend, interval_s
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gpu-check-{backend.name}", daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            readings = self.backend.read()
            if readings and readings[0].util_pct is not None:
                self.values.append(readings[0].util_pct)


def gpu_backends(plan: Plan) -> tuple[dict[str, Any], dict[str, str]]:
    """NVML and GPUtil backends for GPU 0, and for each one that cannot be opened, why."""
    if plan.device != "cuda":
        return {}, {"nvml": DRY_GPU, "gputil": DRY_GPU}
    import torch

    from pipeline.monitor import gpu_targets
    from pipeline.monitor.gpu import GputilBackend, NvmlBackend

    targets = gpu_targets(torch.device("cuda", 0))
    opened, why = {}, {}
    for name, make in (("nvml", lambda: NvmlBackend(targets)), ("gputil", lambda: GputilBackend(targets, timeout_s=2))):
        try:
            opened[name] = make()
        except Exception as err:  # a missing package or library: that backend's rows say so
            why[name] = f"{type(err).__name__}: {err}"
    return opened, why


def bare_resnet(plan: Plan, *, amp: bool, channels_last: bool, seconds: float) -> dict[str, float]:
    """ResNet-50 trained on one ready batch already on the device (float, normalised): no input pipeline at all.

    Three warm-up steps (cuDNN's autotuning, the allocator), then as many steps as fill about ``seconds``,
    timed between two device syncs.
    """
    import torch
    import torch.nn.functional as F

    from pipeline.engine.models import resnet

    device = torch.device(plan.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as the pipeline's ResNet runs here
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = resnet("resnet50", in_channels=3, image_px=plan.image_px, num_classes=1000, stem="imagenet")
    model = model.to(device, memory_format=layout).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(plan.batch, 3, plan.image_px, plan.image_px, device=device).contiguous(memory_format=layout)
    labels = torch.randint(0, 1000, (plan.batch,), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        step()
    sync()
    start = time.perf_counter()
    step()
    sync()
    steps = max(3, int(seconds / max(time.perf_counter() - start, 1e-6)))
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    elapsed = time.perf_counter() - start
    return {"images_per_s": steps * plan.batch / elapsed, "steps": steps, "seconds": elapsed}


def augment_available() -> bool:
    """Whether this checkout has ``data.augment`` (GPU crop/flip); without it the input row runs unaugmented."""
    from pipeline.config import DataConfig

    return "augment" in {f.name for f in dataclasses.fields(DataConfig)}


def step_input(ctx: Context) -> list[Row]:
    """ResNet-50 on uint8 images as a decoded dataset holds them, normalised and augmented on the device, against
    the same model on a ready float batch; and the GPU's utilisation meanwhile. While the bare loop runs, NVML and
    GPUtil both read the GPU (the sampler step reports what each saw)."""
    plan = ctx.plan
    cuda = plan.device == "cuda"
    precision = BF16_CL if cuda else []  # on a CPU: float32, whose amp has its own check
    augment = AUGMENT if augment_available() else []
    what = "uint8 + crop/flip on the device" if augment else "uint8, unaugmented (this checkout has no data.augment)"
    bare_name = f"ResNet-50 {plan.image_px} px, batch {plan.batch}, {'AMP bf16 + channels_last' if cuda else 'fp32'}"
    ratio_name = f"{bare_name}: {what} / a ready float batch"
    util_name = f"GPU utilisation, {what}"
    rows: list[Row] = []

    def make_bare() -> dict[str, float]:
        backends, why = gpu_backends(plan)
        ctx.busy = {"why": why}
        with contextlib.ExitStack() as stack:
            pollers = {name: stack.enter_context(Poller(b, 0.25)) for name, b in backends.items()}
            figures = bare_resnet(plan, amp=cuda, channels_last=cuda, seconds=plan.busy_s)
        for name, backend in backends.items():
            ctx.busy[name] = pollers[name].values
            backend.close()
        return figures

    bare: dict[str, Any] = {}

    def make_ratio() -> Row:
        bare.update(make_bare())
        extra = [*precision, *augment, "monitor.interval_s=0.1"]
        result = train_run(resnet_overrides(plan, *extra, epochs=3))
        figures = {**steady(result), "bare_images_per_s": bare["images_per_s"], "bare_steps": bare["steps"]}
        bare["pipeline"] = figures
        value = result.breakdown.samples_per_s / bare["images_per_s"]
        return Row(
            "input_vs_synthetic",
            ratio_name,
            value,
            "x",
            GOALS["input_vs_synthetic"].text,
            plan.judge(value, GOALS["input_vs_synthetic"]),
            f"{result.breakdown.samples_per_s:,.0f} img/s through the pipeline vs {bare['images_per_s']:,.0f} img/s "
            f"bare; {result.breakdown.data_wait_pct:.0f}% of step time waiting for data",
            figures,
        )

    rows.append(guarded("input_vs_synthetic", ratio_name, "x", make_ratio))
    if not cuda:
        rows.append(Row("input_gpu_util", util_name, None, "%", GOALS["input_gpu_util"].text, "SKIP", DRY_GPU))
    elif "pipeline" not in bare:
        rows.append(
            Row("input_gpu_util", util_name, None, "%", GOALS["input_gpu_util"].text, "ERROR", "its run failed")
        )
    elif bare["pipeline"]["gpu_util_mean_pct"] is None:
        why = "the run could not read the GPU (neither NVML nor GPUtil works): pip install nvidia-ml-py"
        rows.append(Row("input_gpu_util", util_name, None, "%", GOALS["input_gpu_util"].text, "SKIP", why))
    else:
        util = bare["pipeline"]["gpu_util_mean_pct"]
        rows.append(
            Row(
                "input_gpu_util",
                util_name,
                util,
                "%",
                GOALS["input_gpu_util"].text,
                plan.judge(util, GOALS["input_gpu_util"]),
                "the run's own sampler (monitor=auto, every 0.1 s), mean over the run",
                {"gpu_util_mean_pct": util},
            )
        )
    return rows


@contextlib.contextmanager
def injected_oom_above(limit: int) -> Iterator[None]:
    """Models built inside raise torch.OutOfMemoryError for training batches over ``limit`` samples: the dry run's
    stand-in for a card that is too small (a CPU has no allocator cap to hit)."""
    import torch

    import pipeline.engine.build as build_module

    original = build_module.build_model

    def hook(module: Any, inputs: tuple[Any, ...]) -> None:
        if module.training and inputs[0].shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected above {limit} samples)")

    def build(*args: Any, **kwargs: Any) -> Any:
        model = original(*args, **kwargs)
        model.register_forward_pre_hook(hook)
        return model

    build_module.build_model = build
    try:
        yield
    finally:
        build_module.build_model = original


@contextlib.contextmanager
def memory_cap(fraction: float) -> Iterator[None]:
    """Let the CUDA allocator use only ``fraction`` of GPU 0, as if the card were that small."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


def step_oom(ctx: Context) -> list[Row]:
    """A batch four times too large for the card: the out-of-memory fallback halves the micro-batch until it fits
    and the run finishes; images/s after recovery is its steady state (the failed first step left out).

    On the GPU the card is made too small on purpose (``torch.cuda.set_per_process_memory_fraction``, 1.6x the peak
    of the same run at ``plan.batch``), so the row costs seconds on any card, 16 GB or 141 GB, and the failures are
    the allocator's real ones. In a dry run the failure is injected."""
    plan = ctx.plan
    big = 4 * plan.batch
    name = f"out-of-memory fallback: ResNet-50 {plan.image_px} px at batch {big}, images/s after recovery"
    cuda = plan.device == "cuda"
    precision = BF16_CL if cuda else []

    def make() -> Row:
        import torch

        # three steps an epoch, so each epoch has steady steps; on the GPU plan as many images as the batch-256 runs
        samples = max(plan.batch * plan.steps_per_epoch, 3 * big)
        overrides = resnet_overrides(plan, *precision, batch=big, samples=samples)
        if cuda:
            peak = ctx.peak_mb.get("resnet50_bf16_channels_last")
            if peak is None:  # run alone (--only oom): measure the fitting batch's peak first
                train_run([*resnet_overrides(plan, *precision, epochs=1, samples=samples), "trainer.max_steps=2"])
                peak = peak_mb(plan)
                release()
            total = torch.cuda.get_device_properties(0).total_memory / 1e6
            fraction = min(1.6 * peak / total, 0.95)
            how = f"the card capped at {fraction * total / 1e3:.1f} GB of {total / 1e3:.0f} GB"
            cap: Any = memory_cap(fraction)
        else:
            fraction, how = None, f"out of memory injected above {plan.batch} samples (a CPU has no allocator cap)"
            cap = injected_oom_above(plan.batch)
        with cap:
            result = train_run(overrides)
        figures = {**steady(result), "memory_fraction": fraction, "batch": big}
        survived = float(len(result.oom_events) >= 1 and result.micro_batch < big)
        status = plan.judge(survived, GOALS["oom_fallback"])
        value = result.breakdown.samples_per_s
        reference = ctx.images_per_s.get("resnet50_bf16_channels_last" if cuda else "resnet50_fp32")
        against = f" ({value / reference:.2f}x the batch-{plan.batch} row)" if reference else ""
        sizes = " -> ".join(str(e.micro_batch) for e in result.oom_events) + f" -> {result.micro_batch}"
        detail = (
            f"{how}; micro-batch {sizes} after {len(result.oom_events)} out-of-memory event(s), "
            f"{result.steps} steps done; {value:,.0f} img/s after recovery{against}"
        )
        if not survived:
            detail = f"no out-of-memory error happened ({how}): the fallback was not exercised; " + detail
        return Row("oom_fallback", name, value, "img/s", GOALS["oom_fallback"].text, status, detail, figures)

    return [guarded("oom_fallback", name, "img/s", make)]


def step_sampler(ctx: Context) -> list[Row]:
    """What one reading costs through NVML and through GPUtil (``pipeline.diagnostics.bench``'s sampler benchmark),
    and the mean
    utilisation each reported while the bare ResNet-50 loop kept the GPU busy (the input step)."""
    from pipeline.diagnostics.bench import bench_sampler_backends
    from pipeline.diagnostics.harness import Sizes

    plan = ctx.plan
    rows: list[Row] = []
    if plan.dry:  # a machine with a GPU would read it, but a dry run is the CPU's
        for backend, label in (("nvml", "NVML"), ("gputil", "GPUtil")):
            rows.append(
                Row(f"{backend}_read_cost", f"{label}: one reading of one GPU", None, "µs", "", "SKIP", DRY_GPU)
            )
        for backend, label in (("nvml", "NVML"), ("gputil", "GPUtil")):
            name = f"{label}: mean GPU utilisation during the bare ResNet-50 loop"
            rows.append(Row(f"{backend}_busy_util", name, None, "%", "", "SKIP", DRY_GPU))
        return rows

    def costs() -> dict[str, Any]:
        measured = bench_sampler_backends(Sizes(samples=0, repeats=1, warmup=0))
        return {r.name.rsplit(", ", 1)[-1]: r for r in measured if r.name.startswith("sampler reading, ")}

    try:
        found = costs()
    except Exception as err:
        found, failure = {}, f"{type(err).__name__}: {err}"
    else:
        failure = ""
    for backend, label in (("nvml", "NVML"), ("gputil", "GPUtil")):
        key, name = f"{backend}_read_cost", f"{label}: one reading of one GPU"
        row = found.get(backend)
        if failure:
            rows.append(Row(key, name, None, "µs", "", "ERROR", failure))
        elif row is None or not row.measured.endswith("µs"):
            rows.append(Row(key, name, None, "µs", "", "SKIP", row.detail if row else "not measured"))
        else:
            value = float(row.measured.split()[0].replace(",", ""))
            rows.append(Row(key, name, value, "µs", "", "INFO", row.detail, {"us_per_reading": value}))
    for backend, label in (("nvml", "NVML"), ("gputil", "GPUtil")):
        key, name = f"{backend}_busy_util", f"{label}: mean GPU utilisation during the bare ResNet-50 loop"
        values, unopened = ctx.busy.get(backend), ctx.busy.get("why", {})
        if not values:
            if backend in unopened:
                rows.append(Row(key, name, None, "%", "", "SKIP", unopened[backend]))
            elif not ctx.busy:
                rows.append(Row(key, name, None, "%", "", "SKIP", "the input step did not run (--only)"))
            else:
                rows.append(Row(key, name, None, "%", "", "ERROR", "no reading arrived during the loop"))
            continue
        mean = sum(values) / len(values)
        rows.append(
            Row(key, name, mean, "%", "", "INFO", f"{len(values)} readings, every 0.25 s", {"readings": values})
        )
    return rows


def step_overhead(ctx: Context) -> list[Row]:
    """The whole pipeline (timing, sampler, loss checks) against a hand-written loop, MLP epochs on resident
    MNIST-shaped data, interleaved rounds: ``pipeline.diagnostics.bench``'s comparison, on this check's device."""
    plan = ctx.plan
    name = f"pipeline / bare loop, MLP, batch 64, {plan.overhead_samples:,} samples, {plan.device}"

    def make() -> Row:
        from statistics import median

        from pipeline.common.stats import paired_ratio
        from pipeline.config import DataConfig
        from pipeline.data.sources import load_data
        from pipeline.diagnostics.bench import pipeline_epoch
        from pipeline.diagnostics.harness import Sizes, bare_epoch, interleaved

        sizes = Sizes(samples=plan.overhead_samples, repeats=plan.overhead_repeats, warmup=0 if plan.dry else 1)
        bundle = load_data(
            DataConfig("synthetic", shape=[1, 28, 28], num_classes=10, num_samples=sizes.samples, val_samples=500)
        )
        images, labels = (t.to(plan.device) for t in bundle.train.tensors)
        overrides = [
            "data=synthetic",
            f"data.num_samples={sizes.samples}",
            "data.val_samples=500",
            "loader=resident",
            "loader.batch_size=64",
            f"device={plan.device}",
            "tracking=none",
            "checkpoint.enabled=false",
        ]
        times = interleaved(
            {
                "bare": lambda: bare_epoch(images, labels, batch=64),
                "full": lambda: pipeline_epoch(overrides, ctx.work / "unused.db"),
            },
            sizes,
        )
        value = paired_ratio(times["bare"], times["full"])
        return Row(
            "pipeline_vs_bare",
            name,
            value,
            "x",
            GOALS["pipeline_vs_bare"].text,
            plan.judge(value, GOALS["pipeline_vs_bare"]),
            f"median epoch {median(times['full']):.3f} s through the pipeline vs {median(times['bare']):.3f} s bare, "
            f"{sizes.repeats} interleaved round(s)",
            {"bare_s": times["bare"], "pipeline_s": times["full"]},
        )

    return [guarded("pipeline_vs_bare", name, "x", make)]


RUNNERS: dict[str, Callable[[Context], list[Row]]] = {
    "doctor": step_doctor,
    "mlp": step_mlp,
    "resnet": step_resnet,
    "input": step_input,
    "oom": step_oom,
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
    "resnet50_bf16_channels_last_compile",
    "input_vs_synthetic",
    "input_gpu_util",
    "oom_fallback",
    "nvml_read_cost",
    "gputil_read_cost",
    "nvml_busy_util",
    "gputil_busy_util",
    "pipeline_vs_bare",
]


def in_table_order(rows: list[Row]) -> list[Row]:
    """Rows in ``ROW_ORDER``; a step skipped whole (its key is the step's) where its first row would be."""
    first_row = {"resnet": "resnet50_fp32", "input": "input_vs_synthetic", "oom": "oom_fallback"}
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
    lines = ["| check | value | unit | goal | result | detail |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {number(r.value)} | {r.unit} | {r.goal or '—'} | {r.status} | {r.detail} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    import torch

    from pipeline.engine.devices import cpu_name

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=props.name,
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            capability=f"sm_{props.major}{props.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
    return facts


def plain(value: Any) -> Any:
    """JSON without NaN or infinities (which json.dumps writes, and most readers refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


@command("python scripts/gpu_check.py")
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same plan at tiny sizes on the CPU (no GPU needed)")
    parser.add_argument("--out", default="gpu_check.json", help="where to write the raw numbers (JSON)")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of: {', '.join(STEPS)}")
    parser.add_argument("--compile-mode", default="default", help="trainer.compile_mode of the compile row")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="skip a step expected to end past this many seconds (default 480)"
    )
    parser.add_argument("--verbose", action="store_true", help="show the runs' log messages (warnings included)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)}")

    required, optional = missing_dependencies()
    message = dependency_message(required, optional, mlflow=importlib.util.find_spec("mlflow") is not None)
    if message:
        print(message, file=sys.stderr)
    if required:
        return 2
    use_checkout()
    import torch

    from pipeline.diagnostics.harness import quiet_logs

    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if args.budget_s is not None:
        plan = dataclasses.replace(plan, budget_s=args.budget_s)
    if not plan.dry and not torch.cuda.is_available():
        from pipeline.diagnostics import doctor

        finding = doctor.main_finding()
        print(
            "error: no usable CUDA GPU here"
            + (f" ({finding})" if finding else " (python -m pipeline.doctor says why)")
            + "; --dry-run checks the plan on the CPU",
            file=sys.stderr,
        )
        return 2

    import pipeline

    started = datetime.datetime.now(datetime.timezone.utc)
    facts = machine()
    gpu = f"{facts['gpu']} ({facts.get('gpu_memory_gb')} GB)" if facts["gpu"] else "no GPU"
    mode = "dry run: tiny sizes on the CPU; speed goals are shown, not judged" if plan.dry else "full sizes"
    print(
        f"# GPU check ({mode})\n\n{started:%Y-%m-%d %H:%M} UTC · {gpu} · {facts['cpu']}, {facts['cpus']} CPUs · "
        f"Python {facts['python']}, torch {facts['torch']} (CUDA {facts['torch_cuda']})\n",
        flush=True,
    )
    rows: list[Row] = []
    logs = contextlib.nullcontext() if args.verbose else quiet_logs()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, logs:
        ctx = Context(plan, args.compile_mode, Path(tmp))
        for step in [s for s in STEPS if s in names]:
            what, estimate_s = STEPS[step]
            if not plan.dry and ctx.elapsed() + estimate_s > plan.budget_s:
                reason = f"time budget: {ctx.elapsed():.0f} s gone, about {estimate_s} s more needed (--budget-s)"
                rows.append(Row(step, f"{step}: {what}", None, "", "", "SKIP", reason))
                continue
            began = time.perf_counter()
            print(f"[gpu_check] {step}: {what} ...", file=sys.stderr, flush=True)
            rows += RUNNERS[step](ctx)
            print(f"[gpu_check] {step}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
        seconds = ctx.elapsed()
    rows = in_table_order(rows)
    print(table(rows))
    counts = Counter(r.status for r in rows)
    print(f"\n{', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}; {seconds:.0f} s")
    document = {
        "schema": 1,
        "command": " ".join(["python scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "dry_run": plan.dry,
        "started": started.isoformat(timespec="seconds"),
        "seconds": seconds,
        "machine": facts,
        "pipeline": str(Path(pipeline.__file__).resolve().parent),
        "missing_optional": optional,
        "augment": augment_available(),
        "plan": asdict(plan),
        "summary": dict(counts),
        "rows": [asdict(r) for r in rows],
    }
    Path(args.out).write_text(json.dumps(plain(document), indent=2) + "\n")
    print(f"raw numbers: {args.out}")
    return 1 if counts["FAIL"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
