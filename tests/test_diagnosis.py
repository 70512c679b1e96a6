"""Where the time goes: the step-time breakdown, the bottleneck verdict, progress and pictures."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from mlflow import MlflowClient
from torch import nn
from torch.utils.data import Dataset

import pipeline.engine.building.build as build_module
import pipeline.monitor as monitor
from helpers import StepClock, fake_command, machine, split, steady
from pipeline.config import RunConfig
from pipeline.data import DataBundle, DataSpec
from pipeline.engine.hot.timing import Breakdown
from pipeline.engine.observe.progress import NoProgress, ProgressBar, progress_enabled
from pipeline.monitor import GpuTarget, Sample
from pipeline.monitor.gpu import GpuReading
from pipeline.report.plots import step_breakdown, utilisation_timeline
from pipeline.report.summary import format_summary
from pipeline.report.verdict import RunFacts, classify, judge
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


class SlowDataset(Dataset):
    """Digits-shaped samples that take ``delay_s`` each to 'load', on the step timer's clock."""

    def __init__(self, n: int, delay_s: float, clock: StepClock) -> None:
        self.n, self.delay_s, self.clock = n, delay_s, clock

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.clock.spend(self.delay_s)
        return torch.full((1, 28, 28), i % 255, dtype=torch.uint8), i % 10


