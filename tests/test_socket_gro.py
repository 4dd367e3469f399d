"""UDP GRO into and GSO out of the socket backend: invisible to the protocol.

A worker's UDP_SEGMENT (GSO) send reaches the socket backend on loopback as one buffer of
several datagrams (UDP GRO); the backend splits it and the engine must see each datagram as if it
had come alone: the same replies, byte for byte, and the same counters as the datagrams sent
one by one, a short last datagram and a malformed one in the middle included. The replies to one
worker go out as one UDP_SEGMENT send where they can; the worker's socket (no GRO) gets them as
ordinary datagrams. Real ``AllreduceClient`` workers (their C path sends with GSO) get exact sums
through it in test_socket_packets.py. The worker's C path takes those replies with UDP GRO
during a call (runs of results in one buffer): the same results, bit for bit, and the same
counters as one datagram a buffer, and GRO is off again between calls.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.worker import cpath
from ncina.worker.client import AllreduceClient
from ncina_testlib import Worker, dissect, start_aggregator, uplink, window_e_min

JOB = 5
K = 4
UDP_SEGMENT = 103  # linux/udp.h; the socket module does not name it
UDP_GRO = 104
SENTINEL_SLOT = 20


def datagrams() -> list[bytes]:
    """Contributions to slots 0..7 of one worker (each completes its slot), a malformed datagram
    (protocol version 2, same length) in the middle, a duplicate of slot 2 (its result is sent
    again) and a short last one (two elements in slot 8): all but the last of one length, as
    UDP_SEGMENT requires."""
    emin = window_e_min(1)

    def contribution(slot: int, n: int = K, **fields: Any) -> bytes:
        codes = [(slot + j) % 7 + 1 for j in range(n)]
        return uplink(job=JOB, rank=0, slot=slot, offset=slot * K, codes=codes, emin=emin,
                      **fields)  # fmt: skip

    sent = [contribution(slot) for slot in range(4)]
    sent.append(contribution(4, version=2))
    sent += [contribution(slot) for slot in range(4, 8)]
    sent.append(contribution(2))
    sent.append(contribution(8, n=2))
    assert len({len(d) for d in sent[:-1]}) == 1 and len(sent[-1]) < len(sent[0])
    return sent


def serve(tmp_path: Path, name: str, super_packet: bool) -> tuple[list[bytes], dict[str, Any]]:
    """Send ``datagrams()`` to a new socket aggregator (one worker, int results), as one GSO
    super-packet or one by one; return the replies up to the sentinel's and the stats."""
    workdir = tmp_path / name
    workdir.mkdir()
    agg = start_aggregator("socket", workdir, job=JOB, workers=1, k=K, result="int",
                           extra=["--generation", "3"])  # fmt: skip
    try:
        worker = Worker(agg.address)
        sent = datagrams()
        if super_packet:
            worker.socket.setsockopt(socket.SOL_UDP, UDP_SEGMENT, len(sent[0]))
            worker.send(b"".join(sent))
            worker.socket.setsockopt(socket.SOL_UDP, UDP_SEGMENT, 0)
        else:
            for datagram in sent:
                worker.send(datagram)
        # A last contribution: its result comes after every reply to the datagrams above.
        worker.send(uplink(job=JOB, rank=0, slot=SENTINEL_SLOT, offset=0, codes=[1],
                           emin=window_e_min(1)))  # fmt: skip
        replies = []
        while True:
            replies.append(worker.receive())
            if dissect(replies[-1])[0]["slot"] == SENTINEL_SLOT:
                break
        worker.close()
        stats = agg.stats()
    finally:
        assert agg.stop() == 0, agg.log()
    return replies, stats


def test_a_gso_super_packet_is_served_as_its_datagrams_one_by_one(tmp_path: Path) -> None:
    one_by_one, alone = serve(tmp_path, "alone", super_packet=False)
    together, grouped = serve(tmp_path, "grouped", super_packet=True)
    assert together == one_by_one
    # 8 results, the duplicate's result again, slot 8's result, the sentinel's
    assert len(one_by_one) == 11
    assert grouped["jobs"] == alone["jobs"] and grouped["global"] == alone["global"]
    job = grouped["jobs"][str(JOB)]
    assert job["slots_completed"] == 10 and job["results_resent"] == 1
    assert not any(job["drops"].values())
    drops = grouped["global"]["drops"]  # no job claims a datagram it cannot parse
    assert drops["bad_version"] == 1 and sum(drops.values()) == 1
    io, io_alone = grouped["socket"], alone["socket"]
    for name in ("rx_datagrams", "tx_datagrams", "send_errors", "oversized"):
        assert io[name] == io_alone[name], name
    assert io["rx_datagrams"] == 12 and io["tx_datagrams"] == 11
    assert io["gro"] is True and io["gso"] is True  # both in every kernel since 5.0
    assert io["rx_coalesced"] == 1 and io["rx_buffers"] == 2  # the super-packet, the sentinel
    assert io_alone["rx_coalesced"] == 0 and io_alone["rx_buffers"] == 12
    assert io["tx_gso_sends"] >= 1 and io["gso_fallbacks"] == 0


