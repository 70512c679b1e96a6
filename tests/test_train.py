"""End-to-end training in-process: it learns, it is repeatable, every model and path runs."""

from __future__ import annotations

import logging
import math
import multiprocessing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

import pipeline.engine.building.build as build_module
from files import write_image_folder, write_mnist
from pipeline.config import RunConfig
from pipeline.engine.building.provenance import run_name
from pipeline.engine.hot.precision import PrecisionPolicy
from pipeline.engine.models import build_model
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.state_dict().values()])


def test_default_mlp_on_digits_learns_to_at_least_90_percent(make_cfg: MakeCfg) -> None:
    result = train(make_cfg("tracking=none", tiny=False), echo=False)
    assert len(result.epochs) == 5 and result.steps == 5 * 23  # 1,438 samples at batch 64
    assert result.val_acc >= 0.90
    assert result.epochs[-1].train_loss < result.epochs[0].train_loss / 2


def test_resident_loader_learns_too(make_cfg: MakeCfg) -> None:
    result = train(make_cfg("tracking=none", "loader=resident", tiny=False), echo=False)
    assert result.val_acc >= 0.90 and result.loader.startswith("resident")


def test_same_seed_same_weights_and_another_seed_differs(make_cfg: MakeCfg) -> None:
    runs = [train(make_cfg("tracking=none", f"trainer.seed={s}"), echo=False) for s in (7, 7, 8)]
    first, again, other = (weights(r.model) for r in runs)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_the_optimizer_really_steps(make_cfg: MakeCfg) -> None:
    cfg = make_cfg("tracking=none")
    result = train(cfg, echo=False)
    torch.manual_seed(cfg.trainer.seed)  # what train() does before building the model
    initial = build_model(cfg.model, in_shape=(1, 28, 28), num_classes=10)
    assert not torch.equal(weights(initial), weights(result.model))


def test_max_steps_stops_inside_the_second_epoch(make_cfg: MakeCfg) -> None:
    result = train(
        make_cfg("tracking=none", "trainer.epochs=5", "trainer.max_steps=30", "loader.batch_size=64"), echo=False
    )
    assert result.steps == 30 and len(result.epochs) == 2


def test_amp_on_the_cpu_runs_forward_in_bfloat16(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.dtype] = []
    original = build_module.build_model

    def with_hook(*args, **kwargs):
        model = original(*args, **kwargs)
        model[1].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
        return model

    monkeypatch.setattr(build_module, "build_model", with_hook)
    result = train(make_cfg("tracking=none", "amp=true"), echo=False)
    assert result.precision == "amp-bf16"
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in result.model.parameters())  # master weights stay fp32


