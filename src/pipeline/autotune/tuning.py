"""The flow of ``python -m pipeline.tune``: probe the user's configuration, plan the changes its class implies, search
them inside the real training step, confirm the best against the user's configuration, and say what to use.

    python -m pipeline.tune                                   # the default run, at most 120 s
    python -m pipeline.tune experiment=ladder_cpu --budget-s 60
    python -m pipeline.tune --config-dir myconf model=mynet step=custom step._target_=lm.tbptt
    torchrun --standalone --nproc_per_node=2 -m pipeline.tune device=cpu --budget-s 60 --no-track

The probe is one trial of the user's configuration (samples/s, the step split, MFU), classified by the verdict's rules
(``pipeline.report.verdict.classify``); ``changes.plan`` turns the class into candidates. The search and the
confirmation are autotune's (``search.search``): short interleaved rounds that drop the clearly slow, then
``--confirm`` paired rounds of the best against the user's configuration (and the runner-up, when the search left
its lead unclear), in a seeded random order (``trainer.seed``). A gain is claimed only when those rounds show it
(``tuned.claim``), with its interval. ``CONFIRM`` (8) rounds, not the 6 the paired test needs at least: one round
against a real gain on a busy machine then still leaves it shown, and a runner-up can be claimed at its share of the
test's level.

Under torchrun every rank builds and trains the same candidate at the same time (the trials' steps all-reduce):
rank 0's clock and rank 0's measurements drive the search on every rank (``group.share``), so every rank takes the
same decisions in the same order. A candidate must fail on every rank alike (compile missing, out of memory after
the step's own agreement): one failing on a single rank leaves the others waiting for it until the job's timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.autotune.candidates import Candidate, Machine, resident_fits, worker_ladder, worker_limit
from pipeline.autotune.changes import Plan, Probe, input_dims, plan
from pipeline.autotune.search import Measure, Outcome, Settings, Tally, Unusable, search
from pipeline.autotune.trials import Trials
from pipeline.common.cli import Parser, command
from pipeline.common.device_memory import is_oom
from pipeline.common.messages import brief
from pipeline.config import RunConfig, load
from pipeline.engine.building.provenance import run_name
from pipeline.engine.hot.memory import out_of_memory_is_an_error
from pipeline.engine.models import has_convolutions
from pipeline.report.verdict import classify

CONFIRM = 8  # the confirmation rounds (--confirm)


@dataclass(frozen=True)
class Tuning:
    """What a tuning found: the probe, the plan and the search's outcome, for ``tuned``'s report and records."""

    cfg: RunConfig
    probe: Probe
    plan: Plan
    outcome: Outcome
    name: str  # the run's name (``Tiny-make-cpu-bs32-w0``)
    device: str  # the device's name, as the run prints it


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="python -m pipeline.tune",
        description="Try the changes your run's bottleneck implies, inside its real training step, and say which "
        "is faster with confidence.",
    )
    parser.add_argument("overrides", nargs="*", help="as for python -m pipeline: group=option group.key=value")
    parser.add_argument("--budget-s", type=float, default=120.0, help="no trial starts that would end later (120)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per trial (20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them, at least 1 (3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the search at most (3)")
    parser.add_argument(
        "--confirm", type=int, default=CONFIRM, help=f"paired rounds, best vs yours, after the search ({CONFIRM})"
    )
    parser.add_argument("--config-dir", default=None, help="your config folder, as for python -m pipeline")
    parser.add_argument("--no-track", action="store_true", help="record nothing in MLflow")
    args = parser.parse_intermixed_args(argv)
    for flag in ("budget_s", "steps", "rounds"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    if not math.isfinite(args.budget_s):
        parser.error("--budget-s must be a finite number of seconds > 0")
    if args.confirm < 0:
        parser.error("--confirm must be >= 0")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the step timer always leaves out a trial's first step")
    if args.config_dir is not None and not Path(args.config_dir).is_dir():
        parser.error(f"--config-dir {args.config_dir}: no such folder")
    return args


def composed(overrides: Sequence[str], config_dir: str | None) -> list[str]:
    """The overrides ``load`` is handed: ``--config-dir`` as Hydra's search path, which is what the flag does."""
    if config_dir is None:
        return list(overrides)
    return [*overrides, f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]


