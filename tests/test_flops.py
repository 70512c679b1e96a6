"""Model FLOPs counted exactly, MFU by its formula, and the peak it is read against (a GPU's table, a CPU's
measurement: how it is measured and cached is tested in ``test_cpu_peaks.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from mlflow import MlflowClient

from helpers import machine, split
from pipeline.config import RunConfig
from pipeline.engine.building import flops
from pipeline.engine.building.build import build
from pipeline.engine.building.flops import ModelFlops
from pipeline.monitor import peaks
from pipeline.monitor.peaks import Peak
from pipeline.train import train

MLP_FORWARD = 2 * (784 * 512 + 512 * 10)  # multiply-adds of the 784-512-10 MLP, biases aside, twice


def test_the_mlp_step_at_batch_64_needs_the_analytic_flops(make_cfg: Callable[..., RunConfig]) -> None:
    setup = build(make_cfg("model=mlp", "loader.batch_size=64"))
    assert setup.model_flops.per_sample is not None
    assert setup.model_flops.per_sample * 64 == 3 * MLP_FORWARD * 64  # exactly: forward + backward = 3 forwards


def test_resnet18_at_224_px_counts_twice_torchvisions_published_multiply_adds() -> None:
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    forward = flops.forward_flops(model, torch.zeros(1, 3, 224, 224))
    assert forward == pytest.approx(2 * 1.814e9, rel=0.01)  # torchvision's model card: 1.814 G multiply-adds
    assert model.training  # the mode it was in


def test_mfu_is_the_formula() -> None:
    model = ModelFlops(2e9, Peak("bf16", 100.0, "this GPU", "a known datasheet"))
    assert model.tflops(5_000) == pytest.approx(10.0)  # 2 GFLOP x 5,000 samples/s
    assert model.mfu_pct(5_000) == pytest.approx(10.0)
    assert model.metrics(5_000) == {"perf/tflops": pytest.approx(10.0), "perf/mfu_pct": pytest.approx(10.0)}
    assert model.describe(5_000) == (
        "10% of this GPU's bf16 peak (MFU): 10 of 100 TFLOP/s (a known datasheet); 2 GFLOP a sample"
    )


def test_a_run_above_a_measured_cpu_peak_says_the_peak_is_low_and_how_to_measure_it_again() -> None:
    """A CPU peak measured while the machine was busy stays cached, and a later run can do more than it: the summary
    says why the share is over 100%, not a bare 101%."""
    measured = ModelFlops(2e6, Peak("fp32", 0.05, "this CPU", "measured matmul, 2 thread(s)"))
    said = measured.describe(30_000)  # 0.06 TFLOP/s
    assert said.startswith("120% of this CPU's fp32 peak (MFU): 0.06 of 0.05 TFLOP/s (measured matmul, 2 thread(s))")
    assert said.endswith(
        "; over 100%: the cached peak is lower than this run reached (measured while the machine was busier?): "
        "python -m pipeline.doctor measures it again"
    )
    assert "over 100%" not in measured.describe(20_000)  # 80%
    datasheet = ModelFlops(2e9, Peak("bf16", 100.0, "this GPU", "a known datasheet"))
    assert "doctor" not in datasheet.describe(60_000)  # a datasheet's peak is not measured again


def test_a_run_logs_the_mfu_of_its_steps_on_a_faked_clock(
    make_cfg: Callable[..., RunConfig], store_uri: str, monkeypatch: pytest.MonkeyPatch, clock
) -> None:
    """Each training forward takes 10 ms on the step timer's clock, so the steady throughput is exact (32 samples a
    step: 3,200 samples/s) and the MFU against a peak of 0.01 TFLOP/s is the formula's, to the digit."""
    import pipeline.engine.building.build as build_module
    import pipeline.engine.hot.hooks as step_module

    forward = step_module.call_model

    def timed(model, inputs):  # type: ignore[no-untyped-def]
        clock.spend(0.010)
        return forward(model, inputs)

    monkeypatch.setattr(step_module, "call_model", timed)  # the training step's forward
    monkeypatch.setattr(build_module, "device_peak", lambda *a, **k: Peak("fp32", 0.01, "this CPU", "a test"))
    result = train(make_cfg("model=mlp", "loader.batch_size=32", "trainer.max_steps=3"), echo=False)
    metrics = MlflowClient(store_uri).get_run(result.run_id).data.metrics
    per_sample = 3 * MLP_FORWARD
    assert metrics["throughput/samples_per_s"] == pytest.approx(3_200)
    assert metrics["perf/flops_per_sample"] == per_sample
    assert metrics["perf/tflops"] == pytest.approx(per_sample * 3_200 / 1e12)
    assert metrics["perf/mfu_pct"] == pytest.approx(100 * per_sample * 3_200 / 1e12 / 0.01)
    tags = MlflowClient(store_uri).get_run(result.run_id).data.tags
    assert tags["perf.peak"] == "this CPU's fp32 peak (a test)" and tags["perf.peak_tflops"] == "0.01"
    assert "perf.no_mfu" not in tags


