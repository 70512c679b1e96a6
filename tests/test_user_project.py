"""A user's own project outside the package: its model, data and task train through every capability, and the
trained model comes back out of MLflow."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from tests.project import KEYED, REGRESSION, use_project, write_project

from helpers import sigterm_at_step
from pipeline.config import RunConfig
from pipeline.engine.checkpointing import checkpoint
from pipeline.engine.hot import hooks as step_module
from pipeline.engine.stopping import Stopped
from pipeline.train import train

MakeCfg = Callable[..., RunConfig]
EPOCHS = ["trainer.epochs=3", "trainer.max_steps=-1", "loader.batch_size=32"]  # 13 steps an epoch (410 samples)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return use_project(tmp_path, monkeypatch)


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()])


def test_the_users_model_data_and_task_train_with_the_summary_and_the_record(
    project: Path, make_cfg: MakeCfg, store_uri: str
) -> None:
    result = train(make_cfg(*REGRESSION, *EPOCHS, "+model.width=16"), echo=False)
    first, last = result.epochs[0].val_metrics, result.epochs[-1].val_metrics
    assert set(last) == {"val/loss", "val/mae", "val/rmse"} and last["val/mae"] < first["val/mae"]
    assert result.primary == "val/mae" and result.steps == 3 * 13
    run = MlflowClient(store_uri).get_run(result.run_id)
    params, tags = run.data.params, run.data.tags
    assert (params["model._target_"], params["model.width"], params["data._target_"]) == (
        "nets.Tiny",
        "16",
        "sets.make",
    )
    assert params["task.name"] == "regression" and params["optimizer._target_"] == "torch.optim.SGD"
    assert tags["model.class"] == "nets.Tiny" and tags["model.file"] == str(project / "nets.py")
    assert len(tags["model.file_sha256"]) == 16 and tags["data.file"] == str(project / "sets.py")
    assert tags["task.primary"] == "val/mae" and run.info.run_name == "Tiny-make-cpu-bs32-w0"
    for key in ("val/mae", "val/rmse", "train/lr", "time/data_wait_pct", "time/compute_pct"):
        assert key in run.data.metrics, key
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.dataset.name == "make" and len(dataset.dataset.digest) == 8
    assert json.loads(dataset.dataset.schema)["inputs"] == "float32[2, 8]"


def test_the_summary_leads_with_the_tasks_metric(project: Path, make_cfg: MakeCfg) -> None:
    from pipeline.report.summary import format_summary

    summary = format_summary(train(make_cfg(*REGRESSION, "tracking=none"), echo=False))
    assert "  validation  val/mae " in summary and "· val/rmse " in summary
    assert "waiting for data" in summary and "compute" in summary


def test_dict_batches_reach_the_model_as_keyword_inputs_and_an_out_of_memory_error_keeps_the_losses(
    project: Path, make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = [*KEYED, *EPOCHS, "tracking=none", "trainer.log_every_n_steps=1"]
    losses: list[float] = []
    with monkeypatch.context() as patch:
        record_losses(patch, losses)
        plain = train(make_cfg(*base), echo=False)
    with_oom: list[float] = []
    with monkeypatch.context() as patch:
        record_losses(patch, with_oom)
        oom_above(patch, 8)
        fallback = train(make_cfg(*base), echo=False)
    assert len(losses) == plain.steps and [e.micro_batch for e in fallback.oom_events] == [32, 16]
    assert fallback.micro_batch == 8
    assert fallback.steps == plain.steps  # every step still saw the whole batch of 32
    assert with_oom == pytest.approx(losses, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(weights(fallback.model), weights(plain.model), rtol=1e-4, atol=1e-6)


def record_losses(monkeypatch: pytest.MonkeyPatch, into: list[float]) -> None:
    import pipeline.engine.run as train_module

    original = train_module.train_epoch

    def recording(*args, **kwargs):
        metrics = kwargs["hooks"].metrics
        write = metrics.write

        def log_step(logged: dict[str, float], step: int) -> None:
            if "train/loss" in logged:
                into.append(logged["train/loss"])
            write(logged, step)

        metrics.write = log_step
        return original(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_epoch", recording)


def oom_above(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """Training forwards of more than ``limit`` samples raise CUDA's out-of-memory error (a card that fits ``limit``);
    the dict batch's ``features`` entry says how many samples a forward has."""
    original = step_module.call_model

    def call(model, inputs):
        if model.training and inputs["features"].shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return original(model, inputs)

    monkeypatch.setattr(step_module, "call_model", call)


