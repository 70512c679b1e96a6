"""The user's datasets (``data=custom``): what the factory returns, what the first items say, iterable streams and
their shares, resident tensors, and the hooks for batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipeline.common.errors import DatasetError
from pipeline.config import load
from pipeline.data import Place, ResidentLoader, Split, make_batches
from pipeline.data.custom import check_picklable
from pipeline.data.iterable import IterableLoader, check_shares, steps_per_epoch
from pipeline.data.sources import load_data
from pipeline.train import train

USERDATA = '''
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset


class Folder(Dataset):
    classes = ["cat", "dog", "owl"]
    class_to_idx = {"cat": 0, "dog": 1, "owl": 2}

    def __init__(self, n):
        self.x, self.y = torch.randn(n, 3, 4, 4), torch.arange(n) % 3

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def folder(n=24):
    whole = Folder(n)
    return Subset(whole, range(0, n - 6)), Subset(whole, range(n - 6, n))


class Counting(IterableDataset):
    """Items 0..n-1, dealt out by worker when ``shard``; ``set_epoch`` remembered."""

    def __init__(self, n=40, shard=True):
        self.n, self.shard, self.epochs = n, shard, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __len__(self):
        return self.n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info and self.shard else (0, 1)
        for i in range(worker, self.n, workers):
            yield torch.tensor([float(i)]), torch.tensor(float(i))


def counting(n=40, shard=True):
    return Counting(n, shard), Counting(8, shard)


class Boxes:
    def __init__(self, values):
        self.values = values


def boxes_collate(items):
    ys = torch.stack([y for _, y in items])
    return {"x": torch.stack([x for x, _ in items]), "boxes": Boxes(list(ys)), "target": ys}


def boxes(n=64):
    x, y = torch.randn(n, 4), torch.randn(n)
    return TensorDataset(x, y), TensorDataset(x[:16], y[:16])


def split_boxes(batch, pieces):
    inputs, targets = batch
    xs, ys = inputs["x"].tensor_split(pieces), targets.tensor_split(pieces)
    cut = [len(y) for y in ys]
    out, start = [], 0
    for x, y, size in zip(xs, ys, cut):
        out.append(({"x": x, "boxes": Boxes(inputs["boxes"].values[start:start + size])}, y))
        start += size
    return out


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, boxes):
        assert len(boxes.values) == x.shape[0]
        return self.fc(x).squeeze(-1)
'''


@pytest.fixture(autouse=True)
def userdata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "userdata.py").write_text(USERDATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "userdata", raising=False)


def custom(*overrides: str):
    return load(["data=custom", *overrides]).data


def test_the_classes_come_from_the_dataset_through_its_subset_and_are_kept(make_cfg) -> None:
    bundle = load_data(custom("data._target_=userdata.folder"))
    spec = bundle.spec
    assert (spec.in_shape, spec.num_classes, spec.classes) == ((3, 4, 4), 3, ("cat", "dog", "owl"))
    assert spec.class_to_idx == {"cat": 0, "dog": 1, "owl": 2} and (spec.train_size, spec.val_size) == (18, 6)
    assert not spec.builtin and spec.inputs == "float32[2, 3, 4, 4]" and len(spec.digest) == 8
    assert load_data(custom("data._target_=userdata.folder", "data.num_classes=5")).spec.num_classes == 5


def test_an_iterable_epoch_is_its_steps_and_a_stream_that_runs_out_starts_again(caplog) -> None:
    bundle = load_data(custom("data._target_=userdata.counting", "+data.n=40"))
    assert bundle.spec.iterable and bundle.spec.train_size == 40
    cfg = load(["loader.batch_size=8"]).loader
    assert steps_per_epoch(bundle.train, configured=None, batch_size=8, world=2) == 3  # 40 items over 2 ranks
    loader = IterableLoader(bundle.train, cfg, collate=bundle.collate, steps=7, pin=False, seed=0, start_method=None)
    loader.set_epoch(2)
    seen = [batch[1].tolist() for batch in loader]
    assert len(seen) == 7 and seen[5] == [0.0, 1, 2, 3, 4, 5, 6, 7]  # the 6th batch starts the stream again
    assert "the training stream ran out after 5 of the epoch's 7 batches" in caplog.text
    loader.set_epoch(3, skip=4)  # a resume inside the epoch: the batches before are read and dropped
    assert len(loader) == 3 and [b[1][0].item() for b in loader] == [32.0, 0.0, 8.0]
    assert bundle.train.epochs == [2, 3]


def test_an_iterable_without_a_length_needs_its_steps() -> None:
    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(1), torch.zeros(())

    with pytest.raises(DatasetError, match=r"without __len__: say how many batches make an epoch"):
        steps_per_epoch(Endless(), configured=None, batch_size=8, world=1)
    assert steps_per_epoch(Endless(), configured=12, batch_size=8, world=1) == 12


def test_ranks_or_workers_that_all_read_the_same_items_are_refused() -> None:
    cfg = load(["loader=workers", "loader.num_workers=2", "loader.batch_size=4"]).loader
    sharded = load_data(custom("data._target_=userdata.counting"))
    check_shares(sharded.train, cfg, collate=sharded.collate, gather=lambda d: [d], world=1)  # workers differ: fine
    same = load_data(custom("data._target_=userdata.counting", "+data.shard=false"))
    with pytest.raises(DatasetError, match=r"the loader's workers all yield the same training items"):
        check_shares(same.train, cfg, collate=same.collate, gather=lambda d: [d], world=1)
    alone = load(["loader.batch_size=4"]).loader
    with pytest.raises(DatasetError, match=r"every one of the 2 ranks yields the same training items: deal"):
        check_shares(sharded.train, alone, collate=sharded.collate, gather=lambda d: [d, d], world=2)
    check_shares(sharded.train, alone, collate=sharded.collate, gather=lambda d: [d, d + "x"], world=2)


def test_a_map_style_dataset_of_tensors_can_live_on_the_device(make_cfg) -> None:
    bundle = load_data(custom("data._target_=userdata.folder"))
    resident = load(["loader=resident", "loader.batch_size=5"]).loader
    batches = make_batches(
        Split(bundle.train, train=True, collate=bundle.collate), resident, Place(torch.device("cpu"), seed=0)
    )
    assert isinstance(batches, ResidentLoader)
    batches.set_epoch(1)
    inputs, targets = next(iter(batches))
    assert inputs.shape == (5, 3, 4, 4) and targets.dtype == torch.int64
    result = train(
        make_cfg(
            "data=custom",
            "data._target_=userdata.folder",
            "model=resnet18",
            "loader=resident",
            "loader.batch_size=6",
            "tracking=none",
        ),
        echo=False,
    )
    assert result.steps == 3 and result.loader == "resident, batch 6"


def test_spawn_workers_refuse_a_class_from_main(monkeypatch: pytest.MonkeyPatch) -> None:
    import __main__

    bundle = load_data(custom("data._target_=userdata.folder"))

    class Script(torch.utils.data.Dataset):
        def __getitem__(self, i):
            return torch.zeros(1), 0

        def __len__(self):
            return 4

    Script.__module__, Script.__qualname__ = "__main__", "Script"
    monkeypatch.setattr(__main__, "Script", Script, raising=False)
    spawn = load(["loader=workers", "loader.num_workers=2", "loader.multiprocessing_context=spawn"]).loader
    check_picklable(bundle, spawn)  # top-level classes of an importable module: fine
    bundle.train = Script()
    with pytest.raises(DatasetError, match=r"uses __main__\.Script, defined in __main__, which spawn loader workers"):
        check_picklable(bundle, spawn)
    check_picklable(
        bundle, load(["loader=workers", "loader.num_workers=2", "loader.multiprocessing_context=fork"]).loader
    )


def test_a_batch_the_fallback_cannot_cut_uses_the_users_split_hook(make_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.engine.hot.hooks as step

    original = step.call_model

    def oom_above_8(model, inputs):
        if model.training and inputs["x"].shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")
        return original(model, inputs)

    monkeypatch.setattr(step, "call_model", oom_above_8)
    base = [
        "model=custom",
        "model._target_=userdata.Net",
        "data=custom",
        "data._target_=userdata.boxes",
        "data.collate_fn=userdata.boxes_collate",
        "task=regression",
        "tracking=none",
    ]
    from pipeline.data.structures import Unsplittable

    with pytest.raises(Unsplittable, match=r"holding a userdata\.Boxes into micro-batches"):
        train(make_cfg(*base), echo=False)
    result = train(make_cfg(*base, "data.split_batch=userdata.split_boxes"), echo=False)
    assert [e.micro_batch for e in result.oom_events] == [32, 16] and result.micro_batch == 8
