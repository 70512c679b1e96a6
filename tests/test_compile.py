"""torch.compile: its mode is validated and reaches torch; its compile time is recorded apart from the throughput;
a compiled model survives the out-of-memory fallback's smaller micro-batch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

import pipeline.engine.building.build as build_module
import pipeline.engine.hot.timing as timing_module
from pipeline.config import ConfigError, RunConfig, load
from pipeline.engine.hot import compilation
from pipeline.engine.hot.timing import Breakdown
from pipeline.report.logbook import compile_seconds
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]
MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.state_dict().values()])


@pytest.mark.parametrize("mode", MODES)
def test_every_compile_mode_validates_with_compile_on(mode: str) -> None:
    cfg = load(["device=cuda", "trainer.compile=true", f"trainer.compile_mode={mode}"])  # composing needs no GPU
    assert cfg.trainer.compile and cfg.trainer.compile_mode == mode


def test_the_default_compile_mode_is_default_and_compile_stays_off() -> None:
    trainer = load().trainer
    assert (trainer.compile, trainer.compile_mode) == (False, "default")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["trainer.compile_mode=max-autotune"],
            r"^trainer\.compile_mode='max-autotune' is not allowed: expected default while trainer\.compile=false "
            r"\(add trainer\.compile=true",
        ),
        (
            ["trainer.compile=true", "trainer.compile_mode=fast"],
            r"^trainer\.compile_mode='fast' is not allowed: expected one of 'default', 'reduce-overhead', "
            r"'max-autotune', 'max-autotune-no-cudagraphs'$",
        ),
        (
            ["device=cpu", "trainer.compile=true", "trainer.compile_mode=reduce-overhead"],
            r"^trainer\.compile_mode='reduce-overhead' is not allowed: expected default, max-autotune or "
            r"max-autotune-no-cudagraphs on cpu: reduce-overhead adds CUDA graphs",
        ),
    ],
)
def test_a_compile_mode_that_cannot_take_effect_is_refused_naming_the_key(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load(overrides)


def breakdown(first_step_s: float, steady_steps: int, steady_s: float) -> Breakdown:
    """An epoch of ``1 + steady_steps`` steps of 8 samples whose steady steps took ``steady_s`` in all (computing)."""
    return Breakdown(
        data_wait_s=0.0,
        h2d_s=0.0,
        compute_s=steady_s,
        steady_steps=steady_steps,
        steady_samples=8 * steady_steps,
        first_step_s=first_step_s,
        steps=steady_steps + 1,
        samples=8 * (steady_steps + 1),
    )


def test_compile_seconds_is_the_first_step_less_the_mean_steady_step_of_every_epoch() -> None:
    epochs = [breakdown(12.0, 4, 2.0), breakdown(0.6, 4, 2.4)]  # steady steps: 4.4 s over 8 = 0.55 s each
    assert compile_seconds(epochs) == pytest.approx(12.0 - 0.55)
    assert compile_seconds([breakdown(0.1, 4, 2.0)]) == 0.0  # a first step faster than the mean: nothing compiled


def test_compile_seconds_counts_the_later_steps_that_recompiled() -> None:
    last_batch = Breakdown(0.0, 0.0, 2.0, 4, 32, 12.0, 6, 48, compile_steps=1, compile_steps_s=1.84)
    assert compile_seconds([last_batch]) == pytest.approx(12.0 + 1.84 - 2 * 0.5)


def test_compile_seconds_is_unknown_without_a_step_after_an_epochs_first() -> None:
    one_step = Breakdown(0.0, 0.0, 5.0, steady_steps=1, steady_samples=8, first_step_s=5.0, steps=1, samples=8)
    assert compile_seconds([one_step, one_step]) is None
    assert compile_seconds([]) is None


class FakeClock:
    """``time.perf_counter`` for the step timer: one millisecond a reading, plus whatever a test adds."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now