def test_fp16_amp_on_the_cpu_runs_with_an_enabled_grad_scaler_whose_scale_moves(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    scalers: list[torch.amp.GradScaler] = []
    original = PrecisionPolicy.make_scaler

    def growing(self: PrecisionPolicy) -> torch.amp.GradScaler:
        scaler = original(self)
        scaler.set_growth_factor(2.0)
        scaler._growth_interval = 1  # double after every finite step, so three steps move it three times
        scalers.append(scaler)
        return scaler

    monkeypatch.setattr(PrecisionPolicy, "make_scaler", growing)
    result = train(make_cfg("tracking=none", "amp=true", "precision=fp16"), echo=False)
    (scaler,) = scalers
    assert result.precision == "amp-fp16" and result.steps == 3 and scaler.is_enabled()
    assert scaler.get_scale() == 2.0**16 * 2**3  # the scaler stepped with the optimizer every step


@pytest.mark.parametrize("model", ["mlp", "resnet18", "resnet50"])
def test_every_model_trains_two_steps(make_cfg: MakeCfg, model: str) -> None:
    cfg = make_cfg(
        f"model={model}",
        "tracking=none",
        "data=synthetic",
        "data.num_samples=16",
        "data.val_samples=4",
        "loader.batch_size=8",
        "trainer.max_steps=2",
    )
    result = train(cfg, echo=False)
    torch.manual_seed(cfg.trainer.seed)  # what train() does before building the model
    initial = build_model(cfg.model, in_shape=(1, 28, 28), num_classes=10)
    assert type(result.model) is type(initial) and result.parameters == sum(p.numel() for p in initial.parameters())
    assert result.steps == 2 and math.isfinite(result.epochs[0].val_loss)
    assert not torch.equal(weights(initial), weights(result.model))  # two optimizer steps moved the weights


def test_resnet_with_channels_last_sees_nhwc_inputs_and_weights(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    layouts: list[bool] = []
    original = build_module.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        model.conv1.register_forward_pre_hook(
            lambda m, i: layouts.append(i[0].is_contiguous(memory_format=torch.channels_last)) if m.training else None
        )
        return model

    monkeypatch.setattr(build_module, "build_model", build)
    cfg = make_cfg(
        "model=resnet18",
        "tracking=none",
        "data=synthetic",
        "data.shape=[3,32,32]",
        "data.num_samples=8",
        "data.val_samples=4",
        "loader.batch_size=4",
        "trainer.channels_last=true",
        "optimizer=adamw",
        "optimizer.lr=1e-3",
        "trainer.max_steps=2",
    )
    result = train(cfg, echo=False)
    assert result.steps == 2 and layouts == [True, True]
    assert result.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert isinstance(result.model, nn.Module) and not hasattr(result.model, "_orig_mod")


@pytest.mark.slow
def test_worker_processes_give_the_same_weights_as_the_main_process(make_cfg: MakeCfg) -> None:
    base = ["tracking=none", "trainer.max_steps=10"]
    main = train(make_cfg(*base), echo=False)
    workers = train(make_cfg(*base, "loader.num_workers=2", "loader.persistent_workers=true"), echo=False)
    assert torch.equal(weights(main.model), weights(workers.model))


@pytest.mark.slow
@pytest.mark.parametrize("persistent", ["true", "false"])
def test_a_run_with_loader_workers_ends_them_when_it_ends(make_cfg: MakeCfg, persistent: str) -> None:
    """Kept between epochs, the train and val loaders' workers were left to the garbage collector, which met their
    queues already closed: the next run's first collection waited 5 s for each worker to time out (20 s for a
    sweep job after one with 2 workers). The run stops mid-epoch (``max_steps``), with batches still in flight."""
    workers = ["loader.num_workers=2", f"loader.persistent_workers={persistent}"]
    train(make_cfg("tracking=none", "trainer.max_steps=4", *workers), echo=False)
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_compiled_model_trains_through_torch_compile(make_cfg: MakeCfg) -> None:
    eager = train(make_cfg("tracking=none", "trainer.max_steps=2"), echo=False)
    result = train(make_cfg("tracking=none", "trainer.compile=true", "trainer.max_steps=2"), echo=False)
    assert isinstance(result.model, torch._dynamo.eval_frame.OptimizedModule)  # what torch.compile returns
    assert result.steps == 2 and math.isfinite(result.epochs[0].val_loss)
    torch.testing.assert_close(weights(result.model._orig_mod), weights(eager.model), rtol=1e-4, atol=1e-5)


def test_run_names_say_what_differs(make_cfg: MakeCfg) -> None:
    cfg = make_cfg("model=resnet50", "amp=true", "loader.batch_size=128", "loader=workers", "loader.batch_size=128")
    assert run_name(cfg, device_type="cuda", precision="amp-bf16") == "resnet50-digits-cuda-amp-bf16-bs128-w4"
    assert run_name(make_cfg("loader=resident"), device_type="cpu", precision="fp32") == (
        "mlp-digits-cpu-bs32-resident"
    )


def test_summary_is_printed(make_cfg: MakeCfg, capsys: pytest.CaptureFixture[str]) -> None:
    train(make_cfg("tracking=none"), echo=True)
    out = capsys.readouterr().out
    assert "run mlp-digits-cpu-bs32-w0: 1 epoch(s), 3 steps" in out
    assert "val/acc" in out and "samples/s" in out and "tracking off" in out


def test_a_resident_runs_summary_says_what_its_data_share_counts(
    make_cfg: MakeCfg, capsys: pytest.CaptureFixture[str]
) -> None:
    """No loader at all: the share is the batches cut from the tensors on the device, not a wait for a loader."""
    train(make_cfg("tracking=none", "loader=resident"))
    step = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  step time"))
    assert "cutting batches from the resident tensors" in step and "waiting for data" not in step


def test_the_summarys_links_open_the_model_training_view(
    make_cfg: MakeCfg, store_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = train(make_cfg(), echo=True)
    links = [line.split(": ", 1)[1].strip() for line in capsys.readouterr().out.splitlines() if "http://" in line]
    experiment = MlflowClient(store_uri).get_run(result.run_id).info.experiment_id
    assert links == [
        f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{result.run_id}?workflowType=machine_learning",
        f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?workflowType=machine_learning",
    ]


def test_trains_on_mnist_files_and_on_a_folder_of_pngs(make_cfg: MakeCfg, tmp_path: Path) -> None:
    write_mnist(tmp_path / "mnist", n_train=64, n_val=16)
    mnist = train(
        make_cfg("tracking=none", "data=mnist", f"data.root={tmp_path / 'mnist'}", "data.download=false"), echo=False
    )
    assert mnist.steps == 2 and not math.isnan(mnist.epochs[0].val_acc)  # 64 samples, batch 32
    write_image_folder(tmp_path / "pngs", per_class=6)
    folder = train(
        make_cfg(
            "tracking=none",
            "data=imagefolder",
            f"data.root={tmp_path / 'pngs'}",
            "data.image_size=16",
            "model=resnet18",
            "loader.batch_size=4",
            "trainer.max_steps=2",
        ),
        echo=False,
    )
    assert folder.steps == 2


def test_amp_on_the_cpu_is_checked_at_the_start_warned_about_and_recorded(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, store_uri: str
) -> None:
    from mlflow import MlflowClient

    import pipeline.engine.building.amp_check as amp_check

    timed: list[tuple[int, torch.dtype]] = []

    def ten_times_slower(model, batch, *, dtype, **kwargs):  # what the review measured on a CPU
        timed.append((len(batch[0]), dtype))
        return amp_check.AmpProbe(1.7, 17.0, 0.1, batch=4, pairs=5, dtype="bf16", amx=False)

    import pipeline.report.logbook as logbook

    judged: list[object] = []
    real_judge = logbook.judge
    monkeypatch.setattr(logbook, "judge", lambda *a, **kw: judged.append(a[1].amp_check) or real_judge(*a, **kw))
    monkeypatch.setattr(amp_check, "probe_cpu_amp", ten_times_slower)
    result = train(make_cfg("amp=true"), echo=False)
    assert judged == [result.amp_probe]  # the bottleneck hint is told what was measured
    assert timed == [(32, torch.bfloat16)] and result.precision == "amp-bf16" and result.steps == 3
    assert "bf16 autocast ran at 0.10x float32's speed" in caplog.text and "amp=false is faster here" in caplog.text
    run = MlflowClient(store_uri).get_run(result.run_id)
    assert run.data.metrics["amp/cpu_speed_vs_fp32"] == pytest.approx(0.1)
    assert run.data.tags["amp.cpu_check"].startswith("bf16 autocast ran at 0.10x float32's speed on this CPU (median")
    assert "amp check   bf16 autocast ran at 0.10x float32's speed" in run.data.tags["mlflow.note.content"]


def test_float32_runs_and_gpu_runs_are_not_checked(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.engine.building.amp_check as amp_check
    from pipeline.engine.hot.precision import PrecisionPolicy

    def never(*args, **kwargs):
        raise AssertionError("the amp check ran")

    monkeypatch.setattr(amp_check, "probe_cpu_amp", never)
    assert train(make_cfg("tracking=none"), echo=False).amp_probe is None
    policy = PrecisionPolicy("cuda", torch.bfloat16)
    assert amp_check.check_cpu_amp(policy, nn.Linear(2, 2), lambda: never()) is None


def test_the_name_printed_at_the_start_is_the_runs_name_in_the_summary_and_in_mlflow(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 36 (13): the start line said Transformer-corpus-cpu-bs20-w0, the summary and MLflow ...-cfgde124d."""
    from helpers import TINY, run_main

    assert run_main(monkeypatch, "device=cpu", *TINY, "model.hidden_sizes=[64]", "optimizer.lr=0.05") == 0
    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(["1"])
    name = run.info.run_name
    assert name == "mlp-digits-cpu-bs32-w0-hidden_sizes=64-lr0.05"
    out = capsys.readouterr().out
    (started,) = [line for line in out.splitlines() if "] - run " in line]
    assert started.endswith(f"] - run {name}: mlp on digits, 1438 train / 359 val samples, 50,890 parameters")
    assert f"\nrun {name}: 1 epoch(s)" in out  # the summary's first line


def test_an_epochs_line_keeps_the_logger_name_users_see_and_filter_by(
    make_cfg: Callable[..., RunConfig], caplog: pytest.LogCaptureFixture
) -> None:
    """Hydra prints each line's logger name (``[pipeline.train][INFO] - epoch 1/1: ...``), and a log config filters
    by it: the epochs' lines kept theirs when the epoch loop moved into the engine."""
    with caplog.at_level(logging.INFO, logger="pipeline"):
        train(make_cfg("trainer.epochs=1", "tracking=none"), echo=False)
    assert [r.name for r in caplog.records if r.getMessage().startswith("epoch 1/1: ")] == ["pipeline.train"]
