"""The DPDK data plane's engine offline (no EAL, no network): the C parse/slots/result code fed
frame by frame next to the Python reference (``ncina.aggregator.backends.python.slots``), output
frames and counters compared; plus the frames' own correctness (IPv4 and UDP checksums, ARP
replies).

These need only the DPDK development files (the extension links libdpdk); the packet-level
tests over a veth pair are in test_dpdk_packets.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from collections.abc import Iterator

import pytest
from ncina.aggregator.backends.python.handshake import job_descriptor
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.jobs import JobConfig
from ncina.proto import tag
from ncina.proto.descriptor import pack_job_datagram
from ncina.proto.header import FLAG_TAG
from ncina.proto.layers import NcinaHeader
from ncina_testlib import uplink
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw

binding = pytest.importorskip("ncina.aggregator.backends.dpdk.binding")
_MISSING = binding.missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

AGG_MAC = "02:00:00:00:0a:01"
AGG_IP = "10.77.0.1"
WORKER_MAC = "02:00:00:00:0b:01"
PORT = 47000
STRIDE = 2048


@pytest.fixture
def plane() -> Iterator[object]:
    """The process's engine, emptied; jobs are installed by the test."""
    from ncina.aggregator.backends.dpdk.driver import DataPlane

    dp = DataPlane(binding.load())
    dp.reset()
    dp.set_mac(AGG_MAC)
    dp.set_address((AGG_IP, PORT))
    dp.set_generation(0)
    yield dp
    dp.reset()
    dp.set_generation(0)


Datagrams = list[tuple[bytes, tuple[str, int]]]


def frame(
    datagram: bytes, src: tuple[str, int], *, dst_ip: str = AGG_IP, dport: int = PORT
) -> bytes:
    return bytes(
        Ether(src=WORKER_MAC, dst=AGG_MAC)
        / IP(src=src[0], dst=dst_ip)
        / UDP(sport=src[1], dport=dport)
        / Raw(datagram)
    )


def process(dp: object, raw: bytes) -> list[bytes]:
    """Feed one frame to the C engine; return the frames it sends."""
    ffi, lib = dp.ffi, dp.lib  # type: ignore[attr-defined]
    out = ffi.new(f"uint8_t[{STRIDE * 64}]")
    lens = ffi.new("uint32_t[64]")
    n = lib.ncd_process_frame(raw, len(raw), out, STRIDE, 64, lens)
    assert n >= 0, "output buffer too small"
    buf = ffi.buffer(out)
    return [bytes(buf[i * STRIDE : i * STRIDE + lens[i]]) for i in range(n)]


def as_datagrams(frames: list[bytes]) -> list[tuple[bytes, tuple[str, int]]]:
    """Check each result frame's headers and checksums; return (UDP payload, destination)."""
    out = []
    for raw in frames:
        pkt = Ether(raw)
        assert pkt.src == AGG_MAC and pkt.dst == WORKER_MAC
        ip, udp = pkt[IP], pkt[UDP]
        assert ip.src == AGG_IP and ip.ttl == 64 and ip.flags == "DF" and ip.ihl == 5
        assert udp.sport == PORT
        # Recompute both checksums with scapy and compare with what the C code wrote.
        again = Ether(raw)
        again[IP].chksum = None
        again[UDP].chksum = None
        rebuilt = Ether(bytes(again))
        assert rebuilt[IP].chksum == ip.chksum, "IPv4 header checksum"
        assert rebuilt[UDP].chksum == udp.chksum, "UDP checksum"
        assert udp.len == len(raw) - 34 and ip.len == len(raw) - 14
        out.append((bytes(udp.payload), (ip.dst, udp.dport)))
    return out


def job(**kw: object) -> JobConfig:
    args: dict[str, object] = {"job": 7, "workers": 3, "k": 32, "result_format": "int", "seed": 11}
    args.update(kw)
    return JobConfig.create(**args)  # type: ignore[arg-type]


