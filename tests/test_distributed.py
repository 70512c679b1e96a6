"""DistributedDataParallel: the data shares, the decisions taken together, and real ``torchrun`` jobs on Gloo."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient

from helpers import run_main
from pipeline.config import load
from pipeline.data.loaders import EpochOrder, Shard, resident_share
from pipeline.engine.hot.loop import SOLO, EpochHooks, LossWindow, StepMetrics, train_epoch
from pipeline.engine.hot.memory import MicroBatcher
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.hot.step import Inputs, Peers, TrainState, run_step
from pipeline.engine.hot.timing import WallTimer
from pipeline.engine.run import rank_metrics
from pipeline.parallel import distributed
from pipeline.parallel.distributed import DistributedError, Launch, Solo, launch_from
from pipeline.train import train

FAULTS = Path(__file__).parent / "faults"  # sitecustomize.py: faults injected into one rank of a real job


# --- the data each rank reads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_ranks_batches_together_are_the_single_process_batches_of_the_global_size(shuffle: bool) -> None:
    size, per_rank, world = 96, 4, 3
    single = EpochOrder(size, seed=7, shuffle=shuffle)
    ranks = [EpochOrder(size, seed=7, shuffle=shuffle, shard=Shard(rank=r, world=world)) for r in range(world)]
    for order in [single, *ranks]:
        order.set_epoch(3)
    whole = single.indices()
    shares = [r.indices() for r in ranks]
    assert [len(s) for s in shares] == [32, 32, 32]
    for k in range(size // (per_rank * world)):
        together = torch.cat([s[k * per_rank : (k + 1) * per_rank] for s in shares])
        assert sorted(together.tolist()) == sorted(whole[k * per_rank * world : (k + 1) * per_rank * world].tolist())


def test_training_shares_are_padded_to_equal_length_and_evaluation_shares_are_disjoint_and_complete() -> None:
    train = [EpochOrder(10, seed=1, shuffle=True, shard=Shard(rank=r, world=4, pad=True)) for r in range(4)]
    assert [len(o) for o in train] == [3, 3, 3, 3]  # 12 slots: every rank takes as many steps
    seen = torch.cat([o.indices() for o in train]).tolist()
    assert set(seen) == set(range(10)) and len(seen) == 12
    val = [EpochOrder(10, seed=1, shuffle=False, shard=Shard(rank=r, world=4, pad=False)) for r in range(4)]
    assert [o.indices().tolist() for o in val] == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


def test_a_resumed_rank_skips_its_own_batches_in_the_sampler() -> None:
    order = EpochOrder(40, seed=3, shuffle=True, shard=Shard(rank=1, world=2))
    order.set_epoch(2)
    whole = order.indices()
    order.set_epoch(2, start=8)
    assert order.indices().tolist() == whole[8:].tolist() and len(order) == 12


def test_a_resident_rank_keeps_only_its_own_share() -> None:
    assert resident_share(10, Shard(rank=1, world=4, pad=True)).tolist() == [1, 5, 9]
    assert resident_share(10, Shard(rank=3, world=4, pad=True)).tolist() == [3, 7, 1]  # padded from the start
    assert resident_share(10, Shard(rank=3, world=4, pad=False)).tolist() == [3, 7]


# --- the launch ---------------------------------------------------------------------------------------------


def test_torchruns_variables_make_a_launch_and_a_plain_run_has_none() -> None:
    assert launch_from({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == Launch(1, 1, 2)
    assert launch_from({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert launch_from({}) is None
    assert isinstance(distributed.from_env({}), Solo)
    with pytest.raises(DistributedError, match="torchrun --nproc_per_node"):
        launch_from({"WORLD_SIZE": "2"})
    with pytest.raises(DistributedError, match="do not fit"):
        launch_from({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"})


def test_an_mps_run_under_torchrun_is_refused_before_anything_is_built() -> None:
    group = distributed.Group(Launch(0, 0, 2))
    with pytest.raises(DistributedError, match="MPS has no collective backend"):
        group.join(load(["device=mps"]).device)


def test_rank_0_records_every_rank_and_the_slowest_ranks_data_wait() -> None:
    metrics = rank_metrics(
        [
            {"data_wait_pct": 5.0, "samples_per_s": 100.0, "gpu_util_mean_pct": 90.0},
            {"data_wait_pct": 40.0, "samples_per_s": 60.0, "gpu_util_mean_pct": 50.0},
        ]
    )
    assert metrics["ranks/1/gpu_util_mean_pct"] == 50.0 and metrics["ranks/0/data_wait_pct"] == 5.0
    assert metrics["time/data_wait_pct_slowest_rank"] == 40.0 and metrics["time/slowest_rank"] == 1.0
    assert metrics["throughput/global_samples_per_s"] == 160.0
    assert rank_metrics([{"data_wait_pct": 5.0}]) == {}


# --- the decisions, with another rank played by a fake group -----------------------------------------------------


class OtherRanks(Solo):
    """This process plus ranks that are not here: ``agree`` reports what they decided on the given calls."""

    world_size = 2

    def __init__(self, *, fail_on: set[int] = frozenset(), stop_on: dict[int, int] | None = None) -> None:
        self.calls, self.fail_on, self.stop_on = 0, fail_on, stop_on or {}
        self.averaged = 0

    def agree(self, *, failed: bool, stop: int) -> tuple[bool, int]:
        self.calls += 1
        return failed or self.calls in self.fail_on, max(stop, self.stop_on.get(self.calls, 0))

    def average_gradients(self, model: torch.nn.Module) -> None:
        self.averaged += 1


def _state(batch: int) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
    return TrainState(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.amp.GradScaler("cpu", enabled=False),
        MicroBatcher(batch, batch),
    )


def _epoch(
    state: TrainState,
    group: Any,
    steps: int = 4,
    log: Any = lambda metrics, step: None,
    on_step: Any = lambda samples: None,
) -> Any:
    torch.manual_seed(1)
    batches = [(torch.randint(0, 255, (8, 1, 4, 4), dtype=torch.uint8), torch.randint(0, 4, (8,))) for _ in range(6)]
    return train_epoch(
        state,
        batches,
        inputs=Inputs(torch.device("cpu"), PrecisionPolicy("cpu", None), lambda x: x.float() / 255),
        timer=WallTimer(),
        hooks=EpochHooks(metrics=StepMetrics(log, every=2), on_step=on_step),
        max_steps=steps,
        peers=Peers(group),
    )


def test_when_another_rank_runs_out_of_memory_this_rank_shrinks_and_replays_the_same_step() -> None:
    alone, together = _state(8), _state(8)
    _epoch(alone, SOLO)
    group = OtherRanks(fail_on={2})  # the second step's first try: another rank ran out of memory
    stats = _epoch(together, group)
    assert together.micro.micro_batch == 4 and [e.step for e in together.micro.events] == [2]
    assert "another rank" in together.micro.events[0].message
    assert stats.steps == 4 and group.calls == 5 and group.averaged == 4  # one replay; one average per step
    for a, b in zip(alone.model.parameters(), together.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # the replayed step's gradients are the whole batch's


def test_a_stop_another_rank_received_ends_this_ranks_epoch_after_the_same_step() -> None:
    state = _state(8)
    stats = _epoch(state, OtherRanks(stop_on={3: 15}), steps=6)
    assert stats.stopped and stats.stop_signal == 15 and stats.steps == 3 and state.step == 3


def test_a_stop_agreed_while_another_rank_is_out_of_memory_abandons_the_step_on_every_rank() -> None:
    reference, state = _state(8), _state(8)
    _epoch(reference, SOLO, steps=2)
    group = OtherRanks(fail_on={3}, stop_on={3: 15})  # step 3's first try: out of memory elsewhere, and a stop
    stats = _epoch(state, group, steps=6)
    assert stats.stopped and stats.stop_signal == 15 and stats.steps == 2 and state.step == 2
    assert group.calls == 3 and group.averaged == 2 and not state.micro.events  # no retry, no average for step 3
    assert all(p.grad is None for p in state.model.parameters())  # the attempt's gradients are dropped
    for a, b in zip(reference.model.parameters(), state.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the weights of step 2: nothing of step 3 applied


def test_one_step_says_whether_it_fit_was_asked_to_stop_or_was_abandoned() -> None:
    torch.manual_seed(1)
    images, labels = torch.randint(0, 255, (8, 1, 4, 4), dtype=torch.uint8), torch.randint(0, 4, (8,))
    inputs = Inputs(torch.device("cpu"), PrecisionPolicy("cpu", None), lambda x: x.float() / 255)
    state = _state(8)
    fit = run_step(state, images, labels, inputs=inputs, peers=Peers(OtherRanks()))
    assert fit.fit and not fit.stopped and fit.loss is not None and fit.loss.requires_grad is False
    stopping = run_step(state, images, labels, inputs=inputs, peers=Peers(OtherRanks(stop_on={1: 15})))
    assert stopping.fit and stopping.stopped and stopping.stop_signal == 15  # applied; the epoch ends after it
    before = [p.detach().clone() for p in state.model.parameters()]
    abandoned = run_step(state, images, labels, inputs=inputs, peers=Peers(OtherRanks(fail_on={1}, stop_on={1: 2})))
    assert abandoned.abandoned and abandoned.loss is None and abandoned.stop_signal == 2
    for a, b in zip(before, state.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # nothing of the abandoned step was applied
    assert state.step == 0  # the loop counts steps, not the step


def test_the_logged_loss_is_every_ranks_mean_so_all_ranks_meet_a_nan_at_the_same_step() -> None:
    window = LossWindow(4, torch.device("cpu"), skipped_steps_expected=False, reduce=lambda t: t * 0 + float("nan"))
    window.add(torch.tensor(1.0), 8, 1)
    with pytest.raises(Exception, match="became nan at step 1"):
        window.close()


def test_the_run_hands_back_the_bare_model_and_leaves_the_job_after_every_rank_is_done(one_rank: Any) -> None:
    """A run's result once held DDP's wrapper, so it outlived the process group to the interpreter's exit, where a
    rank that had trained correctly aborted (Gloo torn down mid-finalisation): the result holds the bare model."""
    group = one_rank
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch's deprecations are not printed once per rank
        wrapped = group.wrap(model)
    wrapped(torch.randn(4, 3)).sum().backward()
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    assert group.unwrap(wrapped) is model and group.unwrap(torch.compile(wrapped)) is model
    assert Solo().unwrap(wrapped) is wrapped
    group.close(clean=True)  # the barrier before leaving: every rank past its last collective
    assert not torch.distributed.is_initialized()


# --- real torchrun jobs (Gloo on the CPU) ---------------------------------------------------------------------

STEPS, PER_RANK = 12, 16
COMMON = [
    "device=cpu",
    "trainer.epochs=1",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=2",
    "monitor.plots=false",
]


def torchrun(
    tmp_path: Path, *overrides: str, fault: str = "", timeout: int = 300, module: str = "pipeline"
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS), env.get("PYTHONPATH", "")]))
    env["PIPELINE_FAULT"] = fault
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", module]
    store = f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"
    return subprocess.run(
        [*command, *COMMON, f"loader.batch_size={PER_RANK}", store, *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def one_process_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same training in one process, with the global batch: what every DDP job must end with."""
    folder = tmp_path_factory.mktemp("single")
    cfg = load([*COMMON, f"loader.batch_size={2 * PER_RANK}", f"tracking.uri=sqlite:///{folder / 'mlflow.db'}"])
    os.chdir(folder)
    result = train(cfg, echo=False)
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


