"""Compare runs in one table: ``python -m pipeline.compare [--sweep latest|ID | --runs ID,ID | --last N]``.

    python -m pipeline.compare                                 # the latest sweep of experiment `pipeline`
    python -m pipeline.compare --last 6 --baseline <row name or run id>
    python -m pipeline.compare --sweep 1a2b3c4d --ladder --log # a sweep by the short id every output prints

One row per configuration on the same code and software: runs whose params differ only in ``trainer.seed`` (or
a ``repeat`` key) and in bookkeeping keys (``tracking.*``, ``monitor.*``, ``checkpoint.dir``, ...), from the same
git commit and local changes, pipeline, torch and CUDA versions and device, are repeats and share a row, with
n, the median and min–max of each metric (``rows``). A run's sample of a metric is its last value; its speed is
its steady-state samples/s, a DDP job's over all its ranks. Each row's speed-up against the baseline (the first
row, or ``--baseline``) is the Hodges–Lehmann ratio with its 95% interval and an exact test (``pipeline.common.stats``):
paired round by round when both rows ran in the same rounds of an interleaved sweep and enough rounds can reach
the level, else a rank test; real only when the p-value, adjusted by Holm over the table's comparisons, is below
0.05 *and* the change is at least ``--min-effect`` (3%). Each row's steady step is split into data wait, copy,
compute and the pipeline's own work, and what moved against the baseline is named; above the table, whether the
machine drifted over the runs (``pipeline.common.stats.drift``).

Everything comes from one ``MlflowClient.search_runs`` call (``--sweep latest`` costs one more, with
``max_results=1``, to find the sweep); no per-run history is read, so 1,000 runs take one query. Sweep parents
(tag ``sweep.role=parent``) are never rows. It writes ``compare.md``, ``compare.csv`` and ``compare.png``
(samples/s, and the step time stacked by part) to ``--out`` and prints the columns that matter, in lines a
terminal shows whole (``terminal``: the speed-up and a verdict in words), with the link to MLflow's own
compare page for exactly these runs; ``--log`` attaches the three files, and the terminal's view as
``compare.txt``, to the sweep's parent run under ``compare/``. Every run of the table is tagged with its row and
the row's verdict (``tagging``: ``compare.row``, ``compare.verdict``, ``compare.speedup``), so that MLflow's runs
table grouped by ``compare.row`` shows the same rows; ``--no-tags`` leaves the runs as they are. Exit status: 0
written (tags that could not be written are a warning), 2 nothing to compare (no store, experiment or runs) or the
store cannot be read.

The sweep callback calls the same pieces: ``select(client, experiment, sweep=...)``, ``report(client,
selection.runs, note=selection.note)``, ``attach(client, selection.parent.id, result)`` and ``tag_runs(client,
result.table)``.

The modules, in the order the data flows: ``selection`` (reading MLflow into ``ComparedRun``s, ``runs``),
``rows`` (repeats into rows), ``table`` (the comparisons, from ``pipeline.common.stats``), ``formats`` (Markdown, CSV),
``terminal`` (what is printed), ``charts`` (the chart), ``reporting`` (all of it with the links, written or
attached), ``tagging`` (the rows and verdicts as the runs' tags) and ``cli`` (``main``).
"""

from pipeline.common.markdown import markdown_table
from pipeline.common.uris import UI_URL, ui_base
from pipeline.experiments.compare.charts import chart
from pipeline.experiments.compare.cli import main
from pipeline.experiments.compare.formats import table_csv, table_markdown
from pipeline.experiments.compare.reporting import (
    ARTIFACTS,
    FILES,
    TERMINAL,
    Report,
    attach,
    compare_link,
    report,
    write,
)
from pipeline.experiments.compare.rows import (
    BOOKKEEPING,
    PROVENANCE,
    REPEAT_KEYS,
    SHOWN,
    Row,
    config_key,
    differences,
    group,
)
from pipeline.experiments.compare.runs import (
    CORE,
    PARENT,
    ROLE,
    STEP_PARTS,
    ComparedRun,
    CompareError,
)
from pipeline.experiments.compare.selection import MAX_RUNS, Selection, open_store, search_objective, select
from pipeline.experiments.compare.table import BASELINE, Line, Speedup, Table, build, step_change, sweep_drift
from pipeline.experiments.compare.tagging import ROW, SPEEDUP, TAGS, VERDICT, Tagging, run_tags, tag_runs
from pipeline.experiments.compare.terminal import MAX_WIDTH, table_terminal

__all__ = [
    "ARTIFACTS",
    "BASELINE",
    "BOOKKEEPING",
    "CORE",
    "FILES",
    "MAX_RUNS",
    "MAX_WIDTH",
    "PARENT",
    "PROVENANCE",
    "REPEAT_KEYS",
    "ROLE",
    "ROW",
    "SHOWN",
    "SPEEDUP",
    "STEP_PARTS",
    "TAGS",
    "TERMINAL",
    "UI_URL",
    "VERDICT",
    "CompareError",
    "ComparedRun",
    "Line",
    "Report",
    "Row",
    "Selection",
    "Speedup",
    "Table",
    "Tagging",
    "attach",
    "build",
    "chart",
    "compare_link",
    "config_key",
    "differences",
    "group",
    "main",
    "markdown_table",
    "open_store",
    "report",
    "run_tags",
    "search_objective",
    "select",
    "step_change",
    "sweep_drift",
    "table_csv",
    "table_markdown",
    "table_terminal",
    "tag_runs",
    "ui_base",
    "write",
]
