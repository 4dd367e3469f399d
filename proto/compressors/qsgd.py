"""QSGD / standard random dithering (Alistarh et al.; the seed slides): per bucket of ``d``
elements, ``Q_i = ||v||_2 * sign(v_i) * xi_i`` with ``xi_i`` the level ``l / s`` or ``(l + 1) / s``
(``l = floor(s |v_i| / ||v||_2)``), up with probability ``s |v_i| / ||v||_2 - l``: unbiased, second
moment at most ``1 + min(d / s**2, sqrt(d) / s)`` times the input's.

Two encodings of the integer levels, both with Elias omega codes (``bits.omega_*``):

- ``dense`` (the slides' "linear" regime, large ``s``): ``omega(l + 1)`` for every element, no
  positions. At ``s = sqrt(d)`` the slides bound it by ``F + 2.8 d`` bits per bucket.
- ``sparse`` (the "sublinear" regime, small ``s``): per bucket the count of non-zero levels, then
  for each non-zero element the gap to the previous one and its level, all omega coded; at most
  ``F + (3 + 1.5 log2(2 (s**2 + d) / (s**2 + sqrt d))) (s**2 + sqrt d)`` bits per bucket.

Payload (network byte order)::

    HEAD (tag 3, n) | s: uint16 | d: uint32 | encoding: uint8 (0 dense, 1 sparse) | nnz: uint32
    norms:  ceil(n / d) x float32, one per bucket
    signs:  nnz bits (1 = negative), one per non-zero level in element order, zero padded
    omega:  dense:  omega(l_i + 1) for i < n
            sparse: omega(nnz_b + 1) for every bucket b, then for every non-zero element
                    omega(gap) omega(l), gap = position in bucket + 1 for a bucket's first one,
                    else the distance to the previous one

The last bucket is padded with zeros (never sent). ``bucket = 0`` is one bucket for the whole
tensor: standard random dithering ``D_sta^{2,s}`` of the Natural Compression paper.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto.compressors.base import (
    HEAD,
    Compressor,
    State,
    as_vector,
    check_float32_norm,
    expect_end,
    take,
)
from ncina.proto.compressors.bits import (
    omega_bits,
    omega_codes,
    omega_decode,
    omega_encode,
    pack_bits,
    packed_size,
    unpack_bits,
)

ENCODINGS = ("dense", "sparse")
FLOAT_BITS = 32
"""F of the slides: bits of one norm."""


@dataclass(frozen=True)
class QSGD(Compressor):
    """``s`` uniform levels per bucket of ``bucket`` elements (0: one bucket), Elias coded."""

    s: int = 16
    bucket: int = 256
    encoding: str = "dense"

    name: ClassVar[str] = "qsgd"
    tag: ClassVar[int] = 3
    ina: ClassVar[bool] = False
    unbiased: ClassVar[bool] = True
    layout: ClassVar[struct.Struct] = struct.Struct("!HIBI")

    def __post_init__(self) -> None:
        if not 1 <= self.s <= 0xFFFF:
            raise ValueError(f"QSGD needs 1..65535 levels, got s={self.s}")
        if not 0 <= self.bucket < 1 << 32:
            raise ValueError(f"QSGD bucket size must be in 0..2**32-1, got {self.bucket}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"QSGD encoding must be one of {ENCODINGS}, got {self.encoding!r}")

    def _d(self, n: int) -> int:
        return self.bucket or max(n, 1)

    def nominal_bits(self, n: int) -> float:
        """The slides' bound per element (``o(1)`` terms dropped), norms included."""
        d, s2 = self._d(n), self.s**2
        if self.encoding == "dense":
            per = 0.5 * (math.log2(1 + (s2 + min(d, self.s * math.sqrt(d))) / d) + 1) + 2
            return FLOAT_BITS / d + per
        k = s2 + math.sqrt(d)
        return (FLOAT_BITS + (3 + 1.5 * math.log2(2 * (s2 + d) / k)) * k) / d

    def max_payload_size(self, n: int) -> int:
        """A hard bound, unlike ``nominal_bits``: every element non-zero at the top level (taken
        as ``s + 1``: a float32 norm rounded below the true one can push a level above ``s``),
        and in the sparse stream every gap as long as a bucket."""
        d = self._d(n)
        buckets = -(-n // d)
        top = omega_bits(np.array([self.s + 2]))  # the dense code of level s + 1
        if self.encoding == "dense":
            stream = n * top
        else:
            per_element = omega_bits(np.array([d])) + omega_bits(np.array([self.s + 1]))
            stream = buckets * omega_bits(np.array([d + 1])) + n * per_element
        return (HEAD.size + self.layout.size + 4 * buckets + packed_size(n)
                + packed_size(stream))

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        n, d = v.size, self._d(v.size)
        buckets = -(-n // d)
        blocks = np.zeros(buckets * d, dtype=np.float64)
        blocks[:n] = v
        blocks = blocks.reshape(buckets, d)
        wide = np.sqrt(np.einsum("ij,ij->i", blocks, blocks))
        check_float32_norm(float(wide.max(initial=0.0)), "a bucket's 2-norm")
        norms = wide.astype(np.float32)
        # Probabilities use the float32 norm that is sent, so the decoded value is unbiased.
        safe = np.where(norms > 0, norms, 1).astype(np.float64)
        scaled = (np.abs(blocks) * (self.s / safe[:, None])).reshape(-1)[:n]
        low = np.floor(scaled)
        level = (low + (state.rng.random(n) < scaled - low)).astype(np.int64)
        nz = np.flatnonzero(level)
        signs = pack_bits(np.signbit(v[nz]), 1)
        if self.encoding == "dense":
            stream = omega_encode(level + 1)
        else:
            stream = self._sparse_stream(level, nz, d, buckets)
        head = self.header(n, self.s, d, ENCODINGS.index(self.encoding), nz.size)
        return head + norms.astype(">f4").tobytes() + signs + stream

    @staticmethod
    def _sparse_stream(level: np.ndarray, nz: np.ndarray, d: int, buckets: int) -> bytes:
        bucket, local = np.divmod(nz, d)
        counts = np.bincount(bucket, minlength=buckets)
        first = np.ones(nz.size, dtype=bool)
        first[1:] = bucket[1:] != bucket[:-1]
        gaps = np.where(first, local + 1, local - np.concatenate([[0], local[:-1]]))
        gaps_code, gaps_len = omega_codes(gaps)
        level_code, level_len = omega_codes(level[nz])
        count_code, count_len = omega_codes(counts + 1)
        codes = np.stack([gaps_code, level_code], axis=1).reshape(-1)
        lengths = np.stack([gaps_len, level_len], axis=1).reshape(-1)
        return pack_bits(np.concatenate([count_code, codes]), np.concatenate([count_len, lengths]))

    def decompress(self, payload: bytes) -> np.ndarray:
        n, (s, d, encoding, nnz), body = self.parse(payload)
        if d == 0 or s == 0 or encoding >= len(ENCODINGS):
            raise ValueError(f"bad QSGD header: s={s}, d={d}, encoding={encoding}")
        buckets = -(-n // d)
        raw, body = take(body, 4 * buckets, "norms")
        norms = np.frombuffer(raw, dtype=">f4").astype(np.float32)
        raw, body = take(body, packed_size(nnz), "signs")
        negative = unpack_bits(raw, 1, nnz).astype(bool)
        if ENCODINGS[encoding] == "dense":
            codes, used = omega_decode(body, n)
            level = codes.astype(np.int64) - 1
            pos = np.flatnonzero(level)
            if pos.size != nnz:
                raise ValueError(f"QSGD payload has {pos.size} non-zero levels, header says {nnz}")
            level = level[pos]
        else:
            codes, used = omega_decode(body, buckets + 2 * nnz)
            pos, level = self._sparse_positions(codes.astype(np.int64), d, buckets, nnz, n)
        expect_end(body[packed_size(used) :], self.name)
        out = np.zeros(n, dtype=np.float32)
        mag = norms[pos // d] * (level.astype(np.float32) / np.float32(s))
        out[pos] = np.where(negative, -mag, mag)
        return out

    @staticmethod
    def _sparse_positions(
        codes: np.ndarray, d: int, buckets: int, nnz: int, n: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Element positions and levels of the sparse stream's non-zero elements."""
        counts = codes[:buckets] - 1
        if counts.sum() != nnz:
            raise ValueError(f"QSGD bucket counts sum to {counts.sum()}, header says {nnz}")
        gaps, level = codes[buckets:].reshape(nnz, 2).T
        ends = np.cumsum(gaps)
        first = np.cumsum(counts) - counts  # index of each bucket's first non-zero element
        before = np.concatenate([[0], ends])[first]  # gap sum before each bucket
        local = ends - np.repeat(before, counts) - 1
        pos = np.repeat(np.arange(buckets, dtype=np.int64) * d, counts) + local
        if nnz and (local.max() >= d or pos.max() >= n):
            raise ValueError("QSGD sparse stream points past its bucket")
        return pos, level
