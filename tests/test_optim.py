"""Optimizers and schedules from their groups: stepped once per optimizer step, logged as train/lr, checkpointed."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from mlflow import MlflowClient

import pipeline.engine.building.build as build_module
from helpers import without_first_batch_check
from pipeline.common.targets import TargetError
from pipeline.config import OptimizerConfig, RunConfig, SchedulerConfig
from pipeline.engine.optim import WarmupCosineFactor, build_optimizer, build_scheduler
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


def params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(2, 2).parameters())


def test_the_optimizer_groups_make_torch_optimizers_with_their_keywords(make_cfg: MakeCfg) -> None:
    adam = build_optimizer(make_cfg("optimizer=adam", "optimizer.lr=0.003").optimizer, params())
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["lr"] == 0.003
    rms = build_optimizer(OptimizerConfig("RMSprop", {"lr": 0.01, "alpha": 0.9}), params())
    assert isinstance(rms, torch.optim.RMSprop) and rms.defaults["alpha"] == 0.9
    with pytest.raises(TargetError, match=r"^optimizer\.betas is not a keyword of torch\.optim\.SGD \(it takes "):
        build_optimizer(OptimizerConfig("torch.optim.SGD", {"lr": 0.1, "betas": [0.9, 0.99]}), params())
    with pytest.raises(TargetError, match=r"optimizer\._target_=torch\.nn\.Linear raised|not a torch\.optim"):
        build_optimizer(OptimizerConfig("torch.nn.Linear", {}), params())


def test_each_schedule_runs_over_the_runs_steps() -> None:
    def lrs(cfg: SchedulerConfig, steps: int = 10) -> list[float]:
        optimizer = torch.optim.SGD(params(), lr=1.0)
        schedule = build_scheduler(cfg, optimizer, steps=steps, epochs=1)
        seen = []
        for _ in range(steps):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.after_step()
        return seen

    cosine = lrs(SchedulerConfig("pipeline.engine.optim.cosine", {"min_lr": 0.0}))
    assert cosine[0] == 1.0 and cosine[5] == pytest.approx(0.5) and cosine[-1] < 0.03
    assert lrs(SchedulerConfig("pipeline.engine.optim.step", {"step_size": None, "gamma": 0.5}), 9)[3] == 0.5
    warm = lrs(SchedulerConfig("pipeline.engine.optim.warmup_cosine", {"warmup_steps": 4, "min_lr": 0.1}))
    assert warm[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8]) and warm[4] == 1.0 and min(warm) >= 0.1
    onecycle = lrs(SchedulerConfig("pipeline.engine.optim.onecycle", {"max_lr": None, "pct_start": 0.3}))
    assert max(onecycle) == pytest.approx(1.0, rel=0.05) and onecycle[0] < 0.1
    expo = lrs(SchedulerConfig("ExponentialLR", {"gamma": 0.5}), 3)  # a torch.optim.lr_scheduler class by name
    assert expo == [1.0, 0.5, 0.25]
    assert build_scheduler(SchedulerConfig(None), torch.optim.SGD(params(), lr=1.0), steps=3, epochs=1).inner is None
    assert WarmupCosineFactor(0, 10, 0.0)(10) == pytest.approx(0.0) and math.isclose(
        WarmupCosineFactor(0, 10, 0.0)(0), 1
    )


def test_a_schedule_steps_per_optimizer_step_so_the_oom_fallback_changes_neither_it_nor_the_weights(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    base = ["scheduler=cosine", "loader.batch_size=64", "trainer.max_steps=8", "trainer.log_every_n_steps=1"]
    plain = train(make_cfg(*base, "tracking.experiment=plain"), echo=False)

    def oom_above_16(module, inputs):
        if module.training and inputs[0].shape[0] > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    original = build_module.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        model.register_forward_pre_hook(oom_above_16)
        return model

    monkeypatch.setattr(build_module, "build_model", build)
    without_first_batch_check(monkeypatch)
    shrunk = train(make_cfg(*base), echo=False)
    assert shrunk.micro_batch == 16 and len(shrunk.oom_events) == 2
    client = MlflowClient(store_uri)
    lr = {
        r.info.run_id: [m.value for m in client.get_metric_history(r.info.run_id, "train/lr")]
        for r in (client.get_run(plain.run_id), client.get_run(shrunk.run_id))
    }
    assert lr[plain.run_id] == pytest.approx(lr[shrunk.run_id]) and len(lr[plain.run_id]) == 8
    assert lr[plain.run_id][0] < 0.01 and lr[plain.run_id] == sorted(lr[plain.run_id], reverse=True)  # decays
    for a, b in zip(plain.model.state_dict().values(), shrunk.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class TwoArgs(torch.optim.SGD):
    def step(self, closure=None, *, scale):  # a step the pipeline has nothing to give
        return super().step(closure)


class Needy:
    def __init__(self, optimizer, step_size):
        self.optimizer = optimizer

    def step(self, loss, accuracy):  # two values the pipeline has not
        pass

    def state_dict(self):
        return {}


def test_an_optimizer_or_schedule_whose_step_needs_arguments_is_refused_at_build() -> None:
    from pipeline.config import ConfigError

    optimizer = OptimizerConfig(f"{__name__}.TwoArgs", {"lr": 0.1})
    with pytest.raises(ConfigError, match=r"optimizer\._target_=.* TwoArgs\.step needs scale, which the pipeline"):
        build_optimizer(optimizer, params())
    schedule = SchedulerConfig(f"{__name__}.Needy", {"step_size": 2})
    with pytest.raises(ConfigError, match=r"scheduler\._target_=.* Needy\.step needs loss, accuracy"):
        build_scheduler(schedule, torch.optim.SGD(params(), lr=0.1), steps=3, epochs=1)


def test_a_schedule_stepped_per_epoch_moves_after_each_evaluation_only(make_cfg: MakeCfg) -> None:
    optimizer = torch.optim.SGD(params(), lr=1.0)
    cfg = make_cfg("scheduler=step", "scheduler.interval=epoch", "scheduler.step_size=1", "scheduler.gamma=0.5")
    schedule = build_scheduler(cfg.scheduler, optimizer, steps=100, epochs=3)
    for _ in range(5):
        schedule.after_step()  # an optimizer step: not this schedule's cadence
    assert optimizer.param_groups[0]["lr"] == 1.0
    schedule.after_evaluation({"val/loss": 1.0})
    assert optimizer.param_groups[0]["lr"] == 0.5
