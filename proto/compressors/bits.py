"""Bit packing and Elias omega codes: the one bit-level helper of every compressor wire format.

Bit order is MSB first everywhere: the first field starts at bit 7 of byte 0, a field's most
significant bit comes first, and the last byte is padded with zero bits. This is the order in
which Elias codes are written down (``omega(2) = 100``), so a golden vector reads the same in
the spec and in ``np.unpackbits`` of the payload.

Everything is vectorised. Fields are at most :data:`MAX_WIDTH` bits wide, so any field starting
at any bit lies inside one 8-byte big-endian window, which is how fields are read back.
"""

from __future__ import annotations

import numpy as np

MAX_WIDTH = 57
"""Widest field: a field at bit offset 0..7 of a byte still fits one 64-bit window."""

OMEGA_MAX = 1 << 32
"""Elias omega values are in ``1 .. OMEGA_MAX - 1`` (positions and levels of a tensor)."""

_OMEGA_STEPS = 5
"""Reads that decode any omega code of a value below 2**32 (four groups and the final 0)."""


def pack_bits(values: np.ndarray, widths: int | np.ndarray) -> bytes:
    """Concatenate unsigned ``values``, each written in ``widths`` bits (scalar or per value).

    A width of 0 writes nothing. Raises ``ValueError`` for a negative value, a width outside
    ``0..MAX_WIDTH`` or a value that does not fit its width.
    """
    vals = np.asarray(values).reshape(-1)
    if vals.size and np.issubdtype(vals.dtype, np.signedinteger) and vals.min() < 0:
        raise ValueError("pack_bits packs unsigned values, got a negative one")
    vals = vals.astype(np.uint64, copy=False)
    w = np.asarray(widths, dtype=np.int64)
    if w.ndim and w.shape != vals.shape:
        raise ValueError(f"{w.size} widths for {vals.size} values")
    if vals.size == 0:
        return b""
    wmax = int(w.max())
    if int(w.min()) < 0 or wmax > MAX_WIDTH:
        raise ValueError(f"field widths must be in 0..{MAX_WIDTH}")
    if np.any(vals >> w.astype(np.uint64)):
        raise ValueError("a value does not fit its field width")
    # Column j holds bit j (MSB first) of every field; columns past a field's width are dropped.
    cols = np.empty((vals.size, wmax), dtype=np.uint8)
    for j in range(wmax):
        shift = np.maximum(w - 1 - j, 0).astype(np.uint64)
        cols[:, j] = (vals >> shift) & np.uint64(1)
    bits = cols if w.ndim == 0 else cols[np.arange(wmax) < w[:, None]]
    return np.packbits(bits.reshape(-1)).tobytes()


def packed_size(nbits: int) -> int:
    """Bytes taken by ``nbits`` packed bits."""
    return (nbits + 7) // 8


def unpack_bits(buf: bytes | np.ndarray, width: int, count: int) -> np.ndarray:
    """The ``count`` fields of ``width`` bits at the start of ``buf``, as uint64.

    Raises ``ValueError`` when ``buf`` is shorter than ``count * width`` bits.
    """
    if not 0 <= width <= MAX_WIDTH:
        raise ValueError(f"field width must be in 0..{MAX_WIDTH}")
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size * 8 < count * width:
        raise ValueError(f"{raw.size} bytes hold fewer than {count} fields of {width} bits")
    bits = np.unpackbits(raw, count=count * width).reshape(count, width)
    out = np.zeros(count, dtype=np.uint64)
    for j in range(width):
        out = (out << np.uint64(1)) | bits[:, j]
    return out


def bit_length(values: np.ndarray) -> np.ndarray:
    """Number of binary digits of each value below 2**53 (0 for 0), as int64."""
    return np.frexp(np.asarray(values, dtype=np.float64))[1].astype(np.int64)


