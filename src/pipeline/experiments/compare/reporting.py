"""The comparison as the user gets it: ``report`` (Markdown, CSV, the links, and the note MLflow's UI shows),
``write`` (files in a folder) and ``attach`` (the same files on the sweep's parent run, with the terminal's view)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlparse

from pipeline.common.secrets import mask_text
from pipeline.common.stats import MIN_EFFECT
from pipeline.common.uris import TRAINING_VIEW, run_page, ui_base
from pipeline.experiments.compare.charts import chart
from pipeline.experiments.compare.formats import compact_markdown, table_csv, table_markdown
from pipeline.experiments.compare.runs import ComparedRun
from pipeline.experiments.compare.table import Table, build
from pipeline.experiments.compare.terminal import MAX_WIDTH, table_terminal

ARTIFACTS = "compare"  # the folder under the parent run that --log writes to
FILES = ("compare.md", "compare.csv", "compare.png")
TERMINAL = "compare.txt"  # on the parent run only: the table as the terminal prints it, in the same words


@dataclass(frozen=True)
class Report:
    table: Table
    markdown: str  # the heading, the table with its notes, and the links (absolute: a terminal, a file)
    csv: str
    link: str  # MLflow's compare page for exactly these runs
    note: str  # the same for MLflow's UI (a sweep parent's description): links relative to the page it is on
    terminal: str  # what the command prints: the columns that matter, lines of at most MAX_WIDTH characters

    def figure(self) -> Any:
        """A new chart (``matplotlib.figure.Figure``) of the table."""
        return chart(self.table)


# Keyword-only and all defaulted: a caller names only its own (the sweep's summary names two).
# params: pipeline.compare's options (--baseline, --ladder, --ui, --min-effect) and the selection's note and ranking
def report(
    client: Any,
    runs: Sequence[Any],
    *,
    baseline: str | None = None,
    ladder: bool = False,
    note: str = "",
    ui: str | None = None,
    min_effect: float = MIN_EFFECT,
    rank_by: str | None = None,
) -> Report:
    """The comparison of ``runs`` (MLflow runs from ``search_runs``, or ``ComparedRun``s) in table order.

    Args:
        client: the ``MlflowClient`` they came from; its tracking URI gives the links' base.
        baseline, ladder, min_effect, rank_by: as in ``build``.
        note: how the runs were chosen (``Selection.note``), in the heading.
        ui: the MLflow UI's address; default the tracking server's, or ``mlflow ui``'s for a local store.

    Raises:
        CompareError: no runs, or an unknown baseline.
    """
    compared = [r if isinstance(r, ComparedRun) else ComparedRun.from_run(r) for r in runs]
    table = build(compared, baseline=baseline, ladder=ladder, min_effect=min_effect, rank_by=rank_by)
    uri = client.tracking_uri
    base = (ui or ui_base(uri)).rstrip("/")
    shown = [r for line in table.lines for r in line.row.runs]
    experiments = list(dict.fromkeys(r.experiment_id for r in shown))
    page = compare_link("", [r.id for r in shown], experiments)
    rows, n = len(table.lines), len(shown)
    heading = f"## {note + ': ' if note else ''}{n} runs in {rows} rows"
    body = table_markdown(table)
    links = [f"All runs (model-training view): {base}/{run_page(e)}" for e in experiments]
    if urlparse(uri).scheme not in ("http", "https", "databricks"):
        links.append(f"(start the UI first: mlflow ui --backend-store-uri {uri} --port {_port(base)})")
    text = [heading, "", body, f"MLflow's compare page for these {n} runs: {base}/{page}", *links]
    compare_page = _terminal_link(f"MLflow's compare page for these {n} runs", base, page)
    view = [heading, "", table_terminal(table), *compare_page, *links]
    # In the UI: narrow (the page keeps its About panel), and links relative to the page, so that they open on
    # the UI's own address whatever host and port serve it.
    ui_note = [heading, "", compact_markdown(table), f"[MLflow's compare page for these {n} runs]({page})"]
    ui_note += [f"[All runs of experiment {e} (model-training view)]({run_page(e)})" for e in experiments]
    return Report(
        table,
        mask_text("\n".join(text) + "\n"),
        mask_text(table_csv(table)),
        f"{base}/{page}",
        mask_text("\n".join(ui_note) + "\n"),
        mask_text("\n".join(view) + "\n"),
    )


def _terminal_link(what: str, base: str, page: str) -> list[str]:
    """The link on one line where it fits the terminal's width; else where to find it (a link cut in two opens
    nothing, and the compare page's names every run: some 40 characters a run)."""
    line = f"{what}: {base}/{page}"
    return [line] if len(line) <= MAX_WIDTH else [f"{what}: the link is in compare.md ({len(line)} characters)."]


def _port(base: str) -> int:
    return urlparse(base).port or 5000


def compare_link(ui: str, run_ids: Sequence[str], experiment_ids: Sequence[str]) -> str:
    """MLflow's compare page as its UI builds it (``?runs=<JSON list>&experiments=<JSON list>``, percent-encoded:
    the page decodes it, and a terminal keeps the link whole), in the model-training view; ``ui`` '' gives the
    link relative to the UI's own page."""
    runs = quote(json.dumps(list(run_ids), separators=(",", ":")), safe="")
    experiments = quote(json.dumps(list(experiment_ids), separators=(",", ":")), safe="")
    prefix = f"{ui}/" if ui else ""
    return f"{prefix}#/compare-runs?runs={runs}&experiments={experiments}&{TRAINING_VIEW}"


def write(result: Report, folder: Any) -> list[Any]:
    """``compare.md``, ``compare.csv`` and ``compare.png`` in ``folder`` (a ``Path``, made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    md, table, png = (folder / name for name in FILES)
    md.write_text(result.markdown, encoding="utf-8")
    table.write_text(result.csv, encoding="utf-8")
    result.figure().savefig(png, dpi=100)
    return [md, table, png]


def attach(client: Any, run_id: str, result: Report) -> None:
    """Log the three files, and ``compare.txt`` (``Report.terminal``), to ``run_id`` (the sweep's parent run) under
    ``compare/``."""
    client.log_text(run_id, result.markdown, f"{ARTIFACTS}/{FILES[0]}")
    client.log_text(run_id, result.csv, f"{ARTIFACTS}/{FILES[1]}")
    client.log_text(run_id, result.terminal, f"{ARTIFACTS}/{TERMINAL}")
    client.log_figure(run_id, result.figure(), f"{ARTIFACTS}/{FILES[2]}")
