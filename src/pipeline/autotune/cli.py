"""The command: flags, the probe build, the search, the report and its MLflow run (``python -m pipeline.autotune``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Sequence

from pipeline.autotune.candidates import Machine, resident_fits, worker_limit
from pipeline.autotune.report import NothingMeasured, format_report, log_tuning_run
from pipeline.autotune.search import Settings, tune
from pipeline.autotune.trials import Trials
from pipeline.common.cli import Parser, command
from pipeline.common.errors import PipelineError
from pipeline.config import load
from pipeline.engine.building.provenance import run_name
from pipeline.engine.hot.memory import out_of_memory_is_an_error
from pipeline.record.reachability import check_reachable


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="python -m pipeline.autotune",
        description="Time loader settings inside the real training step and print the fastest as a command.",
    )
    parser.add_argument("overrides", nargs="*", help="as for python -m pipeline: group=option group.key=value")
    parser.add_argument("--budget-s", type=float, default=90.0, help="no trial starts that would end later (90)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per trial (20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them, at least 1 (3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the search at most (3)")
    parser.add_argument(
        "--confirm",
        type=int,
        default=6,
        help="fresh rounds of the winner, runner-up and current setting after (6: the fewest the paired test needs)",
    )
    parser.add_argument(
        "--batch-size",
        action="store_true",
        help="first double loader.batch_size until out of memory, --max-batch-size or no faster; keep the fastest",
    )
    parser.add_argument("--max-batch-size", type=int, default=4096, help="the batch-size search's cap (4096)")
    parser.add_argument("--no-track", action="store_true", help="record nothing in MLflow")
    args = parser.parse_intermixed_args(argv)
    for flag in ("budget_s", "steps", "rounds", "max_batch_size"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    if not math.isfinite(args.budget_s):
        parser.error("--budget-s must be a finite number of seconds > 0")
    if args.confirm < 0:
        parser.error("--confirm must be >= 0")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the step timer always leaves out a trial's first step")
    return args


@command("python -m pipeline.autotune")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 with a winner, 2 for a problem the user can fix (a budget that allowed no trial is one)."""
    started = time.monotonic()  # the budget covers loading the config and building the first candidate too
    args = parse_args(argv)
    print(
        "autotune tries loader settings only; python -m pipeline.tune also tries amp, compile, channels_last and "
        "the micro-batch, as your run's bottleneck implies",
        flush=True,
    )
    settings = Settings(args.budget_s, args.steps, args.warmup, args.rounds, args.batch_size, args.confirm)
    try:
        cfg = load(args.overrides)
        if args.no_track:
            cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, enabled=False))
        # its runs live beside the experiment, never in it: compare --last N must not mix them in
        cfg = dataclasses.replace(
            cfg, tracking=dataclasses.replace(cfg.tracking, experiment=f"{cfg.tracking.experiment}-autotune")
        )
        if cfg.tracking.enabled:
            check_reachable(cfg.tracking.uri)  # before the budget is spent
        max_workers = worker_limit()
        # an out-of-memory error the trials do not handle (they shrink the batch) ends the search in one line
        with out_of_memory_is_an_error(), contextlib.closing(Trials(cfg)) as trials:
            setup = trials.probe()
            machine = Machine(
                device_type=setup.device.type,
                max_workers=max_workers,
                resident_fits=resident_fits(setup.spec, setup.device),
                max_batch_size=min(args.max_batch_size, setup.spec.train_size or args.max_batch_size),
            )
            outcome = tune(
                cfg.loader,
                measure=trials.measure,
                machine=machine,
                settings=settings,
                release=trials.release,
                started=started,
            )
        name = cfg.tracking.run_name or run_name(cfg, device_type=setup.device.type, precision=setup.policy.label)
        report = format_report(outcome, args.overrides, title=f"{name} · {setup.choice.name}")
        print(report, flush=True)
        if cfg.tracking.enabled:  # with nothing measured, the run is recorded FAILED and NothingMeasured raised
            where = log_tuning_run(
                cfg, outcome, report, overrides=args.overrides, settings=settings, name=f"autotune-{name}"
            )
            print("\n".join(where), flush=True)
        elif not outcome.ranking():
            raise NothingMeasured.within(outcome)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0
