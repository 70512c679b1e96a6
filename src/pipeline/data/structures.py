"""Batches as structures: a tensor, or tuples, lists and dicts of them, moved, cut and described as a whole.

A built-in source's batch is ``(uint8 images, labels)``; a user's is ``(inputs, targets)`` where ``inputs`` may be a
tensor, a tuple or list of them, or a dict of keyword inputs (``model(**inputs)``). The loop, the prefetcher, the
out-of-memory fallback and the resident loader all go through these functions, so every one of them takes every
batch. A plain tensor takes the first branch of each: the built-in path pays one ``isinstance`` a call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pipeline.common.errors import PipelineError


class Unsplittable(PipelineError):
    """A batch the out-of-memory fallback cannot cut into micro-batches; the message names the hook to provide."""


def move(batch: Any, device: torch.device, *, non_blocking: bool = True) -> Any:
    """``batch`` on ``device``: every tensor in it copied (a no-op for tensors there already), the rest as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: move(v, device, non_blocking=non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(move(v, device, non_blocking=non_blocking) for v in batch)
    return batch


def leaves(batch: Any) -> list[torch.Tensor]:
    """The tensors in ``batch``, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in leaves(v)]
    if isinstance(batch, tuple | list):
        return [t for v in batch for t in leaves(v)]
    return []


def count(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (a list of per-sample objects: its length)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    tensors = leaves(batch)
    if tensors:
        return count(tensors[0])
    return len(batch) if isinstance(batch, tuple | list) else 1


def split(batch: Any, pieces: int) -> list[Any]:
    """``batch`` cut into ``pieces`` micro-batches along the first dimension, as ``torch.tensor_split`` cuts a tensor
    (the larger pieces first), every tensor in it cut alike.

    Raises:
        Unsplittable: something in it is no tensor, tuple, list or dict (``data.split_batch`` can cut it).
    """
    if pieces == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(pieces))
    if isinstance(batch, Mapping):
        parts = {k: split(v, pieces) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(pieces)]
    if isinstance(batch, tuple | list):
        columns = [split(v, pieces) for v in batch]
        return [type(batch)(column[i] for column in columns) for i in range(pieces)]
    raise Unsplittable(
        f"the out-of-memory fallback cannot cut a batch holding a {type(batch).__module__}.{type(batch).__qualname__} "
        f"into micro-batches (it cuts tensors, tuples, lists and dicts of them along dim 0): give data.split_batch a "
        f"_target_, a function (batch, pieces) -> list of micro-batches, or set oom.enabled=false"
    )


def take(batch: Any, index: torch.Tensor | slice) -> Any:
    """The samples ``index`` selects from every tensor of ``batch`` (a resident dataset's batch)."""
    if isinstance(batch, torch.Tensor):
        return batch[index]
    if isinstance(batch, Mapping):
        return {k: take(v, index) for k, v in batch.items()}
    return type(batch)(take(v, index) for v in batch)


def concat(parts: list[Any]) -> Any:
    """Batches of the same structure joined along the first dimension."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, Mapping):
        return {k: concat([p[k] for p in parts]) for k in first}
    return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))


def apply(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` on every tensor of ``batch`` (``record_stream``, ``pin_memory``), the structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: apply(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(apply(v, fn) for v in batch)
    return batch


def only_tensors(batch: Any) -> bool:
    """Whether every leaf of ``batch`` is a tensor (what a resident dataset can index)."""
    if isinstance(batch, torch.Tensor):
        return True
    if isinstance(batch, Mapping):
        return all(only_tensors(v) for v in batch.values())
    if isinstance(batch, tuple | list):
        return all(only_tensors(v) for v in batch)
    return False


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
        return "dict(" + ", ".join(f"{k}: {describe(v)}" for k, v in batch.items()) + ")"
    if isinstance(batch, tuple | list):
        return f"{type(batch).__name__}(" + ", ".join(describe(v) for v in batch) + ")"
    return type(batch).__name__


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """``model(**inputs)`` for keyword inputs (a dict, as Hugging Face models take them), else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)