def omega_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Elias omega code of each value, as (code, length in bits) for :func:`pack_bits`.

    The omega code of ``v`` ends with a single ``0``; before it, going backwards, come ``v`` in
    binary, then ``len(binary(v)) - 1`` in binary, and so on until that number would be 1. So
    ``omega(1) = 0``, ``omega(2) = 10 0``, ``omega(17) = 10 100 10001 0``. A value below 2**32
    has at most four binary groups and a code of at most 43 bits: one field.
    """
    v = np.asarray(values).reshape(-1)
    if v.size and (int(v.min()) < 1 or int(v.max()) >= OMEGA_MAX):
        raise ValueError(f"Elias omega codes values in 1..{OMEGA_MAX - 1}")
    code = np.zeros(v.size, dtype=np.uint64)  # the terminating 0 ...
    length = np.ones(v.size, dtype=np.int64)  # ... is one bit
    group = v.astype(np.int64)
    while True:  # prepend the groups, the value first: at most four rounds
        active = group > 1
        if not active.any():
            return code, length
        digits = bit_length(group)
        code |= np.where(active, group, 0).astype(np.uint64) << length.astype(np.uint64)
        length += np.where(active, digits, 0)
        group = np.where(active, digits - 1, 1)


def omega_encode(values: np.ndarray) -> bytes:
    """The Elias omega codes of ``values`` (each in ``1 .. 2**32 - 1``), concatenated."""
    return pack_bits(*omega_codes(values))


def omega_bits(values: np.ndarray) -> int:
    """Total length in bits of the omega codes of ``values``."""
    return int(omega_codes(values)[1].sum())


def _windows(raw: np.ndarray) -> np.ndarray:
    """For every byte offset q, bytes q..q+7 of ``raw`` (zero padded) as a big-endian uint64."""
    padded = np.concatenate([raw, np.zeros(8, dtype=np.uint8)])
    win = np.zeros(raw.size + 1, dtype=np.uint64)
    for j in range(8):
        win |= padded[j : j + raw.size + 1].astype(np.uint64) << np.uint64(56 - 8 * j)
    return win


def omega_decode(buf: bytes | np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """Decode ``count`` omega codes from the start of ``buf``: (uint64 values, bits used).

    Codes are self-delimiting, so where each starts depends on all before it. The decoder first
    parses, vectorised, a code *as if* one started at every bit offset (each step reads a
    group of ``n + 1`` bits, at most five steps, on the offsets still open), then walks from
    offset 0 to the next start ``count`` times: one list lookup per code, the only Python loop
    (about 0.1 s per million codes). Raises ``ValueError`` on a truncated or malformed stream.
    """
    raw = np.frombuffer(buf, dtype=np.uint8)
    total = raw.size * 8
    if count == 0:
        return np.zeros(0, dtype=np.uint64), 0
    # First read, at every offset: a 0 bit is omega(1); a 1 starts a group of n + 1 = 2 bits.
    bits = np.unpackbits(raw)
    # end and value of the code starting at each bit (end -1: none found yet, or malformed)
    end = np.where(bits == 0, np.arange(1, total + 1, dtype=np.int32), np.int32(-1))
    value = np.ones(total, dtype=np.uint32)
    cand = np.flatnonzero(bits[:-1]).astype(np.int32)  # starts still being parsed ...
    n = (2 + bits[cand + 1]).astype(np.uint64)  # ... the number read so far ...
    p = cand + 2  # ... and where each one reads next
    win = _windows(raw)
    for _ in range(_OMEGA_STEPS - 1):
        word = win[p >> 3] << (p & 7).astype(np.uint64)
        one = (word >> np.uint64(63)).astype(bool)
        stop = ~one & (p < total)
        end[cand[stop]] = p[stop] + 1
        value[cand[stop]] = n[stop]
        width = n.astype(np.int64) + 1
        go = one & (width <= 33) & (p + width <= total)
        cand, p, word, width = cand[go], p[go], word[go], width[go]
        if cand.size == 0:
            break
        n = word >> (64 - width).astype(np.uint64)
        p = p + width.astype(np.int32)
    nxt = end.tolist()
    starts = [0] * count
    p = 0
    for k in range(count):
        if not 0 <= p < total or nxt[p] < 0:
            raise ValueError(f"Elias omega stream of {total} bits ends before code {k} of {count}")
        starts[k] = p
        p = nxt[p]
    return value[starts].astype(np.uint64), p
