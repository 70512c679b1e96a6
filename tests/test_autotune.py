"""The loader tuner: its search with a fake measurement and a fake clock, its candidates, and one real run."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import types
from collections.abc import Callable

import psutil
import pytest

from pipeline import autotune
from pipeline.autotune import Candidate, Machine, Settings, candidates, format_report, override_line, tune
from pipeline.common.errors import PipelineError
from pipeline.config import RunConfig, load
from pipeline.data import DataSpec

DEFAULT = load([]).loader  # conf/loader/default.yaml, as a run composes it
CPU4 = Machine(device_type="cpu", max_workers=4, resident_fits=False)


def workers(candidate: Candidate) -> tuple[int, int]:
    """(num_workers, effective prefetch_factor), (-1, 0) for resident: what the fakes below price."""
    loader = candidate.loader
    if loader.resident:
        return -1, 0
    return loader.num_workers, (loader.prefetch_factor or 2) if loader.num_workers else 0


class FakeMeasure:
    """Known samples/s per (workers, prefetch), times a per-candidate cycle of round factors; every call logged."""

    def __init__(self, rates: dict[tuple[int, int], float], factors: tuple[float, ...] = (1.0,)) -> None:
        self.rates, self.factors = rates, factors
        self.events: list[tuple[str, Candidate]] = []
        self.seen: dict[Candidate, int] = {}

    @property
    def calls(self) -> list[Candidate]:
        return [c for kind, c in self.events if kind == "measure"]

    def __call__(self, candidate: Candidate, *, steps: int, warmup: int) -> float:
        self.events.append(("measure", candidate))
        n = self.seen.get(candidate, 0)
        self.seen[candidate] = n + 1
        return self.rates[workers(candidate)] * self.factors[n % len(self.factors)]

    def release(self, candidate: Candidate) -> None:
        self.events.append(("release", candidate))


def test_tuner_picks_the_measured_fastest_candidate_and_says_by_how_much() -> None:
    fake = FakeMeasure({(0, 0): 100, (1, 2): 150, (2, 2): 300, (4, 2): 200, (2, 4): 240})
    outcome = tune(DEFAULT, measure=fake, machine=CPU4, settings=Settings(rounds=3), release=fake.release)

    winner = outcome.ranking()[0].candidate.loader
    assert (winner.num_workers, winner.prefetch_factor, winner.persistent_workers) == (2, 2, True)
    assert [workers(t.candidate) for t in outcome.ranking()] == [(2, 2), (2, 4), (4, 2), (1, 2), (0, 0)]
    assert outcome.rounds == 2 and outcome.stop_reason == "the leader's slowest round beat the runner-up's fastest"
    report = format_report(outcome, [], title="test")
    assert (
        "fastest: workers=2: +200% [+200% to +200%] on your current setting (300 vs 100 samples/s), p=0.031, paired "
        "over 6 confirmation rounds run after the search chose it; +25% [+25% to +25%] on workers=2 prefetch=4 (240 "
        "samples/s)" in report
    )
    assert "  python -m pipeline loader.num_workers=2 loader.persistent_workers=true loader.prefetch_factor=2" in report


def test_rounds_alternate_their_order() -> None:
    rates = {(0, 0): 100, (1, 2): 100, (2, 2): 110, (4, 2): 120, (4, 4): 118}
    fake = FakeMeasure(rates, factors=(1.0, 1.1, 0.95))  # ranges overlap: no early stop
    settings = Settings(rounds=3, confirm=3)
    outcome = tune(DEFAULT, measure=fake, machine=CPU4, settings=settings, release=fake.release)

    first = [(0, 0), (1, 2), (2, 2), (4, 2), (4, 4)]  # current, the ladder, then prefetch 4 for the best workers
    confirm = [(4, 2), (0, 0), (4, 4)]  # then the winner, the current setting and the runner-up, three times
    assert [workers(c) for c in fake.calls] == first + first[::-1] + first + confirm + confirm[::-1] + confirm
    assert outcome.rounds == 3 and outcome.stop_reason == "all 3 round(s) done"
    assert "noisy" not in format_report(outcome, [], title="test")  # rounds within 1.1 / 0.95 = 1.16x
    assert all(len(t.by_round) == 3 for t in outcome.tallies)


def test_clearly_slow_candidates_are_dropped_and_released_before_the_next_round() -> None:
    rates = {(0, 0): 40, (1, 2): 100, (2, 2): 105, (4, 2): 110, (4, 4): 108}
    fake = FakeMeasure(rates, factors=(1.0, 1.1, 0.95))
    outcome = tune(DEFAULT, measure=fake, machine=CPU4, settings=Settings(rounds=3, confirm=0), release=fake.release)

    slow = next(t for t in outcome.tallies if workers(t.candidate) == (0, 0))
    assert list(slow.by_round) == [1]  # 40 < 50% of 110 after round 1
    assert slow.stopped == "dropped after round 1: best round under 50% of the leader's median"
    released = fake.events.index(("release", slow.candidate))
    second_round = [i for i, (kind, _) in enumerate(fake.events) if kind == "measure"][5]
    assert released < second_round
    assert [workers(c) for c in fake.calls].count((0, 0)) == 1
    assert "workers=0 (current)" in format_report(outcome, [], title="test")  # still reported


def test_rounds_that_disagree_earn_a_warning() -> None:
    rates = {(0, 0): 100, (1, 2): 100, (2, 2): 110, (4, 2): 120, (4, 4): 118}
    fake = FakeMeasure(rates, factors=(1.0, 2.0, 1.0))  # a busy machine doubled every second round
    outcome = tune(DEFAULT, measure=fake, machine=CPU4, settings=Settings(rounds=3), release=fake.release)
    report = format_report(outcome, [], title="test")
    assert "noisy: some candidate's rounds differed by 10% or more (other work on this machine?)" in report
    assert "noisy: the confirmation rounds disagreed by 10% or more" in report


def test_the_plot_draws_each_worker_setting_resident_and_the_current_one() -> None:
    fake = FakeMeasure({(-1, 0): 300, (0, 0): 100, (1, 2): 150, (2, 2): 200, (4, 2): 260, (4, 4): 250})
    machine = Machine(device_type="cpu", max_workers=4, resident_fits=True)
    outcome = tune(DEFAULT, measure=fake, machine=machine, settings=Settings(rounds=1))

    (ax,) = autotune.workers_figure(outcome, title="t").axes
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [
        "DataLoader",
        "current",
        "prefetch=4",
        "resident",
    ]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "4"]


def test_worker_ladder_stops_at_a_plateau() -> None:
    rates = {(0, 0): 100, (1, 2): 150, (2, 2): 200, (4, 2): 203, (8, 2): 205, (16, 2): 206, (4, 4): 190}
    fake = FakeMeasure(rates)
    machine = Machine(device_type="cpu", max_workers=16, resident_fits=False)
    outcome = tune(DEFAULT, measure=fake, machine=machine, settings=Settings(rounds=1, confirm=0), release=fake.release)

    assert sorted({workers(c)[0] for c in fake.calls}) == [0, 1, 2, 4]
    skipped = {t.candidate.loader.num_workers: t.stopped for t in outcome.tallies if not t.measured}
    assert skipped == {
        8: "not measured: 4 workers gained +1.5% over 2 (plateau)",
        16: "not measured: 4 workers gained +1.5% over 2 (plateau)",
    }


def test_budget_is_respected_with_a_fake_clock() -> None:
    now = [0.0]

    def slow_measure(candidate: Candidate, *, steps: int, warmup: int) -> float:
        now[0] += 10.0  # every trial takes 10 s
        return 100.0 * (1 + candidate.loader.num_workers)

    settings = Settings(budget_s=45, rounds=3, confirm=0)
    outcome = tune(DEFAULT, measure=slow_measure, machine=CPU4, settings=settings, clock=lambda: now[0])

    assert now[0] == 40.0  # a fifth trial would have ended at 50 s
    assert outcome.cut_short and outcome.rounds == 1 and sum(len(t.by_round) for t in outcome.tallies) == 4
    assert (
        outcome.stop_reason
        == "cut short: the next trial (about 10.0 s) would have passed the search's 45 s of the 45 s budget"
    )
    report = format_report(outcome, [], title="test")
    assert "cut short by the time budget" in report and "workers=4 prefetch=4: not measured: time budget" in report
    assert "fastest in the search: workers=4 (not confirmed: no confirmation rounds were asked for" in report


def test_a_quarter_of_the_budget_is_kept_for_the_confirmation_rounds() -> None:
    now = [0.0]

    def slow_measure(candidate: Candidate, *, steps: int, warmup: int) -> float:
        now[0] += 10.0
        return 100.0 * (1 + candidate.loader.num_workers)

    settings = Settings(budget_s=100, rounds=3, confirm=2)
    outcome = tune(DEFAULT, measure=slow_measure, machine=CPU4, settings=settings, clock=lambda: now[0])
    searched = [t for t in outcome.trials if not t.confirm]
    assert len(searched) == 7 and outcome.cut_short  # 7 x 10 s <= 75 s: the search's three quarters
    confirmed = [t for t in outcome.trials if t.confirm]
    assert len(confirmed) == 3 and now[0] == 100.0  # one whole round of the three finalists fits the rest
    assert [len(t.by_round) for t in outcome.confirmed] == [1, 1, 1]


def test_a_budget_spent_before_the_first_trial_times_nothing() -> None:
    fake = FakeMeasure({})
    outcome = tune(DEFAULT, measure=fake, machine=CPU4, settings=Settings(budget_s=10), clock=lambda: 20.0, started=0)
    assert fake.calls == [] and outcome.cut_short and outcome.ranking() == []
    assert "nothing was measured: the budget ran out before the first trial" in format_report(outcome, [], title="t")


def batch_priced(rates: dict[int, float], oom_above: int) -> tuple[FakeMeasure, Callable[..., float]]:
    """A fake whose samples/s follow the batch size, out of memory above ``oom_above``."""
    fake = FakeMeasure({})

    def measure(candidate: Candidate, *, steps: int, warmup: int) -> float:
        fake.events.append(("measure", candidate))
        if candidate.loader.batch_size > oom_above:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return rates[candidate.loader.batch_size] - candidate.loader.num_workers  # fewer workers win

    return fake, measure


def test_batch_size_search_keeps_the_largest_that_fits() -> None:
    fake, measure = batch_priced({64: 50, 128: 100, 256: 200, 512: 400}, oom_above=256)
    settings = Settings(rounds=1, search_batch_size=True)
    outcome = tune(DEFAULT, measure=measure, machine=CPU4, settings=settings, release=fake.release)

    assert outcome.batch_sizes == [(128, 100.0), (256, 200.0), (512, None)] and outcome.batch_size == 256
    searched = [c for c in fake.calls if not c.oom_fallback]
    assert [c.loader.batch_size for c in searched] == [128, 256, 512]
    assert all(("release", c) in fake.events for c in searched)  # each freed before the next size
    assert outcome.current.loader.batch_size == 64  # the current setting is timed as it is
    assert {t.candidate.loader.batch_size for t in outcome.tallies if t.candidate != outcome.current} == {256}
    report = format_report(outcome, [], title="test")
    assert "batch sizes tried (micro-batch fallback off): 128: 100/s, 256: 200/s, 512: out of memory; kept 256" in (
        report
    )
    assert "  python -m pipeline loader.num_workers=0 loader.batch_size=256\n" in report


def test_batch_size_search_stops_when_a_doubling_no_longer_pays() -> None:
    fake, measure = batch_priced({64: 50, 128: 100, 256: 150, 512: 152, 1024: 300}, oom_above=4096)
    settings = Settings(rounds=1, search_batch_size=True)
    outcome = tune(DEFAULT, measure=measure, machine=CPU4, settings=settings, release=fake.release)

    assert outcome.batch_sizes == [(128, 100.0), (256, 150.0), (512, 152.0)]  # +1.3% for 512: the search ends
    assert outcome.batch_size == 512


def test_batch_size_search_raises_errors_that_are_not_out_of_memory() -> None:
    def broken(candidate: Candidate, *, steps: int, warmup: int) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        tune(DEFAULT, measure=broken, machine=CPU4, settings=Settings(search_batch_size=True))


def test_worker_limit_follows_the_cpus_and_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert autotune.worker_limit() == 4
    found = candidates(DEFAULT, Machine("cpu", autotune.worker_limit(), resident_fits=False))
    assert [c.loader.num_workers for c in found] == [0, 1, 2, 4]

    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows: the CPU count
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert autotune.worker_limit() == 6 and autotune.worker_ladder(6) == [0, 1, 2, 4, 6]

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(PipelineError, match="LOCAL_WORLD_SIZE='0' is not allowed: expected a positive integer"):
        autotune.worker_limit()


def test_pinned_memory_is_a_candidate_on_cuda_only() -> None:
    cpu = candidates(DEFAULT, Machine("cpu", max_workers=2, resident_fits=True))
    assert [(c.loader.resident, c.loader.num_workers, c.loader.pin_memory) for c in cpu] == [
        (False, 0, "auto"),
        (True, 0, "auto"),
        (False, 1, "auto"),
        (False, 2, "auto"),
    ]
    cuda = candidates(DEFAULT, Machine("cuda", max_workers=2, resident_fits=False))
    assert [(c.loader.num_workers, c.loader.pin_memory) for c in cuda] == [
        (0, "auto"),  # the current setting: auto pins on CUDA
        (0, False),
        (1, "auto"),
        (1, False),
        (2, "auto"),
        (2, False),
    ]
    assert all(c.loader.persistent_workers == (c.loader.num_workers > 0) for c in cuda)


def test_resident_is_tried_when_the_dataset_takes_at_most_half_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = DataSpec(  # a built-in source: 1,000 x (100 uint8 pixels + an int64 label) bytes
        "synthetic", (1, 10, 10), 10, 900, 100, mean=(0.5,), std=(0.25,), source="test", digest="0" * 8
    )
    assert spec.resident_bytes == 108_000
    cpu = types.SimpleNamespace(type="cpu")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=216_000))
    assert autotune.resident_fits(spec, cpu)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=215_999))
    assert not autotune.resident_fits(spec, cpu)


@pytest.mark.parametrize(
    ("overrides", "change"),
    [
        ([], {"num_workers": 4, "persistent_workers": True, "prefetch_factor": 2}),
        (
            ["loader=workers", "data=synthetic"],
            {"resident": True, "num_workers": 0, "persistent_workers": False, "prefetch_factor": None, "timeout": 0.0},
        ),
        (["loader.num_workers=4", "loader.batch_size=32"], {"num_workers": 2, "pin_memory": False, "batch_size": 128}),
    ],
)
def test_the_printed_command_composes_to_the_winning_loader(overrides: list[str], change: dict[str, object]) -> None:
    current = load(overrides).loader
    winner = dataclasses.replace(current, **change)
    line = override_line(overrides, current, winner)
    assert line.startswith("python -m pipeline ")
    assert load(shlex.split(line)[3:]).loader == winner
    assert shlex.split(line).count(f"loader.num_workers={winner.num_workers}") == 1


def test_flags_are_checked_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        autotune.main(["--warmup", "0"])
    assert info.value.code == 2
    assert "--warmup must be >= 1: the step timer always leaves out a trial's first step" in capsys.readouterr().err


@pytest.mark.parametrize("persistent", [True, False])
def test_persistent_workers_live_across_trials_until_released(
    make_cfg: Callable[..., RunConfig], persistent: bool
) -> None:
    cfg = make_cfg("loader.num_workers=1", f"loader.persistent_workers={str(persistent).lower()}")
    trials = autotune.Trials(cfg)
    candidate = Candidate(cfg.loader)
    earlier = set(psutil.Process().children())  # an earlier test's helpers (multiprocessing's resource tracker)
    try:
        assert trials.measure(candidate, steps=3, warmup=1) > 0
        alive = [p for p in psutil.Process().children() if p not in earlier]
        assert len(alive) == (1 if persistent else 0)  # a non-persistent loader's worker stops with its trial
        assert trials.measure(candidate, steps=3, warmup=1) > 0
        # the same worker, kept as training keeps it across epochs: the epoch goes on at the next trial
        assert [p for p in psutil.Process().children() if p not in earlier] == alive
    finally:
        trials.close()
    assert [
        p for p in psutil.Process().children() if p not in earlier
    ] == []  # close() released every live candidate's workers


def test_autotune_times_the_real_step_and_records_its_run(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow import MlflowClient

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # workers 0 and 1 only
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["device=cpu", f"tracking.uri={store}", "--steps", "3", "--warmup", "1", "--rounds", "1"]
    assert autotune.main(args) == 0
    out = capsys.readouterr().out

    assert "workers=0 (current)" in out and "workers=1" in out and "workers=2" not in out
    (command,) = [line.strip() for line in out.splitlines() if line.strip().startswith("python -m pipeline ")]
    assert command.startswith(f"python -m pipeline device=cpu tracking.uri={store} loader.num_workers=")
    client = MlflowClient(store)
    assert [e.name for e in client.search_experiments()] == ["pipeline-autotune", "Default"]  # never `pipeline`
    experiment = client.get_experiment_by_name("pipeline-autotune").experiment_id
    (run,) = client.search_runs(experiment_ids=[experiment], filter_string="tags.autotune = 'true'")
    assert run.info.run_name == "autotune-mlp-digits-cpu-bs64-w0" and run.info.status == "FINISHED"
    assert run.data.tags["autotune.command"] == command  # what was printed, after the confirmation rounds
    assert run.data.metrics["autotune/best_samples_per_s"] > 0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "autotune")}
    assert artifacts == {"autotune/workers.png", "autotune/report.txt", "autotune/trials.json"}


class Lucky(FakeMeasure):
    """Each candidate's true rate, but ``lucky``'s first ``times`` trials come out 50% faster (the noise that made
    it win the search)."""

    def __init__(self, rates: dict[tuple[int, int], float], lucky: tuple[int, int], times: int) -> None:
        super().__init__(rates)
        self.lucky, self.times = lucky, times

    def __call__(self, candidate: Candidate, *, steps: int, warmup: int) -> float:
        value = super().__call__(candidate, steps=steps, warmup=warmup)
        return value * 1.5 if workers(candidate) == self.lucky and self.seen[candidate] <= self.times else value


def test_the_claimed_gain_comes_from_fresh_rounds_after_the_search_not_the_ones_that_chose() -> None:
    fake = Lucky({(0, 0): 100, (1, 2): 100, (2, 2): 110, (4, 2): 105, (2, 4): 104}, lucky=(2, 2), times=2)
    outcome = tune(DEFAULT, measure=fake, machine=CPU4, settings=Settings(rounds=2), release=fake.release)
    chosen = outcome.ranking()[0]
    assert workers(chosen.candidate) == (2, 2) and chosen.median == 165  # the search saw +65%
    assert outcome.confirmation(chosen.candidate).median == 110  # the fresh rounds see its true rate
    report = format_report(outcome, [], title="t")
    assert "fastest: workers=2: +10% [+10% to +10%] on your current setting (110 vs 100 samples/s)" in report
    assert "+65%" in report.split("fastest:")[0]  # the search's table keeps its own numbers


def test_a_winner_no_faster_in_the_confirmation_rounds_leaves_the_current_setting() -> None:
    fake = Lucky({(0, 0): 100, (1, 2): 90, (2, 2): 98, (4, 2): 95, (2, 4): 96}, lucky=(2, 2), times=2)
    outcome = tune(DEFAULT, measure=fake, machine=CPU4, settings=Settings(rounds=2), release=fake.release)
    report = format_report(outcome, [], title="t")
    assert "keep your current setting: the search's fastest, workers=2, was not shown faster in the confirmation" in (
        report
    )
    assert report.rstrip().endswith("python -m pipeline loader.num_workers=0")
    assert autotune.suggestion(outcome) == outcome.current  # what the tuning run's autotune.command tag holds


def test_vs_current_is_the_ratio_of_the_medians_the_table_prints() -> None:
    """The current setting ran one round, the others three: the old per-round pairing printed +88% beside
    13,878 against 519 samples/s. Now every percentage is the ratio of the two medians shown."""
    fake = FakeMeasure({(0, 0): 519, (1, 2): 13_878, (2, 2): 13_000, (4, 2): 12_000, (1, 4): 13_500}, (1.0, 0.5, 1.0))
    outcome = tune(DEFAULT, measure=fake, machine=CPU4, settings=Settings(rounds=3, confirm=0), release=fake.release)
    lines = [re.split(r"\s{2,}", line) for line in autotune.table(outcome).splitlines()[1:] if "=" in line]
    rows = {cells[0].split()[0]: cells for cells in lines if len(cells) == 6}  # not the "not measured" notes
    current = float(rows["workers=0"][1].replace(",", ""))
    for name, cells in rows.items():
        if name != "workers=0" and cells[-2] != "—":
            median = float(cells[1].replace(",", ""))
            assert cells[-2] == autotune.report.pct(median / current - 1), name


def test_no_timed_batch_was_made_before_its_trial_began(
    make_cfg: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers with prefetch 2 fill a queue of four batches while another candidate is timed; each sample's
    making time (CLOCK_MONOTONIC, the same in the workers) rides in its pixels, and every timed batch's must follow
    the start of its trial."""
    import struct
    import time

    import torch

    import pipeline.engine.building.build
    import pipeline.engine.hot.loop
    from pipeline.data.sources import tensor_bundle

    class Stamped(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 512

        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            image = torch.zeros(1, 8, 8, dtype=torch.uint8)
            image.view(-1)[:8] = torch.frombuffer(bytearray(struct.pack("d", time.monotonic())), dtype=torch.uint8)
            return image, index % 10

    def load_data(cfg, **kwargs):  # the digits' shape, with samples that say when they were made
        bundle = tensor_bundle(
            "stamped", train=(torch.zeros(8, 1, 8, 8, dtype=torch.uint8), torch.zeros(8, dtype=torch.long)),
            val=(torch.zeros(8, 1, 8, 8, dtype=torch.uint8), torch.zeros(8, dtype=torch.long)),
            num_classes=10, source="test",
        )  # fmt: skip
        bundle.train = Stamped()
        return bundle

    timed_made: list[tuple[int, list[float]]] = []  # per timed call: its trial, when each timed batch was made
    starts: list[float] = []
    real_train_epoch = pipeline.engine.hot.loop.train_epoch

    def train_epoch(state, batches, **kwargs):
        timed = kwargs["max_steps"] - state.step == 3 + 1  # the trial's timed call (steps=3, plus its first)
        made: list[float] = []

        def watched():
            for n, (images, labels) in enumerate(batches):
                if timed and n > 0:  # the timer leaves a call's first step out
                    made.append(min(struct.unpack("d", bytes(img.view(-1)[:8].tolist()))[0] for img in images))
                yield images, labels

        try:
            return real_train_epoch(state, watched(), **kwargs)
        finally:
            if timed:
                timed_made.append((len(starts) - 1, made))

    monkeypatch.setattr(pipeline.engine.building.build, "load_data", load_data)
    monkeypatch.setattr(pipeline.engine.hot.loop, "train_epoch", train_epoch)
    cfg = make_cfg("loader.num_workers=2", "loader.prefetch_factor=2", "loader.persistent_workers=true")
    trials = autotune.Trials(cfg)
    with_workers, without = Candidate(cfg.loader), Candidate(dataclasses.replace(cfg.loader, num_workers=0,
                                                                                   persistent_workers=False,
                                                                                   prefetch_factor=None))  # fmt: skip
    try:
        for candidate in (with_workers, without, with_workers):  # round 1, another candidate, round 2
            time.sleep(0.3)  # room for the workers to fill their queue, as another candidate's trial gives them
            starts.append(time.monotonic())
            trials.measure(candidate, steps=3, warmup=2)
    finally:
        trials.close()
    assert {trial for trial, _ in timed_made} == {0, 1, 2} and all(len(made) == 3 for _, made in timed_made)
    for trial, made in timed_made:
        assert min(made) > starts[trial], (trial, starts[trial], made)
    assert autotune.queue_depth(cfg.loader) == 4 and autotune.queue_depth(cfg.loader, prefetched=True) == 5


WORKERS2 = Candidate(dataclasses.replace(DEFAULT, num_workers=2, persistent_workers=True, prefetch_factor=2))


def confirmed_outcome(winner: list[float], current: list[float]) -> autotune.Outcome:
    """An outcome whose search chose workers=2 and whose confirmation rounds gave these samples/s, round by round."""
    now = Candidate(DEFAULT)
    rounds = lambda values: dict(enumerate(values, start=1))  # noqa: E731
    return autotune.Outcome(
        current=now,
        tallies=[autotune.Tally(now, {1: 100.0}), autotune.Tally(WORKERS2, {1: 500.0})],
        rounds=1,
        stop_reason="all 1 round(s) done",
        cut_short=False,
        elapsed_s=10.0,
        budget_s=90.0,
        trials=[],
        batch_sizes=[],
        batch_size=DEFAULT.batch_size,
        confirmed=[autotune.Tally(WORKERS2, rounds(winner)), autotune.Tally(now, rounds(current))],
    )


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_winner_that_beat_the_current_setting_in_one_round_of_three_claims_no_gain(repeats: int) -> None:
    """Per-round ratios 5.3, 0.375, 0.94: the ratio of the medians said +50% (the issue saw +398%); the paired
    estimate over the rounds is not significant, so no gain is claimed and the current setting stays."""
    outcome = confirmed_outcome([530.0, 150.0, 94.0] * repeats, [100.0, 400.0, 100.0] * repeats)
    gain = autotune.confirmed_gain(outcome, WORKERS2, outcome.current)
    assert gain.test == "paired" and gain.pairs == 3 * repeats and gain.p >= 0.05
    assert autotune.suggestion(outcome) == outcome.current
    report = format_report(outcome, [], title="t")
    assert "+50%" not in report and "fastest: workers=2" not in report
    assert "keep your current setting: the search's fastest, workers=2, was not shown faster" in report
    assert f"paired over {3 * repeats} confirmation rounds" in report and ": not shown" in report
    if repeats == 1:
        assert "3 rounds cannot show a difference: use --confirm 6 or more" in report
    assert report.rstrip().endswith("python -m pipeline loader.num_workers=0")


def test_a_winner_faster_in_every_one_of_six_rounds_claims_the_paired_estimate_and_its_interval() -> None:
    outcome = confirmed_outcome([300.0, 330.0, 290.0, 310.0, 320.0, 305.0], [100.0, 105.0, 98.0, 101.0, 99.0, 102.0])
    gain = autotune.confirmed_gain(outcome, WORKERS2, outcome.current)
    assert gain.test == "paired" and gain.p == pytest.approx(1 / 32)  # all six rounds one way: 2 / 2**6
    assert autotune.suggestion(outcome) == WORKERS2
    report = format_report(outcome, [], title="t")
    low, high = autotune.report.pct(gain.low - 1), autotune.report.pct(gain.high - 1)
    assert f"fastest: workers=2: {autotune.report.pct(gain.ratio - 1)} [{low} to {high}] on your current setting" in (
        report
    )
    assert "p=0.031, paired over 6 confirmation rounds run after the search chose it" in report
    assert "python -m pipeline loader.num_workers=2" in report
