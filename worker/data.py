"""The digits data set (scikit-learn's bundled copy: no download), split and sharded per rank.

1797 8x8 grey images of the digits 0-9 with 16 grey levels; a fixed, stratified 75/25 train/test
split; pixels scaled to [0, 1]. Every rank builds the same split from the same seed.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

TEST_SHARE = 0.25


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets of ``(image (1, 8, 8) float32, label int64)``."""
    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_SHARE, random_state=seed, stratify=labels
    )
    return (
        TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)),
    )
