"""SLURM through Hydra's submitit launcher: the launcher configs, the sbatch script they make, DDP's variables from
SLURM's, and real sweeps through the submitit local launcher (what CI runs in place of a cluster)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient

from helpers import cli, run_main
from pipeline.config import config_dir
from pipeline.parallel.distributed import Launch, launch_from
from pipeline.parallel.slurm import (
    PORT_BASE,
    PORT_SPAN,
    SlurmEnvironmentError,
    first_host,
    torch_env,
    torch_env_from_slurm,
)
from servers import mlflow_server

# A 2-node, 8-task job's batch script: the job's variables and SLURM_PROCID=0, but no step of srun's.
BATCH = {
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}

# One task of that job's step 0 (node 1, its second GPU), as `srun` in the batch script starts it.
RANK5 = {
    **BATCH,
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_NODELIST": "gpu[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
}


# The cluster sweep of docs/scaling-out.md: 4 GPUs, one DDP rank on each, per job; one job per batch size.
CLUSTER_SWEEP = [
    "-m",
    "hydra/launcher=slurm",
    "hydra.launcher.partition=gpu",
    "hydra.launcher.nodes=1",
    "hydra.launcher.gpus_per_node=4",
    "hydra.launcher.tasks_per_node=4",
    "hydra.launcher.timeout_min=240",
    "hydra.launcher.signal_delay_s=300",
    "+hydra.launcher.additional_parameters.account=myproject",
    "device=cuda",
    "loader.batch_size=64,128,256",
]


# docs/scaling-out.md's way to try the cluster sweep on this machine: the same launcher plugin, jobs as local processes.
LOCAL_SWEEP = [
    "-m",
    "hydra/launcher=local",
    "device=cpu",
    "trainer.epochs=1",
    "trainer.max_steps=2",
    "loader.batch_size=16,32",
]


def hydra_config(*overrides: str) -> Any:
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_a_task_of_a_multi_node_job_gets_torch_distributed_variables() -> None:
    assert torch_env_from_slurm(RANK5) == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu01",  # rank 0 runs on the first host
        "MASTER_PORT": str(PORT_BASE + 123456 % PORT_SPAN),
    }


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("gpu[01-04,07]", "gpu01"),  # zero padding kept
        ("a1,b2", "a1"),
        ("node7", "node7"),
        ("gpu-[007,001-004],cpu1", "gpu-007"),  # the first listed, not the smallest
        ("rack[2-3]-gpu[10-11],login[1-2]", "rack2-gpu10"),  # two bracket groups in one name
    ],
)
def test_the_master_is_the_first_host_of_a_compressed_nodelist(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host
    assert torch_env_from_slurm({**RANK5, "SLURM_STEP_NODELIST": nodelist})["MASTER_ADDR"] == host


@pytest.mark.parametrize("nodelist", ["gpu[01-", "gpu[]", "gpu[a-b]", ",a1"])
def test_a_malformed_nodelist_is_an_error_naming_it(nodelist: str) -> None:
    with pytest.raises(SlurmEnvironmentError, match=r"SLURM nodelist '.*' (is malformed|names no host)"):
        first_host(nodelist)


@pytest.mark.parametrize(
    ("per_node", "node", "local_world"),
    [
        ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, 3, 1),  # uneven: nodes 0-2 run 2 tasks, node 3 runs 1
        ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, 2, 2),
        ({"SLURM_TASKS_PER_NODE": "3,2(x2)"}, 0, 3),
        ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "2(x3),1"}, 3, 4),  # the request wins
        ({"SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_NTASKS_PER_NODE": "4"}, 0, 1),  # srun's step wins over both
    ],
)
def test_the_local_world_size_is_this_nodes_task_count(per_node: dict[str, str], node: int, local_world: int) -> None:
    environ = {k: v for k, v in RANK5.items() if k not in ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE")}
    environ |= {**per_node, "SLURM_STEP_NUM_TASKS": "7", "SLURM_NODEID": str(node)}
    assert torch_env_from_slurm(environ)["LOCAL_WORLD_SIZE"] == str(local_world)


def test_two_jobs_on_one_node_get_different_unprivileged_ports_and_a_set_port_is_kept() -> None:
    ports = [int(torch_env_from_slurm({**RANK5, "SLURM_JOB_ID": str(job)})["MASTER_PORT"]) for job in range(PORT_SPAN)]
    assert min(ports) >= 1024 and max(ports) < 32768  # unprivileged, below Linux's ephemeral range
    assert len(set(ports)) == PORT_SPAN  # PORT_SPAN consecutive job ids never share one
    set_by_site = {**RANK5, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}
    assert torch_env_from_slurm(set_by_site)["MASTER_ADDR"] == "10.0.0.7"
    assert torch_env_from_slurm(set_by_site)["MASTER_PORT"] == "29400"


@pytest.mark.parametrize(
    "environ",
    [
        {},  # not under SLURM
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},  # a one-task job
        {k: v for k, v in RANK5.items() if k != "SLURM_PROCID"},  # the job's variables, no task's (salloc's shell)
        {**RANK5, "SLURM_STEP_NUM_TASKS": "1"},  # srun -n 1 inside an 8-task allocation: one process
        {**RANK5, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"},  # torchrun set them: they stand
        {**RANK5, "WORLD_SIZE": "2"},
    ],
)
def test_no_variables_outside_a_multi_task_job_or_under_torchrun(environ: dict[str, str]) -> None:
    assert torch_env_from_slurm(environ) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_STEP_NUM_TASKS": "eight"}, r"SLURM_STEP_NUM_TASKS='eight' is not an integer"),
        ({"SLURM_STEP_TASKS_PER_NODE": "4x2"}, r"SLURM_STEP_TASKS_PER_NODE='4x2' is malformed"),
        (
            {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None},
            r"none of SLURM_STEP_TASKS_PER_NODE, .* is set",
        ),
        ({"SLURM_LOCALID": None}, r"SLURM_LOCALID is not set: is this process a task started by srun\?"),
        ({"SLURM_JOB_ID": None}, r"SLURM_JOB_ID is not set: set MASTER_PORT"),
    ],
)
def test_a_missing_or_malformed_variable_is_an_error_naming_it(change: dict[str, str | None], message: str) -> None:
    environ = {k: v for k, v in {**RANK5, **change}.items() if v is not None}
    with pytest.raises(SlurmEnvironmentError, match=message):
        torch_env_from_slurm(environ)


@pytest.mark.parametrize(
    "environ",
    [
        BATCH,  # sbatch --ntasks=8 running python itself: no step variables at all
        {**BATCH, "SLURM_STEP_ID": "4294967291", "SLURM_STEP_NUM_TASKS": "8"},  # the batch step's id (Slurm >= 20.11)
        {**BATCH, "SLURM_STEPID": "4294967294", "SLURM_STEP_NUM_TASKS": "8"},  # the batch step's id before 20.11
        {**BATCH, "SLURM_STEP_ID": "batch", "SLURM_STEP_NUM_TASKS": "8"},
    ],
)
def test_a_batch_script_running_python_itself_with_several_tasks_is_refused_naming_srun(
    environ: dict[str, str],
) -> None:
    with pytest.raises(SlurmEnvironmentError) as refused:
        torch_env(environ)
    message = str(refused.value)
    assert message.startswith("this process runs in the batch script of a SLURM job with 8 tasks (SLURM_NTASKS=8)")
    assert "`srun python -m pipeline ...`" in message and "hydra/launcher=slurm" in message and "\n" not in message


def test_a_step_of_fewer_tasks_than_the_job_is_that_many_ranks_and_a_one_task_batch_job_is_a_plain_run() -> None:
    step = {**RANK5, "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "8"}  # srun -n 8 inside a 16-task allocation
    assert torch_env(step)["WORLD_SIZE"] == "8"
    assert torch_env({**BATCH, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}) is None
    assert torch_env({k: v for k, v in BATCH.items() if k != "SLURM_NTASKS"}) is None  # no task count asked for


def test_the_batch_script_is_one_line_from_the_entry_point_before_any_group_or_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: the batch script's process took SLURM_NTASKS as its world size and waited 10 minutes in the group."""
    import torch.distributed

    def waits(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("joined a group whose other ranks never come")

    monkeypatch.setattr(torch.distributed, "init_process_group", waits)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in BATCH.items():
        monkeypatch.setenv(name, value)
    assert run_main(monkeypatch, "device=cpu", "trainer.max_steps=1") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this process runs in the batch script of a SLURM job with 8 tasks") and (
        err.count("\n") == 1
    )
    assert not (tmp_path / "mlflow.db").exists() and "RANK" not in os.environ


