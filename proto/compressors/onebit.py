"""One bit per element: the sign, and one or two shared magnitudes. Both are biased and defined
with error feedback (the registry wraps them by default).

- ``signsgd`` (EF-signSGD, Karimireddy et al. 2019): ``(||v||_1 / n) * sign(v)``.
- ``onebit`` (1-bit SGD, Seide et al. 2014, as in the QSGD slides): elements ``>= 0`` become the
  mean of the non-negative ones, the others the mean of the negative ones.

Payload (network byte order)::

    signsgd: HEAD (tag 7, n) | scale: float32            | n sign bits, MSB first (1 = negative)
    onebit:  HEAD (tag 8, n) | pos: float32 | neg: float32 | n sign bits, MSB first (1 = negative)
"""

from __future__ import annotations

import struct
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto.compressors.base import Compressor, State, as_vector, expect_end, take
from ncina.proto.compressors.bits import pack_bits, packed_size, unpack_bits


class _SignBits(Compressor):
    """Sign bits plus the magnitudes ``(for >= 0, for < 0)`` that :meth:`levels` picks."""

    ina: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    error_feedback: ClassVar[bool] = True

    @abstractmethod
    def levels(self, v: np.ndarray, negative: np.ndarray) -> tuple[float, ...]:
        """The header magnitudes of ``v``."""

    def nominal_bits(self, n: int) -> float:
        return 1.0

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        negative = v < 0
        return self.header(v.size, *self.levels(v, negative)) + pack_bits(negative, 1)

    def decompress(self, payload: bytes) -> np.ndarray:
        n, levels, body = self.parse(payload)
        raw, rest = take(body, packed_size(n), "sign bits")
        expect_end(rest, self.name)
        pos, neg = (levels[0], -levels[0]) if len(levels) == 1 else levels
        return np.where(unpack_bits(raw, 1, n).astype(bool), neg, pos).astype(np.float32)


@dataclass(frozen=True)
class SignSGD(_SignBits):
    """``mean(|v|) * sign(v)``."""

    name: ClassVar[str] = "signsgd"
    tag: ClassVar[int] = 7
    layout: ClassVar[struct.Struct] = struct.Struct("!f")

    def levels(self, v: np.ndarray, negative: np.ndarray) -> tuple[float, ...]:
        return (float(np.mean(np.abs(v), dtype=np.float64)) if v.size else 0.0,)


@dataclass(frozen=True)
class OneBitSGD(_SignBits):
    """The mean of the non-negative elements for those, of the negative ones for the rest."""

    name: ClassVar[str] = "onebit"
    tag: ClassVar[int] = 8
    layout: ClassVar[struct.Struct] = struct.Struct("!ff")

    def levels(self, v: np.ndarray, negative: np.ndarray) -> tuple[float, ...]:
        neg = v[negative].astype(np.float64)
        pos = v[~negative].astype(np.float64)
        return (float(pos.mean()) if pos.size else 0.0, float(neg.mean()) if neg.size else 0.0)
