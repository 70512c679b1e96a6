"""DDP against the textbook loop: ``python -m bench --only ddp``.

Two CPU ranks over Gloo (``torchrun --nproc_per_node=2``), the same MLP, optimizer, per-rank batch and data on the
device; one torchrun job whose two processes run both loops, one after the other, in alternating order round after
round (the same processes, so no process start-up or placement separates the two sides of a pair):

- **textbook**: PyTorch's DDP tutorial loop: ``DistributedDataParallel(model)`` with its default bucketed overlap
  of backward and all-reduce, a per-epoch shuffle of this rank's shard, forward, loss, backward, step;
- **pipeline**: ``pipeline.train`` under the same launch (``loader=resident``, tracking to a local store), which
  adds the out-of-memory and stop agreement, timing, the sampler and the record.

Each side of a round trains two epochs in the job's one process group (``pipeline.train`` uses a group its caller
joined) and reports its second (the steady state: buckets rebuilt, caches warm); the claim is the median of
per-round ratios of global samples/s (``pipeline.common.stats.paired_ratio``). Each rank is a
``python -m bench.ddp`` process that torchrun starts; rank 0 writes every round's seconds to a
JSON file the parent reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from pipeline.common.stats import paired_ratio
from pipeline.config import DataConfig, load
from pipeline.data.sources import load_data
from pipeline.engine.building.build import build
from pipeline.engine.hot.loop import EpochHooks, StepMetrics, train_epoch
from pipeline.engine.hot.step import Inputs, Peers
from pipeline.engine.hot.timing import make_timer
from pipeline.gpucheck.harness import Row, Sizes, bare_step, interleaved, mlp
from pipeline.parallel.distributed import from_env
from pipeline.train import train

RANKS = 2
BATCH = 64  # per rank: the set-up recipe's MNIST batch
CHUNK = 50  # steps per side of a round in the loop-level comparison
CHUNK_ROUNDS = 120  # its rounds (about 0.4 s a side on 2 CPUs): many short pairs, so a 1% difference is resolved
CHECKOUT = Path(__file__).resolve().parents[1]  # the folder that holds ``bench``: the ranks import it from there


def _tutorial(samples: int) -> tuple[Any, Any, Any, Any]:
    """The tutorial's model, optimizer and this rank's shard of in-memory uint8 tensors (as DistributedSampler)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    bundle = load_data(DataConfig("synthetic", shape=[1, 28, 28], num_classes=10, num_samples=samples, val_samples=64))
    images, labels = (t[rank::world] for t in bundle.train.tensors)
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp())
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), images, labels


def textbook(samples: int, batch: int, epochs: int) -> float:
    """The tutorial's DDP loop over this rank's shard; the last epoch's seconds."""
    import torch
    import torch.distributed as dist

    model, optimizer, images, labels = _tutorial(samples)
    seconds = 0.0
    for epoch in range(epochs):
        dist.barrier()
        start = time.perf_counter()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(labels) - batch + 1, batch):
            loss = bare_step(model, optimizer, images, labels, order[i : i + batch])
        loss.item()
        seconds = time.perf_counter() - start
    return seconds


def _config(samples: int, batch: int, epochs: int, store: Path) -> Any:
    return load(
        [
            "device=cpu",
            "data=synthetic",
            f"data.num_samples={samples}",
            "data.val_samples=64",
            "loader=resident",
            f"loader.batch_size={batch}",
            "loader.drop_last=true",
            f"trainer.epochs={epochs}",
            "trainer.progress=false",
            f"tracking.uri=sqlite:///{store}",
            "tracking.experiment=bench-ddp",
            "monitor.plots=false",
            "checkpoint.enabled=false",
        ]
    )


def pipeline(samples: int, batch: int, epochs: int, store: Path) -> float:
    """``pipeline.train`` on this rank, as ``torchrun -m pipeline`` runs it; the last epoch's seconds."""
    result = train(_config(samples, batch, epochs, store), echo=False, quiet=True)
    return result.epochs[-1].seconds


