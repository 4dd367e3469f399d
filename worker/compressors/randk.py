"""Random-k sparsification: ``k = ceil(ratio * n)`` elements chosen uniformly without
replacement, scaled by ``n / k`` so the result is unbiased (variance grows as ``n / k - 1``).

Payload: the index + value format of :mod:`~ncina.worker.compressors.topk` with tag 6; the
indices are sent, not the seed that drew them, so any receiver decodes without numpy's sampler.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.worker.compressors.base import Compressor, State, as_vector
from ncina.worker.compressors.topk import (
    SPARSE_LAYOUT,
    check_ratio,
    kept,
    sparse_bits,
    sparse_body,
    sparse_vector,
)


@dataclass(frozen=True)
class RandomK(Compressor):
    """``ceil(ratio * n)`` uniformly chosen elements, scaled by ``n / k``."""

    ratio: float = 0.01

    name: ClassVar[str] = "randk"
    tag: ClassVar[int] = 6
    ina: ClassVar[bool] = False
    unbiased: ClassVar[bool] = True
    layout: ClassVar[struct.Struct] = SPARSE_LAYOUT

    def __post_init__(self) -> None:
        check_ratio(self.ratio)

    def nominal_bits(self, n: int) -> float:
        return sparse_bits(self.ratio, n)

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        k = kept(self.ratio, v.size)
        idx = np.sort(state.rng.choice(v.size, size=k, replace=False)).astype(np.int64)
        values = v[idx].astype(np.float64) * (v.size / k) if k else v[idx]
        return self.header(v.size, k) + sparse_body(v.size, idx, values)

    def decompress(self, payload: bytes) -> np.ndarray:
        n, (k,), body = self.parse(payload)
        return sparse_vector(n, k, body, self.name)
