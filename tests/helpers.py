"""Helpers several test files share (fixtures stay in conftest.py): the tiny run's overrides, the step timer's faked
clock, the entry point in-process and as a real process, an action at a chosen training step, and what the verdict
reads (a step-time split, steady epochs, the machine's use) made from its shares."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import pipeline.engine.building.build as build_module
import pipeline.engine.observe.replay as replay_module
from pipeline.__main__ import main
from pipeline.engine.hot.timing import Breakdown
from pipeline.engine.results import EpochResult
from pipeline.monitor import UtilSummary

# A run small enough for a unit test: one epoch of a few steps, everything in tmp_path.
TINY = ["trainer.epochs=1", "trainer.max_steps=3", "loader.batch_size=32"]
# For tests of many tracked runs whose subject is neither the plots nor the logged model (a run's ~0.3 s of both)
LEAN = ["monitor.plots=false", "tracking.log_model=false"]


def freeze_the_heap() -> None:
    """Collect, then freeze what is alive (``gc.freeze``): the collector's later passes walk none of it. The tests'
    process does this once its imports are done (conftest): torch, MLflow, SQLAlchemy, Hydra and Matplotlib leave
    over 500,000 objects, and each in-process run's one full pass (``pipeline.common.heap.collector_running``) walked
    them all, 0.6-1 s, some 200 times a session. A run's own objects, made later, are collected as before."""
    gc.collect()
    gc.freeze()


class StepClock:
    """The step timer's clock (``pipeline.engine.hot.timing``'s ``time.perf_counter``): it moves only when the fakes
    below say they spent time, so a share of the step time is exact whatever else the machine is doing."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def run_main(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """``python -m pipeline *args`` in this process, through the real entry point: its exit code."""
    monkeypatch.setattr(sys, "argv", ["pipeline", *args])
    try:
        main()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m pipeline *args`` as a real process in ``cwd``, with no inherited tracking URI or GPU mask."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "CUDA_VISIBLE_DEVICES")}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300
    )


def fake_command(folder: Path, name: str, body: str) -> Path:
    """An executable shell script ``folder/name`` running ``body`` (a stand-in for nvidia-smi, nvcc, ...); returns
    its path. Put ``folder`` first on PATH for the code under test to find it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return script


def without_first_batch_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave out the start-up check of the first batch (one more forward, before the run), so that faults injected
    into the model's forwards land where a test puts them; the run then knows of no input example."""
    from pipeline.engine.building.inputs import FirstBatch

    monkeypatch.setattr(build_module, "check_first_batch", lambda *args, **kwargs: FirstBatch(True, ((), {})))


def without_replay_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """No replay check in the runs this test makes (as ``trainer.replay_check=false``): its few steps replayed after
    the first steady epoch (``pipeline.engine.observe.replay``, tested in test_replay.py) are forwards and optimizer
    steps too, which would shift what a test counts to inject its faults."""
    monkeypatch.setattr(build_module, "make_replay", lambda trainer: replay_module.NO_REPLAY)


def at_training_step(monkeypatch: pytest.MonkeyPatch, step: int, action: Callable[[], None]) -> None:
    """Run ``action`` during the forward pass of training step ``step`` of the model ``train()`` builds. The hook
    goes once it has fired, so the model the run logs at its end carries none (an action holding a lock could not
    be pickled). The steps the replay check replays (``pipeline.engine.observe.replay``) are no training steps: not
    counted."""
    original, replay = build_module.build_model, replay_module.replay
    calls = {"n": 0, "replaying": False}

    def replaying(*args, **kwargs):
        calls["replaying"] = True
        try:
            return replay(*args, **kwargs)
        finally:
            calls["replaying"] = False

    def build(*args, **kwargs):
        model = original(*args, **kwargs)

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if module.training and not calls["replaying"]:
                calls["n"] += 1
                if calls["n"] == step:
                    handle.remove()
                    action()

        handle = model.register_forward_pre_hook(hook)
        return model

    monkeypatch.setattr(build_module, "build_model", build)
    monkeypatch.setattr(replay_module, "replay", replaying)


def sigterm_at_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Send this process SIGTERM during the forward pass of training step ``step``."""
    at_training_step(monkeypatch, step, lambda: os.kill(os.getpid(), signal.SIGTERM))


def split(data_wait_pct: float = 0.0, h2d_pct: float = 0.0, overhead_pct: float = 0.0) -> Breakdown:
    """A steady step-time breakdown with these shares (of 100 s of steady steps, the rest computing): what
    ``pipeline.report.verdict.judge`` reads, the shares exact."""
    compute_s = 100.0 - data_wait_pct - h2d_pct - overhead_pct
    return Breakdown(
        data_wait_pct, h2d_pct, compute_s, steady_steps=10, steady_samples=320, first_step_s=1.0, steps=11,
        samples=352, overhead_s=overhead_pct,
    )  # fmt: skip


def steady(*shares: tuple[float, float]) -> list[EpochResult]:
    """Steady epochs with these (input %, overhead %) shares, the input all waiting for data."""
    return [
        EpochResult(i + 1, 0.5, {}, 100.0, 3.2, split(data_wait_pct=input_pct, overhead_pct=overhead_pct))
        for i, (input_pct, overhead_pct) in enumerate(shares)
    ]


def machine(gpu_util_pct: float | None = None, others_pct: float | None = None) -> UtilSummary:
    """The machine's use over a run: a GPU busy ``gpu_util_pct`` on average (none: no GPU readings), other processes
    using ``others_pct`` of its 4 CPUs (none: no CPU readings)."""
    cpu = None if others_pct is None else others_pct + 25.0  # the run's one CPU of 4 on top of the others'
    process = None if others_pct is None else 100.0
    return UtilSummary(10, cpu, gpu_util_pct, gpu_util_pct, None, process, cpus=1, machine_cpus=4)
