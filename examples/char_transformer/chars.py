"""Windows of a text file as next-character examples: ``data._target_=chars.windows``.

An item is ``(x, y)``: ``block`` character ids and the same window moved on by one character, so the model learns
to predict each next character (``task=next_token``). The vocabulary is the characters of the file, kept as the
dataset's ``classes`` (torchvision's convention), which is how the pipeline knows the model's output size.
"""

from pathlib import Path

import torch
from torch.utils.data import Dataset


class Windows(Dataset):
    def __init__(self, ids: torch.Tensor, block: int, stride: int, vocabulary: list[str]) -> None:
        self.ids, self.block, self.stride = ids, block, stride
        self.classes = vocabulary  # one class per character: the model's num_classes

    def __len__(self) -> int:
        return max(0, (len(self.ids) - self.block - 1) // self.stride + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.ids[start : start + self.block + 1]
        return chunk[:-1], chunk[1:]


def windows(path: str = "text.txt", block: int = 64, stride: int = 16, val_fraction: float = 0.1):
    """(train, val): the text's first part and its last ``val_fraction``, cut into overlapping windows."""
    text = Path(path).read_text(encoding="utf-8")
    vocabulary = sorted(set(text))
    ids = torch.tensor([vocabulary.index(c) for c in text], dtype=torch.long)
    cut = int(len(ids) * (1 - val_fraction))
    return Windows(ids[:cut], block, stride, vocabulary), Windows(ids[cut:], block, stride, vocabulary)
