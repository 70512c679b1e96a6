"""Sweeps whose repeats run round by round: the order, the rounds recorded, and a drifting machine that no longer
turns an A/A comparison into a "real" speed-up while a real 20% difference still shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

import pipeline.engine.hot.timing as timing_module
import pipeline.train
from helpers import LEAN, run_main
from pipeline.config import sweep_jobs
from pipeline.config.design import interleave
from pipeline.experiments.compare import ComparedRun, build
from pipeline.experiments.compare.selection import select

TINY = ["trainer.epochs=1", "trainer.max_steps=3", "loader.batch_size=32", "monitor.enabled=false", "device=cpu"]


def test_repeats_run_round_by_round_in_an_order_drawn_by_the_recorded_seed() -> None:
    axes = [("amp", ["amp=false", "amp=true"]), ("trainer.seed", ["trainer.seed=1", "trainer.seed=2"])]
    plan = interleave(axes, seed=3)
    assert plan.rounds == [0, 0, 1, 1] and plan.seed == 3
    assert [job[1] for job in plan.jobs] == ["trainer.seed=1"] * 2 + ["trainer.seed=2"] * 2
    assert all(sorted(j[0] for j in plan.jobs[r : r + 2]) == ["amp=false", "amp=true"] for r in (0, 2))
    assert interleave(axes, seed=3) == plan  # the same seed, the same order
    orders = {tuple(tuple(j) for j in interleave(axes, seed=s).jobs) for s in range(20)}
    assert len(orders) == 4  # each round's order is drawn: A B or B A, independently


def test_each_job_knows_its_configuration_in_the_order_typed_whatever_order_its_round_ran() -> None:
    """The table lists a sweep's configurations as typed (``sweep.config``): the first one typed is the baseline,
    a ladder's steps stay in order, though each round runs them in a drawn order."""
    axes = [("+ladder", [f"+ladder={s}" for s in "abcd"]), ("trainer.seed", ["trainer.seed=1", "trainer.seed=2"])]
    plan = interleave(axes, seed=5)
    assert [job[0] for job in plan.jobs] != [f"+ladder={s}" for s in "abcd"] * 2  # this seed reorders a round
    assert [job[0] for job in plan.jobs] == [f"+ladder={'abcd'[n]}" for n in plan.configs]
    assert sorted(plan.configs[:4]) == sorted(plan.configs[4:]) == [0, 1, 2, 3]


def periodic_a_a(seed: int, rounds: int = 6) -> Any:
    """An A/A sweep on a machine slowed 17% on jobs j mod 4 in {1, 2} (a disturbance recurring every 4 jobs)."""
    plan = interleave(
        [("arm", ["arm=a", "arm=b"]), ("trainer.seed", [f"trainer.seed={i}" for i in range(rounds)])], seed=seed
    )
    runs = [
        ComparedRun(
            f"r{job}", "x", "FINISHED", {"arm": o[0], "trainer.seed": o[1].split("=")[1]},
            {"throughput/samples_per_s": 1000 * (0.83 if job % 4 in (1, 2) else 1.0)},
            {"sweep.job": str(job), "sweep.id": "s", "sweep.round": str(plan.rounds[job])},
        )
        for job, o in enumerate(plan.jobs)
    ]  # fmt: skip
    return build(sorted(runs, key=lambda r: r.params["arm"]))


def test_a_disturbance_every_four_jobs_makes_no_real_difference_of_an_a_a_sweep() -> None:
    called = [periodic_a_a(seed).lines[1].vs_baseline.real for seed in range(200)]
    assert called.count(True) / len(called) <= 0.05  # the paired test's 2/64 = 3%, not every time


def test_a_real_twenty_percent_difference_under_a_step_change_with_four_seeds_is_still_shown() -> None:
    for seed in range(20):
        plan = interleave(
            [("arm", ["arm=a", "arm=b"]), ("trainer.seed", [f"trainer.seed={i}" for i in range(4)])], seed=seed
        )
        runs = [
            ComparedRun(
                f"r{job}", "x", "FINISHED", {"arm": o[0], "trainer.seed": o[1].split("=")[1]},
                {"throughput/samples_per_s": (1000 if o[0] == "arm=a" else 800) * (0.9 if job >= 4 else 1.0)},
                {"sweep.job": str(job), "sweep.id": "s", "sweep.round": str(plan.rounds[job])},
            )
            for job, o in enumerate(plan.jobs)
        ]  # fmt: skip
        versus = build(sorted(runs, key=lambda r: r.params["arm"])).lines[1].vs_baseline
        assert versus.real is True and versus.comparison.ratio == pytest.approx(0.8, rel=0.02)


