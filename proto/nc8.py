"""The NC8 code: natural compression of float32 to one byte, as specified in docs/protocol.md.

A byte is a sign bit (bit 7) and an exponent code ``c`` (bits 0-6): ``c == 0`` is zero, ``c >= 1``
is ``+-2**(e_min + c - 1)``. A job's :class:`Window` fixes ``e_min`` and the top uplink code so that
the aggregator's 64-bit integer sums of ``N`` workers never overflow.

Every random decision is drawn from a counter-based stream, so the two implementations here agree
bit for bit and any element can be checked on its own. A call draws one 64-bit ``key`` from the
caller's ``numpy.random.Generator`` (``rng.integers(0, 2**64, dtype=np.uint64)``); element ``i``
(flat, 0-based) of the call uses::

    z = splitmix64((key + (i + 1) * 0x9E3779B97F4A7C15) mod 2**64)

Encoding: ``r23 = z & 0x7FFFFF`` decides the rounding up (``r23 < mantissa``, probability
``mantissa / 2**23``); below the window, after a gap of ``g = e_min - e`` powers, ``2**e_min`` is
kept iff the top ``g`` bits of ``z`` are zero (``z >> (64 - g) == 0``, probability ``2**-g``; these
are the top bits of the 41 bits ``z >> 23``, disjoint from ``r23``, hence independent), and
``g > 41`` gives zero.

Re-compression of an integer sum ``S`` with ``2**h <= |S| < 2**(h + 1)`` rounds up iff the top
``h`` bits of ``z = w << 32`` are below ``|S| - 2**h``, where ``w`` is the element's 32-bit
*rounding word*: a CRC-32 a switch computes in one primitive (docs/protocol.md,
"Re-compression"). A result's words are those of its chunk: :func:`result_key` is the CRC-32
(zlib's, BMv2's and Tofino's ``crc32``) of the 25 bytes::

    seed (8) | job (2) | slot (2) | offset (4) | use (4) | version (1) | lane (4)

(big-endian, lane 0), with ``use`` the completions of the slot version before this one, so the
result does not depend on the order in which packets arrive or slots complete. Lane ``i``'s word
is the CRC-32 of the same bytes with lane ``i``, which CRC's linearity makes ``key ^ lane_term(i)``
(:func:`lane_terms`); every backend (Python, the C engine, the P4 program) sends the same bytes,
and :func:`recompress` takes the key.

Implementations: a C fast path (``proto/nc8.c``, built with cffi on first import by
:mod:`ncina.common.cbuild`) and a vectorised numpy reference processing 64K-element blocks. The
module-level functions use the C path when it builds, otherwise numpy with a warning saying why;
``NCINA_NO_C=1`` forces numpy. :data:`IMPLEMENTATION` says which is active and :func:`codec` gives
either one explicitly (tests and benchmarks compare them).
"""

from __future__ import annotations

import math
import operator
import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, Protocol

import numpy as np
from ncina.proto.header import Format

from ncina.common.cbuild import build_extension

GAMMA = 0x9E3779B97F4A7C15
"""Counter increment of the random stream (the splitmix64 golden-ratio constant)."""
MAX_GAP = 41
"""Below the window, values more than this many powers of two below 2**e_min encode to zero."""
MAX_DOWNLINK_CODE = 64
"""Largest exponent code a re-compressed sum can have (|S| <= 2**63)."""
MAX_UPLINK_CODE = 63
"""Largest exponent code whose integer value 2**(c-1) fits a signed 64-bit accumulator."""
SUM_BITS = 62
"""A window keeps N workers' sums within ``+-2**SUM_BITS`` (``N * 2**span``), which a signed
64-bit accumulator holds: ``span = SUM_BITS - ceil(log2(N))`` (docs/protocol.md)."""
INT32_SUM_BITS = 30
"""The window of a job of ``int32`` results keeps its sums within ``+-2**30``, which a signed
32-bit result lane holds: ``span = 30 - ceil(log2(N))``, the top code ``31 - ceil(log2(N))`` (the
Tofino design's rule; docs/protocol.md, "int32 results"). The C engine's copy is
``NCE_INT32_SUM_BITS``."""

