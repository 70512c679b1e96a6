"""A word-level corpus, as research code for recurrent language models reads one: each line's words and an end-of-line
token, numbered in order of first appearance, one long tensor of word ids per split."""

from pathlib import Path

import torch


class Vocabulary:
    def __init__(self):
        self.index = {}
        self.words = []

    def add(self, word):
        if word not in self.index:
            self.index[word] = len(self.words)
            self.words.append(word)
        return self.index[word]

    def __len__(self):
        return len(self.words)


class Corpus:
    """``train`` and ``valid``: the ids of ``folder/train.txt`` and ``folder/valid.txt``, over one vocabulary."""

    def __init__(self, folder):
        self.vocabulary = Vocabulary()
        self.train = self.read(Path(folder) / "train.txt")
        self.valid = self.read(Path(folder) / "valid.txt")

    def read(self, path):
        ids = []
        with open(path, encoding="utf8") as text:
            for line in text:
                ids.extend(self.vocabulary.add(word) for word in [*line.split(), "<eos>"])
        return torch.tensor(ids, dtype=torch.int64)


def batchify(ids, batch_size):
    """The id stream cut into ``batch_size`` columns, one below the other: ``[length, batch_size]``."""
    rows = ids.size(0) // batch_size
    return ids[: rows * batch_size].view(batch_size, rows).t().contiguous()
