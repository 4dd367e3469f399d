"""The DPDK backend on the wire: a data plane per test in its own namespace, reached over a veth
pair through a bridge (``ncina.aggregator.dpdk.netns``).

- wire parity: one recorded schedule (duplicates, retransmissions, malformed packets) sent to
  the Python backend (loopback) and to the DPDK backend under one --generation gives the same
  datagrams to every rank, notices included, and the same counters (int results, and nc8 results
  under one --seed: the same key stream); also for a keyed job (tags, forged packets) and with
  packets of a previous generation;
- the aggregator's kernel stays silent (no ICMP port unreachable), ARP is answered by DPDK;
- raw garbage frames are ignored or counted and the process keeps serving; SIGINT exits cleanly.

The scenario suite itself runs on dpdk through test_aggregator_packets.py.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ncina.aggregator.dpdk import binding, netns
from ncina.proto import tag
from ncina.proto.header import FLAG_TAG, GENERATION_MASK, GENERATION_SHIFT
from ncina_testlib import (
    RunningAggregator,
    launch_aggregator,
    start_aggregator,
    uplink,
    window_e_min,
    worker_host,
)

_MISSING = netns.missing() or binding.missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"dpdk backend: {_MISSING}")

K = 8


def schedule(
    job: int, workers: int, rounds: int, pool: int, seed: int, key: bytes | None = None
) -> list[tuple[int, bytes]]:
    """(sending rank, datagram): SwitchML order (each round's packets shuffled), with
    duplicates, lost-result retransmissions, malformed packets and packets of another generation
    mixed in. With ``key`` every datagram is tagged (the malformed ones too, so they reach the
    checks after the tag's) and each round adds one forged packet (a wrong key)."""
    rnd = random.Random(seed)
    emin = window_e_min(workers)
    top = 62 - (workers - 1).bit_length() + 1
    out: list[tuple[int, bytes]] = []
    for chunk in range(rounds):
        slot, version = chunk % pool, (chunk // pool) % 2
        count = rnd.randint(1, K)
        packets = []
        for rank in range(workers):
            codes = [rnd.choice((0, 0x80)) | rnd.randint(1, top) if rnd.random() < 0.8 else 0
                     for _ in range(count)]  # fmt: skip
            packets.append((rank, uplink(job=job, rank=rank, slot=slot, offset=chunk * K,
                                         codes=codes, emin=emin, pool=version)))  # fmt: skip
        packets += [p for p in packets if rnd.random() < 0.2]  # duplicates (or late resends)
        rnd.shuffle(packets)
        out += packets
        rank = rnd.randrange(workers)
        retx = bytearray(next(d for r, d in packets if r == rank))
        retx[1] |= 0x02
        out.append((rank, bytes(retx)))
        bad = bytearray(packets[0][1])
        what = rnd.randrange(4)
        if what == 0:
            bad[0] = 7
        elif what == 1:
            bad = bad[:-1]
        elif what == 2:
            bad[16] = 0x7F
        else:
            bad[3] ^= 1
        out.append((packets[0][0], bytes(bad)))
        if chunk % 5 == 4:  # from an aggregator start before this one
            stale = bytearray(packets[-1][1])
            stale[1] |= STALE << GENERATION_SHIFT
            out.append((packets[-1][0], bytes(stale)))
        if key is not None:
            forged = bytearray(packets[0][1])
            forged[1] |= FLAG_TAG
            out.append((packets[0][0], tag.sign(bytes(16), forged)))
    if key is None:
        return out
    sealed = []
    for rank, datagram in out:
        if datagram[1] & FLAG_TAG:  # forged already
            sealed.append((rank, datagram))
        else:
            sealed.append((rank, tag.sign(key, bytes([datagram[0], datagram[1] | FLAG_TAG])
                                          + datagram[2:])))  # fmt: skip
    return sealed


def replay(
    aggregator: RunningAggregator, host: str, workers: int, packets: list[tuple[int, bytes]]
) -> tuple[list[list[bytes]], dict[str, Any]]:
    """Send the schedule from one socket per rank; return what each rank received, and the
    stats afterwards (the first packets of each rank fix its address)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(workers)]
    received: list[list[bytes]] = [[] for _ in range(workers)]
    try:
        for s in socks:
            s.bind((host, 0))
            s.setblocking(False)

        def drain() -> None:
            for rank, s in enumerate(socks):
                while True:
                    try:
                        received[rank].append(s.recv(0xFFFF))
                    except BlockingIOError:
                        break

        for i, (rank, datagram) in enumerate(packets):
            socks[rank].sendto(datagram, aggregator.address)
            if i % 8 == 7:
                time.sleep(0.002)  # stay far below any queue's capacity
                drain()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            drain()
        return received, aggregator.stats()
    finally:
        for s in socks:
            s.close()


GENERATION = 6
STALE = 11  # the generation of an earlier start
KEY = bytes(range(32, 64))


@pytest.mark.parametrize("keyed", [False, True], ids=["untagged", "keyed"])
@pytest.mark.parametrize("result", ["int", "nc8"])
def test_wire_parity_with_the_python_backend(tmp_path: Path, result: str, keyed: bool) -> None:
    workers, pool = 3, 4
    packets = schedule(9, workers, rounds=30, pool=pool, seed=4, key=KEY if keyed else None)
    extra = ["--seed", "42", "--pool-size", str(pool), "--generation", str(GENERATION)]
    if keyed:
        key_file = tmp_path / "job.key"
        key_file.write_text(KEY.hex())
        extra += ["--key-file", str(key_file)]
    outputs = {}
    for backend in ("python", "dpdk"):
        agg = start_aggregator(backend, tmp_path / backend, job=9, workers=workers, k=K,
                               result=result, extra=extra, listen="127.0.0.1:0")  # fmt: skip
        try:
            outputs[backend] = replay(agg, worker_host(backend), workers, packets)
        finally:
            assert agg.stop() == 0, agg.log()
    (py_rx, py_stats), (dp_rx, dp_stats) = outputs["python"], outputs["dpdk"]
    assert sum(map(len, py_rx)) > 30
    # The same bytes to every rank: results, and notices (duplicates, stale packets).
    for rank, (dp, py) in enumerate(zip(dp_rx, py_rx, strict=True)):
        pairs = zip(dp, py, strict=False)  # up to the shorter list
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(dp), len(py)))
        assert dp == py, (f"rank {rank}: {len(dp)} datagrams from dpdk, {len(py)} from python, "
                          f"first difference at {first}: "
                          f"{dp[first:first + 1]!r} vs {py[first:first + 1]!r}")  # fmt: skip
    downlink = [d for rx in py_rx for d in rx]
    assert all(d[1] & GENERATION_MASK == GENERATION << GENERATION_SHIFT for d in downlink)
    assert all(bool(d[1] & FLAG_TAG) == keyed for d in downlink)
    if keyed:
        assert all(tag.verify(KEY, d) for d in downlink)
    job = py_stats["jobs"]["9"]
    assert job["notices_sent"] > 0 and job["drops"]["stale_generation"] == 6
    assert (job["drops"]["bad_tag"] > 0) == keyed
    assert dp_stats["jobs"] == py_stats["jobs"]
    assert dp_stats["global"] == py_stats["global"]
    assert dp_stats["dpdk"]["key_underruns"] == 0


@pytest.fixture
def dpdk(tmp_path: Path) -> Iterator[RunningAggregator]:
    agg = start_aggregator("dpdk", tmp_path, job=1, workers=1, k=4, result="int")
    yield agg
    agg.stop()


def test_kernel_stays_silent_and_arp_comes_from_dpdk(dpdk: RunningAggregator) -> None:
    host = worker_host("dpdk")
    for port in (dpdk.address[1], dpdk.address[1] + 1):
        # A connected UDP socket reports an ICMP port unreachable as ECONNREFUSED.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
            s.connect((dpdk.address[0], port))
            s.settimeout(0.3)
            s.send(b"not ncina")
            with pytest.raises(TimeoutError):
                s.recv(100)
            s.send(b"again")  # an earlier ICMP error would surface here
            with pytest.raises(TimeoutError):
                s.recv(100)
    stats = dpdk.stats()
    assert stats["dpdk"]["arp_replies"] >= 1
    assert stats["global"]["drops"]["truncated"] == 2  # the two datagrams to the served port
    assert stats["dpdk"]["ignored"] >= 2  # the two to the other port


def test_garbage_frames_keep_it_serving_and_sigint_exits_cleanly(
    dpdk: RunningAggregator,
) -> None:
    star = netns.shared_star()
    site = star.sites[-1]
    rnd = random.Random(1)
    mac = bytes.fromhex(dpdk.log().split(" mac ")[1].split(",")[0].replace(":", ""))
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as raw:
        raw.bind((site.peer, 0))
        for _ in range(300):
            kind = rnd.randrange(3)
            body = rnd.randbytes(rnd.randint(0, 120))
            if kind == 0:  # IPv4 of random content
                frame = mac + b"\x02" * 6 + b"\x08\x00" + body
            elif kind == 1:  # IPv4/UDP to the port, random lengths
                ip = bytes([0x45, 0, 0, rnd.randint(0, 255)]) + bytes(8) + bytes(4)
                ip = ip[:9] + b"\x11" + ip[10:] + socket.inet_aton(dpdk.address[0])
                udp = (47000).to_bytes(2, "big") * 2 + rnd.randbytes(4)
                frame = mac + b"\x02" * 6 + b"\x08\x00" + ip + udp + body
            else:  # ARP and other ethertypes
                frame = mac + b"\x02" * 6 + rnd.choice([b"\x08\x06", b"\x86\xdd"]) + body
            raw.send(frame.ljust(14, b"\0"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((worker_host("dpdk"), 0))
        s.settimeout(5)
        s.sendto(uplink(job=1, rank=0, slot=0, offset=0, codes=[2, 2, 0, 0x81],
                        emin=window_e_min(1)), dpdk.address)  # fmt: skip
        data, _ = s.recvfrom(0xFFFF)
    assert data[16:] == (2).to_bytes(8, "big") * 2 + bytes(8) + (-1).to_bytes(8, "big", signed=True)
    dpdk.process.send_signal(signal.SIGINT)
    assert dpdk.process.wait(10) == 0
    final = json.loads(dpdk.stats_path.read_text())
    assert final["dpdk"]["rx_frames"] >= 300
    assert final["jobs"]["1"]["slots_completed"] == 1
    assert "Traceback" not in dpdk.log()


def test_a_result_frame_larger_than_an_mbuf_is_refused_at_start(tmp_path: Path) -> None:
    """Regression: with --mtu 9000, int results of K=1024 (8,250-byte frames) started and then
    wrote past the 2048-byte mbufs on the first completed slot. Now the start fails at once, with
    the limit and the largest K, before EAL starts."""
    agg = launch_aggregator("dpdk", tmp_path, job=1, workers=2, k=1024, result="int",
                            extra=["--mtu", "9000"])  # fmt: skip
    try:
        assert agg.process.wait(60) == 1
    finally:
        agg.stop()
    log = agg.log()
    assert "2048-byte mbuf" in log and "largest k for int results is 248" in log, log
    assert "listening" not in log and "Traceback" not in log
