"""The ncina header on the data path: struct and numpy packing, and datagram validation.

The layout is specified in ``docs/protocol.md``; ``ncina.proto.layers`` is the scapy form of the
same layout, and the tests check that both agree byte for byte. Everything here works on UDP
payloads (the ncina header plus its payload); Ethernet/IP/UDP are the transport's business.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import numpy as np
from ncina.proto.wire import HEADER_SIZE, TAG_SIZE, payload_room

VERSION = 1
PORT = 47000

FLAG_RESULT = 0x01  # set by the aggregator on results
FLAG_RETX = 0x02  # the worker re-sends this chunk after a timeout
FLAG_POOL = 0x04  # pool version of the slot (SwitchML's shadow copy)
# Bits 3-6: the aggregator's generation, 1..15, chosen anew at every start; 0 on uplink means
# "not known yet" (docs/protocol.md, "Generations and notices").
GENERATION_SHIFT = 3
GENERATION_MASK = 0x78
MAX_GENERATION = GENERATION_MASK >> GENERATION_SHIFT
# Bit 7: the datagram ends in an authentication tag (ncina.proto.tag, TAG_SIZE bytes; keyed jobs
# only).
FLAG_TAG = 0x80

# A notice (RESULT set, count 0) carries one big-endian 64-bit word: the bitmap of the ranks
# whose contribution to the slot's version the aggregator holds.
NOTICE = struct.Struct("!Q")

# version, flags, format, emin (signed), job, rank, slot, count, offset; network byte order.
HEADER = struct.Struct("!BBBbHHHHI")
assert HEADER.size == HEADER_SIZE  # ncina.proto.wire holds the sizes

# The same layout as a numpy record, for packing many chunks at once.
HEADER_DTYPE = np.dtype(
    [
        ("version", "u1"),
        ("flags", "u1"),
        ("format", "u1"),
        ("emin", "i1"),
        ("job", ">u2"),
        ("rank", ">u2"),
        ("slot", ">u2"),
        ("count", ">u2"),
        ("offset", ">u4"),
    ]
)
assert HEADER_DTYPE.itemsize == HEADER_SIZE


class Format(IntEnum):
    """Payload format of a packet."""

    NC8 = 0  # one NC8 code per element (uplink and downlink)
    INT = 1  # exact sums, signed 64-bit big-endian, in units of 2**e_min (downlink)
    BLOB = 2  # server mode: one self-describing compressor payload of the chunk (both ways)
    JOB = 3  # the job handshake: a job descriptor (ncina.proto.descriptor), both ways
    INT32 = 4  # exact sums, signed 32-bit big-endian, in units of 2**e_min (downlink)


ELEMENT_SIZE = {Format.NC8: 1, Format.INT: 8, Format.INT32: 4}
"""Bytes per element of the fixed-size formats (BLOB payloads have their own length)."""
INT_DTYPE = np.dtype(">i8")  # element type of the INT payload
INT32_DTYPE = np.dtype(">i4")  # element type of the INT32 payload
SUM_DTYPES = {Format.INT: INT_DTYPE, Format.INT32: INT32_DTYPE}
"""Element type of each format of exact sums (a result's, or a leaf's partial sums: INT)."""
UPLINK_FORMATS = (Format.NC8, Format.INT)
"""What an INA job's members send: NC8 codes (workers), INT partial sums (leaves, to a spine)."""