def test_the_mode_reaches_torch_compile_and_the_compile_time_is_recorded_out_of_the_throughput(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    """torch.compile is faked (a real one takes seconds to minutes on a CPU): its first forward costs 10 s on the
    step timer's clock, as a lazy compilation would."""
    clock = FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)
    modes: list[str] = []

    def fake_compile(model: nn.Module, *, mode: str) -> nn.Module:
        modes.append(mode)
        forwards = []

        def compile_on_first_forward(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if module.training and not forwards:
                clock.now += 10.0
            forwards.append(1)

        model.register_forward_pre_hook(compile_on_first_forward)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    mode = "max-autotune-no-cudagraphs"
    result = train(
        make_cfg("trainer.compile=true", f"trainer.compile_mode={mode}", "monitor.enabled=false"), echo=False
    )

    assert modes == [mode]
    b = result.breakdown
    assert b.first_step_s > 10.0 and b.steps == 3 and b.steady_steps == 2 and b.steady_samples == 64
    assert b.step_s < 1.0  # the first step's 10 s are not in the steady steps' time...
    assert b.samples_per_s == pytest.approx(64 / b.step_s)  # ...that the throughput divides by
    client = MlflowClient(store_uri)
    run = client.get_run(result.run_id)
    assert run.data.metrics["throughput/samples_per_s"] == pytest.approx(b.samples_per_s)
    assert run.data.metrics["time/compile_s"] == pytest.approx(b.first_step_s - b.step_s / 2)
    assert run.data.metrics["time/compile_s"] > 9.9
    assert run.data.params["trainer.compile"] == "true" and run.data.params["trainer.compile_mode"] == mode
    note = f"torch.compile (mode {mode}) took about 10.0 s: the first step's 10.0 s, less steady steps' time"
    assert any(n.startswith(note) for n in result.notes)
    assert note in run.data.tags["mlflow.note.content"]  # the printed summary, as the run's description


def test_an_eager_run_records_no_compile_time(make_cfg: MakeCfg, store_uri: str) -> None:
    result = train(make_cfg(), echo=False)
    metrics = MlflowClient(store_uri).get_run(result.run_id).data.metrics
    assert "time/compile_s" not in metrics and "throughput/samples_per_s" in metrics
    assert not any("torch.compile" in n for n in result.notes)


def out_of_memory_once_above_16(attempts: list[int]) -> Callable[[torch.Tensor], None]:
    """A function that raises a real torch.OutOfMemoryError the first time it sees more than 16 samples, run
    eagerly between two compiled graphs (as a failing allocation inside one would raise at run time). ``attempts``
    is reached through the closure, not passed in: dynamo would guard on an argument's length and recompile."""

    @torch.compiler.disable
    def inject(activations: torch.Tensor) -> None:
        attempts.append(activations.shape[0])
        if activations.shape[0] > 16 and attempts.count(activations.shape[0]) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")

    return inject


@pytest.mark.slow
def test_a_compiled_model_survives_an_out_of_memory_error_and_recompiles_for_the_smaller_micro_batch(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first attempt at micro-batch 32 fails after the first layer's compiled graph ran; the fallback replays
    the step at 16, which recompiles (the batch dimension turns dynamic), and the run finishes as an eager run at
    micro-batch 16 would: same steps, same weights, no recompile limit hit."""
    torch._dynamo.reset()  # no graphs, guards or dynamic-shape decisions left over from other tests
    attempts: list[int] = []
    inject = out_of_memory_once_above_16(attempts)
    original = build_module.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)  # Flatten, Linear, ReLU, Linear
        model[1].register_forward_hook(lambda module, inputs, output: inject(output) if module.training else None)
        return model

    base = ["trainer.max_steps=4", "loader.batch_size=32", "trainer.replay_check=false"]  # attempts counted: no replay
    eager = train(make_cfg(*base, "tracking=none", "oom.micro_batch_size=16"), echo=False)
    monkeypatch.setattr(build_module, "build_model", build)
    with caplog.at_level(logging.WARNING):
        result = train(make_cfg(*base, "trainer.compile=true"), echo=False)

    assert isinstance(result.model, torch._dynamo.eval_frame.OptimizedModule)
    assert [e.micro_batch for e in result.oom_events] == [32] and result.micro_batch == 16
    assert result.steps == 4 and attempts == [32] + [16] * 8  # the failed attempt, then 2 micro-batches a step
    torch.testing.assert_close(weights(result.model._orig_mod), weights(eager.model), rtol=1e-4, atol=1e-5)
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]
    metrics = MlflowClient(store_uri).get_run(result.run_id).data.metrics
    assert metrics["oom/micro_batch_size"] == 16 and metrics["time/compile_s"] >= 0


@pytest.mark.slow
def test_a_sweep_over_three_models_compiles_every_job_in_one_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Three hidden sizes, two epochs of digits at batch 64 (its 30-sample last batch recompiles once): 6 graphs
    for one forward's code, past a recompile limit of 4 (dynamo's is 8: five jobs would show the same at twice the
    cost) if the jobs shared its state. Each job starts fresh, so each compiles and none runs eagerly; without the
    reset, the third job's recompile limit ends it with one line."""
    from helpers import run_main

    # torch's own patch, undone by torch: monkeypatch's undo left the config module without the key, and the
    # next compile in this process failed ("recompile_limit does not exist")
    with torch._dynamo.config.patch(recompile_limit=4):
        sizes = "[32],[48],[64]"
        args = ["-m", f"model.hidden_sizes={sizes}", "trainer.compile=true", "trainer.epochs=2", "device=cpu"]
        args += ["monitor.enabled=false", "loader.batch_size=64", "trainer.progress=false"]
        assert run_main(monkeypatch, *args) == 0
        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        jobs = [r for r in client.search_runs(["1"]) if "sweep.job" in r.data.tags]
        assert len(jobs) == 3 and {r.info.status for r in jobs} == {"FINISHED"}
        for run in jobs:
            metrics = run.data.metrics
            assert metrics["compile/graphs"] >= 2 and metrics["compile/recompiles"] >= 1  # the last batch, evaluation
            assert metrics["time/compile_s"] > 0 and run.data.params["trainer.compile"] == "true"

        monkeypatch.setattr(compilation, "fresh", lambda: None)  # the jobs now share dynamo's state, as they did
        monkeypatch.chdir(tmp_path / "multirun")
        assert run_main(monkeypatch, *args) == 2
        runs = MlflowClient(f"sqlite:///{tmp_path / 'multirun' / 'mlflow.db'}").search_runs(["1"])
        failed = [r for r in runs if r.info.status == "FAILED" and "sweep.job" in r.data.tags]
        assert failed and failed[0].data.tags["error"].startswith(
            "RecompileLimit: torch.compile reached its recompile limit"
        )
