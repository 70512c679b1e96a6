"""The user's own datasets (``data=custom``): made by their factory, checked before any run starts.

    python -m pipeline data=custom data._target_=sets.make data.n=1000

The factory returns ``(train, val)`` or ``{"train": ..., "val": ...}``, each a map-style dataset (``__getitem__``
and ``__len__``) or a ``torch.utils.data.IterableDataset``. An item is ``(input, target)``, or a dict whose
``data.target_key`` entry is the target and whose other entries are the model's keyword inputs; ``Batches`` turns
every collated batch into ``(inputs, targets)``, in the loader's workers. The first items are read at start-up: a
factory that returns no datasets, items that hold no tensors, a dataset that spawn workers cannot pickle and an
iterable dataset without a length or ``data.steps_per_epoch`` are each one line, before any MLflow run is opened.

The class count comes from ``data.num_classes`` or the dataset's ``classes`` (torchvision's convention, looked for
through ``Subset`` wrappers); ``class_to_idx`` is kept with the run. Items reach the model as they are: no
normalisation and no augmentation (a dataset's own transform does those).
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import pickle
import pickletools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from pipeline.common.errors import ConfigError, DatasetError
from pipeline.common.messages import brief
from pipeline.common.targets import FactoryFailed, hook, instantiate, source_file
from pipeline.config import DataConfig, LoaderConfig
from pipeline.data import structures

log = logging.getLogger(__name__)

DIGEST_ITEMS = 64  # the dataset input's digest covers this many first items of each split


@dataclass(frozen=True)
class Batches:
    """A collate function that hands the loop ``(inputs, targets)``: the user's ``collate`` (or torch's default, which
    then stacks samples along ``batch_dim``) first, then a dict batch's ``target_key`` entry taken out as the targets,
    and integer class labels or token ids of any width as int64 (``long_targets``: what cross-entropy takes; int32
    labels from NumPy would fail at the first step). Picklable, for spawn workers; runs in them."""

    collate: Callable[[list[Any]], Any]
    target_key: str
    batch_dim: int = 0
    long_targets: bool = False

    def __call__(self, items: list[Any]) -> tuple[Any, Any]:
        inputs, targets = as_pair(self.collate(items), self.target_key)
        if self.batch_dim and self.collate is default_collate:  # stacked along 0: the samples' dimension moved
            inputs, targets = (structures.apply(part, self._moved) for part in (inputs, targets))
        return inputs, self.as_targets(targets)

    def as_targets(self, targets: Any) -> Any:
        """Integer targets of any width as int64 where the task scores class labels or token ids."""
        if self.long_targets and isinstance(targets, torch.Tensor) and _narrow_integer(targets):
            return targets.long()
        return targets

    def _moved(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.movedim(0, self.batch_dim).contiguous() if tensor.dim() > self.batch_dim else tensor


def _narrow_integer(targets: torch.Tensor) -> bool:
    """Integers other than int64 (bool is no label)."""
    return (
        targets.dtype not in (torch.int64, torch.bool) and not targets.is_floating_point() and not targets.is_complex()
    )


def as_pair(batch: Any, target_key: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a collated batch: a dict loses its target entry, a pair stays as it is."""
    if isinstance(batch, Mapping):
        if target_key not in batch:
            raise DatasetError(
                f"a batch is a dict without the {target_key!r} entry (its keys: {', '.join(map(str, batch))}): set "
                f"data.target_key to the target's key"
            )
        return {k: v for k, v in batch.items() if k != target_key}, batch[target_key]
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    raise DatasetError(
        f"a batch is {structures.describe(batch)}: expected (inputs, targets) or a dict with a {target_key!r} entry "
        f"(from the dataset's items, or data.collate_fn)"
    )


@dataclass(frozen=True)
class Custom:
    """What ``load`` found: the splits, how to batch them, and what the first items say."""

    train: Any
    val: Any
    collate: Batches
    split_batch: Callable[[Any, int], list[Any]] | None
    first: tuple[Any, Any]  # the first two training items as one batch: (inputs, targets)
    classes: tuple[str, ...] | None
    class_to_idx: dict[str, int] | None
    num_classes: int | None
    source: str
    digest: str

    @property
    def iterable(self) -> bool:
        return isinstance(self.train, IterableDataset)


