"""Pictures of a run: the utilisation timeline and the step-time breakdown (matplotlib, headless)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the compare chart imports this module, and must not pay for torch
    from pipeline.engine.hot.timing import Breakdown
    from pipeline.monitor import Sample

# One colour per part of a step in every chart that splits one (step_time.png, compare.png), under the compare
# table's names for the parts
STEP_COLOURS = {"data wait": "#d62728", "copy": "#ff7f0e", "compute": "#2ca02c", "own work": "#7f7f7f"}


WIDTH_IN = 9.0


def _figure(rows: int, height: float, *, bottom_in: float = 0.55) -> tuple[Any, Any]:
    """A figure made without pyplot (as ``compare``'s chart is): headless, owned by nobody, nothing to close, and
    pyplot's import (~0.2 s of every run) is not paid. Lazy: matplotlib (~0.3 s) only when a run draws. Its margins
    are set in inches (room for the y label, the title and ``bottom_in`` for the x label and anything below): a
    layout engine drew each figure twice, ~50 ms each."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, height))
    fig.subplots_adjust(
        left=0.75 / WIDTH_IN, right=1 - 0.2 / WIDTH_IN, top=1 - 0.4 / height, bottom=bottom_in / height, hspace=0.12
    )
    return fig, fig.subplots(rows, 1, sharex=True, squeeze=False)


def utilisation_timeline(
    samples: Sequence[Sample], epoch_starts: Sequence[float], *, title: str, cpu_count: int | None = None
) -> Any:
    """CPU (machine and process), RAM, and per-GPU utilisation and memory over time, epochs marked.

    Args:
        samples: the sampler's readings.
        epoch_starts: seconds on the sampler's clock at which each epoch began.
        title: the figure's title.
        cpu_count: logical CPUs of the machine the samples came from (default: this one's).

    Returns:
        The matplotlib figure.
    """
    # The run's CPU is sampled with 100 = one core; on the shared 0-100 axis it is drawn as a share
    # of the whole machine, like the machine's own line, so a run using several cores is not clipped.
    cores = cpu_count or os.cpu_count() or 1
    gpu_indices = sorted({g.index for s in samples for g in s.gpus})
    fig, axes = _figure(2 if gpu_indices else 1, 5.5 if gpu_indices else 3.2)
    elapsed_s = [s.elapsed_s for s in samples]
    cpu = axes[0][0]
    cpu.plot(elapsed_s, [s.cpu_pct for s in samples], label="CPU, whole machine %")
    cpu.plot(elapsed_s, [s.process_cpu_pct / cores for s in samples], label="CPU, this run (% of the machine)")
    cpu.plot(elapsed_s, [s.ram_pct for s in samples], label="RAM %", linestyle=":")
    cpu.set_ylabel("%")
    for index in gpu_indices:
        gpu = axes[1][0]
        readings = [(s.elapsed_s, g) for s in samples for g in s.gpus if g.index == index]
        gpu.plot(
            [x for x, g in readings if g.util_pct is not None],
            [g.util_pct for _, g in readings if g.util_pct is not None],
            label=f"GPU {index} utilisation %",
        )
        gpu.plot(
            [x for x, g in readings if g.mem_used_mb is not None and g.mem_total_mb],
            [100 * g.mem_used_mb / g.mem_total_mb for _, g in readings if g.mem_used_mb is not None and g.mem_total_mb],
            label=f"GPU {index} memory %",
        )
        gpu.set_ylabel("%")
    for row in axes:
        ax = row[0]
        for i, start in enumerate(epoch_starts, 1):
            ax.axvline(start, color="grey", linewidth=0.8, linestyle="--")
            ax.text(start, 1.0, f" epoch {i}", transform=ax.get_xaxis_transform(), fontsize=7, va="top")
        ax.set_ylim(0, 105)
        ax.legend(loc="lower right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds since the run started")
    axes[0][0].set_title(title)
    return fig


def step_breakdown(breakdowns: Sequence[Breakdown], *, title: str) -> Any:
    """Stacked bars per epoch: % of steady-state step time waiting for data, copying, computing and in the
    pipeline's own work (``STEP_COLOURS``)."""
    fig, axes = _figure(1, 3.2, bottom_in=1.0)  # the legend goes under the x label
    ax = axes[0][0]
    epochs = list(range(1, len(breakdowns) + 1))
    bottom = [0.0] * len(breakdowns)
    for label, values, color in (
        ("waiting for data", [b.data_wait_pct for b in breakdowns], STEP_COLOURS["data wait"]),
        ("host-to-device copy", [b.h2d_pct for b in breakdowns], STEP_COLOURS["copy"]),
        ("compute", [b.compute_pct for b in breakdowns], STEP_COLOURS["compute"]),
        ("the pipeline's own work", [b.overhead_pct for b in breakdowns], STEP_COLOURS["own work"]),
    ):
        ax.bar(epochs, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(epochs)
    ax.set_xlabel("epoch")
    ax.set_ylabel("% of step time")
    ax.set_ylim(0, 100)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8)
    ax.set_title(title)
    return fig
