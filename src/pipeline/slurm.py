"""DDP without torchrun inside a multi-task SLURM job: torch.distributed's variables from SLURM's.

    python -m pipeline -m hydra/launcher=slurm hydra.launcher.gpus_per_node=4 hydra.launcher.tasks_per_node=4 ...

With ``tasks_per_node=N`` the submitit launcher starts every job as N processes per node (``srun``), one per
GPU. SLURM tells each one who it is (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``...), but
``torch.distributed``'s ``env://`` rendezvous reads torchrun's names (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).
``torch_env_from_slurm`` translates, without calling ``scontrol`` (one process per rank, each asking the controller,
is what cluster admins ask us not to do); ``pipeline.distributed`` exports the result before joining the group.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping

from pipeline.errors import PipelineError

PORT_BASE = 12_000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN: unprivileged, and below Linux's ephemeral
PORT_SPAN = 20_000  # ports (32768-60999), which outgoing connections take; consecutive jobs never share a port
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")  # one item of SLURM_TASKS_PER_NODE: "4" or "4(x2)"
_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")  # the step's first
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")  # one item inside a nodelist's brackets: "07" or "01-04"


class SlurmEnvironmentError(PipelineError):
    """A SLURM variable this module reads is missing or malformed; the message names it and its value."""


class SlurmMissing(PipelineError):
    """``hydra/launcher=slurm`` on a machine without SLURM's commands."""


def check_slurm_commands(launcher_target: str) -> None:
    """Refuse the SLURM launcher where ``srun`` or ``sbatch`` is missing, before a sweep opens its parent run:
    submitit finds out only once the first batch is launched, in a traceback.

    Args:
        launcher_target: ``hydra.launcher._target_``; other launchers pass.

    Raises:
        SlurmMissing: naming what is missing and the local launcher that tries the sweep on this machine.
    """
    if not launcher_target.endswith(".SlurmLauncher"):
        return
    missing = [command for command in ("srun", "sbatch") if shutil.which(command) is None]
    if missing:
        has = "neither" if len(missing) == 2 else f"no {missing[0]}"
        raise SlurmMissing(
            f"hydra/launcher=slurm needs SLURM's srun and sbatch, and this machine has {has} on its PATH: launch "
            "the sweep from the cluster's login node, or try it here with hydra/launcher=local"
        )


def torch_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torch.distributed's variables for this process, when it is one task of a multi-task SLURM job step.

    ``pipeline.distributed`` calls this when torchrun's variables are absent, so that a sweep launched with
    ``hydra/launcher=slurm`` and ``tasks_per_node=N`` trains with DDP, one rank per task. The step's own
    variables (``SLURM_STEP_*``, set by ``srun``) win over the job's: a step may use fewer tasks or nodes than the
    allocation, and only its tasks join the group. A ``MASTER_ADDR`` or ``MASTER_PORT`` already set (a site's
    setup script) is kept. Caution: a batch script that runs python itself, without ``srun``, also sees
    ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``: its one process would wait for ranks that never come.

    Args:
        environ: the process's environment (``os.environ``, or a dict in tests).

    Returns:
        ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (the step's first host) and
        ``MASTER_PORT`` (from ``SLURM_JOB_ID``, so two jobs on one node differ); None outside SLURM, in a one-task
        job, or when torchrun's ``RANK`` / ``WORLD_SIZE`` are already there.

    Raises:
        SlurmEnvironmentError: a variable needed is missing or malformed.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ or "SLURM_PROCID" not in environ:
        return None
    world = _integer(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if world is None or world <= 1:
        return None
    node = _integer(environ, "SLURM_NODEID") or 0
    local_world = _tasks_on_node(environ, node)
    nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    master_addr = environ.get("MASTER_ADDR") or first_host(nodelist)
    if "MASTER_PORT" in environ:
        master_port = environ["MASTER_PORT"]
    else:
        job = _integer(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            raise SlurmEnvironmentError("SLURM_JOB_ID is not set: set MASTER_PORT to a free port shared by all ranks")
        master_port = str(PORT_BASE + job % PORT_SPAN)
    return {
        "RANK": str(_required(environ, "SLURM_PROCID")),
        "LOCAL_RANK": str(_required(environ, "SLURM_LOCALID")),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }


def first_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist, compressed or not: ``gpu[01-04,07]`` → ``gpu01``, ``a1,b2`` → ``a1``,
    ``rack[2-3]-gpu[10-11]`` → ``rack2-gpu10`` (zero padding kept, as SLURM writes host names).

    Raises:
        SlurmEnvironmentError: brackets that do not close, or a range that is not ``N`` or ``N-M``.
    """
    host: list[str] = []
    pos = 0
    while pos < len(nodelist) and nodelist[pos] != ",":  # the first group ends at a comma outside brackets
        if nodelist[pos] != "[":
            host.append(nodelist[pos])
            pos += 1
            continue
        end = nodelist.find("]", pos)
        first = _RANGE.fullmatch(nodelist[pos + 1 : end].split(",")[0]) if end > 0 else None
        if first is None:
            raise SlurmEnvironmentError(f"SLURM nodelist {nodelist!r} is malformed: expected e.g. gpu[01-04,07]")
        host.append(first.group(1))
        pos = end + 1
    if not host:
        raise SlurmEnvironmentError(f"SLURM nodelist {nodelist!r} names no host")
    return "".join(host)


def _tasks_on_node(environ: Mapping[str, str], node: int) -> int:
    """This node's task count from ``SLURM_*TASKS_PER_NODE``: ``4``, or per node ``2(x3),1`` (nodes 0-2: 2, 3: 1)."""
    name = next((n for n in _PER_NODE if environ.get(n)), None)
    if name is None:
        raise SlurmEnvironmentError(f"none of {', '.join(_PER_NODE)} is set: cannot tell the tasks on this node")
    counts: list[int] = []
    for item in environ[name].split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None:
            raise SlurmEnvironmentError(f"{name}={environ[name]!r} is malformed: expected e.g. 4 or 4(x2),2")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if name == "SLURM_NTASKS_PER_NODE" or len(counts) == 1:  # one number for every node
        return counts[0]
    if node >= len(counts):
        raise SlurmEnvironmentError(f"{name}={environ[name]!r} has no entry for SLURM_NODEID={node}")
    return counts[node]


def _first(environ: Mapping[str, str], *names: str) -> str:
    for name in names:
        if environ.get(name):
            return environ[name]
    raise SlurmEnvironmentError(f"none of {', '.join(names)} is set")


def _integer(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as an integer; None when none is."""
    for name in names:
        value = environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise SlurmEnvironmentError(f"{name}={value!r} is not an integer") from None
    return None


def _required(environ: Mapping[str, str], name: str) -> int:
    value = _integer(environ, name)
    if value is None:
        raise SlurmEnvironmentError(f"{name} is not set: is this process a task started by srun?")
    return value
