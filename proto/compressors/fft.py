"""FFT sparsification with range-based N-bit offset floats (Wang et al., HPDC'20, seed 002).

1. The tensor, as a 1-d real signal, goes through a real FFT: ``n // 2 + 1`` complex frequencies
   (the other half is their mirror image). The ``k`` of largest magnitude are kept, ``2k`` reals:
   ``k`` is half (rounded up) of what top-k keeps at the same ``theta``, ``ceil((1 - theta) n)``.
2. Packing (the paper's parallel packing): a status bitmap marks the kept frequencies; their
   values follow in frequency order (numpy's boolean selection is the prefix-sum scatter).
3. Each real and imaginary part becomes an ``N``-bit offset float (the paper's Algorithm 1): a
   sign bit and an ``N - 1``-bit code ``c``; ``c = 0`` is zero, ``c >= 1`` is the float32 whose
   bit pattern is ``(pbase + c - 1) << (23 - m)``. In words: floats with an ``m``-bit mantissa
   counted up from ``eps`` (bit pattern ``pbase << (23 - m)``), each code the next representable
   number, so the spacing doubles every ``2**m`` codes and precision follows the magnitude.
   The range is this payload's largest magnitude ``max``: ``pbase`` is chosen so that the top
   code is ``max`` (the paper's tuning of ``eps`` until the extreme codes hit ``min``/``max``,
   solved in closed form; the sign bit gives the balanced ``P = 2**N / 2`` split directly).
   ``m`` (``mantissa = -1``) is tuned per payload: each ``m`` in ``0 .. min(N - 1, 23)`` is tried
   and the one with the smallest squared error kept. Unlike Algorithm 1's truncating shift, the
   shift rounds to nearest (half of the dropped bits added first), halving the largest error at
   no cost; magnitudes below ``eps / 2`` become 0. ``bits = 32`` sends plain float32 instead.

Biased (use with error feedback). Payload (network byte order)::

    HEAD (tag 9, n) | N: uint8 | m: uint8 | pbase: uint32 | k: uint32
    status: n // 2 + 1 bits, MSB first (1 = kept), zero padded
    values: 2k fields of N bits, MSB first (real, imaginary of each kept frequency in order)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto.compressors.base import Compressor, State, as_vector, expect_end, take
from ncina.proto.compressors.bits import pack_bits, packed_size, unpack_bits
from ncina.proto.compressors.topk import kept

FLOAT_BITS = 32
"""``bits`` value meaning plain float32 values (no quantization)."""


def offset_float_encode(values: np.ndarray, bits: int, m: int, pbase: int) -> np.ndarray:
    """N-bit offset-float fields (sign bit, then the ``bits - 1``-bit code) of float32 values."""
    shift = 23 - m
    mag = np.abs(values).astype(np.float32).view(np.uint32).astype(np.int64)
    q = (mag + ((1 << shift) >> 1)) >> shift  # the pattern with an m-bit mantissa, rounded
    top = (1 << (bits - 1)) - 1
    code = np.clip(q - pbase + 1, 0, top)
    eps = np.array([pbase << shift], dtype=np.uint32).view(np.float32)[0]
    code = np.where(q < pbase, (np.abs(values) >= eps / 2).astype(np.int64), code)
    return np.where(np.signbit(values) & (code > 0), code | (1 << (bits - 1)), code)


def offset_float_decode(fields: np.ndarray, bits: int, m: int, pbase: int) -> np.ndarray:
    """float32 values of N-bit offset-float fields."""
    f = fields.astype(np.int64)
    code = f & ((1 << (bits - 1)) - 1)
    pattern = (code + pbase - 1) << (23 - m)
    if code.size and int(pattern.max()) >= 0x7F800000:
        raise ValueError("offset float code beyond the largest finite float32")
    pattern = pattern.astype(np.uint32)
    mag = np.where(code > 0, pattern.view(np.float32), np.float32(0))
    return np.where(f >> (bits - 1), -mag, mag).astype(np.float32)


def offset_float_base(largest: float, bits: int, m: int) -> int:
    """``pbase`` whose top code is ``largest`` (at least 1: code 1 stays a positive number)."""
    shift = 23 - m
    pattern = int(np.float32(largest).view(np.uint32))
    return max(1, ((pattern + ((1 << shift) >> 1)) >> shift) - ((1 << (bits - 1)) - 2))


@dataclass(frozen=True)
class FFTSparsify(Compressor):
    """Top frequencies of the real FFT (dropping the fraction ``theta``), ``bits``-bit floats."""

    theta: float = 0.85
    bits: int = 10
    mantissa: int = -1

    name: ClassVar[str] = "fft"
    tag: ClassVar[int] = 9
    ina: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    layout: ClassVar[struct.Struct] = struct.Struct("!BBII")

    def __post_init__(self) -> None:
        if not 0 <= self.theta < 1:
            raise ValueError(f"theta (the dropped fraction) must be in [0, 1), got {self.theta}")
        if not (2 <= self.bits <= 24 or self.bits == FLOAT_BITS):
            raise ValueError(f"offset floats have 2..24 bits (or 32: float32), got {self.bits}")
        if not -1 <= self.mantissa <= min(self.bits - 1, 23):
            raise ValueError(f"mantissa bits must be -1 (tuned) or 0..{min(self.bits - 1, 23)}")

    def kept(self, n: int) -> int:
        """Frequencies kept of an ``n``-element tensor."""
        return min(n // 2 + 1, -(-kept(1 - self.theta, n) // 2))

    def nominal_bits(self, n: int) -> float:
        return (n // 2 + 1 + 2 * self.kept(n) * self.bits) / n if n else 0.0

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        n = v.size
        if n == 0:
            return self.header(0, self.bits, 0, 0, 0)
        freq = np.fft.rfft(v.astype(np.float64))
        k = self.kept(n)
        status = np.zeros(freq.size, dtype=bool)
        status[np.argpartition(np.abs(freq), freq.size - k)[freq.size - k :]] = True
        chosen = freq[status]
        reals = np.stack([chosen.real, chosen.imag], axis=1).reshape(-1).astype(np.float32)
        if self.bits == FLOAT_BITS:
            m, pbase, values = 0, 0, reals.astype(">f4").tobytes()
        else:
            m, pbase, fields = self._quantize(reals)
            values = pack_bits(fields, self.bits)
        return self.header(n, self.bits, m, pbase, k) + pack_bits(status, 1) + values

    def _quantize(self, reals: np.ndarray) -> tuple[int, int, np.ndarray]:
        """(m, pbase, fields): the tuned (or given) mantissa bits with the smallest error."""
        largest = float(np.max(np.abs(reals), initial=0.0))
        choices = range(min(self.bits - 1, 23) + 1) if self.mantissa < 0 else [self.mantissa]
        best = None
        for m in choices:
            pbase = offset_float_base(largest, self.bits, m)
            fields = offset_float_encode(reals, self.bits, m, pbase)
            err = float(np.sum((offset_float_decode(fields, self.bits, m, pbase) - reals) ** 2))
            if best is None or err < best[0]:
                best = (err, m, pbase, fields)
        return best[1], best[2], best[3]

    def decompress(self, payload: bytes) -> np.ndarray:
        n, (bits, m, pbase, k), body = self.parse(payload)
        if n == 0:
            expect_end(body, self.name)
            return np.zeros(0, dtype=np.float32)
        if not (2 <= bits <= 24 or bits == FLOAT_BITS) or m > 23:
            raise ValueError(f"bad FFT header: bits={bits}, m={m}")
        size = n // 2 + 1
        raw, body = take(body, packed_size(size), "status bitmap")
        status = unpack_bits(raw, 1, size).astype(bool)
        if int(status.sum()) != k:
            raise ValueError(f"FFT status bitmap marks {int(status.sum())} frequencies, k={k}")
        if bits == FLOAT_BITS:
            raw, rest = take(body, 8 * k, "values")
            reals = np.frombuffer(raw, dtype=">f4").astype(np.float32)
        else:
            raw, rest = take(body, packed_size(2 * k * bits), "values")
            reals = offset_float_decode(unpack_bits(raw, bits, 2 * k), bits, m, pbase)
        expect_end(rest, self.name)
        freq = np.zeros(size, dtype=np.complex128)
        freq[status] = reals[0::2] + 1j * reals[1::2].astype(np.float64)
        return np.fft.irfft(freq, n).astype(np.float32)