def largest_k(mtu: int, result_format: Format, tagged: bool = False) -> int:
    """The largest chunk size K whose datagrams both ways fit one IPv4 packet of ``mtu`` bytes.

    The uplink carries K NC8 bytes, the result K elements of ``result_format``
    (``ELEMENT_SIZE``: 1, 8 or 4 bytes), each behind IPv4, UDP, the ncina header and, for a
    keyed job, the tag; the result is the larger. 0 when not even one element fits.
    """
    return max(0, payload_room(mtu, tagged) // ELEMENT_SIZE[Format(result_format)])


# Drop reasons found by `parse` (all but BAD_FLAGS: every flag bit has a meaning, so which flags
# are wrong depends on the job); the aggregator adds the job-level ones (docs/protocol.md).
TRUNCATED = "truncated"
BAD_VERSION = "bad_version"
BAD_FLAGS = "bad_flags"
BAD_FORMAT = "bad_format"
BAD_LENGTH = "bad_length"
BAD_COUNT = "bad_count"


class Header(NamedTuple):
    """One decoded header; field order and meaning as in docs/protocol.md."""

    version: int
    flags: int
    format: int
    emin: int
    job: int
    rank: int
    slot: int
    count: int
    offset: int

    @property
    def pool(self) -> int:
        """The pool version bit, 0 or 1."""
        return (self.flags & FLAG_POOL) >> 2

    @property
    def is_result(self) -> bool:
        return bool(self.flags & FLAG_RESULT)

    @property
    def is_retx(self) -> bool:
        return bool(self.flags & FLAG_RETX)

    @property
    def generation(self) -> int:
        """The generation bits, 0..15 (0: the sender does not know the aggregator's yet)."""
        return (self.flags & GENERATION_MASK) >> GENERATION_SHIFT

    @property
    def is_tagged(self) -> bool:
        return bool(self.flags & FLAG_TAG)


class ProtocolError(ValueError):
    """A datagram that is not a well-formed ncina packet; ``reason`` is its drop counter's name."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def flags_for(
    pool: int, *, result: bool = False, retx: bool = False, generation: int = 0
) -> int:
    """Compose the flags byte from the pool version, the two booleans and the generation."""
    return (
        (FLAG_POOL if pool else 0) | (FLAG_RESULT if result else 0) | (FLAG_RETX if retx else 0)
        | generation << GENERATION_SHIFT
    )


def pack(
    *,
    job: int,
    rank: int,
    slot: int,
    offset: int,
    count: int,
    emin: int,
    flags: int = 0,
    fmt: int = Format.NC8,
    payload: bytes | memoryview = b"",
) -> bytes:
    """One datagram: the header, then ``payload`` (``count`` elements of format ``fmt``)."""
    return HEADER.pack(VERSION, flags, fmt, emin, job, rank, slot, count, offset) + bytes(payload)


def parse(datagram: bytes | bytearray | memoryview) -> tuple[Header, memoryview]:
    """Validate the job-independent part of a datagram and split it into header and payload.

    With the ``TAG`` flag the last ``TAG_SIZE`` bytes are the tag, not payload: the payload
    returned stops before it (checking the tag needs the job's key: ``ncina.proto.tag.verify``).
    Raises ``ProtocolError`` whose ``reason`` names the drop counter: ``truncated``,
    ``bad_version``, ``bad_format``, ``bad_count`` (zero elements) or
    ``bad_length`` (payload is not exactly ``count`` elements; an empty one for BLOB).
    """
    view = memoryview(datagram)
    if len(view) < HEADER_SIZE:
        raise ProtocolError(TRUNCATED, f"{len(view)} bytes, the header needs {HEADER_SIZE}")
    hdr = Header._make(HEADER.unpack_from(view))
    if hdr.version != VERSION:
        raise ProtocolError(BAD_VERSION, f"version {hdr.version}, expected {VERSION}")
    blob = hdr.format == Format.BLOB
    size = ELEMENT_SIZE.get(hdr.format)  # type: ignore[call-overload]
    if size is None and not blob:
        raise ProtocolError(BAD_FORMAT, f"payload format {hdr.format}")
    if hdr.count == 0:
        raise ProtocolError(BAD_COUNT, "zero elements")
    end = len(view) - TAG_SIZE if hdr.flags & FLAG_TAG else len(view)
    payload = view[HEADER_SIZE:end]  # empty if a tagged datagram is too short for its tag
    if blob:
        if not len(payload):
            raise ProtocolError(BAD_LENGTH, "empty blob payload")
    elif len(payload) != hdr.count * size:
        raise ProtocolError(
            BAD_LENGTH, f"{len(payload)} payload bytes for {hdr.count} elements of {size} bytes"
        )
    return hdr, payload


def pack_chunks(
    codes: np.ndarray,
    *,
    k: int,
    job: int,
    rank: int,
    emin: int,
    slots: np.ndarray,
    pools: np.ndarray,
    offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack a whole NC8-coded tensor into uplink datagrams at once.

    Returns ``(frames, lengths)``: ``frames`` is a ``(chunks, 16 + k)`` uint8 array whose row ``i``
    is the datagram of chunk ``i`` (elements ``i*k`` up to ``i*k + k``) padded to the row width,
    ``lengths[i]`` its real length (the last chunk may be short). ``slots``, ``pools`` and
    ``offsets`` give each chunk's slot, pool version and ``offset`` field (in INA mode the slot's
    running element counter, docs/protocol.md). Setting the RETX flag later is a write to
    column 1.
    """
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    n = codes.size
    chunks = -(-n // k)
    if slots.shape != (chunks,) or pools.shape != (chunks,) or offsets.shape != (chunks,):
        raise ValueError(f"slots, pools and offsets must have one entry per chunk ({chunks})")
    frames = np.zeros((chunks, HEADER_SIZE + k), dtype=np.uint8)
    whole, rest = divmod(n, k)
    counts = np.full(chunks, k, dtype=np.int64)
    if rest:
        counts[-1] = rest
    _fill_headers(frames, Format.NC8, emin, job, rank, slots, pools, counts, offsets)
    body = frames[:, HEADER_SIZE:]
    body[:whole] = codes[: whole * k].reshape(whole, k)
    if rest:
        body[whole, :rest] = codes[whole * k :]
    return frames, HEADER_SIZE + counts


def pack_blobs(
    payloads: list[bytes],
    *,
    counts: np.ndarray,
    offsets: np.ndarray,
    job: int,
    rank: int,
    emin: int,
    slots: np.ndarray,
    pools: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack server mode's uplink datagrams: one BLOB per chunk, ``payloads[i]`` standing for
    ``counts[i]`` elements at ``offsets[i]``.

    Returns ``(frames, lengths)`` as :func:`pack_chunks` does: row ``i`` is chunk ``i``'s datagram
    padded to the longest one, ``lengths[i]`` its real length.
    """
    chunks = len(payloads)
    if not chunks or any(not p for p in payloads):
        raise ValueError("every blob chunk needs a non-empty payload")
    sizes = np.array([len(p) for p in payloads], dtype=np.int64)
    frames = np.zeros((chunks, HEADER_SIZE + int(sizes.max())), dtype=np.uint8)
    _fill_headers(frames, Format.BLOB, emin, job, rank, slots, pools, counts, offsets)
    for row, payload in zip(frames, payloads, strict=True):
        row[HEADER_SIZE : HEADER_SIZE + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    return frames, HEADER_SIZE + sizes


def _fill_headers(
    frames: np.ndarray,
    fmt: Format,
    emin: int,
    job: int,
    rank: int,
    slots: np.ndarray,
    pools: np.ndarray,
    counts: np.ndarray,
    offsets: np.ndarray,
) -> None:
    """Write the uplink header of every chunk into the first 16 bytes of its row of ``frames``."""
    chunks = frames.shape[0]
    for name, column in (("slots", slots), ("pools", pools), ("counts", counts),
                         ("offsets", offsets)):  # fmt: skip
        if np.shape(column) != (chunks,):
            raise ValueError(f"{name} must have one entry per chunk ({chunks})")
    hdr = frames[:, :HEADER_SIZE].view(HEADER_DTYPE)[:, 0]
    hdr["version"] = VERSION
    hdr["flags"] = np.where(pools != 0, FLAG_POOL, 0)
    hdr["format"] = fmt
    hdr["emin"] = emin
    hdr["job"] = job
    hdr["rank"] = rank
    hdr["slot"] = slots
    hdr["count"] = counts
    hdr["offset"] = offsets