def test_sigterm_and_resume_end_with_the_weights_of_an_uninterrupted_run(
    project: Path, make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    base = [*REGRESSION, *EPOCHS, "scheduler=cosine"]
    whole = train(make_cfg(*base, "tracking.experiment=whole"), echo=False)
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 20)
        with pytest.raises(Stopped):
            train(make_cfg(*base), echo=False)
    (folder,) = {p for p in (tmp_path / "checkpoints").iterdir() if p.name != whole.run_id}
    saved = checkpoint.load(folder / "last.pt")
    assert saved["position"].step == 20 and saved["scheduler"]["last_epoch"] == 20  # one schedule step per step
    resumed = train(make_cfg(*base, "resume=latest"), echo=False)
    assert resumed.steps == whole.steps
    torch.testing.assert_close(weights(resumed.model), weights(whole.model), rtol=0, atol=0)


def test_a_checkpoint_holds_plain_values_only(project: Path, make_cfg: MakeCfg, tmp_path: Path) -> None:
    result = train(make_cfg(*REGRESSION, "scheduler=warmup_cosine"), echo=False)
    path = tmp_path / "checkpoints" / str(result.run_id) / "last.pt"
    saved = torch.load(path, weights_only=True)  # no allowed globals: tensors and plain values alone
    assert saved["format"] == checkpoint.FORMAT and saved["position"] == {"epoch": 1, "batch": 3, "step": 3}
    assert saved["config"]["model"]["_target_"] == "nets.Tiny" and saved["scheduler"]["lr_lambdas"][0]["warmup"] == 0
    assert set(saved["model"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}


def test_autotune_times_the_users_own_loader_in_the_real_step(project: Path, make_cfg: MakeCfg) -> None:
    import dataclasses

    from pipeline.autotune.candidates import Candidate
    from pipeline.autotune.trials import Trials

    cfg = make_cfg(*REGRESSION, "tracking=none")
    trials = Trials(cfg)
    try:
        assert trials.probe().spec.name == "make"
        speeds = [
            trials.measure(Candidate(loader), steps=3, warmup=1)
            for loader in (cfg.loader, dataclasses.replace(cfg.loader, resident=True))
        ]
    finally:
        trials.close()
    assert all(speed > 0 for speed in speeds)


def test_autotune_offers_resident_only_for_map_style_tensors_and_searches_an_iterable_dataset(
    project: Path, make_cfg: MakeCfg, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline import autotune
    from pipeline.autotune.candidates import resident_fits
    from pipeline.data import load_data

    cpu = torch.device("cpu")
    keyed = load_data(make_cfg(*KEYED).data).spec  # 512 samples of 8 + 1 float32 features and a float32 target
    assert keyed.sample_bytes == (8 + 1 + 1) * 4 and keyed.resident_bytes == 512 * 40 and resident_fits(keyed, cpu)
    stream = ["data._target_=sets.stream", "+data.steps_per_epoch=4"]
    streamed = load_data(make_cfg(*REGRESSION, *stream).data).spec
    assert streamed.iterable and streamed.resident_bytes is None and not resident_fits(streamed, cpu)
    budget = ["--budget-s", "30", "--steps", "2", "--warmup", "1", "--rounds", "1", "--no-track"]
    assert autotune.main([*budget, *REGRESSION, *stream, "device=cpu", "loader.batch_size=8"]) == 0
    report = capsys.readouterr().out
    assert "resident" not in report and "workers=0" in report, report


# --- the same project in real processes ------------------------------------------------------------------------


def loaded_elsewhere(folder: Path, run_id: str, elsewhere: Path) -> tuple[str, str, str]:
    """The run's logged model loaded in a fresh process in ``elsewhere`` (none of the project's code there): its class,
    its validation MAE on ``folder``'s sets.py, and whether the project's activations module was loaded with it."""
    elsewhere.mkdir()
    probe = f"""
import importlib.util, sys, mlflow, torch
mlflow.set_tracking_uri("sqlite:///{folder / "mlflow.db"}")
model = mlflow.pytorch.load_model("runs:/{run_id}/model")
spec = importlib.util.spec_from_file_location("user_sets", {str(folder / "sets.py")!r})
sets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sets)
_, val = sets.make()
x, y = val.tensors
with torch.no_grad():
    mae = (model(x) - y).abs().mean().item()
print(type(model).__module__ + "." + type(model).__name__, mae, "activations" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    name, mae, sibling = out.stdout.split()
    return name, mae, sibling


TINY = ["device=cpu", "trainer.epochs=2", "loader.batch_size=32", "monitor.plots=false"]


def pipeline(folder: Path, *args: str, module: str = "pipeline", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=folder, capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.slow
def test_the_project_trains_from_its_own_folder_its_model_reproduces_the_metric_and_its_checkpoint_needs_torch_alone(
    tmp_path: Path,
) -> None:
    """One run of the project, read two ways: its logged model in a fresh process that has no nets.py, and its
    checkpoint with torch alone, where pipeline is not installed."""
    folder = write_project(tmp_path / "myproject")
    proc = pipeline(folder, *REGRESSION, *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation  val/mae" in proc.stdout and "waiting for data" in proc.stdout
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (run,) = client.search_runs(["1"])
    (model,) = client.search_logged_models(["1"])
    assert {m.key for m in model.metrics} >= {"val/mae", "val/rmse", "val/loss"}
    name, mae, _ = loaded_elsewhere(folder, run.info.run_id, tmp_path / "elsewhere")  # no nets.py there
    assert name == "nets.Tiny" and float(mae) == pytest.approx(run.data.metrics["val/mae"], rel=1e-5)

    path = folder / "checkpoints" / run.info.run_id / "last.pt"
    site = str(Path(torch.__file__).parents[1])  # torch's site-packages: its .pth files (pipeline's) unread
    probe = (
        "import sys, torch\n"
        "try:\n    import pipeline.engine.checkpointing.checkpoint\nexcept ImportError:\n    print('no pipeline')\n"
        f"saved = torch.load({str(path)!r}, weights_only=True)\n"
        "print(sorted(saved['model']), saved['position'], saved['config']['model']['_target_'])\n"
    )
    env = {"PYTHONPATH": site, "PATH": os.environ.get("PATH", "")}
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == "no pipeline"
    assert "'net.0.weight'" in out.stdout and "{'epoch': 3, 'batch': 0, 'step': 26}" in out.stdout
    assert out.stdout.strip().endswith("nets.Tiny")


@pytest.mark.slow
def test_a_sweep_over_the_users_keywords_and_its_comparison(tmp_path: Path) -> None:
    folder = write_project(tmp_path / "myproject")
    proc = pipeline(folder, "-m", *REGRESSION, *TINY, "trainer.max_steps=6", "+model.width=16,32", "trainer.seed=1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    jobs = [r for r in client.search_runs(["1"]) if r.data.tags.get("sweep.role") != "parent"]
    assert sorted((r.data.params["model.width"], r.data.params["trainer.seed"]) for r in jobs) == [
        ("16", "1"),
        ("16", "2"),
        ("32", "1"),
        ("32", "2"),
    ]
    compared = pipeline(folder, "--out", "report", module="pipeline.compare")
    assert compared.returncode == 0, compared.stderr[-3000:]
    view = compared.stdout.splitlines()  # what a terminal shows: the swept key and the task's metric among them
    start = next(i for i, line in enumerate(view) if line.startswith("row "))
    header = re.split(r"\s{2,}", view[start].strip())
    assert "model.width" in header and "val/mae" in header
    rows = [re.split(r"\s{2,}", line.strip()) for line in view[start + 1 : start + 3]]
    assert sorted(row[header.index("model.width")] for row in rows) == ["16", "32"]
    assert all(row[header.index("n")] == "2" for row in rows)
    table = [line for line in (folder / "report" / "compare.md").read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert all(row[header.index("model")] == "Tiny" for row in rows)


@pytest.mark.slow
def test_two_gloo_ranks_end_with_the_weights_of_one_process_at_the_global_batch(tmp_path: Path) -> None:
    folder = write_project(tmp_path / "myproject")
    common = [*REGRESSION, "device=cpu", "trainer.epochs=1", "trainer.max_steps=8", "monitor.plots=false"]
    single = pipeline(folder, *common, "loader.batch_size=32", "tracking.experiment=single")
    assert single.returncode == 0, single.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "pipeline"]
    ddp = subprocess.run(
        [*command, *common, "loader.batch_size=16", "tracking.experiment=ddp"],
        cwd=folder,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-3000:]
    assert "distributed 2 ranks over gloo, batch 16 per rank, 32 in all" in ddp.stdout
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    finals = {}
    for name in ("single", "ddp"):
        (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
        finals[name] = torch.load(folder / "checkpoints" / run.info.run_id / "last.pt", weights_only=True)["model"]
    for key, value in finals["single"].items():
        torch.testing.assert_close(finals["ddp"][key], value, rtol=1e-4, atol=1e-5, msg=key)


# --- issue 36: the model out and the provenance cover all of the user's code -------------------------------------

SIBLING_NET = """
import torch
from torch import nn

from activations import act


class Tiny2(nn.Module):
    def __init__(self, in_shape, width=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(in_shape[0], width), nn.Linear(width, 1)

    def forward(self, x):
        return self.fc2(act(self.fc1(x))).squeeze(-1)
"""
ACTIVATIONS = "import torch\n\n\ndef act(x):\n    return torch.tanh(x) * 1.5\n"
SIBLING = ["model=custom", "model._target_=nets2.Tiny2", "data=custom", "data._target_=sets.make", "task=regression"]


def sibling_project(folder: Path) -> Path:
    write_project(folder)
    (folder / "nets2.py").write_text(SIBLING_NET.lstrip())
    (folder / "activations.py").write_text(ACTIVATIONS)
    return folder


@pytest.fixture
def siblings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The project with nets2.py and its activations.py, importable from ``tmp_path`` as a launch folder's are."""
    folder = sibling_project(tmp_path)
    monkeypatch.syspath_prepend(str(folder))
    for name in ("nets2", "activations", "sets", "nets"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("form", ["pickle", "pt2"])
def test_a_model_whose_file_imports_a_sibling_loads_elsewhere_and_reproduces_its_metric(
    siblings: Path, make_cfg: MakeCfg, store_uri: str, tmp_path: Path, form: str
) -> None:
    """Issue 36 (11): only the files defining nn.Module classes were shipped; `from activations import act` then
    failed to load with ModuleNotFoundError in a fresh process elsewhere."""
    result = train(make_cfg(*SIBLING, *TINY, f"tracking.model_format={form}"), echo=False)
    assert result.logged_model.endswith(" (pt2)") == (form == "pt2")
    run = MlflowClient(store_uri).get_run(result.run_id)
    assert run.data.tags["model.format"] == form
    _, mae, sibling = loaded_elsewhere(siblings, result.run_id, tmp_path / "elsewhere")
    assert float(mae) == pytest.approx(run.data.metrics["val/mae"], rel=1e-5)
    assert sibling == ("True" if form == "pickle" else "False")  # pt2 is a graph: no code of the user's loads


def test_the_record_hashes_every_user_module_the_run_imported(
    siblings: Path, make_cfg: MakeCfg, store_uri: str
) -> None:
    """Issue 36 (12): model.file_sha256 hashed the _target_'s file alone, not the sibling it imports."""
    result = train(make_cfg(*SIBLING, "tracking.log_model=false"), echo=False)
    tags = MlflowClient(store_uri).get_run(result.run_id).data.tags
    files = {k.removeprefix("code.file."): v for k, v in tags.items() if k.startswith("code.file.")}
    assert set(files) == {"nets2.py", "activations.py", "sets.py"} and all(len(v) == 16 for v in files.values())
    assert len(tags["code.sha256"]) == 16


def test_a_resume_refuses_changed_code_naming_the_file_and_a_fork_continues_tagged(
    siblings: Path, make_cfg: MakeCfg, store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36 (12): resume compared config keys only, so an edit that kept the shapes resumed silently."""
    from helpers import sigterm_at_step

    base = [*SIBLING, *EPOCHS, "tracking.log_model=false"]
    with monkeypatch.context() as patch:
        sigterm_at_step(patch, 5)
        with pytest.raises(Stopped):
            train(make_cfg(*base), echo=False)
    (siblings / "activations.py").write_text(ACTIVATIONS.replace("1.5", "2.0"))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"^cannot resume run \w+: your code changed since its checkpoint "
        r"\(activations\.py: \w{16} then, \w{16} now\).*fork=true",
    ):
        train(make_cfg(*base, "resume=latest"), echo=False)
    forked = train(make_cfg(*base, "resume=latest", "fork=true"), echo=False)
    tags = MlflowClient(store_uri).get_run(forked.run_id).data.tags
    assert "code:activations.py" in tags["fork.changed"]


def test_a_model_is_logged_at_every_epochs_checkpoint_and_the_best_is_found(
    project: Path, make_cfg: MakeCfg, store_uri: str
) -> None:
    result = train(make_cfg(*REGRESSION, *EPOCHS, "tracking.log_model=checkpoints"), echo=False)
    client = MlflowClient(store_uri)
    models = client.search_logged_models(["1"])
    assert sorted(m.name for m in models) == ["model"] * 3
    linked = {m.model_id: {x.key: x.value for x in m.metrics} for m in models}
    assert sorted(v["val/mae"] for v in linked.values()) == sorted(e.val_metrics["val/mae"] for e in result.epochs)
    (best,) = client.search_logged_models(
        ["1"], order_by=[{"field_name": "metrics.val/mae", "ascending": True}], max_results=1
    )
    assert linked[best.model_id]["val/mae"] == min(e.val_metrics["val/mae"] for e in result.epochs)
    assert result.logged_model == f"mlflow.pytorch.load_model('runs:/{result.run_id}/model')"


def test_auto_picks_pt2_where_the_model_exports_and_pickle_where_it_takes_keywords(
    project: Path, make_cfg: MakeCfg, store_uri: str
) -> None:
    tensor = train(make_cfg(*REGRESSION, "tracking.model_format=auto"), echo=False)
    keyed = train(make_cfg(*KEYED, "tracking.model_format=auto"), echo=False)
    client = MlflowClient(store_uri)
    assert client.get_run(tensor.run_id).data.tags["model.format"] == "pt2"
    assert client.get_run(keyed.run_id).data.tags["model.format"] == "pickle"


def test_pt2_for_a_model_of_keyword_inputs_is_refused_before_the_run(
    project: Path, make_cfg: MakeCfg, tmp_path: Path
) -> None:
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"^tracking\.model_format='pt2' is not allowed: expected pickle or auto"):
        train(make_cfg(*KEYED, "tracking.model_format=pt2"), echo=False)
    assert not (tmp_path / "mlruns").exists()
