"""Parity of the BMv2 switch with the Python reference on the same recorded packets.

One recorded session (complete slots, a short chunk, both pool versions, duplicates answered with
notices, retransmissions after completion and for the previous version, a stale generation, and
one packet for each drop reason a member or a stranger can cause) is sent to a Python aggregator
and to the P4 program on BMv2. Every worker must receive the same datagrams in the same order,
byte for byte (`nc8` results too: every backend rounds with the same CRC-32 word of the seed and
the chunk, so this is where BMv2's own `HashAlgorithm.crc32` is checked against the zlib CRC-32
of ``ncina.proto.nc8.result_key``), each `nc8` code one of the two powers of two around the exact
sum. The counters must agree to the byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.proto.profiles import tofino_max_code
from ncina_testlib import (
    TWIN,
    Worker,
    code_values,
    counters,
    dissect,
    exact_sums,
    is_nc8_rounding,
    start_aggregator,
    uplink,
    wait_learned,
    window_e_min,
    worker_host,
)

JOB = 41
WORKERS = 3
K = 12  # within the Tofino design's lanes per pass (its twin runs the session too)
POOL = 8
GENERATION = 5
WINDOW_TOP = 62 - (WORKERS - 1).bit_length() + 1  # the window's highest valid code

Send = tuple[int, bytes]  # (rank of the sending socket, datagram)


def session(emin: int, top: int = WINDOW_TOP) -> tuple[list[Send], dict[tuple[int, int, int],
                                                                      list[int]]]:
    """The recorded uplink, and the exact sum of every chunk it completes, by (slot, pool,
    offset); its chunks' codes are at most ``top``."""
    rng = np.random.default_rng(2024)
    sends: list[Send] = []
    sums: dict[tuple[int, int, int], list[int]] = {}

    def chunk(slot: int, pool: int, count: int = K, offset: int | None = None,
              order: tuple[int, ...] = (0, 1, 2)) -> list[bytes]:  # fmt: skip
        offset = slot * K if offset is None else offset
        codes = rng.integers(0, 256, (WORKERS, count)).astype(np.uint8)
        # keep every code at most top (for the window's top, 61: at most 31)
        codes[(codes & 0x7F) > top] &= 0x80 | (1 << (top.bit_length() - 1)) - 1
        sums[(slot, pool, offset)] = exact_sums(codes.tolist())
        packets = [uplink(job=JOB, rank=r, slot=slot, offset=offset, codes=codes[r].tolist(),
                          emin=emin, pool=pool) for r in range(WORKERS)]  # fmt: skip
        sends.extend((r, packets[r]) for r in order)
        return packets

    first = chunk(0, 0)
    chunk(1, 0)
    chunk(2, 0, count=5)  # a short chunk
    sends.append((1, first[1]))  # retransmission after completion: the stored result again
    # A duplicate before completion: a notice with the bitmap held so far.
    dup = chunk(3, 0, order=(0,))
    sends.append((0, dup[0]))
    sends.extend((r, dup[r]) for r in (1, 2))
    # The next use of slot 0 (version 1) by ranks 0 and 1, while rank 2, whose version 0 result
    # was lost, retransmits for version 0 (answered from the stored result) before moving on.
    again = chunk(0, 1, offset=3 * K + 16 * K, order=(0, 1))
    sends.append((2, first[2]))
    sends.append((2, again[2]))
    # Generation bits of another start: stale, answered with an empty notice.
    sends.append((1, uplink(job=JOB, rank=1, slot=4, offset=4 * K, codes=[1] * K, emin=emin,
                            flags=3 << 3)))  # fmt: skip
    # One packet per drop reason (the rank is a member's unless the reason is about the rank).
    good = {"job": JOB, "slot": 5, "offset": 5 * K, "codes": [1] * K, "emin": emin}
    bad = [
        uplink(rank=0, **{**good, "emin": emin + 1}),  # window_mismatch
        uplink(rank=0, **{**good, "slot": POOL}),  # bad_slot
        uplink(rank=0, **{**good, "codes": [WINDOW_TOP + 1] + [1] * (K - 1)}),  # bad_code
        uplink(rank=0, **{**good, "codes": [1] * (K + 1)}),  # bad_count (count > K)
        uplink(rank=0, **good, count=K - 1),  # bad_length
        uplink(rank=0, **{**good, "codes": [1] * (8 * K)}, count=K, format=1),  # bad_format
        uplink(rank=0, **good, flags=0x01),  # bad_flags (RESULT from a worker)
        uplink(rank=WORKERS, **good),  # non_member (rank out of range)
        uplink(rank=0, **{**good, "job": JOB + 1}),  # unknown_job
        uplink(rank=0, **good, version=2),  # bad_version
        uplink(rank=0, **good, count=0),  # bad_count (zero elements)
        uplink(rank=0, **good)[:10],  # truncated
        uplink(rank=0, **good, flags=0x80),  # bad_length (TAG: the last 8 bytes are no payload)
        uplink(rank=0, **{**good, "codes": [1] * (K + 8)}, count=K, flags=0x80),  # bad_tag
    ]
    sends.extend((0, datagram) for datagram in bad)
    sends.append((1, uplink(rank=0, **{**good, "slot": 6, "offset": 6 * K})))  # non_member
    # (rank 0's packet from rank 1's socket: another address)
    return sends, sums


