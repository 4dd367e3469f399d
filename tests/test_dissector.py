"""The Wireshark dissector (tools/wireshark/ncina.lua) against scapy's decode of the same packets.

Pcaps run through ``tshark -X lua_script:...`` (tests/ncina_wireshark.py compares every field):
the conformance corpus with the Python reference's replies to it (every payload format, every
header field at its edges, truncated and malformed datagrams, hellos and all three handshake
answers, int, int32 and nc8 results, notices) plus a keyed job's tagged datagrams and a server-mode
job's blobs, built in-process; and a real exchange on loopback (a keyed allreduce through the
socket aggregator, whose UDP GSO sends the capture sees whole), captured with scapy's sniffer
(root only). Needs ``tshark`` (``make setup`` installs it); tests/test_topo_mininet.py checks a
``ncina topo --pcaps`` capture the same way.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.jobs import JobConfig
from ncina.proto import corpus
from ncina.proto.compressors import REGISTRY, create
from ncina.proto.compressors.base import State
from ncina.proto.descriptor import MODE_NAMES, Descriptor, pack_job_datagram
from ncina.proto.header import (
    FLAG_POOL,
    FLAG_RESULT,
    FLAG_RETX,
    FLAG_TAG,
    PORT,
    Format,
)
from ncina.proto.layers import NcinaHeader
from ncina.proto.tag import sign, verify
from ncina.proto.wire import HEADER_SIZE, TAG_SIZE
from ncina_wireshark import (
    DISSECTOR,
    TSHARK,
    check_capture,
    check_pcap,
    dissect,
    expected_frame,
    kind,
    segments,
    tshark,
)
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw
from scapy.utils import rdpcap, wrpcap

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(TSHARK is None, reason="tshark is not installed (make setup installs it)"),
]

KEY = bytes(range(16))
WORKER_ADDRESS = "10.0.0.1"
AGGREGATOR_ADDRESS = "10.0.1.1"


def frame(datagram: bytes, source: tuple[str, int], destination: tuple[str, int]) -> Packet:
    return (Ether() / IP(src=source[0], dst=destination[0])
            / UDP(sport=source[1], dport=destination[1]) / Raw(datagram))  # fmt: skip


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
                                     window_max=corpus.window_max(result),
                                     seed=corpus.SEED))  # fmt: skip
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
    assert {(Format.INT, 1, 0), (Format.INT32, 1, 0), (Format.NC8, 1, FLAG_TAG),
            (Format.BLOB, 1, 0)} <= formats
    answers = [d for d, _ in datagrams if kind(d, False) == ("handshake answer", None)]
    assert {d[HEADER_SIZE] for d in answers} == {0, 1, 2}  # every status
    valid = [d for d, up in datagrams if len(d) > TAG_SIZE and verify(KEY, d)]
    assert {kind(d, up)[0] for d, up in datagrams if d in valid} == {
        "hello", "handshake answer", "chunk", "notice", "result"}
    check_pcap(pcap, datagrams)
    # With the keyed job's key, the dissector verifies every tag as ncina.proto.tag does: the
    # keyed job's datagrams verify, the corpus's tagged ones (another key, or no tag at all
    # but a TAG flag) do not.
    check_pcap(pcap, datagrams, key=KEY)


def test_the_dissector_is_registered_on_port_47000_and_for_decode_as(tmp_path: Path) -> None:
    """A datagram on another port is plain UDP until ``-d udp.port==P,ncina`` (Decode As)."""
    datagram = corpus.datagram(slot=1, codes=[0x81, 0x02, 0])
    pcap = tmp_path / "other_port.pcap"
    wrpcap(str(pcap), [frame(datagram, (WORKER_ADDRESS, 40000), (AGGREGATOR_ADDRESS, 9999))])
    assert dissect(pcap)[0]["ncina.kind"] == []
    done = tshark(["-r", str(pcap), "-d", "udp.port==9999,ncina", "-T", "fields", "-e",
                   "ncina.code"])  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["0x81,0x02,0x00"], done.stderr


def lua_table(name: str) -> dict[int, str]:
    """The ``[number] = "name"`` entries of the dissector's table ``local NAME = {...}``."""
    text = DISSECTOR.read_text()
    body = text[text.index(f"local {name} = {{") :]
    body = body[: body.index("}")]
    return {int(n): v for n, v in re.findall(r'\[(\d+)\] = "([^"]*)"', body)}


