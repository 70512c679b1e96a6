"""What a run costs beyond its training: ``.venv/bin/python scripts/bench_startup.py [--pairs 5] [--src DIR ...]``.

Times the default run's whole process, ``python -m pipeline`` (the MLP on scikit-learn's bundled digits, 5 epochs,
tracking on, in a launch folder whose MLflow store exists already: one run first creates it), against a bare script
that trains the same MLP on the same data and evaluates each epoch: plain torch, the digits loaded and split as
``pipeline.data.sources`` does (upsampled to 28x28, the fixed-seed 80/20 split, normalised by the training pixels'
mean and std), batch 64, SGD lr 0.01 momentum 0.9, seed 42, the epochs' sample order of ``EpochOrder``. Both print
each epoch's val/acc; the bench checks that they print the same accuracies, so the two do the same work.
Each process's CPU time (user + system, all threads) is reported beside its wall time: on a busy machine it moves
less.

Rounds alternate the order (bare, pipeline; pipeline, bare; ...) after a warm-up round that is not counted, so the
machine's drifts cancel; the result is the median of the per-round ratios (``pipeline.common.stats.paired_ratio``)
with their min-max, and both medians. ``--src`` names one or more source trees (``<checkout>/src``, default this
checkout's): each runs in every round with its own launch folder, e.g. a worktree of the code before a change beside
the code after it. ``--overrides tracking=none`` times another job (the bare script stays the same).

Timing claims live here, never in the test suite; BENCHMARKS.md keeps the results.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.common.stats import paired_ratio, summarize
from pipeline.gpucheck.harness import machine

ROOT = Path(__file__).resolve().parents[1]
ACCURACY = re.compile(r"epoch (\d+)/\d+: .*?val/acc ([0-9.]+)")

BARE = '''"""The default run's job in plain torch: the MLP on the bundled digits, 5 epochs, evaluated each epoch."""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED, EPOCHS, BATCH = 42, 5, 64
torch.manual_seed(SEED)
digits = load_digits()
pixels = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0
pixels = F.interpolate(pixels, size=(28, 28), mode="bilinear", align_corners=False)
images = (pixels.clamp(0, 1) * 255).round().to(torch.uint8)
labels = torch.from_numpy(digits.target).long()
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
n_val = round(len(labels) * 0.2)
train_idx, val_idx = order[n_val:], order[:n_val]
train_x, train_y, val_x, val_y = images[train_idx], labels[train_idx], images[val_idx], labels[val_idx]
scaled = train_x.float().div_(255)
mean = scaled.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)
std = scaled.std(dim=(0, 2, 3)).clamp_min(1e-3).view(1, -1, 1, 1)


def normalise(x):
    return torch.addcmul(-mean / std, x.float(), 1.0 / (255.0 * std))


model = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
val = DataLoader(TensorDataset(val_x, val_y), batch_size=BATCH)
for epoch in range(1, EPOCHS + 1):
    shuffled = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
    model.train()
    for batch in DataLoader(TensorDataset(train_x, train_y), batch_size=BATCH, sampler=shuffled.tolist()):
        x, y = batch
        loss = F.cross_entropy(model(normalise(x)), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in val:
            correct += (model(normalise(x)).argmax(dim=1) == y).sum().item()
    print(f"epoch {epoch}/{EPOCHS}: val/acc {correct / len(val_y):.4f}", flush=True)
'''


def timed(command: list[str], *, cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """The command's wall time and CPU time (user + system, all its threads) in seconds, and its output (stdout and
    stderr); a failure ends the bench. On a busy machine the CPU time moves less than the wall time."""
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {child.returncode} in {cwd}:\n{output[-3000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, output


def accuracies(output: str) -> dict[int, str]:
    """Each epoch's val/acc as printed (the pipeline's log lines and the bare script's alike)."""
    return {int(epoch): acc for epoch, acc in ACCURACY.findall(output)}


def environment(src: Path | None) -> dict[str, str]:
    """This process's environment, with ``src`` first on the import path and the store in the launch folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH")}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


def run_round(variants: list[tuple[str, list[str], Path, dict[str, str]]], reverse: bool) -> dict[str, float]:
    """One round: every variant once, in order or in reverse; each one's wall seconds by name, and its CPU seconds
    under ``cpu <name>``."""
    seconds = {}
    for name, command, cwd, env in reversed(variants) if reverse else variants:
        seconds[name], seconds[f"cpu {name}"], _ = timed(command, cwd=cwd, env=env)
        print(f"  {name:<24} {seconds[name]:6.2f} s wall, {seconds[f'cpu {name}']:6.2f} s CPU", flush=True)
    return seconds


def variants(args: argparse.Namespace, work: Path) -> list[tuple[str, list[str], Path, dict[str, str]]]:
    """The bare script and one pipeline run per source tree, each pipeline in a launch folder of its own."""
    bare = work / "bare.py"
    bare.write_text(BARE)
    chosen = [("bare", [args.python, str(bare)], work, environment(None))]
    for number, src in enumerate(args.src):
        launch = work / f"launch{number}"
        launch.mkdir()
        command = [args.python, "-m", "pipeline", *args.overrides]
        chosen.append((f"pipeline {src}", command, launch, environment(src)))
    return chosen


def same_work(chosen: list[tuple[str, list[str], Path, dict[str, str]]]) -> None:
    """Run each variant once (the warm-up; it creates the stores) and check they print the same accuracies."""
    seen = {}
    for name, command, cwd, env in chosen:
        *_, output = timed(command, cwd=cwd, env=env)
        seen[name] = accuracies(output)
        print(f"warm-up {name}: val/acc by epoch {seen[name]}", flush=True)
    if len({tuple(sorted(acc.items())) for acc in seen.values()}) != 1 or not seen["bare"]:
        raise SystemExit(f"the variants do not train the same job (val/acc by epoch): {seen}")


def report(rounds: list[dict[str, float]], names: list[str], pairs: int) -> None:
    """The median ratio of each pipeline to the bare script, its min-max over the rounds, and the medians."""
    bare = [r["bare"] for r in rounds]
    bare_summary = summarize(bare)
    print(f"\n{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {machine()}; load {os.getloadavg()[0]:.1f}")
    print(f"{pairs} alternated pairs; bare script median {bare_summary.median:.2f} s wall")
    for clock in ("", "cpu "):
        base = [r[f"{clock}bare"] for r in rounds]
        for name in names:
            mine = [r[f"{clock}{name}"] for r in rounds]
            ratios = summarize(a / b for a, b in zip(mine, base, strict=True))
            print(
                f"{clock or 'wall '}{name}: {paired_ratio(mine, base):.2f}x the bare script (per-round ratios "
                f"{ratios.low:.2f}-{ratios.high:.2f}); median {summarize(mine).median:.2f} s against "
                f"{summarize(base).median:.2f} s"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="rounds counted after the warm-up (default 5)")
    parser.add_argument("--src", type=Path, nargs="+", default=[ROOT / "src"], help="source trees to time")
    parser.add_argument("--overrides", nargs="*", default=[], help="overrides for python -m pipeline")
    parser.add_argument("--python", default=sys.executable, help="the interpreter both run with")
    args = parser.parse_args(argv)
    args.src = [src.resolve() for src in args.src]
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        chosen = variants(args, Path(tmp))
        same_work(chosen)
        rounds = []
        for number in range(args.pairs):
            print(f"round {number + 1} of {args.pairs}", flush=True)
            rounds.append(run_round(chosen, reverse=number % 2 == 1))
    report(rounds, [name for name, *_ in chosen[1:]], args.pairs)


if __name__ == "__main__":
    main()
