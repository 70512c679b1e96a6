"""A character-level transformer language model: ``model._target_=gpt.CharGPT``.

Token and position embeddings, ``layers`` pre-norm transformer blocks with a causal mask, and a linear head over
the vocabulary: outputs ``[B, T, V]`` logits for ``[B, T]`` inputs. ``num_classes`` (the vocabulary's size) comes
from the data.
"""

import torch
from torch import nn


class CharGPT(nn.Module):
    def __init__(self, num_classes: int, block: int = 64, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(num_classes, width)
        self.positions = nn.Embedding(block, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)
        self.register_buffer("causal", torch.triu(torch.full((block, block), float("-inf")), diagonal=1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        steps = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(steps, device=ids.device))
        x = self.blocks(x, mask=self.causal[:steps, :steps], is_causal=True)
        return self.head(self.norm(x))
