"""Compare runs in one table: ``python -m pipeline.compare [--sweep latest|ID | --runs ID,ID | --last N]``.

    python -m pipeline.compare                                 # the latest sweep of experiment `pipeline`
    python -m pipeline.compare --last 6 --baseline <run id or name>
    python -m pipeline.compare --sweep <sweep.id> --ladder --log

One row per configuration: runs whose params differ only in ``trainer.seed`` (or a ``repeat`` key), on the
same hardware, are repeats and share a row, with n, the median and min–max of each metric. A run's sample of a
metric is its last value (``time/epoch_s`` of its last epoch). The speed-up is the median steady-state
samples/s over the baseline row's (the first row, or ``--baseline``); it counts as real only when a
Mann–Whitney U test (two-sided, p < 0.05) finds the samples differ *and* the change is at least
``--min-effect`` (3%); otherwise it reads ``~``. A row with fewer than 4 repeats cannot show a difference
(with 3 against 3 the smallest two-sided p a rank test can reach is 0.10). Config keys that differ between
the runs become columns; keys that are the same everywhere are printed once, above the table.

Everything comes from one ``MlflowClient.search_runs`` call (``--sweep latest`` costs one more, with
``max_results=1``, to find the sweep); no per-run history is read, so 1,000 runs take one query. Sweep parents
(tag ``sweep.role=parent``) are never rows. It writes ``compare.md``, ``compare.csv`` and ``compare.png``
(samples/s, min–max whiskers) to ``--out`` and prints the table with the link to MLflow's own compare page for
exactly these runs; ``--log`` attaches the three files to the sweep's parent run under ``compare/``.
Exit status: 0 written, 2 nothing to compare (no store, experiment or runs) or the store cannot be read.

The sweep callback calls the same pieces: ``select(client, experiment, sweep=...)``, ``report(client,
selection.runs, note=selection.note)`` and ``attach(client, selection.parent.id, result)``.

The modules, in the order the data flows: ``selection`` (reading MLflow into ``RunRecord``s, ``records``),
``table`` (repeats into rows, the speed-ups from ``stats``), ``formats`` (Markdown, CSV), ``charts`` (the bar
chart), ``reporting`` (all of it with the links, written or attached) and ``cli`` (``main``).
"""

from pipeline.compare.charts import chart
from pipeline.compare.cli import main
from pipeline.compare.formats import table_csv, table_markdown
from pipeline.compare.records import (
    CORE,
    DEVICE_PEAK_MB,
    EPOCH_S,
    GPU_UTIL,
    OOM_EVENTS,
    PARENT,
    PEAK_MB,
    ROLE,
    THROUGHPUT,
    VAL_ACC,
    CompareError,
    RunRecord,
)
from pipeline.compare.reporting import ARTIFACTS, FILES, Report, attach, compare_link, report, write
from pipeline.compare.selection import MAX_RUNS, Selection, open_store, select
from pipeline.compare.stats import ALPHA, MIN_EFFECT, MIN_REPEATS, NOISY, Speedup, Stat, geomean, speedup, stat
from pipeline.compare.table import (
    BASELINE,
    HARDWARE_TAGS,
    NOT_CONFIG,
    REPEAT_KEYS,
    SHOWN,
    Line,
    Row,
    Table,
    build,
    config_key,
    differences,
    group,
)
from pipeline.store import UI_URL, ui_base

__all__ = [
    "ALPHA",
    "ARTIFACTS",
    "BASELINE",
    "CORE",
    "DEVICE_PEAK_MB",
    "EPOCH_S",
    "FILES",
    "GPU_UTIL",
    "HARDWARE_TAGS",
    "MAX_RUNS",
    "MIN_EFFECT",
    "MIN_REPEATS",
    "NOISY",
    "NOT_CONFIG",
    "OOM_EVENTS",
    "PARENT",
    "PEAK_MB",
    "REPEAT_KEYS",
    "ROLE",
    "SHOWN",
    "THROUGHPUT",
    "UI_URL",
    "VAL_ACC",
    "CompareError",
    "Line",
    "Report",
    "Row",
    "RunRecord",
    "Selection",
    "Speedup",
    "Stat",
    "Table",
    "attach",
    "build",
    "chart",
    "compare_link",
    "config_key",
    "differences",
    "geomean",
    "group",
    "main",
    "open_store",
    "report",
    "select",
    "speedup",
    "stat",
    "table_csv",
    "table_markdown",
    "ui_base",
    "write",
]