class SlowModel(nn.Module):
    """A linear model whose forward takes ``delay_s`` on the step timer's clock."""

    def __init__(self, delay_s: float, clock: StepClock) -> None:
        super().__init__()
        self.delay_s, self.clock = delay_s, clock
        self.fc = nn.Linear(784, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.spend(self.delay_s)
        return self.fc(x.flatten(1))


def slow_bundle(delay_s: float, clock: StepClock, n: int = 96) -> DataBundle:
    spec = DataSpec("slow", (1, 28, 28), 10, n, 16, (0.5,), (0.25,), "test", "00000000")
    return DataBundle(spec, SlowDataset(n, delay_s, clock), SlowDataset(16, 0.0, clock))


def test_a_slow_dataset_is_judged_input_bound(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, clock: StepClock, quiet_machine: None
) -> None:
    monkeypatch.setattr(build_module, "load_data", lambda cfg, **kwargs: slow_bundle(delay_s=0.01, clock=clock))
    monkeypatch.setattr(build_module, "build_model", lambda *a, **k: SlowModel(delay_s=0.02, clock=clock))
    result = train(make_cfg("tracking=none", "trainer.max_steps=-1", "loader.batch_size=16"), echo=False)
    b = result.breakdown
    assert b.data_wait_pct + b.h2d_pct + b.compute_pct + b.overhead_pct == pytest.approx(100.0)
    assert b.data_wait_pct == pytest.approx(100 * 0.16 / 0.18) and result.bottleneck == "input"  # 16 x 10 ms a step
    assert result.verdict.startswith("highly input-bound (") and "loader.resident=true" in result.verdict
    assert "decided by the step-time split" in result.verdict


def test_a_slow_model_is_judged_compute_bound(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, clock: StepClock, quiet_machine: None
) -> None:
    """The model's 30 ms forward is all a step's time on the step timer's clock: no wall-clock share is asserted
    (a busy two-core machine once made a real one 89.5%)."""
    monkeypatch.setattr(build_module, "build_model", lambda *a, **k: SlowModel(delay_s=0.03, clock=clock))
    result = train(make_cfg("tracking=none", "trainer.max_steps=6", "loader=resident"), echo=False)
    assert result.breakdown.compute_pct == pytest.approx(100.0) and result.bottleneck == "compute"
    assert result.verdict.startswith("compute-bound") and "no GPU that torch can use" in result.verdict


@pytest.mark.parametrize(
    ("input_pct", "overhead", "mfu", "idle", "expected"),
    [
        (58, 0, None, False, "input-high"),
        (20, 30, None, False, "input-high"),  # input first: the loader's share is the larger win
        (19, 15, None, False, "overhead"),
        (19, 0, 8, True, "overhead"),  # MFU under 10% with the device mostly idle
        (19, 0, 8, False, "input-moderate"),
        (5, 0, None, False, "input-moderate"),
        (4.9, 14.9, 40, False, "compute"),
        (0, 0, 3, False, "compute"),
    ],
)
def test_classification_rules(input_pct: float, overhead: float, mfu: float | None, idle: bool, expected: str) -> None:
    assert classify(input_pct=input_pct, overhead_pct=overhead, mfu_pct=mfu, idle=idle) == expected


def test_epochs_that_agree_make_a_confident_verdict_and_epochs_that_disagree_cannot_tell(make_cfg: MakeCfg) -> None:
    cpu = RunFacts("cpu", "fp32")
    agree = judge(make_cfg(), cpu, split(30), machine(), epochs=steady((28, 1), (31, 1), (33, 0)))
    assert agree.bottleneck == "input" and agree.confidence == "high"
    assert agree.message.startswith(
        "highly input-bound (high confidence: input 28-33% over 3 epochs; decided by the step-time split): "
    )
    apart = judge(make_cfg(), cpu, split(12), machine(), epochs=steady((2, 1), (25, 1)))
    assert apart.bottleneck == "unknown" and apart.confidence == "low"
    assert apart.message.startswith(
        "cannot tell: the steady epochs disagree, input 2-25% over 2 epochs; the shares lean moderately input-bound: "
    )
    near = judge(make_cfg(), cpu, split(5), machine(), epochs=steady((4.5, 0), (6, 0)))
    assert near.confidence == "high"  # classes differ across a threshold by less than DISAGREE_SPREAD_PCT: noise


def test_input_hint_on_a_gpu_names_workers_and_pinned_memory(make_cfg: MakeCfg) -> None:
    cfg = make_cfg("loader.pin_memory=false")
    verdict = judge(cfg, RunFacts("cuda", "fp32"), split(58, 2), machine(gpu_util_pct=41), cpus=8)
    assert verdict.message == (
        "highly input-bound (medium confidence: one steady epoch; decided by the step-time split): 58% of step time "
        "waiting for data, 2% copying it, GPU busy 41% on average — "
        "try loader.num_workers=4 loader.persistent_workers=true loader.pin_memory=true, or loader.resident=true"
    )


@pytest.mark.parametrize(
    ("loader", "hint"),
    [
        ("workers", "try loader.num_workers=8, or loader.resident=true"),
        ("resident", "already resident; try a larger batch (loader.batch_size=64)"),
    ],
)
def test_input_hint_with_workers_doubles_them_and_resident_suggests_a_bigger_batch(
    make_cfg: MakeCfg, loader: str, hint: str
) -> None:
    verdict = judge(make_cfg(f"loader={loader}"), RunFacts("cuda", "fp32"), split(40), machine(30), cpus=16)
    assert hint in verdict.message


def test_compute_hints_follow_device_and_precision(make_cfg: MakeCfg) -> None:
    gpu = judge(make_cfg("model=resnet50"), RunFacts("cuda", "fp32"), split(1, 1), machine(gpu_util_pct=98))
    assert gpu.message.endswith("try amp=true trainer.channels_last=true trainer.compile=true loader.batch_size=64")
    cpu = judge(make_cfg("amp=true"), RunFacts("cpu", "amp-bf16"), split(1), machine())
    assert "trainer.compile=true; amp's effect on this CPU was not measured" in cpu.message
    assert cpu.message.index("loader.batch_size=64") < cpu.message.index("no GPU that torch can use")


def test_on_a_busy_machine_the_verdict_cannot_tell_and_says_which_way_the_shares_lean(make_cfg: MakeCfg) -> None:
    verdict = judge(make_cfg(), RunFacts("cpu", "fp32"), split(1), machine(others_pct=60))
    assert (verdict.bottleneck, verdict.confidence) == ("unknown", "low")
    assert verdict.message.startswith(
        "cannot tell: the machine was busy (others used 60% of its CPUs); the shares lean compute-bound: 1% of step "
        "time waiting for data, 0% copying it — "
    )
    assert verdict.tags()["verdict.class"] == "unknown" and verdict.tags()["verdict.top_ops"] == "none profiled"


def test_a_tracked_run_records_system_metrics_breakdown_verdict_and_plots(
    make_cfg: MakeCfg, store_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # the plots are drawn without pyplot (its import)
    result = train(make_cfg("trainer.epochs=2", "trainer.max_steps=-1", "monitor.interval_s=0.05"), echo=False)
    client = MlflowClient(store_uri)
    run = client.get_run(result.run_id)
    metrics = run.data.metrics
    for key in (
        "system/cpu_utilization_percentage",
        "system/system_memory_usage_megabytes",
        "system/process_cpu_utilization_percentage",
        "time/data_wait_pct",
        "time/h2d_pct",
        "time/compute_pct",
        "time/overhead_pct",
        "time/first_step_s",
        "throughput/samples_per_s",
        "cpu/util_mean_pct",
        "cpu/run_util_mean_pct",
    ):
        assert key in metrics, key
    assert run.data.tags["machine.busy"] in ("true", "false") and run.data.tags["machine.others_cpu_pct"].isdigit()
    assert len(client.get_metric_history(result.run_id, "time/compute_pct")) == 2
    assert run.data.tags["bottleneck"] in ("input", "overhead", "compute", "unknown")
    assert run.data.tags["verdict.class"] == run.data.tags["bottleneck"]
    assert run.data.tags["verdict.confidence"] in ("high", "medium", "low")
    assert run.data.tags["bottleneck.hint"] == result.verdict
    artifacts = {a.path for a in client.list_artifacts(result.run_id, "plots")}
    assert artifacts == {"plots/utilisation.png", "plots/step_time.png"}
    png = Path(client.download_artifacts(result.run_id, "plots/utilisation.png", str(tmp_path))).read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert "utilisation CPU" in run.data.tags["mlflow.note.content"]


@pytest.mark.slow
def test_a_run_beside_processes_burning_every_cpu_says_the_machine_was_busy(make_cfg: MakeCfg) -> None:
    """One spinning process per CPU for the whole run: the run's own CPU share stays below the machine's, and the
    summary says the machine was busy. Nothing about how fast anything ran is asserted."""
    cpus = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < cpus:
        pytest.skip("this process may use only some of the machine's CPUs: the burners could not fill the machine")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus)]
    try:
        cfg = make_cfg("tracking=none", "trainer.max_steps=20", "monitor.interval_s=0.05")  # ~4 s beside them
        result = train(cfg, echo=False)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    u = result.utilisation
    assert u.samples >= 3 and u.run_cpu_pct is not None and u.cpu_mean_pct is not None
    assert u.run_cpu_pct < u.cpu_mean_pct  # of its CPUs, which are all the machine's here
    assert u.busy and result.verdict.startswith("cannot tell: the machine was busy (others used ")
    assert "  note        the machine was busy (others used " in format_summary(result)


