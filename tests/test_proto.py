"""The wire format: scapy layer and fast packer agree byte for byte, and parse() validates."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from ncina.proto import PORT, ProtocolError, pack, parse
from ncina.proto.header import (
    ELEMENT_SIZE,
    FLAG_POOL,
    FLAG_RESULT,
    FLAG_RETX,
    HEADER_DTYPE,
    Format,
    flags_for,
    largest_k,
    pack_chunks,
)
from ncina.proto.layers import NcinaHeader
from ncina.proto.wire import HEADER_SIZE, IPV4_UDP_HEADERS, TAG_SIZE
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw, raw

FIELDS = {
    "flags": FLAG_POOL | FLAG_RETX,
    "format": Format.INT,
    "emin": -50,
    "job": 0xBEEF,
    "rank": 513,
    "slot": 0x1234,
    "count": 3,
    "offset": 0xDEADBEEF,
}


def test_header_layout_is_the_documented_one() -> None:
    """Offsets and sizes of docs/protocol.md, on a packet with a distinct value per field."""
    plain = {k: v for k, v in FIELDS.items() if k not in ("format", "flags")}
    b = pack(**plain, flags=FIELDS["flags"], fmt=FIELDS["format"])
    assert HEADER_SIZE == 16 and len(b) == 16
    assert b == bytes(
        [1, 0x06, 1, 0xCE, 0xBE, 0xEF, 0x02, 0x01, 0x12, 0x34, 0x00, 0x03, 0xDE, 0xAD, 0xBE, 0xEF]
    )


def test_scapy_and_fast_packer_agree_byte_for_byte() -> None:
    payload = struct.pack(">3q", 5, -7, 1 << 62)
    plain = {k: v for k, v in FIELDS.items() if k not in ("format", "flags")}
    fast = pack(**plain, flags=FIELDS["flags"], fmt=Format.INT, payload=payload)
    layer = NcinaHeader(**FIELDS) / Raw(payload)
    assert raw(layer) == fast


@pytest.mark.parametrize("field,value", [
    ("version", 1), ("flags", FLAG_RESULT), ("flags", FLAG_RETX), ("flags", FLAG_POOL),
    ("flags", 0x07), ("format", 0), ("format", 1), ("emin", -126), ("emin", 63), ("job", 0),
    ("job", 0xFFFF), ("rank", 0xFFFF), ("slot", 0xFFFF), ("count", 1), ("count", 1024),
    ("offset", 0), ("offset", 0xFFFFFFFF),
])
def test_scapy_round_trip_of_every_field(field: str, value: int) -> None:
    """Build with scapy, dissect from bytes through Ether/IP/UDP, compare with parse()."""
    hdr = NcinaHeader(**{**FIELDS, "count": 1, "format": 0, field: value})
    body = b"\x01" * hdr.count * (8 if hdr.format == Format.INT else 1)
    pkt = Ether() / IP(dst="10.0.0.1") / UDP(sport=40000, dport=PORT) / hdr / Raw(body)
    back = Ether(raw(pkt))
    assert NcinaHeader in back
    assert int(back[NcinaHeader].getfieldval(field)) == value
    assert back[Raw].load == body
    parsed, payload = parse(raw(back[NcinaHeader]))
    assert getattr(parsed, field) == value
    assert bytes(payload) == body


def test_results_from_the_port_dissect_too() -> None:
    pkt = UDP(sport=PORT, dport=40000) / NcinaHeader(flags="RESULT", count=1) / Raw(b"\x00")
    assert NcinaHeader in UDP(raw(pkt))


def test_flags_for() -> None:
    assert flags_for(0) == 0
    assert flags_for(1) == FLAG_POOL
    assert flags_for(1, result=True, retx=True) == 0x07
    hdr, _ = parse(pack(job=1, rank=0, slot=0, offset=0, count=1, emin=0,
                        flags=flags_for(1, retx=True), payload=b"\x00"))
    assert hdr.pool == 1 and hdr.is_retx and not hdr.is_result


def good(**kw: int) -> bytes:
    base = {"job": 1, "rank": 0, "slot": 0, "offset": 0, "count": 2, "emin": -50}
    base.update(kw)
    return pack(**base, payload=b"\x01\x02")


@pytest.mark.parametrize("datagram,reason", [
    (b"", "truncated"),
    (good()[:15], "truncated"),
    (b"\x02" + good()[1:], "bad_version"),
    (good()[:1] + b"\x80" + good()[2:], "bad_length"),  # TAG set: the last 8 bytes are no payload
    (good()[:2] + b"\x07" + good()[3:], "bad_format"),
    (good(count=0)[:-2], "bad_count"),
    (good()[:-1], "bad_length"),
    (good() + b"\x00", "bad_length"),
    (good()[:2] + b"\x01" + good()[3:], "bad_length"),  # int format needs 8 bytes per element
])
def test_parse_rejects_with_the_counter_name(datagram: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as err:
        parse(datagram)
    assert err.value.reason == reason


def test_pack_chunks_matches_pack_per_chunk() -> None:
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, size=1000, dtype=np.uint8)
    k = 256
    slots = np.array([5, 6, 7, 0])
    pools = np.array([1, 0, 1, 1])
    offsets = np.array([4096, 70, 2**32 - 1, 0])  # any 32-bit values (docs/protocol.md)
    frames, lengths = pack_chunks(codes, k=k, job=9, rank=3, emin=-40, slots=slots, pools=pools,
                                  offsets=offsets)
    assert frames.shape == (4, HEADER_SIZE + k)
    assert list(lengths) == [272, 272, 272, HEADER_SIZE + 1000 - 3 * k]
    for i in range(4):
        n = lengths[i] - HEADER_SIZE
        expect = pack(job=9, rank=3, slot=int(slots[i]), offset=int(offsets[i]), count=int(n),
                      emin=-40, flags=flags_for(int(pools[i])),
                      payload=codes[i * k : i * k + n].tobytes())
        assert frames[i, : lengths[i]].tobytes() == expect
        assert raw(NcinaHeader(expect)) == expect


def test_pack_chunks_exact_multiple_and_empty() -> None:
    frames, lengths = pack_chunks(np.arange(8, dtype=np.uint8), k=4, job=1, rank=0, emin=0,
                                  slots=np.zeros(2, int), pools=np.zeros(2, int),
                                  offsets=np.zeros(2, int))
    assert list(lengths) == [20, 20]
    assert frames[1, HEADER_SIZE:].tolist() == [4, 5, 6, 7]
    frames, lengths = pack_chunks(np.zeros(0, np.uint8), k=4, job=1, rank=0, emin=0,
                                  slots=np.zeros(0, int), pools=np.zeros(0, int),
                                  offsets=np.zeros(0, int))
    assert frames.shape == (0, 20) and lengths.size == 0
    with pytest.raises(ValueError, match="one entry per chunk"):
        pack_chunks(np.zeros(5, np.uint8), k=4, job=1, rank=0, emin=0,
                    slots=np.zeros(1, int), pools=np.zeros(2, int), offsets=np.zeros(2, int))


def test_header_dtype_reads_what_struct_wrote() -> None:
    b = pack(job=0xBEEF, rank=513, slot=0x1234, offset=0xDEADBEEF, count=3, emin=-50,
             flags=FLAG_POOL, fmt=Format.INT)
    rec = np.frombuffer(b, dtype=HEADER_DTYPE)[0]
    assert (rec["job"], rec["rank"], rec["slot"], rec["count"], rec["offset"], rec["emin"]) == (
        0xBEEF, 513, 0x1234, 3, 0xDEADBEEF, -50)


@pytest.mark.parametrize(
    ("mtu", "fmt", "tagged", "k"),
    [
        (1500, Format.NC8, False, 1456),
        (1500, Format.INT, False, 182),
        (1500, Format.NC8, True, 1448),
        (9000, Format.NC8, False, 8956),
        (9000, Format.INT, True, 1118),
        (1500, Format.INT32, False, 364),
        (9000, Format.INT32, True, 2237),
        (44, Format.NC8, False, 0),
    ],
)
def test_largest_k_fills_the_mtu_both_ways(mtu: int, fmt: Format, tagged: bool, k: int) -> None:
    assert largest_k(mtu, fmt, tagged) == k
    size = ELEMENT_SIZE[fmt]
    tag = TAG_SIZE if tagged else 0
    assert IPV4_UDP_HEADERS + HEADER_SIZE + k * size + tag <= mtu  # the result fits
    assert IPV4_UDP_HEADERS + HEADER_SIZE + (k + 1) * size + tag > mtu  # one more does not
