"""The fastest loader settings for this run, timed inside the real training step.

    python -m pipeline.autotune                                     # the default run, at most 90 s
    python -m pipeline.autotune data=cifar10 model=resnet18 --budget-s 120
    python -m pipeline.autotune data=mnist --batch-size             # also the largest batch that fits
    python -m pipeline.autotune --steps 20 --warmup 3 --rounds 3 --no-track

It takes the overrides of ``python -m pipeline``. The candidates are the run's own loader group
varied in ``num_workers`` (a doubling ladder 0, 1, 2, 4, ... up to the CPUs this process may use
divided by ``LOCAL_WORLD_SIZE``), ``pin_memory`` (CUDA only), ``prefetch_factor`` 2 vs 4 (the best
worker count only) and ``resident`` (when the dataset fits in half the free memory), plus the
current setting as it is. Each is built once (``build``: data, model on the device, loader,
precision), then trained per round for ``--warmup`` untimed and ``--steps`` timed steps of the
real loop (``train_epoch``) under the run's step timer. Persistent workers stay alive across
rounds, as they do across epochs; what their queue made while other candidates were timed
(``queue_depth``: workers × prefetch_factor batches) is drawn and dropped before a trial, so no
timed batch was made before its trial began. Rounds alternate their order (A B C, C B A, ...) so
a warming page cache or a busy neighbour favours none; the median over rounds ranks the candidates.

The search stops early: a doubling of the workers that gained under 3% ends the ladder, a candidate
whose best round is under 80% of the leader's median (50% after the first round) is measured no
more, and rounds end once the leader's slowest round beats the runner-up's fastest. Those choices
only *pick* the winner: the gain it prints comes from ``--confirm`` fresh rounds (6) of the winner,
the current setting and the runner-up after the search, with a quarter of ``--budget-s`` kept for
them, so neither the luck that made a candidate win nor the early stop inflates it. The gain is the paired
estimate over those rounds with its interval and signed-rank p (``pipeline.common.stats.compare``), claimed only
when significant (6 rounds are the fewest that can be); otherwise it says "not shown" and to keep the current
setting. No trial starts that would overrun the budget. It prints a table and the setting to use as a command to
paste, and records the table and a plot of samples/s against ``num_workers`` in an MLflow run (``autotune-...``,
tag ``autotune=true``) in the experiment ``<tracking.experiment>-autotune``, apart from the runs
``python -m pipeline.compare`` reads.

The package, by responsibility: ``candidates`` (which settings to try), ``search`` (the rounds, the budget, the
batch size: ``tune``), ``trials`` (real training steps: ``Trials``), ``report`` (table, command, plot, MLflow run)
and ``cli`` (``main``; ``__main__`` runs it).
"""

from __future__ import annotations

from pipeline.autotune.candidates import (
    RESIDENT_SHARE,
    Candidate,
    Machine,
    candidates,
    describe,
    prefetch_variant,
    resident_fits,
    worker_ladder,
    worker_limit,
)
from pipeline.autotune.cli import main, parse_args
from pipeline.autotune.report import (
    confirmed_gain,
    format_report,
    gain,
    log_tuning_run,
    override_line,
    shown,
    suggestion,
    table,
    verdict,
    workers_figure,
)
from pipeline.autotune.search import (
    BATCH_SEARCH_SHARE,
    CONFIRM_SHARE,
    DROP_BELOW,
    DROP_BELOW_FIRST,
    PLATEAU_GAIN,
    Measure,
    Outcome,
    Settings,
    Tally,
    Trial,
    tune,
)
from pipeline.autotune.trials import Trials, queue_depth

__all__ = [
    "BATCH_SEARCH_SHARE",
    "CONFIRM_SHARE",
    "DROP_BELOW",
    "DROP_BELOW_FIRST",
    "PLATEAU_GAIN",
    "RESIDENT_SHARE",
    "Candidate",
    "Machine",
    "Measure",
    "Outcome",
    "Settings",
    "Tally",
    "Trial",
    "Trials",
    "candidates",
    "confirmed_gain",
    "describe",
    "format_report",
    "gain",
    "log_tuning_run",
    "main",
    "override_line",
    "parse_args",
    "prefetch_variant",
    "queue_depth",
    "resident_fits",
    "shown",
    "suggestion",
    "table",
    "tune",
    "verdict",
    "worker_ladder",
    "worker_limit",
    "workers_figure",
]