ROUNDING = 1
"""The revision of the nc8 results' rounding word this code computes, named in the job handshake
(docs/protocol.md, "Re-compression"): 1, the CRC-32 word; 0 was the SplitMix64 word of earlier
releases, which no backend computes any more (a peer that names it is refused)."""
ROUNDING_NAMES = {0: "splitmix64 (revision 0)", 1: "crc32 (revision 1)"}
RESULT_WORD = struct.Struct("!QHHIIBI")
"""The bytes whose CRC-32 is a result element's rounding word: seed, job, slot, offset, use,
version, lane (docs/protocol.md, "Re-compression")."""

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_BLOCK = 1 << 16
_STEPS = np.arange(1, _BLOCK + 1, dtype=np.uint64) * np.uint64(GAMMA)  # (j + 1) * GAMMA


@dataclass(frozen=True)
class Window:
    """A job's exponent window: code 1 is ``2**e_min``, uplink codes are ``0..span + 1``."""

    e_min: int
    span: int

    def __post_init__(self) -> None:
        if not 0 <= self.span <= 62:
            raise ValueError(f"window span {self.span} outside 0..62")
        if not (self.e_min >= -126 and self.e_min + 64 <= 127):
            raise ValueError(
                f"window e_min {self.e_min} outside -126..63: codes must decode to float32 "
                "normal numbers (-126 <= e_min and e_min + 64 <= 127)"
            )

    @classmethod
    def for_job(cls, workers: int, e_max: int = 10, sum_bits: int = SUM_BITS) -> Window:
        """The window of a job of ``workers`` workers whose largest exponent is ``e_max``.

        ``span = sum_bits - ceil(log2(workers))`` so that ``workers * 2**span <= 2**sum_bits``:
        with ``SUM_BITS`` (62) the sum of every worker's code never overflows a signed 64-bit
        accumulator; ``sum_bits(result_format)`` gives the bits of a job's results.
        """
        workers = operator.index(workers)
        e_max = operator.index(e_max)
        if workers < 1:
            raise ValueError(f"a job needs at least 1 worker, got {workers}")
        span = sum_bits - (workers - 1).bit_length()  # (n - 1).bit_length() == ceil(log2(n))
        if span < 0:
            raise ValueError(f"{workers} workers is too many for sums within 2**{sum_bits}")
        try:
            return cls(e_min=e_max - span, span=span)
        except ValueError as exc:
            raise ValueError(
                f"no valid window for {workers} workers and e_max {e_max}: {exc}"
            ) from None

    @property
    def e_max(self) -> int:
        """Largest in-window exponent: the top uplink code is ``2**e_max``."""
        return self.e_min + self.span

    @property
    def max_code(self) -> int:
        """Largest uplink exponent code."""
        return self.span + 1


def sum_bits(result_format: int) -> int:
    """The bits a job's window keeps its sums within for results of ``result_format`` (a
    ``ncina.proto.header.Format``): ``INT32_SUM_BITS`` for int32, else ``SUM_BITS``."""
    return INT32_SUM_BITS if result_format == Format.INT32 else SUM_BITS


def int32_refusal(total_workers: int, span: int) -> str | None:
    """Why a job of int32 results cannot have ``total_workers`` workers sending codes up to
    ``2**span`` (its window's span), or None: their largest sum, ``total_workers * 2**span`` in
    units of ``2**e_min``, must stay within ``2**INT32_SUM_BITS`` (docs/protocol.md, "int32
    results"). Every admission (``JobConfig``, the C engine's ``nce_job_add``) refuses with this
    sentence."""
    if total_workers << span <= 1 << INT32_SUM_BITS:
        return None
    return (
        f"int32 results: {total_workers} workers' codes up to 2^{span} can sum to "
        f"{total_workers} * 2^{span}, beyond the 2^{INT32_SUM_BITS} a signed 32-bit lane is "
        f"kept within (span + ceil(log2 N) <= {INT32_SUM_BITS})"
    )


