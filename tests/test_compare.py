"""``python -m pipeline.compare``: the arithmetic on known numbers, then end to end on a real SQLite store."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from pipeline.experiments import compare
from pipeline.experiments.compare import ComparedRun, CompareError, build, group, table_csv, table_markdown

BASE = {
    "model._target_": "pipeline.engine.models.mlp",
    "loader.batch_size": "64",
    "loader.num_workers": "0",
    "loader.resident": "false",
}
BASE |= {"data.name": "digits", "optimizer.lr": "0.01", "trainer.seed": "0", "amp": "false"}


def compared_run(
    run_id: str,
    samples_per_s: float | None = 1000.0,
    *,
    seed: int = 0,
    name: str | None = None,
    status: str = "FINISHED",
    epochs: int = 3,
    params: dict[str, str] | None = None,
    tags: dict[str, str] | None = None,
    **metrics: float,
) -> ComparedRun:
    """A run as ``search_runs`` would give it: ``epoch_s=`` and friends name metrics by their last part."""
    names = {"epoch_s": "time/epoch_s", "acc": "val/acc", "gpu": "gpu/util_mean_pct", "peak": "memory/max_allocated_mb"}
    names |= {"device_peak": "gpu/mem_peak_mb", "oom": "oom/events", "step_ms": "time/step_ms"}
    names |= {"wait": "time/data_wait_pct", "h2d": "time/h2d_pct", "compute": "time/compute_pct"}
    names |= {"own": "time/overhead_pct", "mfu": "perf/mfu_pct"}
    values = {names[k]: v for k, v in metrics.items()}
    if samples_per_s is not None:
        values.setdefault("time/epoch_s", 60000 / samples_per_s)
        values.setdefault("val/acc", 0.9)
        values["throughput/samples_per_s"] = samples_per_s
    all_params = {**BASE, "trainer.seed": str(seed), **(params or {})}
    all_tags = {"device.type": "cuda", "device.name": "NVIDIA H200", "precision": "fp32", "bottleneck": "compute"}
    return ComparedRun(
        id=run_id,
        name=name or f"mlp-bs{all_params['loader.batch_size']}",
        status=status,
        params=all_params,
        metrics=values,
        tags={**all_tags, **(tags or {})},
        steps={k: epochs for k in values},
        experiment_id="1",
    )


def repeats(prefix: str, values: list[float], **kwargs: Any) -> list[ComparedRun]:
    return [compared_run(f"{prefix}{i}", v, seed=i, **kwargs) for i, v in enumerate(values)]


# ---- rows ----


def test_seed_repeats_share_a_row_other_params_and_other_hardware_do_not() -> None:
    runs = [
        *repeats("a", [1000, 1010, 990]),
        compared_run("b0", 2000, params={"loader.batch_size": "128"}),
        compared_run("c0", 1500, tags={"device.name": "NVIDIA A100"}),  # same params, other GPU
        compared_run("a3", 1020, seed=3),
    ]
    rows = group(runs)
    assert [[r.id for r in row.runs] for row in rows] == [["a0", "a1", "a2", "a3"], ["b0"], ["c0"]]
    assert rows[0].speed().median == 1005


def test_runs_of_another_commit_local_changes_or_torch_are_another_row_and_the_table_says_so() -> None:
    code = {"mlflow.source.git.commit": "1a2b3c4d5e6f", "git.dirty": "false", "torch.version": "2.6.0"}
    changed = {**code, "git.dirty": "true", "git.diff": "9f8e7d6c"}
    runs = [
        *repeats("a", [100, 101, 102], tags=code),
        *repeats("b", [130, 131, 132], tags=changed),
        *repeats("c", [90, 91, 92], tags={**code, "torch.version": "2.7.0"}),
    ]
    table = build(runs)
    assert [line.row.n for line in table.lines] == [3, 3, 3]
    assert [line.row.name for line in table.lines] == [
        "mlp-bs64 @clean torch 2.6.0",
        "mlp-bs64 @+changes 9f8e7d torch 2.6.0",
        "mlp-bs64 @clean torch 2.7.0",
    ]
    assert table.provenance == ["git.dirty", "git.diff", "torch.version"]
    text = table_markdown(table)
    header = next(line for line in text.splitlines() if line.startswith("| run"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[8:11] == ["local changes", "changes", "torch"]
    assert "have the same config and differ only in: local changes, changes" in text.replace("\n", " ")


def test_bookkeeping_keys_never_split_a_row() -> None:
    places = [
        {"checkpoint.dir": "ckpt-a", "monitor.interval_s": "0.5", "trainer.progress": "true"},
        {"checkpoint.dir": "ckpt-b", "monitor.interval_s": "2.0", "trainer.progress": "false"},
        {"tracking.run_name": "mine", "tracking.tags": "{'who': 'me'}", "tracking.uri": "sqlite:///x.db"},
    ]
    runs = [compared_run(f"r{i}", 100 + i, seed=i, params=p) for i, p in enumerate(places)]
    table = build(runs)
    assert len(table.lines) == 1 and table.lines[0].row.n == 3
    assert table.diff_keys == [] and "checkpoint.dir" not in table_markdown(table)


def test_a_key_the_sweep_varies_defines_rows_even_a_tag() -> None:
    """An A/A sweep ``-m +tracking.tags.arm=a,b trainer.seed=1,2``: two rows, told apart by the swept tag."""
    swept = {"sweep.keys": "tracking.tags.arm,trainer.seed", "sweep.id": "s1"}
    runs = [
        compared_run(f"{arm}{seed}", 100 + seed, seed=seed, params={"tracking.tags.arm": arm}, tags=swept)
        for seed in (1, 2)
        for arm in ("a", "b")
    ]
    table = build(runs)
    assert [[r.id for r in line.row.runs] for line in table.lines] == [["a1", "a2"], ["b1", "b2"]]
    assert table.diff_keys == ["tracking.tags.arm"]
    unswept = [compared_run(f"r{arm}", 100, params={"tracking.tags.arm": arm}) for arm in ("a", "b")]
    assert len(build(unswept).lines) == 1  # a tag no sweep varied stays bookkeeping


def test_a_row_is_named_after_what_its_repeats_names_share() -> None:
    named = [compared_run(f"r{i}", 100, seed=i, name=f"seed{i}-mlp-digits-cpu-bs32-w0-lr0.1") for i in range(3)]
    assert group(named)[0].name == "mlp-digits-cpu-bs32-w0-lr0.1"
    assert group([compared_run("a", name="x-1"), compared_run("b", seed=1, name="x-1-b")])[0].name == "x-1"
    assert group([compared_run("a", name="one"), compared_run("b", seed=1, name="two")])[0].name == "one (+1 names)"


def test_keys_that_differ_become_columns_and_keys_that_do_not_are_printed_once() -> None:
    runs = [
        *repeats("a", [1000, 1010]),
        compared_run("b0", 2000, params={"loader.batch_size": "128", "optimizer.lr": "0.1", "amp": "true"}),
    ]
    table = build(runs)
    assert table.diff_keys == ["optimizer.lr"]  # batch size has its own column, amp the precision column
    assert table.same == {"data.name": "digits"}
    text = table_markdown(table)
    assert text.startswith("Same in every run: `data.name=digits`")
    header = next(line for line in text.splitlines() if line.startswith("| run"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[5:10] == ["batch", "workers", "resident", "optimizer.lr", "epoch s"]
    assert "amp" not in columns and len(columns) == len(set(columns))
    assert "trainer.seed" not in text


def test_prose_above_and_below_the_table_is_wrapped_for_mlflows_page() -> None:
    params = {f"data.key{i:02d}": f"value-{i}" for i in range(40)}
    text = table_markdown(
        build([compared_run("a", 100, params=params), compared_run("b", 200, params={**params, "amp": "true"})])
    )
    prose = [line for line in text.splitlines() if not line.startswith("|")]
    assert max(len(line) for line in prose) <= 100
    assert sum("`data.key" in line for line in prose) >= 5  # the long list spans several lines


# ---- speed-ups ----


def test_rows_show_median_and_range_and_the_speedup_with_its_interval() -> None:
    runs = [*repeats("a", [100, 101, 102, 103, 104]), *repeats("b", [200, 210, 205, 220, 190], params={"amp": "true"})]
    table = build(runs)
    first, second = table.lines
    assert first.row is table.baseline and first.vs_baseline.reason == "baseline"
    ratios = sorted(b / a for a in [100, 101, 102, 103, 104] for b in [200, 210, 205, 220, 190])
    c = second.vs_baseline.comparison
    assert c.ratio == pytest.approx(ratios[12]) and (c.low, c.high) == pytest.approx((ratios[2], ratios[22]))
    assert second.vs_baseline.real is True and c.p == pytest.approx(2 / 252)
    text = table_markdown(table)
    assert "| 102 (100–104)" in text and "| 205 (190–220)" in text
    assert f"| {c.ratio:.2f}× [{c.low:.2f}–{c.high:.2f}] " in text and "real: p=0.0079, rank, 5v5" in text
    assert "| 5%" in text and "noisy" not in text.split("\n\n")[1]  # IQR 10 / median 205 = 4.9%: not flagged


def test_the_tie_case_reports_the_exact_p_and_is_not_real() -> None:
    table = build(
        [*repeats("a", [1000, 2000, 3000, 4000]), *repeats("b", [4000, 5000, 6000, 7000], params={"amp": "1"})]
    )
    speedup = table.lines[1].vs_baseline
    assert speedup.comparison.p == pytest.approx(4 / 70) and speedup.real is False
    assert "~ p=0.057 ≥ 0.05" in speedup.reason


def test_three_repeats_each_cannot_show_a_difference_but_three_against_five_can() -> None:
    short = build([*repeats("a", [100, 101, 99]), *repeats("b", [150, 151, 149], params={"amp": "1"})])
    assert short.lines[1].vs_baseline.real is None
    assert short.lines[1].vs_baseline.reason == "cannot show a difference with 3 repeats: use at least 4"
    assert short.lines[1].vs_baseline.cannot_show and short.lines[1].vs_baseline.repeats_needed == 4
    assert short.lines[1].vs_baseline.cell().startswith("~1.50× [")
    lopsided = build([*repeats("a", [100, 101, 99]), *repeats("b", [150, 151, 149, 152, 148], params={"amp": "1"})])
    assert lopsided.lines[1].vs_baseline.real is True and "p=0.036" in lopsided.lines[1].vs_baseline.reason


def test_several_rows_are_corrected_for_together_by_holm() -> None:
    rows = [repeats("a", [100, 101, 102, 103])]
    rows += [repeats(f"x{i}", [200 + i, 201 + i, 202 + i, 203 + i], params={"optimizer.lr": str(i)}) for i in range(3)]
    four = build([r for row in rows for r in row])
    assert [ln.vs_baseline.real for ln in four.lines[1:]] == [None] * 3  # 0.029 × 3 = 0.086: never below 0.05
    assert "(Holm over 3 rows)" in four.lines[1].vs_baseline.reason
    assert "adjusted by Holm over the table's 3 comparisons" in table_markdown(four).replace("\n", " ")
    rows = [repeats("a", [100, 101, 102, 103, 104])]
    rows += [repeats(f"x{i}", [200 + i + j for j in range(5)], params={"optimizer.lr": str(i)}) for i in range(3)]
    five = build([r for row in rows for r in row])
    assert [ln.vs_baseline.real for ln in five.lines[1:]] == [True] * 3  # 0.0079 × 3 = 0.024


def test_rows_run_in_the_same_rounds_are_compared_round_by_round() -> None:
    """Six rounds on a machine that slows 10% a round: the rank test sees overlapping samples, the paired test a
    steady 5% gain in every round."""
    base = [
        compared_run(f"a{i}", 1000 * 0.9**i, seed=i, tags={"sweep.id": "s1", "sweep.round": str(i)}) for i in range(6)
    ]
    new = [
        compared_run(
            f"b{i}", 1050 * 0.9**i, seed=i, params={"amp": "1"}, tags={"sweep.id": "s1", "sweep.round": str(i)}
        )
        for i in range(6)
    ]
    speedup = build([*base, *new]).lines[1].vs_baseline
    assert speedup.comparison.test == "paired" and speedup.comparison.ratio == pytest.approx(1.05)
    assert speedup.real is True and "paired, 6 rounds" in speedup.reason
    unpaired = (
        build(
            [
                *(compared_run(r.id, r.metrics["throughput/samples_per_s"], seed=i) for i, r in enumerate(base)),
                *(
                    compared_run(r.id, r.metrics["throughput/samples_per_s"], seed=i, params={"amp": "1"})
                    for i, r in enumerate(new)
                ),
            ]
        )
        .lines[1]
        .vs_baseline
    )
    assert unpaired.comparison.test == "rank" and unpaired.real is False


def test_a_ddp_job_is_compared_by_the_throughput_of_all_its_ranks() -> None:
    single = repeats("a", [1000, 1001, 1002, 1003])
    ddp = [compared_run(f"d{i}", 990 + i, seed=i, params={"device.index": "ddp"}) for i in range(4)]
    for run in ddp:
        run.metrics["throughput/global_samples_per_s"] = 2 * run.metrics["throughput/samples_per_s"]  # type: ignore[index]
    line = build([*single, *ddp]).lines[1]
    assert line.row.speed().median == pytest.approx(2 * 991.5)
    assert line.vs_baseline.real is True and line.vs_baseline.ratio == pytest.approx(1.98, rel=0.01)


def test_a_row_whose_spread_reaches_ten_percent_is_flagged_noisy() -> None:
    table = build(repeats("a", [80, 90, 100, 110, 120]))
    assert "20% noisy" in table_markdown(table)
    assert next(csv.DictReader(io.StringIO(table_csv(table))))["spread_iqr_over_median"] == "0.2"


def test_a_baseline_is_named_by_its_row_or_a_run() -> None:
    runs = [compared_run("a0", 100, name="slow"), compared_run("b0", 400, name="fast", params={"amp": "true"})]
    table = build(runs, baseline="fast")
    assert table.baseline.name == "fast"
    assert table.lines[0].vs_baseline.ratio == pytest.approx(0.25)
    named = [compared_run(f"s{i}", 100 + i, seed=i, name=f"seed{i}-mlp") for i in range(2)]
    named += [compared_run(f"t{i}", 200 + i, seed=i, name=f"seed{i}-mlp-amp", params={"amp": "1"}) for i in range(2)]
    assert build(named, baseline="mlp-amp").baseline.name == "mlp-amp"  # the row's name, as the table prints it
    with pytest.raises(CompareError, match="--baseline nope: no row or selected run has that name or id"):
        build(runs, baseline="nope")


def test_a_run_lacking_metrics_is_listed_and_its_cells_are_empty() -> None:
    runs = [
        *repeats("a", [100, 101]),
        compared_run(
            "f0", None, status="FAILED", params={"loader.batch_size": "4096"}, oom=2, tags={"error": "OOM: x"}
        ),
    ]
    table = build(runs)
    failed = table.lines[1]
    assert failed.row.speed() is None and failed.vs_baseline.ratio is None
    assert failed.row.oom_events == 2
    text = table_markdown(table)
    assert "- run mlp-bs4096 (f0, FAILED) has no time/epoch_s, throughput/samples_per_s, val/acc; error: OOM: x" in text
    row = next(line for line in text.splitlines() if line.startswith("| mlp-bs4096"))
    assert row.rstrip(" |").endswith("1 FAILED") and "| 2 " in row  # a status column appears; OOM events 2


def test_a_ladder_gives_the_total_and_the_mean_step_not_a_mean_of_cumulative_gains() -> None:
    runs = [compared_run("a", 100), compared_run("b", 200, params={"amp": "true"})]
    runs.append(compared_run("c", 800, params={"amp": "true", "loader.resident": "true"}))
    table = build(runs, ladder=True)
    assert [ln.vs_previous and ln.vs_previous.ratio for ln in table.lines] == [
        None,
        pytest.approx(2.0),
        pytest.approx(4.0),
    ]
    assert table.total == pytest.approx(8.0) and table.per_step == pytest.approx(math.sqrt(8.0))
    text = table_markdown(table)
    assert "Ladder: 8.00× in all (the last row over the baseline), 2.83× per step over 2 step(s)" in text
    assert "no step was shown" in " ".join(text.split())  # one run a row: nothing here is shown
    rows = list(csv.DictReader(io.StringIO(table_csv(table))))
    assert [r["run"] for r in rows[-2:]] == ["ladder total", "ladder per step"]
    assert float(rows[-2]["speedup"]) == pytest.approx(8.0) and float(rows[-1]["speedup"]) == pytest.approx(2.828, 1e-3)


def test_a_real_slowdown_is_said_in_words_and_a_doubtful_one_is_not() -> None:
    slower = build(
        [
            *repeats("a", [100.0, 101.0, 99.0, 100.5, 100.2]),
            *repeats("b", [77.0, 78.0, 76.5, 77.5, 77.2], params={"amp": "1"}),
        ]
    )
    assert slower.lines[1].vs_baseline.real and slower.lines[1].vs_baseline.cell().startswith("0.77× slower [")
    doubtful = build([*repeats("a", [100.0, 101.0, 99.0]), *repeats("b", [77.0, 78.0, 76.5], params={"amp": "1"})])
    assert doubtful.lines[1].vs_baseline.cell().startswith("~0.77× [")


def test_an_accuracy_search_is_ranked_by_its_objective() -> None:
    runs = [
        compared_run(f"r{i}", speed, params={"optimizer.lr": lr}, acc=acc)
        for i, (speed, lr, acc) in enumerate([(300, "0.1", 0.80), (100, "0.01", 0.95), (200, "0.3", 0.90)])
    ]
    table = build(runs, rank_by="val/acc")
    assert [ln.row.param("optimizer.lr") for ln in table.lines] == ["0.01", "0.3", "0.1"]
    assert table.baseline is table.lines[0].row
    assert "Rows ranked by val/acc (the search's objective), best first." in table_markdown(table)


# ---- why a row is faster ----


def test_every_row_splits_its_step_and_says_what_moved_against_the_baseline() -> None:
    def split(wait: float, compute: float) -> dict[str, float]:
        step = wait + compute + 1.0
        return {
            "step_ms": step,
            "wait": 100 * wait / step,
            "h2d": 0.0,
            "compute": 100 * compute / step,
            "own": 100 * 1.0 / step,
        }

    starved, fed = split(50.0, 10.0), split(8.0, 11.0)
    runs = [compared_run(f"a{i}", 1000, seed=i, **starved) for i in range(2)]
    runs += [compared_run(f"b{i}", 3000, seed=i, params={"loader.num_workers": "4"}, **fed) for i in range(2)]
    table = build(runs)
    assert table.lines[1].step_change == "data wait −42 ms, compute +1.0 ms"
    text = table_markdown(table)
    assert "| 61.0 = 50.0+0.0+10.0+1.0 " in text and "| 20.0 = 8.0+0.0+11.0+1.0 " in text
    assert "data wait −42 ms, compute +1.0 ms" in text
    row = list(csv.DictReader(io.StringIO(table_csv(table))))[1]
    assert float(row["step_data_wait_ms"]) == pytest.approx(8.0) and row["step_vs_baseline"].startswith("data wait")


def test_the_chart_draws_samples_per_s_and_the_step_stacked_by_part() -> None:
    split = {"step_ms": 10.0, "wait": 60.0, "h2d": 10.0, "compute": 25.0, "own": 5.0}
    table = build([*repeats("a", [100, 110, 120], **split), *repeats("b", [300, 330, 360], params={"amp": "1"})])
    figure = compare.chart(table)
    speed, step = figure.axes[:2]
    assert sorted(bar.get_width() for bar in speed.patches) == [110, 330]
    labels = [t.get_text() for t in speed.get_yticklabels()]
    assert labels == ["mlp-bs64 (n=3)", "mlp-bs64 (n=3)"]
    whiskers = speed.collections[0].get_segments()  # the error bars, one segment per bar
    assert sorted((seg[0][0], seg[1][0]) for seg in whiskers) == [(100, 120), (300, 360)]
    top = [bar for bar in step.patches if bar.get_y() > 0.5]  # the baseline is drawn on top (y = 1)
    assert [round(bar.get_width(), 6) for bar in top] == [6.0, 1.0, 2.5, 0.5]
    assert [t.get_text() for t in step.get_legend().get_texts()] == ["data wait", "copy", "compute", "own work"]


def test_a_chart_of_many_rows_draws_the_first_ones_and_the_baseline_and_says_so() -> None:
    runs = [compared_run(f"r{i}", 100.0 + i, params={"loader.batch_size": str(i + 1)}) for i in range(60)]
    table = build(runs, baseline="mlp-bs60")  # the baseline ranks last: the chart keeps it
    figure = compare.chart(table)
    speed = figure.axes[0]
    assert len(speed.patches) == compare.charts.CHART_ROWS == 40
    labels = [t.get_text() for t in speed.get_yticklabels()]
    assert labels[0] == "mlp-bs60 (n=1)" and labels[-1] == f"{table.lines[0].row.name} (n=1)"  # drawn bottom-up
    assert "40 of 60 rows" in figure.get_suptitle()


def test_single_epoch_runs_and_device_memory_get_footnotes() -> None:
    table = build([compared_run("a", 100, epochs=1, device_peak=3512.0)])
    text = table_markdown(table)
    assert "600¹" in text and "¹ a single epoch: its time includes warm-up" in text
    assert "3,512²" in text and "² the device's peak" in text
    assert "¹" not in table_markdown(build([compared_run("a", 100, epochs=2, peak=100.0)]))


def test_the_compare_link_is_the_one_mlflow_ui_parses() -> None:
    link = compare.compare_link("http://127.0.0.1:5000", ["r1", "r2"], ["7"])
    page, query = unquote(link).split("?", 1)
    assert page == "http://127.0.0.1:5000/#/compare-runs"
    fields = dict(part.split("=", 1) for part in query.split("&"))
    assert json.loads(fields["runs"]) == ["r1", "r2"] and json.loads(fields["experiments"]) == ["7"]
    assert fields["workflowType"] == "machine_learning"
    assert compare.compare_link("", ["r1"], ["7"]).startswith("#/compare-runs?runs=")  # relative: the UI's own page
    assert compare.ui_base("https://bob:pw@mlflow.example.com/") == "https://mlflow.example.com"


# ---- end to end, on a real store ----


def make_run(
    client: MlflowClient,
    experiment_id: str,
    name: str,
    *,
    start: int,
    params: dict[str, str] | None = None,
    tags: dict[str, str] | None = None,
    metrics: dict[str, float] | None = None,
    epochs: int = 2,
    status: str = "FINISHED",
) -> str:
    run = client.create_run(experiment_id, run_name=name, start_time=start, tags=tags or {})
    points = [Metric(k, v, start, epoch) for k, v in (metrics or {}).items() for epoch in range(1, epochs + 1)]
    items = [Param(k, v) for k, v in (params or {}).items()]
    client.log_batch(run.info.run_id, metrics=points, params=items)
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def child_metrics(samples_per_s: float) -> dict[str, float]:
    return {
        "throughput/samples_per_s": samples_per_s,
        "time/epoch_s": 60000 / samples_per_s,
        "val/acc": 0.95,
        "gpu/util_mean_pct": 80.0,
        "memory/max_allocated_mb": 1234.0,
    }


@pytest.fixture
def sweep_store(store_uri: str) -> dict[str, Any]:
    """An old plain run, an old sweep, and the latest sweep: a parent, 5 seeds of bs64 and of bs128, a failed bs4096."""
    client = MlflowClient(tracking_uri=store_uri)
    exp = client.create_experiment("pipeline")
    tags = {"device.type": "cuda", "device.name": "NVIDIA H200", "precision": "fp32", "bottleneck": "compute"}
    make_run(client, exp, "old", start=1000, params=BASE, tags=tags, metrics=child_metrics(10))
    old = make_run(client, exp, "old-sweep", start=2000, tags={"sweep.role": "parent", "sweep.id": "S0"})
    make_run(client, exp, "old-job", start=2001, params=BASE, metrics=child_metrics(10), tags={"sweep.id": "S0"})
    parent = make_run(client, exp, "sweep-S1", start=3000, tags={"sweep.role": "parent", "sweep.id": "S1"})
    children, job = [], 0
    for batch, speeds in (("64", [1000, 1010, 990, 1005, 995]), ("128", [1500, 1490, 1510, 1505, 1495])):
        for seed, speed in enumerate(speeds):
            sweep = {"sweep.id": "S1", "sweep.role": "job", "sweep.job": str(job), "mlflow.parentRunId": parent}
            params = {**BASE, "loader.batch_size": batch, "trainer.seed": str(seed)}
            name, start = f"mlp-digits-cuda-fp32-bs{batch}-w0", 4000 - job  # started in reverse: job order wins
            metrics = child_metrics(speed)
            children.append(make_run(client, exp, name, start=start, params=params, tags=tags | sweep, metrics=metrics))
            job += 1
    sweep = {"sweep.id": "S1", "sweep.role": "job", "sweep.job": str(job), "mlflow.parentRunId": parent}
    params, error = {**BASE, "loader.batch_size": "4096"}, {"error": "OutOfMemoryError"}
    name, oom = "mlp-digits-cuda-fp32-bs4096-w0", {"oom/events": 1.0}
    tags |= sweep | error
    failed = make_run(client, exp, name, start=3500, params=params, tags=tags, metrics=oom, status="FAILED")
    return {"client": client, "experiment": exp, "parent": parent, "children": [*children, failed], "old": old}


def test_main_compares_the_latest_sweep_writes_the_files_and_attaches_them_to_its_parent(
    sweep_store: dict[str, Any], store_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert compare.main(["--uri", store_uri, "--out", str(out), "--log"]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["compare.csv", "compare.md", "compare.png"]
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    view = [line for line in printed.splitlines() if not line.startswith("wrote ")]  # it names tmp_path
    assert max(len(line) for line in view) <= 160, max(view, key=len)
    assert "Same in every run: 2 config keys (listed in compare.md)." in printed
    markdown = (out / "compare.md").read_text()

    rows = list(csv.DictReader(io.StringIO((out / "compare.csv").read_text())))
    # sweep.job order, repeats grouped, the parent and the older runs left out
    summary = [(r["batch_size"], r["n"], r["status"]) for r in rows]
    assert summary == [("64", "5", "FINISHED"), ("128", "5", "FINISHED"), ("4096", "1", "1 FAILED")]
    assert float(rows[1]["speedup"]) == pytest.approx(1500 / 1000, rel=0.01) and rows[1]["real"] == "true"
    assert rows[0]["samples_per_s_min"] == "990" and rows[0]["samples_per_s_max"] == "1010"
    assert rows[2]["samples_per_s_median"] == "" and rows[2]["oom_events"] == "1"

    assert "## sweep S1: 11 runs in 3 rows" in printed and "## sweep S1: 11 runs in 3 rows" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| mlp-digits")]
    assert "| 1,000 (990–1,010)" in table[0] and "| 1.50× [" in table[1] and "real: p=0.0079" in table[1]
    view = [line for line in view if line.startswith("mlp-digits")]
    assert "1,000" in view[0] and "1.50× [" in view[1] and "faster: shown" in view[1]
    assert "- run mlp-digits-cuda-fp32-bs4096-w0" in printed and "error: OutOfMemoryError" in printed

    assert "MLflow's compare page for these 11 runs: the link is in compare.md (" in printed  # 11 ids: too long
    link = next(w for w in markdown.split() if "compare-runs" in w)
    fields = dict(part.split("=", 1) for part in unquote(link).split("?", 1)[1].split("&"))
    assert sorted(json.loads(fields["runs"])) == sorted(sweep_store["children"])
    assert json.loads(fields["experiments"]) == [sweep_store["experiment"]]
    assert f"/#/experiments/{sweep_store['experiment']}/runs?workflowType=machine_learning" in printed

    logged = sweep_store["client"].list_artifacts(sweep_store["parent"], "compare")
    assert sorted(Path(a.path).name for a in logged) == ["compare.csv", "compare.md", "compare.png", "compare.txt"]
    text = Path(sweep_store["client"].download_artifacts(sweep_store["parent"], "compare/compare.txt", str(tmp_path)))
    assert text.read_text() == printed[: printed.index("\nwrote ")]  # the table as printed, word for word


def test_main_with_run_ids_keeps_their_order_and_refuses_to_log_without_a_sweep(
    sweep_store: dict[str, Any], store_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = sweep_store["children"][5], sweep_store["children"][0]  # bs128, then bs64
    argv = ["--uri", store_uri, "--out", str(tmp_path / "o"), "--runs", f"{first},{second},nope", "--log"]
    assert compare.main(argv) == 2
    captured = capsys.readouterr()
    assert "runs given by id (not found: nope): 2 runs in 2 rows" in captured.out
    names = [line.split()[0] for line in captured.out.splitlines() if line.startswith("mlp")]
    assert names == ["mlp-digits-cuda-fp32-bs128-w0", "mlp-digits-cuda-fp32-bs64-w0"]
    assert captured.err.strip() == "error: --log: these runs are not one sweep (no parent run tagged sweep.role=parent)"


def test_main_without_a_sweep_compares_the_experiments_runs_with_a_note(
    store_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(tracking_uri=store_uri)
    exp = client.create_experiment("pipeline")
    for i, speed in enumerate([100.0, 300.0]):
        make_run(client, exp, f"run{i}", start=1000 + i, params={**BASE, "amp": str(i)}, metrics=child_metrics(speed))
    assert compare.main(["--uri", store_uri, "--out", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert "no sweep in experiment 'pipeline' (no run tagged sweep.role=parent): all its runs: 2 runs" in printed
    row = next(line for line in printed.splitlines() if line.startswith("run1"))
    assert "3.00×" in row and "[" not in row and "cannot tell: add repeats" in row
    assert "cannot show a difference with 1 repeat: use at least 4" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--experiment", "nope"], "error: no experiment 'nope'; there are: Default, pipeline (--experiment NAME)"),
        (["--sweep", "S9"], "error: no sweep 'S9' in experiment 'pipeline' (no run tagged sweep.id=S9...)"),
        (["--sweep", "S"], "error: --sweep S: 2 sweeps start so (S0, S1); give more characters"),
        (["--sweep", "S1_"], "error: --sweep 'S1_': quotes, backslashes, % and _ are not allowed"),
        (["--baseline", "zzz"], "error: --baseline zzz: no row or selected run has that name or id (rows: mlp-digits"),
    ],
)
def test_main_says_what_is_wrong_in_one_line_and_exits_2(
    sweep_store: dict[str, Any], store_uri: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert compare.main(["--uri", store_uri, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err
    assert not Path("compare").exists()


def test_main_does_not_create_a_store_that_is_not_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "elsewhere" / "mlflow.db"
    assert compare.main(["--uri", f"sqlite:///{missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: no MLflow store at {missing}: run this where you trained, or pass --uri sqlite:///PATH"
    assert not missing.exists()


def test_200_runs_are_read_in_one_query_without_per_run_calls(
    store_uri: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(tracking_uri=store_uri)
    exp = client.create_experiment("pipeline")
    parent = make_run(client, exp, "sweep", start=1, tags={"sweep.role": "parent", "sweep.id": "BIG"})
    for i in range(199):
        tags = {"sweep.id": "BIG", "sweep.job": str(i), "mlflow.parentRunId": parent}
        params = {"loader.batch_size": str(2 ** (i % 4 + 4)), "trainer.seed": str(i // 4)}
        make_run(client, exp, f"job{i}", start=i + 2, params=params, tags=tags, metrics=child_metrics(100.0 + i))

    calls: list[dict[str, Any]] = []
    search = MlflowClient.search_runs

    def counted(self: MlflowClient, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return search(self, *args, **kwargs)

    def per_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a per-run round trip")

    monkeypatch.setattr(MlflowClient, "search_runs", counted)
    monkeypatch.setattr(MlflowClient, "get_run", per_run)
    monkeypatch.setattr(MlflowClient, "get_metric_history", per_run)

    assert compare.main(["--uri", store_uri, "--sweep", "BIG"]) == 0
    assert len(calls) == 1 and calls[0]["max_results"] == compare.MAX_RUNS
    assert "## sweep BIG: 199 runs in 4 rows" in capsys.readouterr().out

    calls.clear()
    assert compare.main(["--uri", store_uri, "--sweep", "BI"]) == 0  # a prefix: still one query
    assert len(calls) == 1 and "## sweep BIG: 199 runs in 4 rows" in capsys.readouterr().out

    calls.clear()
    assert compare.main(["--uri", store_uri]) == 0  # latest: one query finds the sweep, one reads it
    assert [c["max_results"] for c in calls] == [1, compare.MAX_RUNS]
    assert "## sweep BIG: 199 runs in 4 rows" in capsys.readouterr().out

    calls.clear()
    assert compare.main(["--uri", store_uri, "--last", "8"]) == 0
    assert len(calls) == 1 and "8 runs in 4 rows" in capsys.readouterr().out


def test_a_row_of_another_batch_size_is_compared_per_sample_not_per_step() -> None:
    split = {"step_ms": 2.0, "wait": 10.0, "h2d": 0.0, "compute": 90.0, "own": 0.0}  # 0.2 + 1.8 ms at batch 64
    bigger = {"step_ms": 5.0, "wait": 4.0, "h2d": 0.0, "compute": 96.0, "own": 0.0}  # 0.2 + 4.8 ms at batch 256
    runs = [compared_run(f"a{i}", 32_000, seed=i, **split) for i in range(2)]
    runs += [compared_run(f"b{i}", 51_200, seed=i, params={"loader.batch_size": "256"}, **bigger) for i in range(2)]
    change = build(runs).lines[1].step_change
    assert change == "per sample: compute −9.4 µs, data wait −2.3 µs"  # 28.1 -> 18.75 µs and 3.1 -> 0.8 µs


# ---- the view a terminal prints ----

# What a real run logs besides the swept keys: 40 keys with the dotted names and values the config tree gives them
LONG_KEYS = {
    **{f"model.kwargs.hidden_layer_{i}_features": str(64 * (i + 1)) for i in range(8)},
    **{f"optimizer.schedule.warmup_{name}": "0.1" for name in ("steps", "ratio", "start_factor", "end_factor")},
    **{f"data.transforms.train.{name}": "torchvision.transforms.v2.RandomResizedCrop" for name in "abcdefgh"},
    **{f"trainer.{name}": "false" for name in ("compile", "channels_last", "deterministic", "detect_anomaly")},
    **{f"precision.{name}": "bfloat16" for name in ("dtype", "reduce_dtype", "param_dtype", "buffer_dtype")},
    **{f"loader.{name}": "auto" for name in ("pin_memory", "prefetch_factor", "persistent_workers", "drop_last")},
    **{f"checkpoint.keep_{name}": "3" for name in ("last", "best", "every", "epochs")},
    **{f"task.metrics.{name}": "torchmetrics.classification.MulticlassAccuracy" for name in "abcd"},
}


def readme_sweep(seeds: int = 1) -> list[ComparedRun]:
    """The README's 9-run sweep (batch 32, 64, 128 × workers 0, 2, 4), ``seeds`` runs a configuration, every run
    with the 40 long keys and a step split; the names as a sweep gives them, long."""
    split = {"step_ms": 12.5, "wait": 40.0, "h2d": 2.0, "compute": 55.0, "own": 3.0}
    runs = []
    for i, (batch, workers) in enumerate((b, w) for b in (32, 64, 128) for w in (0, 2, 4)):
        params = {**LONG_KEYS, "loader.batch_size": str(batch), "loader.num_workers": str(workers)}
        name = f"bs{batch}-w{workers}-resnet18-imagenet-subset-cuda-amp-bf16-channels-last-compiled-seed"
        for seed in range(seeds):
            speed = 10_000.0 * (1 + 0.3 * i) * (1 + 0.004 * seed)
            runs.append(compared_run(f"r{i}s{seed}", speed, seed=seed, name=name, params=params, **split))
    return runs


def terminal_lines(table: compare.Table) -> list[str]:
    return compare.table_terminal(table).splitlines()


def columns_of(lines: list[str]) -> list[str]:
    header = next(line for line in lines if line.startswith("row "))
    return [c for c in header.split("  ") if c.strip()]


@pytest.mark.parametrize("seeds", [1, 3])
def test_the_terminal_view_of_the_readme_sweep_fits_160_columns_with_the_columns_that_matter(seeds: int) -> None:
    table = build(readme_sweep(seeds))
    assert len(table.lines) == 9 and len(table.same) == 41  # the 40 long keys but precision.dtype, and BASE's two
    assert max(len(line) for line in table_markdown(table).splitlines()) > 300  # the whole table stays whole
    lines = terminal_lines(table)
    assert max(len(line) for line in lines) <= 160
    assert [c.strip() for c in columns_of(lines)] == [
        "row",
        "n",
        "samples/s",
        "speed-up [95% CI]",
        "verdict",
        "val/acc",
        "MFU %",
        "step ms",
    ]
    rows = [line for line in lines if line.startswith("bs")]
    assert len(rows) == 9 and all(f"  {seeds}  " in line for line in rows)
    assert "1.00× (baseline)" in rows[0] and "baseline" in rows[0]
    assert "12.5 = 5.0+0.2+6.9+0.4" in rows[1]  # the step's parts, in the total's precision
    same = [line for line in lines if "every run" in line]
    assert same == ["Same in every run: 41 config keys (listed in compare.md)."]
    assert not any("Hodges" in line or "Holm" in line or "rank, " in line for line in lines)  # words, not jargon


def test_a_single_run_has_no_interval_and_cannot_tell() -> None:
    table = build(readme_sweep(1))
    speedup = table.lines[4].vs_baseline
    assert speedup.cell() == "~2.20×" and speedup.verdict() == "cannot tell: add repeats"
    rows = [line for line in terminal_lines(table) if line.startswith("bs")]
    assert all("[" not in line for line in rows)
    assert all(line.rstrip().count("cannot tell: add repeats") == 1 for line in rows[1:])


def test_the_verdict_says_in_words_what_the_test_showed() -> None:
    steady = [100.0, 101.0, 99.0, 100.5, 100.2]

    def versus(values: list[float]) -> compare.Speedup:
        return build([*repeats("a", steady), *repeats("b", values, params={"amp": "1"})]).lines[1].vs_baseline

    assert versus([130.0, 131.0, 129.0, 130.5, 130.2]).verdict() == "faster: shown"
    assert versus([77.0, 78.0, 76.5, 77.5, 77.2]).verdict() == "slower: shown"
    assert versus([99.5, 101.5, 98.0, 100.0, 101.0]).verdict() == "no difference shown"
    assert versus([101.5, 101.6, 101.7, 101.8, 101.9]).verdict() == "no difference shown"  # p=0.0079, but a 1.6% change
    short = build([*repeats("a", [100, 101, 99]), *repeats("b", [150, 151, 149], params={"amp": "1"})])
    assert short.lines[1].vs_baseline.verdict() == "cannot tell: add repeats"  # 3 v 3 never reaches p < 0.05
    assert compare.BASELINE.verdict() == "baseline"


def test_a_row_name_too_long_for_the_terminal_is_cut_in_the_middle() -> None:
    long = "x" * 150
    runs = [
        compared_run("a", 100, name=f"{long}-bs64-w0"),
        compared_run("b", 200, name=f"{long}-bs64-w2", params={"amp": "1"}),
    ]
    lines = terminal_lines(build(runs))
    assert max(len(line) for line in lines) <= 160
    rows = [line for line in lines if line.startswith("xxx")]
    assert all("…" in row.split()[0] for row in rows)
    assert rows[0].split()[0].endswith("-bs64-w0") and rows[1].split()[0].endswith("-bs64-w2")


def test_the_chart_has_a_title_a_legend_and_step_colours_of_step_time_png_and_marks_slowdowns() -> None:
    from matplotlib.colors import to_hex

    from pipeline.engine.hot.timing import Breakdown
    from pipeline.report.plots import STEP_COLOURS, step_breakdown

    split = {"step_ms": 10.0, "wait": 60.0, "h2d": 10.0, "compute": 25.0, "own": 5.0}
    steady = [100.0, 101.0, 99.0, 100.5, 100.2]
    runs = [*repeats("a", steady, **split)]
    runs += repeats("b", [130.0, 131.0, 129.0, 130.5, 130.2], params={"amp": "1"}, **split)  # faster: shown
    runs += repeats("c", [77.0, 78.0, 76.5, 77.5, 77.2], params={"amp": "2"}, **split)  # slower: shown
    runs += repeats("d", [99.5, 101.5, 98.0, 100.0, 101.0], params={"amp": "3"}, **split)  # no difference
    table = build(runs)
    figure = compare.chart(table)
    assert "samples/s" in figure.get_suptitle() and table.baseline.name in figure.get_suptitle()
    speed, step = figure.axes[:2]
    bars = {round(bar.get_width(), 1): bar for bar in speed.patches}  # the medians: 100.2, 130.2, 77.2, 100.0
    faster, slower, same = bars[130.2], bars[77.2], bars[100.0]
    assert to_hex(faster.get_facecolor()) != to_hex(slower.get_facecolor())
    assert slower.get_hatch() and not faster.get_hatch()  # a slowdown is hatched, a speed-up is not
    assert to_hex(same.get_facecolor()) not in (to_hex(faster.get_facecolor()), to_hex(slower.get_facecolor()))
    legend = [t.get_text() for t in speed.get_legend().get_texts()]
    assert legend[:4] == ["baseline", "faster: shown", "slower: shown", "no difference shown, or cannot tell"]
    assert any("*" in text for text in legend) and any("hatched" in text for text in legend)
    labels = [t.get_text() for t in speed.texts]
    assert any("faster: shown" in t for t in labels) and not any("~" in t for t in labels)
    parts = {t.get_text(): t for t in step.get_legend().get_texts()}
    assert list(parts) == ["data wait", "copy", "compute", "own work"]
    drawn = {label: to_hex(bar.get_facecolor()) for label, bar in zip(parts, step.patches[::4], strict=True)}
    assert drawn == {part: to_hex(colour) for part, colour in STEP_COLOURS.items()}
    run_chart = step_breakdown([Breakdown(1.0, 0.1, 2.0, 3, 30, 0.5, 4, 40, overhead_s=0.2)], title="run")
    ax = run_chart.axes[0]
    texts = ax.get_legend().get_texts()
    by_label = {t.get_text(): to_hex(p.get_facecolor()) for t, p in zip(texts, ax.patches, strict=True)}
    assert list(by_label.values()) == [to_hex(c) for c in STEP_COLOURS.values()]  # the same colour per part


def test_the_terminal_view_shows_the_keys_that_differ_as_far_as_they_fit() -> None:
    runs = [compared_run(f"r{w}", 100 + w, name="tiny-regression", params={"model.width": str(w)}) for w in (16, 32)]
    lines = terminal_lines(build(runs))
    assert [c.strip() for c in columns_of(lines)][:3] == ["row", "n", "model.width"]
    widths = [line.split()[2] for line in lines if line.startswith("tiny-regression")]
    assert widths == ["16", "32"]
    many = {f"model.layers.block_{i}.expansion_ratio_of_the_hidden_features": "x" * 20 for i in range(8)}
    runs = [compared_run(f"s{w}", 100, name="tiny", params={k: f"{v}{w}" for k, v in many.items()}) for w in range(2)]
    lines = terminal_lines(build(runs))
    assert max(len(line) for line in lines) <= 160
    shown = [c.strip() for c in columns_of(lines)]
    left = [k for k in many if k not in shown]
    assert left and any(line.startswith(f"{len(left)} more config key(s) differ between rows") for line in lines)


def test_runs_of_two_sweeps_are_never_paired_by_their_round_numbers_alone() -> None:
    """``--last N`` over two sweeps: rows whose runs came from different sweeps never ran side by side, whatever
    their ``sweep.round`` tags say; the rank test compares them."""
    base = [
        compared_run(f"a{i}", 1000 * 0.9**i, seed=i, tags={"sweep.id": "s1", "sweep.round": str(i)}) for i in range(6)
    ]
    new = [
        compared_run(
            f"b{i}", 1050 * 0.9**i, seed=i, params={"amp": "1"}, tags={"sweep.id": "s2", "sweep.round": str(i)}
        )
        for i in range(6)
    ]
    speedup = build([*base, *new]).lines[1].vs_baseline
    assert speedup.comparison.test == "rank" and speedup.real is False
    assert "paired" not in speedup.reason


def test_three_rows_of_four_repeats_under_holm_say_they_cannot_show_a_difference_and_how_many_would() -> None:
    """Each row 2× faster in every run: 4 v 4 reaches p = 0.029, but Holm over 3 rows makes the best 0.086."""
    rows = [repeats("a", [100, 101, 102, 103])]
    rows += [repeats(f"x{i}", [200 + i, 201 + i, 202 + i, 203 + i], params={"optimizer.lr": str(i)}) for i in range(3)]
    table = build([r for row in rows for r in row])
    for line in table.lines[1:]:
        speedup = line.vs_baseline
        assert speedup.real is None and speedup.cannot_show is True and speedup.repeats_needed == 5
        assert speedup.reason == "cannot show a difference with 4 repeats (Holm over 3 rows): use at least 5"
    assert table.lines[0].vs_baseline.cannot_show is False
    text = " ".join(table_markdown(table).split())
    assert "3 rows cannot show a difference with 4 repeats (Holm over 3 rows): use at least 5 per row" in text
    five = build([r for row in [repeats("a", [100, 101, 102, 103, 104]), *rows[1:]] for r in row]).lines[1]
    assert five.vs_baseline.cannot_show is False and five.vs_baseline.repeats_needed is None


def test_a_drift_not_shown_says_what_was_estimated_and_how_sure_in_words() -> None:
    from pipeline.common.stats import Drift
    from pipeline.experiments.compare.formats import _drift

    table = build([*repeats("a", [100, 101, 102, 103]), *repeats("b", [150, 151, 152, 153], params={"amp": "1"})])
    said = _drift(replace(table, drift=Drift(-0.33, 0.18, 12)))
    assert said == "Drift: the machine slowed about 33% from the first to the last of these 12 runs, p=0.18: not shown."


def test_a_records_steps_are_each_latest_metrics_step_with_or_without_mlflows_metric_objects(store_uri: str) -> None:
    client = MlflowClient(store_uri)
    run_id = client.create_run(client.create_experiment("steps")).info.run_id
    client.log_batch(run_id, metrics=[Metric("val/acc", 0.5, 0, 1), Metric("val/acc", 0.7, 0, 3), Metric("x", 1, 0, 7)])
    run = client.get_run(run_id)
    assert ComparedRun.from_run(run).steps == {"val/acc": 3, "x": 7}

    class Bare:  # a RunData without them: read through its protobuf
        def __init__(self, data: Any) -> None:
            self.params, self.metrics, self.tags, self.proto = data.params, data.metrics, data.tags, data.to_proto()

        def to_proto(self) -> Any:
            return self.proto

    bare = type("Run", (), {"info": run.info, "data": Bare(run.data)})()
    assert ComparedRun.from_run(bare).steps == {"val/acc": 3, "x": 7}


def test_each_row_shows_its_runs_median_mfu_in_every_view() -> None:
    """MFU (``perf/mfu_pct``) in the terminal, compare.md and compare.csv: the median over the row's runs; a row whose
    runs have none (an unknown GPU, an older run) shows a dash, never a zero."""
    runs = [
        compared_run(f"a{i}", 1000 + i, seed=i, mfu=m, tags={"perf.peak": "this GPU's bf16 peak (H200 datasheet)"})
        for i, m in enumerate((31.0, 35.0, 33.0))
    ]
    runs += [compared_run(f"b{i}", 900 + i, seed=i, params={"amp": "1"}) for i in range(3)]
    table = build(runs)
    lines = terminal_lines(table)
    header = columns_of(lines)
    at = [c.strip() for c in header].index("MFU %")
    start = lines[lines.index(next(line for line in lines if line.startswith("row ")))].index("MFU %")
    rows = [line for line in lines if line.startswith("mlp-")]
    assert [row[start : start + 5].strip() for row in rows] == ["33", "–"] and at == 6
    md = table_markdown(table)
    assert "| MFU % " in md
    csv_rows = list(csv.DictReader(io.StringIO(compare.table_csv(table))))
    assert [r["mfu_pct"] for r in csv_rows] == ["33", ""]
    assert csv_rows[0]["mfu_peak"] == "this GPU's bf16 peak (H200 datasheet)"


def test_mfu_read_against_cpu_peaks_of_different_measurements_is_marked_in_every_view() -> None:
    """A CPU's peak is measured, and a later quiet measurement raises it: rows whose runs read MFU against peaks of
    different measurements (tag ``perf.peak_measured``) get ``‡`` and the note; one measurement, or a GPU's
    datasheet (no tag), none."""
    first, later = "2026-12-07T06:30:12.000+00:00", "2026-12-07T09:02:45.500+00:00"
    cpu = {"device.type": "cpu", "perf.peak": "this CPU's fp32 peak (measured matmul, 2 thread(s))"}
    runs = [
        compared_run(f"a{i}", 1000 + i, seed=i, mfu=16.0, tags={**cpu, "perf.peak_measured": first}) for i in (0, 1)
    ]
    runs += [
        compared_run(f"b{i}", 3600 + i, seed=i, mfu=2.0, params={"amp": "1"}, tags={**cpu, "perf.peak_measured": later})
        for i in (0, 1)
    ]
    table = build(runs)
    note = (
        f"‡ MFU read against CPU peaks from 2 measurements (perf.peak_measured {first} to {later}): rows' MFU differ "
        "by their peaks as well as by their speed; compare samples/s, or rerun the rows to read MFU against one "
        "measurement."
    )
    text = table_markdown(table)
    assert "| 16‡ " in text and "| 2‡ " in text and note in " ".join(text.split())
    rows = [line for line in terminal_lines(table) if line.startswith("mlp-")]
    assert [row.split()[-2] for row in rows] == ["16‡", "2‡"]  # MFU %, then step ms's "–"
    assert note in " ".join(terminal_lines(table))
    same = build([replace(r, tags={**r.tags, "perf.peak_measured": first}) for r in runs])
    gpu = build([replace(r, tags={k: v for k, v in r.tags.items() if k != "perf.peak_measured"}) for r in runs])
    for unmarked in (same, gpu):
        assert "‡" not in table_markdown(unmarked) and "‡" not in "\n".join(terminal_lines(unmarked))


def test_rows_with_runs_on_a_busy_machine_are_marked_in_every_view() -> None:
    busy = {"machine.busy": "true", "machine.others_cpu_pct": "60"}
    runs = [
        *repeats("a", [1000.0, 1010.0, 990.0]),
        compared_run("b0", 1500.0, seed=0, params={"amp": "1"}, tags=busy),
        *(
            compared_run(f"b{i}", 1500.0 + i, seed=i, params={"amp": "1"}, tags={"machine.busy": "false"})
            for i in (1, 2)
        ),
    ]
    table = build(runs)
    text = table_markdown(table)
    assert "1,501† (1,500–1,502)" in text and "1,000 (990–1,010)" in text
    assert "† some of the row's runs ran on a busy machine" in text and "Rows: mlp-bs64 (1 of 3 runs)." in " ".join(
        text.split()
    )
    csv_rows = list(csv.DictReader(io.StringIO(table_csv(table))))
    assert [r["busy_runs"] for r in csv_rows] == ["0", "1"]
    lines = terminal_lines(table)
    rows = [line for line in lines if line.startswith("mlp-bs64")]
    assert "1,000 " in rows[0] and "1,501†" in rows[1]
    assert any(line.startswith("† some of the row's runs ran on a busy machine") for line in lines)
    assert "1,501†" in compare.formats.compact_markdown(table)


def test_the_terminal_view_with_busy_rows_still_fits_160_columns() -> None:
    runs = [replace(r, tags={**r.tags, "machine.busy": "true"}) if i % 2 else r for i, r in enumerate(readme_sweep(3))]
    lines = terminal_lines(build(runs))
    assert max(len(line) for line in lines) <= 160
    assert sum(line.startswith("bs") and "†" in line for line in lines) == 9
    assert "†" not in table_markdown(build(readme_sweep(1)))


# ---- the comparison back in MLflow: rows and verdicts as the runs' tags ----


class TagRecorder:
    """A client that records ``log_batch`` calls, refusing the experiments in ``refused`` as a server refuses a
    user who may not write them."""

    def __init__(self, runs: list[ComparedRun], refused: frozenset[str] = frozenset()) -> None:
        self.experiment = {r.id: r.experiment_id for r in runs}
        self.refused = refused
        self.written: dict[str, dict[str, str]] = {}
        self.calls: list[str] = []

    def log_batch(self, run_id: str, *, tags: list[Any]) -> None:
        from mlflow.exceptions import MlflowException

        self.calls.append(run_id)
        if self.experiment[run_id] in self.refused:
            raise MlflowException(f"Permission denied for run {run_id}.\nPERMISSION_DENIED")
        self.written[run_id] = {t.key: t.value for t in tags}


def three_rows() -> list[ComparedRun]:
    """mlp-fp32 (the baseline), mlp-amp 1.5× faster, mlp-lr the same speed: 5 repeats each."""
    return [
        *repeats("a", [1000, 1010, 990, 1005, 995], name="mlp-fp32"),
        *repeats("b", [1500, 1490, 1510, 1505, 1495], name="mlp-amp", params={"amp": "true"}),
        *repeats("c", [1001, 1003, 998, 1002, 999], name="mlp-lr", params={"optimizer.lr": "0.1"}),
    ]


def test_each_run_is_tagged_with_its_rows_name_verdict_and_speed_up_as_the_terminal_prints_them() -> None:
    table = build(three_rows())
    tags = compare.run_tags(table)
    assert tags["a0"] == {
        "compare.row": "mlp-fp32",
        "compare.verdict": "baseline",
        "compare.speedup": "1.00× (baseline)",
    }
    assert tags["b3"]["compare.row"] == "mlp-amp" and tags["b3"]["compare.verdict"] == "faster: shown"
    assert (
        tags["b3"]["compare.speedup"].startswith("1.50× [") and tags["c1"]["compare.verdict"] == "no difference shown"
    )
    assert len(tags) == 15 and len({tuple(t.values()) for t in tags.values()}) == 3  # a row's runs: its tags
    rows = {line.split("  ")[0]: line for line in terminal_lines(table) if line.startswith("mlp-")}
    for said in tags.values():
        assert (
            said["compare.speedup"] in rows[said["compare.row"]]
            and said["compare.verdict"] in rows[said["compare.row"]]
        )

    client = TagRecorder(three_rows())
    tagging = compare.tag_runs(client, table)
    assert client.written == tags and (tagging.runs, tagging.changed, tagging.failed) == (15, 15, 0)
    assert tagging.line().startswith("tags: 15 runs carry their row and its verdict (compare.row, compare.verdict and")
    again = TagRecorder(three_rows())  # the same comparison of runs that already carry its tags: nothing to write
    tagged = [replace(r, tags={**r.tags, **tags[r.id]}) for r in three_rows()]
    assert compare.tag_runs(again, build(tagged)).changed == 0 and again.calls == []
    other = compare.tag_runs(again, build(tagged, baseline="mlp-amp"))  # another comparison replaces them
    assert other.changed == 15 and again.written["a0"]["compare.verdict"] == "slower: shown"
    assert again.written["b0"] == {
        "compare.row": "mlp-amp",
        "compare.verdict": "baseline",
        "compare.speedup": "1.00× (baseline)",
    }


def test_runs_whose_experiment_refuses_the_tags_are_counted_in_one_line_and_the_others_still_tagged() -> None:
    runs = [replace(r, experiment_id="2") if r.id.startswith("b") else r for r in three_rows()]
    client = TagRecorder(runs, refused=frozenset({"2"}))
    tagging = compare.tag_runs(client, build(runs))
    assert sorted(client.written) == sorted(r.id for r in runs if r.experiment_id == "1")
    assert [c for c in client.calls if c.startswith("b")] == ["b0"]  # its first refusal skips the rest of it
    assert (tagging.changed, tagging.failed) == (10, 5)
    assert tagging.line() == (
        "warning: the tags compare.row, compare.verdict and compare.speedup were not written on 5 of 15 runs "
        "(MlflowException: Permission denied for run b0.): the table is whole, but MLflow's UI cannot group those "
        "runs by row"
    )


def test_main_tags_the_runs_of_the_latest_sweep_and_a_second_run_changes_nothing(
    sweep_store: dict[str, Any], store_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert compare.main(["--uri", store_uri, "--out", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    client: MlflowClient = sweep_store["client"]
    tags = {r: client.get_run(r).data.tags for r in sweep_store["children"]}
    rows = [line for line in printed.splitlines() if line.startswith("mlp-digits")]
    for said in tags.values():
        row = next(line for line in rows if line.split("  ")[0] == said["compare.row"])
        assert said["compare.verdict"] in row and said["compare.speedup"] in row
    assert (
        sorted(t["compare.verdict"] for t in tags.values())
        == ["baseline"] * 5 + ["faster: shown"] * 5 + ["no samples/s"]  # the failed bs4096 has none
    )
    assert "compare.row" not in client.get_run(sweep_store["parent"]).data.tags  # the parent is never a row
    assert (
        "(compare.row, compare.verdict and compare.speedup; 11 written): group MLflow's runs by compare.row" in printed
    )
    assert compare.main(["--uri", store_uri, "--out", str(tmp_path / "o")]) == 0
    assert "; none changed)" in capsys.readouterr().out
    assert (
        compare.main(["--uri", store_uri, "--out", str(tmp_path / "o"), "--baseline", "mlp-digits-cuda-fp32-bs128-w0"])
        == 0
    )
    again = capsys.readouterr().out
    assert "; 10 written)" in again  # the failed run's row says "no samples/s" whatever the baseline: not written
    assert "the sweep's parent run sweep-S1 holds the table its sweep ended with: --log puts this one there" in again
    assert client.get_run(sweep_store["children"][0]).data.tags["compare.verdict"] == "slower: shown"


def test_main_over_runs_of_no_sweep_tags_them_and_says_no_run_holds_the_table(
    sweep_store: dict[str, Any], store_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = sweep_store["children"][5], sweep_store["children"][0]
    assert compare.main(["--uri", store_uri, "--out", str(tmp_path / "o"), "--runs", f"{first},{second}"]) == 0
    printed = capsys.readouterr().out
    assert "the table itself stays in compare.md: runs chosen without a sweep have no parent run in MLflow" in printed
    client: MlflowClient = sweep_store["client"]
    assert client.get_run(first).data.tags["compare.verdict"] == "baseline"
    assert client.get_run(second).data.tags["compare.verdict"] == "cannot tell: add repeats"
    assert "compare.row" not in client.get_run(sweep_store["children"][1]).data.tags  # not in this table: untouched
    assert compare.main(["--uri", store_uri, "--out", str(tmp_path / "o"), "--last", "3", "--no-tags"]) == 0
    assert "tags:" not in capsys.readouterr().out
    assert "compare.row" not in client.get_run(sweep_store["children"][1]).data.tags


def test_a_store_that_refuses_writes_still_gets_its_table_and_one_line_on_what_was_not_tagged(
    sweep_store: dict[str, Any], store_uri: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import sqlite3

    import sqlalchemy
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    def read_only(connection: object, record: object) -> None:  # SQLite's own refusal, as a read-only file gives
        if isinstance(connection, sqlite3.Connection):
            connection.execute("PRAGMA query_only=ON")

    def reconnect() -> None:  # MLflow keeps one engine per store: its pooled connections would keep writing
        engine = SqlAlchemyStore._engine_map.pop(store_uri, None)
        if engine is not None:
            engine.dispose()

    reconnect()
    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "connect", read_only)
    try:
        assert compare.main(["--uri", store_uri, "--out", str(tmp_path / "o")]) == 0
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "connect", read_only)
        reconnect()
    out, err = capfd.readouterr()
    assert "## sweep S1: 11 runs in 3 rows" in out and "faster: shown" in out
    assert err.splitlines() == [  # one line: MLflow's own log of the error, with its traceback, is not shown
        "warning: the tags compare.row, compare.verdict and compare.speedup were not written on 11 of 11 runs "
        "(MlflowException: (sqlite3.OperationalError) attempt to write a readonly database): the table is whole, "
        "but MLflow's UI cannot group those runs by row"
    ]
    client = MlflowClient(tracking_uri=store_uri)
    assert all("compare.row" not in client.get_run(r).data.tags for r in sweep_store["children"])
