"""The GPU check's steps that train with the pipeline itself (``pipeline.train.train`` in this process,
``tracking=none``): the doctor's checks, the MLP's epoch on resident data, ResNet-50 in each precision (and
compiled), and a batch too large for the card, which the out-of-memory fallback must survive.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from pipeline.config import load
from pipeline.gpucheck.goals import (
    BF16,
    BF16_CL,
    COMMON,
    GOALS,
    Context,
    Goal,
    Plan,
    Row,
    guarded,
)


def train_run(overrides: list[str], hooks: Any = None) -> Any:
    """``python -m pipeline <overrides>`` in this process, printing nothing, under ``hooks``
    (``pipeline.engine.session.Hooks``); returns its ``RunResult``."""
    from pipeline.train import train  # lazy: torch (~1.4 s), checked for first

    return train(load(overrides), echo=False, quiet=True, hooks=hooks)


def peak_mb(plan: Plan) -> float | None:
    """The CUDA allocator's peak since the last run started (each run resets it), in MB."""
    import torch

    return torch.cuda.max_memory_allocated() / 1e6 if plan.device == "cuda" else None


def steady(result: Any) -> dict[str, Any]:
    """A run's steady-state figures, for the JSON."""
    breakdown = result.breakdown
    return {
        "samples_per_s": breakdown.samples_per_s,
        "steady_steps": breakdown.steady_steps,
        "steps": result.steps,
        "first_step_s": breakdown.first_step_s,
        "compute_pct": breakdown.compute_pct,
        "data_wait_pct": breakdown.data_wait_pct,
        "h2d_pct": breakdown.h2d_pct,
        "overhead_pct": breakdown.overhead_pct,
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


def step_doctor(ctx: Context) -> list[Row]:
    """``python -m pipeline.doctor``'s checks, as one row: how many failed, and which warned or failed."""

    def make() -> Row:
        from pipeline.machine import doctor  # lazy: torch (~1.4 s), checked for first

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


def step_mlp(ctx: Context) -> list[Row]:
    """The set-up recipe's MLP on MNIST-shaped data kept on the device: the second epoch's training and evaluation."""
    plan = ctx.plan
    name = f"MLP epoch, {plan.mlp_samples:,} MNIST-shaped samples, resident, batch 64, with evaluation"

    def make() -> Row:
        from pipeline.engine.session import Hooks  # lazy: torch (~1.4 s), checked for first

        evaluations: list[float] = []
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
            ],
            hooks=Hooks(evaluated=evaluations.append),  # each evaluation pass's seconds (it ends with a host sync)
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
                from pipeline.report.logbook import compile_seconds  # lazy: torch (~1.4 s), checked for first

                figures["compile_s"] = compile_seconds([e.breakdown for e in result.epochs])
                if figures["compile_s"] is not None:
                    detail += f"; compiling took {figures['compile_s']:.0f} s (left out)"
            if result.oom_events:
                detail += f"; out of memory: micro-batch {result.micro_batch}"
            mfu = result.flops.mfu_pct(value)
            figures["mfu_pct"] = mfu
            ctx.mfu[key] = (mfu, result.flops.peak.what if mfu is not None else result.flops.why_none())
            detail += f"; MFU {mfu:.1f}%" if mfu is not None else ""
            goal = GOALS.get(key)
            return Row(key, name, value, "img/s", goal.text if goal else "", plan.judge(value, goal), detail, figures)

        rows.append(guarded(key, name, "img/s", make))
    return rows if compiled else [*rows, mfu_row(ctx)]


def mfu_row(ctx: Context, key: str = "resnet50_bf16_channels_last") -> Row:
    """That run's MFU against the table of GPU peaks (a dry run: the CPU's measured peak); a card the table does not
    hold reads 0 and fails, with the reason."""
    name = "MFU, ResNet-50 AMP bf16 + channels_last, against the device's peak"
    goal = GOALS["mfu"]
    if key not in ctx.mfu:
        return Row("mfu", name, None, "%", goal.text, "SKIP", f"the {key} run did not complete")
    value, basis = ctx.mfu[key]
    shown = value if value is not None else 0.0
    return Row("mfu", name, shown, "%", goal.text, ctx.plan.judge(shown, goal), basis, {"mfu_pct": value})


def injected_oom_above(limit: int) -> Any:
    """The run's hooks (``pipeline.engine.session.Hooks``) under which its model raises torch.OutOfMemoryError for
    training batches over ``limit`` samples: the dry run's stand-in for a card that is too small (a CPU has no
    allocator cap to hit)."""
    import torch

    from pipeline.engine.session import Hooks  # lazy: torch (~1.4 s), checked for first

    def hook(module: Any, inputs: tuple[Any, ...]) -> None:
        if module.training and inputs[0].shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected above {limit} samples)")

    return Hooks(model=lambda model: model.register_forward_pre_hook(hook))


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
                from pipeline.gpucheck.harness import release  # lazy: torch (~1.4 s), checked for first

                release()
            total = torch.cuda.get_device_properties(0).total_memory / 1e6
            fraction = min(1.6 * peak / total, 0.95)
            how = f"the card capped at {fraction * total / 1e3:.1f} GB of {total / 1e3:.0f} GB"
            cap: Any = memory_cap(fraction)
            hooks = None
        else:
            fraction, how = None, f"out of memory injected above {plan.batch} samples (a CPU has no allocator cap)"
            cap, hooks = contextlib.nullcontext(), injected_oom_above(plan.batch)
        with cap:
            result = train_run(overrides, hooks)
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