def chunked(samples: int, batch: int, store: Path) -> dict[str, Callable[[], float]]:
    """The two training loops, CHUNK steps at a time, each resuming where its last chunk stopped: the textbook loop,
    and ``pipeline.engine.hot.loop.train_epoch`` on what ``pipeline.engine.building.build`` builds for a run (the DDP
    wrapper and its agreement, the resident loader's shard, the fused normalisation, the step timer, the loss averaged
    over ranks at each logging point); the run's surroundings (tracker, sampler) are left out, measured by the other
    benchmarks."""
    import itertools

    import torch
    import torch.distributed as dist

    model, optimizer, images, labels = _tutorial(samples)
    cfg = _config(samples, batch, 1, store)
    group = from_env()
    group.join(cfg.device)  # the job's group, joined already by ``main``
    setup = build(cfg, group)

    def forever() -> Any:
        for epoch in itertools.count(1):
            setup.train_batches.set_epoch(epoch)
            yield from setup.train_batches

    batches = forever()
    order: list[Any] = []

    def textbook_chunk() -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CHUNK):
            if not order:
                order.extend(torch.randperm(len(labels)).split(batch)[: len(labels) // batch])
            loss = bare_step(model, optimizer, images, labels, order.pop())
        loss.item()
        return time.perf_counter() - start

    def pipeline_chunk() -> float:
        dist.barrier()
        start = time.perf_counter()
        train_epoch(
            setup.state,
            itertools.islice(batches, CHUNK),
            inputs=Inputs(setup.device, setup.policy, setup.prepare),
            timer=make_timer(setup.device),
            hooks=EpochHooks(metrics=StepMetrics(every=cfg.trainer.log_every_n_steps)),
            peers=Peers(setup.group),
        )
        return time.perf_counter() - start

    return {"textbook": textbook_chunk, "pipeline": pipeline_chunk}


def run_job(sizes, work: Path, *, batch: int = BATCH, epochs: int = 2) -> dict[str, dict[str, list[float]]]:
    """One torchrun job of ``RANKS`` CPU ranks running both comparisons; rank 0's seconds per round and side."""
    out = work / "ddp.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["OMP_NUM_THREADS"] = "1"  # one thread per rank, as torchrun sets for several ranks (said, not left implicit)
    # the ranks run in ``work``: ``bench`` is found through the checkout's root, before what PYTHONPATH held already
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    rounds = (sizes.samples, sizes.repeats, sizes.warmup, chunk_rounds(sizes))
    command += ["-m", "bench.ddp", *map(str, (*rounds, batch, epochs, out))]
    done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"the DDP benchmark job failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(out.read_text())


def chunk_rounds(sizes) -> int:
    """The loop-level comparison's rounds: ``CHUNK_ROUNDS`` for the full suite's 7 repeats, in proportion else."""
    return max(2, CHUNK_ROUNDS * sizes.repeats // 7)


def bench_ddp(sizes, work: Path) -> list:
    """The pipeline's global samples/s under DDP as a share of the textbook loop's: its training loop in short
    interleaved chunks, then whole runs (second epochs), rounds interleaved."""
    both = run_job(sizes, work)
    rows = []
    for kind, seconds in (("loop", both["loop"]), ("run", both["run"])):
        ratio = paired_ratio(
            seconds["textbook"], seconds["pipeline"]
        )  # same samples each side: seconds ratio = samples/s ratio
        ratios = sorted(a / b for a, b in zip(seconds["textbook"], seconds["pipeline"], strict=True))
        q = len(ratios) // 4
        if kind == "loop":
            name = f"DDP training loop / textbook DDP loop, {RANKS} CPU ranks (Gloo), MLP, batch {BATCH}/rank"
            per_side = CHUNK * BATCH * RANKS
            what = f"{CHUNK}-step chunks, {len(ratios)} rounds; middle half of per-round ratios"
        else:
            name = f"DDP pipeline run / textbook DDP loop, {RANKS} CPU ranks (Gloo), MLP, batch {BATCH}/rank"
            per_side = sizes.samples // (RANKS * BATCH) * RANKS * BATCH
            what = f"second epochs of {per_side:,} samples, {len(ratios)} rounds; middle half of per-round ratios"
        rows.append(
            Row(
                name,
                f"{ratio:.3f}",
                ">= 0.97",
                ratio >= 0.97,
                f"global samples/s {per_side / median(seconds['pipeline']):,.0f} vs "
                f"{per_side / median(seconds['textbook']):,.0f} ({what} {ratios[q]:.3f}–{ratios[-1 - q]:.3f})",
            )
        )
    return rows


def main(argv: list[str]) -> int:
    """One rank of the benchmark job: ``SAMPLES REPEATS WARMUP CHUNK_ROUNDS BATCH EPOCHS OUT.json`` (torchrun
    starts it). Whole runs first, then the loops in chunks (one warm-up round each)."""
    import torch.distributed as dist

    samples, repeats, warmup, chunks, batch, epochs = map(int, argv[:6])
    out = Path(argv[6])
    dist.init_process_group("gloo")  # once: both loops use the job's group (a group cannot be joined twice)
    runs = interleaved(
        {
            "textbook": lambda: textbook(samples, batch, epochs),
            "pipeline": lambda: pipeline(samples, batch, epochs, out.parent / "ddp.db"),
        },
        Sizes(samples, repeats, warmup),
    )
    loops = interleaved(chunked(samples, batch, out.parent / "ddp.db"), Sizes(samples, chunks, 1))
    dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps({"run": runs, "loop": loops}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
