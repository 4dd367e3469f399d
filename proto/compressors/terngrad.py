"""TernGrad (Wen et al. 2017): ``scale * sign(x_i) * b_i`` with ``b_i ~ Bernoulli(|x_i| / scale)``
and ``scale = max_i |x_i|``, the one scaler every element shares. Unbiased; two bits per element.

Payload (network byte order)::

    HEAD (tag 4, n) | scale: float32 | n 2-bit trits, MSB first (0: 0, 1: +scale, 2: -scale)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto.compressors.base import Compressor, State, as_vector, expect_end, take
from ncina.proto.compressors.bits import pack_bits, packed_size, unpack_bits


@dataclass(frozen=True)
class TernGrad(Compressor):
    """Stochastic ternary quantization with the tensor's max magnitude as the shared scaler."""

    name: ClassVar[str] = "terngrad"
    tag: ClassVar[int] = 4
    ina: ClassVar[bool] = False
    unbiased: ClassVar[bool] = True
    layout: ClassVar[struct.Struct] = struct.Struct("!f")

    def nominal_bits(self, n: int) -> float:
        return 2.0

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        scale = np.max(np.abs(v), initial=np.float32(0))
        keep = state.rng.random(v.size) * scale < np.abs(v)  # probability |x_i| / scale
        trits = np.where(keep, np.where(np.signbit(v), 2, 1), 0)
        return self.header(v.size, scale) + pack_bits(trits, 2)

    def decompress(self, payload: bytes) -> np.ndarray:
        n, (scale,), body = self.parse(payload)
        raw, rest = take(body, packed_size(2 * n), "trits")
        expect_end(rest, self.name)
        trits = unpack_bits(raw, 2, n)
        if np.any(trits == 3):
            raise ValueError("TernGrad trit code 3 is not defined")
        return np.choose(trits.astype(np.intp), [0, scale, -scale]).astype(np.float32)