def load(cfg: DataConfig, *, batch_size: int | None = None, long_targets: bool = False) -> Custom:
    """Make the user's datasets and check their first items. The factory receives ``batch_size``
    (``loader.batch_size``) where its signature names it and the group does not set it: data laid out in batch order
    is not told its batch size twice. ``long_targets``: integer targets become int64 (``Batches``).

    Raises:
        DatasetError: no datasets, items that are not tensors (or dicts or tuples of them).
        TargetError: the factory cannot be imported or raised (``pipeline.common.targets``).
    """
    path = str(cfg._target_)
    supplied = {"batch_size": batch_size} if batch_size is not None else {}
    made = instantiate(path, cfg.keywords, key="data", supplied=supplied)
    train, val = _splits(made, path)
    collate = Batches(_collate(cfg), cfg.target_key, cfg.batch_dim, long_targets)
    first_items = [_item(train, i, "training", path) for i in range(2)]
    first_items = [item for item in first_items if item is not None]
    if not first_items:
        raise DatasetError(f"data._target_={path}: the training set yields no items")
    if cfg.collate_fn is None:
        for index, item in enumerate(first_items):
            check_item(item, cfg.target_key, where=f"training item {index}")
    first = collate(first_items)
    check_batch(first, where="the first training batch", batch_dim=cfg.batch_dim)
    if _item(val, 0, "validation", path) is None:
        raise DatasetError(f"data._target_={path}: the validation set yields no items")
    classes, class_to_idx = _classes(train)
    num_classes = cfg.num_classes or (len(classes) if classes else None)
    cut = cfg.split_batch
    split = hook(cut._target_, cut.keywords, key="data.split_batch", partial=cut._partial_) if cut else None
    return Custom(
        train=train,
        val=val,
        collate=collate,
        split_batch=split,
        first=first,
        classes=classes,
        class_to_idx=class_to_idx,
        num_classes=num_classes,
        source=f"{path} ({source_file(made if not isinstance(made, tuple | list | Mapping) else train) or 'code'})",
        digest=structures.digest([_digested(_first_items(s), collate) for s in (train, val)]),
    )


def _collate(cfg: DataConfig) -> Callable[[list[Any]], Any]:
    if cfg.collate_fn is None:
        return default_collate
    made = cfg.collate_fn
    return hook(made._target_, made.keywords, key="data.collate_fn", partial=made._partial_)


def _splits(made: Any, path: str) -> tuple[Any, Any]:
    if isinstance(made, Mapping):
        missing = [k for k in ("train", "val") if k not in made]
        if missing:
            raise DatasetError(
                f"data._target_={path} returned a dict without {' and '.join(repr(m) for m in missing)} (its keys: "
                f"{', '.join(map(str, made))}): return (train, val) or {{'train': ..., 'val': ...}}"
            )
        pair: Sequence[Any] = (made["train"], made["val"])
    elif isinstance(made, tuple | list) and len(made) == 2:
        pair = made
    else:
        what = "one dataset" if is_dataset(made) else f"a {type(made).__name__}"
        raise DatasetError(
            f"data._target_={path} returned {what}: return (train, val) or {{'train': ..., 'val': ...}}, each a "
            f"torch.utils.data.Dataset"
        )
    for name, dataset in zip(("train", "val"), pair, strict=True):
        if not is_dataset(dataset):
            raise DatasetError(
                f"data._target_={path} returned a {type(dataset).__name__} as {name}: expected a dataset "
                f"(map-style: __getitem__ and __len__; or a torch.utils.data.IterableDataset)"
            )
    return pair[0], pair[1]


def is_dataset(obj: Any) -> bool:
    """A map-style dataset (``__getitem__`` and ``__len__``, a ``Dataset`` or not) or an ``IterableDataset``."""
    if isinstance(obj, IterableDataset):
        return True
    if isinstance(obj, str | bytes | torch.Tensor | Mapping):
        return False
    return isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


def _item(dataset: Any, index: int, split: str, path: str) -> Any:
    """Item ``index`` of a split (an iterable's ``index``-th), None when it has fewer."""
    try:
        if isinstance(dataset, IterableDataset):
            for i, item in enumerate(dataset):
                if i == index:
                    return item
            return None
        if len(dataset) <= index:
            return None
        return dataset[index]
    except DatasetError:
        raise
    except Exception as err:
        raise FactoryFailed(
            f"data._target_={path}: reading {split} item {index} raised {brief(err, first_line=True)} "
            "(--debug shows the traceback)"
        ) from err


def _digested(items: list[Any], collate: Batches) -> Any:
    """The first items as the digest reads them: one batch, or, where they do not stack into one (sequences of
    different lengths, laid out in batches of their own), each item as a batch of one."""
    try:
        return collate(items)
    except RuntimeError:  # torch's default_collate: items of different sizes
        return [collate([item]) for item in items]


def _first_items(dataset: Any) -> list[Any]:
    items = []
    if isinstance(dataset, IterableDataset):
        for item in dataset:
            items.append(item)
            if len(items) == DIGEST_ITEMS:
                break
        return items
    return [dataset[i] for i in range(min(DIGEST_ITEMS, len(dataset)))]


LEAVES = (torch.Tensor, int, float, bool)


