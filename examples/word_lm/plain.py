"""The same job as experiment=word_lm, as a plain PyTorch script of the usual research kind: the reference the
pipeline's run is checked against (tests/test_examples.py). Prints each epoch's validation loss and perplexity.

    python plain.py
"""

import argparse
import math

import torch
from corpus import Corpus, batchify
from model import RecurrentLM
from torch import nn


def detach(hidden):
    return hidden.detach() if isinstance(hidden, torch.Tensor) else tuple(h.detach() for h in hidden)


def windows(source, bptt):
    for start in range(0, source.size(0) - 1, bptt):
        length = min(bptt, source.size(0) - 1 - start)
        yield source[start : start + length], source[start + 1 : start + 1 + length].reshape(-1)


def evaluate(model, source, bptt, criterion):
    model.eval()
    total, count = 0.0, 0
    hidden = model.init_hidden(source.size(1))
    with torch.no_grad():
        for tokens, targets in windows(source, bptt):
            output, hidden = model(tokens, hidden)
            total += criterion(output, targets).item() * targets.numel()
            count += targets.numel()
    return total / count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=20.0)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    corpus = Corpus(args.data)
    train, valid = batchify(corpus.train, args.batch_size), batchify(corpus.valid, args.batch_size)
    model = RecurrentLM("LSTM", len(corpus.vocabulary), 64, 64, 2, 0.2)
    criterion, lr, best = nn.NLLLoss(), args.lr, None
    for epoch in range(1, args.epochs + 1):
        model.train()
        hidden = model.init_hidden(args.batch_size)
        for tokens, targets in windows(train, args.bptt):
            hidden = detach(hidden)
            model.zero_grad()
            output, hidden = model(tokens, hidden)
            criterion(output, targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        loss = evaluate(model, valid, args.bptt, criterion)
        print(f"epoch {epoch} val/loss {loss:.6f} val/perplexity {math.exp(loss):.6f}")
        if best is None or loss < best:
            best = loss
        else:
            lr /= 4.0


if __name__ == "__main__":
    main()