def introductions(emin: int) -> list[Send]:
    """Every rank's first packet, completing no slot: ranks 0 and 1 in slot 7, rank 2 in slot 5
    (whose packets in the session are all dropped before the slot is read). The twin learns a
    rank through a digest and its control plane's entries, and a copy of a result for a rank
    not learned yet is lost: the session starts once they are in (``wait_learned``)."""
    slots = [POOL - 1] * (WORKERS - 1) + [5]
    return [(r, uplink(job=JOB, rank=r, slot=slot, offset=slot * K, codes=[1] * K, emin=emin))
            for r, slot in enumerate(slots)]  # fmt: skip


def replay(backend: str, workdir: Path, result: str,
           top: int = WINDOW_TOP) -> tuple[list[list[bytes]], dict[str, Any]]:  # fmt: skip
    """Send the session to a new aggregator of ``backend``; what each rank received, and the
    final stats."""
    agg = start_aggregator(backend, workdir, job=JOB, workers=WORKERS, k=K, result=result,
                           extra=["--pool-size", str(POOL), "--generation", str(GENERATION),
                                  "--seed", "3"])  # fmt: skip
    workers = [Worker(agg.address, timeout=5.0) for _ in range(WORKERS)]
    try:
        for rank, datagram in introductions(window_e_min(WORKERS)):
            workers[rank].send(datagram)
        wait_learned(agg, WORKERS)
        sends, _ = session(window_e_min(WORKERS), top)
        for rank, datagram in sends:
            workers[rank].send(datagram)
        received: list[list[bytes]] = [[] for _ in range(WORKERS)]
        for rank, worker in enumerate(workers):
            worker.socket.settimeout(1.5)  # every reply is back long before: the stream is short
            while True:
                try:
                    received[rank].append(worker.receive())
                except TimeoutError:
                    break
        return received, agg.stats()
    finally:
        for worker in workers:
            worker.close()
        assert agg.stop() == 0, agg.log()


@pytest.mark.parametrize(("backend", "result"), [("bmv2", "int"), ("bmv2", "nc8"), (TWIN, "int")])
def test_bmv2_answers_like_the_python_reference(backend: str, result: str, tmp_path: Path) -> None:
    """The Tofino design's twin gets a session whose codes its 32-bit lanes take (at most
    tofino_max_code(3)), the reference the same session."""
    worker_host(backend)  # skips with the reason when BMv2, p4c or root is missing
    top = tofino_max_code(WORKERS) if backend == TWIN else WINDOW_TOP
    reference, ref_stats = replay("python", tmp_path / "python", result, top)
    switch, sw_stats = replay(backend, tmp_path / "bmv2", result, top)
    _, sums = session(window_e_min(WORKERS), top)
    assert [len(r) for r in switch] == [len(r) for r in reference]
    assert sum(len(r) for r in reference) == 5 * WORKERS + 4  # results, 2 resent, 2 notices
    for rank, (ours, theirs) in enumerate(zip(switch, reference, strict=True)):
        for got, want in zip(ours, theirs, strict=True):
            got_fields, got_payload = dissect(got)
            want_fields, want_payload = dissect(want)
            assert got_fields == want_fields, rank
            assert got_payload == want_payload, (rank, got_fields)
            if result == "int" or got_fields["count"] == 0:
                continue
            key = (got_fields["slot"], got_fields["flags"] >> 2 & 1, got_fields["offset"])
            exact = sums[key]
            assert all(is_nc8_rounding(c, s) for c, s in zip(got_payload, exact, strict=True))
    # Resent results are the stored bytes: rank 1's two results for slot 0 version 0 agree.
    first_two = [dissect(d) for d in switch[1][:1]] + [
        dissect(d) for d in switch[1] if dissect(d)[0]["slot"] == 0][:2]
    assert first_two[1] == first_two[2]
    ours, theirs = counters(sw_stats, JOB), counters(ref_stats, JOB)
    assert ours == theirs, {k: (ours[k], theirs[k]) for k in set(ours) | set(theirs)
                            if ours[k] != theirs[k]}  # fmt: skip


def test_session_covers_every_reason_a_packet_can_be_dropped_for() -> None:
    """The recorded session itself, checked on the reference: each drop reason it aims at."""
    from ncina.aggregator.backends.python.pipeline import Aggregator
    from ncina.aggregator.jobs import JobConfig

    agg = Aggregator(GENERATION)
    agg.add_job(JobConfig.create(job=JOB, workers=WORKERS, k=K, result_format="int",
                                 pool_size=POOL, seed=3))  # fmt: skip
    for rank, datagram in session(window_e_min(WORKERS))[0]:
        agg.handle(datagram, ("10.0.0.1", 40000 + rank))
    job = agg.jobs[JOB].stats.drops
    assert {r for r, n in job.items() if n} == {
        "window_mismatch", "bad_slot", "bad_code", "bad_count", "bad_length", "bad_format",
        "bad_flags", "non_member", "bad_tag", "stale_generation",
    }  # fmt: skip
    assert {r for r, n in agg.stats.drops.items() if n} == {
        "unknown_job", "bad_version", "truncated"}
    assert code_values([0x81]) == [-1]
