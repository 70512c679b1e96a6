"""DDP without torchrun: torch.distributed's variables from SLURM's job step, or from submitit's local tasks.

    python -m pipeline -m hydra/launcher=slurm hydra.launcher.gpus_per_node=4 hydra.launcher.tasks_per_node=4 ...
    srun python -m pipeline ...                     # in a batch script with --ntasks-per-node=4

With ``tasks_per_node=N`` the submitit launcher starts every job as N processes per node (``srun``), one per
GPU. SLURM tells each one who it is (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_STEP_NUM_TASKS``...), but
``torch.distributed``'s ``env://`` rendezvous reads torchrun's names (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).
``torch_env`` translates, without calling ``scontrol`` (one process per rank, each asking the controller, is what
cluster admins ask us not to do); ``pipeline.parallel.distributed`` exports the result before joining the group.

Only the tasks of a job step are ranks. srun sets the step's variables (``SLURM_STEP_ID``, ``SLURM_STEP_NUM_TASKS``,
``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``: Slurm's ``env_array_for_step`` in src/common/env.c, and the
srun(1) man page's OUTPUT ENVIRONMENT VARIABLES). The batch script is not a step srun started: its environment
(``env_array_for_batch_job``) has the job's ``SLURM_NTASKS`` and ``SLURM_PROCID=0`` but no ``SLURM_STEP_NUM_TASKS``,
and its step id, where one is set, is Slurm's batch sentinel (``SLURM_BATCH_SCRIPT``: 0xfffffffb in current slurm.h,
0xfffffffe in older releases; every special step id is above ``SLURM_MAX_NORMAL_STEP_ID``, 0xfffffff0). A python
started there directly is one process: with several tasks asked for, it is refused in one line instead of waiting
for ranks that never come.

submitit's local executor (``hydra/launcher=local`` with ``tasks_per_node=N``) starts N processes on this machine
with its own variables (``SUBMITIT_LOCAL_*``: submitit/local/local.py, ``Controller.start_tasks`` and
``LocalJobEnvironment``); they are mapped the same way, so the N tasks train one DDP run.

submitit's own ``helpers.TorchDistributedEnvironment`` is not used: it reads the job's ``SLURM_NTASKS`` and
``SLURM_JOB_NODELIST`` rather than the step's, rewrites ``CUDA_VISIBLE_DEVICES`` to the local rank (wrong where the
site already bound one GPU per task), draws ``MASTER_PORT`` from 20000-60000 (inside Linux's ephemeral ports), and
reads ``os.environ`` only. Only the first host of a nodelist is needed, which ``first_host`` reads without
expanding the list (no python-hostlist dependency).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping

from pipeline.common.errors import PipelineError

PORT_BASE = 12_000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN: unprivileged, and below Linux's ephemeral
PORT_SPAN = 20_000  # ports (32768-60999), which outgoing connections take; consecutive jobs never share a port
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")  # one item of SLURM_TASKS_PER_NODE: "4" or "4(x2)"
_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")  # the step's first
MAX_NORMAL_STEP_ID = 0xFFFFFFF0  # slurm.h's SLURM_MAX_NORMAL_STEP_ID: batch, extern, interactive steps are above
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")  # one item inside a nodelist's brackets: "07" or "01-04"


class SlurmEnvironmentError(PipelineError):
    """SLURM's (or submitit's) variables cannot make this process a rank: one is missing or malformed (the message
    names it and its value), or the process is the batch script of a job with several tasks (run it with srun)."""


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


def torch_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torch.distributed's variables for this process when a launcher other than torchrun started several.

    Args:
        environ: the process's environment (``os.environ``, or a dict in tests).

    Returns:
        ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for one
        task of a multi-task SLURM job step or submitit local job; None for one process, or when torchrun's ``RANK``
        / ``WORLD_SIZE`` are already there.

    Raises:
        SlurmEnvironmentError: a variable needed is missing or malformed, or a SLURM batch script with several tasks
            runs python itself instead of through ``srun``.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return None
    if environ.get("SUBMITIT_EXECUTOR") == "local":  # also inside a SLURM allocation: the local tasks are the ranks
        return torch_env_from_submitit_local(environ)
    return torch_env_from_slurm(environ)


def torch_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torch.distributed's variables for this process, when it is one task of a multi-task SLURM job step.

    A sweep launched with ``hydra/launcher=slurm`` and ``tasks_per_node=N`` (or ``srun python -m pipeline`` in a
    batch script) trains with DDP, one rank per task of the step. Only the step's variables count: a step may use
    fewer tasks or nodes than the allocation, and only its tasks join the group. A ``MASTER_ADDR`` or
    ``MASTER_PORT`` already set (a site's setup script) is kept.

    Returns:
        The variables (``MASTER_ADDR``: the step's first host; ``MASTER_PORT``: from ``SLURM_JOB_ID``, so two jobs
        on one node differ); None outside SLURM, in a one-task step or job, or under torchrun.

    Raises:
        SlurmEnvironmentError: a variable needed is missing or malformed, or this process is the batch script of a
            job with several tasks (no ``srun``).
    """
    if "RANK" in environ or "WORLD_SIZE" in environ or "SLURM_PROCID" not in environ:
        return None
    if not in_job_step(environ):
        tasks = _integer(environ, "SLURM_NTASKS", "SLURM_NPROCS")
        if tasks is not None and tasks > 1:
            raise SlurmEnvironmentError(
                f"this process runs in the batch script of a SLURM job with {tasks} tasks (SLURM_NTASKS={tasks}), "
                "not in a job step, so it would train alone while waiting for the other ranks: start one process "
                "per task with `srun python -m pipeline ...` in the batch script, launch the sweep with "
                "hydra/launcher=slurm, or ask for --ntasks=1"
            )
        return None
    world = _required(environ, "SLURM_STEP_NUM_TASKS")
    if world <= 1:
        return None
    node = _integer(environ, "SLURM_NODEID") or 0  # the node's index within the step
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


