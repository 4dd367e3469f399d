"""The models ``ncina train`` can train on the 8x8 digits images: a small MLP and a small CNN.

Both take a batch of shape ``(B, 1, 8, 8)`` and return logits over the 10 digits. They are small
on purpose: one DDP bucket or a few, trained in seconds on two cores, large enough that the
bytes of gradient exchange dominate the traffic of a step.
"""

from __future__ import annotations

from torch import nn

CLASSES = 10


def mlp() -> nn.Module:
    """64 -> 128 -> 64 -> 10, ReLU (about 17K parameters)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


def cnn() -> nn.Module:
    """Two 3x3 convolutions (16, 32 channels), 2x2 max-pool, linear head (about 10K parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, CLASSES),
    )


MODELS = {"mlp": mlp, "cnn": cnn}


def check(name: str) -> None:
    """Raise ``ValueError`` naming the models when ``name`` is not one of them."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; models: {', '.join(sorted(MODELS))}")
