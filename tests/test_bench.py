"""The benchmark suite (``python -m bench`` from the checkout's root) runs end to end (a smoke run: tiny sizes; its
numbers are not checked), and stays out of the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.suite import BENCHES, main
from pipeline.common.stats import paired_ratio
from pipeline.gpucheck.harness import Row, Sizes, interleaved, table


def test_interleaving_alternates_order_drops_warmup_and_pairs_rounds() -> None:
    calls: list[str] = []
    durations = {"a": iter([100.0, 1.0, 3.0, 2.0]), "b": iter([100.0, 5.0, 4.0, 6.0])}

    def variant(name: str):
        def run() -> float:
            calls.append(name)
            return next(durations[name])

        return run

    times = interleaved({"a": variant("a"), "b": variant("b")}, Sizes(samples=1, repeats=3, warmup=1))
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert times == {"a": [1.0, 3.0, 2.0], "b": [5.0, 4.0, 6.0]}
    assert paired_ratio(times["a"], times["b"]) == pytest.approx(1 / 3)  # per-round ratios 0.2, 0.75, 1/3


def test_table_marks_goals_met_missed_and_informational() -> None:
    text = table(
        [
            Row("x", "1.0", ">= 0.98", True, "d"),
            Row("y", "0.5", ">= 3x", False, "e"),
            Row("z", "3 µs", "(info)", None, "f|g"),
        ]
    )
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines()]
    assert cells[0] == ["benchmark", "measured", "goal", "met", "detail"] and set(text.splitlines()[1]) == {"|", "-"}
    assert cells[2:] == [
        ["x", "1.0", ">= 0.98", "yes", "d"],
        ["y", "0.5", ">= 3x", "**no**", "e"],
        ["z", "3 µs", "(info)", "—", "f\\|g"],
    ]


def test_unknown_benchmark_names_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--only", "overhead,nope"])
    assert info.value.code == 2 and "unknown benchmark(s) ['nope']" in capsys.readouterr().err


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_non_positive_thread_counts_are_refused_in_one_line(capsys: pytest.CaptureFixture[str], threads: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--only", "overhead", "--threads", threads])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--threads must be >= 1" in err
    assert err.count("\n") == 1 and err.startswith("error: python -m bench: --threads must be >= 1")


ROWS = {  # each benchmark's rows in a --quick run (ddp: the next test runs its workers)
    "overhead": ["pipeline / bare loop, MLP, batch 64", "pipeline / bare loop, MLP, batch 512", "sampler on / off"],
    "sampler": ["sampler reading, psutil"],
    "resident": ["loader.resident=true vs the set-up recipe's DataLoader"],
    "launch": ["launch to first training step"],
    "amp": ["amp=true / float32 speed, MLP", "bf16 autocast / float32 speed, ResNet-50 step"],
    "amp_check": ["CPU amp check, the same config"],
    "compile": ["torch.compile, batch dimension static / dynamic up front"],
    "profile": ["trainer.profile=false / bare loop, MLP, batch 64", "trainer.profile=true / false, steady samples/s"],
    "autotune": ["autotune's claimed gain, reproduced in real runs"],
    "compare": [
        "compare / search_runs, 40 runs (10 rows), fresh processes",
        "compare / search_runs with the collector paused, 40 runs (10 rows), fresh processes",
    ],
    "mfu": ["MFU, 784-2048-2048-10 at batch 256 / the recipe's 784-512-10 at batch 64"],
    "tune": ["tune: time against an exhaustive sweep", "tune: its choice against the exhaustive best", "tune: its c"],
}


@pytest.mark.slow
def test_python_m_bench_runs_from_the_checkouts_root_as_a_thin_command(tmp_path: Path) -> None:
    """``bench/`` lives outside ``src/`` and the wheel: from the checkout's root ``python -m bench`` finds it, and its
    ``__main__`` only calls the suite's ``main``."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root / "src")  # this checkout's pipeline, whatever the environment installed
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m bench ") and "--only ONLY" in proc.stdout
    thin = (root / "bench" / "__main__.py").read_text()
    assert "from bench.suite import main" in thin and len(thin.splitlines()) <= 12


