"""The data sets ``ncina train`` trains on: all built on the machine, nothing downloaded.

- ``digits``: scikit-learn's bundled copy of the 8x8 digits (1797 grey images, 16 levels); a
  fixed, stratified 75/25 train/test split; pixels scaled to [0, 1].
- ``synthetic-images``: 3x32x32 images of 10 classes, each a class's template plus
  standard-normal noise, 4096 for training and 512 for testing (throughput first, as Horovod's
  synthetic benchmark, but with a structure a conv net learns in a few dozen steps, so that a
  benchmark's accuracy and loss say something). A template is a smooth random pattern (4x4
  Gaussian values per channel, bilinearly upsampled, unit RMS) scaled by ``SIGNAL``: weak
  against the noise pixel by pixel, plain over the whole image.
- ``python-source``: a character-level language-modelling corpus, the bytes of the Python
  standard library's top-level modules (a real text that every machine with Python has): samples
  are windows of ``CONTEXT + 1`` bytes, the input its first ``CONTEXT`` bytes and the target the
  next byte at every position; the last tenth of the text is the test set.

Every rank builds the same sets from the same seed. A user's own data plugs in as ``--data
module:factory``: a function of the seed returning ``(train, test)`` datasets of ``(input,
target)`` pairs whose model output's last axis is the class of ``target``.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from ncina.worker.models import CLASSES, CONTEXT, load_factory
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset, TensorDataset

TEST_SHARE = 0.25
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 4096, 512
SIGNAL = 0.1  # a template's RMS against the noise's 1
TEMPLATE_GRID = 4  # a template's random values per side and channel, before upsampling
CORPUS_BYTES = 4 << 20  # of the standard library's text: enough for many epochs of a small LM
CORPUS_TEST_SHARE = 0.1
CORPUS_TEST_SAMPLES = 1024  # evaluated after every epoch: keep it quick

Split = tuple[Dataset, Dataset]


def digits(seed: int) -> Split:
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


def templates(generator: torch.Generator) -> torch.Tensor:
    """The classes' templates of ``synthetic-images``, ``(CLASSES, 3, 32, 32)``, unit RMS each."""
    coarse = torch.randn(CLASSES, 3, TEMPLATE_GRID, TEMPLATE_GRID, generator=generator)
    smooth = torch.nn.functional.interpolate(coarse, size=32, mode="bilinear",
                                             align_corners=False)  # fmt: skip
    return smooth / smooth.flatten(1).pow(2).mean(1).sqrt().view(-1, 1, 1, 1)


def synthetic_images(seed: int) -> Split:
    """Synthetic 3x32x32 images, a class template plus noise (see the module doc); the same
    for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    patterns = templates(generator)
    count = SYNTHETIC_TRAIN + SYNTHETIC_TEST
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    images = SIGNAL * patterns[labels] + torch.randn(count, 3, 32, 32, generator=generator)
    return (
        TensorDataset(images[:SYNTHETIC_TRAIN], labels[:SYNTHETIC_TRAIN]),
        TensorDataset(images[SYNTHETIC_TRAIN:], labels[SYNTHETIC_TRAIN:]),
    )


def corpus(limit: int = CORPUS_BYTES) -> bytes:
    """The first ``limit`` bytes of the standard library's top-level modules, in name order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = bytearray()
    for path in sorted(stdlib.glob("*.py")):
        text += path.read_bytes()
        if len(text) >= limit:
            break
    if len(text) < 64 * (CONTEXT + 1):
        raise ValueError(f"too little Python source under {stdlib} for a corpus")
    return bytes(text[:limit])


def _windows(text: bytes, limit: int | None = None) -> TensorDataset:
    """Non-overlapping windows of ``CONTEXT + 1`` bytes: (first CONTEXT, the next byte of each)."""
    data = np.frombuffer(text, dtype=np.uint8)
    count = data.size // (CONTEXT + 1)
    if limit is not None:
        count = min(count, limit)
    rows = torch.from_numpy(data[: count * (CONTEXT + 1)].astype(np.int64)).view(count, -1)
    return TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def python_source(seed: int) -> Split:
    """The character-level corpus (see the module doc); ``seed`` is unused: the text is fixed."""
    text = corpus()
    cut = int(len(text) * (1 - CORPUS_TEST_SHARE))
    return _windows(text[:cut]), _windows(text[cut:], CORPUS_TEST_SAMPLES)


DATASETS: dict[str, Callable[[int], Split]] = {
    "digits": digits,
    "synthetic-images": synthetic_images,
    "python-source": python_source,
}


def resolve(name: str) -> Callable[[int], Split]:
    """The data set ``--data`` names: one of ``DATASETS`` or ``module:factory``."""
    if name in DATASETS:
        return DATASETS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown data set {name!r}; data sets: {', '.join(DATASETS)}, or module:factory"
        )
    return load_factory(name, "data set")  # type: ignore[return-value]
