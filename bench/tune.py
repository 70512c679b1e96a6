"""``python -m bench --only tune``: does ``python -m pipeline.tune`` find the fastest configuration, in a
fraction of the time an exhaustive sweep takes, and does its claimed gain hold?

On the CPU ladder's configuration (``experiment=ladder_cpu``: MNIST-shaped synthetic data, the MLP), three stages:

1. ``pipeline.tune`` as the command runs it (``tuning.tune_run``) with ``TUNE_BUDGET_S``: the candidates its probe's
   class implies, the search, the confirmation, the claim (``tuned.claim``).
2. The exhaustive sweep a user would run instead: every candidate tune considered trained as a whole run
   (``train``, the ladder's two epochs), ``EXHAUSTIVE_ROUNDS`` repeats each in alternating order; the fastest median
   of the runs' steady samples/s is the best.
3. Afterwards, the user's configuration, tune's choice and the sweep's best trained again as whole runs in
   ``AFTER_ROUNDS`` alternated rounds: their real speeds.

The goals (the issue's): tune's choice within 5% of the sweep's best real speed, in at most 20% of the sweep's time,
and its claimed gain within 1.5x of the gain measured afterwards (when it claims none, the measured gain of what it
kept is reported, not judged).
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median

from pipeline.autotune import tuned
from pipeline.autotune.candidates import Candidate, describe
from pipeline.autotune.report import confirmed_gain
from pipeline.autotune.search import Settings
from pipeline.autotune.tuning import CONFIRM, tune_run
from pipeline.config import RunConfig, load
from pipeline.gpucheck.harness import Row, Sizes
from pipeline.parallel.distributed import Solo
from pipeline.train import train

TUNE_BUDGET_S = 60.0
EXHAUSTIVE_ROUNDS = 5
AFTER_ROUNDS = 5
TUNE_SHARE = 0.20  # tune's time, at most this share of the exhaustive sweep's
WITHIN_BEST = 0.95  # tune's choice's real speed, at least this share of the exhaustive best's
CLAIM_WITHIN = 1.5  # the claimed gain within this factor of the gain measured afterwards


def bench_tune(sizes: Sizes, work: Path) -> list[Row]:
    quick = sizes.repeats == 1
    overrides = ["experiment=ladder_cpu", "tracking=none", "trainer.progress=false", "trainer.replay_check=false"]
    if quick:  # the rows' shape, not their figures: one short epoch a run
        overrides += ["data.num_samples=1000", "data.val_samples=200", "trainer.epochs=1"]
    cfg = load(overrides)
    started = time.monotonic()
    settings = Settings(budget_s=5.0 if quick else TUNE_BUDGET_S, confirm=CONFIRM)  # the command's defaults
    result = tune_run(cfg, settings, group=Solo(), started=started)
    tune_s = time.monotonic() - started
    chosen, said = tuned.claim(result.outcome)
    current = result.outcome.current
    gain = confirmed_gain(result.outcome, chosen, current) if chosen is not None else None
    candidates = list(result.plan.candidates)
    rounds = 1 if quick else EXHAUSTIVE_ROUNDS
    began = time.monotonic()
    speeds = _runs(cfg, candidates, rounds=rounds)
    sweep_s = time.monotonic() - began
    best = max((c for c in candidates if speeds[c]), key=lambda c: median(speeds[c]))
    pick = chosen or current
    after = _runs(cfg, list(dict.fromkeys([current, pick, best])), rounds=1 if quick else AFTER_ROUNDS)
    real = {c: median(v) for c, v in after.items()}
    return _rows(
        tune_s=tune_s,
        sweep=(sweep_s, rounds, len(candidates)),
        share=real[pick] / real[best],
        claimed=gain.ratio if gain is not None else None,
        measured=real[pick] / real[current],
        said=said,
        names=(describe(pick, current), describe(best, current)),
    )


def _runs(cfg: RunConfig, candidates: list[Candidate], *, rounds: int) -> dict[Candidate, list[float]]:
    """Every candidate trained as a whole run in every round, the order alternating (A B C, C B A, ...): each run's
    steady samples/s (the summary's speed)."""
    speeds: dict[Candidate, list[float]] = {c: [] for c in candidates}
    for number in range(rounds):
        for candidate in candidates if number % 2 == 0 else reversed(candidates):
            try:
                speed = train(candidate.config(cfg), echo=False).speed()
            except Exception as err:  # a candidate this machine cannot run (compile without a compiler)
                print(f"<!-- tune bench: {describe(candidate, candidates[0])} not run: {err} -->", flush=True)
                continue
            if speed is not None:
                speeds[candidate].append(speed.median)
    return speeds


def _rows(
    *,
    tune_s: float,
    sweep: tuple[float, int, int],
    share: float,
    claimed: float | None,
    measured: float,
    said: str,
    names: tuple[str, str],
) -> list[Row]:
    chosen, best = names
    sweep_s, rounds, count = sweep
    rows = [
        Row(
            "tune: time against an exhaustive sweep",
            f"{tune_s:.0f} s vs {sweep_s:.0f} s ({tune_s / sweep_s:.0%})",
            f"<= {TUNE_SHARE:.0%}",
            tune_s <= TUNE_SHARE * sweep_s,
            f"the sweep trained the {count} candidates tune considered, {rounds} run(s) each",
        ),
        Row(
            "tune: its choice against the exhaustive best",
            f"{share:.1%} of the best's speed",
            f">= {WITHIN_BEST:.0%}",
            share >= WITHIN_BEST,
            f"tune chose {chosen}; the sweep's best {best}; both trained again in alternated rounds",
        ),
    ]
    if claimed is None:
        rows.append(Row("tune: its claim", "no change claimed", "(info)", None, f"{said}; measured after: "
                        f"{measured:.2f}x"))  # fmt: skip
    else:
        ratio = max(claimed / measured, measured / claimed)
        rows.append(
            Row(
                "tune: its claimed gain held",
                f"claimed {claimed:.2f}x, measured {measured:.2f}x",
                f"within {CLAIM_WITHIN}x",
                ratio <= CLAIM_WITHIN,
                said,
            )
        )
    return rows
