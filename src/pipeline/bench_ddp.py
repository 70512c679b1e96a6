"""DDP against the textbook loop: ``python -m pipeline.bench --only ddp``.

Two CPU ranks over Gloo (``torchrun --nproc_per_node=2``), the same MLP, optimizer, per-rank batch and data on the
device; one torchrun job whose two processes run both loops, one after the other, in alternating order round after
round (the same processes, so no process start-up or placement separates the two sides of a pair):

- **textbook**: PyTorch's DDP tutorial loop: ``DistributedDataParallel(model)`` with its default bucketed overlap
  of backward and all-reduce, a per-epoch shuffle of this rank's shard, forward, loss, backward, step;
- **pipeline**: ``pipeline.train`` under the same launch (``loader=resident``, tracking to a local store), which
  adds the out-of-memory and stop agreement, timing, the sampler and the record.

Each side of a round trains two epochs in the job's one process group (``pipeline.train`` uses a group its caller
joined) and reports its second (the steady state: buckets rebuilt, caches warm); the claim is the median of
per-round ratios of global samples/s (``pipeline.stats.paired_ratio``). Each rank is a
``python -m pipeline.bench_ddp`` process that torchrun starts; rank 0 writes every round's seconds to a JSON file
the parent reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

RANKS = 2
BATCH = 64  # per rank: the guides' MNIST batch


def textbook(samples: int, batch: int, epochs: int) -> float:
    """The tutorial's DDP loop over this rank's shard of in-memory uint8 tensors; the last epoch's seconds."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pipeline.bench import bare_step, mlp
    from pipeline.config import DataConfig
    from pipeline.data.sources import load_data

    rank, world = dist.get_rank(), dist.get_world_size()
    bundle = load_data(DataConfig("synthetic", shape=[1, 28, 28], num_classes=10, num_samples=samples, val_samples=64))
    images, labels = (t[rank::world] for t in bundle.train.tensors)  # this rank's shard, as DistributedSampler
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
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


def pipeline(samples: int, batch: int, epochs: int, store: Path) -> float:
    """``pipeline.train`` on this rank, as ``torchrun -m pipeline`` runs it; the last epoch's seconds."""
    from pipeline.config import load
    from pipeline.train import train

    cfg = load(
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
    result = train(cfg, echo=False, quiet=True)
    return result.epochs[-1].seconds


def run_job(sizes, work: Path, *, batch: int = BATCH, epochs: int = 2) -> dict[str, list[float]]:
    """One torchrun job of ``RANKS`` CPU ranks running both loops round after round; rank 0's seconds per round."""
    out = work / "ddp.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["OMP_NUM_THREADS"] = "1"  # one thread per rank, as torchrun sets for several ranks (said, not left implicit)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    command += ["-m", "pipeline.bench_ddp", *map(str, (sizes.samples, sizes.repeats, sizes.warmup, batch, epochs, out))]
    done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"the DDP benchmark job failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(out.read_text())


def bench_ddp(sizes, work: Path) -> list:
    """The pipeline's global samples/s under DDP as a share of the textbook loop's, rounds interleaved."""
    from pipeline.bench import Row
    from pipeline.stats import paired_ratio

    t = run_job(sizes, work)
    ratio = paired_ratio(t["textbook"], t["pipeline"])  # same samples per epoch: seconds ratio = samples/s ratio
    ratios = sorted(a / b for a, b in zip(t["textbook"], t["pipeline"], strict=True))
    per_epoch = sizes.samples // (RANKS * BATCH) * RANKS * BATCH
    return [
        Row(
            f"DDP pipeline / textbook DDP loop, {RANKS} CPU ranks (Gloo), MLP, batch {BATCH}/rank",
            f"{ratio:.3f}",
            ">= 0.97",
            ratio >= 0.97,
            f"global samples/s {per_epoch / median(t['pipeline']):,.0f} vs {per_epoch / median(t['textbook']):,.0f} "
            f"(second epoch of {per_epoch:,} samples; per-round ratios {ratios[0]:.3f}–{ratios[-1]:.3f}, "
            f"{len(ratios)} rounds)",
        )
    ]


def main(argv: list[str]) -> int:
    """One rank of the benchmark job: ``SAMPLES REPEATS WARMUP BATCH EPOCHS OUT.json`` (torchrun starts it)."""
    import torch.distributed as dist

    from pipeline.bench import Sizes, interleaved

    samples, repeats, warmup, batch, epochs = map(int, argv[:5])
    out = Path(argv[5])
    dist.init_process_group("gloo")  # once: both loops use the job's group (a group cannot be joined twice)
    times = interleaved(
        {
            "textbook": lambda: textbook(samples, batch, epochs),
            "pipeline": lambda: pipeline(samples, batch, epochs, out.parent / "ddp.db"),
        },
        Sizes(samples, repeats, warmup),
    )
    dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
