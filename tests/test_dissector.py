"""The Wireshark dissector (tools/wireshark/ncina.lua) against scapy's decode of the same packets.

Two pcaps, each run through ``tshark -X lua_script:...``: the conformance corpus with the
Python reference's replies to it (every payload format, every header field at its edges,
truncated and malformed datagrams, hellos and all three handshake answers, int and nc8
results, notices) plus a keyed job's tagged datagrams and a server-mode job's blobs, built
in-process; and a real exchange on loopback (a keyed allreduce through the socket aggregator),
captured with scapy's sniffer (root only). Every field tshark shows must equal what
``expected`` derives from scapy's layer and ``ncina.proto``'s decoders, field by field, lane by
lane, including the drop reason an aggregator would count. Needs ``tshark`` (``make setup``
installs it); tests/test_topo_mininet.py decodes a ``ncina topo --pcaps`` capture the same way.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.slots import Aggregator
from ncina.proto import corpus
from ncina.proto.compressors import create
from ncina.proto.compressors.base import HEAD, State
from ncina.proto.descriptor import (
    DESCRIPTOR,
    Descriptor,
    job_datagram_length,
    pack_job_datagram,
)
from ncina.proto.header import (
    FLAG_POOL,
    FLAG_RESULT,
    FLAG_RETX,
    FLAG_TAG,
    GENERATION_MASK,
    GENERATION_SHIFT,
    HEADER_SIZE,
    INT_DTYPE,
    NOTICE,
    PORT,
    TAG_SIZE,
    Format,
    ProtocolError,
    parse,
)
from ncina.proto.layers import NcinaHeader
from ncina.proto.tag import sign
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw
from scapy.utils import wrpcap

DISSECTOR = Path(__file__).resolve().parents[1] / "tools" / "wireshark" / "ncina.lua"
TSHARK = shutil.which("tshark")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(TSHARK is None, reason="tshark is not installed (make setup installs it)"),
]

HEADER_FIELDS = ("version", "flags", "format", "emin", "job", "rank", "slot", "count", "offset")
FLAG_BITS = {"result": FLAG_RESULT, "retx": FLAG_RETX, "pool": FLAG_POOL, "tag": FLAG_TAG}
DESCRIPTOR_FIELDS = ("status", "mode", "e_max", "e_min", "workers", "pool_size", "k", "keyed",
                     "reserved", "compressor")  # fmt: skip
# Every field the dissector has, as tshark names them: what each frame's line holds.
FIELDS = (
    *(f"ncina.{name}" for name in HEADER_FIELDS),
    *(f"ncina.flags.{name}" for name in (*FLAG_BITS, "generation")),
    "ncina.kind", "ncina.drop", "ncina.code", "ncina.code.sign", "ncina.code.exponent",
    "ncina.sum", "ncina.value", "ncina.blob.method", "ncina.blob.count", "ncina.bitmap",
    "ncina.bitmap.rank", *(f"ncina.descriptor.{name}" for name in DESCRIPTOR_FIELDS), "ncina.tag",
    "ncina.segments",
)  # fmt: skip
KEY = bytes(range(16))
WORKER_ADDRESS = "10.0.0.1"
AGGREGATOR_ADDRESS = "10.0.1.1"


# ---- what scapy and ncina.proto say a datagram holds ----


def kind(datagram: bytes, to_aggregator: bool) -> tuple[str | None, str | None]:
    """``(kind, drop reason)`` of a datagram as docs/protocol.md defines them, from the header
    alone: ``parse``'s drop reasons, the handshake's length and count rules (and ``bad_flags``
    for a hello with RESULT), a notice's length."""
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
    if result and header.count == 0 and header.format <= Format.BLOB:
        size = HEADER_SIZE + NOTICE.size + (TAG_SIZE if header.flags & FLAG_TAG else 0)
        return "notice", None if len(datagram) == size else "bad_length"
    return ("result" if result else "chunk"), reason