def counters(dp: object, ref: Aggregator, job_id: int) -> tuple[dict, dict, dict, dict]:
    mine_job = dp.job_stats(job_id).to_json()  # type: ignore[attr-defined]
    mine_global = dp.global_stats().to_json()  # type: ignore[attr-defined]
    ref_job = ref.jobs[job_id].stats.to_json()
    ref_global = ref.stats.to_json()
    return mine_job, ref_job, mine_global, ref_global


def run_both(
    dp: object, configs: list[JobConfig], packets: Datagrams, generation: int = 0
) -> Aggregator:
    """Feed the same datagrams to the C engine and the reference (both at ``generation``);
    assert equal output, in order."""
    ref = Aggregator(generation)
    dp.set_generation(generation)  # type: ignore[attr-defined]
    for c in configs:
        ref.add_job(c)
        dp.add_job(c)  # type: ignore[attr-defined]
    for datagram, src in packets:
        want = list(ref.handle(datagram, src))
        got = as_datagrams(process(dp, frame(datagram, src)))
        assert got == want, f"packet {NcinaHeader(datagram).summary()} from {src}"
    for c in configs:
        mj, rj, mg, rg = counters(dp, ref, c.job)
        assert mj == rj
        assert mg == rg
    return ref


def random_traffic(config: JobConfig, rounds: int, seed: int) -> Datagrams:
    """A SwitchML-like schedule: every rank sends each chunk into slot i mod S with flipping
    versions; shuffled within a round, with duplicates, retransmissions after completion, and
    some malformed packets mixed in."""
    rnd = random.Random(seed)
    top = config.window.span + 1
    n, s, k = config.workers, config.pool_size, config.k
    out: list[tuple[bytes, tuple[str, int]]] = []
    addr = [(f"10.77.1.{r + 1}", 5000 + r) for r in range(n)]
    for chunk in range(rounds):
        slot, pool = chunk % s, (chunk // s) % 2
        count = k if rnd.random() < 0.8 else rnd.randint(1, k)
        round_pkts = []
        for r in range(n):
            codes = bytes(rnd.choice([0, rnd.randint(1, top), 0x80 | rnd.randint(1, top)])
                          for _ in range(count))
            d = uplink(job=config.job, rank=r, slot=slot, offset=chunk * k, codes=codes,
                       emin=config.window.e_min, pool=pool)
            round_pkts.append((d, addr[r]))
            if rnd.random() < 0.2:
                round_pkts.append((d, addr[r]))  # duplicate before completion (or resend after)
        rnd.shuffle(round_pkts)
        out += round_pkts
        for _ in range(rnd.randint(0, 2)):  # lost results: retransmissions with RETX
            r = rnd.randrange(n)
            d = bytearray(rnd.choice([p for p in round_pkts if p[1] == addr[r]])[0])
            d[1] |= 0x02
            out.append((bytes(d), addr[r]))
        if rnd.random() < 0.3:
            bad = bytearray(round_pkts[0][0])
            which = rnd.randrange(6)
            if which == 0:
                bad[0] = 2  # bad_version
            elif which == 1:
                bad = bad[:10]  # truncated
            elif which == 2:
                bad[3] = (bad[3] + 1) & 0xFF  # window_mismatch
            elif which == 3:
                bad[16] = top + 1  # bad_code
            elif which == 4:
                bad[5] ^= 0x55  # unknown job
            else:
                bad = bad[:-1]  # bad_length
            out.append((bytes(bad), addr[0]))
    return out


@pytest.mark.parametrize("fmt", ["int", "nc8"])
def test_parity_random_schedule(plane: object, fmt: str) -> None:
    config = job(result_format=fmt, pool_size=4, workers=4, k=64)
    run_both(plane, [config], random_traffic(config, rounds=40, seed=3))


@pytest.mark.parametrize("keyed", [False, True], ids=["untagged", "keyed"])
@pytest.mark.parametrize("fmt", ["int", "nc8"])
def test_parity_with_generation_notices_and_tags(plane: object, fmt: str, keyed: bool) -> None:
    key = bytes(range(7, 7 + 48)) if keyed else None
    config = job(result_format=fmt, pool_size=4, workers=3, k=16, key=key)
    packets = random_traffic(config, rounds=30, seed=8)
    rnd = random.Random(2)

    def flagged(datagram: bytes, flags: int) -> bytes:
        return bytes([datagram[0], datagram[1] | flags]) + datagram[2:]

    traffic: Datagrams = []
    for datagram, src in packets:
        variants = [datagram]
        if rnd.random() < 0.05:  # a packet of an earlier aggregator start: stale, a notice
            variants.insert(0, flagged(datagram, 9 << 3))
        if key is not None:
            variants = [tag.sign(key, flagged(d, FLAG_TAG)) for d in variants]
            if rnd.random() < 0.05:
                variants.insert(0, tag.sign(bytes(16), flagged(datagram, FLAG_TAG)))  # forged
        traffic += [(d, src) for d in variants]
    ref = run_both(plane, [config], traffic, generation=5)
    stats = ref.jobs[7].stats
    assert stats.notices_sent > 0 and stats.drops["stale_generation"] > 0
    assert (stats.drops["bad_tag"] > 0) == keyed


def test_blake2b_matches_hashlib(plane: object) -> None:
    ffi, lib = plane.ffi, plane.lib  # type: ignore[attr-defined]
    rnd = random.Random(1)
    out = ffi.new("uint8_t[64]")
    for length in [*range(0, 300), 1023, 1024, 1025, 1600]:
        message = rnd.randbytes(length)
        shapes = ((16, 8), (rnd.randint(17, 64), 8), (0, 64), (64, rnd.randint(1, 64)))
        for key_length, digest in shapes:
            key = rnd.randbytes(key_length)
            assert lib.nce_blake2b(out, digest, key, key_length, message, length) == 0
            want = hashlib.blake2b(message, digest_size=digest, key=key).digest()
            assert bytes(ffi.buffer(out, digest)) == want, (length, key_length, digest)


def test_blake2b_refuses_lengths_past_its_buffers(plane: object) -> None:
    # Issue 27, minor: a key past 64 bytes would be copied past the state's block, a digest of
    # 0 or past 64 bytes written past the caller's or the state's words: both refused.
    ffi, lib = plane.ffi, plane.lib  # type: ignore[attr-defined]
    out = ffi.new("uint8_t[80]")
    key = bytes(80)
    for key_length, digest in ((65, 8), (16, 0), (16, 65), (80, 80)):
        assert lib.nce_blake2b(out, digest, key, key_length, b"m", 1) == -1
        assert bytes(ffi.buffer(out)) == bytes(80), (key_length, digest)


def test_parity_two_jobs_and_members(plane: object) -> None:
    a = job(job=1, workers=2, result_format="nc8", seed=5,
            members=[(0, ("10.77.1.1", 5000))])
    b = job(job=2, workers=3, k=8, result_format="int", pool_size=2)
    packets = random_traffic(a, 12, seed=1) + random_traffic(b, 12, seed=2)
    random.Random(9).shuffle(packets)
    # A packet claiming rank 0 of job 1 from another address: non_member.
    packets.append((uplink(job=1, rank=0, slot=0, offset=0, codes=b"\x01",
                           emin=a.window.e_min), ("10.77.9.9", 5000)))
    run_both(plane, [a, b], packets)


def test_malformed_reasons(plane: object) -> None:
    config = job(workers=2, k=4, pool_size=2)
    e = config.window.e_min
    src = ("10.77.1.1", 5000)
    bad = [
        b"\x01" * 5,  # truncated
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=e, version=2),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=e, flags=0x08),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=e, flags=0x01),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=e, format=1, count=0),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01" * 8, emin=e, format=1, count=1),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=e, format=9),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01\x01", emin=e, count=3),
        uplink(job=7, rank=5, slot=0, offset=0, codes=b"\x01", emin=e),
        uplink(job=7, rank=0, slot=2, offset=0, codes=b"\x01", emin=e),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01" * 5, emin=e),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x7f", emin=e),
        uplink(job=8, rank=0, slot=0, offset=0, codes=b"\x01", emin=e),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=e + 1),
        uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=e),
        uplink(job=7, rank=1, slot=0, offset=4, codes=b"\x01", emin=e),  # chunk_mismatch
        uplink(job=7, rank=1, slot=0, offset=0, codes=b"\x01\x01", emin=e),  # chunk_mismatch
    ]
    ref = run_both(plane, [config], [(d, src if i < 15 else ("10.77.1.2", 5001))
                                     for i, d in enumerate(bad)])
    drops = {k: v for k, v in ref.jobs[7].stats.drops.items() if v}
    drops.update({f"global.{k}": v for k, v in ref.stats.drops.items() if v})
    assert drops == {
        "global.truncated": 1, "global.bad_version": 1, "bad_flags": 2, "bad_count": 2,
        "bad_length": 1, "bad_format": 2, "non_member": 1, "bad_slot": 1, "bad_code": 1,
        "global.unknown_job": 1, "window_mismatch": 1, "chunk_mismatch": 2,
    }  # fmt: skip