def allreduce_twice(tmp_path: Path, name: str) -> tuple[list[np.ndarray], list[dict], list[int]]:
    """Two C-path workers, two mean all-reduces each (nc8 results, K 64, 40 chunks) through a
    new socket aggregator: their results, stats, and the receive buffers each client's C
    path filled (both calls)."""
    workdir = tmp_path / name
    workdir.mkdir()
    k, n = 64, 40 * 64 - 5
    agg = start_aggregator("socket", workdir, job=JOB, workers=2, k=k, result="nc8",
                           extra=["--seed", "7"])
    clients = [AllreduceClient(agg.address, job=JOB, rank=rank, workers=2, k=k, seed=rank,
                               result_format="nc8", data_path="c") for rank in range(2)]
    try:
        xs = [np.random.default_rng(rank).standard_normal(n).astype(np.float32)
              for rank in range(2)]  # fmt: skip
        results = []
        with ThreadPoolExecutor(2) as pool:
            for _ in range(2):
                results += list(pool.map(lambda c, x: c.allreduce(x), clients, xs))
        for client in clients:  # off between calls: Python reads one datagram a buffer
            assert client._link.sock.getsockopt(socket.SOL_UDP, UDP_GRO) == 0
        buffers = [int(c._path.c.state.rx_buffers) for c in clients]
        return results, [c.stats for c in clients], buffers
    finally:
        for client in clients:
            client.close()
        assert agg.stop() == 0, agg.log()


def test_the_c_worker_takes_runs_of_results_with_gro(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpath.GRO_ENV, "0")
    alone, alone_stats, alone_buffers = allreduce_twice(tmp_path, "alone")
    monkeypatch.setenv(cpath.GRO_ENV, "1")
    runs, stats, buffers = allreduce_twice(tmp_path, "runs")
    assert [r.tobytes() for r in runs] == [r.tobytes() for r in alone]
    assert runs[0].tobytes() == runs[1].tobytes()
    for key in ("packets_received", "bytes_received", "results_ignored", "bad_tag"):
        assert [s[key] for s in stats] == [s[key] for s in alone_stats], key
    # One a buffer: 2 calls of 40 chunks, and the agreement the clients make after their handshake
    assert alone_buffers == [s["packets_received"] for s in stats] == [81, 81]
    assert sum(buffers) < sum(alone_buffers)  # the aggregator's GSO runs arrive whole


def test_the_fabric_echo_sends_gso_runs_and_takes_gro_buffers_as_the_workers_do(
    tmp_path: Path,
) -> None:
    """The fabric's echo load (``ncina.harness.echo``, issue 36) against the socket backend's
    no-op forwarder on loopback: its refills reach the forwarder as UDP GSO runs (coalesced
    buffers, as a worker's C transfer sends them: one datagram a send before), and it splits the
    forwarder's runs, which its GRO socket takes whole, into every echo: each echo completes one
    chunk and refills its slot, so exactly a window more datagrams went out than came back."""
    from ncina.aggregator.backends.dpdk import binding

    from ncina.harness.echo import run_load

    if binding.missing():
        pytest.skip(f"the echo's load generator is in the dpdk extension: {binding.missing()}")
    agg = start_aggregator("socket", tmp_path, job=1, workers=1, k=64, result="nc8",
                           extra=["--socket-mode", "forward"])  # fmt: skip
    try:
        counters = run_load(agg.address, "127.0.0.1", k=64, window=64, seconds=0.3,
                            retx_after=1.0, start_at=0.0)  # fmt: skip
        io = agg.stats()["socket"]
    finally:
        assert agg.stop() == 0, agg.log()
    assert counters["retransmit_rounds"] == 0 and counters["send_errors"] == 0, counters
    assert counters["completed"] == counters["received"] > 1000, counters
    assert counters["sent"] == counters["received"] + 64, counters
    assert counters["received"] <= io["rx_datagrams"] <= counters["sent"], io  # last in flight
    assert io["rx_coalesced"] > 0 and io["rx_buffers"] < io["rx_datagrams"] // 4, io
