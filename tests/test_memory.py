"""Out-of-memory fallback: recognised forms only, effective batch kept, memory freed, clear failure."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

import pipeline.engine.building.build as build_module
from helpers import without_first_batch_check, without_replay_check
from pipeline.common.device_memory import is_oom
from pipeline.config import ConfigError, RunConfig
from pipeline.engine.hot.memory import (
    MicroBatcher,
    OomFailure,
    OutOfMemory,
    OutOfMemoryAtMinimum,
    single_sample_tail,
)
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.79 GiB total capacity)",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB)",
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 1099511627776 bytes.",
    ],
)
def test_every_known_out_of_memory_form_is_recognised(message: str) -> None:
    assert is_oom(RuntimeError(message))


def test_torch_out_of_memory_error_is_recognised_whatever_its_message() -> None:
    assert is_oom(torch.OutOfMemoryError("anything"))


@pytest.mark.parametrize(
    "err",
    [
        ValueError("CUDA out of memory"),  # right words, wrong kind: not from the allocator
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: no kernel image is available for execution on the device"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x784 and 512x10)"),
    ],
)
def test_other_errors_are_not_out_of_memory(err: Exception) -> None:
    assert not is_oom(err)


def oom_above(limit: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
    """A forward pre-hook that raises a real torch.OutOfMemoryError for inputs of more than ``limit`` samples."""

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if inputs[0].shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {inputs[0].shape[0]} samples")

    return hook


def with_hook(monkeypatch: pytest.MonkeyPatch, hook, seen: list[int] | None = None) -> None:
    """``hook`` on the model's forwards in training and evaluation; the start-up check of the first batch (one more
    forward, before the run) and the replay check (a few more after the first epoch) are left out, so that the
    faults land where the tests put them."""
    original = build_module.build_model
    without_first_batch_check(monkeypatch)
    without_replay_check(monkeypatch)

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        model.register_forward_pre_hook(hook)
        if seen is not None:
            model.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]) if m.training else None)
        return model

    monkeypatch.setattr(build_module, "build_model", build)


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.state_dict().values()])


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_effective_batch(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["tracking=none", "loader.batch_size=64", "trainer.max_steps=6"]
    reference = train(make_cfg(*base, "oom.micro_batch_size=16"), echo=False)

    seen: list[int] = []
    steps: list[int] = []
    with_hook(monkeypatch, oom_above(16), seen)
    original = build_module.build_optimizer

    def counting(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        optimizer.register_step_post_hook(lambda opt, a, k: steps.append(1))
        return optimizer

    monkeypatch.setattr(build_module, "build_optimizer", counting)
    result = train(make_cfg(*base), echo=False)

    assert [e.micro_batch for e in result.oom_events] == [64, 32] and result.micro_batch == 16
    assert len(steps) == 6  # exactly one optimizer step per batch, failed attempts included
    assert sum(seen) == 6 * 64 and set(seen) == {16}  # every sample once, none skipped or repeated
    torch.testing.assert_close(weights(result.model), weights(reference.model), rtol=0, atol=1e-12)


def test_accumulated_micro_batches_match_the_whole_batch_in_float64(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = build_module.build_model
    monkeypatch.setattr(build_module, "build_model", lambda *a, **k: original(*a, **k).double())
    monkeypatch.setattr(
        "pipeline.data.loaders.Normalize.__call__",
        lambda self, images: images.double() * self.scale.double() + self.shift.double(),
    )
    base = ["tracking=none", "loader.batch_size=64", "trainer.max_steps=5"]
    whole = train(make_cfg(*base), echo=False)
    micro = train(make_cfg(*base, "oom.micro_batch_size=8"), echo=False)
    torch.testing.assert_close(weights(micro.model), weights(whole.model), rtol=0, atol=1e-10)


def test_the_failed_steps_tensors_are_freed_before_the_retry(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake OOM is raised inside the forward pass, after the first layer's activations exist and are
    saved for backward; by the retry they must be gone (only the traceback could have kept them)."""
    activations: list[weakref.ref] = []
    alive_at_retry: list[bool] = []
    original = build_module.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)  # Flatten, Linear, ReLU, Linear

        def after_relu(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if module.training and output.shape[0] > 16:
                activations.append(weakref.ref(output))  # held by autograd (ReLU saves its output) and the frames
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

        def before_forward(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if module.training and activations and len(alive_at_retry) < len(activations):
                gc.collect()
                alive_at_retry.append(activations[-1]() is not None)

        model[2].register_forward_hook(after_relu)
        model.register_forward_pre_hook(before_forward)
        return model

    monkeypatch.setattr(build_module, "build_model", build)
    result = train(make_cfg("tracking=none", "loader.batch_size=32", "trainer.max_steps=2"), echo=False)
    assert result.micro_batch == 16 and len(activations) == 1 and alive_at_retry == [False]


def test_out_of_memory_at_the_minimum_fails_the_run_clearly(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    with_hook(monkeypatch, oom_above(0))
    with pytest.raises(
        OutOfMemoryAtMinimum,
        match=r"out of memory at step 1 even with a micro-batch of 4 "
        r"\(oom.min_micro_batch=4",
    ):
        train(make_cfg("loader.batch_size=16", "oom.min_micro_batch=4"), echo=False)
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "FAILED" and "OutOfMemoryAtMinimum" in run.data.tags["error"]
    history = MlflowClient(store_uri).get_metric_history(run.info.run_id, "oom/micro_batch_size")
    assert [m.value for m in history] == [8.0, 4.0]


def test_other_errors_pass_through_without_a_retry(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        calls.append(1)
        raise RuntimeError("CUDA error: device-side assert triggered")

    with_hook(monkeypatch, hook)
    with pytest.raises(RuntimeError, match="device-side assert"):
        train(make_cfg("tracking=none"), echo=False)
    assert calls == [1]


def test_disabled_fallback_raises_the_out_of_memory_error(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch) -> None:
    with_hook(monkeypatch, oom_above(16))
    with pytest.raises(
        OutOfMemory, match=r"^out of memory \(CUDA out of memory. Tried to allocate 32 samples\)"
    ) as info:
        train(make_cfg("tracking=none", "oom.enabled=false"), echo=False)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)  # no retry: the first error ends the run


def test_evaluation_falls_back_on_its_own_without_shrinking_the_training_micro_batch(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    def eval_only(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if not module.training and inputs[0].shape[0] > 10:
            raise torch.OutOfMemoryError("CUDA out of memory")

    reference = train(make_cfg("tracking=none", "trainer.epochs=2", "trainer.max_steps=-1"), echo=False)
    with_hook(monkeypatch, eval_only)
    result = train(make_cfg("trainer.epochs=2", "trainer.max_steps=-1"), echo=False)
    assert result.micro_batch == 32 and not result.oom_events  # training kept its whole batch
    assert result.eval_micro_batch == 8
    assert torch.equal(weights(result.model), weights(reference.model))
    assert result.epochs[-1].val_acc == reference.epochs[-1].val_acc
    assert result.epochs[-1].val_loss == pytest.approx(reference.epochs[-1].val_loss, rel=1e-6)
    history = MlflowClient(store_uri).get_metric_history(result.run_id, "oom/eval_micro_batch_size")
    assert [(m.step, m.value) for m in history] == [(1, 8.0), (2, 8.0)]


CUDNN_NOT_SUPPORTED = (
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
)


def test_cudnn_not_supported_is_out_of_memory_only_on_a_nearly_full_device(monkeypatch: pytest.MonkeyPatch) -> None:
    err = RuntimeError(CUDNN_NOT_SUPPORTED)
    assert not is_oom(err) and is_oom(err, nearly_full=True)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 78_000e6)
    micro = MicroBatcher(batch_size=64, micro_batch=64)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40e9, 80e9))  # half free: a layout problem
    assert micro.diagnose(err, gpu) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1e9, 80e9))  # 1.25% free: no workspace fits
    assert micro.diagnose(err, gpu) == OomFailure(CUDNN_NOT_SUPPORTED, 78_000.0)


