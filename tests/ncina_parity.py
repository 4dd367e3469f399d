"""Wire parity with the Python reference, for every backend built on the C slot engine.

One recorded schedule (duplicates, retransmissions, malformed packets, packets of an earlier
generation, and for a keyed job forged packets) is sent to the Python backend and to the backend
under test under one --generation; every rank must receive the same datagrams (results and
notices, byte for byte) and the counters must be equal (int results, and nc8 results under one
--seed: the same rounding bits), for a one-level job and for a spine's (int partial sums from
its leaves). Used by test_socket_packets.py and test_dpdk_packets.py.
"""

from __future__ import annotations

import random
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ncina.proto import tag
from ncina.proto.header import FLAG_TAG, GENERATION_MASK, GENERATION_SHIFT
from ncina_testlib import start_aggregator, uplink, window_e_min, worker_host

from ncina.harness.aggregators import RunningAggregator

K = 8
REPLAY_GUARD = 60.0  # s: a replay that has not been answered by then hangs


def schedule(
    job: int, workers: int, rounds: int, pool: int, seed: int, key: bytes | None = None,
    total: int | None = None, sum_bits: int = 62,
) -> list[tuple[int, bytes]]:  # fmt: skip
    """(sending rank, datagram): SwitchML order (each round's packets shuffled), with
    duplicates, lost-result retransmissions, malformed packets and packets of another generation
    mixed in. With ``key`` every datagram is tagged (the malformed ones too, so they reach the
    checks after the tag's) and each round adds one forged packet (a wrong key).

    With ``total`` the ranks are the leaves of a spine of ``total`` workers (docs/protocol.md,
    "Hierarchical aggregation"): their payloads are int partial sums, mostly within what
    ``total / workers`` workers can sum, sometimes one beyond (``bad_code``), and each round
    adds a leaf's datagram in nc8 codes (``bad_format``). ``sum_bits`` is the window's
    (``ncina.proto.nc8.sum_bits``: 30 for a job of int32 results)."""
    rnd = random.Random(seed)
    emin = window_e_min(total or workers, sum_bits=sum_bits)
    span = sum_bits - ((total or workers) - 1).bit_length()
    top = span + 1
    bound = (total // workers << span) if total else 0
    out: list[tuple[int, bytes]] = []
    for chunk in range(rounds):
        slot, version = chunk % pool, (chunk // pool) % 2
        count = rnd.randint(1, K)
        packets = []
        for rank in range(workers):
            if total:
                sums = [rnd.choice((-bound, bound, rnd.randint(-bound, bound), 0))
                        for _ in range(count)]  # fmt: skip
                if rnd.random() < 0.1:
                    sums[rnd.randrange(count)] = rnd.choice((bound + 1, -bound - 1))
                payload = b"".join(struct.pack("!q", v) for v in sums)
                packets.append((rank, uplink(job=job, rank=rank, slot=slot, offset=chunk * K,
                                             codes=payload, emin=emin, pool=version, format=1,
                                             count=count)))  # fmt: skip
                continue
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
        if total:  # codes where the spine takes partial sums
            rank = rnd.randrange(workers)
            out.append((rank, uplink(job=job, rank=rank, slot=slot, offset=chunk * K,
                                     codes=[1] * count, emin=emin, pool=version)))  # fmt: skip
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
            if i == 0:
                # A data plane in a namespace is first reached through ARP: the kernel queues
                # this datagram until the answer, and datagrams sent while the answer is being
                # processed can overtake it. The rest go once the aggregator has counted it.
                _wait_counted(aggregator, 1)
            if i % 8 == 7:
                time.sleep(0.002)  # stay far below any queue's capacity
                drain()
        # Done when the aggregator has counted every datagram sent and every reply it counted
        # has arrived, not after a fixed wait: a data plane starved of CPU (a loaded CI host)
        # may take seconds. The deadline is a hang guard; past it the comparison shows the gap.
        deadline = time.monotonic() + REPLAY_GUARD
        while True:
            time.sleep(0.05)
            drain()
            stats = aggregator.stats()
            counted = _counted(stats)
            replies = sum(job["packets_out"] for job in stats["jobs"].values())
            if counted >= len(packets) and sum(map(len, received)) >= replies:
                return received, stats
            if time.monotonic() > deadline:
                return received, stats
    finally:
        for s in socks:
            s.close()


def _counted(stats: dict[str, Any]) -> int:
    """Datagrams the aggregator has received, whether a job took them or they were dropped."""
    return stats["global"]["packets_in"] + sum(job["packets_in"] for job in stats["jobs"].values())


def _wait_counted(aggregator: RunningAggregator, datagrams: int) -> None:
    deadline = time.monotonic() + REPLAY_GUARD
    while _counted(aggregator.stats()) < datagrams and time.monotonic() < deadline:
        time.sleep(0.01)


GENERATION = 6
STALE = 11  # the generation of an earlier start
KEY = bytes(range(32, 64))


def assert_wire_parity(
    backend: str, tmp_path: Path, result: str, keyed: bool, options: Sequence[str] = (),
    spine: bool = False,
) -> None:  # fmt: skip
    """Replay one schedule to the Python backend and to ``backend`` (started with ``options``
    too); assert equal replies and counters. ``spine``: both serve a spine of 3 leaves and 6
    workers in total (``--uplink int``), the schedule sends int partial sums."""
    workers, pool = 3, 4
    total = 2 * workers if spine else None
    packets = schedule(9, workers, rounds=30, pool=pool, seed=4, key=KEY if keyed else None,
                       total=total)  # fmt: skip
    extra = ["--seed", "42", "--pool-size", str(pool), "--generation", str(GENERATION)]
    if total:
        extra += ["--uplink", "int", "--total-workers", str(total)]
    if keyed:
        key_file = tmp_path / "job.key"
        key_file.write_text(KEY.hex())
        extra += ["--key-file", str(key_file)]
    outputs = {}
    for name in ("python", backend):
        mine = [*extra, *options] if name == backend else extra
        agg = start_aggregator(name, tmp_path / name, job=9, workers=workers, k=K,
                               result=result, extra=mine, listen="127.0.0.1:0")  # fmt: skip
        try:
            outputs[name] = replay(agg, worker_host(name), workers, packets)
        finally:
            assert agg.stop() == 0, agg.log()
    (py_rx, py_stats), (dp_rx, dp_stats) = outputs["python"], outputs[backend]
    assert sum(map(len, py_rx)) > 30
    # The same bytes to every rank: results, and notices (duplicates, stale packets).
    for rank, (dp, py) in enumerate(zip(dp_rx, py_rx, strict=True)):
        pairs = zip(dp, py, strict=False)  # up to the shorter list
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(dp), len(py)))
        assert dp == py, (f"rank {rank}: {len(dp)} datagrams from {backend}, "
                          f"{len(py)} from python, first difference at {first}: "
                          f"{dp[first:first + 1]!r} vs {py[first:first + 1]!r}")  # fmt: skip
    downlink = [d for rx in py_rx for d in rx]
    assert all(d[1] & GENERATION_MASK == GENERATION << GENERATION_SHIFT for d in downlink)
    assert all(bool(d[1] & FLAG_TAG) == keyed for d in downlink)
    if keyed:
        assert all(tag.verify(KEY, d) for d in downlink)
    job = py_stats["jobs"]["9"]
    assert job["notices_sent"] > 0 and job["drops"]["stale_generation"] == 6
    assert (job["drops"]["bad_tag"] > 0) == keyed
    assert (job["drops"]["bad_format"] > 0) == spine
    assert job["drops"]["bad_code"] > 0 and job["slots_completed"] > 0
    assert dp_stats["jobs"] == py_stats["jobs"]
    assert dp_stats["global"] == py_stats["global"]
