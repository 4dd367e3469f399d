"""3LC (Lim, Andersen, Kaminsky 2018): 3-value quantization with sparsity multiplication, quartic
encoding and zero-run encoding. Biased; defined with error accumulation, which is this library's
error feedback (the registry wraps it by default).

1. Quantization: ``M = max_i |x_i| * s`` with ``s`` in ``[1, 2)``, ``q_i = round(x_i / M)`` in
   ``{-1, 0, 1}``, decoded as ``q_i * M``. A larger ``s`` raises the threshold ``M / 2``: more
   zeros, so better zero-run compression, and more error (carried to the next step by the error
   accumulation).
2. Quartic encoding: five trits per byte, ``b = 81 d0 + 27 d1 + 9 d2 + 3 d3 + d4`` with
   ``d = q + 1``; the last group is padded with ``q = 0`` (digit 1). Bytes are ``0 .. 242``; five
   zeros give 121.
3. Zero-run encoding: a run of ``k`` bytes 121, ``2 <= k <= 14``, becomes the one byte
   ``243 + k - 2`` (243 .. 255); longer runs are cut into runs of 14 from the left, and a
   leftover single 121 stays as it is.

Payload (network byte order)::

    HEAD (tag 10, n) | M: float32 | zero-run encoded quartic bytes (to the end)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto.compressors.base import Compressor, State, as_vector

QUARTIC_WEIGHTS = np.array([81, 27, 9, 3, 1], dtype=np.uint8)
ZERO_GROUP = 121
"""Quartic byte of five zero trits."""
RUN_BASE = 243
"""Byte of a run of 2 zero groups; ``RUN_BASE + k - 2`` is a run of ``k``."""
MAX_RUN = 14


def quartic_encode(trits: np.ndarray) -> np.ndarray:
    """Quartic bytes of trits in ``{-1, 0, 1}`` (five per byte, last group padded with 0)."""
    digits = np.ones(-(-trits.size // 5) * 5, dtype=np.uint8)
    digits[: trits.size] = trits + 1
    return digits.reshape(-1, 5) @ QUARTIC_WEIGHTS


def quartic_decode(data: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` trits (int8) of quartic bytes; ``ValueError`` for a byte above 242."""
    if data.size and data.max() > 242:
        raise ValueError("quartic byte above 242")
    digits = (data[:, None] // (QUARTIC_WEIGHTS.astype(np.uint16)[None, :])) % 3
    return digits.reshape(-1)[:n].astype(np.int8) - 1


def zero_run_encode(data: np.ndarray) -> np.ndarray:
    """Replace runs of :data:`ZERO_GROUP` bytes by run bytes, vectorised.

    Every position of a run gets its offset in the run; a byte is emitted at offsets 0, 14, 28,
    ... of each run, standing for the ``min(14, rest)`` bytes from there.
    """
    zero = data == ZERO_GROUP
    edges = np.flatnonzero(np.diff(np.concatenate([[False], zero, [False]]).astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    run_start = np.zeros(data.size, dtype=np.int64)
    run_end = np.zeros(data.size, dtype=np.int64)
    lengths = ends - starts
    run_start[zero] = np.repeat(starts, lengths)
    run_end[zero] = np.repeat(ends, lengths)
    pos = np.arange(data.size)
    offset = pos - run_start
    emit = ~zero | (offset % MAX_RUN == 0)
    chunk = np.minimum(MAX_RUN, run_end - pos)
    token = np.where(zero & (chunk >= 2), RUN_BASE + chunk - 2, data)
    return token[emit].astype(np.uint8)


def zero_run_decode(data: np.ndarray) -> np.ndarray:
    """Expand run bytes back to runs of :data:`ZERO_GROUP`."""
    run = data >= RUN_BASE
    counts = np.where(run, data.astype(np.int64) - RUN_BASE + 2, 1)
    return np.repeat(np.where(run, ZERO_GROUP, data).astype(np.uint8), counts)


@dataclass(frozen=True)
class ThreeLC(Compressor):
    """3-value quantization with sparsity multiplier ``s``, quartic and zero-run encoded."""

    s: float = 1.0

    name: ClassVar[str] = "3lc"
    tag: ClassVar[int] = 10
    ina: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    error_feedback: ClassVar[bool] = True
    layout: ClassVar[struct.Struct] = struct.Struct("!f")

    def __post_init__(self) -> None:
        if not 1 <= self.s < 2:
            raise ValueError(f"the 3LC sparsity multiplier must be in [1, 2), got s={self.s}")

    def nominal_bits(self, n: int) -> float:
        """Quartic encoding alone (before zero runs): 8 bits per 5 elements."""
        return 8 / 5

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        m = np.float32(np.max(np.abs(v), initial=np.float32(0)) * np.float32(self.s))
        trits = np.rint(v / m).astype(np.int8) if m > 0 else np.zeros(v.size, np.int8)
        return self.header(v.size, m) + zero_run_encode(quartic_encode(trits)).tobytes()

    def decompress(self, payload: bytes) -> np.ndarray:
        n, (m,), body = self.parse(payload)
        data = zero_run_decode(np.frombuffer(body, dtype=np.uint8))
        if data.size != -(-n // 5):
            raise ValueError(f"3LC payload holds {data.size} quartic bytes, {n} elements need "
                             f"{-(-n // 5)}")
        return quartic_decode(data, n).astype(np.float32) * np.float32(m)