class FakeAllocator:
    """CUDA's caching allocator as far as the figures go: ``empty_cache`` frees cached blocks but leaves the peak
    (as the real one does); only ``reset_peak_memory_stats`` starts it again from what is allocated; the retry
    counter grows until ``reset_accumulated_memory_stats``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.allocated, self.peak, self.retries = 100e6, 100e6, 0
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: self.peak)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: self.allocated)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1e9, 8e9))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda device: setattr(self, "retries", 0))
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": self.retries})
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    def fail_at(self, used: float) -> torch.OutOfMemoryError:
        """A step that reached ``used`` bytes and failed: the peak holds it, then its tensors are freed."""
        self.peak, self.retries = max(self.peak, used), self.retries + 1
        return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")


def test_each_out_of_memory_event_records_its_own_peak_not_an_earlier_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = torch.device("cuda", 0)
    allocator = FakeAllocator(monkeypatch)
    micro = MicroBatcher(batch_size=64, micro_batch=64)
    events = []
    for used in (7_900e6, 5_200e6):  # micro-batch 64 failed at 7.9 GB, then 32 at 5.2 GB
        try:
            raise allocator.fail_at(used)
        except torch.OutOfMemoryError as err:
            failure = micro.diagnose(err, gpu)
        events.append(micro.recover(failure, step=3, optimizer=None, scaler=None, device=gpu))
    assert [(e.micro_batch, e.memory_mb) for e in events] == [(64, 7_900.0), (32, 5_200.0)]


def test_allocator_retries_are_counted_per_run_not_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.engine.building.devices import activate
    from pipeline.monitor import allocator_metrics

    gpu = torch.device("cuda", 0)
    allocator = FakeAllocator(monkeypatch)
    activate(gpu)  # job 1 of an in-process sweep
    allocator.fail_at(1e9), allocator.fail_at(1e9)
    assert allocator_metrics(gpu)["memory/alloc_retries"] == 2
    activate(gpu)  # job 2: its own figures
    assert allocator_metrics(gpu)["memory/alloc_retries"] == 0


def test_micro_batched_batchnorm_runs_are_tagged_and_others_are_not(make_cfg: MakeCfg, store_uri: str) -> None:
    small = [
        "data=synthetic",
        "data.num_samples=16",
        "data.val_samples=4",
        "loader.batch_size=8",
        "trainer.max_steps=1",
    ]
    resnet = train(make_cfg(*small, "model=resnet18", "oom.micro_batch_size=4"), echo=False)
    mlp = train(make_cfg(*small, "oom.micro_batch_size=4"), echo=False)
    whole = train(make_cfg(*small, "model=resnet18"), echo=False)
    client = MlflowClient(store_uri)
    assert client.get_run(resnet.run_id).data.tags["oom.batchnorm"] == (
        "BatchNorm normalised micro-batches of 4, not batches of 8: its statistics, and so the gradients, "
        "differ from whole-batch training"
    )
    assert "oom.batchnorm" not in client.get_run(mlp.run_id).data.tags
    assert "oom.batchnorm" not in client.get_run(whole.run_id).data.tags


def test_the_summary_says_the_fallback_acted(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with_hook(monkeypatch, oom_above(8))
    train(make_cfg("tracking=none"), echo=True)
    assert "OOM fallback 2 out-of-memory event(s): micro-batch 32 -> 8" in capsys.readouterr().out


def test_micro_batch_config_is_validated(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"oom.micro_batch_size=64 .* at most loader.batch_size \(32\)"):
        make_cfg("oom.micro_batch_size=64")
    with pytest.raises(ConfigError, match=r"oom.min_micro_batch=0"):
        make_cfg("oom.min_micro_batch=0")


def test_micro_batcher_chunks_cover_the_batch_exactly() -> None:
    micro = MicroBatcher(batch_size=10, micro_batch=4)
    assert micro.chunks(10) == [(0, 4), (4, 7), (7, 10)] and micro.chunks(3) == [(0, 3)]  # 4 + 3 + 3, not 4 + 4 + 2


def test_micro_batches_are_as_equal_as_tensor_split_makes_them_and_never_larger_than_asked() -> None:
    """100 at 32 was 32 + 32 + 32 + 4: a 4-sample BatchNorm batch and one more shape for torch.compile."""
    assert MicroBatcher(100, 32).chunks(100) == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert MicroBatcher(1438, 16).pieces(30) == 2 and MicroBatcher(1438, 16).chunks(30) == [(0, 15), (15, 30)]
    for n in range(1, 70):
        for size in range(1, 40):
            spans = MicroBatcher(n, size).chunks(n)
            lengths = [stop - start for start, stop in spans]
            assert spans[0][0] == 0 and spans[-1][1] == n and sum(lengths) == n
            assert max(lengths) - min(lengths) <= 1 and len(spans) == MicroBatcher(n, size).pieces(n)
            assert max(lengths) <= size or min(lengths) >= 2  # larger only to avoid a one-sample micro-batch


def test_out_of_memory_at_the_minimum_later_on_keeps_the_last_checkpoint_loadable(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, tmp_path
) -> None:
    from pipeline.engine.checkpointing.checkpoint import load

    calls = {"n": 0}

    def from_the_second_epoch(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if module.training:
            calls["n"] += 1
            if calls["n"] > 45:  # 45 steps per epoch at batch 32 on digits
                raise torch.OutOfMemoryError("CUDA out of memory")

    with_hook(monkeypatch, from_the_second_epoch)
    with pytest.raises(OutOfMemoryAtMinimum):
        train(make_cfg("trainer.epochs=2", "trainer.max_steps=-1", "oom.min_micro_batch=8"), echo=False)
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "FAILED"
    saved = load(tmp_path / "checkpoints" / run.info.run_id / "last.pt")
    assert saved["position"].epoch == 2 and saved["position"].step == 45 and saved["micro_batch"] == 32


TINY_IMAGES = ["data=synthetic", "data.shape=[1,8,8]", "data.val_samples=4", "tracking=none", "trainer.max_steps=-1"]


def test_a_batchnorm_model_never_trains_on_a_one_sample_last_batch(
    make_cfg: MakeCfg, caplog: pytest.LogCaptureFixture
) -> None:
    """9 samples in batches of 4 leave a last batch of 1; the ImageNet stem shrinks 8 px to 1 px, where BatchNorm
    would see one value per channel and fail ("Expected more than 1 value per channel")."""
    cfg = make_cfg(*TINY_IMAGES, "data.num_samples=9", "loader.batch_size=4", "model=resnet18", "model.stem=imagenet")
    with caplog.at_level("WARNING", logger="pipeline.engine.build"):
        result = train(cfg, echo=False)
    assert result.steps == 2  # 4 + 4, the ninth sample dropped
    (warning,) = [r.getMessage() for r in caplog.records if "BatchNorm" in r.getMessage()]
    assert "each epoch's last training batch would hold 1 sample" in warning and "loader.batch_size=4" in warning


def test_a_model_without_batchnorm_keeps_its_one_sample_last_batch(make_cfg: MakeCfg) -> None:
    result = train(make_cfg(*TINY_IMAGES, "data.num_samples=9", "loader.batch_size=4"), echo=False)
    assert result.steps == 3


@pytest.mark.parametrize(
    ("samples", "batch", "world", "tail"),
    [(1438, 1437, 1, True), (9, 4, 1, True), (8, 4, 1, False), (17, 4, 2, True), (16, 4, 2, False), (3, 4, 1, False)],
    ids=["digits at 1437", "9 by 4", "8 by 4", "two ranks of 9", "two ranks of 8", "one short batch"],
)
def test_a_one_sample_tail_is_found_in_each_ranks_share(samples: int, batch: int, world: int, tail: bool) -> None:
    assert single_sample_tail(samples, batch_size=batch, world=world) is tail


def test_a_batch_of_one_is_refused_for_a_model_with_batchnorm(make_cfg: MakeCfg) -> None:
    with pytest.raises(
        ConfigError, match=r"loader.batch_size=1 is not allowed: expected at least 2 for model=resnet18"
    ):
        train(make_cfg(*TINY_IMAGES, "data.num_samples=9", "loader.batch_size=1", "model=resnet18"), echo=False)
    with pytest.raises(ConfigError, match=r"oom.micro_batch_size=1 is not allowed: expected at least 2 for model=res"):
        train(make_cfg(*TINY_IMAGES, "data.num_samples=9", "oom.micro_batch_size=1", "model=resnet18"), echo=False)


def test_out_of_memory_shrinking_stops_at_two_samples_for_a_model_with_batchnorm(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_hook(monkeypatch, oom_above(0))
    with pytest.raises(OutOfMemoryAtMinimum, match=r"even with a micro-batch of 2 "):
        train(make_cfg(*TINY_IMAGES, "data.num_samples=16", "loader.batch_size=8", "model=resnet18"), echo=False)


def test_micro_batches_never_leave_a_one_sample_tail() -> None:
    assert MicroBatcher(1437, 718).chunks(1437) == [(0, 479), (479, 958), (958, 1437)]  # balanced: 3 of 479
    assert MicroBatcher(5, 2).chunks(5) == [(0, 3), (3, 5)]  # too few to split in three: two, the larger first
    assert MicroBatcher(3, 1).chunks(3) == [(0, 1), (1, 2), (2, 3)]  # a micro-batch of 1 was asked for


def test_a_stop_during_the_out_of_memory_fallback_abandons_the_step_instead_of_retrying_smaller(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, tmp_path
) -> None:
    """Step 5 runs out of memory at 32 and 16; SIGTERM arrives during the attempt at 8, which fails too. No attempt
    at 4 may start: the run stops after step 4 with step 4's weights, checkpointed, and ends KILLED."""
    import os
    import signal

    from pipeline.engine.checkpointing.checkpoint import Position, load
    from pipeline.engine.stopping import Stopped

    reference = train(make_cfg("tracking=none", "trainer.max_steps=4"), echo=False)
    full_batches, seen = [0], []

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if not module.training:
            return
        size = inputs[0].shape[0]
        seen.append(size)
        full_batches[0] += size == 32
        if full_batches[0] >= 5:  # step 5 onwards: only 4 samples fit
            if size == 8:
                os.kill(os.getpid(), signal.SIGTERM)
            if size > 4:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} samples")

    with_hook(monkeypatch, hook)
    with pytest.raises(Stopped) as stopped:
        train(make_cfg("trainer.max_steps=10"), echo=False)
    assert stopped.value.exit_code == 143
    assert seen == [32, 32, 32, 32, 32, 16, 8]  # no attempt at 4 after the stop request
    (run,) = MlflowClient(store_uri).search_runs(experiment_ids=["1"])
    assert run.info.status == "KILLED"
    saved = load(tmp_path / "checkpoints" / run.info.run_id / "last.pt")
    assert saved["position"] == Position(epoch=1, batch=4, step=4)  # step 5 is not counted: a resume replays it
    saved_weights = torch.cat([t.double().flatten() for t in saved["model"].values()])
    assert torch.equal(saved_weights, weights(reference.model))  # nothing of the abandoned step was applied