def test_the_summary_says_the_mfu_against_this_cpus_measured_peak(make_cfg: Callable[..., RunConfig]) -> None:
    from pipeline.report.summary import format_summary

    result = train(make_cfg("model=mlp", "tracking.enabled=false"), echo=False)
    line = next(line for line in format_summary(result).splitlines() if line.startswith("  compute"))
    assert "% of this CPU's fp32 peak (MFU): " in line and " TFLOP/s (measured matmul, " in line and "a sample" in line


def test_a_model_the_counter_cannot_see_into_has_no_mfu_and_says_why() -> None:
    model = ModelFlops(flops.per_sample(0, 2), Peak("fp32", 1.0, "this CPU", "a test"))
    assert model.metrics(1_000) == {}
    assert model.describe(1_000) == "no MFU: the FLOP counter found no matmul or convolution in the model's forward"


def test_an_unknown_gpu_has_no_peak_and_never_another_cards() -> None:
    peak = peaks.device_peak(torch.device("cuda", 0), "bf16", device_name="NVIDIA Some Future GPU")
    assert peak.tflops is None and "'NVIDIA Some Future GPU' is not in pipeline's table" in peak.reason
    model = ModelFlops(1e9, peak)
    assert model.metrics(1_000) == {"perf/tflops": pytest.approx(1.0)}  # achieved, but no MFU
    assert model.tags()["perf.no_mfu"] == peak.reason
    assert model.describe(1_000).startswith("1 TFLOP/s (1 GFLOP a sample); no MFU: ")


def test_mps_has_no_peak_and_says_so() -> None:
    peak = peaks.device_peak(torch.device("mps"), "fp32")
    assert peak.tflops is None and peak.reason.startswith("no MFU on mps")


@pytest.mark.parametrize(
    ("autocast", "tf32", "capability", "expected"),
    [
        (torch.bfloat16, False, (9, 0), "bf16"),
        (torch.float16, True, (7, 0), "fp16"),
        (None, True, (8, 0), "tf32"),
        (None, True, (7, 0), "fp32"),  # a V100 has no TF32
        (None, False, (9, 0), "fp32"),
    ],
)
def test_the_peak_is_the_dtype_the_run_computes_in(
    monkeypatch: pytest.MonkeyPatch, autocast: torch.dtype | None, tf32: bool, capability: tuple, expected: str
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    before = torch.backends.cuda.matmul.allow_tf32  # a switch of torch's C++ side: set and put back by hand
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        assert peaks.run_dtype(torch.device("cuda", 0), autocast) == expected
        assert peaks.run_dtype(torch.device("cpu"), autocast) == ("fp32" if autocast is None else expected)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_a_compute_bound_gpu_run_at_low_mfu_gets_the_changes_that_raise_it(make_cfg: Callable[..., RunConfig]) -> None:
    from pipeline.report.verdict import Mfu, RunFacts, judge

    cfg = make_cfg("model=resnet18")
    low = judge(cfg, RunFacts("cuda", "fp32", mfu=Mfu(8, "tf32")), split(1, 1), machine(gpu_util_pct=98))
    assert low.bottleneck == "compute"
    assert (
        "computes at only 8% of its tf32 peak (MFU); to raise it try amp=true trainer.channels_last=true" in low.message
    )
    high = judge(cfg, RunFacts("cuda", "amp-bf16", mfu=Mfu(61, "bf16")), split(1, 1), machine(gpu_util_pct=98))
    assert "at 61% of its bf16 peak (MFU): the model's own arithmetic is the limit at this precision" in high.message
    assert "amp=true" not in high.message and "channels_last" not in high.message
    fp32 = judge(cfg, RunFacts("cuda", "fp32", mfu=Mfu(70, "tf32")), split(1, 1), machine(gpu_util_pct=98))
    assert fp32.message.endswith("amp=true computes in a narrower format, whose peak is higher")


def test_a_cpu_run_at_high_mfu_is_told_the_arithmetic_is_the_limit_there(make_cfg: Callable[..., RunConfig]) -> None:
    from pipeline.report.verdict import Mfu, RunFacts, judge

    verdict = judge(make_cfg(), RunFacts("cpu", "fp32", mfu=Mfu(55, "fp32")), split(1), machine())
    assert verdict.message.startswith("compute-bound (medium confidence: one steady epoch; decided by the step-time")
    assert "55% of its fp32 peak (MFU) — on this CPU the model's own arithmetic is the limit; " in verdict.message
