"""Top-k sparsification (Aji & Heafield 2017; Alistarh et al. 2018): the ``k = ceil(ratio * n)``
largest-magnitude elements, as indices and float32 values. Biased: use it with error feedback
(``ef+topk``), which sends what was dropped later.

Payload (network byte order), shared with random-k::

    HEAD (tag, n) | k: uint32 | k x float32 values | k indices of index_width(n) bits, MSB first

Indices ascend; ``index_width(n)`` is the bits of ``n - 1`` (at least 1).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto.compressors.base import Compressor, State, as_vector, expect_end, take
from ncina.proto.compressors.bits import pack_bits, packed_size, unpack_bits

SPARSE_LAYOUT = struct.Struct("!I")


def index_width(n: int) -> int:
    """Bits of one index into an ``n``-element tensor."""
    return max(1, (n - 1).bit_length())


def kept(ratio: float, n: int) -> int:
    """Elements a sparsifier keeping the fraction ``ratio`` sends: ``ceil(ratio * n)``.

    The product is rounded to 9 decimals first, so ``1 - 0.85`` keeps 1500 of 10000, not 1501.
    """
    return min(n, math.ceil(round(ratio * n, 9)))


def check_ratio(ratio: float) -> None:
    """``ValueError`` unless ``0 < ratio <= 1``."""
    if not 0 < ratio <= 1:
        raise ValueError(f"the kept fraction must be in (0, 1], got ratio={ratio}")


def sparse_bits(ratio: float, n: int) -> float:
    """Bits per element of the index + value format."""
    return kept(ratio, n) * (32 + index_width(n)) / n if n else 0.0


def sparse_body(n: int, idx: np.ndarray, values: np.ndarray) -> bytes:
    """The values and indices sections of ascending ``idx`` and their float32 ``values``."""
    return values.astype(">f4").tobytes() + pack_bits(idx, index_width(n))


def sparse_vector(n: int, k: int, body: memoryview, name: str) -> np.ndarray:
    """The dense float32 tensor of a sparse body of ``k`` elements."""
    raw, body = take(body, 4 * k, "values")
    values = np.frombuffer(raw, dtype=">f4")
    raw, rest = take(body, packed_size(k * index_width(n)), "indices")
    expect_end(rest, name)
    idx = unpack_bits(raw, index_width(n), k).astype(np.int64)
    if k and (idx.max() >= n or np.any(np.diff(idx) <= 0)):
        raise ValueError(f"{name} indices are not ascending positions below {n}")
    out = np.zeros(n, dtype=np.float32)
    out[idx] = values
    return out


@dataclass(frozen=True)
class Sparsifier(Compressor):
    """What top-k and random-k share: the kept fraction ``ratio``, the index + value payload, and
    its decoding; a subclass only chooses the ``k`` elements (:meth:`choose`)."""

    ratio: float = 0.01

    ina: ClassVar[bool] = False
    layout: ClassVar[struct.Struct] = SPARSE_LAYOUT

    def __post_init__(self) -> None:
        check_ratio(self.ratio)

    def nominal_bits(self, n: int) -> float:
        return sparse_bits(self.ratio, n)

    def choose(self, v: np.ndarray, k: int, state: State) -> tuple[np.ndarray, np.ndarray]:
        """Ascending int64 indices of the ``k`` elements to send, and their values."""
        raise NotImplementedError

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        k = kept(self.ratio, v.size)
        idx, values = self.choose(v, k, state)
        return self.header(v.size, k) + sparse_body(v.size, idx, values)

    def decompress(self, payload: bytes) -> np.ndarray:
        n, (k,), body = self.parse(payload)
        return sparse_vector(n, k, body, self.name)


@dataclass(frozen=True)
class TopK(Sparsifier):
    """The ``ceil(ratio * n)`` largest-magnitude elements."""

    name: ClassVar[str] = "topk"
    tag: ClassVar[int] = 5
    unbiased: ClassVar[bool] = False

    def choose(self, v: np.ndarray, k: int, state: State) -> tuple[np.ndarray, np.ndarray]:
        idx = np.sort(np.argpartition(np.abs(v), v.size - k)[v.size - k :]) if k else np.zeros(0)
        idx = idx.astype(np.int64)
        return idx, v[idx]
