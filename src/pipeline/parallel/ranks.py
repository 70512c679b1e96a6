"""Where this process sits in a job: its rank, local rank and world size from torchrun's variables (or a SLURM job
step's, or submitit's local tasks'), and the GPU it trains on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pipeline.common.errors import PipelineError
from pipeline.parallel.slurm import in_job_step, torch_env


class DistributedError(PipelineError):
    """The launch or the process group cannot work (bad environment, unsupported device, another rank failed)."""


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the job, as the launcher (torchrun, SLURM) set it."""

    rank: int
    local_rank: int
    world_size: int


def launch_from(environ: Mapping[str, str]) -> Launch | None:
    """The launch described by torchrun's variables (or a multi-task SLURM job step's, or submitit's local tasks'),
    or None for a plain run.

    Raises:
        DistributedError: the variables are present but inconsistent.
        SlurmEnvironmentError: SLURM's or submitit's variables are malformed, or a SLURM batch script with several
            tasks runs python without ``srun`` (one line, before anything waits for ranks that never come).
    """
    env: Mapping[str, str] = environ
    if "WORLD_SIZE" not in env and "RANK" not in env:
        env = torch_env(environ) or environ
        if env is not environ:
            os.environ.update({k: v for k, v in env.items() if k not in environ})  # MASTER_ADDR & co. for the group
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank, local = int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
    except (KeyError, ValueError) as err:
        raise DistributedError(
            f"WORLD_SIZE={env.get('WORLD_SIZE')} but RANK={env.get('RANK')} LOCAL_RANK={env.get('LOCAL_RANK')}: "
            "start several processes with torchrun --nproc_per_node=N -m pipeline ..., which sets them all"
        ) from err
    if not 0 <= rank < world or local < 0:
        raise DistributedError(f"RANK={rank} LOCAL_RANK={local} do not fit WORLD_SIZE={world}")
    return Launch(rank, local, world)


def cuda_index(local_rank: int, environ: Mapping[str, str] | None = None) -> int:
    """The CUDA device this rank trains on: ``LOCAL_RANK``, one GPU per process of the node; or 0 where each task of
    a SLURM job step sees one GPU of its own (``--gpus-per-task=1``, ``--gpu-bind=single:1``: SLURM sets
    ``CUDA_VISIBLE_DEVICES`` per task, so every rank's GPU is its ``cuda:0``).

    One visible GPU and several processes on the node stay refused unless the rank is SLURM's own task
    (``SLURM_LOCALID``): torchrun and submitit's local executor, also inside a SLURM step, hand every process they
    start the same ``CUDA_VISIBLE_DEVICES``, so their ranks would share that GPU.

    Raises:
        DistributedError: fewer GPUs than processes on this node.
    """
    environ = os.environ if environ is None else environ
    count = torch.cuda.device_count()
    if local_rank < count:
        return local_rank
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if count == 1 and len(visible) == 1 and in_job_step(environ) and environ.get("SLURM_LOCALID") == str(local_rank):
        return 0
    raise DistributedError(
        f"LOCAL_RANK={local_rank} but this node has {count} GPU(s): start at most {count} process(es) per node "
        f"(torchrun --nproc_per_node={count}), give each SLURM task its own GPU (--gpus-per-task=1), or device=cpu"
    )
