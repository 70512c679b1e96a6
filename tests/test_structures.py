"""Batches as structures: moved, cut, gathered and described whole, whatever the user's items hold."""

from __future__ import annotations

import pytest
import torch

from pipeline.data.structures import Unsplittable, call_model, concat, count, describe, digest, move, split, take


def batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    inputs = {"ids": torch.arange(10).view(5, 2), "mask": torch.ones(5, 2, dtype=torch.bool)}
    return inputs, torch.arange(5).float()


def test_a_dict_batch_is_cut_along_the_first_dimension_as_tensor_split_cuts_a_tensor() -> None:
    parts = split(batch(), 2)
    assert [count(p[1]) for p in parts] == [3, 2]  # the larger piece first, like torch.tensor_split
    assert torch.equal(parts[1][0]["ids"], torch.tensor([[6, 7], [8, 9]])) and parts[1][1].tolist() == [3.0, 4.0]
    joined = concat([p[0] for p in parts])
    assert torch.equal(joined["ids"], batch()[0]["ids"]) and joined["mask"].dtype == torch.bool


def test_nested_tuples_and_lists_keep_their_types_when_cut_and_taken() -> None:
    nested = ([torch.zeros(4, 1), (torch.ones(4), torch.arange(4))], torch.arange(4))
    (first, _), (second, _) = split(nested, 2)
    assert isinstance(first, list) and isinstance(first[1], tuple) and first[1][1].tolist() == [0, 1]
    assert take(nested, torch.tensor([3, 0]))[1].tolist() == [3, 0] and second[1][1].tolist() == [2, 3]


def test_a_batch_holding_something_else_names_its_type_and_the_hook_to_provide() -> None:
    class Boxes:
        pass

    with pytest.raises(Unsplittable, match=r"cannot cut a batch holding a .*Boxes .* give data\.split_batch a "):
        split(([Boxes()], torch.zeros(2)), 2)
    assert split(([Boxes()], torch.zeros(2)), 1)[0][1].shape == (2,)  # one piece: nothing to cut


def test_moving_leaves_non_tensors_alone_and_describe_names_every_shape() -> None:
    moved = move({"ids": torch.zeros(2, 3, dtype=torch.long), "note": "x"}, torch.device("cpu"))
    assert moved["note"] == "x"
    assert describe(batch()) == "tuple(dict(ids: int64[5, 2], mask: bool[5, 2]), float32[5])"


def test_the_digest_changes_with_any_byte_and_with_the_shape() -> None:
    one = digest([batch()])
    changed = batch()
    changed[0]["ids"][4, 1] = 99
    assert one == digest([batch()]) and one != digest([changed]) and len(one) == 8
    assert digest([torch.zeros(2, 3)]) != digest([torch.zeros(3, 2)])


def test_keyword_inputs_are_passed_by_name() -> None:
    assert call_model(lambda ids, mask: ids.sum() + mask.sum(), batch()[0]) == 45 + 10
    assert call_model(lambda x: x * 2, torch.ones(1)).item() == 2


Inp = __import__("collections").namedtuple("Inp", ["a", "b"])


@__import__("dataclasses").dataclass
class Pair:
    ids: torch.Tensor
    mask: torch.Tensor
    note: str = "kept"


def test_namedtuples_survive_moving_cutting_taking_and_joining() -> None:
    """Issue 36 (9): torch's default_collate keeps namedtuples, and type(batch)(generator) could not rebuild one."""
    from torch.utils.data import default_collate

    batch = default_collate([(Inp(torch.full((2,), i), torch.tensor(i)), i) for i in range(6)])
    assert isinstance(batch[0], Inp)
    moved = move(batch, torch.device("cpu"))
    parts = split(moved, 3)
    assert all(isinstance(p[0], Inp) for p in parts) and [p[0].b.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    joined = concat([p[0] for p in parts])
    assert isinstance(joined, Inp) and torch.equal(joined.a, batch[0].a)
    assert take(batch, torch.tensor([5, 0]))[0].b.tolist() == [5, 0]
    assert describe(batch) == "list(Inp(int64[6, 2], int64[6]), int64[6])"


def test_dataclass_batches_are_cut_field_by_field_and_keep_their_other_fields() -> None:
    pair = Pair(torch.arange(8).view(4, 2), torch.ones(4, 2, dtype=torch.bool))
    first, second = split(pair, 2)
    assert isinstance(first, Pair) and first.ids.tolist() == [[0, 1], [2, 3]] and second.note == "kept"
    assert torch.equal(concat([first, second]).ids, pair.ids) and count(pair) == 4
    assert describe(pair) == "Pair(ids: int64[4, 2], mask: bool[4, 2], note: str)"


def test_an_object_with_its_own_to_is_moved_by_it() -> None:
    class Boxes:
        def to(self, device: torch.device) -> str:
            return f"moved to {device}"

    assert move((Boxes(), torch.zeros(1)), torch.device("cpu"))[0] == "moved to cpu"


def test_sequence_first_batches_are_counted_and_cut_along_their_batch_dimension() -> None:
    tokens = torch.arange(24).view(6, 4)  # [T, B]
    assert count(tokens, 1) == 4 and count((tokens, tokens), 1) == 4
    first, second = split((tokens, tokens), 2, dim=1)
    assert first[0].shape == (6, 2) and torch.equal(concat([first[0], second[0]], dim=1), tokens)
    assert take(tokens, slice(1, 3), dim=1).tolist() == tokens[:, 1:3].tolist()