@pytest.mark.slow
def test_a_hanging_gpu_monitor_does_not_stop_training(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "bin"
    # GPUtil's query hangs; the run's start-up facts (the doctor's plain nvidia-smi, 10 s bound) get a quick failure
    fake_command(folder, "nvidia-smi", 'case "$*" in *utilization.gpu*) sleep 60 ;; esac\nexit 9\n')
    monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")
    monkeypatch.setattr(monitor, "gpu_targets", lambda device: [GpuTarget(0, "GPU-0000")])
    result = train(
        make_cfg("tracking=none", "monitor=gputil", "monitor.interval_s=0.1", "trainer.max_steps=-1"), echo=False
    )
    assert result.steps == 45 and result.utilisation.gpu_util_mean_pct is None
    assert "pipeline-sampler" not in {t.name for t in threading.enumerate()}
    time.sleep(0.2)
    assert not [c for c in psutil.Process().children(recursive=True) if c.is_running() and c.status() != "zombie"]
    assert sum("did not answer" in r.getMessage() for r in caplog.records) == 1


def last_line(text: str) -> str:
    """What a terminal shows last: the text after the final carriage return."""
    return text.rsplit("\r", 1)[-1]


def test_progress_bar_shows_epoch_steps_loss_rate_and_eta() -> None:
    stream = io.StringIO()
    bar = ProgressBar(total=4, epoch=2, epochs=5, stream=stream)
    bar.set_loss(0.4321)
    for _ in range(4):
        bar.step(64)
    bar.close()
    text = stream.getvalue()
    assert text.endswith("\n")  # close() leaves the finished bar on its own line
    line = last_line(text).strip()
    assert line.startswith("epoch 2/5 ") and " 4/4 · loss 0.4321 · " in line and line.endswith(" samples/s · ETA 00:00")
    rate = re.search(r"· ([\d,]+) samples/s", line)
    assert rate is not None and int(rate.group(1).replace(",", "")) > 0


def test_progress_bar_shows_the_loss_of_the_last_logging_point() -> None:
    stream = io.StringIO()
    bar = ProgressBar(total=3, epoch=1, epochs=1, stream=stream)
    for loss in (0.5, 0.25):
        bar.set_loss(loss)
        bar.step(8)
    bar.close()
    line = last_line(stream.getvalue())
    assert " 2/3 · loss 0.2500 · " in line and "0.5000" not in line


def test_progress_bar_before_any_loss_shows_none() -> None:
    stream = io.StringIO()
    bar = ProgressBar(total=2, epoch=1, epochs=3, stream=stream)
    bar.step(8)
    bar.close()
    line = last_line(stream.getvalue())
    assert line.startswith("epoch 1/3 ") and " 1/2 · " in line and "loss" not in line


def test_progress_bar_redraws_at_most_ten_times_a_second() -> None:
    stream = io.StringIO()
    started = time.perf_counter()
    bar = ProgressBar(total=2000, epoch=1, epochs=1, stream=stream)
    for _ in range(2000):
        bar.step(1)
    bar.close()
    elapsed = time.perf_counter() - started
    # One draw when it opens, one when it closes, and one per tenth of a second in between (not 2000).
    assert stream.getvalue().count("\r") <= 2 + elapsed / 0.1 + 1
    assert " 2000/2000 " in last_line(stream.getvalue())


def test_progress_bar_writes_to_stderr_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar(total=1, epoch=3, epochs=4)
    bar.step(16)
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == "" and last_line(captured.err).startswith("epoch 3/4 ")


def test_progress_is_quiet_off_a_terminal_and_in_sweeps() -> None:
    assert not progress_enabled("auto", quiet=False, stream=io.StringIO())
    assert not progress_enabled("auto", quiet=True)
    assert progress_enabled(True, quiet=True) and not progress_enabled(False, quiet=False)
    NoProgress().step(3)


def test_the_plot_shows_this_runs_cpu_as_a_share_of_the_machine() -> None:
    samples = [Sample(float(t), 95.0, 180.0, 1000.0, 20.0) for t in range(5)]  # 1.8 cores busy
    fig = utilisation_timeline(samples, [0.0], title="run", cpu_count=2)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    run = lines["CPU, this run (% of the machine)"]
    assert list(run.get_ydata()) == [90.0] * 5
    low, high = fig.axes[0].get_ylim()
    assert low <= min(run.get_ydata()) and max(run.get_ydata()) <= high
    assert list(lines["CPU, whole machine %"].get_ydata()) == [95.0] * 5


def test_plots_draw_gpu_rows_and_epoch_marks(tmp_path: Path) -> None:
    samples = [
        Sample(
            t * 0.5,
            50.0,
            90.0,
            1000.0,
            20.0,
            [GpuReading(0, util_pct=40.0 + t, mem_used_mb=100.0 * t, mem_total_mb=1000.0)],
        )
        for t in range(10)
    ]
    fig = utilisation_timeline(samples, [0.0, 2.5], title="run")
    assert len(fig.axes) == 2  # CPU/RAM and GPU
    fig.savefig(tmp_path / "u.png")
    fig = step_breakdown([Breakdown(1.0, 0.1, 2.0, 3, 30, 0.5, 4, 40)] * 2, title="run")
    fig.savefig(tmp_path / "s.png")
    assert (tmp_path / "u.png").stat().st_size > 5000 and (tmp_path / "s.png").stat().st_size > 5000
