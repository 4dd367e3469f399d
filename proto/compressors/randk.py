"""Random-k sparsification: ``k = ceil(ratio * n)`` elements chosen uniformly without
replacement, scaled by ``n / k`` so the result is unbiased (variance grows as ``n / k - 1``).

Payload: the index + value format of :mod:`~ncina.proto.compressors.topk` with tag 6; the
indices are sent, not the seed that drew them, so any receiver decodes without numpy's sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto.compressors.base import State
from ncina.proto.compressors.topk import Sparsifier


@dataclass(frozen=True)
class RandomK(Sparsifier):
    """``ceil(ratio * n)`` uniformly chosen elements, scaled by ``n / k``."""

    name: ClassVar[str] = "randk"
    tag: ClassVar[int] = 6
    unbiased: ClassVar[bool] = True

    def choose(self, v: np.ndarray, k: int, state: State) -> tuple[np.ndarray, np.ndarray]:
        idx = np.sort(state.rng.choice(v.size, size=k, replace=False)).astype(np.int64)
        return idx, v[idx].astype(np.float64) * (v.size / k) if k else v[idx]
