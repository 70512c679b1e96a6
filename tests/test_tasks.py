"""The tasks: each loss, each metric against a hand computation, and the first batch's checks."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.common.errors import DatasetError
from pipeline.config import TargetConfig, TaskConfig
from pipeline.engine.hot.tasks import (
    Classification,
    Multilabel,
    NextToken,
    OutputMismatch,
    Regression,
    logits,
    make_task,
)


def finished(task, outputs, targets, parts: int = 2) -> dict[str, float]:
    """The task's metrics over ``parts`` batches, as evaluation sums them."""
    sums = sum(task.sums(o, t) for o, t in zip(outputs.tensor_split(parts), targets.tensor_split(parts), strict=True))
    return task.finish(sums.double().tolist())


def test_classification_reports_the_mean_cross_entropy_and_the_accuracy() -> None:
    out = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 0.5]])
    y = torch.tensor([0, 1, 1, 1])
    metrics = finished(Classification(), out, y)
    assert metrics["val/acc"] == 0.75
    assert metrics["val/loss"] == pytest.approx(F.cross_entropy(out, y).item())


def test_regression_reports_mse_mae_and_rmse() -> None:
    out, y = torch.tensor([1.0, 2.0, 4.0, 0.0]), torch.tensor([1.0, 3.0, 2.0, 0.0])
    metrics = finished(Regression(), out, y)
    assert metrics == pytest.approx({"val/loss": 5 / 4, "val/mae": 3 / 4, "val/rmse": math.sqrt(5 / 4)})


def test_multilabel_reports_micro_f1_and_exact_match_at_the_threshold() -> None:
    out = torch.tensor([[3.0, -3.0], [3.0, 3.0], [-3.0, -3.0], [0.1, -0.1]])  # predicted: 10, 11, 00, 10 at 0.5
    y = torch.tensor([[1, 0], [1, 0], [0, 1], [1, 0]])
    metrics = finished(Multilabel(0.5), out, y)
    tp, fp, fn = 3, 1, 1
    assert metrics["val/f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn)) and metrics["val/exact_match"] == 0.5
    strict = finished(Multilabel(0.6), out, y)  # 0.1 is below logit(0.6): row 4 predicts nothing
    assert strict["val/exact_match"] == 0.25


def test_next_token_leaves_out_the_ignored_positions_and_reports_perplexity() -> None:
    torch.manual_seed(0)
    out, y = torch.randn(4, 5, 7), torch.randint(0, 7, (4, 5))
    y[:, -1] = -100  # padding
    metrics = finished(NextToken(-100), out, y)
    nll = F.cross_entropy(out.reshape(-1, 7), y.reshape(-1), ignore_index=-100)
    assert metrics["val/loss"] == pytest.approx(nll.item(), rel=1e-6)
    assert metrics["val/perplexity"] == pytest.approx(math.exp(nll.item()), rel=1e-6)
    assert NextToken(-100).weight(y).item() == 16  # what the loss averages over: the counted tokens


@pytest.mark.parametrize(
    ("task", "outputs", "targets", "match"),
    [
        (Regression(), torch.zeros(4, 1), torch.zeros(4), r"outputs \[4, 1\] against targets \[4\] would broadcast"),
        (Regression(), torch.zeros(4), torch.zeros(4, 1), r"outputs \[4\] against targets \[4, 1\]"),
        (Classification(), torch.zeros(4), torch.zeros(4, dtype=torch.long), r"needs \[B, C\] class scores"),
        (Classification(), torch.zeros(4, 3), torch.tensor([0, 1, 2, 5]), r"labels run from 0 to 5, but the model"),
        (Multilabel(), torch.zeros(4, 3), torch.zeros(4, 2), r"one output per label: outputs \[4, 3\]"),
        (NextToken(), torch.zeros(2, 5, 3), torch.zeros(2, 4, dtype=torch.long), r"\[B, T, V\] outputs for \[B, T\]"),
    ],
)
def test_an_output_that_does_not_fit_the_loss_names_both_shapes(task, outputs, targets, match) -> None:
    with pytest.raises(OutputMismatch, match=match):
        task.check_outputs(outputs, targets)


@pytest.mark.parametrize(
    ("task", "targets", "match"),
    [
        (Classification(), torch.zeros(4), r"float32\[4\]: task=classification needs integer class labels"),
        (Regression(), torch.zeros(4, dtype=torch.long), r"int64\[4\]: task=regression needs floating-point"),
        (Multilabel(), torch.full((4, 2), 0.5), r"needs \[B, L\] targets of 0 and 1"),
        (NextToken(), torch.zeros(4, 3), r"needs \[B, T\] integer token ids"),
        (Classification(), {"y": torch.zeros(4)}, r"task=classification needs a tensor"),
    ],
)
def test_a_target_whose_dtype_does_not_fit_the_task_is_refused(task, targets, match) -> None:
    with pytest.raises(DatasetError, match=match):
        task.check_targets(targets)


def test_a_built_in_task_reads_logits_out_of_dicts_objects_and_tuples() -> None:
    x = torch.ones(2, 3)

    class Output:
        logits = x

    assert all(logits(o) is x for o in (x, {"logits": x}, Output(), (x, torch.zeros(1))))
    with pytest.raises(OutputMismatch, match=r"returned dict\(hidden: float32\[2, 3\]\)"):
        logits({"hidden": x})


@pytest.fixture
def user_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "usermetrics.py").write_text(
        "import torch\n\n"
        "def huber(outputs, targets, delta=1.0):\n"
        "    return torch.nn.functional.huber_loss(outputs, targets, delta=delta)\n\n"
        "def max_error(outputs, targets):\n    return float((outputs - targets).abs().max())\n\n"
        "class Count:\n"
        "    def __init__(self):\n        self.reset()\n"
        "    def reset(self):\n        self.n = 0\n"
        "    def update(self, outputs, targets):\n        self.n += len(targets)\n"
        "    def compute(self):\n        return torch.tensor(float(self.n))\n"
        "    def to(self, device):\n        return self\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usermetrics", raising=False)


