"""The compressor contract: one class per method, payloads that decompress on their own.

A compressor turns a float32 tensor into ``bytes`` and back:

- ``compress(x, state) -> bytes``: ``x`` is flattened (C order). Every payload starts with the
  common header :data:`HEAD` (method tag, element count) followed by the method's own fields
  and sections (see ``docs/compressors.md``), so ``decompress(payload)`` needs nothing else.
- ``decompress(payload) -> np.ndarray``: flat float32 of the original length.
- ``ina``: whether payloads of several workers can be summed by a switch as integers (they are
  NC8 codes of one window), or need server mode (decompress, sum in float, re-compress).
- ``unbiased``: whether ``E[decompress(compress(x))] == x``.
- ``nominal_bits(n)``: bits per element of a payload for an ``n``-element tensor, from the
  format (fixed-size formats) or from the method's published bound (variable-length ones),
  header excluded; the benchmark reports the measured size next to it.
- ``max_payload_size(n)``: bytes that no payload of an ``n``-element tensor exceeds, header
  included: what server mode sizes its chunks by, so that every payload fits a datagram.

Randomness and per-tensor memory live in :class:`State`, one per tensor.
"""

from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

HEAD = struct.Struct("!BI")
"""Common payload header: method tag (uint8), element count n (uint32), network byte order."""

SECTION_PADDING = 2
"""Bytes a payload's bit sections may add by padding to whole bytes, over ``nominal_bits``:
no method has more than two padded sections except QSGD, which has its own bound."""


@dataclass
class State:
    """Per-tensor state of a compressor, kept by the caller between calls.

    ``rng`` makes every random choice (one seeded ``numpy.random.Generator``). ``residual`` is the
    error-feedback memory ``e`` (float32, the tensor's flat shape; ``None`` before the first
    call): what earlier payloads failed to carry, added to the next input by
    :class:`~ncina.proto.compressors.ef.ErrorFeedback`. ``saturated`` counts elements clipped
    to the top of an NC8 window over all calls (biased; should stay 0).
    """

    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    residual: np.ndarray | None = None
    saturated: int = 0


def as_vector(x: np.ndarray) -> np.ndarray:
    """``x`` as a flat float32 array; ``ValueError`` naming the first NaN or infinity.

    The check mirrors the NC8 codec's: a non-finite gradient is an error the caller sees.
    """
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if flat.size >= 1 << 32:
        raise ValueError(f"{flat.size} elements do not fit the uint32 element count")
    if not np.isfinite(flat).all():
        i = int(np.flatnonzero(~np.isfinite(flat))[0])
        raise ValueError(f"cannot compress non-finite value {flat[i]!r} at flat index {i}")
    return flat


FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_float32_norm(norm: float, what: str) -> float:
    """``norm`` (computed in float64) if a float32 header field can carry it, else
    ``ValueError``: a float32 norm of finite inputs may overflow to infinity, which would
    silently turn the whole payload into zeros."""
    if not norm <= FLOAT32_MAX:
        raise ValueError(
            f"{what} {norm:.4g} exceeds float32 (max {FLOAT32_MAX:.4g}): the payload carries it "
            "as float32; scale the tensor down (or use smaller buckets)"
        )
    return norm


class Compressor(ABC):
    """One compression method; subclasses are frozen dataclasses of their parameters."""

    name: ClassVar[str]
    """Registry name."""
    tag: ClassVar[int]
    """First payload byte, so a payload given to the wrong method is rejected."""
    ina: ClassVar[bool]
    """Payloads are integer-summable in a switch (NC8 codes)."""
    unbiased: ClassVar[bool]
    """``E[decompress(compress(x))] == x``."""
    error_feedback: ClassVar[bool] = False
    """The method is defined with error feedback (the registry wraps it by default)."""
    layout: ClassVar[struct.Struct] = struct.Struct("!")
    """The method's header fields after :data:`HEAD`."""

    @abstractmethod
    def nominal_bits(self, n: int) -> float:
        """Bits per element of the payload of an ``n``-element tensor, header excluded."""

    def max_payload_size(self, n: int) -> int:
        """Bytes no payload of an ``n``-element tensor exceeds, :data:`HEAD` included.

        From ``nominal_bits``, which is the exact size of the fixed-size formats and an upper
        bound for 3LC (its size before zero-run encoding, which never expands); a method whose
        ``nominal_bits`` is not an upper bound (QSGD's published one) overrides this.
        """
        body = math.ceil(self.nominal_bits(n) * n / 8) if n else 0
        return HEAD.size + self.layout.size + body + SECTION_PADDING

    @abstractmethod
    def compress(self, x: np.ndarray, state: State) -> bytes:
        """The payload of ``x`` (any shape, flattened); random choices from ``state.rng``."""

    @abstractmethod
    def decompress(self, payload: bytes) -> np.ndarray:
        """The flat float32 tensor a payload stands for."""

    def header(self, n: int, *fields: float) -> bytes:
        """:data:`HEAD` and the method's header fields."""
        return HEAD.pack(self.tag, n) + self.layout.pack(*fields)

    def parse(self, payload: bytes) -> tuple[int, tuple, memoryview]:
        """Split a payload into (n, method header fields, body); ``ValueError`` if malformed."""
        size = HEAD.size + self.layout.size
        if len(payload) < size:
            raise ValueError(f"{self.name} payload of {len(payload)} bytes: header is {size}")
        tag, n = HEAD.unpack_from(payload)
        if tag != self.tag:
            raise ValueError(f"payload tag {tag} is not {self.name}'s ({self.tag})")
        return n, self.layout.unpack_from(payload, HEAD.size), memoryview(payload)[size:]


def largest_fitting(compressor: Compressor, room: int, k: int) -> int:
    """The largest chunk of at most ``k`` elements whose every payload fits ``room`` bytes
    (``max_payload_size``), or 0 when not even one element's does."""
    low, high = 0, k  # max_payload_size grows with n: bisect for the last n that fits
    while low < high:
        mid = (low + high + 1) // 2
        if compressor.max_payload_size(mid) <= room:
            low = mid
        else:
            high = mid - 1
    return low


def take(body: memoryview, size: int, what: str) -> tuple[memoryview, memoryview]:
    """Split ``size`` bytes off the front of ``body``; ``ValueError`` naming ``what`` if short."""
    if len(body) < size:
        raise ValueError(f"payload truncated in {what}: {len(body)} of {size} bytes")
    return body[:size], body[size:]


def expect_end(rest: memoryview, name: str) -> None:
    """``ValueError`` if bytes are left over after the last section of a payload."""
    if len(rest):
        raise ValueError(f"{name} payload has {len(rest)} trailing bytes")
