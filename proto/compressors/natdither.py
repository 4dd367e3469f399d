"""Natural dithering (Horvath et al. 2019, Def. 3): random dithering on the binary geometric
levels ``1, 1/2, ..., 2**(1 - s)`` (and 0) of ``|x_i| / ||x||_p``, with the norm itself naturally
compressed, so every output is ``+-2**e`` or 0.

For ``y = |x_i| / ||x||_p`` in ``[2**t, 2**(t+1))`` with ``t >= 1 - s`` the level is ``2**t`` or
``2**(t+1)``, up with probability ``(y - 2**t) / 2**t``; below the lowest level ``2**(1 - s)``
it is that level with probability ``y / 2**(1 - s)``, else 0. The norm (computed in float64) goes
through NC independently, so the product is unbiased (Theorem 4). Against standard dithering with
the same number of levels the variance is exponentially smaller (Theorem 5); the benchmark
measures it.

The norm is rounded by the NC operator itself, to one of its two neighbouring powers of two,
not by the job's NC8 window: it travels as a float32 header field, so any norm float32 can
hold is sent unbiased (an earlier version NC8-coded it inside the window and so scaled every
tensor of norm above ``2**e_max`` down as a whole). The window bounds only the NC8 codes of the
values ``norm * level`` in the INA mode: a value above ``2**e_max`` saturates there, is counted
(``State.saturated``) and biased, as for every NC8 payload; size ``e_max`` for the largest
element, not for the norm.

Two payload modes (network byte order)::

    HEAD (tag 2, n) | s: uint8 | packed: uint8 | workers: uint16 | e_max: int8 | norm: float32
    packed == 0:  n NC8 codes of the window (workers, e_max)              -> ina, 8 bits/element
    packed == 1:  n fields of 1 + bit_length(s) bits, MSB first: sign bit, then the level
                  index j (0: zero, j >= 1: level 2**(1 - j)); value = norm * level

``norm`` is the naturally compressed norm (a power of two or 0), or with ``nc_norm = 0``
(packed mode only) the float32 norm itself: the setting of the paper's variance experiments
(Appendix B.2), which measure the levels alone. In the INA mode each output
``+-norm * 2**(1 - j)`` is itself a power of two, encoded by the NC8 codec (exact inside the
window; below it, the codec's unbiased rounding), so NC8 payloads of several workers add up in a
switch. The packed mode sends the same values in fewer bits, for server mode.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto import nc8
from ncina.proto.compressors.base import (
    Compressor,
    State,
    as_vector,
    check_float32_norm,
    expect_end,
    take,
)
from ncina.proto.compressors.bits import pack_bits, packed_size, unpack_bits

MAX_LEVELS = 32
"""Most levels: the lowest, 2**-31, is still far inside float32 for any sane norm."""


def natural_round(value: float, rng: np.random.Generator) -> float:
    """The NC operator on one non-negative float: ``value`` in ``[2**e, 2**(e+1))`` becomes
    ``2**(e+1)`` with probability ``value / 2**e - 1``, else ``2**e`` (unbiased); 0 stays 0.
    No window: any exponent a float64 has."""
    if value == 0.0:
        return 0.0
    low = math.ldexp(1.0, math.frexp(value)[1] - 1)  # 2**e <= value < 2**(e+1)
    return 2.0 * low if rng.random() < value / low - 1.0 else low


@dataclass(frozen=True)
class NaturalDithering(Compressor):
    """``s`` binary geometric levels of ``|x_i| / ||x||_p`` (``p`` 2 or inf), NC norm."""

    s: int = 8
    p: float = 2
    packed: bool = False
    nc_norm: bool = True
    workers: int = 4
    e_max: int = 10

    name: ClassVar[str] = "natdither"
    tag: ClassVar[int] = 2
    unbiased: ClassVar[bool] = True
    layout: ClassVar[struct.Struct] = struct.Struct("!BBHbf")

    def __post_init__(self) -> None:
        if not 1 <= self.s <= MAX_LEVELS:
            raise ValueError(f"natural dithering needs 1..{MAX_LEVELS} levels, got s={self.s}")
        if self.p not in (2, math.inf):
            raise ValueError(f"natural dithering supports the 2 and inf norms, got p={self.p}")
        if not (self.nc_norm or self.packed):
            raise ValueError("NC8 payloads need the naturally compressed norm (nc_norm=1)")
        self.window()

    @property
    def ina(self) -> bool:  # type: ignore[override]
        """NC8 payloads are switch-summable; packed ones are not."""
        return not self.packed

    def window(self) -> nc8.Window:
        """The NC8 window of the job (codes, and the compressed norm)."""
        return nc8.Window.for_job(self.workers, self.e_max)

    def nominal_bits(self, n: int) -> float:
        return float(1 + self.s.bit_length()) if self.packed else 8.0

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        window = self.window()
        wide = v.astype(np.float64)
        norm = float(np.max(np.abs(wide), initial=0.0) if self.p == math.inf
                     else np.linalg.norm(wide))  # fmt: skip
        check_float32_norm(norm, f"the {self.p:g}-norm")
        if self.nc_norm:
            sent = check_float32_norm(natural_round(norm, state.rng), "the rounded norm")
        else:
            sent = norm = float(np.float32(norm))  # the levels use the norm that is sent
        level = self._levels(v, norm, state.rng) if sent else np.zeros(v.size, np.int32)
        head = self.header(v.size, self.s, self.packed, self.workers, self.e_max, sent)
        neg = np.signbit(v) & (level > 0)
        if self.packed:
            width = self.s.bit_length()
            return head + pack_bits((neg.astype(np.int64) << width) | level, 1 + width)
        values = np.ldexp(np.where(neg, -sent, sent).astype(np.float32), 1 - level)
        values[level == 0] = 0.0
        enc = nc8.encode(values, window, state.rng)
        state.saturated += enc.saturated
        return head + enc.codes.tobytes()

    def _levels(self, v: np.ndarray, norm: float, rng: np.random.Generator) -> np.ndarray:
        """Level index per element (int32): 0 for zero, ``j >= 1`` for level ``2**(1 - j)``."""
        y = np.minimum(np.abs(v) / np.float64(norm), 1.0)  # float rounding may exceed 1
        t = (y.view(np.uint64) >> np.uint64(52)).astype(np.int32) - 1023  # floor(log2 y)
        low = t >= 1 - self.s  # at or above the lowest level (y == 0 is not: t = -1023)
        ratio = y / np.ldexp(1.0, np.where(low, t, np.int32(1 - self.s)))
        up = rng.random(v.size) < np.where(low, ratio - 1, ratio)
        return np.where(low, 1 - t - up, np.where(up, np.int32(self.s), np.int32(0)))

    def decompress(self, payload: bytes) -> np.ndarray:
        n, (s, packed, workers, e_max, norm), body = self.parse(payload)
        if not packed:
            codes, rest = take(body, n, "NC8 codes")
            expect_end(rest, self.name)
            window = nc8.Window.for_job(workers, e_max)
            return nc8.decode(np.frombuffer(codes, dtype=np.uint8), window)
        width = s.bit_length()
        data, rest = take(body, packed_size(n * (1 + width)), "levels")
        expect_end(rest, self.name)
        fields = unpack_bits(data, 1 + width, n).astype(np.int64)
        level = (fields & ((1 << width) - 1)).astype(np.int32)
        if np.any(level > s):
            raise ValueError(f"natural dithering level index above s={s}")
        mag = np.where(level > 0, np.ldexp(np.float32(norm), 1 - level), 0).astype(np.float32)
        return np.where(fields >> width, -mag, mag)