class Encoded(NamedTuple):
    """Result of :func:`encode`."""

    codes: np.ndarray
    """uint8 codes, same shape as the input."""
    saturated: int
    """Number of elements clipped to the top of the window (biased; should stay rare)."""


@lru_cache(maxsize=64)
def _decode_table(e_min: int) -> np.ndarray:
    """float32 value of each of the 256 bytes; bytes whose value is no float32 normal get 0."""
    table = np.zeros(256, dtype=np.float32)
    for b in range(256):
        c = b & 0x7F
        if c and -126 <= e_min + c - 1 <= 127:
            table[b] = math.copysign(math.ldexp(1.0, e_min + c - 1), -1.0 if b & 0x80 else 1.0)
    table.setflags(write=False)
    return table


def _int_table() -> np.ndarray:
    """int64 value of each byte: +-2**(c-1), 0 for c == 0 and for c > 63 (rejected by callers)."""
    table = np.zeros(256, dtype=np.int64)
    for b in range(256):
        c = b & 0x7F
        if 1 <= c <= MAX_UPLINK_CODE:
            table[b] = -(1 << (c - 1)) if b & 0x80 else 1 << (c - 1)
    table.setflags(write=False)
    return table


_INT_TABLE = _int_table()


class _Kernels(Protocol):
    """One implementation of the codec kernels on flat, contiguous arrays of equal length."""

    name: str

    def encode(
        self, x: np.ndarray, codes: np.ndarray, key: int, window: Window
    ) -> tuple[int, bool]:
        """Write codes of float32 ``x``; return (saturated count, whether a NaN/Inf was seen)."""
        ...

    def decode(self, codes: np.ndarray, out: np.ndarray, e_min: int) -> int:
        """Write float32 values of ``codes``; return the largest exponent code seen."""
        ...

    def codes_to_int(self, codes: np.ndarray, out: np.ndarray) -> None:
        """Write int64 values of (valid uplink) codes."""
        ...

    def accumulate(self, acc: np.ndarray, codes: np.ndarray) -> None:
        """Add the int64 values of (valid uplink) codes to ``acc``."""
        ...

    def int_to_codes(self, sums: np.ndarray, codes: np.ndarray, key: int) -> None:
        """Write the stochastic re-compression of int64 ``sums`` with lane words
        ``key ^ lane_term(i)``."""
        ...

    def result_key(
        self, seed: int, job: int, slot: int, version: int, offset: int, use: int
    ) -> int:
        """The rounding word of lane 0 of an aggregator's result for the chunk (module doc)."""
        ...


def _crc_table() -> np.ndarray:
    """The byte table of the reflected CRC-32 (polynomial 0x04C11DB7, zlib's): entry ``b`` is the
    register after shifting the byte ``b`` through a zero register."""
    reg = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        reg = (reg >> np.uint32(1)) ^ np.where(reg & 1, np.uint32(0xEDB88320), np.uint32(0))
    return reg


_CRC_TABLE = _crc_table()


def lane_terms(start: int, n: int) -> np.ndarray:
    """``lane_term(i)`` for lanes ``start .. start + n - 1`` (uint32): the linear part of CRC-32
    (zero register, no final xor) of the 4 big-endian bytes of ``i mod 2**32``, so that the
    rounding word of lane ``i`` is ``key ^ lane_term(i)`` when ``key`` is lane 0's word of the
    same bytes (CRC-32 of equal-length inputs is affine over GF(2); docs/protocol.md)."""
    lanes = (np.arange(n, dtype=np.uint64) + np.uint64(start)).astype(np.uint32)
    reg = np.zeros(n, dtype=np.uint32)
    for shift in (24, 16, 8, 0):
        byte = (lanes >> np.uint32(shift)) & np.uint32(0xFF)
        reg = _CRC_TABLE[(reg ^ byte) & np.uint32(0xFF)] ^ (reg >> np.uint32(8))
    return reg


def _stream(key: int, start: int, n: int) -> np.ndarray:
    """The random words ``z`` of elements ``start .. start + n - 1`` of a call keyed ``key``."""
    z = _STEPS[:n] + np.uint64((key + start * GAMMA) & _MASK64)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