def test_not_ncina_is_ignored(plane: object) -> None:
    plane.add_job(job())  # type: ignore[attr-defined]
    d = uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=job().window.e_min)
    assert process(plane, frame(d, ("10.77.1.1", 5000), dport=47001)) == []
    assert process(plane, frame(d, ("10.77.1.1", 5000), dst_ip="10.77.0.2")) == []
    assert process(plane, b"\x00" * 10) == []
    stats = plane.job_stats(7)  # type: ignore[attr-defined]
    assert stats.packets_in == 0


@pytest.mark.parametrize("src_mac", ["ff:ff:ff:ff:ff:ff", "01:00:5e:00:00:01", "00:00:00:00:00:00"])
def test_a_frame_from_a_group_or_zero_mac_gets_no_reply(plane: object, src_mac: str) -> None:
    # Issue 27, finding 7: replies go to the frame's Ethernet source; a broadcast or multicast
    # source made a result go to the whole segment. Such frames are ignored (no host sends
    # from one), before the engine sees them: no member learns that MAC.
    config = job(result_format="int")
    plane.add_job(config)  # type: ignore[attr-defined]
    emin = config.window.e_min
    hello = pack_job_datagram(job_descriptor(config), job=7, rank=0)
    d = uplink(job=7, rank=0, slot=0, offset=0, codes=b"\x01", emin=emin)
    for datagram in (hello, d):
        raw = bytes(Ether(src=src_mac, dst=AGG_MAC) / IP(src="10.77.1.1", dst=AGG_IP)
                    / UDP(sport=5000, dport=PORT) / Raw(datagram))  # fmt: skip
        assert process(plane, raw) == []
    assert plane.job_stats(7).packets_in == 0  # type: ignore[attr-defined]
    assert len(process(plane, frame(hello, ("10.77.1.1", 5000)))) == 1  # from a host: answered


