"""The GPU check's step for what a run records when asked (``--only profile``): ``trainer.profile=true`` on ResNet-50
steps (the trace artifact must hold the profiled steps and, on CUDA, their kernels; ``perf/gpu_busy_pct`` must be
recorded), and ``trainer.memory_snapshot=on_oom`` on the MLP with an out-of-memory error injected into its forward
(``training.injected_oom_above``: the fallback must recover and ``memory/snapshot.pickle`` must hold the allocator's
real history). These are the check's only runs that record: into an MLflow store of their own in the check's
temporary folder (artifacts included), so MLflow is needed for them; without it both rows are skipped.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import pickletools
from pathlib import Path
from typing import Any

from pipeline.common.metric_names import (
    PERF_GPU_BUSY_PCT,
    PERF_GPU_IDLE_DATA_PCT,
    PERF_GPU_IDLE_HOST_PCT,
    PROFILE_STEPS,
)
from pipeline.gpucheck.goals import BF16_CL, GOALS, Context, Row, guarded
from pipeline.gpucheck.training import injected_oom_above, resnet_overrides, train_run

EXPERIMENT = "gpu-check"
PROFILED = 2  # trainer.profile_steps: steps 2 and 3, after the first's warm-up


def pickled_strings(data: bytes) -> set[str]:
    """The strings a pickle holds (its keys and values), read by ``pickletools`` opcode by opcode: nothing in it is
    unpickled, so nothing in it runs."""
    return {arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}


def step_profile(ctx: Context) -> list[Row]:
    """A profiled ResNet-50 run and a run that keeps the allocator's snapshot at an out-of-memory error."""
    plan = ctx.plan
    trace_name = f"trainer.profile=true: ResNet-50 {plan.image_px} px, batch {plan.batch}, {PROFILED} steps profiled"
    snapshot_name = "trainer.memory_snapshot=on_oom: the MLP, an out-of-memory error injected"
    if importlib.util.find_spec("mlflow") is None:
        why = "mlflow is not installed: these rows read the run's artifacts back (pip install mlflow)"
        return [
            Row("profile_trace", trace_name, None, "% GPU busy", GOALS["profile_trace"].text, "SKIP", why),
            Row("memory_snapshot", snapshot_name, None, "KB", GOALS["memory_snapshot"].text, "SKIP", why),
        ]
    uri = open_store(ctx.work)
    rows = [guarded("profile_trace", trace_name, "% GPU busy", lambda: profiled(ctx, uri, trace_name))]
    if plan.dry:
        why = "trainer.memory_snapshot acts on CUDA GPUs only (a CPU has no allocator history)"
        rows.append(Row("memory_snapshot", snapshot_name, None, "KB", GOALS["memory_snapshot"].text, "SKIP", why))
    else:
        rows.append(guarded("memory_snapshot", snapshot_name, "KB", lambda: snapshot(ctx, uri, snapshot_name)))
    return rows


def open_store(work: Path) -> str:
    """A store in the check's folder whose experiment keeps its artifacts there too (not in ./mlruns)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{work / 'records.db'}"
    client = MlflowClient(uri)
    if client.get_experiment_by_name(EXPERIMENT) is None:
        client.create_experiment(EXPERIMENT, artifact_location=(work / "artifacts").as_uri())
    return uri


def recorded(overrides: list[str], uri: str) -> list[str]:
    """``overrides`` recording into ``uri`` instead of nowhere (the check's other runs are ``tracking=none``)."""
    kept = [o for o in overrides if o != "tracking=none"]
    return [*kept, f"tracking.uri={uri}", f"tracking.experiment={EXPERIMENT}", "tracking.log_model=false"]


def artifact(uri: str, run_id: str, path: str, work: Path) -> bytes:
    from mlflow import MlflowClient

    return Path(MlflowClient(uri).download_artifacts(run_id, path, str(work))).read_bytes()


def profiled(ctx: Context, uri: str, name: str) -> Row:
    plan, cuda = ctx.plan, ctx.plan.device == "cuda"
    steps = min(plan.steps_per_epoch, PROFILED + 3)  # the first (warm-up), the profiled ones, steady ones if any
    extra = [*(BF16_CL if cuda else []), "trainer.profile=true", f"trainer.profile_steps={PROFILED}"]
    result = train_run(recorded(resnet_overrides(plan, *extra, epochs=1, samples=plan.batch * steps), uri))
    from mlflow import MlflowClient

    metrics = MlflowClient(uri).get_run(result.run_id).data.metrics
    events = json.loads(gzip.decompress(artifact(uri, result.run_id, "profile/trace.json.gz", ctx.work)))["traceEvents"]
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    kernels = sum(e.get("cat") == "kernel" for e in events)
    wanted = {f"step {n}" for n in range(2, 2 + PROFILED)}
    busy = metrics.get(PERF_GPU_BUSY_PCT)
    ok = wanted <= names and metrics.get(PROFILE_STEPS) == PROFILED and (not cuda or (busy is not None and kernels))
    report = result.profile
    detail = f"trace: {len(events):,} events, {kernels:,} kernels, ranges {', '.join(sorted(wanted & names))}"
    if busy is not None:
        detail += (
            f"; GPU busy {busy:.0f}%, idle {metrics[PERF_GPU_IDLE_HOST_PCT]:.0f}% on the host, "
            f"{metrics[PERF_GPU_IDLE_DATA_PCT]:.0f}% for data"
        )
    if report is not None and report.operators:
        detail += f"; top: {report.operators[0].name} {report.operators[0].share_pct:.0f}%"
    figures: dict[str, Any] = {
        "metrics": {k: v for k, v in metrics.items() if k.partition("/")[0] in ("profile", "perf")},
        "trace_events": len(events),
        "kernels": kernels,
        "operators": [vars(op) for op in report.operators[:20]] if report is not None else [],
    }
    goal = GOALS["profile_trace"]
    return Row("profile_trace", name, busy, "% GPU busy", goal.text, plan.judge(float(ok), goal), detail, figures)


def snapshot(ctx: Context, uri: str, name: str) -> Row:
    plan, batch = ctx.plan, 64
    overrides = [
        f"device={plan.device}",
        "model=mlp",
        "data=synthetic",
        "data.shape=[1,28,28]",
        f"data.num_samples={4 * batch}",
        f"data.val_samples={batch}",
        "loader=resident",
        f"loader.batch_size={batch}",
        "trainer.epochs=1",
        "trainer.memory_snapshot=on_oom",
        "checkpoint.enabled=false",
        "monitor.plots=false",
        "trainer.progress=false",
    ]
    result = train_run(recorded(overrides, uri), injected_oom_above(batch // 2))
    data = artifact(uri, result.run_id, "memory/snapshot.pickle", ctx.work)
    held = pickled_strings(data)
    recovered = len(result.oom_events) >= 1 and result.micro_batch < batch
    history = {"segments", "device_traces", "action", "alloc"} <= held  # the allocator's events, not just its state
    ok = recovered and history
    detail = (
        f"memory/snapshot.pickle: {len(data) / 1e3:,.0f} KB, "
        + ("with the allocator's segments and its history of allocations" if history else "without a history")
        + f"; micro-batch {batch} -> {result.micro_batch} after {len(result.oom_events)} out-of-memory event(s), "
        f"{result.steps} steps done"
    )
    goal = GOALS["memory_snapshot"]
    figures = {"bytes": len(data), "history": history, "oom_events": [e.micro_batch for e in result.oom_events]}
    return Row("memory_snapshot", name, len(data) / 1e3, "KB", goal.text, plan.judge(float(ok), goal), detail, figures)