# --- trainer.memory_snapshot=on_oom: the allocator's snapshot at the first out-of-memory error ---


class FakeHistory:
    """Stands in for ``torch.cuda.memory``'s history recorder and snapshot (a CPU has neither)."""

    def __init__(self) -> None:
        self.recording: list[dict] = []
        self.taken = 0

    def record(self, **kwargs) -> None:
        self.recording.append(kwargs)

    def take(self, device=None) -> dict:
        self.taken += 1
        return {"segments": [{"total_size": 2**20, "blocks": []}], "device_traces": [[{"action": "oom"}]]}


class FilesTracker:
    run_id = "r1"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def log_file(self, path, artifact_dir: str) -> None:
        self.files[f"{artifact_dir}/{path.name}"] = path.read_bytes()


def test_the_first_out_of_memory_error_keeps_the_allocators_snapshot_once_and_the_fallback_still_recovers() -> None:
    import pickle

    from pipeline.engine.observe.snapshot import MAX_ENTRIES, OomSnapshot

    allocator, tracker = FakeHistory(), FilesTracker()
    snapshot = OomSnapshot(torch.device("cuda", 0), record=allocator.record, take=allocator.take)
    micro = MicroBatcher(batch_size=64, micro_batch=64, on_oom=snapshot)
    cpu = torch.device("cpu")
    with snapshot.recording(tracker):
        assert micro.diagnose(RuntimeError("CUDA error: device-side assert triggered"), cpu) is None
        assert allocator.taken == 0  # not an out-of-memory error: nothing taken
        for _ in range(2):
            failure = micro.diagnose(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), cpu)
            micro.recover(failure, step=1, optimizer=None, scaler=None, device=cpu)
    assert allocator.taken == 1 and micro.micro_batch == 16  # one snapshot; the fallback halved twice as before
    assert pickle.loads(tracker.files["memory/snapshot.pickle"])["device_traces"] == [[{"action": "oom"}]]
    assert allocator.recording == [
        {"enabled": "all", "context": "all", "stacks": "python", "max_entries": MAX_ENTRIES, "device": snapshot.device},
        {"enabled": None, "device": snapshot.device},  # recording stops with the run
    ]


