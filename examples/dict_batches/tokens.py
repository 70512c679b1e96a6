"""Token sequences of varying length as dict items, Hugging Face style: ``data._target_=tokens.reviews``.

An item is ``{"input_ids": ..., "target": label}``; ``pad`` (``data.collate_fn=tokens.pad``) pads a batch to its
longest sequence and adds the ``attention_mask``, so a batch is ``{"input_ids", "attention_mask", "target"}``. The
pipeline hands the model every entry but the target as a keyword: ``model(input_ids=..., attention_mask=...)``.

The "reviews" are made up: sequences of words from a small vocabulary, labelled positive when they hold more
words from the positive list than from the negative one.
"""

import random

import torch
from torch.utils.data import Dataset

VOCABULARY = 200  # token ids 1..199; 0 is padding
POSITIVE, NEGATIVE = range(10, 20), range(20, 30)


class Reviews(Dataset):
    classes = ("negative", "positive")

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.items = []
        for _ in range(n):
            length = rng.randrange(8, 40)
            ids = [rng.randrange(1, VOCABULARY) for _ in range(length)]
            score = sum(i in POSITIVE for i in ids) - sum(i in NEGATIVE for i in ids)
            if score == 0:  # a tie: one more word decides
                ids.append(rng.choice([*POSITIVE, *NEGATIVE]))
                score = 1 if ids[-1] in POSITIVE else -1
            self.items.append((torch.tensor(ids), int(score > 0)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | int]:
        ids, label = self.items[i]
        return {"input_ids": ids, "target": label}


def reviews(n_train: int = 2000, n_val: int = 400, seed: int = 0) -> dict[str, Reviews]:
    return {"train": Reviews(n_train, seed), "val": Reviews(n_val, seed + 1)}


def pad(items: list[dict]) -> dict[str, torch.Tensor]:
    """A batch of dict items, padded to the longest sequence, with the mask of real tokens."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
    return {"input_ids": ids, "attention_mask": ids != 0, "target": torch.tensor([item["target"] for item in items])}
