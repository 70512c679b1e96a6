"""A small regressor for tabular features: the model of this example (``model._target_=nets.Regressor``)."""

from torch import nn


class Regressor(nn.Module):
    """Features -> hidden -> ReLU -> hidden -> one value per sample.

    ``in_shape`` comes from the data (the pipeline passes it because this signature names it); ``hidden`` and
    ``dropout`` are keywords from the config (``+model.hidden=128``).
    """

    def __init__(self, in_shape: tuple[int, ...], hidden: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_shape[0], hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)  # [B]: the targets' shape, as task=regression requires