def in_job_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of a job step that srun started (not the batch script, not salloc's shell).

    srun sets ``SLURM_STEP_ID`` (and the older ``SLURM_STEPID``) to the step's number and ``SLURM_STEP_NUM_TASKS``;
    the batch script has no ``SLURM_STEP_NUM_TASKS``, and a step id above ``MAX_NORMAL_STEP_ID`` (or a name such as
    ``batch``) is one of SLURM's special steps (batch, extern, interactive), never several ranks.
    """
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if not step or not environ.get("SLURM_STEP_NUM_TASKS"):
        return False
    return step.isdigit() and int(step) < MAX_NORMAL_STEP_ID


def torch_env_from_submitit_local(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torch.distributed's variables for one of the ``tasks_per_node`` processes of a submitit local job.

    submitit's controller starts every task with ``SUBMITIT_LOCAL_NTASKS``, ``SUBMITIT_LOCAL_GLOBALID``,
    ``SUBMITIT_LOCAL_LOCALID`` and ``SUBMITIT_LOCAL_JOB_ID`` (the controller's pid, the same for every task of the
    job): one machine, so the master is 127.0.0.1 and the port comes from the job id, as for SLURM.

    Returns:
        The variables; None for a one-task job.

    Raises:
        SlurmEnvironmentError: a variable needed is missing or malformed.
    """
    world = _integer(environ, "SUBMITIT_LOCAL_NTASKS")
    if world is None or world <= 1:
        return None
    job = _required(environ, "SUBMITIT_LOCAL_JOB_ID", started_by="submitit's local executor")
    return {
        "RANK": str(_required(environ, "SUBMITIT_LOCAL_GLOBALID", started_by="submitit's local executor")),
        "LOCAL_RANK": str(_required(environ, "SUBMITIT_LOCAL_LOCALID", started_by="submitit's local executor")),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),  # submitit's local executor runs one node
        "MASTER_ADDR": environ.get("MASTER_ADDR") or "127.0.0.1",
        "MASTER_PORT": environ.get("MASTER_PORT") or str(PORT_BASE + job % PORT_SPAN),
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


def _required(environ: Mapping[str, str], name: str, *, started_by: str = "srun") -> int:
    value = _integer(environ, name)
    if value is None:
        raise SlurmEnvironmentError(f"{name} is not set: is this process a task started by {started_by}?")
    return value
