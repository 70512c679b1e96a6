"""The run's closing summary, line by line, from a RunResult made by hand."""

from __future__ import annotations

import pytest

from pipeline.engine.hot.timing import Breakdown, combine
from pipeline.engine.results import EpochResult, RunResult, run_breakdown, steady_epochs
from pipeline.experiments import sweep
from pipeline.monitor.sampler import UtilSummary
from pipeline.report.summary import format_summary


def epoch(number: int, samples_per_s: float, *, wait_s: float = 0.0, ranks: dict[str, float] | None = None):
    """An epoch of 10 steps whose 9 steady ones took 1 s of compute (plus ``wait_s`` waiting for data)."""
    steps = Breakdown(wait_s, 0.0, 1.0, 9, round(samples_per_s * (1.0 + wait_s)), 0.1, 10, 1000)
    return EpochResult(number, 0.5, {"val/loss": 0.4, "val/acc": 0.9}, 1.2, samples_per_s, steps, ranks or {})


def result_of(epochs: list[EpochResult], **kwargs) -> RunResult:
    return RunResult(
        "r", "id", "cpu", "CPU", "fp32", "x", 10, 10, 1.0, epochs=epochs, breakdown=run_breakdown(epochs), **kwargs
    )


def line_of(result: RunResult, label: str) -> str:
    (line,) = [line for line in format_summary(result).splitlines() if line.startswith(f"  {label}")]
    return line


@pytest.mark.parametrize(("samples", "said"), [(1, "(1 sample)"), (12, "(12 samples)")])
def test_the_utilisation_line_counts_its_samples_in_words(samples: int, said: str) -> None:
    util = UtilSummary(samples, 82.0, None, None, None)
    result = RunResult("r", "id", "cpu", "CPU", "fp32", "x", 10, 10, 1.0, utilisation=util)
    (line,) = [line for line in format_summary(result).splitlines() if "utilisation" in line]
    assert line == f"  utilisation CPU: the machine 82% {said}"


def test_the_speed_is_the_median_of_the_epochs_with_their_range_not_the_last_epochs() -> None:
    result = result_of([epoch(i, s) for i, s in enumerate([3_000.0, 1_548.0, 5_000.0, 6_000.0, 8_009.0], 1)])
    expected = "5,000 samples/s, median of 5 epochs (1,548–8,009; steady state; first step 0.10 s)"
    assert line_of(result, "speed") == f"  speed       {expected}"
    assert (result.speed().median, result.speed().n) == (5_000.0, 5)


def test_one_epochs_speed_has_no_range() -> None:
    assert line_of(result_of([epoch(1, 900.0)]), "speed") == (
        "  speed       900 samples/s in 1 epoch (steady state; first step 0.10 s)"
    )


def test_the_speed_and_the_step_shares_cover_the_same_epochs_steady_steps() -> None:
    timed = [epoch(1, 1_000.0, wait_s=1.0), epoch(2, 3_000.0), epoch(3, 2_000.0, wait_s=3.0)]
    untimed = EpochResult(4, 0.5, {}, 0.0, 0.0, combine([]), {})  # an epoch that trained no step
    result = result_of([*timed, untimed])
    assert steady_epochs(result.epochs) == timed
    assert result.breakdown == combine([e.breakdown for e in timed])
    assert result.speed().n == result.breakdown.steady_steps / 9 == 3 and result.speed().median == 2_000.0
    assert "median of 3 epochs (1,000–3,000;" in line_of(result, "speed")
    assert line_of(result, "step time").startswith("  step time   57% waiting for data")  # 4 s of 7 s, pooled


def test_a_ddp_jobs_speed_is_the_median_of_its_global_throughput_and_the_sweep_still_reads_the_last_epoch() -> None:
    job = [(1_800.0, 900.0), (2_000.0, 1_000.0), (1_000.0, 500.0)]
    epochs = [epoch(i, own, ranks={"throughput/global_samples_per_s": both}) for i, (both, own) in enumerate(job, 1)]
    result = result_of(epochs)
    assert line_of(result, "speed") == (
        "  speed       1,800 samples/s, median of 3 epochs (1,000–2,000; steady state, all ranks; rank 0 900; "
        "first step 0.10 s)"
    )
    assert sweep.objective(result, "throughput/samples_per_s") == 1_000.0  # what a sweep compares: unchanged


def test_the_utilisation_line_gives_the_runs_own_cpu_beside_the_machines() -> None:
    quiet = UtilSummary(3, 40.0, None, None, None, process_cpu_mean_pct=70.0, cpus=2, machine_cpus=2)
    result = result_of([epoch(1, 900.0)], utilisation=quiet)
    assert (
        line_of(result, "utilisation") == "  utilisation CPU: this run 35% of its 2 CPUs, the machine 40% (3 samples)"
    )
    assert "busy" not in format_summary(result)


def test_a_busy_machine_is_said_in_one_line_under_the_utilisation() -> None:
    busy = UtilSummary(3, 100.0, None, None, None, process_cpu_mean_pct=70.0, cpus=2, machine_cpus=2)
    lines = format_summary(result_of([epoch(1, 900.0)], utilisation=busy)).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  utilisation"))
    assert lines[at] == "  utilisation CPU: this run 35% of its 2 CPUs, the machine 100% (3 samples)"
    assert lines[at + 1] == (
        "  note        the machine was busy (others used 65% of its CPUs): speed figures are not comparable"
    )
