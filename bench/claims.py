"""Benchmarks of the pipeline's own claims: does what it tells a user hold up when measured again?

    python -m bench --only autotune,amp_check,compile,profile

- ``autotune``: the loader tuner's suggestion and the gain it claims, then real training runs of the suggested
  command against the current one, interleaved: the claim should reproduce within 1.5× of its gain, never slower.
- ``amp_check``: the CPU amp check run again and again on one model: one verdict, ratios within ±15%.
- ``compile``: torch.compile with the batch dimension static (the last, smaller batch recompiles once and is
  left out of the steady state) against ``dynamic=True`` up front (no recompile, a dynamic graph for every step).
- ``profile``: ``trainer.profile=false`` against the bare loop (off, nothing is added to a step), and the steady
  samples/s of ``trainer.profile=true`` against false's (its profiled steps are left out of the steady state).

``bench`` registers them (``BENCHES``); the numbers go to BENCHMARKS.md, never into a test.
"""

from __future__ import annotations

import contextlib
import io
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.autotune import (
    Machine,
    Settings,
    Trials,
    confirmed_gain,
    override_line,
    resident_fits,
    suggestion,
    tune,
    worker_limit,
)
from pipeline.common.stats import ALPHA, MIN_EFFECT, Comparison, compare, paired_ratio, summarize
from pipeline.config import DataConfig, load
from pipeline.data.sources import load_data
from pipeline.engine.building.amp_check import probe_cpu_amp
from pipeline.engine.models import mlp, resnet
from pipeline.gpucheck.harness import QUICK, Row, Sizes, bare_epoch, interleaved
from pipeline.train import train

CLAIM_FACTOR = 1.5  # the real gain must be within this factor of the claimed gain


def claim_holds(claimed: float | None, real: Comparison) -> bool:
    """Whether real runs bear out the tuner's claim (``claimed``: the speed ratio it printed, None: no gain claimed).

    A claimed gain holds when the real gain's estimate lies within ``CLAIM_FACTOR`` of it either way, and a claim
    is never a slowdown; with no gain claimed, the real runs must show no real difference."""
    if claimed is None:
        return real.p >= ALPHA or abs(real.ratio - 1) < MIN_EFFECT
    gain, found = claimed - 1, real.ratio - 1
    return gain > 0 and gain / CLAIM_FACTOR <= found <= gain * CLAIM_FACTOR


def _quick(sizes: Sizes) -> bool:
    """``--quick`` (compared by value: run as ``python -m bench``, bench's own ``Sizes`` is another class)."""
    return (sizes.samples, sizes.warmup) == (QUICK.samples, QUICK.warmup)


def bench_autotune(sizes: Sizes, work: Path) -> list[Row]:
    """``python -m pipeline.autotune`` on MNIST-shaped synthetic data, then its suggestion against the current
    setting in real ``python -m pipeline`` runs (two epochs each, the second's steady samples/s), interleaved."""
    samples = 2_000 if _quick(sizes) else 20_000
    base = ["device=cpu", "data=synthetic", f"data.num_samples={samples}", "data.val_samples=500"]
    base += ["tracking=none", "monitor.enabled=false", "trainer.progress=false"]
    cfg = load(base)
    trials = Trials(cfg)
    try:
        setup = trials.probe()
        machine = Machine(setup.device.type, worker_limit(), resident_fits(setup.spec, setup.device))
        settings = Settings(budget_s=6, rounds=1, confirm=1) if _quick(sizes) else Settings(budget_s=90)
        outcome = tune(cfg.loader, measure=trials.measure, machine=machine, settings=settings, release=trials.release)
    finally:
        trials.close()
    suggested = suggestion(outcome) or outcome.current  # what the tuner prints to paste
    claimed = None  # "keep your current setting": no gain claimed
    if suggested != outcome.current:  # suggested only when the paired confirmation showed the gain
        claimed = confirmed_gain(outcome, suggested, outcome.current).ratio
    command = override_line(base, outcome.current.loader, suggested.loader)
    extra = [w for w in command.split() if w.startswith("loader.")]
    rates = interleaved(
        {
            "current": lambda: _epoch_rate([*base, "trainer.epochs=2"], work),
            "suggested": lambda: _epoch_rate([*base, "trainer.epochs=2", *extra], work),
        },
        sizes,
    )
    pairs = list(zip(rates["current"], rates["suggested"], strict=True))
    real = compare(rates["current"], rates["suggested"], pairs=pairs)  # paired by round: 7 rounds can reach p < 0.05
    return [
        Row(
            f"autotune's claimed gain, reproduced in real runs (synthetic {samples:,}, cpu)",
            f"{real.ratio:.2f}× [{real.low:.2f}–{real.high:.2f}] real vs "
            + (f"{claimed:.2f}× claimed" if claimed is not None else "no gain claimed"),
            f"the real gain's estimate within {CLAIM_FACTOR}× of the claimed gain, never a slowdown",
            claim_holds(claimed, real),
            f"suggested `{' '.join(extra) or 'the current setting'}`; real: {len(pairs)} interleaved pairs of "
            f"2-epoch runs ({statistics.median(rates['suggested']):,.0f} vs {statistics.median(rates['current']):,.0f} "
            f"samples/s; {real.sizes}, p={real.p:.2g})",
        )
    ]


def _epoch_rate(overrides: list[str], work: Path) -> float:
    cfg = load([*overrides, f"checkpoint.dir={work / 'checkpoints'}"])
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, echo=False, quiet=True).epochs[-1].samples_per_s