class _NumpyKernels:
    """The reference: vectorised numpy, in blocks of 64K elements to stay in cache."""

    name = "numpy"

    def encode(
        self, x: np.ndarray, codes: np.ndarray, key: int, window: Window
    ) -> tuple[int, bool]:
        bmin = window.e_min + 127  # biased exponent of 2**e_min
        saturated = 0
        bad = False
        for start in range(0, x.size, _BLOCK):
            u = x[start : start + _BLOCK].view(np.uint32)
            z = _stream(key, start, u.size)
            biased = ((u >> 23) & 0xFF).astype(np.int32)
            bad = bad or bool(np.any(biased == 0xFF))
            # Round up with probability mantissa / 2**23; a subnormal becomes 2**-126 or zero.
            eb = biased + ((z & np.uint64(0x7FFFFF)).astype(np.uint32) < (u & 0x7FFFFF))
            d = eb - bmin  # e - e_min
            saturated += int(np.count_nonzero(d > window.span))
            gap = -d
            top_bits = np.clip(gap, 1, MAX_GAP).astype(np.uint64)
            keep = ((z >> (np.uint64(64) - top_bits)) == 0) & (gap <= MAX_GAP) & (eb != 0)
            c = np.where(d < 0, keep, np.minimum(d, window.span) + 1)
            sign = ((u >> 24) & 0x80).astype(np.int32)
            codes[start : start + u.size] = np.where(c != 0, c | sign, 0)
        return saturated, bad

    def decode(self, codes: np.ndarray, out: np.ndarray, e_min: int) -> int:
        table = _decode_table(e_min)
        top = 0
        for start in range(0, codes.size, _BLOCK):
            block = codes[start : start + _BLOCK]
            np.take(table, block, out=out[start : start + _BLOCK])
            top = max(top, int(np.max(block & 0x7F)))
        return top

    def codes_to_int(self, codes: np.ndarray, out: np.ndarray) -> None:
        for start in range(0, codes.size, _BLOCK):
            np.take(_INT_TABLE, codes[start : start + _BLOCK], out=out[start : start + _BLOCK])

    def accumulate(self, acc: np.ndarray, codes: np.ndarray) -> None:
        for start in range(0, codes.size, _BLOCK):
            acc[start : start + _BLOCK] += _INT_TABLE[codes[start : start + _BLOCK]]

    def int_to_codes(self, sums: np.ndarray, codes: np.ndarray, key: int) -> None:
        one = np.uint64(1)
        for start in range(0, sums.size, _BLOCK):
            s = sums[start : start + _BLOCK]
            neg = s < 0
            u = s.view(np.uint64)
            mag = np.where(neg, np.uint64(0) - u, u)  # |S|, 2**63 for INT64_MIN
            # h = floor(log2 |S|) (of 1 for S == 0, masked below). float64 may round up across
            # a power of two, never down: correct by one where 2**h overshoots.
            lg = mag | one
            h = (np.frexp(lg.astype(np.float64))[1] - 1).astype(np.uint64)
            h -= (one << h) > lg
            z = (lane_terms(start, s.size) ^ np.uint32(key)).astype(np.uint64) << np.uint64(32)
            r = (z >> one) >> (np.uint64(63) - h)  # top h bits of z = word << 32
            c = h + one + (r < mag - (one << h))
            codes[start : start + s.size] = np.where(mag != 0, c | (neg.astype(np.uint64) << 7), 0)

    def result_key(
        self, seed: int, job: int, slot: int, version: int, offset: int, use: int
    ) -> int:
        return zlib.crc32(RESULT_WORD.pack(seed, job, slot, offset, use, version, 0))


