"""The run's closing summary, line by line, from a RunResult made by hand."""

from __future__ import annotations

import pytest

from pipeline.monitor.sampler import UtilSummary
from pipeline.report.summary import RunResult, format_summary


@pytest.mark.parametrize(("samples", "said"), [(1, "(1 sample)"), (12, "(12 samples)")])
def test_the_utilisation_line_counts_its_samples_in_words(samples: int, said: str) -> None:
    util = UtilSummary(samples, 82.0, None, None, None)
    result = RunResult("r", "id", "cpu", "CPU", "fp32", "x", 10, 10, 1.0, utilisation=util)
    (line,) = [line for line in format_summary(result).splitlines() if "utilisation" in line]
    assert line == f"  utilisation CPU 82% of the machine {said}"