def test_a_run_with_memory_snapshot_on_oom_keeps_the_snapshot_in_its_record_and_recovers(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str, tmp_path
) -> None:
    """The whole path on the CPU: the loop's out-of-memory error reaches the snapshot through the micro-batcher, and
    the snapshot (a fake allocator's: validation refuses on_oom off CUDA) lands in the run's artifacts."""
    import pickle

    from pipeline.engine.observe import snapshot as snapshot_module

    allocator = FakeHistory()

    def make(trainer, device):
        return snapshot_module.OomSnapshot(device, record=allocator.record, take=allocator.take)

    monkeypatch.setattr(build_module, "make_snapshot", make)
    with_hook(monkeypatch, oom_above(16))
    result = train(make_cfg("loader.batch_size=64", "trainer.max_steps=4", "monitor.plots=false"), echo=False)
    assert [e.micro_batch for e in result.oom_events] == [64, 32] and result.micro_batch == 16
    assert allocator.taken == 1
    client = MlflowClient(store_uri)
    kept = client.download_artifacts(result.run_id, "memory/snapshot.pickle", str(tmp_path))
    with open(kept, "rb") as file:
        assert pickle.load(file)["segments"][0]["total_size"] == 2**20
    assert allocator.recording[-1] == {"enabled": None, "device": torch.device("cpu")}


def test_with_the_fallback_off_the_snapshot_is_kept_before_the_run_fails(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, store_uri: str
) -> None:
    from pipeline.engine.observe import snapshot as snapshot_module

    allocator = FakeHistory()
    monkeypatch.setattr(
        build_module,
        "make_snapshot",
        lambda trainer, device: snapshot_module.OomSnapshot(device, record=allocator.record, take=allocator.take),
    )
    with_hook(monkeypatch, oom_above(16))
    with pytest.raises(OutOfMemory):
        train(make_cfg("oom.enabled=false", "monitor.plots=false"), echo=False)
    client = MlflowClient(store_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])
    assert run.info.status == "FAILED" and allocator.taken == 1
    assert [a.path for a in client.list_artifacts(run.info.run_id, "memory")] == ["memory/snapshot.pickle"]