class _CKernels:
    """The C fast path (proto/nc8.c) through a cffi API-mode module."""

    name = "c"

    def __init__(self, module: ModuleType) -> None:
        self._ffi = module.ffi
        self._lib = module.lib

    def _in(self, ctype: str, a: np.ndarray) -> object:
        return self._ffi.from_buffer(ctype, a)

    def _out(self, ctype: str, a: np.ndarray) -> object:
        return self._ffi.from_buffer(ctype, a, require_writable=True)

    def encode(
        self, x: np.ndarray, codes: np.ndarray, key: int, window: Window
    ) -> tuple[int, bool]:
        saturated = self._ffi.new("uint64_t *")
        bad = self._lib.nc8_encode(
            self._in("float[]", x),
            self._out("uint8_t[]", codes),
            x.size,
            key,
            window.e_min,
            window.span,
            saturated,
        )
        return int(saturated[0]), bool(bad)

    def decode(self, codes: np.ndarray, out: np.ndarray, e_min: int) -> int:
        return self._lib.nc8_decode(
            self._in("uint8_t[]", codes), self._out("float[]", out), codes.size, e_min
        )

    def codes_to_int(self, codes: np.ndarray, out: np.ndarray) -> None:
        self._lib.nc8_codes_to_int(
            self._in("uint8_t[]", codes), self._out("int64_t[]", out), codes.size
        )

    def accumulate(self, acc: np.ndarray, codes: np.ndarray) -> None:
        self._lib.nc8_accumulate(
            self._out("int64_t[]", acc), self._in("uint8_t[]", codes), codes.size
        )

    def int_to_codes(self, sums: np.ndarray, codes: np.ndarray, key: int) -> None:
        self._lib.nc8_int_to_codes(
            self._in("int64_t[]", sums), self._out("uint8_t[]", codes), sums.size, key
        )

    def result_key(
        self, seed: int, job: int, slot: int, version: int, offset: int, use: int
    ) -> int:
        return int(self._lib.nc8_result_key(seed, job, slot, version, offset, use))


_HERE = Path(__file__).resolve().parent


