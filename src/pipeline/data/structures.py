"""Batches as structures: a tensor, or tuples, lists, dicts and dataclasses of them, moved, cut and described whole.

A built-in source's batch is ``(uint8 images, labels)``; a user's is ``(inputs, targets)`` where ``inputs`` may be a
tensor, a tuple or list of them (a namedtuple, as torch's ``default_collate`` keeps it), a dict of keyword inputs
(``model(**inputs)``), a dataclass, or an object with a ``to(device)`` of its own. The loop, the prefetcher, the
out-of-memory fallback and the resident loader all go through these functions, so every one of them takes every batch,
and each container comes back as the type it was (a namedtuple as itself, a dict subclass as itself where it can be
made from pairs). A plain tensor takes the first branch of each: the built-in path pays one ``isinstance`` a call.

``dim`` is the dimension that counts samples: 0, or the user's ``data.batch_dim`` (1 for sequence-first ``[T, B]``
batches), along which a batch is cut, taken and joined.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from pipeline.common.errors import PipelineError


class Unsplittable(PipelineError):
    """A batch the out-of-memory fallback cannot cut into micro-batches; the message names the hook to provide."""


def _record(batch: Any) -> bool:
    """A dataclass instance (a class of the user's holding a batch's fields)."""
    return dataclasses.is_dataclass(batch) and not isinstance(batch, type)


def _fields(batch: Any) -> dict[str, Any]:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init}


def rebuilt(batch: Any, parts: Iterable[Any]) -> Any:
    """A container of ``batch``'s type holding ``parts`` in its order (a namedtuple takes them as its fields)."""
    kind = type(batch)
    if kind is tuple or kind is list:
        return kind(parts)
    if isinstance(batch, tuple) and hasattr(kind, "_fields"):
        return kind(*parts)
    if isinstance(batch, tuple | list):
        return kind(parts)
    if isinstance(batch, Mapping):
        pairs = dict(zip(batch, parts, strict=True))
        return pairs if kind is dict else _mapping(kind, pairs)
    return dataclasses.replace(batch, **dict(zip(_fields(batch), parts, strict=True)))


def _mapping(kind: type, pairs: dict[str, Any]) -> Any:
    """A dict subclass made from ``pairs`` (``OrderedDict``, Hugging Face's ``BatchEncoding``), or a plain dict."""
    try:
        return kind(pairs)
    except Exception:  # a mapping that cannot be made from pairs: its entries, as a dict
        return pairs


def children(batch: Any) -> list[Any] | None:
    """The parts of a container in order; None for a leaf (a tensor, or anything else)."""
    if isinstance(batch, torch.Tensor):
        return None
    if isinstance(batch, Mapping):
        return list(batch.values())
    if isinstance(batch, tuple | list):
        return list(batch)
    if _record(batch):
        return list(_fields(batch).values())
    return None


def move(batch: Any, device: torch.device, *, non_blocking: bool = True) -> Any:
    """``batch`` on ``device``: every tensor in it copied (a no-op for tensors there already), an object with a ``to``
    of its own moved by it, the rest as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    parts = children(batch)
    if parts is not None:
        return rebuilt(batch, [move(v, device, non_blocking=non_blocking) for v in parts])
    to = getattr(batch, "to", None)
    return to(device) if callable(to) and not isinstance(batch, type) else batch


def leaves(batch: Any) -> list[torch.Tensor]:
    """The tensors in ``batch``, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    parts = children(batch)
    return [t for v in parts for t in leaves(v)] if parts is not None else []