def check_item(item: Any, target_key: str, *, where: str) -> None:
    """An item the default collate turns into tensors: ``(input, target)`` or a dict with ``target_key``.

    Raises:
        DatasetError: another shape, or something inside that is no tensor, array or number.
    """
    if isinstance(item, Mapping):
        if target_key not in item:
            raise DatasetError(
                f"{where} is a dict without the {target_key!r} entry (its keys: {', '.join(map(str, item))}): set "
                f"data.target_key to the target's key"
            )
        _check_leaves(item, where)
        return
    if isinstance(item, tuple | list) and len(item) == 2:
        _check_leaves(item, where)
        return
    size = f" of {len(item)}" if isinstance(item, tuple | list) else ""
    raise DatasetError(
        f"{where} is a {type(item).__name__}{size}: expected (input, target), or a dict whose {target_key!r} entry is "
        f"the target (data.target_key) and whose other entries are the model's keyword inputs"
    )


def _check_leaves(value: Any, where: str) -> None:
    import numpy as np

    if isinstance(value, (*LEAVES, np.ndarray, np.number)):
        return
    if isinstance(value, Mapping):
        for v in value.values():
            _check_leaves(v, where)
        return
    if isinstance(value, tuple | list):
        for v in value:
            _check_leaves(v, where)
        return
    hint = {
        "Image": "add torchvision.transforms.ToTensor() (or PILToTensor()) to the dataset's transform",
        "str": "turn text into token tensors in the dataset, or give data.collate_fn that does",
    }.get(type(value).__name__, "return tensors, arrays or numbers, or give data.collate_fn that makes them")
    raise DatasetError(f"{where} holds a {type(value).__module__}.{type(value).__name__}, not a tensor: {hint}")


def check_batch(batch: tuple[Any, Any], *, where: str, batch_dim: int = 0) -> None:
    """The collated ``(inputs, targets)`` hold tensors (inputs may also hold other values the model takes), the first
    of them with a ``data.batch_dim`` to count samples along."""
    inputs, targets = batch
    if not structures.leaves(inputs):
        raise DatasetError(f"{where}'s inputs are {structures.describe(inputs)}: no tensor in them")
    if not isinstance(targets, torch.Tensor) and not structures.leaves(targets):
        raise DatasetError(f"{where}'s targets are {structures.describe(targets)}: expected a tensor")
    first = structures.leaves(inputs)[0]
    if batch_dim and first.dim() <= batch_dim:
        raise ConfigError(
            "data.batch_dim",
            batch_dim,
            f"a dimension of {where}'s inputs ({structures.describe(inputs)}: {first.dim()} of them), the one its "
            f"samples lie along",
        )


def _classes(dataset: Any) -> tuple[tuple[str, ...] | None, dict[str, int] | None]:
    """``classes`` and ``class_to_idx`` of a dataset or what it wraps (``Subset.dataset``, ...)."""
    seen = 0
    while dataset is not None and seen < 5:
        classes = getattr(dataset, "classes", None)
        if isinstance(classes, Sequence) and not isinstance(classes, str) and classes:
            mapping = getattr(dataset, "class_to_idx", None)
            mapping = {str(k): int(v) for k, v in mapping.items()} if isinstance(mapping, Mapping) else None
            return tuple(str(c) for c in classes), mapping
        dataset, seen = getattr(dataset, "dataset", None), seen + 1
    return None, None


def start_method(loader: LoaderConfig) -> str | None:
    """How this run's loader workers start (None: no workers): ``loader.multiprocessing_context`` or the default."""
    if loader.num_workers == 0:
        return None
    if loader.multiprocessing_context != "auto":
        return loader.multiprocessing_context
    return multiprocessing.get_start_method(allow_none=False)


def check_picklable(custom: Any, loader: LoaderConfig) -> None:
    """Spawn and forkserver workers receive the datasets and the collate function pickled; refuse at start what
    they could not receive: a lambda or a local function inside, or a class defined in ``__main__`` (a worker
    imports ``__main__`` afresh and does not find it). ``custom`` has ``train``, ``val`` and ``collate``.

    Raises:
        DatasetError: naming what failed and the three ways out.
    """
    method = start_method(loader)
    if method not in ("spawn", "forkserver"):
        return
    fixes = (
        "define it at the top level of an importable module (not in __main__, no lambda), or set "
        "loader.num_workers=0, or loader.multiprocessing_context=fork where the platform has it"
    )
    for name, obj in (("training set", custom.train), ("validation set", custom.val), ("collate", custom.collate)):
        try:
            pickled = pickle.dumps(obj)
        except Exception as err:
            raise DatasetError(f"the {name} cannot be sent to {method} loader workers ({brief(err)}): {fixes}") from err
        from_main = next((symbol for symbol in _globals(pickled) if symbol.startswith("__main__ ")), None)
        if from_main is not None:
            raise DatasetError(
                f"the {name} uses {from_main.replace(' ', '.')}, defined in __main__, which {method} loader workers "
                f"cannot import: {fixes}"
            )


def _globals(data: bytes) -> list[str]:
    """The ``module name`` globals a pickle refers to."""
    found: list[str] = []
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        if op.name in ("GLOBAL", "INST"):
            found.append(str(arg))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.append(f"{strings[-2]} {strings[-1]}")
        if isinstance(arg, str):
            strings.append(arg)
    return found
