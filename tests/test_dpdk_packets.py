"""The DPDK backend on the wire: a data plane per test in its own namespace, reached over a veth
pair through a bridge (``ncina.aggregator.backends.dpdk.netns``).

- wire parity with the Python backend (``ncina_parity``): the same datagrams to every rank,
  notices included, and the same counters, also keyed and with packets of a previous generation;
  on af_packet and on af_xdp (``--dpdk-pmd``);
- the aggregator's kernel stays silent (no ICMP port unreachable), ARP is answered by DPDK;
- raw garbage frames are ignored or counted and the process keeps serving; SIGINT exits cleanly.

The scenario suite itself runs on dpdk through test_aggregator_packets.py.
"""

from __future__ import annotations

import json
import random
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from ncina.aggregator.backends.dpdk import binding, eal, netns
from ncina_parity import assert_wire_parity
from ncina_testlib import launch_aggregator, start_aggregator, uplink, window_e_min, worker_host

from ncina.harness.aggregators import RunningAggregator

_MISSING = netns.missing() or binding.missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"dpdk backend: {_MISSING}")


@pytest.mark.parametrize("keyed", [False, True], ids=["untagged", "keyed"])
@pytest.mark.parametrize("result", ["int", "nc8"])
def test_wire_parity_with_the_python_backend(tmp_path: Path, result: str, keyed: bool) -> None:
    assert_wire_parity("dpdk", tmp_path, result, keyed)


@pytest.mark.parametrize("result", ["int", "nc8"])
def test_spine_wire_parity_with_the_python_backend(tmp_path: Path, result: str) -> None:
    """A keyed spine (--uplink int): its leaves' int partial sums as the python spine takes
    them (docs/protocol.md, "Hierarchical aggregation")."""
    assert_wire_parity("dpdk", tmp_path, result, True, spine=True)


@pytest.mark.parametrize("result", ["int", "nc8"])
def test_wire_parity_over_af_xdp(tmp_path: Path, result: str) -> None:
    """The same engine behind DPDK's AF_XDP driver instead of af_packet (--dpdk-pmd af_xdp)."""
    assert_wire_parity("dpdk", tmp_path, result, True, ["--dpdk-pmd", "af_xdp"])


@pytest.fixture
def dpdk(tmp_path: Path) -> Iterator[RunningAggregator]:
    agg = start_aggregator("dpdk", tmp_path, job=1, workers=1, k=4, result="int")
    yield agg
    agg.stop()


def assert_one_slot_completes(agg: RunningAggregator) -> None:
    """A one-worker job (K=4, int results) completes a slot: the sums of codes 2, 2, 0, -1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((worker_host("dpdk"), 0))
        s.settimeout(5)
        s.sendto(uplink(job=1, rank=0, slot=0, offset=0, codes=[2, 2, 0, 0x81],
                        emin=window_e_min(1)), agg.address)  # fmt: skip
        data, _ = s.recvfrom(0xFFFF)
    assert data[16:] == b"".join(v.to_bytes(8, "big", signed=True) for v in (2, 2, 0, -1))


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
    assert_one_slot_completes(dpdk)
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


@pytest.fixture
def hugepages() -> Iterator[int]:
    """128 MB more of 2 MB hugepages, reserved the way docs/dpdk.md tells a user to, for one test
    (yields the free MB); the reservation is put back afterwards. Skips where the kernel cannot
    find the pages."""
    nr = eal.SYS_HUGEPAGES / "hugepages-2048kB" / "nr_hugepages"
    if not nr.exists():
        pytest.skip("this kernel has no 2 MB hugepages")
    before = int(nr.read_text())
    nr.write_text(str(before + eal.MEMORY_MB // 2))
    try:
        free = eal.free_hugepage_mb()
        if free < eal.MEMORY_MB:
            pytest.skip(f"the kernel found only {free} MB of hugepages (memory fragmented)")
        yield free
    finally:
        nr.write_text(str(before))


def test_the_data_plane_runs_in_hugepages_when_asked(tmp_path: Path, hugepages: int) -> None:
    """--hugepages on: EAL maps its 128 MB from hugepages (--in-memory, no hugetlbfs mount
    needed), says so at start and serves as before."""
    agg = start_aggregator("dpdk", tmp_path, job=1, workers=1, k=4, result="int",
                           extra=["--hugepages", "on"])  # fmt: skip
    try:
        assert "memory: hugepages" in agg.log()
        assert eal.free_hugepage_mb() <= hugepages - eal.MEMORY_MB
        assert_one_slot_completes(agg)
    finally:
        assert agg.stop() == 0
    assert eal.free_hugepage_mb() == hugepages


def test_the_noop_forwarder_answers_arp_and_echoes_each_datagram(tmp_path: Path) -> None:
    """``--dpdk-mode forward`` (bench aggregator's baseline) answers the host's ARP request for
    its address and sends every datagram back with addresses and ports swapped (issue 36 item 1:
    it classified the ARP request after swapping the MACs, saw a broadcast source, and answered
    nothing)."""
    agg = start_aggregator("dpdk", tmp_path, job=1, workers=1, k=4, result="int",
                           extra=["--dpdk-mode", "forward"])  # fmt: skip
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((worker_host("dpdk"), 0))
            s.connect(agg.address)
            s.settimeout(5)
            sent = [bytes([n]) * (20 + n) for n in range(3)]
            for datagram in sent:
                s.send(datagram)
                assert s.recv(0xFFFF) == datagram
        stats = agg.stats()
        assert stats["dpdk"]["arp_replies"] == 1
    finally:
        agg.stop()