def expected(datagram: bytes, to_aggregator: bool) -> dict[str, list[str]]:
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
    payload = bytes(header.payload)[: -TAG_SIZE if tagged else None]
    if drop is not None:
        return out
    emin = int(header.emin)
    if what in ("hello", "handshake answer"):
        values = DESCRIPTOR.unpack(payload)
        for name, value in zip(DESCRIPTOR_FIELDS, values, strict=True):
            text = f"0x{value:08x}" if name == "compressor" else str(value)
            out[f"ncina.descriptor.{name}"] = [text]
    elif what == "notice":
        (bitmap,) = NOTICE.unpack(payload)
        out["ncina.bitmap"] = [f"0x{bitmap:016x}"]
        out["ncina.bitmap.rank"] = [str(r) for r in range(64) if bitmap >> r & 1]
    elif header.format == Format.NC8:
        out["ncina.code"] = [f"0x{c:02x}" for c in payload]
        out["ncina.code.sign"] = [str(c >> 7) for c in payload]
        out["ncina.code.exponent"] = [str(c & 0x7F) for c in payload]
        out["ncina.value"] = [repr(0.0 if c & 0x7F == 0 else (-1.0 if c & 0x80 else 1.0)
                                   * 2.0 ** (emin + (c & 0x7F) - 1)) for c in payload]  # fmt: skip
    elif header.format == Format.INT:
        sums = np.frombuffer(payload, dtype=INT_DTYPE).tolist()
        out["ncina.sum"] = [str(s) for s in sums]
        out["ncina.value"] = [repr(s * 2.0**emin) for s in sums]
    elif len(payload) >= HEAD.size:
        method, count = HEAD.unpack_from(payload)
        out["ncina.blob.method"], out["ncina.blob.count"] = [str(method)], [str(count)]
    return out


def fixed_length(datagram: bytes) -> int | None:
    """The length docs/protocol.md fixes for a datagram of this header (a job datagram, a notice,
    ``count`` nc8 or int elements, plus the tag); None for a blob or an unreadable header."""
    if len(datagram) < HEADER_SIZE or datagram[0] != 1:
        return None
    header = NcinaHeader(datagram[:HEADER_SIZE])
    tag = TAG_SIZE if header.flags & FLAG_TAG else 0
    if header.format == Format.JOB:
        return job_datagram_length(header.flags)
    if header.flags & FLAG_RESULT and header.count == 0 and header.format <= Format.BLOB:
        return HEADER_SIZE + NOTICE.size + tag
    size = {Format.NC8: 1, Format.INT: INT_DTYPE.itemsize}.get(header.format)
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


def expected_frame(payload: bytes, to_aggregator: bool) -> dict[str, list[str]]:
    """``expected`` of each datagram of a UDP payload, their occurrences in order."""
    pieces = segments(payload)
    out: dict[str, list[str]] = {name: [] for name in FIELDS}
    for piece in pieces:
        for name, values in expected(piece, to_aggregator).items():
            out[name] += values
    if len(pieces) > 1:
        out["ncina.segments"] = [str(len(pieces))]
    return out


# ---- pcaps and tshark ----


def frame(datagram: bytes, source: tuple[str, int], destination: tuple[str, int]) -> Packet:
    return (Ether() / IP(src=source[0], dst=destination[0])
            / UDP(sport=source[1], dport=destination[1]) / Raw(datagram))  # fmt: skip


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


