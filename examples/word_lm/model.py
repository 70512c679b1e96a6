"""A recurrent language model of the usual research kind: embedding, a multi-layer LSTM (or GRU), a linear decoder,
log-probabilities out. Sequence-first: ``[T, B]`` word ids in, ``[T * B, V]`` log-probabilities out, and the hidden
state the caller carries to the next batch."""

import torch.nn.functional as F
from torch import nn


class RecurrentLM(nn.Module):
    def __init__(self, cell, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super().__init__()
        self.ntoken, self.cell, self.nhid, self.nlayers = ntoken, cell, nhid, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, cell)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("tied weights need nhid equal to ninp")
            self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, batch_size):
        weight = next(self.parameters())
        zeros = weight.new_zeros(self.nlayers, batch_size, self.nhid)
        return (zeros, zeros.clone()) if self.cell == "LSTM" else zeros