def tuning_config(overrides: Sequence[str], *, no_track: bool) -> RunConfig:
    """The user's configuration, recording (unless ``no_track``) into ``<tracking.experiment>-tune``: beside the
    experiment, never in it, so ``compare --last N`` there does not mix the trials in."""
    cfg = load(overrides)
    tracking = dataclasses.replace(cfg.tracking, experiment=f"{cfg.tracking.experiment}-tune")
    if no_track:
        tracking = dataclasses.replace(tracking, enabled=False)
    return dataclasses.replace(cfg, tracking=tracking)


def measure_probe(trials: Trials, setup: Any, settings: Settings) -> Probe:
    """One trial of the user's configuration: samples/s, the step split of its last timed call, MFU, the class."""
    current = Candidate(trials.cfg.loader)
    rate = trials.measure(current, steps=settings.steps, warmup=settings.warmup)
    split = trials.split[current]
    mfu = setup.model_flops.mfu_pct(rate)
    input_pct = split.data_wait_pct + split.h2d_pct
    kind = classify(input_pct=input_pct, overhead_pct=split.overhead_pct, mfu_pct=mfu)
    return Probe(rate, split.data_wait_pct, split.h2d_pct, split.compute_pct, split.overhead_pct, mfu, kind)


def usable(measure: Measure, group: Any, current: Candidate) -> Measure:
    """``measure``, with a candidate that cannot run here (any error building or training it: compile unavailable,
    out of memory, a bug a change exposes) raised as ``Unusable`` with the reason; the user's own configuration
    failing stays an error. Rank 0's result is every rank's (``group.share``), so every rank's search decides alike."""

    def shared(candidate: Candidate, *, steps: int, warmup: int) -> float:
        value, why = None, ""
        try:
            value = measure(candidate, steps=steps, warmup=warmup)
        except Exception as err:  # any failure of a change is its row's reason, one line; the user's own raises
            if candidate == current:
                raise
            why = f"out of memory ({brief(err)})" if is_oom(err) else f"failed: {brief(err)}"
        value, why = group.share(lambda: (value, why))
        if why:
            raise Unusable(why)
        return value

    return shared


def tune_run(
    cfg: RunConfig, settings: Settings, *, group: Any, started: float, clock: Callable[[], float] = time.monotonic
) -> Tuning:
    """Probe, plan, search: the whole measurement, on every rank alike."""
    with out_of_memory_is_an_error(), contextlib.closing(Trials(cfg, group)) as trials:
        setup = trials.probe()
        mine = measure_probe(trials, setup, settings)  # every rank trains it: its steps all-reduce
        probe = group.share(lambda: mine)
        max_workers = worker_limit()
        machine = Machine(setup.device.type, max_workers, resident_fits(setup.spec, setup.device))
        convolutional = has_convolutions(setup.group.unwrap(setup.state.model))
        planned = plan(
            cfg, probe, machine, device=setup.device, input_dims=input_dims(setup.example), convolutional=convolutional
        )
        found = group.share(lambda: planned)  # rank 0's plan: the candidates every rank tries, in its order
        current = found.candidates[0]
        outcome = search(
            found.candidates,
            measure=usable(trials.measure, group, current),
            settings=dataclasses.replace(settings, order_seed=cfg.trainer.seed, runner_up=False),
            release=trials.release,
            clock=lambda: group.share(clock),
            started=started,
            ladder=worker_ladder(max_workers),
        )
    skipped = [Tally(candidate, stopped=f"skipped: {why}") for candidate, why in found.skipped]
    outcome = dataclasses.replace(outcome, tallies=[*outcome.tallies, *skipped])
    name = cfg.tracking.run_name or run_name(cfg, device_type=setup.device.type, precision=setup.policy.label)
    return Tuning(cfg, probe, found, outcome, name, setup.choice.name)


@command("python -m pipeline.tune")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 with an answer (a change, or keep yours), 2 for a problem the user can fix."""
    from pipeline.autotune import tuned
    from pipeline.parallel import distributed
    from pipeline.record.reachability import check_reachable

    started = time.monotonic()  # the budget covers loading the config and building the first candidate too
    args = parse_args(argv)
    settings = Settings(args.budget_s, args.steps, args.warmup, args.rounds, confirm=args.confirm)
    cfg = tuning_config(composed(args.overrides, args.config_dir), no_track=args.no_track)
    with distributed.joined(cfg.device) as group:
        if cfg.tracking.enabled and group.is_main:
            check_reachable(cfg.tracking.uri)  # before the budget is spent
        began = group.share(lambda: started)  # rank 0's clock is every rank's
        result = tune_run(cfg, settings, group=group, started=began)
        if group.is_main:
            tuned.conclude(result, args.overrides, config_dir=args.config_dir, settings=settings)
    return 0
