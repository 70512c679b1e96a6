"""python -m pipeline.tune: the plan its probe's class implies, the search and the claim with a fake measurement and a
fake clock, the experiment file and the MLflow record, and one real run on a user's own project."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from pipeline.autotune import tuned
from pipeline.autotune.candidates import Candidate, Machine
from pipeline.autotune.changes import Probe, plan
from pipeline.autotune.search import CLEAR_LEAD, Settings, Unusable, search
from pipeline.autotune.tuning import Tuning, main
from pipeline.config import RunConfig, load
from project import REGRESSION, use_project

CPU = torch.device("cpu")
MACHINE = Machine(device_type="cpu", max_workers=2, resident_fits=True)


def probe(kind: str, *, input_pct: float = 0.0) -> Probe:
    return Probe(1000.0, input_pct, 0.0, 100.0 - input_pct, 0.0, 5.0, kind)


def names(candidates: list[Candidate]) -> list[str]:
    return [c.name or "loader" for c in candidates[1:]]


def test_an_input_bound_run_tries_loader_settings_only() -> None:
    found = plan(load(["device=cpu"]), probe("input-high", input_pct=40), MACHINE, device=CPU, input_dims=4)
    assert found.candidates[0] == Candidate(load(["device=cpu"]).loader)  # the user's configuration first
    assert set(names(found.candidates)) == {"loader"} and len(found.candidates) >= 3
    assert any(c.loader.resident for c in found.candidates)


def test_a_compute_bound_run_tries_amp_channels_last_and_compile_and_no_loader_setting() -> None:
    found = plan(load(["device=cpu"]), probe("compute"), MACHINE, device=CPU, input_dims=4)
    assert names(found.candidates) == ["amp", "channels_last", "compile"]
    assert found.candidates[1].overrides(found.candidates[0].loader) == ["amp=true"]


def test_channels_last_is_no_candidate_for_a_2d_input_and_a_moderately_input_bound_run_tries_both() -> None:
    found = plan(load(["device=cpu"]), probe("input-moderate", input_pct=8), MACHINE, device=CPU, input_dims=2)
    assert "channels_last" not in names(found.candidates)
    assert {"loader", "amp", "compile"} <= set(names(found.candidates))


def test_micro_batches_are_candidates_only_when_the_run_micro_batches() -> None:
    plain = plan(load(["device=cpu"]), probe("compute"), MACHINE, device=CPU, input_dims=2)
    assert not [n for n in names(plain.candidates) if n.startswith("micro")]
    cfg = load(["device=cpu", "loader.batch_size=64", "oom.micro_batch_size=8"])
    micro = [c for c in plan(cfg, probe("overhead"), MACHINE, device=CPU, input_dims=2).candidates if "micro" in c.name]
    assert [c.name for c in micro] == ["micro-batch=16", "micro-batch=32", "micro-batch=64"]
    assert micro[-1].config(cfg).oom.micro_batch_size == 64 and micro[-1].config(cfg).loader.batch_size == 64


def test_amp_the_device_cannot_autocast_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "pipeline.autotune.changes.autocast_unusable", lambda device: "bfloat16 autocast does not run on cpu here"
    )
    found = plan(load(["device=cpu"]), probe("compute"), MACHINE, device=CPU, input_dims=2)
    assert "amp" not in names(found.candidates)
    assert [(c.name, why) for c, why in found.skipped] == [("amp", "bfloat16 autocast does not run on cpu here")]


class Fake:
    """samples/s per candidate name from ``rates`` times noise drawn from ``spread``; a fake clock of 1 s a trial."""

    def __init__(self, rates: dict[str, float], *, spread: float = 0.0, fails: dict[str, str] | None = None) -> None:
        self.rates, self.spread, self.fails = rates, spread, fails or {}
        self.now, self.calls, self.draw = 0.0, 0, random.Random(0)

    def __call__(self, candidate: Candidate, *, steps: int, warmup: int) -> float:
        self.now += 1.0
        self.calls += 1
        if candidate.name in self.fails:
            raise Unusable(self.fails[candidate.name])
        return self.rates[candidate.name or "yours"] * (1 + self.draw.uniform(-self.spread, self.spread))


def run_search(fake: Fake, *, budget_s: float = 200, confirm: int = 6) -> tuple[tuple, object]:
    cfg = load(["device=cpu"])
    found = plan(cfg, probe("compute"), MACHINE, device=CPU, input_dims=4)
    settings = Settings(budget_s=budget_s, confirm=confirm, order_seed=1, runner_up=False)
    outcome = search(found.candidates, measure=fake, settings=settings, clock=lambda: fake.now)
    return tuned.claim(outcome), outcome


def test_no_gain_is_claimed_from_noise_alone() -> None:
    (winner, line), _ = run_search(Fake(dict.fromkeys(("yours", "amp", "channels_last", "compile"), 100.0), spread=0.1))
    assert winner is None and line.startswith("no change shown: keep your configuration")


def test_a_real_gain_is_claimed_with_its_interval() -> None:
    rates = {"yours": 100.0, "amp": 142.0, "channels_last": 90.0, "compile": 110.0}
    (winner, line), outcome = run_search(Fake(rates, spread=0.03))
    assert winner is not None and winner.name == "amp"
    gain = line.split("amp: ")[1].split(" your")[0]
    low, high = (float(x) for x in gain.split("[")[1].rstrip("]").split(", "))
    assert line.startswith("faster: amp: 1.4") and low <= 1.42 <= high and "x [" in line
    assert {t.candidate.name for t in outcome.confirmed} == {"amp", ""}  # best and yours only


class Lucky(Fake):
    """``Fake``, but ``lucky``'s first trials (the search's) read ``luck`` instead of its rate: a winner by noise."""

    def __init__(self, rates: dict[str, float], *, lucky: str, luck: list[float]) -> None:
        super().__init__(rates, spread=0.02)
        self.lucky, self.luck = lucky, list(luck)

    def __call__(self, candidate: Candidate, *, steps: int, warmup: int) -> float:
        value = super().__call__(candidate, steps=steps, warmup=warmup)
        return self.luck.pop(0) if candidate.name == self.lucky and self.luck else value


def search_with(fake: Fake, confirm: int = 8) -> tuple[tuple, object]:
    found = plan(load(["device=cpu"]), probe("compute"), MACHINE, device=CPU, input_dims=2)  # amp, compile
    settings = Settings(budget_s=200, confirm=confirm, order_seed=1, runner_up=False)
    outcome = search(found.candidates, measure=fake, settings=settings, clock=lambda: fake.now)
    return tuned.claim(outcome), outcome


def test_a_winner_by_noise_gives_way_to_a_runner_up_its_confirmation_rounds_show_faster() -> None:
    """amp is the search's fastest by luck (its real rate is yours); compile, 1.3x for real, comes second, the lead
    unclear: both are confirmed against yours, amp is not shown and compile is, at the runner-up's 0.01."""
    fake = Lucky({"yours": 100.0, "amp": 100.0, "compile": 130.0}, lucky="amp", luck=[150.0, 128.0, 150.0])
    (winner, line), outcome = search_with(fake)
    assert outcome.stop_reason != CLEAR_LEAD and outcome.ranking()[0].candidate.name == "amp"
    assert {t.candidate.name for t in outcome.confirmed} == {"amp", "compile", ""}
    assert winner is not None and winner.name == "compile"
    assert line.startswith("faster: compile: 1.3")
    assert "(paired over 8 confirmation rounds in random order, p=0.0078, below 0.01 as the runner-up; the " in line
    assert "the search's fastest, amp: 1.0" in line


