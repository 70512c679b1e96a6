"""The short summary printed from a run's result (``pipeline.engine.results``) and stored as its description.

The summary's ``speed`` is the run's: the median of its epochs' steady-state samples/s with their min–max, over the
same epochs whose steady steps the ``step time`` shares pool (``steady_epochs``), so both figures describe the same
steps, and one epoch slowed by something else on the machine does not become the headline. What runs are compared
and searched by is unchanged: each epoch logs its own ``throughput/samples_per_s``, and ``compare`` and a sweep's
objective read the last epoch's, as every run they compare does.
"""

from __future__ import annotations

from pipeline.common import stats
from pipeline.common.metric_names import VAL_ACC, VAL_LOSS
from pipeline.data.backends import on_device
from pipeline.engine.results import EpochResult, RunResult, steady_epochs
from pipeline.monitor import UtilSummary
from pipeline.report.verdict import busy_words, data_wait_words


def format_summary(result: RunResult) -> str:
    """A few lines: what ran where, how well, how fast, where the time went, where the record is."""
    last = result.epochs[-1] if result.epochs else None
    b = result.breakdown
    lines = [
        f"run {result.run_name}: {len(result.epochs)} epoch(s), {result.steps} steps in {result.total_s:.1f} s",
        f"  device      {result.device} ({result.device_name})",
        f"  model       {result.parameters:,} parameters · precision {result.precision} · loader {result.loader}",
    ]
    if result.distributed:
        lines.append(f"  distributed {result.distributed}")
    if last is not None:
        ordered = sorted(last.val_metrics.items(), key=lambda item: (item[0] != result.primary, item[0] == VAL_LOSS))
        shown = " · ".join(
            f"{name} {value:.4g}" if abs(value) >= 1e4 else f"{name} {value:.4f}" for name, value in ordered
        )
        lines += [
            f"  {'accuracy' if result.primary == VAL_ACC else 'validation':<12}{shown} · "
            f"train/epoch_loss {last.train_loss:.4f}",
            speed_line(result),
            *compute_line(result),
            f"  step time   {b.data_wait_pct:.0f}% {data_wait_words(on_device(result.loader_kind))} · "
            f"{b.h2d_pct:.0f}% copying to the device · "
            f"{b.compute_pct:.0f}% compute · {b.overhead_pct:.0f}% the pipeline's own work between steps",
        ]
        lines += [f"  free data   {result.replay.describe()}"] if result.replay is not None else []
    lines += utilisation_lines(result.utilisation)
    if result.oom_events:
        first = result.oom_events[0].micro_batch
        lines.append(
            f"  OOM fallback {len(result.oom_events)} out-of-memory event(s): micro-batch {first} -> "
            f"{result.micro_batch}, gradients accumulated so every step still saw the full batch"
        )
    if result.eval_micro_batch and result.eval_micro_batch < result.micro_batch:
        lines.append(
            f"  OOM fallback evaluation ran out of memory and continued in micro-batches of {result.eval_micro_batch}"
        )
    if result.amp_probe is not None:
        lines.append(f"  amp check   {result.amp_probe.describe()}")
    if result.profile is not None:
        lines += [f"  profile     {line}" for line in result.profile.describe()]
    if result.verdict:
        lines.append(f"  bottleneck  {result.verdict}")
    if result.logged_model:
        lines.append(f"  model out   {result.logged_model}")
    lines += [f"  note        {note}" for note in result.notes]
    lines += ["  " + line for line in result.tracking]
    return "\n".join(lines)


def speed_line(result: RunResult) -> str:
    """``speed`` as the median of the steady epochs' samples/s with their range (``RunResult.speed``)."""
    speed, steady = result.speed(), steady_epochs(result.epochs)
    if speed is None:
        return "  speed       no steady step was timed"
    said = f", median of {speed.n} epochs ({speed.low:,.0f}–{speed.high:,.0f}; " if speed.n > 1 else " in 1 epoch ("
    own = device_speed(result.epochs) if any(e.ranks for e in steady) else None
    ranks = f", all ranks; rank 0 {own:,.0f}" if own is not None else ""
    first = f"first step {result.breakdown.first_step_s:.2f} s"
    launch = next((e.launch_s for e in result.epochs if e.launch_s is not None), None)
    first += f", {launch:.1f} s from launch" if launch is not None else ""  # time/launch_to_first_step_s
    return f"  speed       {speed.median:,.0f} samples/s{said}steady state{ranks}; {first})"


def device_speed(epochs: list[EpochResult]) -> float | None:
    """This process's median steady samples/s over the epochs the speed line covers: what its device's MFU is read
    at (rank 0's under DDP, where the speed line gives the job's); None when no steady step was timed."""
    own = stats.summarize(e.samples_per_s for e in steady_epochs(epochs))
    return own.median if own is not None else None


def compute_line(result: RunResult) -> list[str]:
    """``compute``: the MFU of this process's device at ``device_speed``."""
    speed = device_speed(result.epochs)
    return [f"  compute     {result.flops.describe(speed)}"] if result.flops is not None and speed is not None else []


def utilisation_lines(u: UtilSummary) -> list[str]:
    """The run's own CPU share of the CPUs it may use beside the machine's, the GPU's, and a note when others kept
    the machine busy."""
    if not u.samples:
        return []
    machine = f"the machine {u.cpu_mean_pct:.0f}%"
    if u.run_cpu_pct is not None:
        util = f"  utilisation CPU: this run {u.run_cpu_pct:.0f}% of its {u.cpus} CPU{'s' if u.cpus != 1 else ''}, "
        util += machine
    else:
        util = f"  utilisation CPU: {machine}"
    if u.gpu_util_mean_pct is not None:
        util += f" · GPU {u.gpu_util_mean_pct:.0f}% mean, {u.gpu_util_p95_pct:.0f}% p95"
    if u.gpu_mem_peak_mb is not None:
        util += f", {u.gpu_mem_peak_mb:,.0f} MB peak"
    lines = [util + f" ({u.samples} {'sample' if u.samples == 1 else 'samples'})"]
    if u.busy:
        lines.append(f"  note        {busy_words(u)}: speed figures are not comparable")
    return lines
