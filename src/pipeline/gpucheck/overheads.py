"""The GPU check's steps that measure around the model: uint8 images augmented on the device against a ready batch
(``step_input``), what a utilisation reading costs through NVML and GPUtil while the GPU is busy
(``step_sampler``, with a ``Poller``), and the pipeline against a bare training loop (``step_overhead``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any

from pipeline.common.messages import brief
from pipeline.common.stats import paired_ratio
from pipeline.config import DataConfig
from pipeline.gpucheck.goals import (
    AUGMENT,
    BF16_CL,
    DRY_GPU,
    GOALS,
    Context,
    Plan,
    Row,
    guarded,
)
from pipeline.gpucheck.training import (
    resnet_overrides,
    steady,
    train_run,
)


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

    from pipeline.monitor import gpu_targets  # lazy: torch (~1.4 s), checked for first
    from pipeline.monitor.gpu import GputilBackend, NvmlBackend  # lazy: torch, as above

    targets = gpu_targets(torch.device("cuda", 0))
    opened, why = {}, {}
    for name, make in (("nvml", lambda: NvmlBackend(targets)), ("gputil", lambda: GputilBackend(targets, timeout_s=2))):
        try:
            opened[name] = make()
        except Exception as err:  # a missing package or library: that backend's rows say so
            why[name] = brief(err)
    return opened, why


def bare_resnet(plan: Plan, *, amp: bool, channels_last: bool, seconds: float) -> dict[str, float]:
    """ResNet-50 trained on one ready batch already on the device (float, normalised): no input pipeline at all.

    Three warm-up steps (cuDNN's autotuning, the allocator), then as many steps as fill about ``seconds``,
    timed between two device syncs.
    """
    import torch
    import torch.nn.functional as F

    from pipeline.engine.models import resnet  # lazy: torch (~1.4 s), checked for first

    device = torch.device(plan.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as the pipeline's ResNet runs here
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = resnet("resnet50", (3, plan.image_px, plan.image_px), 1000, stem="imagenet")
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


def step_sampler(ctx: Context) -> list[Row]:
    """What one reading costs through NVML and through GPUtil (``harness.sampler_readings``, the benchmark suite's
    sampler rows), and the mean utilisation each reported while the bare ResNet-50 loop kept the GPU busy (the input
    step)."""
    from pipeline.gpucheck.harness import Sizes, sampler_readings  # lazy: torch (~1.4 s), checked for first

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
        measured = sampler_readings(Sizes(samples=0, repeats=1, warmup=0))
        return {r.name.rsplit(", ", 1)[-1]: r for r in measured if r.name.startswith("sampler reading, ")}

    try:
        found = costs()
    except Exception as err:
        found, failure = {}, brief(err)
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
    MNIST-shaped data, interleaved rounds: the benchmark suite's comparison (``python -m bench --only overhead``), on
    this check's device."""
    plan = ctx.plan
    name = f"pipeline / bare loop, MLP, batch 64, {plan.overhead_samples:,} samples, {plan.device}"

    def make() -> Row:
        from statistics import median

        from pipeline.data.sources import load_data  # lazy: torch, as above
        from pipeline.gpucheck.harness import Sizes, bare_epoch, interleaved, pipeline_epoch  # lazy: torch (~1.4 s)

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