def test_arp_reply(plane: object) -> None:
    req = bytes(Ether(src=WORKER_MAC, dst="ff:ff:ff:ff:ff:ff")
                / ARP(op=1, hwsrc=WORKER_MAC, psrc="10.77.1.1", pdst=AGG_IP))
    (reply,) = process(plane, req)
    arp = Ether(reply)[ARP]
    assert arp.op == 2 and arp.hwsrc == AGG_MAC and arp.psrc == AGG_IP
    assert arp.hwdst == WORKER_MAC and arp.pdst == "10.77.1.1"
    other = bytes(Ether(src=WORKER_MAC, dst="ff:ff:ff:ff:ff:ff")
                  / ARP(op=1, hwsrc=WORKER_MAC, psrc="10.77.1.1", pdst="10.77.0.99"))
    assert process(plane, other) == []


# The mbuf data room of the data plane's pool (RTE_MBUF_DEFAULT_DATAROOM): every frame it sends
# is built in one such mbuf, so a job whose result frames are larger must be refused.
MBUF_ROOM = 2048


@pytest.mark.parametrize(
    ("k", "result", "keyed", "largest"),
    [(1024, "int", False, 248), (249, "int", False, 248), (248, "int", True, 247)],
)
def test_a_job_whose_frames_exceed_the_mbuf_is_refused(
    plane: object, k: int, result: str, keyed: bool, largest: int
) -> None:
    """Regression: int results with K >= 249 (or a --mtu above ~2034) made send_all write past
    the 2048-byte mbuf data room. The driver refuses the job, naming the largest K; so does the
    engine itself (a keyed job whose tag would not fit is removed, not left unkeyed)."""
    ffi, lib = plane.ffi, plane.lib  # type: ignore[attr-defined]
    assert lib.ncd_frame_room() == MBUF_ROOM
    key = bytes(range(16)) if keyed else None
    config = job(job=3, k=k, result_format=result, key=key)
    message = f"{MBUF_ROOM}-byte mbuf.*largest k for {result} results is {largest}"
    with pytest.raises(ValueError, match=message):
        plane.add_job(config)  # type: ignore[attr-defined]
    stats = ffi.new("struct nce_counters *")
    assert lib.nce_job_stats(3, stats) == -1  # nothing installed
    fmt = 1 if result == "int" else 0
    window = config.window
    if keyed:
        assert lib.nce_job_add(3, 3, k, 4, window.e_min, window.span, fmt, 0) == 0
        assert lib.nce_job_set_key(3, key, len(key)) == -1
    else:
        assert lib.nce_job_add(3, 3, k, 4, window.e_min, window.span, fmt, 0) == -1
    assert lib.nce_job_stats(3, stats) == -1
    assert re.search(message, ffi.string(lib.nce_error()).decode())
    # The largest K fits, and its full result frame is sent.
    config = job(job=3, k=largest, result_format=result, key=key, workers=1)
    plane.add_job(config)  # type: ignore[attr-defined]
    datagram = uplink(job=3, rank=0, slot=0, offset=0, codes=bytes([1]) * largest,
                      emin=config.window.e_min)  # fmt: skip
    if keyed:
        datagram = tag.sign(key, bytes([datagram[0], datagram[1] | FLAG_TAG]) + datagram[2:])
    (out,) = process(plane, frame(datagram, ("10.77.1.1", 5000)))
    assert MBUF_ROOM - (8 if result == "int" else 1) < len(out) <= MBUF_ROOM


def test_a_spine_whose_leaves_int_frames_exceed_the_mbuf_is_refused(plane: object) -> None:
    """A spine with nc8 results (frames of K bytes) still takes its leaves' int partial sums
    (frames of 8 K bytes): the driver holds it to the int K of the mbuf."""
    ffi, lib = plane.ffi, plane.lib  # type: ignore[attr-defined]
    spine = JobConfig.create(job=3, workers=2, k=249, result_format="nc8", pool_size=4,
                             total_workers=4, uplink_format="int")  # fmt: skip
    message = r"partial sums sent up as int: .*largest k for int results is 248"
    with pytest.raises(ValueError, match=message):
        plane.add_job(spine)  # type: ignore[attr-defined]
    stats = ffi.new("struct nce_counters *")
    assert lib.nce_job_stats(3, stats) == -1  # nothing installed
    plane.add_job(dataclasses.replace(spine, k=248))  # type: ignore[attr-defined]
    assert lib.nce_job_stats(3, stats) == 0