def test_a_runner_up_needs_every_round_when_it_is_second_and_six_rounds_cannot_show_it() -> None:
    fake = Lucky({"yours": 100.0, "amp": 100.0, "compile": 130.0}, lucky="amp", luck=[150.0, 128.0, 150.0])
    (winner, line), outcome = search_with(fake, confirm=6)
    assert {t.candidate.name for t in outcome.confirmed} == {"amp", "compile", ""}
    assert winner is None and line.startswith("no change shown: keep your configuration (amp: ")


def test_a_clear_winner_is_confirmed_against_yours_alone_and_tested_at_the_whole_level() -> None:
    (winner, line), outcome = search_with(Fake({"yours": 100.0, "amp": 150.0, "compile": 110.0}, spread=0.02))
    assert outcome.stop_reason == CLEAR_LEAD
    assert {t.candidate.name for t in outcome.confirmed} == {"amp", ""}
    assert winner is not None and winner.name == "amp" and "runner-up" not in line


def test_a_candidate_that_fails_is_skipped_with_the_reason_in_its_row() -> None:
    rates = {"yours": 100.0, "amp": 120.0, "channels_last": 90.0, "compile": 0.0}
    _, outcome = run_search(Fake(rates, fails={"compile": "torch.compile is not available here"}))
    table = tuned.table(outcome)
    assert "compile: skipped: torch.compile is not available here" in table


def test_the_budget_is_respected_with_a_fake_clock() -> None:
    fake = Fake({"yours": 100.0, "amp": 120.0, "channels_last": 90.0, "compile": 110.0})
    _, outcome = run_search(fake, budget_s=9)
    assert outcome.elapsed_s <= 9 and fake.calls <= 9


