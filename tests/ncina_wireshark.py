"""Helpers for the Wireshark dissector's tests: tshark with tools/wireshark/ncina.lua, and what
scapy's layer and ``ncina.proto`` say each field of a datagram must be.

``check_pcap`` (frames and the datagrams they carry) and ``check_capture`` (a capture on the
aggregator's port, read with scapy) compare the dissector's decode of every frame with
``expected_frame``: header fields, flag bits, the kind and the drop reason an aggregator would
count, every lane, the descriptor, the notice's bitmap, the tag and, given the job's key, whether
the dissector's BLAKE2b finds it valid as ``ncina.proto.tag.verify`` does. Used by
tests/test_dissector.py and tests/test_topo_mininet.py (``ncina topo --pcaps``).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from ncina.proto.compressors.base import HEAD
from ncina.proto.descriptor import DESCRIPTOR, job_datagram_length
from ncina.proto.header import (
    ELEMENT_SIZE,
    FLAG_POOL,
    FLAG_RESULT,
    FLAG_RETX,
    FLAG_TAG,
    GENERATION_MASK,
    GENERATION_SHIFT,
    NOTICE,
    PORT,
    SUM_DTYPES,
    VERSION,
    Format,
    ProtocolError,
    parse,
)
from ncina.proto.layers import NcinaHeader
from ncina.proto.tag import verify
from ncina.proto.wire import HEADER_SIZE, TAG_SIZE

NOTICE_FORMATS = (*ELEMENT_SIZE, Format.BLOB)
"""The formats a notice may name (the job's result format): an unknown one makes no notice."""
DISSECTOR = Path(__file__).resolve().parents[1] / "tools" / "wireshark" / "ncina.lua"
TSHARK = shutil.which("tshark")

HEADER_FIELDS = ("version", "flags", "format", "emin", "job", "rank", "slot", "count", "offset")
FLAG_BITS = {"result": FLAG_RESULT, "retx": FLAG_RETX, "pool": FLAG_POOL, "tag": FLAG_TAG}
DESCRIPTOR_FIELDS = ("status", "mode", "e_max", "e_min", "workers", "pool_size", "k", "keyed",
                     "uplink", "compressor", "rounding")  # fmt: skip
# Every field the dissector has, as tshark names them: what each frame's line holds.
FIELDS = (
    *(f"ncina.{name}" for name in HEADER_FIELDS),
    *(f"ncina.flags.{name}" for name in (*FLAG_BITS, "generation")),
    "ncina.kind", "ncina.drop", "ncina.code", "ncina.code.sign", "ncina.code.exponent",
    "ncina.sum", "ncina.value", "ncina.blob.method", "ncina.blob.count", "ncina.bitmap",
    "ncina.bitmap.rank", *(f"ncina.descriptor.{name}" for name in DESCRIPTOR_FIELDS), "ncina.tag",
    "ncina.segments", "ncina.tag.valid",
)  # fmt: skip


# ---- what scapy and ncina.proto say a datagram holds ----


def kind(datagram: bytes, to_aggregator: bool) -> tuple[str | None, str | None]:
    """``(kind, drop reason)`` of a datagram as docs/protocol.md defines them, from the header
    alone: ``parse``'s drop reasons, the handshake's length and count rules (and ``bad_flags``
    for a hello with RESULT), a notice's length (with its bitmap, or a restart notice's
    without)."""
    try:
        parse(datagram)
        reason = None
    except ProtocolError as exc:
        reason = exc.reason
    if reason in ("truncated", "bad_version"):
        return None, reason
    header = NcinaHeader(datagram)
    result = bool(header.flags & FLAG_RESULT)
    if header.format == Format.JOB:
        if len(datagram) != job_datagram_length(header.flags):
            reason = "bad_length"
        elif header.count != 1:
            reason = "bad_count"
        elif result and to_aggregator:
            reason = "bad_flags"
        else:
            reason = None
        return ("handshake answer" if result else "hello"), reason
    if result and header.count == 0 and header.format in NOTICE_FORMATS:
        restart = HEADER_SIZE + (TAG_SIZE if header.flags & FLAG_TAG else 0)
        return "notice", None if len(datagram) in (restart, restart + NOTICE.size) else "bad_length"
    return ("result" if result else "chunk"), reason


def expected(
    datagram: bytes, to_aggregator: bool, key: bytes | None = None
) -> dict[str, list[str]]:
    """The dissector's fields for ``datagram`` as scapy's layer and ``ncina.proto`` decode it:
    each field's occurrences as text, the way ``tshark -T fields`` prints them."""
    what, drop = kind(datagram, to_aggregator)
    out: dict[str, list[str]] = {name: [] for name in FIELDS}
    if not datagram:  # Wireshark's UDP hands an empty payload to no dissector
        return out
    if drop is not None:
        out["ncina.drop"] = [drop]
    if len(datagram) < HEADER_SIZE:
        return out
    header = NcinaHeader(datagram)
    for name in HEADER_FIELDS:
        value = int(header.getfieldval(name))
        out[f"ncina.{name}"] = [f"0x{value:02x}" if name == "flags" else str(value)]
    flags = int(header.flags)
    for name, bit in FLAG_BITS.items():
        out[f"ncina.flags.{name}"] = [str(int(bool(flags & bit)))]
    out["ncina.flags.pool"] = [str(flags >> 2 & 1)]
    out["ncina.flags.generation"] = [str((flags & GENERATION_MASK) >> GENERATION_SHIFT)]
    if drop == "bad_version":
        return out
    out["ncina.kind"] = [what]
    tagged = flags & FLAG_TAG and len(datagram) - HEADER_SIZE >= TAG_SIZE
    if tagged:
        out["ncina.tag"] = [datagram[-TAG_SIZE:].hex()]
        if key is not None:  # the dissector's verdict with the key preference set
            out["ncina.tag.valid"] = [str(int(verify(key, datagram)))]
    payload = bytes(header.payload)[: -TAG_SIZE if tagged else None]
    if drop is not None:
        return out
    emin = int(header.emin)
    if what in ("hello", "handshake answer"):
        values = DESCRIPTOR.unpack(payload)
        for name, value in zip(DESCRIPTOR_FIELDS, values, strict=True):
            text = f"0x{value:08x}" if name == "compressor" else str(value)
            out[f"ncina.descriptor.{name}"] = [text]
    elif what == "notice" and payload:  # (a restart notice has no bitmap)
        (bitmap,) = NOTICE.unpack(payload)
        out["ncina.bitmap"] = [f"0x{bitmap:016x}"]
        out["ncina.bitmap.rank"] = [str(r) for r in range(64) if bitmap >> r & 1]
    elif header.format == Format.NC8:
        out["ncina.code"] = [f"0x{c:02x}" for c in payload]
        out["ncina.code.sign"] = [str(c >> 7) for c in payload]
        out["ncina.code.exponent"] = [str(c & 0x7F) for c in payload]
        out["ncina.value"] = [repr(0.0 if c & 0x7F == 0 else (-1.0 if c & 0x80 else 1.0)
                                   * 2.0 ** (emin + (c & 0x7F) - 1)) for c in payload]  # fmt: skip
    elif header.format in SUM_DTYPES:  # int, int32
        sums = np.frombuffer(payload, dtype=SUM_DTYPES[header.format]).tolist()
        out["ncina.sum"] = [str(s) for s in sums]
        out["ncina.value"] = [repr(s * 2.0**emin) for s in sums]
    elif len(payload) >= HEAD.size:
        method, count = HEAD.unpack_from(payload)
        out["ncina.blob.method"], out["ncina.blob.count"] = [str(method)], [str(count)]
    return out


def fixed_length(datagram: bytes) -> int | None:
    """The length docs/protocol.md fixes for a datagram of this header (a job datagram, a notice,
    ``count`` nc8 or int elements, plus the tag); None for a blob or an unreadable header."""
    if len(datagram) < HEADER_SIZE or datagram[0] != VERSION:
        return None
    header = NcinaHeader(datagram[:HEADER_SIZE])
    tag = TAG_SIZE if header.flags & FLAG_TAG else 0
    if header.format == Format.JOB:
        return job_datagram_length(header.flags)
    if header.flags & FLAG_RESULT and header.count == 0 and header.format in NOTICE_FORMATS:
        return HEADER_SIZE + NOTICE.size + tag
    size = ELEMENT_SIZE.get(header.format)
    return HEADER_SIZE + header.count * size + tag if size and header.count else None


def segments(payload: bytes) -> list[bytes]:
    """The datagrams of a UDP payload: one, or those of a GSO send seen before segmentation
    (datagrams of the first one's length back to back, the last possibly shorter, each the
    length its header fixes)."""
    first = fixed_length(payload)
    if first is None or first >= len(payload):
        return [payload]
    pieces, start = [], 0
    while start < len(payload):
        length = fixed_length(payload[start:])
        end = start + (length or 0)
        if length is None or end > len(payload) or length > first or (
            length < first and end < len(payload)
        ):
            return [payload]
        pieces.append(payload[start:end])
        start = end
    return pieces


def expected_frame(
    payload: bytes, to_aggregator: bool, key: bytes | None = None
) -> dict[str, list[str]]:
    """``expected`` of each datagram of a UDP payload, their occurrences in order."""
    pieces = segments(payload)
    out: dict[str, list[str]] = {name: [] for name in FIELDS}
    for piece in pieces:
        for name, values in expected(piece, to_aggregator, key).items():
            out[name] += values
    if len(pieces) > 1:
        out["ncina.segments"] = [str(len(pieces))]
    return out


# ---- pcaps and tshark ----



def tshark(arguments: Sequence[str], home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run tshark with ``home`` as its home directory (an empty one by default, where the pcap
    is): no user's preferences and no personally installed dissector (``make dissector``)
    apply, whose second registration would fail. Without ``home`` the dissector is loaded with
    ``-X lua_script:``."""
    if home is None:
        arguments = ["-X", f"lua_script:{DISSECTOR}", *arguments]
        home = Path(arguments[arguments.index("-r") + 1]).parent / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")} | {"HOME": str(home)}
    return subprocess.run([str(TSHARK), *arguments], capture_output=True, text=True, check=False,
                          timeout=60, env=env)  # fmt: skip


def dissect(
    pcap: Path, port: int = PORT, home: Path | None = None, key: bytes | None = None
) -> list[dict[str, list[str]]]:
    """Every frame of ``pcap`` as the dissector decodes it, with the aggregators on UDP
    ``port`` (the dissector's preference): field name to its occurrences."""
    argv = ["-r", str(pcap), "-o", f"ncina.port:{port}", "-o", f"ncina.key:{(key or b'').hex()}",
            "-T", "fields",
            "-E", "occurrence=a", "-E", "aggregator=|", "-E", "separator=/t"]  # fmt: skip
    for name in FIELDS:
        argv += ["-e", name]
    done = tshark(argv, home)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("Running as")]
    assert done.returncode == 0 and not errors, done.stderr
    frames = []
    for line in done.stdout.splitlines():
        columns = line.split("\t")
        assert len(columns) == len(FIELDS), line
        frames.append({name: text.split("|") if text else []
                       for name, text in zip(FIELDS, columns, strict=True)})  # fmt: skip
    return frames


def differences(got: dict[str, list[str]], want: dict[str, list[str]]) -> Iterator[str]:
    for name in FIELDS:
        g, w = got[name], want[name]
        if name == "ncina.value":  # doubles: tshark prints 15 significant digits
            same = len(g) == len(w) and all(
                math.isclose(float(a), float(b), rel_tol=1e-13) for a, b in zip(g, w, strict=True)
            )
        else:
            same = g == w
        if not same:
            yield f"{name}: tshark {g[:8]}, scapy {w[:8]}"


def check_pcap(
    pcap: Path, datagrams: Sequence[tuple[bytes, bool]], port: int = PORT,
    key: bytes | None = None,
) -> None:
    """Every frame of ``pcap`` decodes to what ``expected`` says of the matching datagram
    (``True``: sent to the aggregator), with ``key`` as the dissector's key preference."""
    frames = dissect(pcap, port, key=key)
    assert len(frames) == len(datagrams)
    for number, (got, (datagram, uplink)) in enumerate(zip(frames, datagrams, strict=True), 1):
        wrong = list(differences(got, expected_frame(datagram, uplink, key)))
        assert not wrong, f"frame {number} ({datagram[:24].hex()}...): {wrong}"


def check_capture(
    pcap: Path, port: int = PORT, key: bytes | None = None
) -> list[tuple[bytes, bool]]:
    """``check_pcap`` for a capture of UDP to and from the aggregators' ``port`` (every frame
    must be one); returns each frame's UDP payload and whether it went to the aggregator."""
    from scapy.layers.inet import UDP
    from scapy.utils import rdpcap

    packets = rdpcap(str(pcap))
    assert all(UDP in p and port in (p[UDP].sport, p[UDP].dport) for p in packets)
    datagrams = [(bytes(p[UDP].payload), p[UDP].dport == port) for p in packets]
    check_pcap(pcap, datagrams, port, key)
    return datagrams
