"""A bag-of-embeddings classifier taking keyword inputs, as Hugging Face models do: ``model._target_=bag.BagOfWords``.

``forward(input_ids, attention_mask)`` averages the embeddings of the real tokens and returns
``{"logits": [B, num_classes]}``, a dict like a ``ModelOutput``: the built-in tasks read its ``logits``.
"""

from torch import nn


class BagOfWords(nn.Module):
    def __init__(self, num_classes: int, vocabulary: int = 200, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width, padding_idx=0)
        self.classify = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        mean = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return {"logits": self.classify(mean)}