def test_the_dissector_names_formats_and_methods_as_ncina_proto_does() -> None:
    assert lua_table("FORMATS") == {f.value: f.name.lower() for f in Format}
    assert lua_table("METHODS") == {cls.tag: name for name, cls in REGISTRY.items()}
    assert lua_table("MODES") == MODE_NAMES


def test_a_gso_frame_shows_each_of_its_datagrams(tmp_path: Path) -> None:
    """Datagrams of one length back to back, the last possibly shorter, are a GSO send seen
    before segmentation; any other concatenation is one malformed datagram."""
    a = corpus.datagram(slot=1, codes=[1] * corpus.K)
    b = corpus.datagram(slot=2, codes=[0x81] * corpus.K, rank=1)
    short = corpus.datagram(slot=3, codes=[2, 3, 4])
    payloads = [a + b, a + b + short, short + a, a + b[:20]]
    assert [len(segments(p)) for p in payloads] == [2, 3, 1, 1]
    pcap = tmp_path / "gso.pcap"
    wrpcap(str(pcap), [frame(p, (WORKER_ADDRESS, 40000), (AGGREGATOR_ADDRESS, PORT))
                       for p in payloads])  # fmt: skip
    check_pcap(pcap, [(p, True) for p in payloads])
    assert [f["ncina.segments"] for f in dissect(pcap)] == [["2"], ["3"], [], []]


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
    chunks and results, captured on ``lo`` by tcpdump (scapy's sniffer closed its socket on a
    GSO batch larger than its buffer and then saw nothing, now and then)."""
    from ncina.worker.client import AllreduceClient
    from ncina_testlib import start_aggregator

    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        pytest.skip("tcpdump is not installed (make setup installs it)")
    key_file = tmp_path / "job.key"
    key_file.write_text(KEY.hex())
    agg = start_aggregator("socket", tmp_path, job=5, workers=2, k=64, result="int",
                           extra=["--key-file", str(key_file), "--seed", "1"])  # fmt: skip
    port = agg.address[1]
    pcap = tmp_path / "allreduce.pcap"
    # A datagram to the sentinel's port ends the capture: once tcpdump wrote it, it wrote every
    # datagram before it.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sentinel:
        sentinel.bind(("127.0.0.1", 0))
        end = sentinel.getsockname()[1]
        dump = subprocess.Popen(
            [tcpdump, "-i", "lo", "-n", "-U", "-w", str(pcap),
             f"udp port {port} or udp port {end}"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            said = ""
            while "listening on" not in said and dump.poll() is None:
                said = dump.stderr.readline() if dump.stderr else ""
            assert dump.poll() is None, f"tcpdump exited: {said}"
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
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                UDP in p and p[UDP].dport == end for p in _read(pcap)
            ):
                time.sleep(0.1)
        finally:
            dump.send_signal(signal.SIGINT)
            dump.wait(10)
            assert agg.stop() == 0, agg.log()
    wrpcap(str(pcap), [p for p in _read(pcap) if UDP in p and port in (p[UDP].sport, p[UDP].dport)])
    assert [len(r) for r in results] == [300, 300]
    datagrams = check_capture(pcap, port, KEY)  # the aggregator's port is not 47000 here
    seen = {kind(d, up) for payload, up in datagrams for d in segments(payload)}
    assert {("hello", None), ("handshake answer", None), ("chunk", None), ("result", None)} <= seen
    assert all(d[1] & FLAG_TAG for payload, _ in datagrams for d in segments(payload))
    hellos = [d for d, up in datagrams if kind(d, up) == ("hello", None)]
    answers = [d for d, up in datagrams if kind(d, up) == ("handshake answer", None)]
    assert {d[6:8] for d in hellos} == {b"\0\0", b"\0\1"} and len(answers) == len(hellos)


def _read(pcap: Path) -> list[Packet]:
    """The packets of ``pcap`` so far (none while tcpdump has not written its header yet)."""
    try:
        return list(rdpcap(str(pcap)))
    except (OSError, EOFError):
        return []