def test_every_benchmark_but_ddp_has_its_quick_rows_listed() -> None:
    assert set(ROWS) == set(BENCHES) - {"ddp"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ROWS))
def test_a_quick_run_of_each_benchmark_prints_its_rows(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One benchmark a test, so that two workers share the suite's smoke run."""
    assert main(["--quick", "--only", name]) == 0
    out = capsys.readouterr().out
    for row in ROWS[name]:
        assert f"| {row}" in out, row


def test_the_ddp_benchmark_times_both_loops_and_reports_their_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rounds, as each rank runs them (here a job of one rank joining and leaving twice), and the row."""
    from bench import ddp as bench_ddp
    from pipeline.gpucheck.harness import QUICK
    from servers import free_port

    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    # whole runs: a warm-up round and 2 more; then the loops in chunks, a warm-up round and 3 more
    assert bench_ddp.main(["512", "2", "1", "3", "64", "2", str(tmp_path / "ddp.json")]) == 0
    seconds = json.loads((tmp_path / "ddp.json").read_text())
    assert {kind: {side: len(s) for side, s in sides.items()} for kind, sides in seconds.items()} == {
        "run": {"textbook": 2, "pipeline": 2},
        "loop": {"textbook": 3, "pipeline": 3},
    }
    assert all(s > 0 for sides in seconds.values() for side in sides.values() for s in side)

    run = {"textbook": [2.0, 2.5], "pipeline": [2.5, 2.0]}  # per-round ratios 0.8 and 1.25
    loop = {"textbook": [1.0, 1.0, 1.0, 1.0], "pipeline": [1.0, 1.1, 1.0, 1.25]}  # 1, 1/1.1, 1, 0.8
    monkeypatch.setattr(bench_ddp, "run_job", lambda sizes, work: {"run": run, "loop": loop})
    looped, whole = bench_ddp.bench_ddp(Sizes(QUICK.samples, 2, 0), tmp_path)
    assert looped.name.startswith("DDP training loop / textbook DDP loop, 2 CPU ranks") and looped.goal == ">= 0.97"
    assert looped.measured == "0.955" and looped.met is False  # the median of 0.8, 0.909, 1, 1
    assert "50-step chunks, 4 rounds; middle half of per-round ratios 0.909–1.000" in looped.detail
    assert whole.name.startswith("DDP pipeline run / textbook DDP loop") and whole.measured == "1.025" and whole.met
    assert "2 rounds; middle half of per-round ratios 0.800–1.250" in whole.detail


def test_a_claimed_gain_holds_only_when_the_real_estimate_is_within_1_5x_of_it() -> None:
    """BENCHMARKS.md's row claimed +37% against +19% real and passed because the intervals overlapped."""
    from bench.claims import claim_holds
    from pipeline.common.stats import compare

    def real(ratio: float):
        base = [100.0, 102.0, 98.0, 101.0, 99.0, 100.0, 103.0]
        new = [b * ratio * (1 + 0.2 * (i % 2 - 0.5)) for i, b in enumerate(base)]  # a wide interval around it
        return compare(base, new, pairs=list(zip(base, new, strict=True)))

    wide = real(1.19)
    assert wide.high - 1 >= 0.37 / 1.5 and wide.low - 1 <= 0.37 * 1.5  # the old check: the interval reached it
    assert not claim_holds(1.37, wide)  # +19% is under +37% / 1.5 = +24.7%
    assert claim_holds(1.30, real(1.30)) and claim_holds(1.25, real(1.19))
    assert not claim_holds(0.9, real(0.9))  # a claim is never a slowdown
    assert claim_holds(None, real(1.0)) and not claim_holds(None, real(1.3))
