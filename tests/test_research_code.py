"""Research code trains as it is (issue 36): a step hook whose state flows across batches, clipping after unscaling,
sequence-first data, log-probability outputs, integer labels of any width, and the memory estimate that leaves the
model alone."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient

from helpers import LEAN, at_training_step, run_main
from pipeline.common.errors import ConfigError
from pipeline.engine.checkpointing.checkpoint import CheckpointError
from pipeline.engine.stopping import Stopped
from pipeline.train import train

RESEARCH = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

CALLS = []  # what the hook saw at each call


class Columns(Dataset):
    """A token stream in batch order: item k * batch_size + b is column b of window k, with its next tokens."""

    def __init__(self, ids, window, batch_size):
        rows = ids.size(0) // batch_size
        self.source = ids[: rows * batch_size].view(batch_size, rows).t().contiguous()
        self.window, self.classes = window, [str(i) for i in range(int(ids.max()) + 1)]
        self.starts = range(0, self.source.size(0) - 1, window)

    def __len__(self):
        return len(self.starts) * self.source.size(1)

    def __getitem__(self, index):
        window, column = divmod(index, self.source.size(1))
        start = self.starts[window]
        n = min(self.window, self.source.size(0) - 1 - start)
        return self.source[start : start + n, column], self.source[start + 1 : start + 1 + n, column]


def stream(batch_size, window=5, tokens=600, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = (torch.arange(tokens) % 7 + torch.randint(0, 2, (tokens,), generator=g)) % 8
    return Columns(ids[: tokens * 4 // 5], window, batch_size), Columns(ids[tokens * 4 // 5 :], window, batch_size)


class Recurrent(nn.Module):
    """Sequence-first: [T, B] ids in, [T * B, V] log-probabilities and the hidden state out."""

    def __init__(self, num_classes, width=8):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(num_classes, width), nn.GRU(width, width)
        self.head, self.width, self.vocab = nn.Linear(width, num_classes), width, num_classes

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.embed(tokens), hidden)
        return F.log_softmax(self.head(out).view(-1, self.vocab), dim=1), hidden

    def init_hidden(self, batch_size):
        return next(self.parameters()).new_zeros(1, batch_size, self.width)


def recurrent(num_classes, width=8):
    return Recurrent(num_classes, width)


def carry(model, batch, ctx):
    tokens, targets = batch
    hidden = ctx.state.get("hidden")
    CALLS.append(
        dict(training=ctx.training, epoch=ctx.epoch, step=ctx.step, carried=hidden is not None,
             attached=hidden is not None and hidden.requires_grad, grad=torch.is_grad_enabled(),
             mode=ctx.module.training, batch=tokens.size(1))
    )
    if hidden is None:
        hidden = ctx.module.init_hidden(tokens.size(1))
    output, ctx.state["hidden"] = model(tokens, hidden)
    return {"loss": ctx.loss(output, targets), "outputs": output, "targets": targets}


def loss_only(model, batch, ctx):
    tokens, targets = batch
    output, _ = model(tokens, ctx.module.init_hidden(tokens.size(1)))
    return ctx.loss(output, targets)


def not_a_loss(model, batch, ctx):
    return "done"


def kept_object(model, batch, ctx):
    ctx.state["thing"] = object()
    return loss_only(model, batch, ctx)


class Masked(nn.Module):
    """Caches its causal mask in a plain attribute on first use, as published transformer code does."""

    def __init__(self, num_classes, width=8):
        super().__init__()
        self.embed, self.head, self.mask = nn.Embedding(num_classes, width), nn.Linear(width, num_classes), None
        self.attention = nn.MultiheadAttention(width, 1)

    def forward(self, tokens):
        if self.mask is None or self.mask.size(0) != len(tokens):
            self.mask = torch.log(torch.tril(torch.ones(len(tokens), len(tokens))))
        x = self.embed(tokens)
        out, _ = self.attention(x, x, x, attn_mask=self.mask)
        return F.log_softmax(self.head(out), dim=-1)


def labels32(n=96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).to(torch.int32)
    return TensorDataset(x[:80], y[:80]), TensorDataset(x[80:], y[80:])
'''

SEQUENCE = [
    "model=custom",
    "model._target_=research.recurrent",
    "data=custom",
    "data._target_=research.stream",
    "data.batch_dim=1",
    "loader.shuffle=false",
    "loader.batch_size=4",
    "task=next_token",
    "task.outputs=log_probs",
    "device=cpu",
]
HOOK = ["step=custom", "step._target_=research.carry"]


def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> Any:
    """``tmp_path/<name>.py`` holding ``text``, importable as a launch folder's module is, freshly imported."""
    (tmp_path / f"{name}.py").write_text(text.lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return __import__(name)


@pytest.fixture
def research(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    return user_module(tmp_path, monkeypatch, "research", RESEARCH)


def test_the_hooks_state_flows_across_batches_detached_and_is_emptied_at_each_epoch_and_evaluation(
    make_cfg: Any, research: Any
) -> None:
    no_replay = "trainer.replay_check=false"  # the hook's calls are counted: none for the replay check's steps
    result = train(make_cfg(*SEQUENCE, *HOOK, "trainer.epochs=2", "trainer.max_steps=-1", no_replay, *LEAN), echo=False)
    calls = research.CALLS
    training = [c for c in calls if c["training"] and c["grad"]]
    per_epoch = len(training) // 2
    assert per_epoch == 24 and result.steps == 48  # 480 tokens in 4 columns of 120, windows of 5: 24 batches
    for epoch in (1, 2):
        own = [c for c in training if c["epoch"] == epoch]
        assert [c["carried"] for c in own] == [False] + [True] * (per_epoch - 1)  # emptied at the epoch's start
        assert not any(c["attached"] for c in own)  # detached after every optimizer step: no graph spans two steps
        assert all(c["mode"] for c in own)
    assert [c["step"] for c in training] == list(range(48))  # ctx.step: the optimizer steps done before the batch
    evaluation = [c for c in calls if not c["training"] and c["epoch"] in (1, 2) and c["batch"] == 4]
    assert not any(c["grad"] or c["mode"] for c in evaluation)  # no_grad, eval mode
    assert [c["carried"] for c in evaluation] == ([False] + [True] * 5) * 2  # its own state, emptied each time
    assert math.isfinite(result.epochs[-1].val_metrics["val/perplexity"])


def test_a_resume_mid_epoch_continues_with_the_checkpointed_state(
    make_cfg: Any, research: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    base = [*SEQUENCE, *HOOK, "trainer.epochs=2", "trainer.max_steps=-1", *LEAN]
    whole = train(make_cfg(*base, "tracking.experiment=whole"), echo=False)
    with monkeypatch.context() as patch:
        at_training_step(patch, 27, lambda: os.kill(os.getpid(), signal.SIGTERM))  # epoch 2, its third batch
        with pytest.raises(Stopped):
            train(make_cfg(*base), echo=False)
    (folder,) = [f for f in (tmp_path / "checkpoints").iterdir() if '"stopped"' in (f / "state.json").read_text()]
    saved = torch.load(folder / "last.pt", weights_only=True)
    assert saved["position"]["batch"] == 3 and saved["step_state"]["hidden"].shape == (1, 4, 8)
    resumed = train(make_cfg(*base, f"resume={folder.name}"), echo=False)
    for a, b in zip(whole.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_step_that_carries_state_is_never_cut_into_micro_batches(make_cfg: Any, research: Any) -> None:
    with pytest.raises(
        Exception, match=r"carries state across batches \(ctx\.state holds 'hidden'\).*loader\.batch_size"
    ):
        train(make_cfg(*SEQUENCE, *HOOK, "oom.micro_batch_size=2", "tracking=none"), echo=False)


def test_a_step_that_returns_only_its_loss_reports_val_loss(make_cfg: Any, research: Any) -> None:
    result = train(make_cfg(*SEQUENCE, "step=custom", "step._target_=research.loss_only", "tracking=none"), echo=False)
    assert set(result.epochs[-1].val_metrics) == {"val/loss"} and math.isfinite(result.epochs[-1].val_loss)


def test_a_step_hook_under_amp_on_the_cpu_is_timed_by_the_amp_check_and_trains(make_cfg: Any, research: Any) -> None:
    # the amp check once called the step's loss as the task's, loss(outputs, targets): a TypeError at start-up
    result = train(make_cfg(*SEQUENCE, "step=custom", "step._target_=research.loss_only", "amp=true", "tracking=none"),
                   echo=False)  # fmt: skip
    assert result.amp_probe is not None and result.amp_probe.measured
    assert result.precision == "amp-bf16" and result.val_loss == result.val_loss  # trained, a finite val/loss


@pytest.mark.parametrize(
    ("hook", "error"),
    [
        ("research.not_a_loss", r"^step\._target_=research\.not_a_loss returned str: expected the loss tensor"),
        ("research.missing", r"^step\._target_=research\.missing: research \(.*\) has no attribute 'missing'"),
    ],
)
def test_a_step_that_cannot_train_is_one_line_before_any_run_opens(
    research: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    hook: str,
    error: str,
) -> None:
    assert run_main(monkeypatch, *SEQUENCE, "step=custom", f"step._target_={hook}", "trainer.max_steps=2") == 2
    (line,) = capsys.readouterr().err.splitlines()
    import re

    assert re.search(error, line.removeprefix("error: ")), line
    assert not (tmp_path / "mlflow.db").exists()


def test_a_state_a_checkpoint_cannot_keep_is_named(make_cfg: Any, research: Any) -> None:
    with pytest.raises(CheckpointError, match=r"ctx\.state\['thing'\] holds a builtins\.object: a checkpoint keeps"):
        train(make_cfg(*SEQUENCE, "step=custom", "step._target_=research.kept_object", *LEAN), echo=False)


def test_sequence_first_batches_split_along_their_batch_dimension_give_the_whole_batchs_weights(
    make_cfg: Any, research: Any
) -> None:
    masked = ["model._target_=research.Masked", "trainer.max_steps=4", "tracking=none", "optimizer.lr=0.5"]
    whole = train(make_cfg(*SEQUENCE, *masked), echo=False)
    micro = train(make_cfg(*SEQUENCE, *masked, "oom.micro_batch_size=2"), echo=False)
    assert micro.micro_batch == 2
    for a, b in zip(whole.model.state_dict().values(), micro.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_memory_estimate_leaves_a_lazily_cached_mask_alone_and_the_model_trains(research: Any) -> None:
    """Issue 36 (8): the estimate's meta forward left a meta mask in a plain attribute; the first real forward then
    failed with "Tensor.item() cannot be called on meta tensors"."""
    from pipeline.config import load
    from pipeline.engine.building.footprint import estimate

    model = research.Masked(8)
    tokens = torch.zeros(5, 2, dtype=torch.long)
    need = estimate(load([]), in_shape=None, num_classes=8, samples=1, model=model, example=tokens, batch_dim=1)
    assert model.mask is None and need.batch_bytes > 0  # the forward ran, on meta tensors, and left nothing behind
    assert model(tokens).shape == (5, 2, 8)


@pytest.mark.parametrize("loader", ["loader=default", "loader=resident"])
def test_integer_labels_of_any_width_are_cast_to_int64_and_train(
    research: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], loader: str
) -> None:
    """Issue 36 (9): int32 labels passed the check and failed at step 1 as an internal error."""
    args = ["model=custom", "model._target_=torch.nn.Linear", "model.in_features=8", "model.out_features=2"]
    code = run_main(monkeypatch, *args, "data=custom", "data._target_=research.labels32", loader, "device=cpu", *LEAN)
    assert code == 0, capsys.readouterr().err


def test_a_model_that_returns_log_probabilities_is_scored_by_nll_and_keeps_perplexity(
    make_cfg: Any, research: Any, caplog: pytest.LogCaptureFixture
) -> None:
    masked = ["model._target_=research.Masked", "trainer.max_steps=2", "tracking=none"]
    with caplog.at_level(logging.WARNING):
        logits = train(make_cfg(*SEQUENCE[:-1], "task.outputs=logits", *masked), echo=False)
    assert "task.outputs=log_probs takes them as they are" in caplog.text
    nll = train(make_cfg(*SEQUENCE, *masked), echo=False)
    assert nll.epochs[0].val_metrics["val/perplexity"] == pytest.approx(logits.epochs[0].val_metrics["val/perplexity"])


def test_raw_scores_under_task_outputs_log_probs_are_refused(make_cfg: Any, research: Any) -> None:
    from pipeline.engine.hot.tasks import OutputMismatch

    with pytest.raises(OutputMismatch, match=r"task\.outputs=log_probs, but the model's outputs are not log-prob"):
        train(make_cfg("task.outputs=log_probs", "tracking=none"), echo=False)


def test_clipping_acts_after_the_scaler_unscales_and_reports_the_norm_before_it() -> None:
    from pipeline.engine.optim import Clipping

    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((weight * torch.tensor([3.0, 4.0, 0.0, 0.0])).sum()).backward()  # a gradient of norm 5, scaled
    clip = Clipping([weight], max_norm=1.0, value=None)
    clip(optimizer, scaler)
    assert float(clip.norm) == pytest.approx(5.0)  # unscaled first: the norm is the true gradient's
    assert weight.grad.tolist() == pytest.approx([0.6, 0.8, 0.0, 0.0])
    scaler.step(optimizer)  # the scaler does not unscale a second time
    assert weight.tolist() == pytest.approx([-0.6, -0.8, 0.0, 0.0])


def test_clip_grad_norm_bounds_each_step_and_logs_the_gradients_norm(make_cfg: Any, store_uri: str) -> None:
    base = ["optimizer.momentum=0", "optimizer.lr=0.1", "trainer.max_steps=1", "trainer.log_every_n_steps=1", *LEAN]
    before = train(make_cfg(*base, "trainer.max_steps=1", "optimizer.lr=1e-30"), echo=False).model
    clipped = train(make_cfg(*base, "trainer.clip_grad_norm=0.01"), echo=False)
    step = torch.cat([(a - b).flatten() for a, b in zip(clipped.model.parameters(), before.parameters(), strict=True)])
    assert float(step.norm()) == pytest.approx(0.1 * 0.01, rel=1e-3)  # lr x the clipped norm
    norms = MlflowClient(store_uri).get_metric_history(clipped.run_id, "train/grad_norm")
    assert len(norms) == 1 and norms[0].value > 0.01  # the norm before clipping


def test_one_clipping_key_at_a_time(make_cfg: Any) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.clip_grad_value=0\.5 .* null while trainer\.clip_grad_norm=1"):
        make_cfg("trainer.clip_grad_norm=1.0", "trainer.clip_grad_value=0.5")


SINE = '''
import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Sequence(nn.Module):
    """Two LSTM cells over a sine wave, one value a step, in float64: the usual L-BFGS demonstration."""

    def __init__(self):
        super().__init__()
        self.lstm1, self.lstm2, self.linear = nn.LSTMCell(1, 51), nn.LSTMCell(51, 51), nn.Linear(51, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def waves(n=12, length=60, period=20):
    rng = np.random.RandomState(2)
    x = np.array(range(length)) + rng.randint(-4 * period, 4 * period, n).reshape(n, 1)
    return np.sin(x / 1.0 / period).astype("float64")


def data():
    d = torch.from_numpy(waves())
    return TensorDataset(d[3:, :-1], d[3:, 1:]), TensorDataset(d[:3, :-1], d[:3, 1:])


def model():
    return Sequence().double()


def plain(steps, lr=0.8):
    """The plain script: the test loss after each L-BFGS step."""
    torch.manual_seed(0)
    d = torch.from_numpy(waves())
    input, target, test_input, test_target = d[3:, :-1], d[3:, 1:], d[:3, :-1], d[:3, 1:]
    seq = model()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        def closure():
            optimizer.zero_grad()
            loss = criterion(seq(input), target)
            loss.backward()
            return loss
        optimizer.step(closure)
        with torch.no_grad():
            losses.append(criterion(seq(test_input), test_target).item())
    return losses
'''
LBFGS = [
    "model=custom",
    "model._target_=sine.model",
    "data=custom",
    "data._target_=sine.data",
    "task=regression",
    "optimizer=custom",
    "optimizer._target_=LBFGS",
    "optimizer.lr=0.8",
    "loader.batch_size=9",
    "trainer.seed=0",
    "trainer.epochs=3",
    "device=cpu",
]


@pytest.fixture
def sine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    return user_module(tmp_path, monkeypatch, "sine", SINE)


def test_an_lbfgs_run_gives_the_plain_scripts_validation_loss(make_cfg: Any, sine: Any) -> None:
    """Issue 36 (2): LBFGS.step() missing its closure ended as an internal error after the run had opened."""
    result = train(make_cfg(*LBFGS, *LEAN, "trainer.log_every_n_steps=1"), echo=False)
    reference = sine.plain(3)
    assert [e.val_loss for e in result.epochs] == pytest.approx(reference, abs=1e-6)
    assert reference[-1] < reference[0]  # it learns


def test_an_lbfgs_sweep_over_two_rates_runs_and_compares(
    sine: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from pipeline.experiments.compare.cli import main as compare

    code = run_main(monkeypatch, "-m", *LBFGS[:7], "optimizer.lr=0.8,0.5", *LBFGS[8:], "trainer.epochs=2", *LEAN)
    assert code == 0, capsys.readouterr().err
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(["1"])
    runs = [r for r in runs if r.data.tags.get("sweep.role") != "parent"]
    assert sorted(r.data.params["optimizer.lr"] for r in runs) == ["0.5", "0.8"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    capsys.readouterr()
    assert compare(["--uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]) == 0
    table = capsys.readouterr().out
    assert "optimizer.lr" in table and "0.5" in table and "0.8" in table


def test_a_closure_optimizer_under_float16s_scaler_is_refused_before_the_run(make_cfg: Any, sine: Any) -> None:
    with pytest.raises(ConfigError, match=r"^precision\.dtype='fp16' is not allowed: expected bf16, or amp=false"):
        train(make_cfg(*LBFGS, "amp=true", "precision=fp16", "tracking=none"), echo=False)


def test_a_plateau_schedule_is_fed_val_loss_after_each_evaluation_and_checkpointed(
    make_cfg: Any, store_uri: str, tmp_path: Path
) -> None:
    """Issue 36 (3): ReduceLROnPlateau.step() missing 'metrics' was an internal error; every schedule was stepped per
    optimizer step with no argument."""
    stalled = ["optimizer.lr=1e-12", "trainer.epochs=3", "trainer.max_steps=-1", "loader.batch_size=256", *LEAN]
    custom = ["scheduler=custom", "scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau"]
    result = train(make_cfg(*stalled, *custom, "scheduler.factor=0.5", "scheduler.patience=0"), echo=False)
    assert result.model is not None
    lrs = [m.value for m in MlflowClient(store_uri).get_metric_history(result.run_id, "train/lr")]
    assert lrs[0] == 1e-12 and lrs[-1] == pytest.approx(0.25e-12)  # halved after epochs 2 and 3 (no improvement)
    saved = torch.load(tmp_path / "checkpoints" / result.run_id / "last.pt", weights_only=True)
    assert saved["scheduler"]["num_bad_epochs"] == 0 and saved["scheduler"]["best"] < 10  # its state, kept
    builtin = train(make_cfg(*stalled, "scheduler=plateau", "scheduler.patience=0", "scheduler.factor=0.1"), echo=False)
    assert builtin.model.state_dict().keys() == result.model.state_dict().keys()


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["scheduler=plateau", "scheduler.monitor=val/f1"], r"^scheduler\.monitor='val/f1' .* val/loss, val/acc$"),
        (["scheduler=plateau", "scheduler.monitor=val/acc"], r"^scheduler\.mode='min' .* max \(higher is better\)"),
        (["scheduler=cosine", "scheduler.monitor=val/loss"], r"^scheduler\.monitor='val/loss' .* step takes no metric"),
        (["scheduler=plateau", "scheduler.interval=step"], r"^scheduler\.interval='step' .* fed val/loss after each"),
    ],
)
def test_a_schedule_that_cannot_be_fed_is_refused_before_the_run(
    make_cfg: Any, overrides: list[str], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        train(make_cfg(*overrides, "tracking=none"), echo=False)


def test_an_empty_micro_batch_of_ignored_tokens_never_poisons_the_step_with_nan() -> None:
    """Issue 36 (10): a micro-batch whose targets were all ignore_index had a NaN mean, and NaN x 0 stays NaN."""
    from pipeline.engine.hot.memory import MicroBatcher
    from pipeline.engine.hot.precision import PrecisionPolicy
    from pipeline.engine.hot.step import TrainState, forward_backward
    from pipeline.engine.hot.tasks import NextToken

    torch.manual_seed(0)
    tokens = torch.randint(0, 5, (4, 6))
    targets = tokens.clone()
    targets[:2] = -100  # the first micro-batch of two counts nothing

    def grads(micro: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
        state = TrainState(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.amp.GradScaler("cpu", enabled=False),
            MicroBatcher(4, micro),
            task=NextToken(),
        )
        loss, _ = forward_backward(state, tokens, targets, policy=PrecisionPolicy("cpu", None), prepare=lambda x: x)
        return loss, [p.grad.clone() for p in model.parameters()]

    whole, whole_grads = grads(4)
    split, split_grads = grads(2)
    assert math.isfinite(float(split)) and float(split) == pytest.approx(float(whole))
    for a, b in zip(whole_grads, split_grads, strict=True):
        torch.testing.assert_close(a, b)


NAMED = """
from collections import namedtuple

import torch
from torch import nn
from torch.utils.data import Dataset

Inp = namedtuple("Inp", ["a", "b"])


class Pairs(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(n)
        self.a, self.b = torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        return Inp(self.a[i], self.b[i]), int(self.a[i].sum() > self.b[i].sum())


def make():
    return Pairs(64), Pairs(16)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, inp):
        return self.fc(torch.cat([inp.a, inp.b], dim=1))
"""


@pytest.mark.parametrize("loader", [["oom.micro_batch_size=4"], ["loader=resident"]], ids=["split", "resident"])
def test_namedtuple_inputs_train_through_the_fallbacks_cut_and_the_resident_loader(
    make_cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loader: list[str]
) -> None:
    """Issue 36 (9): (Inp(a, b), y) items failed as Inp.__new__() missing 'b', an internal error."""
    user_module(tmp_path, monkeypatch, "named", NAMED)
    args = [
        "model=custom",
        "model._target_=named.Net",
        "data=custom",
        "data._target_=named.make",
        "loader.batch_size=8",
    ]
    result = train(make_cfg(*args, *loader, "tracking=none"), echo=False)
    assert result.steps == 3 and math.isfinite(result.epochs[0].val_loss)


def test_an_exception_in_the_users_step_names_its_line_and_step_target(
    research: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    source = (tmp_path / "research.py").read_text()
    (tmp_path / "research.py").write_text(
        source + "\n\ndef fails(model, batch, ctx):\n    if ctx.training and ctx.step == 2:\n"
        "        raise IndexError('window out of range')  # HERE\n    return loss_only(model, batch, ctx)\n"
    )
    monkeypatch.delitem(sys.modules, "research", raising=False)
    code = run_main(monkeypatch, *SEQUENCE, "step=custom", "step._target_=research.fails", *LEAN)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    where = next(i for i, text in enumerate((tmp_path / "research.py").read_text().splitlines(), 1) if "# HERE" in text)
    assert code == 2 and line.startswith("error: step._target_=research.fails: your code raised IndexError:")
    assert f" at research.py:{where} in fails " in line


CAUSAL = '''
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel


class Counting(Dataset):
    """Token ids that count up from a random start: each next token is learnable from the one before."""

    def __init__(self, n, seed, length=12, vocab=32):
        g = torch.Generator().manual_seed(seed)
        self.ids = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(length)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # Hugging Face's convention: labels = input_ids


def make():
    return Counting(64, seed=0), Counting(16, seed=1)


def gpt(vocab=32):
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16, n_layer=1, n_head=2))
'''
HF = [
    "model=custom",
    "model._target_=causal.gpt",
    "data=custom",
    "data._target_=causal.make",
    "data.target_key=labels",
    "task=next_token",
    "loader.batch_size=16",
    "optimizer=adamw",
    "optimizer.lr=0.01",
    "trainer.epochs=2",
    "trainer.max_steps=-1",
    "device=cpu",
]


@pytest.fixture
def causal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    user_module(tmp_path, monkeypatch, "causal", CAUSAL)


def test_a_hugging_face_causal_lm_trains_on_its_own_loss_and_on_the_tasks_shifted_one_alike(
    make_cfg: Any, causal: None, store_uri: str
) -> None:
    """Issue 36 (7): labels=input_ids, unshifted, silently trained the model to copy its input."""
    own = train(make_cfg(*HF, "task.loss=model", "tracking.experiment=own"), echo=False)
    shifted = train(make_cfg(*HF, "task.shift_labels=true", *LEAN), echo=False)
    for a, b in zip(own.epochs, shifted.epochs, strict=True):
        assert a.val_loss == pytest.approx(b.val_loss, rel=1e-4)
        assert a.val_metrics["val/acc"] == pytest.approx(b.val_metrics["val/acc"])  # the metrics shift too
    assert own.epochs[-1].val_loss < own.epochs[0].val_loss
    assert math.exp(own.epochs[-1].val_loss) == pytest.approx(own.epochs[-1].val_metrics["val/perplexity"])
    (model,) = MlflowClient(store_uri).search_logged_models(["1"])
    info = __import__("mlflow").models.get_model_info(f"models:/{model.model_id}")
    assert info.signature.inputs.input_names() == ["input_ids"]  # the labels it was given are no input of it


def test_the_tasks_loss_on_targets_equal_to_the_inputs_unshifted_is_refused_in_one_line(
    causal: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run_main(monkeypatch, *HF) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: the targets are the inputs themselves") and "task.shift_labels=true" in line
    assert not (tmp_path / "mlflow.db").exists()


def test_a_batch_dimension_the_batches_do_not_have_is_refused_before_the_run(make_cfg: Any, research: Any) -> None:
    with pytest.raises(ConfigError, match=r"^data\.batch_dim=2 is not allowed: expected a dimension of the first"):
        train(make_cfg(*SEQUENCE, "data.batch_dim=2", "tracking=none"), echo=False)
