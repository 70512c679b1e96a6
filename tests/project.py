"""A user's own project, written by tests into a folder outside the package: a network, its datasets, a loss.

    cd <folder> && python -m pipeline model=custom model._target_=nets.Tiny data=custom data._target_=sets.make \\
        task=regression

``nets.Tiny`` takes a tensor; ``nets.Keyed`` takes keyword inputs (dict items, as Hugging Face models take them).
``sets.make`` returns ``(train, val)`` of a noisy linear target, as tensors or as dict items.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

NETS = '''
import torch
from torch import nn


class Tiny(nn.Module):
    """A two-layer regressor; in_shape comes from the data."""

    def __init__(self, in_shape, width=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_shape[0], width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


class Keyed(nn.Module):
    """The same, for keyword inputs: model(features=..., scale=...)."""

    def __init__(self, width=32, features=8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, features, scale):
        return self.net(features).squeeze(-1) * scale


def not_a_module(in_shape):
    return {"weights": 1}


def broken(width=32):
    raise ValueError(f"width {width} is too wide for this test")
'''

SETS = """
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset


class Keyed(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i], "scale": torch.tensor(1.0), "target": self.y[i]}


def make(n=512, features=8, seed=0, dict_items=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, generator=g)
    y = x @ w + 0.1 * torch.randn(n, generator=g)
    cut = n * 4 // 5
    if dict_items:
        return {"train": Keyed(x[:cut], y[:cut]), "val": Keyed(x[cut:], y[cut:])}
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def labels(n=64):
    x = torch.randn(n, 8)
    return TensorDataset(x, torch.rand(n)), TensorDataset(x, torch.rand(n))


def strings(n=16):
    return [("a sentence", 1)] * n, [("another", 0)] * n


def one(n=16):
    return TensorDataset(torch.randn(n, 8), torch.randn(n))


class Stream(IterableDataset):
    def __iter__(self):
        for _ in range(40):
            yield torch.randn(8), torch.randn(())


def stream():
    return Stream(), Stream()


class Lambda(Dataset):
    def __init__(self):
        self.fn = lambda i: (torch.randn(8), torch.randn(()))

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return self.fn(i)


def with_lambda():
    return Lambda(), Lambda()
"""

FILES = {"nets.py": NETS, "sets.py": SETS}
MODULES = ("nets", "sets")
REGRESSION = ["model=custom", "model._target_=nets.Tiny", "data=custom", "data._target_=sets.make", "task=regression"]
KEYED = [
    "model=custom",
    "model._target_=nets.Keyed",
    "data=custom",
    "data._target_=sets.make",
    "+data.dict_items=true",
    "task=regression",
]


def write_project(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in FILES.items():
        (folder / name).write_text(text.lstrip())
    return folder


def use_project(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Write the project into ``folder`` and make it importable as a launch folder is, without modules of the same
    name left over from another test's folder."""
    write_project(folder)
    monkeypatch.syspath_prepend(str(folder))
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    return folder