def _build_c() -> _CKernels:
    """Build (or load from the cache) the C kernels; RuntimeError says what is missing."""
    header = _HERE / "nc8.h"
    cdef = "\n".join(
        line for line in header.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    module = build_extension(
        "nc8", cdef, [_HERE / "nc8.c"], preamble='#include "nc8.h"\n', depends=[header]
    )
    return _CKernels(module)


# --- argument handling -------------------------------------------------------------------------


def _draw_key(rng: np.random.Generator) -> int:
    """The per-call key of the random stream."""
    return int(rng.integers(0, 2**64, dtype=np.uint64))


def _flat(a: np.ndarray) -> np.ndarray:
    """A flat, C-contiguous view (or copy, if ``a`` is not contiguous)."""
    return np.ascontiguousarray(a).reshape(-1)


def _result(out: np.ndarray | None, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """``out`` checked for shape, dtype, contiguity and writability, or a new array."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != shape:
        raise ValueError(f"out must be a {np.dtype(dtype)} array of shape {shape}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be C-contiguous and writable")
    return out


def _codes_arg(codes: np.ndarray) -> np.ndarray:
    a = np.asarray(codes)
    if a.dtype != np.uint8:
        raise TypeError(f"NC8 codes must be uint8, got {a.dtype}")
    return a


def _ints_arg(sums: np.ndarray) -> np.ndarray:
    a = np.asarray(sums)
    if not np.issubdtype(a.dtype, np.signedinteger):
        raise TypeError(f"integer sums must have a signed integer dtype, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_uplink(flat_codes: np.ndarray) -> None:
    """Reject codes whose integer value does not fit int64 (exponent code above 63)."""
    bad = np.flatnonzero(flat_codes & 0x40)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"code 0x{int(flat_codes[i]):02x} at flat index {i} has exponent code "
            f"{int(flat_codes[i]) & 0x7F} > {MAX_UPLINK_CODE}: not an integer-summable code"
        )


# --- public API ----------------------------------------------------------------------------------


class Codec:
    """The NC8 operations, bound to one implementation (see :func:`codec`).

    The module-level :func:`encode`, :func:`decode`, :func:`codes_to_int`, :func:`accumulate`,
    :func:`int_to_codes`, :func:`recompress` and :func:`result_key` are those of the active
    implementation; both give the same bytes.
    """

    def __init__(self, kernels: _Kernels) -> None:
        self._k = kernels

    @property
    def name(self) -> str:
        """``"c"`` or ``"numpy"``."""
        return self._k.name

    def encode(
        self, x: np.ndarray, window: Window, rng: np.random.Generator, out: np.ndarray | None = None
    ) -> Encoded:
        """Natural compression of ``x`` into NC8 codes of the same shape, unbiased in the window.

        ``x`` is float32 of any shape; float64 and float16 are first converted to float32
        (float64 rounds to nearest, so the code is unbiased for the float32 value). Values above
        the window saturate to the top code and are counted; ``+-0`` gives ``0x00``. Raises
        ``ValueError`` naming the first flat index of a NaN or infinity (``out`` may then be
        partly written). One key is drawn from ``rng`` per call (random stream: module doc).
        """
        key = _draw_key(rng)
        src = np.asarray(x)
        if src.dtype not in (np.float32, np.float64, np.float16):
            raise TypeError(f"encode needs float32 (or float64/float16) values, got {src.dtype}")
        with np.errstate(over="ignore"):  # float64 beyond float32: inf, reported below
            flat = _flat(src.astype(np.float32, copy=False))
        codes = _result(out, src.shape, np.uint8)
        saturated, bad = self._k.encode(flat, codes.reshape(-1), key, window)
        if bad:
            i = int(np.flatnonzero(~np.isfinite(flat))[0])
            raise ValueError(f"cannot encode {float(src.flat[i])} at flat index {i}")
        return Encoded(codes, saturated)

    def decode(
        self, codes: np.ndarray, window: Window, out: np.ndarray | None = None
    ) -> np.ndarray:
        """float32 values of NC8 codes (any shape): ``+-2**(e_min + c - 1)``, 0 for ``c == 0``.

        Raises ``ValueError`` naming the first code above 64, which no encoder produces.
        """
        src = _codes_arg(codes)
        flat = _flat(src)
        res = _result(out, src.shape, np.float32)
        if self._k.decode(flat, res.reshape(-1), window.e_min) > MAX_DOWNLINK_CODE:
            i = int(np.flatnonzero((flat & 0x7F) > MAX_DOWNLINK_CODE)[0])
            raise ValueError(f"code 0x{int(flat[i]):02x} at flat index {i} is above the NC8 range")
        return res

    def codes_to_int(self, codes: np.ndarray) -> np.ndarray:
        """int64 values ``+-2**(c - 1)`` (0 for ``c == 0``) of uplink codes: the switch ALU input.

        Raises ``ValueError`` for an exponent code above 63 (its value does not fit int64).
        """
        src = _codes_arg(codes)
        flat = _flat(src)
        _check_uplink(flat)
        res = np.empty(src.shape, dtype=np.int64)
        self._k.codes_to_int(flat, res.reshape(-1))
        return res

    def accumulate(self, acc: np.ndarray, codes: np.ndarray) -> None:
        """``acc += codes_to_int(codes)`` in place, without the intermediate array.

        ``acc`` is a C-contiguous writable int64 array of the codes' shape. Like a switch
        register the addition wraps modulo 2**64; the job's :class:`Window` rules overflow out.
        """
        if not (isinstance(acc, np.ndarray) and acc.dtype == np.int64):
            raise TypeError("acc must be an int64 numpy array")
        if not (acc.flags.c_contiguous and acc.flags.writeable):
            raise ValueError("acc must be C-contiguous and writable")
        src = _codes_arg(codes)
        if src.shape != acc.shape:
            raise ValueError(f"codes of shape {src.shape} do not match acc of shape {acc.shape}")
        flat = _flat(src)
        _check_uplink(flat)
        self._k.accumulate(acc.reshape(-1), flat)

    def int_to_codes(
        self, sums: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Stochastic re-compression of int64 sums (units of ``2**e_min``) to NC8 codes.

        ``S`` with ``2**h <= |S| < 2**(h + 1)`` becomes code ``h + 1`` or ``h + 2`` (values
        ``2**h``, ``2**(h + 1)``), up with probability exactly ``(|S| - 2**h) / 2**h``, sign
        kept; 0 stays 0. Codes are at most 64. One 32-bit key is drawn from ``rng`` per call:
        element ``i``'s rounding word is ``key ^ lane_term(i)`` (:func:`lane_terms`).
        """
        return self.recompress(sums, int(rng.integers(0, 2**32, dtype=np.uint64)), out)

    def recompress(self, sums: np.ndarray, key: int, out: np.ndarray | None = None) -> np.ndarray:
        """:meth:`int_to_codes` with the ``key`` given (an aggregator's result:
        ``key = result_key(seed, job, slot, version, offset, use)``), 0 <= key < 2**32."""
        if not 0 <= key <= _MASK32:
            raise ValueError(f"key {key} is not a 32-bit unsigned integer")
        src = _ints_arg(sums)
        res = _result(out, src.shape, np.uint8)
        self._k.int_to_codes(_flat(src), res.reshape(-1), key)
        return res

    def result_key(
        self, seed: int, job: int, slot: int, version: int, offset: int, use: int
    ) -> int:
        """The key of an aggregator's nc8 result for a chunk, the rounding word of its lane 0
        (module doc; docs/protocol.md, "Re-compression"): the CRC-32 of the job's ``seed``
        (0..2**64 - 1), the chunk's ``job``,
        ``slot`` (0..65535 each), pool ``version`` (0 or 1) and ``offset`` (0..2**32 - 1), and
        ``use``, the completions of that slot version before this one (0..2**32 - 1), and the
        lane 0 (:data:`RESULT_WORD`)."""
        for name, value, top in (("seed", seed, _MASK64), ("job", job, 0xFFFF),
                                 ("slot", slot, 0xFFFF), ("version", version, 1),
                                 ("offset", offset, 0xFFFFFFFF),
                                 ("use", use, 0xFFFFFFFF)):  # fmt: skip
            if not 0 <= value <= top:
                raise ValueError(f"result key: {name} {value} is outside 0..{top}")
        return self._k.result_key(seed, job, slot, version, offset, use)


def ints_to_float(sums: np.ndarray, window: Window, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of int64 sums in units of ``2**e_min`` (the ``int`` result format).

    Each sum is rounded to the nearest float32 and scaled exactly by ``2**e_min``.
    """
    src = _ints_arg(sums)
    res = _result(out, src.shape, np.float32)
    np.multiply(src.astype(np.float32), np.float32(math.ldexp(1.0, window.e_min)), out=res)
    return res


def _c_disabled() -> bool:
    return os.environ.get("NCINA_NO_C", "") not in ("", "0")


_NUMPY = Codec(_NumpyKernels())


@lru_cache(maxsize=1)
def _c_codec() -> Codec | str:
    """The C codec (built on first use), or the reason it is unavailable."""
    if _c_disabled():
        return "NCINA_NO_C is set"
    try:
        return Codec(_build_c())
    except RuntimeError as exc:
        return str(exc)


def codec(name: str) -> Codec:
    """The codec of implementation ``name`` (``"c"`` or ``"numpy"``).

    Raises ``RuntimeError`` saying why when the C one cannot be built or ``NCINA_NO_C`` is set.
    """
    if name == "numpy":
        return _NUMPY
    if name != "c":
        raise ValueError(f"unknown NC8 implementation {name!r} (expected 'c' or 'numpy')")
    fast = _c_codec()
    if isinstance(fast, str):
        raise RuntimeError(f"C NC8 codec unavailable: {fast}")
    return fast


def _default() -> Codec:
    """The C codec, or numpy with a warning saying why not (silently if NCINA_NO_C is set)."""
    try:
        return codec("c")
    except RuntimeError as exc:
        if not _c_disabled():
            warnings.warn(f"{exc}; using numpy", RuntimeWarning, stacklevel=2)
        return _NUMPY


_ACTIVE = _default()
IMPLEMENTATION: str = _ACTIVE.name
"""Active implementation: ``"c"`` or ``"numpy"``."""
encode = _ACTIVE.encode
decode = _ACTIVE.decode
codes_to_int = _ACTIVE.codes_to_int
accumulate = _ACTIVE.accumulate
int_to_codes = _ACTIVE.int_to_codes
recompress = _ACTIVE.recompress
result_key = _ACTIVE.result_key