def test_a_sweep_without_repeats_keeps_hydras_order_and_a_plain_override_rides_along() -> None:
    plan = interleave([("a", ["a=1", "a=2"]), ("b", ["b=x", "b=y"]), ("c", ["c=0"])], seed=0)
    assert plan.jobs == [["a=1", "b=x", "c=0"], ["a=1", "b=y", "c=0"], ["a=2", "b=x", "c=0"], ["a=2", "b=y", "c=0"]]
    assert plan.rounds == [None] * 4
    plus = interleave([("+repeat", ["+repeat=1", "+repeat=2"]), ("a", ["a=1", "a=2"])], seed=0)
    assert plus.rounds == [0, 0, 1, 1] and plus.jobs[2][0] == "+repeat=2"


def test_the_checked_jobs_are_every_job_of_the_sweep() -> None:
    assert sorted(sweep_jobs(["loader.batch_size=32,64", "trainer.seed=1,2,3"])) == sorted(
        [f"loader.batch_size={b}", f"trainer.seed={s}"] for b in (32, 64) for s in (1, 2, 3)
    )


class DriftingMachine:
    """The step timer's clock (``time.perf_counter``) on a machine that slows 1% with every job: each reading
    advances ``tick`` seconds, ``tick`` grows by 1% a job, and a job with ``trainer.log_every_n_steps=101`` is slower by
    ``penalty`` (1.0: an A/A comparison). Deterministic: no real sleeping, no noise."""

    def __init__(self, penalty: float) -> None:
        self.penalty, self.jobs, self.now, self.tick = penalty, 0, 0.0, 0.001

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    def train(self, real: Any) -> Any:
        def drifting(cfg: Any, **kwargs: Any) -> Any:
            self.tick = 0.001 * 1.01**self.jobs * (self.penalty if cfg.trainer.log_every_n_steps == 101 else 1.0)
            self.jobs += 1
            return real(cfg, **kwargs)

        return drifting


def drifting_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, penalty: float) -> Any:
    """``-m trainer.log_every_n_steps=100,101 trainer.seed=1,2,3,4`` (the seed typed last, as the docs write
    sweeps, with the default sweeper): in 3 steps neither logs, so the two rows differ only by what the clock says."""
    machine = DriftingMachine(penalty)
    monkeypatch.setattr(timing_module, "time", machine)
    monkeypatch.setattr(pipeline.train, "train", machine.train(pipeline.train.train))
    store = tmp_path / f"drift-{penalty}.db"
    args = ["-m", "trainer.log_every_n_steps=100,101", "trainer.seed=1,2,3,4", *TINY, *LEAN]
    assert run_main(monkeypatch, *args, f"tracking.uri=sqlite:///{store}") == 0
    chosen = select(MlflowClient(f"sqlite:///{store}"))  # as python -m pipeline.compare chooses and orders them:
    return build(chosen.runs)  # rows in the order typed (the baseline log_every_n_steps=100), whatever order ran


@pytest.mark.slow
def test_a_drifting_machine_makes_no_real_difference_of_an_a_a_sweep_and_hides_no_real_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    a_a = drifting_sweep(monkeypatch, tmp_path, penalty=1.0)
    versus = a_a.lines[1].vs_baseline
    assert [r.round for r in a_a.lines[0].row.runs] == ["0", "1", "2", "3"]  # recorded: sweep.round
    assert sorted(int(r.job) // 2 for r in a_a.lines[0].row.runs) == [0, 1, 2, 3]  # one run in each round
    assert versus.real is False
    assert a_a.drift.real and a_a.drift.change == pytest.approx(1.01**-7 - 1, rel=1e-3)  # said, not hidden

    b_slower = drifting_sweep(monkeypatch, tmp_path, penalty=1.25)
    versus = b_slower.lines[1].vs_baseline
    assert versus.real is True and versus.comparison.ratio == pytest.approx(0.8, rel=0.02)
    assert versus.cell().startswith(f"{versus.comparison.ratio:.2f}× slower")  # 0.80 or 0.81: the drawn order

    # Hydra's own order, each configuration's four seeds back to back, on the same machine: the runs the basic
    # sweeper would have made (job j at 1000 x 0.99**j samples/s) make the A/A comparison "real"
    blocked = [
        ComparedRun(
            f"r{job}", "A" if job < 4 else "B", "FINISHED",
            {"trainer.log_every_n_steps": str(100 + job // 4), "trainer.seed": str(1 + job % 4)},
            {"throughput/samples_per_s": 1000 * 0.99**job}, {"sweep.job": str(job)},
        )
        for job in range(8)
    ]  # fmt: skip
    versus = build(blocked).lines[1].vs_baseline
    assert versus.real is True and versus.comparison.p == pytest.approx(2 / 70)  # what the design above prevents
