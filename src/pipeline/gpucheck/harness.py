"""How every benchmark here measures, shared by ``python -m bench`` and the GPU check: variants interleaved in
one process round after round (``interleaved``: warm-up discarded, the order alternating), the hand-written loop
that is the honest baseline (``mlp``, ``bare_step``, ``bare_epoch``), one result ``Row`` per claim with its goal,
the Markdown table and the machine's one-line description. Needs only torch: a fresh GPU machine runs it before
anything else is installed.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.common.markdown import markdown_table
from pipeline.engine.building.devices import cpu_name


@dataclass(frozen=True)
class Row:
    name: str
    measured: str
    goal: str
    met: bool | None  # None: informational, no goal
    detail: str


@dataclass(frozen=True)
class Sizes:
    samples: int  # MNIST-shaped training samples
    repeats: int
    warmup: int


FULL = Sizes(samples=60_000, repeats=7, warmup=1)


QUICK = Sizes(samples=2_000, repeats=1, warmup=0)


def interleaved(variants: dict[str, Callable[[], float]], sizes: Sizes) -> dict[str, list[float]]:
    """What each variant returns (seconds, or a rate), per round; rounds alternate the order and the warm-up round
    is dropped."""
    results: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(sizes.warmup + sizes.repeats):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            result = variants[name]()
            if round_ >= sizes.warmup:
                results[name].append(result)
    return results


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))


def bare_epoch(images: torch.Tensor, labels: torch.Tensor, *, batch: int) -> float:
    """A hand-written loop over in-memory uint8 tensors: the fastest honest baseline, on the tensors' device."""
    torch.manual_seed(0)
    model = mlp().to(images.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if images.is_cuda:
        torch.cuda.synchronize(images.device)  # the timed epoch starts with nothing queued
    start = time.perf_counter()
    order = torch.randperm(len(labels), device=images.device)
    for i in range(0, len(labels), batch):
        loss = bare_step(model, optimizer, images, labels, order[i : i + batch])
    loss.item()
    return time.perf_counter() - start


def bare_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """One step of the hand-written loop on the samples at ``index``: normalise, forward, backward, step."""
    x = (images[index].float() / 255 - 0.5) / 0.2887
    loss = F.cross_entropy(model(x), labels[index])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def pipeline_epoch(overrides: list[str], store: Path, writes: list[float] | None = None) -> float:
    """One epoch of ``python -m pipeline`` in-process: the epoch's wall time plus its metric writes.

    ``writes`` collects each run's share of that time spent writing metrics.
    """
    result = pipeline_run(overrides, store)
    seconds = result.epochs[0].seconds + result.tracking_write_s  # the writes between epochs count too
    if writes is not None:  # the writer thread's writes, if any, ran during the epoch: its seconds hold them
        writes.append((result.tracking_write_s + result.tracking_background_write_s) / seconds)
    return seconds


def pipeline_run(overrides: list[str], store: Path) -> Any:
    """A one-epoch ``python -m pipeline`` run in-process, on the CPU, tracked in ``store``: its ``RunResult``."""
    from pipeline.config import load  # lazy: Hydra and the run's imports (MLflow), only for a run
    from pipeline.train import train  # lazy, as above

    base = ["device=cpu", "trainer.epochs=1", "trainer.progress=false", f"tracking.uri=sqlite:///{store}"]
    cfg = load([*base, "tracking.experiment=bench", "monitor.plots=false", *overrides])
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, echo=False, quiet=True)


def sampler_readings(sizes: Sizes) -> list[Row]:
    """Microseconds per reading of each sampler backend that works here: psutil's (CPU, RAM), NVML's, GPUtil's."""
    from pipeline.common.messages import brief
    from pipeline.monitor import Sampler, gpu_targets  # lazy: psutil and the GPU libraries, only when measured
    from pipeline.monitor.gpu import GputilBackend, NvmlBackend  # lazy, as above

    rows = []
    n = 50 if sizes is QUICK else 500

    def per_read_us(sampler: Sampler) -> float:
        sampler.read()
        start = time.perf_counter()
        for _ in range(n):
            sampler.read()
        return 1e6 * (time.perf_counter() - start) / n

    alone, family = per_read_us(Sampler(interval_s=1.0)), per_read_us(Sampler(interval_s=1.0, children=True))
    rows.append(
        Row(
            "sampler reading, psutil (CPU, RAM)",
            f"{alone:.0f} µs",
            "(info)",
            None,
            f"per reading, on the sampler thread; {family:.0f} µs with loader workers (psutil scans /proc for them)",
        )
    )
    gpus = gpu_targets(torch.device("cuda", 0)) if torch.cuda.is_available() else []
    for name, make in (("nvml", lambda: NvmlBackend(gpus)), ("gputil", lambda: GputilBackend(gpus, timeout_s=5))):
        if not gpus:
            rows.append(Row(f"sampler reading, {name}", "n/a", "(info)", None, "no CUDA device on this machine"))
            continue
        try:
            backend = make()
        except Exception as err:  # report, do not fail the suite
            rows.append(Row(f"sampler reading, {name}", "n/a", "(info)", None, brief(err)))
            continue
        reads = 20 if name == "gputil" else n
        start = time.perf_counter()
        for _ in range(reads):
            backend.read()
        rows.append(
            Row(
                f"sampler reading, {name}",
                f"{1e6 * (time.perf_counter() - start) / reads:.0f} µs",
                "(info)",
                None,
                "per reading of one GPU",
            )
        )
        backend.close()
    return rows


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def table(rows: list[Row]) -> str:
    def met(row: Row) -> str:
        return "—" if row.met is None else ("yes" if row.met else "**no**")

    body = [[r.name, r.measured, r.goal, met(r), r.detail] for r in rows]
    return "\n".join(markdown_table(["benchmark", "measured", "goal", "met", "detail"], body))


def machine_facts() -> dict[str, Any]:
    """The machine a measurement ran on: Python, torch and its CUDA, the CPU, and the first GPU if there is one."""
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


def machine() -> str:
    """``machine_facts`` in one line, with the torch threads the benchmarks use."""
    facts = machine_facts()
    return (
        f"{facts['cpu']}, {facts['cpus']} CPUs, {facts['gpu'] or 'no GPU'}; Python {facts['python']}, "
        f"torch {facts['torch']}, {torch.get_num_threads()} torch threads"
    )


def release() -> None:
    """Free what the last run left (its model, its data), so every run starts from the same free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