def test_a_custom_task_uses_the_users_loss_callables_and_stateful_metrics(user_metrics: None) -> None:
    cfg = TaskConfig(
        "custom",
        loss=TargetConfig("usermetrics.huber", keywords={"delta": 0.5}),
        metrics=[TargetConfig("usermetrics.max_error"), TargetConfig("usermetrics.Count", name="seen")],
        primary="val/seen",
    )
    task = make_task(cfg)
    out, y = torch.tensor([0.0, 1.0, 3.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, 0.0])
    assert task.loss(out, y).item() == pytest.approx(F.huber_loss(out, y, delta=0.5).item())
    task.reset()
    metrics = finished(task, out, y)
    per_batch_max = (1.0 * 2 + 3.0 * 2) / 4  # averaged over batches, weighted by their samples
    assert metrics["val/max_error"] == pytest.approx(per_batch_max) and metrics["val/seen"] == 4.0
    assert metrics["val/loss"] == pytest.approx(F.huber_loss(out, y, delta=0.5).item())
    assert task.primary == "val/seen" and task.metric_names == ("val/loss", "val/max_error", "val/seen")
    unreduced = TargetConfig("torch.nn.functional.l1_loss", keywords={"reduction": "none"})
    with pytest.raises(OutputMismatch, match=r"task\.loss returned float32\[4\] .* expected a scalar tensor"):
        make_task(TaskConfig("custom", loss=unreduced)).check_outputs(out, y)


def test_torchmetrics_metrics_work_as_custom_metrics() -> None:
    pytest.importorskip("torchmetrics")
    cfg = TaskConfig(
        "custom",
        loss=TargetConfig("torch.nn.functional.cross_entropy"),
        metrics=[TargetConfig("torchmetrics.classification.MulticlassAccuracy", keywords={"num_classes": 3})],
    )
    task = make_task(cfg)
    out = torch.tensor([[3.0, 0, 0], [0, 3.0, 0], [0, 0, 3.0], [3.0, 0, 0]])
    y = torch.tensor([0, 1, 2, 2])
    task.reset()
    metrics = finished(task, out, y)
    assert metrics["val/MulticlassAccuracy"] == pytest.approx((1 + 1 + 0.5) / 3)  # macro: the classes' mean
