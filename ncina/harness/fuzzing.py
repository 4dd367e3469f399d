"""Hostile input during a real job: malformed, truncated, oversized, out-of-range and random
datagrams thrown at a running aggregator while its workers all-reduce (docs/reliability.md,
"Hostile input").

``hostile_datagrams`` makes a seeded mix of them (structured mutations of valid packets, random
header fields, scapy's field fuzzing, raw bytes); ``fuzz_during_allreduce`` sends them from a
stranger's socket while real ``AllreduceClient`` workers, whose addresses the job has configured
(so no fuzzed packet can take a rank's place), sum a tensor whose exact sum is known. It reports
whether the result was exact, whether every fuzzed datagram was counted as a drop, the drops by
reason and the aggregator's resident memory before and after. ``tests/test_fuzz.py`` runs it on
every backend with hypothesis-made datagrams; ``ncina bench reliability`` with 100,000 of these.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ncina.harness.reference import powers_of_two
from ncina.proto.header import FLAG_TAG, HEADER, VERSION, pack
from ncina.proto.job import JobSpec
from ncina.proto.wire import DEFAULT_MTU, HEADER_SIZE, IPV4_UDP_HEADERS, TAG_SIZE
from ncina.worker.client import AllreduceClient

FUZZ_DATAGRAM = DEFAULT_MTU - IPV4_UDP_HEADERS
"""The longest fuzzed datagram: an IPv4/UDP payload that fits a 1500-byte MTU unfragmented."""
BURST = 32  # datagrams sent between two short pauses: far below any socket or ring capacity
PAUSE = 0.001
AHEAD = 512
"""How far ``fuzz_during_allreduce`` lets its datagrams run ahead of the aggregator's packets_in.
BMv2 reads a port through a ring and a queue that a long burst at full pace overflows behind a
slow program (docs/bmv2.md, "Input loss"): the twin lost 113 of 3,127 chunks sent at 32 a
millisecond and none at one, before any counter saw them. What the fuzz checks is the counting."""


def hostile_datagrams(
    n: int, *, seed: int, job: int, workers: int, k: int, emin: int, pool_size: int
) -> Iterator[bytes]:
    """``n`` datagrams that a job (``job``, ``workers``, ``k``, window ``emin``, ``pool_size``)
    must drop when they come from a stranger: a seeded mix of mutated valid packets, headers with
    random fields (the job's id and in-range values half of the time), wrong versions, truncated
    headers, garbage tags, scapy ``fuzz()`` of the header, and raw random bytes. Made one at a
    time as they are taken (a million of them held at once would take about half a GB), the same
    sequence for the same arguments."""
    from scapy.packet import Raw, fuzz
    from scapy.volatile import RandBin

    from ncina.proto.layers import NcinaHeader

    rnd = random.Random(seed)
    random.seed(seed)  # scapy's fuzz() draws from the random module: its own state, kept between
    scapy_state = random.getstate()  # draws, so that others' use of it changes nothing here

    def valid() -> bytearray:
        count = rnd.randint(1, k)
        codes = bytes(rnd.randint(0, 255) & 0x87 for _ in range(count))  # small codes
        return bytearray(pack(job=job, rank=rnd.randrange(workers), slot=rnd.randrange(pool_size),
                              offset=rnd.randrange(1 << 20) * k, count=count, emin=emin,
                              payload=codes))  # fmt: skip

    def pick(in_range: int, bits: int) -> int:
        return rnd.randrange(in_range) if rnd.random() < 0.5 else rnd.getrandbits(bits)

    def random_header() -> bytes:
        count = rnd.choice((0, 1, k, k + 1, rnd.getrandbits(16)))
        header = HEADER.pack(
            VERSION if rnd.random() < 0.8 else rnd.getrandbits(8),
            rnd.getrandbits(8),
            rnd.choice((0, 1, 2, rnd.getrandbits(8))),
            emin if rnd.random() < 0.5 else rnd.randint(-128, 127),
            job if rnd.random() < 0.6 else rnd.getrandbits(16),
            pick(workers + 1, 16),
            pick(pool_size + 1, 16),
            count,
            rnd.getrandbits(32),
        )
        size = count if rnd.random() < 0.5 else rnd.randint(0, FUZZ_DATAGRAM - HEADER_SIZE)
        return header + rnd.randbytes(min(size, FUZZ_DATAGRAM - HEADER_SIZE))

    def mutated() -> bytes:
        datagram = valid()
        for _ in range(rnd.randint(1, 3)):
            datagram[rnd.randrange(len(datagram))] = rnd.getrandbits(8)
        return bytes(datagram)

    def tagged() -> bytes:
        datagram = valid()
        datagram[1] |= FLAG_TAG
        return bytes(datagram) + rnd.randbytes(TAG_SIZE)

    def scapy_fuzzed() -> bytes:
        nonlocal scapy_state
        size = rnd.randint(0, 512)
        random.setstate(scapy_state)
        layer = bytes(fuzz(NcinaHeader()) / Raw(RandBin(size)))
        scapy_state = random.getstate()
        return layer[:FUZZ_DATAGRAM]

    makers: Sequence[Callable[[], bytes]] = (
        mutated,
        mutated,
        random_header,
        random_header,
        tagged,
        scapy_fuzzed,
        lambda: rnd.randbytes(rnd.randint(0, HEADER_SIZE - 1)),  # truncated
        lambda: rnd.randbytes(rnd.randint(HEADER_SIZE, FUZZ_DATAGRAM)),  # raw
        lambda: bytes(valid()) + rnd.randbytes(rnd.randint(1, FUZZ_DATAGRAM - HEADER_SIZE - k)),
    )
    for _ in range(n):
        yield rnd.choice(makers)()


def resident_kib(pid: int) -> int:
    """The resident set size of process ``pid`` (VmRSS, KiB)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass
class FuzzReport:
    """What ``fuzz_during_allreduce`` saw."""

    exact: bool  # every worker got the exact sum
    sent: int  # fuzzed datagrams sent
    dropped: int  # drops counted by the aggregator meanwhile (job and global sections)
    accepted: int  # the aggregator's packets_in growth minus the workers' and fuzzer's packets
    drops: dict[str, int] = field(default_factory=dict)  # by reason, this phase only
    rss_kib: tuple[int, int] = (0, 0)  # the aggregator's resident memory before and after
    seconds: float = 0.0


def _totals(document: dict[str, Any], job: int) -> tuple[int, dict[str, int]]:
    """packets_in (without the job handshakes the job answered: they are neither accepted nor
    dropped) and the drops by reason of the job and global sections together."""
    sections = [document["global"], document["jobs"][str(job)]]
    drops: dict[str, int] = {}
    for section in sections:
        for reason, count in section["drops"].items():
            drops[reason] = drops.get(reason, 0) + count
    return sum(s["packets_in"] for s in sections) - sections[1]["handshakes"], drops


SETTLE_S = 1.0
"""How long the aggregator's packets_in must stay unchanged before the datagrams it has not
counted are taken as lost: a loaded machine's queues (BMv2's above all) hold them for a while."""


def _settled(stats: Callable[[], dict[str, Any]], job: int,
             expected_in: int) -> tuple[int, dict[str, int]]:  # fmt: skip
    """``_totals`` of the aggregator's stats once its packets_in has reached ``expected_in`` (every
    datagram sent has arrived) or has not grown for ``SETTLE_S``."""
    totals = _totals(stats(), job)
    still_since = time.monotonic()
    while totals[0] < expected_in and time.monotonic() - still_since < SETTLE_S:
        time.sleep(0.1)
        now = _totals(stats(), job)
        if now[0] != totals[0]:
            still_since = time.monotonic()
        totals = now
    return totals


def _steady(stats: Callable[[], dict[str, Any]], job: int) -> tuple[int, dict[str, int]]:
    """``_totals`` of two stats documents in a row that agree (at most ``SETTLE_S`` of
    reading): the workers' first hellos, sent as their clients are made, may be counted while
    a document is read, and a switch's counters are not read at one instant, so one document
    alone may hold a hello's handshake and not its ``packets_in`` (issue 37: the twin's fuzz
    test saw ``accepted`` 3 under load, one per worker)."""
    totals = _totals(stats(), job)
    end = time.monotonic() + SETTLE_S
    while time.monotonic() < end:
        again = _totals(stats(), job)
        if again == totals:
            break
        totals = again
    return totals


def fuzz_during_allreduce(
    address: tuple[str, int],
    host: str,
    ports: Sequence[int],
    stats: Callable[[], dict[str, Any]],
    pid: int,
    fuzzer: Callable[[Callable[[bytes], None]], None],
    *,
    spec: JobSpec,
    elements: int,
    seed: int = 0,
) -> FuzzReport:
    """Run ``fuzzer(send)``, where ``send(datagram)`` sends to the aggregator at ``address``
    from a stranger's socket on ``host``, while one worker per port of ``ports`` (the job's
    configured members, bound to ``host``) sums powers of two, call after call until the fuzzer
    returns; ``stats`` returns the aggregator's stats document now, ``pid`` is its process (for
    its memory); ``spec`` is the job, every field of it the workers'. ``send`` paces the
    datagrams so that no socket buffer overflows, and waits for the aggregator to have seen all
    but ``AHEAD`` of them every ``AHEAD``."""
    workers, job = len(ports), spec.job
    if spec.workers != workers:
        raise ValueError(f"a job of {spec.workers} workers, {workers} ports")
    inputs = [powers_of_two(elements, seed + rank, lowest=-20) for rank in range(workers)]
    exact = np.sum(np.stack(inputs).astype(np.float64), axis=0).astype(np.float32)
    clients = [
        AllreduceClient.for_job(address, spec, rank=r, seed=r, bind=(host, port), deadline=30.0)
        for r, port in enumerate(ports)
    ]
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        stranger.bind((host, 0))
        before_in, before_drops = _steady(stats, job)
        rss_before = resident_kib(pid)
        sent_by_workers = [c.stats["packets_sent"] for c in clients]
        fuzzing = threading.Event()
        fuzzing.set()
        # At least one call, more while the fuzzer runs; every rank makes the same calls (the
        # barrier's action decides once per round for all of them).
        more = [True]
        rounds = threading.Barrier(workers, action=lambda: more.__setitem__(0, fuzzing.is_set()))

        def work(rank: int) -> bool:
            ok = True
            while more[0]:
                got = clients[rank].allreduce(inputs[rank], op="sum")
                ok = ok and np.array_equal(got, exact)
                rounds.wait(timeout=60)
            return ok

        began = time.monotonic()
        with ThreadPoolExecutor(workers) as pool:
            calls = [pool.submit(work, r) for r in range(workers)]
            sent = [0]

            def send(datagram: bytes) -> None:
                stranger.sendto(datagram, address)
                sent[0] += 1
                if sent[0] % BURST == 0:
                    time.sleep(PAUSE)
                if sent[0] % AHEAD == 0:  # the aggregator catches up (or stops counting)
                    _settled(stats, job, before_in + sent[0] - AHEAD)

            try:
                fuzzer(send)
            finally:
                fuzzing.clear()
            results = [c.result() for c in calls]
        seconds = time.monotonic() - began
        workers_sent = sum(c.stats["packets_sent"] - s for c, s in zip(clients, sent_by_workers,
                                                                        strict=True))  # fmt: skip
        after_in, after_drops = _settled(stats, job, before_in + workers_sent + sent[0])
        rss_after = resident_kib(pid)
    finally:
        stranger.close()
        for client in clients:
            client.close()
    drops = {r: after_drops.get(r, 0) - before_drops.get(r, 0) for r in after_drops}
    dropped = sum(drops.values())
    return FuzzReport(
        exact=all(results),
        sent=sent[0],
        dropped=dropped,
        accepted=(after_in - before_in) - workers_sent - dropped,
        drops={r: n for r, n in sorted(drops.items()) if n},
        rss_kib=(rss_before, rss_after),
        seconds=seconds,
    )
