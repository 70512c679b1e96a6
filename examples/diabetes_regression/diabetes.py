"""scikit-learn's bundled diabetes data (442 patients, 10 features, a disease-progression score; no download):
``data._target_=diabetes.splits``."""

import torch
from torch.utils.data import TensorDataset


def splits(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation sets, features and target standardised with the training split's statistics."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = round(len(y) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    x = (x - x[train].mean(0)) / x[train].std(0)
    y = (y - y[train].mean()) / y[train].std()
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])