def bench_amp_check(sizes: Sizes) -> list[Row]:
    """The CPU amp check (``pipeline.engine.building.amp_check.probe_cpu_amp``) run ``repeats + 2`` times on the same
    model and batch: does it give one verdict, and ratios within ±15% of their median?"""
    torch.manual_seed(0)
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    models = {"MLP 784-512-10": mlp((784,), 10, [512])}
    if not _quick(sizes):
        models["ResNet-18, 28 px"] = resnet("resnet18", (1, 28, 28), 10, stem="small")
    rows = []
    for name, model in models.items():
        probes = [probe_cpu_amp(model, (images, labels), dtype=torch.bfloat16) for _ in range(sizes.repeats + 2)]
        speeds = [p.speed for p in probes if p.measured]
        middle = statistics.median(speeds) if speeds else math.nan
        verdicts = sorted({p.verdict for p in probes})
        spread = max(max(speeds) / middle, middle / min(speeds)) if speeds else math.inf
        rows.append(
            Row(
                f"CPU amp check, the same config {len(probes)} times: {name}",
                f"{min(speeds, default=math.nan):.2f}–{max(speeds, default=math.nan):.2f}×",
                "one verdict, each ratio within ±15% of the median",
                len(verdicts) == 1 and spread <= 1.15,
                f"verdict(s): {', '.join(verdicts)}; batch {probes[0].batch}, "
                f"{statistics.median(p.pairs for p in probes):.0f} pairs a check; median {middle:.2f}×",
            )
        )
    return rows


def bench_compile(sizes: Sizes) -> list[Row]:
    """The MLP's steady step under torch.compile: batch dimension static (the pipeline's choice) or dynamic from
    the start. Each variant compiles first (untimed, the 30-sample last batch included), then times full steps."""
    steps = 20 if _quick(sizes) else 200

    def run(dynamic: bool) -> float:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.compile(nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10)),
                              dynamic=dynamic)  # fmt: skip
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(n: int) -> None:
            loss = F.cross_entropy(model(torch.randn(n, 1, 28, 28)), torch.randint(0, 10, (n,)))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        for n in (64, 64, 30, 64):  # compile both shapes before the clock starts
            step(n)
        start = time.perf_counter()
        for _ in range(steps):
            step(64)
        return steps * 64 / (time.perf_counter() - start)

    rates = interleaved({"static": lambda: run(False), "dynamic": lambda: run(True)}, sizes)
    ratio = paired_ratio(rates["static"], rates["dynamic"])
    spread = summarize(rates["static"])
    return [
        Row(
            "torch.compile, batch dimension static / dynamic up front (MLP steady step, cpu)",
            f"{ratio:.2f}",
            "(info)",
            None,
            f"{statistics.median(rates['static']):,.0f} vs {statistics.median(rates['dynamic']):,.0f} samples/s, "
            f"median of {len(rates['static'])} interleaved rounds of {steps} steps at batch 64"
            + (" (noisy)" if spread and spread.noisy else "")
            + "; above 1: the pipeline's choice (static, the recompiling step left out) runs faster",
        )
    ]


def bench_profile(sizes: Sizes, work: Path) -> list[Row]:
    """``trainer.profile``: off, the pipeline's MLP epoch against the bare loop (off adds nothing to a step: the timer
    is not wrapped); on, its steady samples/s against off's (the profiled steps are left out of the steady state)."""
    samples = sizes.samples
    images, labels = load_data(
        DataConfig("synthetic", shape=[1, 28, 28], num_classes=10, num_samples=samples, val_samples=500)
    ).train.tensors
    base = ["device=cpu", "data=synthetic", f"data.num_samples={samples}", "data.val_samples=500", "loader=resident"]
    base += ["loader.batch_size=64", "trainer.epochs=1", "tracking=none", "monitor.enabled=false"]
    base += ["trainer.progress=false", f"checkpoint.dir={work / 'checkpoints'}"]
    steady: dict[bool, list[float]] = {False: [], True: []}  # samples/s, warm-up rounds included

    def epoch(profile: bool) -> float:
        with contextlib.redirect_stdout(io.StringIO()):
            result = train(load([*base, f"trainer.profile={str(profile).lower()}"]), echo=False, quiet=True)
        steady[profile].append(result.breakdown.samples_per_s)
        return result.epochs[0].seconds

    epoch_s = interleaved(
        {"bare": lambda: bare_epoch(images, labels, batch=64), "off": lambda: epoch(False), "on": lambda: epoch(True)},
        sizes,
    )
    off, on = steady[False][sizes.warmup :], steady[True][sizes.warmup :]
    overhead, kept_out = paired_ratio(epoch_s["bare"], epoch_s["off"]), paired_ratio(on, off)

    def spread(numerators: list[float], denominators: list[float]) -> str:
        ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
        return f"{min(ratios):.3f}–{max(ratios):.3f} over {len(ratios)} rounds"

    return [
        Row(
            "trainer.profile=false / bare loop, MLP, batch 64",
            f"{overhead:.3f}",
            ">= 0.98",
            overhead >= 0.98,
            f"{spread(epoch_s['bare'], epoch_s['off'])}; median epoch {statistics.median(epoch_s['off']):.2f} s vs "
            f"{statistics.median(epoch_s['bare']):.2f} s ({samples:,} samples, resident; tracking and the sampler "
            "off): the loop as it was, no profiler made",
        ),
        Row(
            "trainer.profile=true / false, steady samples/s, MLP, batch 64",
            f"{kept_out:.3f}",
            ">= 0.98",
            kept_out >= 0.98,
            f"{spread(on, off)}; {statistics.median(on):,.0f} vs {statistics.median(off):,.0f} samples/s: the 3 "
            f"profiled steps are left out; the epoch's wall time, which holds them, "
            f"{paired_ratio(epoch_s['on'], epoch_s['off']):.2f}x off's",
        ),
    ]
