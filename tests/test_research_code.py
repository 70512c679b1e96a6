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
from pipeline.engine.checkpoint import CheckpointError
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


@pytest.fixture
def research(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "research.py").write_text(RESEARCH.lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "research", raising=False)
    import research

    return research


def test_the_hooks_state_flows_across_batches_detached_and_is_emptied_at_each_epoch_and_evaluation(
    make_cfg: Any, research: Any
) -> None:
    result = train(make_cfg(*SEQUENCE, *HOOK, "trainer.epochs=2", "trainer.max_steps=-1", *LEAN), echo=False)
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
    from pipeline.engine.footprint import estimate

    model = research.Masked(8)
    tokens = torch.zeros(5, 2, dtype=torch.long)
    need = estimate(load([]), in_shape=None, num_classes=8, samples=1, model=model, example=tokens, batch_dim=1)
    assert model.mask is None and need.batch_bytes > 0  # the forward ran, on meta tensors, and left nothing behind
    assert model(tokens).shape == (5, 2, 8)


def test_integer_labels_of_any_width_are_cast_to_int64_and_train(
    research: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36 (9): int32 labels passed the check and failed at step 1 as an internal error."""
    args = ["model=custom", "model._target_=torch.nn.Linear", "model.in_features=8", "model.out_features=2"]
    code = run_main(monkeypatch, *args, "data=custom", "data._target_=research.labels32", "device=cpu", *LEAN)
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
    from pipeline.engine.tasks import OutputMismatch

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
