"""What puts the research code (corpus.py, model.py, unchanged) into the pipeline: its data, its model and its step.

python -m pipeline --config-dir conf experiment=word_lm
"""

from corpus import Corpus, batchify
from model import RecurrentLM
from torch.utils.data import Dataset


class Columns(Dataset):
    """A batchified split in batch order: item ``k * batch_size + b`` is column ``b`` of the ``k``-th window of ``bptt``
    rows and, shifted by one, its targets. Read in order (``loader.shuffle=false``) in batches of ``batch_size``, and
    stacked along dimension 1 (``data.batch_dim=1``), batch ``k`` is the window ``[bptt, batch_size]``."""

    def __init__(self, ids, bptt, batch_size, words):
        self.source, self.bptt, self.classes = batchify(ids, batch_size), bptt, words
        self.windows = range(0, self.source.size(0) - 1, bptt)

    def __len__(self):
        return len(self.windows) * self.source.size(1)

    def __getitem__(self, index):
        window, column = divmod(index, self.source.size(1))
        start = self.windows[window]
        length = min(self.bptt, self.source.size(0) - 1 - start)
        return self.source[start : start + length, column], self.source[start + 1 : start + 1 + length, column]


def corpus(path, bptt, batch_size):
    """``(train, val)`` of ``path``'s train.txt and valid.txt; ``batch_size``: the loader's, given by the pipeline."""
    words = Corpus(path)
    vocabulary = words.vocabulary.words
    return Columns(words.train, bptt, batch_size, vocabulary), Columns(words.valid, bptt, batch_size, vocabulary)


def lstm(num_classes, emsize, nhid, nlayers, dropout, tied=False):
    """The model, its output as wide as the vocabulary (``num_classes``: the dataset's ``classes``)."""
    return RecurrentLM("LSTM", num_classes, emsize, nhid, nlayers, dropout, tied)


def tbptt(model, batch, ctx):
    """Truncated backpropagation through time: the hidden state flows from one batch to the next in corpus order
    (the pipeline detaches it after every step and empties it at each epoch and evaluation)."""
    tokens, targets = batch
    hidden = ctx.state.get("hidden")
    if hidden is None:
        hidden = ctx.module.init_hidden(tokens.size(1))
    output, ctx.state["hidden"] = model(tokens, hidden)
    return {"loss": ctx.loss(output, targets), "outputs": output, "targets": targets}