def only_run(tmp_path: Path) -> Any:
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(["1"])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # rank 0 alone owns the MLflow run
    return runs[0]


def final_weights(tmp_path: Path, run_id: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / "checkpoints" / run_id / "last.pt", weights_only=False)["model"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.slow  # about 30 s: both ranks build and time every candidate
def test_tune_under_torchrun_times_each_candidate_on_both_ranks_and_records_one_parent(tmp_path: Path) -> None:
    """Every trial is a collective step on both ranks: a rank timing another candidate, or deciding alone when to
    stop, would leave the other waiting in an all-reduce (or the job failing on mismatched shapes). Each rank decided
    by its own clock when a trial had timed enough steps, and the job hung in its probe."""
    tune = ["--budget-s", "20", "--steps", "4", "--warmup", "1"]  # short calls: several a trial, as many on each rank
    proc = torchrun(tmp_path, *tune, module="pipeline.tune", timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("\ncandidate ") == 1 and proc.stdout.count("\n  python -m pipeline ") == 1  # rank 0's
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pipeline-tune").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1 and len({r.data.tags["tune.candidate"] for r in children}) >= 2


@pytest.mark.slow
def test_two_ranks_record_one_run_and_end_with_the_one_process_weights(
    tmp_path: Path, one_process_weights: dict[str, torch.Tensor]
) -> None:
    proc = torchrun(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run(tmp_path)
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert (p["distributed.world_size"], p["distributed.backend"]) == ("2", "gloo")
    assert (p["distributed.batch_size_per_rank"], p["distributed.global_batch_size"]) == ("16", "32")
    assert {"ranks/0/data_wait_pct", "ranks/1/data_wait_pct", "time/data_wait_pct_slowest_rank"} <= set(
        run.data.metrics
    )
    assert "distributed 2 ranks over gloo, batch 16 per rank, 32 in all" in proc.stdout
    assert "FutureWarning" not in proc.stdout + proc.stderr  # no deprecated argument to DDP: no warning per rank
    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(
        run.info.run_id, "time/allreduce_ms"
    )
    assert [m.step for m in history] == list(range(2, STEPS + 1, 2)) and all(m.value > 0 for m in history)
    assert_same_weights(final_weights(tmp_path, run.info.run_id), one_process_weights)


@pytest.mark.slow
def test_an_out_of_memory_error_on_one_rank_shrinks_both_and_training_finishes(
    tmp_path: Path, one_process_weights: dict[str, torch.Tensor]
) -> None:
    # from step 3 on, rank 1 fits 8 samples, rank 0 all 16: step 3 is an overlapped one, where rank 1 sends zero
    # gradients into the all-reduce and the agreement read after it discards the step on both ranks
    proc = torchrun(tmp_path, fault="oom:1:8@3")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "out of memory on another rank" in output  # rank 0 shrank for rank 1
    assert re.search(r"\[rank 1\].*out of memory at step 3 with micro-batch 16", output)
    run = only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.metrics["oom/micro_batch_size"] == 8
    assert_same_weights(final_weights(tmp_path, run.info.run_id), one_process_weights)  # the global batch kept


def test_a_command_in_a_process_that_joined_a_group_before_it_returns_as_any_other(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # a test that joined a one-rank group earlier in this process: the command that follows is no rank of a job,
    # and must not end the process without its teardown (it would end the test run)
    monkeypatch.setattr(distributed, "_JOINED", [True])
    monkeypatch.chdir(tmp_path)
    assert run_main(monkeypatch, "tracking=none", "trainer.max_steps=2", "trainer.epochs=1") == 0


@pytest.mark.slow
def test_a_rank_whose_interpreter_would_abort_in_its_teardown_still_ends_a_finished_job_with_status_0(
    tmp_path: Path,
) -> None:
    # Gloo's C++ threads once aborted a rank at its exit, after the run had finished and was recorded: a worker
    # leaves without the interpreter's teardown, once its exit handlers have run and its output is flushed
    proc = torchrun(tmp_path, "trainer.max_steps=4", fault="abort_at_exit:1:")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert only_run(tmp_path).info.status == "FINISHED"
    assert "mlflow.pytorch.load_model(" in proc.stdout  # rank 0's summary, flushed before it left


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_both_at_the_same_step_and_resume_finishes_the_run(
    tmp_path: Path, one_process_weights: dict[str, torch.Tensor]
) -> None:
    proc = torchrun(tmp_path, fault="sigterm:1:5")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0  # both ranks exit 143, as a stopped run does
    stops = re.findall(r"\[rank (\d)\].*stopped at step (\d+)", output)
    assert sorted(stops) == [("0", "6"), ("1", "6")], output[-4000:]  # the signal came during step 5's agreement
    run = only_run(tmp_path)
    assert run.info.status == "KILLED"
    checkpoints = list((tmp_path / "checkpoints").rglob("last.pt"))
    assert len(checkpoints) == 1
    assert torch.load(checkpoints[0], weights_only=False)["position"]["step"] == 6

    resumed = torchrun(tmp_path, f"resume={run.info.run_id}")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    run = only_run(tmp_path)
    assert run.info.status == "FINISHED"
    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [2, 4, 6, 8, 10, 12]
    assert_same_weights(final_weights(tmp_path, run.info.run_id), one_process_weights)


def test_a_resident_loader_under_ddp_holds_only_this_ranks_share() -> None:
    from torch.utils.data import TensorDataset

    from pipeline.data import Place, Split, make_batches

    images = torch.arange(10, dtype=torch.uint8).view(10, 1, 1, 1)
    dataset = TensorDataset(images, torch.arange(10))
    cfg = load(["device=cpu", "loader=resident", "loader.batch_size=2"]).loader
    loader = make_batches(Split(dataset, train=True), cfg, Place(torch.device("cpu"), seed=0, rank=1, world=2))
    assert loader.labels.tolist() == [1, 3, 5, 7, 9] and len(loader) == 3
    val = make_batches(Split(dataset, train=False), cfg, Place(torch.device("cpu"), seed=0, rank=1, world=3))
    assert val.labels.tolist() == [1, 4, 7]


def test_the_quiet_torchrun_ends_a_stop_in_one_line_and_the_signals_exit_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import signal

    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from pipeline.parallel.launch import main as launch

    seen: list[list[str]] = []

    def stopped(argv: list[str]) -> None:  # what torchrun's agent raises once it has passed SIGTERM to the ranks
        seen.append(argv)
        raise SignalException("Process 4242 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torch.distributed.run, "main", stopped)
    with pytest.raises(SystemExit) as exit_:
        launch(["--standalone", "--nproc_per_node=2", "-m", "pipeline", "device=cpu"])
    assert exit_.value.code == 143 and seen == [["--standalone", "--nproc_per_node=2", "-m", "pipeline", "device=cpu"]]
    err = capsys.readouterr().err
    assert err.startswith("torchrun stopped by SIGTERM: every rank was passed the signal") and err.count("\n") == 1


# --- SLURM's one GPU per task; two torchrun "nodes" on one machine ----------------------------------------------


def fake_cuda_join(monkeypatch: pytest.MonkeyPatch, devices: int, environ: dict[str, str]) -> list[int]:
    """A machine whose process sees ``devices`` GPUs under ``environ``; the group is joined without NCCL."""
    import torch.distributed as dist

    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(os, "environ", environ)
    return chosen


SLURM_TASK_3 = {  # task 3 of a 4-task step on one node, started with --gpus-per-task=1: it sees its own GPU only
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
    "CUDA_VISIBLE_DEVICES": "0",
}


def test_a_slurm_task_bound_to_one_gpu_trains_on_cuda_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: LOCAL_RANK=3 with one visible device was refused, though SLURM had given the task its own GPU."""
    from pipeline.config import DeviceConfig

    chosen = fake_cuda_join(monkeypatch, devices=1, environ=dict(SLURM_TASK_3))
    group = distributed.Group(Launch(3, 3, 4))
    group.join(DeviceConfig("cuda"))
    assert chosen == [0] and group.backend == "nccl"
    assert group.place(torch.device("cuda")) == torch.device("cuda", 0)


@pytest.mark.parametrize(
    "environ",
    [
        {"CUDA_VISIBLE_DEVICES": "0"},  # torchrun: every process gets the same CUDA_VISIBLE_DEVICES
        {k: v for k, v in SLURM_TASK_3.items() if k != "SLURM_STEP_ID"},  # not a step: the batch script
        {**SLURM_TASK_3, "CUDA_VISIBLE_DEVICES": ""},  # one GPU on the node, not bound to the task
        {**SLURM_TASK_3, "SLURM_LOCALID": "0"},  # torchrun inside a step: its 4 processes share the task's one GPU
    ],
)
def test_one_gpu_shared_by_several_processes_of_a_node_is_still_refused(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]
) -> None:
    from pipeline.config import DeviceConfig

    chosen = fake_cuda_join(monkeypatch, devices=1, environ=environ)
    with pytest.raises(DistributedError, match=r"LOCAL_RANK=3 but this node has 1 GPU\(s\): .*--gpus-per-task=1"):
        distributed.Group(Launch(3, 3, 4)).join(DeviceConfig("cuda"))
    assert chosen == []


def two_nodes(tmp_path: Path, *overrides: str, fault: str = "") -> list[tuple[int, str]]:
    """Two torchrun "nodes" (``--nnodes=2``, one process each) on this machine, c10d rendezvous on 127.0.0.1: each
    node's exit status and output. Node 0 hosts the rendezvous; ranks go to nodes in the order they join."""
    from servers import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS), env.get("PYTHONPATH", "")]))
    env |= {"PIPELINE_FAULT": fault, "OMP_NUM_THREADS": "1"}
    port, store = free_port(), f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"
    nodes = []
    for node in (0, 1):
        launch = ["--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_backend=c10d"]
        launch += [f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_conf=is_host={int(node == 0)}"]
        launch += ["--rdzv_id=two-nodes", "--local_addr=127.0.0.1", "--max_restarts=0"]
        pipeline = ["-m", "pipeline", *COMMON, f"loader.batch_size={PER_RANK}", store, *overrides]
        log = (tmp_path / f"node{node}.log").open("w")  # files, not pipes: a full pipe would stall one node
        command = [sys.executable, "-m", "pipeline.launch", *launch, *pipeline]
        nodes.append((subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=log), log))
    try:
        codes = [process.wait(timeout=300) for process, _ in nodes]
    finally:
        for process, log in nodes:
            if process.poll() is None:
                process.kill()
            log.close()
    return [(code, (tmp_path / f"node{node}.log").read_text()) for node, code in enumerate(codes)]


@pytest.mark.slow
def test_two_nodes_stop_together_when_one_nodes_torchrun_is_stopped_and_resume_ends_with_the_one_process_weights(
    tmp_path: Path, one_process_weights: dict[str, torch.Tensor]
) -> None:
    nodes = two_nodes(tmp_path, fault="sigterm-torchrun:1:5")  # SIGTERM to the torchrun of rank 1's node
    output = "\n".join(text for _, text in nodes)
    assert sorted(code for code, _ in nodes) == [1, 143], output[-4000:]  # its node: the signal; the other: failed
    assert "torchrun stopped by SIGTERM: every rank was passed the signal" in output
    stops = re.findall(r"\[rank (\d)\].*stopped at step (\d+)", output)
    assert sorted(rank for rank, _ in stops) == ["0", "1"] and len({step for _, step in stops}) == 1, output[-4000:]
    run = only_run(tmp_path)  # one run, rank 0's, recorded from the other node
    assert run.info.status == "KILLED" and run.data.params["distributed.world_size"] == "2"
    (checkpoint,) = (tmp_path / "checkpoints").rglob("last.pt")
    assert torch.load(checkpoint, weights_only=False)["position"]["step"] == int(stops[0][1])

    resumed = two_nodes(tmp_path, f"resume={run.info.run_id}")
    assert [code for code, _ in resumed] == [0, 0], "\n".join(text for _, text in resumed)[-4000:]
    run = only_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert_same_weights(final_weights(tmp_path, run.info.run_id), one_process_weights)


# --- the all-reduce overlapped with backward (pipeline.parallel.overlap) ----------------------------------------------


class OverlappingRanks(OtherRanks):
    """``OtherRanks`` whose all-reduce can run inside the last backward: it notes whether this rank's backward had
    already run when each agreement was taken (it must not have, on an overlapped step)."""

    can_overlap = True

    def __init__(self, model: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model, self.reduced, self.backward_before_agreement = model, 0, []

    def agree(self, *, failed: bool, stop: int) -> tuple[bool, int]:
        self.backward_before_agreement.append(any(p.grad is not None for p in self.model.parameters()))
        return super().agree(failed=failed, stop=stop)

    def reduce_in_backward(
        self,
        model: torch.nn.Module,
        loss: torch.Tensor | None,
        *,
        step: int,
        micro: int,
        failed: bool,
        stop: int,
        carry: torch.Tensor | None = None,
    ) -> tuple[bool, int, None]:
        self.reduced += 1
        answer = self.agree(failed=failed, stop=stop)  # noted before this rank's backward: as it is issued
        if loss is not None:
            loss.backward()
        return (*answer, None)  # nothing carried: the window reduces its losses itself


def test_after_the_first_step_the_agreement_comes_before_the_backward_that_all_reduces() -> None:
    alone, together = _state(8), _state(8)
    _epoch(alone, SOLO)
    group = OverlappingRanks(together.model)
    _epoch(together, group)
    assert group.averaged == 1 and group.reduced == 3  # the first step by hand, the others inside backward
    assert group.backward_before_agreement == [True, False, False, False]
    for a, b in zip(alone.model.parameters(), together.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_out_of_memory_elsewhere_on_an_overlapped_step_replays_it_by_hand_then_overlaps_again() -> None:
    alone, together = _state(8), _state(8)
    _epoch(alone, SOLO)
    group = OverlappingRanks(together.model, fail_on={3})  # step 3's agreement: another rank ran out of memory
    stats = _epoch(together, group)
    assert stats.steps == 4 and together.micro.micro_batch == 4 and [e.step for e in together.micro.events] == [3]
    # step 3 replayed by hand; step 4 in two micro-batches, the first one's backward local, the last one's held
    assert group.backward_before_agreement == [True, False, False, True, True]
    # steps 1 and 3 (the replay) by hand; 2, 3 (its first attempt, all-reduced, then discarded by the agreement) and
    # 4 inside backward
    assert (group.averaged, group.reduced) == (2, 3)
    for a, b in zip(alone.model.parameters(), together.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # the replay's micro-batches sum to the whole batch's gradients


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real process group of one rank (Gloo): DDP's reducer, its hooks and the job's store, in this process."""
    from pipeline.config import DeviceConfig
    from servers import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    group = distributed.Group(Launch(0, 0, 1))
    group.join(DeviceConfig("cpu"))
    yield group
    group.close(clean=False)


def test_a_run_uses_a_process_group_its_caller_joined_and_leaves_it_to_the_caller(one_rank: Any) -> None:
    from pipeline.config import DeviceConfig

    run = distributed.Group(Launch(0, 0, 1))
    run.join(DeviceConfig("cpu"))  # the fixture's group, already joined: no second rendezvous
    run.close()
    assert torch.distributed.is_initialized()  # still the caller's
    with pytest.raises(
        DistributedError, match="already joined a gloo process group of 1 ranks; the run needs gloo with 2"
    ):
        distributed.Group(Launch(0, 0, 2)).join(DeviceConfig("cpu"))


def test_averaging_by_hand_sends_every_trainable_parameter_with_zeros_for_a_missing_gradient(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(2, 2)})
    wrapped = one_rank.wrap(model)
    model["used"](torch.randn(4, 3)).sum().backward()  # a step whose forward used one layer on this rank
    sent: list[int] = []
    real = torch.distributed.all_reduce
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: sent.append(t.numel()) or real(t, *a, **k))
    one_rank.average_gradients(wrapped)
    assert sent == [8 + 6]  # 2x3 + 2 used, 2x2 + 2 unused: the same sizes on every rank, whatever it used
    assert torch.equal(model["unused"].weight.grad, torch.zeros(2, 2))


def test_an_overlapped_step_records_its_all_reduce_time_and_a_one_process_run_records_none(one_rank: Any) -> None:
    state = _state(8)
    state.model = one_rank.wrap(state.model)
    state.optimizer = torch.optim.SGD(one_rank.unwrap(state.model).parameters(), lr=0.1)
    logged: list[dict[str, float]] = []
    _epoch(state, one_rank, log=lambda metrics, step: logged.append(metrics))  # steps 1-4, logged at 2 and 4
    # step 1 (averaged by hand) is measured for the first log, step 3 (overlapped: the hook saw its last gradient)
    # for the second; steps 2 and 4 run unwatched
    # train/lr with the first log only: a constant rate is logged once an epoch
    assert [sorted(m) for m in logged] == [
        ["time/allreduce_ms", "train/loss", "train/lr"],
        ["time/allreduce_ms", "train/loss"],
    ]
    assert all(m["time/allreduce_ms"] > 0 for m in logged) and one_rank.step_metrics() == {}  # read once
    assert Solo().step_metrics() == {}


def test_the_comm_clock_measures_one_step_per_logging_interval() -> None:
    from pipeline.parallel.overlap import CommClock

    clock = CommClock(torch.device("cpu"))
    for _ in range(3):  # three steps between logging points: only the first is measured
        clock.begin()
        clock.end()
    assert len(clock.spans) == 1 and clock.watch([torch.zeros(1, requires_grad=True)]) is None
    assert list(clock.metrics()) == ["time/allreduce_ms"] and clock.armed and clock.spans == []
    weight = torch.ones(2, requires_grad=True)
    watch = clock.watch([weight])
    assert clock.started is None
    (weight * 3).sum().backward()
    watch.remove()
    assert clock.started is not None  # begun when backward produced the last watched gradient


def test_an_out_of_memory_error_inside_an_overlapped_backward_leaves_the_job_with_one_line_saying_what_to_do(
    one_rank: Any,
) -> None:
    model = one_rank.wrap(torch.nn.Linear(3, 2))
    oom = torch.OutOfMemoryError("CUDA out of memory")
    one_rank.unwrap(model).weight.register_hook(lambda grad: (_ for _ in ()).throw(oom))
    with one_rank.no_sync(model):
        loss = model(torch.randn(4, 3)).sum()
    with pytest.raises(DistributedError) as failed:
        one_rank.reduce_in_backward(model, loss, step=7, micro=16, failed=False, stop=0)
    message = str(failed.value)
    assert "rank 0 ran out of memory in the backward of step 7 (micro-batch 16)" in message
    assert "loader.batch_size" in message and "oom.micro_batch_size smaller than 16" in message
    assert not torch.distributed.is_initialized()  # the others' all-reduce fails now, not at the timeout


@pytest.mark.slow
def test_an_out_of_memory_error_in_one_ranks_overlapped_backward_ends_the_job_failed_without_a_hang(
    tmp_path: Path,
) -> None:
    """Rank 1 runs out of memory inside step 3's backward while rank 0 is already in the all-reduce: rank 1 leaves
    the job, rank 0's all-reduce fails at once, and the run is FAILED with the reason (the group's timeout is 10
    minutes: a hang would fail this test by its own timeout)."""
    proc = torchrun(tmp_path, "trainer.max_steps=6", fault="oom_backward:1:3", timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    run = only_run(tmp_path)
    assert run.info.status == "FAILED"
    error = run.data.tags["error"]
    assert "rank 1 ran out of memory in the backward of step 3 (micro-batch 16)" in error, error
    assert "loader.batch_size" in error
    assert re.search(r"error: rank 1 ran out of memory in the backward of step 3", proc.stderr), output[-4000:]


def test_an_agreement_broken_by_a_rank_that_left_raises_the_reason_it_posted(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NCCL a peer's backward does not wait for the all-reduce: it meets the departed rank at the next agreement."""
    from pipeline.parallel.overlap import FAILURE_KEY

    torch.distributed.distributed_c10d._get_default_store().set(FAILURE_KEY, "rank 1 ran out of memory in the backward")

    def closed(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:41859")

    monkeypatch.setattr(torch.distributed, "all_reduce", closed)
    with pytest.raises(DistributedError, match="^rank 1 ran out of memory in the backward$"):
        one_rank.agree(failed=False, stop=0)


def test_on_the_cpu_the_agreement_travels_in_the_gradients_own_all_reduce(one_rank: Any) -> None:
    """One collective per overlapped step, not two: the flags are the gradient of one more parameter that DDP
    all-reduces with the others, and the gradients that come back are those DDP's own all-reduce gives."""
    from pipeline.parallel import overlap
    from pipeline.parallel.overlap import pack_agreement, read_agreement

    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 2)
    model = one_rank.wrap(torch.nn.Linear(3, 2))
    one_rank.unwrap(model).load_state_dict(plain.state_dict())
    x = torch.randn(4, 3)
    group = torch.distributed.distributed_c10d._get_default_group()
    collectives = []
    for failed, stop in [(False, 0), (True, 15), (False, 0), (False, 2)]:  # the answer never leaks into a later step
        one_rank.unwrap(model).zero_grad(set_to_none=True)
        with one_rank.no_sync(model):
            loss = model(x).sum()
        before = group._get_sequence_number_for_group()  # counts this group's collectives
        answer = one_rank.reduce_in_backward(model, loss, step=2, micro=4, failed=failed, stop=stop)
        assert answer == (failed, stop, None)
        collectives.append(group._get_sequence_number_for_group() - before)
    assert collectives[1:] == [1, 1, 1]  # the first step also re-orders DDP's buckets (a broadcast of their sizes)
    answer = model.module.agreement.grad  # in DDP's bucket, never the shared all-zero flags that it summed
    assert answer.data_ptr() != overlap._NOTHING.data_ptr() and not overlap._NOTHING.any()
    plain(x).sum().backward()
    for a, b in zip(plain.parameters(), one_rank.unwrap(model).parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)  # one rank: the average is the gradient
    assert read_agreement(pack_agreement(False, 0) + pack_agreement(False, 2) + pack_agreement(True, 15)) == (True, 15)
    assert read_agreement(pack_agreement(False, 0) * 2) == (False, 0)


def test_on_the_cpu_a_logging_steps_loss_average_travels_in_the_gradients_all_reduce(one_rank: Any) -> None:
    """A logging point costs no collective of its own: the interval's losses ride the logging step's gradient
    all-reduce (a separate blocking all-reduce every 10 steps cost about 2.5% of a small MLP's training on 2 CPU
    ranks), and the loss logged is the same as a one-process run's."""
    alone, together = _state(8), _state(8)
    together.model = one_rank.wrap(together.model)
    together.optimizer = torch.optim.SGD(one_rank.unwrap(together.model).parameters(), lr=0.1)
    group = torch.distributed.distributed_c10d._get_default_group()
    marks: list[int] = []
    expected: list[float] = []
    logged: list[float] = []
    _epoch(alone, SOLO, steps=6, log=lambda metrics, step: expected.append(metrics["train/loss"]))
    _epoch(
        together,
        one_rank,
        steps=6,
        log=lambda metrics, step: logged.append(metrics["train/loss"]),
        on_step=lambda samples: marks.append(group._get_sequence_number_for_group()),
    )
    marks.append(group._get_sequence_number_for_group())
    # steps 3-6 are overlapped (step 1 is averaged by hand, step 2 also re-orders DDP's buckets); 4 and 6 are logged
    assert [b - a for a, b in itertools.pairwise(marks[1:])] == [1, 1, 1, 1, 0]
    assert len(logged) == 3
    torch.testing.assert_close(logged, expected)


def test_what_ddp_wraps_is_trained_and_checkpointed_without_the_agreements_parameter(one_rank: Any) -> None:
    from pipeline.parallel.overlap import unwrap

    model = torch.nn.Linear(3, 2)
    wrapped = one_rank.wrap(model)
    assert one_rank.unwrap(wrapped) is model and unwrap(wrapped) is model
    assert list(unwrap(wrapped).state_dict()) == ["weight", "bias"]
    assert sum(p.numel() for p in wrapped.parameters()) == 8 + 66 + 64  # the agreement and a window of losses
