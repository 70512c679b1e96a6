"""The command line: ``python -m pipeline.compare`` (``main``); mlflow is imported only after the arguments parse."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.common.cli import Parser, command
from pipeline.common.errors import PipelineError
from pipeline.common.messages import brief
from pipeline.common.secrets import mask_text
from pipeline.common.stats import MIN_EFFECT
from pipeline.common.uris import UI_URL, absolute, sqlite_path
from pipeline.experiments.compare.reporting import ARTIFACTS, Report, attach, report, write
from pipeline.experiments.compare.runs import PARENT, ROLE, ComparedRun
from pipeline.experiments.compare.selection import open_store, select
from pipeline.experiments.compare.tagging import ROW, tag_runs
from pipeline.record.reachability import parse

MAX_EFFECT = 10.0  # a required speed-up of 1,000%: anything above is a typo
OUT = "compare"  # the default --out, beside the store; its .gitignore keeps it out of any checkout's changes


def default_out(uri: str) -> Path:
    """Where the files go without ``--out``: ``compare/`` beside a local store (the folder of ``mlflow.db`` or of
    ``mlruns/``), else in the launch folder (a server's store)."""
    database = sqlite_path(uri)
    if database is not None:
        return database.parent / OUT
    scheme, sep, rest = uri.partition("://")
    if not sep:  # a plain path: a file store
        return Path(uri).parent / OUT
    return Path(rest).parent / OUT if scheme == "file" else Path(OUT)


def _write(result: Report, out: Path | None, uri: str) -> list[Path]:
    """The files in ``out``, or beside the store in a folder that ignores itself (as a venv or pytest's cache does),
    so that no checkout it lies in counts them as local changes (``git.dirty``)."""
    if out is not None:
        return write(result, out)
    folder = default_out(uri)
    paths = write(result, folder)
    (folder / ".gitignore").write_text("# written by python -m pipeline.compare\n*\n", encoding="utf-8")
    return paths


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m pipeline.compare",
        description="Compare runs in one table: repeats grouped, medians and ranges, speed-ups tested for noise.",
    )
    parser.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    parser.add_argument("--experiment", default="pipeline", help="experiment name (default: pipeline)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--sweep", default="latest", help="latest (default), or a sweep's id or its first characters")
    which.add_argument("--runs", help="run ids, comma-separated, in the order of the rows")
    which.add_argument("--last", type=int, metavar="N", help="the newest N runs of the experiment")
    parser.add_argument(
        "--baseline", metavar="ROW|RUN", help="the row to measure against: its name, or a run's id (default: the first)"
    )
    parser.add_argument("--ladder", action="store_true", help="also compare each row with the previous one")
    parser.add_argument("--min-effect", type=float, default=MIN_EFFECT, help="smallest real speed-up (default 0.03)")
    parser.add_argument("--out", type=Path, help="folder for the files (default: compare/ beside the store)")
    parser.add_argument("--log", action="store_true", help="attach the files to the sweep's parent run")
    parser.add_argument(
        "--no-tags", action="store_true", help=f"leave the runs' tags as they are (default: tag each with its {ROW})"
    )
    parser.add_argument("--ui", help=f"the MLflow UI's address for the links (default: the server's, or {UI_URL})")
    return parser


def _valid(url: str) -> bool:
    try:
        parse(url)
    except PipelineError:
        return False
    return True


@command("python -m pipeline.compare")
def main(argv: Sequence[str] | None = None) -> int:
    """Select, compare, write the files, print the table; 0 done, 2 a one-line error on stderr."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.last is not None and args.last < 1:
        parser.error("--last N needs N >= 1")
    if not (math.isfinite(args.min_effect) and 0 <= args.min_effect <= MAX_EFFECT):
        parser.error(f"--min-effect {args.min_effect}: expected a share from 0 to {MAX_EFFECT:g} (0.03 = 3%)")
    if args.runs is not None and not any(r.strip() for r in args.runs.split(",")):
        parser.error(f"--runs {args.runs}: no run id given (ids, comma-separated)")
    if args.ui is not None and (not args.ui.startswith(("http://", "https://")) or not _valid(args.ui)):
        parser.error(f"--ui {args.ui}: expected the UI's address, e.g. {UI_URL}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: a file is in the way; name a folder (it is made if missing)")
    uri = absolute(args.uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")
    from mlflow.exceptions import MlflowException

    try:
        client = open_store(uri)
        run_ids = [r.strip() for r in args.runs.split(",") if r.strip()] if args.runs else None
        selection = select(client, args.experiment, sweep=args.sweep, run_ids=run_ids, last=args.last)
        result = report(
            client,
            selection.runs,
            baseline=args.baseline,
            ladder=args.ladder,
            note=selection.note,
            ui=args.ui,
            min_effect=args.min_effect,
            rank_by=selection.objective,
        )
    except PipelineError as err:
        print(f"error: {mask_text(str(err))}", file=sys.stderr)
        return 2
    except MlflowException as err:
        first = brief(err, first_line=True, with_type=False)
        print(f"error: {mask_text(uri)} could not be read: {first}", file=sys.stderr)
        return 2
    try:
        paths = _write(result, args.out, uri)
    except OSError as err:
        where = args.out or default_out(uri)
        print(f"error: --out {where}: cannot write the files there ({err.strerror or err})", file=sys.stderr)
        return 2
    print(result.terminal)
    print("wrote " + ", ".join(str(p) for p in paths))
    if args.log:
        if selection.parent is None:
            print(f"error: --log: these runs are not one sweep (no parent run tagged {ROLE}={PARENT})", file=sys.stderr)
            return 2
        attach(client, selection.parent.id, result)
        print(f"attached to the sweep's parent run {selection.parent.name} ({selection.parent.id}) under {ARTIFACTS}/")
    if not args.no_tags:
        _tag(client, result, selection.parent, logged=args.log)
    return 0


def _tag(client: Any, result: Report, parent: ComparedRun | None, *, logged: bool) -> None:
    """Tag the table's runs (``tag_runs``) and say it in a line, on stderr where some could not be written; then
    where the table is: runs that are not one sweep (``--last``, ``--runs``) have no parent run to hold it, so in
    MLflow they carry only their tags; a sweep's parent keeps its table until ``--log`` replaces it."""
    tagging = tag_runs(client, result.table)
    print(tagging.line(), file=sys.stderr if tagging.failed else sys.stdout)
    if parent is None:
        print("the table itself stays in compare.md: runs chosen without a sweep have no parent run in MLflow for it")
    elif tagging.changed and not logged:
        print(f"the sweep's parent run {parent.name} holds the table its sweep ended with: --log puts this one there")