def dissect(pcap: Path, port: int = PORT, home: Path | None = None) -> list[dict[str, list[str]]]:
    """Every frame of ``pcap`` as the dissector decodes it, with the aggregators on UDP
    ``port`` (the dissector's preference): field name to its occurrences."""
    argv = ["-r", str(pcap), "-o", f"ncina.port:{port}", "-T", "fields",
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


def check_pcap(pcap: Path, datagrams: Sequence[tuple[bytes, bool]], port: int = PORT) -> None:
    """Every frame of ``pcap`` decodes to what ``expected`` says of the matching datagram
    (``True``: sent to the aggregator)."""
    frames = dissect(pcap, port)
    assert len(frames) == len(datagrams)
    for number, (got, (datagram, uplink)) in enumerate(zip(frames, datagrams, strict=True), 1):
        wrong = list(differences(got, expected_frame(datagram, uplink)))
        assert not wrong, f"frame {number} ({datagram[:24].hex()}...): {wrong}"


# ---- the corpus and the reference's replies ----


def reference_exchange() -> Iterator[tuple[bytes, tuple[str, int], tuple[str, int]]]:
    """``(datagram, source, destination)``: the corpus sent to two reference aggregators (int
    and nc8 results) with their replies, then a keyed job (tagged chunks, results, a notice and
    handshakes) and a server-mode job (blobs both ways)."""
    aggregator = (AGGREGATOR_ADDRESS, PORT)
    ranks = {r: (WORKER_ADDRESS, 40000 + r) for r in range(corpus.WORKERS)}
    ranks[corpus.STRANGER] = (WORKER_ADDRESS, 39999)
    for result in corpus.RESULTS:
        agg = Aggregator(generation=corpus.GENERATION)
        agg.add_job(JobConfig.create(job=corpus.JOB, workers=corpus.WORKERS, k=corpus.K,
                                     result_format=result, pool_size=corpus.POOL,
                                     window_max=corpus.E_MAX, seed=corpus.SEED))  # fmt: skip
        for case in corpus.generate():
            for step in case.steps:
                yield step.datagram, ranks[step.sender], aggregator
                for reply, destination in agg.handle(step.datagram, ranks[step.sender]):
                    yield reply, aggregator, destination

    agg = Aggregator(generation=3)
    config = JobConfig.create(job=7, workers=2, k=8, result_format="nc8", key=KEY, seed=2)
    agg.add_job(config)
    mine = Descriptor(mode=int(Format.NC8), workers=2, pool_size=config.pool_size, k=8,
                      e_max=config.window.e_max, e_min=config.window.e_min, keyed=True,
                      compressor=0)  # fmt: skip
    emin = config.window.e_min
    hello = pack_job_datagram(mine, job=7, rank=1, key=KEY)
    chunk = [sign(KEY, bytes(NcinaHeader(flags=FLAG_TAG | FLAG_POOL, emin=emin, job=7, rank=r,
                                         slot=3, count=8, offset=3) / Raw(bytes([r + 1] * 8))))
             for r in range(2)]  # fmt: skip
    retx = chunk[0][:1] + bytes([chunk[0][1] | FLAG_RETX]) + chunk[0][2:-TAG_SIZE]
    for datagram, rank in ((hello, 1), (hello[:-TAG_SIZE], 1), (chunk[0], 0),
                           (sign(KEY, retx), 0), (chunk[1], 1)):  # fmt: skip
        yield datagram, ranks[rank], aggregator
        for reply, destination in agg.handle(datagram, ranks[rank]):
            yield reply, aggregator, destination

    server = create("topk:ratio=0.5")
    agg = Aggregator(generation=1)
    agg.add_job(JobConfig.create(job=9, workers=2, k=16, result_format="nc8"), server)
    rng = np.random.default_rng(3)
    for r in range(2):
        blob = server.compress(rng.standard_normal(16).astype(np.float32), State(rng))
        datagram = bytes(NcinaHeader(format=Format.BLOB, emin=0, job=9, rank=r, slot=0, count=16,
                                     offset=0) / Raw(blob))  # fmt: skip
        yield datagram, ranks[r], aggregator
        for reply, destination in agg.handle(datagram, ranks[r]):
            yield reply, aggregator, destination


def test_every_corpus_datagram_and_reply_decodes_as_scapy_does(tmp_path: Path) -> None:
    exchange = list(reference_exchange())
    pcap = tmp_path / "corpus.pcap"
    wrpcap(str(pcap), [frame(*packet) for packet in exchange])
    datagrams = [(d, destination[1] == PORT) for d, _, destination in exchange]
    # The pcap holds every kind the dissector knows, so the comparison covers each.
    kinds = {kind(d, up) for d, up in datagrams}
    for wanted in [("chunk", None), ("result", None), ("notice", None), ("hello", None),
                   ("handshake answer", None), (None, "truncated"), (None, "bad_version"),
                   ("chunk", "bad_format"), ("chunk", "bad_count"), ("chunk", "bad_length"),
                   ("handshake answer", "bad_flags"), ("hello", "bad_length")]:  # fmt: skip
        assert wanted in kinds
    formats = {(d[2], d[1] & FLAG_RESULT, d[1] & FLAG_TAG) for d, _ in datagrams if len(d) > 2}
    assert {(Format.INT, 1, 0), (Format.NC8, 1, FLAG_TAG), (Format.BLOB, 1, 0)} <= formats
    answers = [d for d, _ in datagrams if kind(d, False) == ("handshake answer", None)]
    assert {d[HEADER_SIZE] for d in answers} == {0, 1, 2}  # every status
    check_pcap(pcap, datagrams)


def test_the_dissector_is_registered_on_port_47000_and_for_decode_as(tmp_path: Path) -> None:
    """A datagram on another port is plain UDP until ``-d udp.port==P,ncina`` (Decode As)."""
    datagram = corpus.datagram(slot=1, codes=[0x81, 0x02, 0])
    pcap = tmp_path / "other_port.pcap"
    wrpcap(str(pcap), [frame(datagram, (WORKER_ADDRESS, 40000), (AGGREGATOR_ADDRESS, 9999))])
    assert dissect(pcap)[0]["ncina.kind"] == []
    done = tshark(["-r", str(pcap), "-d", "udp.port==9999,ncina", "-T", "fields", "-e",
                   "ncina.code"])  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["0x81,0x02,0x00"], done.stderr


def test_make_dissector_installs_it_where_tshark_finds_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    done = subprocess.run(["make", "-s", "-C", str(DISSECTOR.parents[2]), "dissector",
                           f"HOME={home}"], capture_output=True, text=True, check=True,
                          timeout=60)  # fmt: skip
    installed = home / ".local" / "lib" / "wireshark" / "plugins" / "ncina.lua"
    assert done.stdout.startswith(f"installed {installed}:")
    assert installed.read_bytes() == DISSECTOR.read_bytes()
    pcap = tmp_path / "hello.pcap"
    hello = pack_job_datagram(Descriptor(0, 4, 64, 256, 10, -50, False, 0), job=3, rank=1)
    wrpcap(str(pcap), [frame(hello, (WORKER_ADDRESS, 40000), (AGGREGATOR_ADDRESS, PORT))])
    [decoded] = dissect(pcap, home=home)  # no -X lua_script: the installed plugin
    assert decoded == expected_frame(hello, True)


# ---- a real exchange on loopback ----


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="capturing on loopback needs root")
def test_a_captured_keyed_allreduce_decodes_as_scapy_does(tmp_path: Path) -> None:
    """Two workers all-reduce through the socket backend with a key: hellos, answers, tagged
    chunks and results, captured on ``lo`` by scapy's sniffer."""
    from ncina.worker.client import AllreduceClient
    from ncina_testlib import start_aggregator
    from scapy.arch.linux import L2Socket
    from scapy.sendrecv import AsyncSniffer

    key_file = tmp_path / "job.key"
    key_file.write_text(KEY.hex())
    agg = start_aggregator("socket", tmp_path, job=5, workers=2, k=64, result="int",
                           extra=["--key-file", str(key_file), "--seed", "1"])  # fmt: skip
    port = agg.address[1]
    # A datagram to this port on loopback ends the capture: everything before it was seen.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sentinel:
        sentinel.bind(("127.0.0.1", 0))
        end = sentinel.getsockname()[1]
        started = threading.Event()

        def ours(p: Any) -> bool:
            return UDP in p and port in (p[UDP].sport, p[UDP].dport)

        def last(p: Any) -> bool:
            return UDP in p and p[UDP].dport == end

        # scapy's L2Socket (not its listen socket) skips the frames loopback shows a second
        # time, as they leave (PACKET_OUTGOING): each datagram is captured once.
        sniffer = AsyncSniffer(iface="lo", L2socket=L2Socket, lfilter=lambda p: ours(p) or last(p),
                               stop_filter=last, started_callback=started.set)
        sniffer.start()
        try:
            assert started.wait(10)
            data = [np.arange(300, dtype=np.float32) * (r + 1) for r in range(2)]
            results: list[np.ndarray] = [np.empty(0)] * 2

            def worker(rank: int) -> None:
                with AllreduceClient(agg.address, job=5, rank=rank, workers=2, k=64,
                                     result_format="int", key=KEY, seed=rank) as client:
                    results[rank] = client.allreduce(data[rank])

            threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            sentinel.sendto(b"end", ("127.0.0.1", end))
            sniffer.join(30)
        finally:
            if sniffer.running:
                sniffer.stop()
            assert agg.stop() == 0, agg.log()
    packets = [p for p in sniffer.results if ours(p)]
    pcap = tmp_path / "allreduce.pcap"
    wrpcap(str(pcap), packets)
    datagrams = [(bytes(p[UDP].payload), p[UDP].dport == port) for p in packets]
    seen = {kind(d, up) for payload, up in datagrams for d in segments(payload)}
    assert {("hello", None), ("handshake answer", None), ("chunk", None), ("result", None)} <= seen
    assert all(d[1] & FLAG_TAG for payload, _ in datagrams for d in segments(payload))
    hellos = [d for d, up in datagrams if kind(d, up) == ("hello", None)]
    answers = [d for d, up in datagrams if kind(d, up) == ("handshake answer", None)]
    assert {d[6:8] for d in hellos} == {b"\0\0", b"\0\1"} and len(answers) == len(hellos)
    assert [len(r) for r in results] == [300, 300]
    check_pcap(pcap, datagrams, port)  # the aggregator's port is not 47000 here
