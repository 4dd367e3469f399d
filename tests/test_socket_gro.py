"""UDP GRO into and GSO out of the socket backend: invisible to the protocol.

A worker's UDP_SEGMENT (GSO) send reaches the socket backend on loopback as one buffer of
several datagrams (UDP GRO); the backend splits it and the engine must see each datagram as if it
had come alone: the same replies, byte for byte, and the same counters as the datagrams sent
one by one, a short last datagram and a malformed one in the middle included. The replies to one
worker go out as one UDP_SEGMENT send where they can; the worker's socket (no GRO) gets them as
ordinary datagrams. Real ``AllreduceClient`` workers (their C path sends with GSO) get exact sums
through it in test_socket_packets.py.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from ncina_testlib import Worker, dissect, start_aggregator, uplink, window_e_min

JOB = 5
K = 4
UDP_SEGMENT = 103  # linux/udp.h; the socket module does not name it
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
