"""``python -m pipeline.compare``: the arithmetic on known numbers, then end to end on a real SQLite store."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from pipeline import compare
from pipeline.compare import CompareError, RunRecord, build, group, speedup, stat, table_csv, table_markdown

BASE = {"model.name": "mlp", "loader.batch_size": "64", "loader.num_workers": "0", "loader.resident": "false"}
BASE |= {"data.name": "digits", "trainer.lr": "0.01", "trainer.seed": "0", "amp": "false"}


def record(
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
) -> RunRecord:
    """A run as ``search_runs`` would give it: ``epoch_s=`` and friends name metrics by their last part."""
    names = {"epoch_s": "time/epoch_s", "acc": "val/acc", "gpu": "gpu/util_mean_pct", "peak": "memory/max_allocated_mb"}
    names |= {"device_peak": "gpu/mem_peak_mb", "oom": "oom/events"}
    values = {names[k]: v for k, v in metrics.items()}
    if samples_per_s is not None:
        values.setdefault("time/epoch_s", 60000 / samples_per_s)
        values.setdefault("val/acc", 0.9)
        values["throughput/samples_per_s"] = samples_per_s
    all_params = {**BASE, "trainer.seed": str(seed), **(params or {})}
    all_tags = {"device.type": "cuda", "device.name": "NVIDIA H200", "precision": "fp32", "bottleneck": "compute"}
    return RunRecord(
        id=run_id,
        name=name or f"mlp-bs{all_params['loader.batch_size']}",
        status=status,
        params=all_params,
        metrics=values,
        tags={**all_tags, **(tags or {})},
        steps={k: epochs for k in values},
        experiment_id="1",
    )


def repeats(prefix: str, values: list[float], **kwargs: Any) -> list[RunRecord]:
    return [record(f"{prefix}{i}", v, seed=i, **kwargs) for i, v in enumerate(values)]


# ---- the arithmetic ----


def test_stat_gives_the_median_the_range_and_the_iqr_of_known_numbers() -> None:
    s = stat([120, 80, 100, 110, 90])
    assert (s.median, s.low, s.high, s.n, s.iqr) == (100, 80, 120, 5, 20)
    assert s.spread == pytest.approx(0.20) and s.noisy
    calm = stat([99, 100, 100, 101, 102])
    assert calm.spread == pytest.approx(0.01) and not calm.noisy
    assert stat([7.0]).iqr == 0 and not stat([7.0]).noisy
    assert stat([]) is None


def test_a_speedup_with_three_repeats_says_it_cannot_show_a_difference() -> None:
    result = speedup([100, 101, 99], [150, 151, 149])
    assert result.median_ratio == pytest.approx(1.5)
    assert result.real is None and result.p is None
    assert "cannot show a difference" in result.reason
    assert result.cell() == "~1.50×"


def test_a_speedup_is_real_when_five_repeats_separate_and_the_effect_is_large() -> None:
    result = speedup([100, 101, 102, 103, 104], [110, 111, 112, 113, 114])
    assert result.median_ratio == pytest.approx(112 / 102)
    assert result.p == pytest.approx(2 / 252)  # exact two-sided p of fully separated 5 vs 5
    assert result.real is True
    assert result.cell() == "1.10×"


def test_a_significant_speedup_smaller_than_the_minimum_effect_is_shown_as_approximate() -> None:
    base, faster = [100, 100.1, 100.2, 100.3, 100.4], [101, 101.1, 101.2, 101.3, 101.4]
    result = speedup(base, faster)
    assert result.p == pytest.approx(2 / 252) and result.median_ratio == pytest.approx(101.2 / 100.2)
    assert result.real is False and result.cell() == "~1.01×"
    assert "1.0% < 3%" in result.reason
    assert speedup(base, faster, min_effect=0.005).real is True  # the threshold is the caller's...
    runs = [*repeats("a", base), *repeats("b", faster, params={"amp": "true"})]
    assert build(runs, min_effect=0.005).lines[1].vs_baseline.real is True  # ...all the way from --min-effect


def test_a_large_speedup_the_rank_test_does_not_confirm_is_shown_as_approximate() -> None:
    result = speedup([90, 95, 100, 105, 110], [80, 96, 104, 112, 125])
    assert result.median_ratio == pytest.approx(1.04)  # above the minimum effect...
    assert result.p > 0.05 and result.real is False  # ...but the samples overlap
    assert result.cell() == "~1.04×"


def test_seed_repeats_share_a_row_other_params_and_other_hardware_do_not() -> None:
    runs = [
        *repeats("a", [1000, 1010, 990]),
        record("b0", 2000, params={"loader.batch_size": "128"}),
        record("c0", 1500, tags={"device.name": "NVIDIA A100"}),  # same params, other GPU
        record("a3", 1020, seed=3),
    ]
    rows = group(runs)
    assert [[r.id for r in row.runs] for row in rows] == [["a0", "a1", "a2", "a3"], ["b0"], ["c0"]]
    assert rows[0].stat("throughput/samples_per_s").median == 1005


def test_a_row_is_named_after_what_its_repeats_names_share() -> None:
    named = [record(f"r{i}", 100, seed=i, name=f"mlp-digits-cpu-bs32-w0-seed{i}-lr0.1") for i in range(3)]
    assert group(named)[0].name == "mlp-digits-cpu-bs32-w0-lr0.1"
    assert group([record("a", name="x-1"), record("b", seed=1, name="x-1-b")])[0].name == "x-1"
    assert group([record("a", name="one"), record("b", seed=1, name="two")])[0].name == "one (+1 names)"


def test_keys_that_differ_become_columns_and_keys_that_do_not_are_printed_once() -> None:
    runs = [
        *repeats("a", [1000, 1010]),
        record("b0", 2000, params={"loader.batch_size": "128", "trainer.lr": "0.1"}),
    ]
    table = build(runs)
    assert table.diff_keys == ["trainer.lr"]  # batch size has its own column; the seed is the repeat
    assert table.same == {"amp": "false", "data.name": "digits"}
    text = table_markdown(table)
    assert text.startswith("Same in every run: `amp=false`, `data.name=digits`")
    header = next(line for line in text.splitlines() if line.startswith("| run"))
    columns = [c.strip() for c in header.strip("|").split("|")][5:10]
    assert columns == ["batch", "workers", "resident", "trainer.lr", "epoch s"]
    assert "trainer.seed" not in text


def test_rows_show_median_and_range_and_the_speedup_over_the_first_row() -> None:
    runs = [*repeats("a", [100, 101, 102, 103, 104]), *repeats("b", [200, 210, 205, 220, 190], params={"amp": "true"})]
    table = build(runs)
    first, second = table.lines
    assert first.row is table.baseline and first.vs_baseline.reason == "baseline"
    assert second.vs_baseline.median_ratio == pytest.approx(205 / 102) and second.vs_baseline.real is True
    text = table_markdown(table)
    assert "| 102 (100–104)" in text and "| 205 (190–220)" in text
    assert "2.01×" in text and "real: p=0.0079" in text
    assert "| 5%" in text and "noisy" not in text.split("\n\n")[1]  # IQR 10 / median 205 = 4.9%: not flagged


def test_a_row_whose_spread_reaches_ten_percent_is_flagged_noisy() -> None:
    table = build(repeats("a", [80, 90, 100, 110, 120]))
    assert "20% noisy" in table_markdown(table)
    assert next(csv.DictReader(io.StringIO(table_csv(table))))["spread_iqr_over_median"] == "0.2"


def test_a_baseline_named_on_the_command_line_is_the_reference() -> None:
    runs = [record("a0", 100, name="slow"), record("b0", 400, name="fast", params={"amp": "true"})]
    table = build(runs, baseline="fast")
    assert table.baseline.name == "fast"
    assert table.lines[0].vs_baseline.median_ratio == pytest.approx(0.25)
    with pytest.raises(CompareError, match="--baseline nope: no selected run"):
        build(runs, baseline="nope")


def test_a_run_lacking_metrics_is_listed_and_its_cells_are_empty() -> None:
    runs = [
        *repeats("a", [100, 101]),
        record("f0", None, status="FAILED", params={"loader.batch_size": "4096"}, oom=2, tags={"error": "OOM: x"}),
    ]
    table = build(runs)
    failed = table.lines[1]
    assert failed.row.stat("throughput/samples_per_s") is None and failed.vs_baseline.median_ratio is None
    assert failed.row.oom_events == 2
    text = table_markdown(table)
    assert "- run mlp-bs4096 (f0, FAILED) has no time/epoch_s, throughput/samples_per_s, val/acc; error: OOM: x" in text
    row = next(line for line in text.splitlines() if line.startswith("| mlp-bs4096"))
    assert row.rstrip(" |").endswith("1 FAILED") and "| 2 " in row  # a status column appears; OOM events 2


def test_a_ladder_compares_each_row_with_the_previous_and_adds_the_geometric_mean() -> None:
    runs = [record("a", 100), record("b", 200, params={"amp": "true"})]
    runs.append(record("c", 800, params={"amp": "true", "loader.resident": "true"}))
    table = build(runs, ladder=True)
    assert [ln.vs_previous and ln.vs_previous.median_ratio for ln in table.lines] == [None, 2.0, 4.0]
    assert table.geomean_vs_baseline == pytest.approx(math.sqrt(2.0 * 8.0))  # 2× and 8× over the baseline
    assert table.geomean_per_step == pytest.approx(math.sqrt(2.0 * 4.0))
    text = table_markdown(table)
    assert "| geometric mean" in text and "| 4.00× " in text and "2.83× per step" in text
    last = list(csv.DictReader(io.StringIO(table_csv(table))))[-1]
    assert last["run"] == "geometric mean" and float(last["speedup"]) == pytest.approx(4.0)


def test_single_epoch_runs_and_device_memory_get_footnotes() -> None:
    table = build([record("a", 100, epochs=1, device_peak=3512.0)])
    text = table_markdown(table)
    assert "600¹" in text and "¹ a single epoch: its time includes warm-up" in text
    assert "3,512²" in text and "² the device's peak" in text
    assert "¹" not in table_markdown(build([record("a", 100, epochs=2, peak=100.0)]))


def test_the_compare_link_is_the_one_mlflow_ui_parses() -> None:
    link = compare.compare_link("http://127.0.0.1:5000", ["r1", "r2"], ["7"])
    page, query = unquote(link).split("?", 1)
    assert page == "http://127.0.0.1:5000/#/compare-runs"
    fields = dict(part.split("=", 1) for part in query.split("&"))
    assert json.loads(fields["runs"]) == ["r1", "r2"] and json.loads(fields["experiments"]) == ["7"]
    assert fields["workflowType"] == "machine_learning"
    assert compare.ui_base("https://bob:pw@mlflow.example.com/") == "https://mlflow.example.com"


def test_the_chart_has_one_bar_per_row_at_its_median_with_min_max_whiskers() -> None:
    table = build([*repeats("a", [100, 110, 120]), *repeats("b", [300, 330, 360], params={"amp": "true"})])
    figure = compare.chart(table)
    bars = figure.axes[0].patches
    assert sorted(bar.get_width() for bar in bars) == [110, 330]
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    assert labels == ["mlp-bs64 (n=3)", "mlp-bs64 (n=3)"]
    whiskers = figure.axes[0].collections[0].get_segments()  # the error bars, one segment per bar
    assert sorted((seg[0][0], seg[1][0]) for seg in whiskers) == [(100, 120), (300, 360)]


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
    assert (out / "compare.md").read_text() in printed

    rows = list(csv.DictReader(io.StringIO((out / "compare.csv").read_text())))
    # sweep.job order, repeats grouped, the parent and the older runs left out
    summary = [(r["batch_size"], r["n"], r["status"]) for r in rows]
    assert summary == [("64", "5", "FINISHED"), ("128", "5", "FINISHED"), ("4096", "1", "1 FAILED")]
    assert float(rows[1]["speedup"]) == pytest.approx(1500 / 1000) and rows[1]["speedup_real"] == "true"
    assert rows[0]["samples_per_s_min"] == "990" and rows[0]["samples_per_s_max"] == "1010"
    assert rows[2]["samples_per_s_median"] == "" and rows[2]["oom_events"] == "1"

    assert "## 11 runs in 3 rows — sweep S1, parent run sweep-S1: 11 runs" in printed
    table = [line for line in printed.splitlines() if line.startswith("| mlp-digits")]
    assert "| 1,000 (990–1,010)" in table[0] and "| 1.50× " in table[1] and "real: p=0.0079" in table[1]
    assert "- run mlp-digits-cuda-fp32-bs4096-w0" in printed and "error: OutOfMemoryError" in printed

    link = next(w for w in printed.split() if "compare-runs" in w)
    fields = dict(part.split("=", 1) for part in unquote(link).split("?", 1)[1].split("&"))
    assert sorted(json.loads(fields["runs"])) == sorted(sweep_store["children"])
    assert json.loads(fields["experiments"]) == [sweep_store["experiment"]]
    assert f"/#/experiments/{sweep_store['experiment']}/runs?workflowType=machine_learning" in printed

    logged = sweep_store["client"].list_artifacts(sweep_store["parent"], "compare")
    assert sorted(Path(a.path).name for a in logged) == ["compare.csv", "compare.md", "compare.png"]


def test_main_with_run_ids_keeps_their_order_and_refuses_to_log_without_a_sweep(
    sweep_store: dict[str, Any], store_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = sweep_store["children"][5], sweep_store["children"][0]  # bs128, then bs64
    argv = ["--uri", store_uri, "--out", str(tmp_path / "o"), "--runs", f"{first},{second},nope", "--log"]
    assert compare.main(argv) == 2
    captured = capsys.readouterr()
    assert "runs given by id (not found: nope): 2 runs" in captured.out
    batches = [line.split("|")[6].strip() for line in captured.out.splitlines() if line.startswith("| mlp")]
    assert batches == ["128", "64"]
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
    assert "~3.00×" in printed and "n=1 < 4: cannot show a difference" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--experiment", "nope"], "error: no experiment 'nope'; there are: Default, pipeline (--experiment NAME)"),
        (["--sweep", "S9"], "error: no sweep 'S9' in experiment 'pipeline' (runs tagged sweep.id=S9)"),
        (["--baseline", "zzz"], "error: --baseline zzz: no selected run has that id or name"),
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
    assert "## 199 runs in 4 rows" in capsys.readouterr().out

    calls.clear()
    assert compare.main(["--uri", store_uri]) == 0  # latest: one query finds the sweep, one reads it
    assert [c["max_results"] for c in calls] == [1, compare.MAX_RUNS]
    assert "## 199 runs in 4 rows" in capsys.readouterr().out

    calls.clear()
    assert compare.main(["--uri", store_uri, "--last", "8"]) == 0
    assert len(calls) == 1 and "## 8 runs in 4 rows" in capsys.readouterr().out


def test_a_real_slowdown_is_said_in_words_and_a_doubtful_one_is_not() -> None:
    from pipeline.compare import speedup

    slower = speedup([100.0, 101.0, 99.0, 100.5, 100.2], [77.0, 78.0, 76.5, 77.5, 77.2])
    assert slower.real and slower.cell() == "0.77× slower"
    doubtful = speedup([100.0, 101.0, 99.0], [77.0, 78.0, 76.5])  # n=3: no difference can be shown
    assert doubtful.cell() == "~0.77×"