def count(batch: Any, dim: int = 0) -> int:
    """Samples in ``batch``: dimension ``dim`` of its first tensor (a list of per-sample objects: its length)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[dim] if batch.dim() > dim else 1
    tensors = leaves(batch)
    if tensors:
        return count(tensors[0], dim)
    return len(batch) if isinstance(batch, tuple | list) else 1


def split(batch: Any, pieces: int, dim: int = 0) -> list[Any]:
    """``batch`` cut into ``pieces`` micro-batches along ``dim``, as ``torch.tensor_split`` cuts a tensor (the larger
    pieces first), every tensor in it cut alike.

    Raises:
        Unsplittable: something in it is no tensor, tuple, list, dict or dataclass (``data.split_batch`` can cut it).
    """
    if pieces == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(pieces, dim=dim))
    if batch is None or isinstance(batch, str | bytes | int | float | bool):  # the batch's, not a sample's: in each
        return [batch] * pieces
    parts = children(batch)
    if parts is None:
        raise Unsplittable(
            f"the out-of-memory fallback cannot cut a batch holding a {type(batch).__module__}."
            f"{type(batch).__qualname__} into micro-batches (it cuts tensors, tuples, lists, dicts and dataclasses of "
            f"them along the batch dimension): give data.split_batch a _target_, a function (batch, pieces) -> list of "
            f"micro-batches, or set oom.enabled=false"
        )
    columns = [split(v, pieces, dim) for v in parts]
    return [rebuilt(batch, [column[i] for column in columns]) for i in range(pieces)]


def take(batch: Any, index: torch.Tensor | slice, dim: int = 0) -> Any:
    """The samples ``index`` selects from every tensor of ``batch`` (a resident dataset's batch)."""
    if isinstance(batch, torch.Tensor):
        return batch[index] if dim == 0 else batch[(slice(None),) * dim + (index,)]
    parts = children(batch)
    return rebuilt(batch, [take(v, index, dim) for v in parts]) if parts is not None else batch


def concat(parts: list[Any], dim: int = 0) -> Any:
    """Batches of the same structure joined along ``dim``."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=dim)
    if children(first) is None:
        return first
    columns = zip(*(children(p) or [] for p in parts), strict=True)
    return rebuilt(first, [concat(list(column), dim) for column in columns])


def apply(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` on every tensor of ``batch`` (``record_stream``, ``pin_memory``), the structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    parts = children(batch)
    return rebuilt(batch, [apply(v, fn) for v in parts]) if parts is not None else batch


def detached(batch: Any) -> Any:
    """``batch`` with every tensor detached from its graph (a step's state carried to the next step)."""
    return apply(batch, torch.Tensor.detach)


def only_tensors(batch: Any) -> bool:
    """Whether every leaf of ``batch`` is a tensor (what a resident dataset can index)."""
    if isinstance(batch, torch.Tensor):
        return True
    parts = children(batch)
    return parts is not None and all(only_tensors(v) for v in parts)


def nbytes(batch: Any) -> int:
    """Bytes the tensors of ``batch`` hold."""
    return sum(t.numel() * t.element_size() for t in leaves(batch))


def sample_bytes(batch: Any) -> int | None:
    """Bytes one sample of an ``(inputs, targets)`` batch holds (None: it holds something besides tensors)."""
    if not only_tensors(batch):
        return None
    return nbytes(batch) // max(count(batch[1]), 1)


def digest(batches: list[Any]) -> str:
    """8 hex digits that change when the samples change: the shapes, dtypes and bytes of every tensor."""
    h = hashlib.sha256()
    for batch in batches:
        for t in leaves(batch):
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:8]


def describe(batch: Any) -> str:
    """``dict(input_ids: int64[32, 128], mask: bool[32, 128])``: a structure's shape for messages."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, Mapping):
        return f"{type(batch).__name__}(" + ", ".join(f"{k}: {describe(v)}" for k, v in batch.items()) + ")"
    parts = children(batch)
    if parts is not None and _record(batch):
        return f"{type(batch).__name__}(" + ", ".join(f"{k}: {describe(v)}" for k, v in _fields(batch).items()) + ")"
    if parts is not None:
        return f"{type(batch).__name__}(" + ", ".join(describe(v) for v in parts) + ")"
    return type(batch).__name__


def call_model(model: Callable[..., Any], inputs: Any, **extra: Any) -> Any:
    """``model(**inputs)`` for keyword inputs (a dict, as Hugging Face models take them), else ``model(inputs)``;
    ``extra`` keywords too (``labels=``, for a model that computes its own loss)."""
    if isinstance(inputs, Mapping):
        return model(**inputs, **extra)
    return model(inputs, **extra)