def test_a_task_of_a_submitit_local_job_gets_torch_distributed_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    task = {  # what submitit's local controller sets for task 1 of 2 (submitit/local/local.py)
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_LOCALID": "1",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_JOB_ID": "31337",
    }
    expected = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(PORT_BASE + 31337 % PORT_SPAN),  # the controller's pid: the same for both tasks
    }
    assert torch_env(task) == expected
    assert torch_env({**RANK5, **task}) == expected  # a local sweep started inside a SLURM step: submitit's tasks
    assert torch_env({**task, "SUBMITIT_LOCAL_NTASKS": "1"}) is None
    with pytest.raises(SlurmEnvironmentError, match="SUBMITIT_LOCAL_GLOBALID is not set: .* submitit's local"):
        torch_env({k: v for k, v in task.items() if k != "SUBMITIT_LOCAL_GLOBALID"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # launch_from exports the variables for the group
    assert launch_from(task) == Launch(rank=1, local_rank=1, world_size=2)
    assert os.environ["MASTER_PORT"] == expected["MASTER_PORT"]


def test_the_slurm_launcher_config_exposes_the_cluster_keys_and_asks_for_sigterm_before_the_limit() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hydra = hydra_config("hydra/launcher=slurm", "hydra.launcher.partition=gpu").hydra
    launcher = hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert {key: launcher[key] for key in ("partition", "nodes", "gpus_per_node", "tasks_per_node")} == {
        "partition": "gpu",  # as given
        "nodes": 1,
        "gpus_per_node": 1,
        "tasks_per_node": 1,
    }
    resources = ("cpus_per_task", "mem_gb", "timeout_min", "signal_delay_s", "max_num_timeout")
    assert [launcher[key] for key in resources] == [8, 32, 60, 120, 0]
    assert launcher.additional_parameters == {"signal": "TERM@120"}
    assert launcher.submitit_folder == f"{hydra.sweep.dir}/.submitit/%j"
    assert [str(w.message) for w in caught if "schema" in str(w.message)] == []


def test_the_local_launcher_config_runs_each_job_as_one_submitit_process() -> None:
    hydra = hydra_config("hydra/launcher=local").hydra
    launcher = hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.timeout_min) == (1, 1, 60)
    assert launcher.submitit_folder == f"{hydra.sweep.dir}/.submitit"  # no %j: the local controller made it a folder


@pytest.mark.parametrize(
    ("choice", "target"),
    [
        ("submitit_slurm", "submitit_launcher.SlurmLauncher"),  # the plugin's own configs, still there by name
        ("submitit_local", "submitit_launcher.LocalLauncher"),
        ("parallel", "parallel_launcher.ParallelLauncher"),  # Hydra's joblib launcher, recording lost workers
        ("basic", "BasicLauncher"),
    ],
)
def test_the_other_launchers_still_compose_under_their_own_names(choice: str, target: str) -> None:
    assert hydra_config(f"hydra/launcher={choice}").hydra.launcher._target_.endswith(target)


def test_the_readme_cluster_sweep_submits_one_array_task_per_job_with_the_resources_and_signal_asked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The command of docs/scaling-out.md through the real entry point, Hydra, the launcher and submitit, up to
    ``sbatch``: fake ``srun``/``sbatch`` stand in for the cluster, and the jobs are taken as done without running."""
    import submitit
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import DelayedSubmission

    bin_dir, script = tmp_path / "bin", tmp_path / "sbatch_script.sh"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that srun exists
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {script}\necho "Submitted batch job 4242"\n')
    for tool in ("srun", "sbatch"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(submitit.SlurmJob, "results", lambda job: [JobReturn(status=JobStatus.COMPLETED)])
    with mlflow_server(tmp_path / "server") as server:  # the team server that command records to
        assert run_main(monkeypatch, *CLUSTER_SWEEP, f"tracking.uri={server.uri}") == 0
        (parent,) = MlflowClient(server.uri).search_runs(experiment_ids=["1"])  # no job ran

    directives = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    for expected in (
        "--signal=TERM@300",  # SIGTERM 5 minutes before the limit, to every task: the pipeline's clean stop
        "--partition=gpu",
        "--nodes=1",
        "--gpus-per-node=4",
        "--ntasks-per-node=4",  # srun starts 4 processes: torch_env_from_slurm makes them ranks 0-3
        "--cpus-per-task=8",
        "--mem=32GB",
        "--time=240",
        "--account=myproject",
        "--array=0-2%3",  # one array task per job, all at once
        "--job-name=pipeline",
    ):
        assert f"#SBATCH {expected}" in directives
    assert not any("USR2" in line for line in directives)
    (folder,) = tmp_path.glob("multirun/*/*/.submitit")
    assert list(folder.rglob("%j")) == []  # sbatch's script names %j; submitit makes no folder of it here
    srun = next(line for line in script.read_text().splitlines() if line.startswith("srun "))
    assert srun.endswith(f"-u -m submitit.core._submit {folder}/%j")
    submitted = [DelayedSubmission.load(path).args for path in sorted(folder.glob("4242_*/*_submitted.pkl"))]
    assert [(args[0], args[2]) for args in submitted] == [  # each array task's overrides and job number
        (["device=cuda", f"loader.batch_size={size}", "tracking.uri=" + server.uri.replace(":", "\\:")], number)
        for number, size in enumerate((64, 128, 256))
    ]
    assert parent.data.tags["sweep.launcher"] == "slurm" and parent.data.tags["sweep.role"] == "parent"


def _cmdline(process: psutil.Process) -> list[str]:
    """A process's command line; empty once it has ended (a zombie until its parent reaps it)."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def sweep_runs(store: Path) -> tuple[Any, list[Any]]:
    """The one sweep's parent run and its jobs' runs, by job number."""
    runs = MlflowClient(f"sqlite:///{store}").search_runs(experiment_ids=["1"])
    (parent,) = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    return parent, sorted((r for r in runs if r is not parent), key=lambda r: int(r.data.tags["sweep.job"]))


@pytest.mark.slow
def test_the_readme_local_sweep_runs_each_job_in_a_submitit_process_under_the_parent(tmp_path: Path) -> None:
    store = tmp_path / "mlflow.db"  # the default store, in the folder the sweep is launched from
    proc = cli(*LOCAL_SWEEP, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent, children = sweep_runs(store)
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.launcher"] == "local"
    assert [(r.info.status, r.data.params["loader.batch_size"]) for r in children] == [
        ("FINISHED", "16"),
        ("FINISHED", "32"),
    ]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    job_pids = {r.data.tags["process.pid"] for r in children}
    assert len(job_pids) == 2 and parent.data.tags["process.pid"] not in job_pids  # submitit's own processes
    (folder,) = tmp_path.glob("multirun/*/*")
    assert len(list(folder.glob(".submitit/*_0_result.pkl"))) == 2  # what submitit handed back to the launcher
    assert list(tmp_path.rglob("%j")) == []  # before: an empty folder named %j, the template taken literally


@pytest.mark.slow
def test_a_local_job_of_two_tasks_trains_one_ddp_run_of_two_ranks(tmp_path: Path) -> None:
    """Before: submitit's local tasks were not mapped to ranks, so tasks_per_node=2 trained two separate runs."""
    two_tasks = ["hydra/launcher=local", "hydra.launcher.tasks_per_node=2", "hydra.launcher.gpus_per_node=0"]
    proc = cli("-m", *two_tasks, "device=cpu", "trainer.max_steps=4", "loader.batch_size=16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent, (job,) = sweep_runs(tmp_path / "mlflow.db")  # one run for the job: rank 0's
    assert (parent.info.status, job.info.status) == ("FINISHED", "FINISHED")
    p = job.data.params
    assert (p["distributed.world_size"], p["distributed.backend"], p["distributed.global_batch_size"]) == (
        "2",
        "gloo",
        "32",
    )
    (folder,) = tmp_path.glob("multirun/*/*/.submitit")
    assert len(list(folder.glob("*_0_log.err"))) == len(list(folder.glob("*_1_log.err"))) == 1  # the job's 2 tasks
    assert list(tmp_path.rglob("%j")) == []


@pytest.mark.slow
def test_sigterm_to_a_submitit_job_stops_it_with_a_checkpoint_and_resume_through_the_launcher_finishes_it(
    tmp_path: Path,
) -> None:
    """What the time limit's SIGTERM does to a SLURM job, on this machine: a clean stop while the sweep's other job
    runs on and is summarised, then the resume it shows."""
    store = tmp_path / "mlflow.db"
    job = ["device=cpu", "loader.batch_size=16", "monitor.plots=false", f"tracking.uri=sqlite:///{store}"]
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "CUDA_VISIBLE_DEVICES")}
    args = [sys.executable, "-m", "pipeline", "-m", "hydra/launcher=local", *job, "trainer.epochs=500,1"]
    sweep = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while True:  # both jobs did an epoch, and the one-epoch job ended: the 500-epoch one is mid-training now
            processes = psutil.Process(sweep.pid).children(recursive=True)
            tasks = [p for p in processes if "submitit.core._submit" in " ".join(_cmdline(p))]
            if len(list((tmp_path / "checkpoints").glob("*/last.pt"))) == 2 and len(tasks) == 1:
                break
            assert sweep.poll() is None and time.monotonic() < deadline, "the jobs did not reach their checkpoints"
            time.sleep(0.2)
        (task,) = tasks  # the 500-epoch job, under submitit's
        task.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=120)
    finally:  # a failed assertion must not leave a job training 500 epochs
        if sweep.poll() is None:
            processes += psutil.Process(sweep.pid).children(recursive=True)
            sweep.kill()
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()  # psutil checks it is still the same process first
    assert sweep.returncode == 1, err[-3000:]  # the sweep ends with the job stopped
    parent, (killed, other) = sweep_runs(store)
    assert (parent.info.status, killed.info.status, other.info.status) == ("KILLED", "KILLED", "FINISHED")
    summary = parent.data.tags["mlflow.note.content"]
    assert ": 2 runs in 2 rows" in summary and "| FINISHED |" in summary  # the launcher waited for the other job
    state = json.loads((tmp_path / "checkpoints" / killed.info.run_id / "state.json").read_text())
    assert state["status"] == "stopped"
    step = state["position"]["step"]
    logs = [log.read_text() for log in tmp_path.glob("multirun/*/*/.submitit/*_0_log.err")]  # jobs' stderr
    assert len(logs) == 2
    stopped = "stopped by SIGTERM at a step boundary; continue it with: python -m pipeline resume=<run id>"
    assert sum(stopped in log for log in logs) == 1

    again = [*job, "trainer.epochs=500", f"trainer.max_steps={step + 5}", f"resume={killed.info.run_id}"]
    proc = cli("-m", "hydra/launcher=local", *again, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = MlflowClient(f"sqlite:///{store}").get_run(killed.info.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["resumed_at_step"] == str(step)  # the same run, continued
    assert run.data.tags["mlflow.parentRunId"] != parent.info.run_id  # now under the resuming sweep's parent


def test_the_slurm_launcher_without_slurm_is_one_line_before_any_run_is_opened(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "bin").mkdir()  # a PATH with no srun or sbatch: a laptop, a CI runner
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert run_main(monkeypatch, "-m", "hydra/launcher=slurm", "loader.batch_size=32,64", "device=cpu") == 2
    err = capsys.readouterr().err
    assert err == (
        "error: hydra/launcher=slurm needs SLURM's srun and sbatch, and this machine has neither on its PATH: "
        "launch the sweep from the cluster's login node, or try it here with hydra/launcher=local; no job was started\n"
    )
    if (tmp_path / "mlflow.db").exists():
        assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(experiment_ids=["0", "1"]) == []
