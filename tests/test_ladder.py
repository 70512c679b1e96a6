"""The optimisation ladder: an experiment config plus a sweep; its plan composes, step by step, cumulatively."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from pipeline.config import config_dir, load, sweep_jobs


def ladder_plan(experiment: str) -> list[list[str]]:
    """The jobs ``python -m pipeline -m experiment=<experiment>`` runs, from the sweep its config declares."""
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    jobs = sweep_jobs([f"experiment={experiment}", *(f"{key}={value}" for key, value in params.items())])
    assert jobs, "the ladder's sweep could not be listed"
    return jobs


def steps(jobs: list[list[str]]) -> list[str]:
    """The ladder's steps in the order the jobs run them (each round's order is drawn at random)."""
    return list(dict.fromkeys(o.split("=", 1)[1] for job in jobs for o in job if o.startswith("+ladder=")))


def ladder_steps(experiment: str) -> list[str]:
    """The steps in the order the ladder's file lists them: the order each builds on the ones before."""
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    return str(cfg.hydra.sweeper.params["+ladder"]).split(",")


def by_step(jobs: list[list[str]], order: list[str]) -> list[list[str]]:
    return sorted(jobs, key=lambda job: order.index(next(o for o in job if o.startswith("+ladder=")).split("=")[1]))


def test_the_cpu_ladder_composes_and_leaves_out_the_steps_with_no_cpu_meaning() -> None:
    jobs = ladder_plan("ladder_cpu")
    order = ladder_steps("ladder_cpu")
    assert order == ["baseline", "cpu1_resident", "cpu2_batch", "cpu3_amp", "cpu4_compile"]
    assert len(jobs) == 5 * 5  # five seeds a step: enough for a rank test over 4 comparisons, Holm-corrected
    assert all(sorted(steps(jobs[r : r + 5])) == sorted(order) for r in range(0, 25, 5))  # every step once a round
    assert {o for job in jobs[:5] for o in job if o.startswith("trainer.seed=")} == {"trainer.seed=1"}
    configs = [load(job) for job in by_step(jobs[:5], order)]  # round 1: one seed of each step
    assert [c.device.name for c in configs] == ["cpu"] * 5
    assert [(c.trainer.channels_last, c.loader.num_workers, c.loader.pin_memory) for c in configs] == [
        (False, 0, "auto")
    ] * 5  # no NHWC, no workers, no pinning: they mean nothing on a CPU
    # cumulative: each step keeps the ones before it
    assert [(c.loader.resident, c.loader.batch_size, c.amp, c.trainer.compile) for c in configs] == [
        (False, 64, False, False),
        (True, 64, False, False),
        (True, 256, False, False),
        (True, 256, True, False),
        (True, 256, True, True),
    ]


def test_the_gpu_ladder_follows_the_steps_dependencies() -> None:
    jobs = ladder_plan("ladder_gpu")
    order = ladder_steps("ladder_gpu")
    assert sorted(steps(jobs)) == sorted(order)
    assert len(jobs) == 7 * 6  # six seeds a step: Holm over 6 comparisons leaves 5 vs 5 (p >= 0.0079) no margin
    assert order[0] == "baseline" and order.index("gpu1_amp") < order.index("gpu2_channels_last")  # NHWC after AMP
    configs = {step: load(["experiment=ladder_gpu", f"+ladder={step}"]) for step in order}  # composing needs no GPU
    assert configs["gpu2_channels_last"].amp and configs["gpu2_channels_last"].trainer.channels_last
    assert configs["gpu3_workers"].loader.num_workers == 4 and configs["gpu3_workers"].loader.pin_memory is True
    assert configs["gpu4_resident"].loader.resident and configs["gpu4_resident"].loader.num_workers == 0
    assert configs["gpu6_batch"].trainer.compile and configs["gpu6_batch"].loader.batch_size == 512
    assert {c.device.name for c in configs.values()} == {"cuda"}


@pytest.mark.parametrize("experiment", ["ladder_cpu", "ladder_gpu"])
def test_every_ladder_file_opens_with_the_command_that_runs_it(experiment: str) -> None:
    files = [config_dir() / "experiment" / f"{experiment}.yaml", *sorted((config_dir() / "ladder").glob("*.yaml"))]
    for path in files:
        assert "python -m pipeline -m experiment=ladder_" in path.read_text().split("\n\n")[0], path


def test_the_ladder_headline_says_when_no_step_was_shown() -> None:
    from pipeline.experiments.compare import ComparedRun, build, table_markdown, table_terminal

    def run(i: int, step: str, speed: float) -> ComparedRun:
        metrics = {"throughput/samples_per_s": speed, "time/epoch_s": 1.0, "val/acc": 0.9}
        params = {"+ladder": step, "trainer.seed": str(i)}
        return ComparedRun(f"{step}{i}", f"ladder={step}", "FINISHED", params, metrics, {})

    noisy = [100.0, 140.0, 80.0, 120.0, 95.0]  # each step within the one before's noise
    runs = [run(i, step, v * (1 + 0.02 * k)) for k, step in enumerate(("a", "b", "c")) for i, v in enumerate(noisy)]
    table = build(runs, ladder=True)
    assert all(not line.vs_previous.real for line in table.lines[1:])
    for text in (table_markdown(table), table_terminal(table)):
        said = " ".join(text.split())
        assert "Ladder: 1.04× in all" in said
        assert "no step was shown to change the speed on its own: the totals may be noise" in said

    steady = [100.0, 101.0, 99.0, 100.5, 100.2]
    shown = build([run(i, s, v * 2**k) for k, s in enumerate(("a", "b")) for i, v in enumerate(steady)], ladder=True)
    said = " ".join(table_markdown(shown).split())
    assert "Ladder: 2.00× in all" in said and "1 of 1 step(s) shown" in said and "no step was shown" not in said