def tuning(cfg: RunConfig, rates: dict[str, float]) -> Tuning:
    found = plan(cfg, probe("compute"), MACHINE, device=CPU, input_dims=2)
    fake = Fake(rates, spread=0.02)
    settings = Settings(budget_s=100, confirm=6, order_seed=1, runner_up=False)
    outcome = search(found.candidates, measure=fake, settings=settings, clock=lambda: fake.now)
    return Tuning(cfg, probe("compute"), found, outcome, "mlp-test", "cpu")


def test_the_experiment_file_composes_with_the_launch_and_the_command_line_restates_no_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    overrides = ["device=cpu", "experiment=ladder_cpu", "amp=false", "tracking=none"]
    result = tuning(load(overrides), {"yours": 100.0, "amp": 150.0, "compile": 90.0})
    tuned.conclude(result, overrides, config_dir=None, settings=Settings(budget_s=100))
    out = capsys.readouterr().out
    assert "  python -m pipeline device=cpu experiment=ladder_cpu tracking=none amp=true\n" in out
    path = tmp_path / "tuned" / "experiment" / "tuned_amp.yaml"
    assert f"experiment file: {Path('tuned/experiment/tuned_amp.yaml')}" in out
    assert "python -m pipeline --config-dir tuned device=cpu amp=false tracking=none experiment=tuned_amp" in out
    composed = load(
        ["device=cpu", "tracking=none", f"hydra.searchpath=[file://{path.parents[1]}]", "experiment=tuned_amp"]
    )
    assert composed.amp is True and composed.tracking.experiment == "ladder-cpu"  # on top of the launch's experiment
    assert composed.data.num_samples == 20000


def test_every_trial_is_a_nested_run_under_one_parent_that_compare_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.experiments.compare import report, select

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load(["device=cpu", f"tracking.uri={store}", "tracking.experiment=pipeline-tune"])
    result = tuning(cfg, {"yours": 100.0, "amp": 150.0, "compile": 90.0})
    tuned.conclude(result, ["device=cpu"], config_dir=None, settings=Settings(budget_s=100))
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("pipeline-tune").experiment_id
    (parent,) = client.search_runs([experiment], "tags.`sweep.role` = 'parent'")
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == len(result.outcome.trials) and parent.data.tags["tune.changes"] == "amp=true"
    amp = [c for c in children if c.data.tags["tune.candidate"] == "amp"]
    assert amp and all(c.data.params["amp"] == "True" and "throughput/samples_per_s" in c.data.metrics for c in amp)
    selection = select(client, "pipeline-tune")
    assert selection.parent is not None and selection.parent.id == parent.info.run_id
    assert len({r.tags["tune.candidate"] for r in selection.runs}) >= 2
    assert report(client, selection.runs, note=selection.note) is not None


SLOW = """
import time

from torch.utils.data import Dataset

import sets


class Slow(Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(0.0005)  # a decoder's worth of work, without the CPU
        return self.inner[i]


def make(n=2048):
    train, val = sets.make(n)
    return Slow(train), Slow(val)
"""


@pytest.mark.slow  # about 12 s: a real tune with its builds, its 8 confirmation rounds and MLflow
def test_a_users_own_project_ends_with_a_command_line_an_experiment_file_and_a_parent_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    project = use_project(tmp_path / "project", monkeypatch)
    monkeypatch.chdir(project)
    (project / "hooks.py").write_text(
        "def step(model, batch, ctx):\n    x, y = batch\n    return ctx.loss(model(x), y)\n"
    )
    (project / "slow.py").write_text(SLOW)
    (project / "conf" / "experiment").mkdir(parents=True)
    store = f"sqlite:///{project / 'mlflow.db'}"
    overrides = [
        *REGRESSION,
        "data._target_=slow.make",
        "step=custom",
        "step._target_=hooks.step",
        "device=cpu",
        f"tracking.uri={store}",
    ]
    overrides += ["loader.batch_size=16"]
    argv = [*overrides, "--budget-s", "25", "--steps", "4", "--warmup", "1", "--config-dir", "conf"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "\nfaster: " in out, out  # a dataset that sleeps: loader workers or resident data win
    (path,) = (project / "conf" / "experiment").glob("tuned_*.yaml")
    assert f"experiment file: {Path('conf/experiment') / path.name}" in out
    assert "  python -m pipeline --config-dir conf model=custom" in out
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("pipeline-tune").experiment_id
    (parent,) = client.search_runs([experiment], "tags.`sweep.role` = 'parent'")
    assert parent.info.status == "FINISHED" and parent.data.tags["tune.changes"] != "none: keep your configuration"
    assert client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
