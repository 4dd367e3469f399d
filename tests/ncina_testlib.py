"""Helpers shared by packet-level tests: aggregators on every backend, worker sockets, crafted
packets. The aggregator processes themselves are ``ncina.harness.aggregators``'s (shared with the
benchmarks); here they get the tests' namespaces for the backends without a kernel socket.

Import with ``from ncina_testlib import ...`` (``tests/`` is on pytest's ``pythonpath``).

Packets are built with the scapy layer (``NcinaHeader() / Raw()``) rather than the fast packer,
so a packer bug cannot hide an aggregator bug. Tests synchronise on the aggregator's replies, never
on sleeps: a UDP socket on loopback delivers in order, so once the reply to a later packet is
back, every earlier packet has been handled.
"""

from __future__ import annotations

import collections
import selectors
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ncina.aggregator.backends import names
from ncina.proto.header import FLAG_RESULT, HEADER, Format
from ncina.proto.layers import NcinaHeader
from scapy.packet import Raw

from ncina.harness import aggregators
from ncina.harness.aggregators import LOCAL_BACKENDS, RunningAggregator, local_command

Address = tuple[str, int]

TWIN = "bmv2-tofino"
"""The bmv2 backend running the v1model twin of the Tofino program (``--profile tofino``,
docs/tofino.md): a backend variant of its own in the cross-backend tests, where the design's
limits (``twin_lacks``) allow."""

AGGREGATOR_BACKENDS = (*names(), TWIN)
"""Backends ``start_aggregator`` can run; packet-level tests are parametrised over them."""


def twin_lacks(backend: str, *features: str) -> None:
    """Skip the test on the twin when it needs one of ``features`` that the Tofino design lacks
    (``ncina.proto.profiles.LACKS``: the reason is the design's one
    sentence)."""
    if backend != TWIN:
        return
    import pytest
    from ncina.proto.profiles import LACKS

    pytest.skip(f"{TWIN}: " + "; ".join(LACKS[feature] for feature in features))

TAGGED_BACKENDS = names(keyed=True)
"""Backends that implement the authentication tag (the P4 program does not)."""


def aggregator_command(backend: str, arguments: Sequence[str]) -> list[str]:
    """The command line of ``ncina aggregator --backend BACKEND ARGUMENTS`` for any backend of
    ``AGGREGATOR_BACKENDS``: the dpdk and bmv2 ones in a namespace of their own on a veth into
    the tests' bridge (the test is skipped, with the reason, where they cannot run)."""
    if backend not in AGGREGATOR_BACKENDS:
        raise ValueError(f"unknown aggregator backend {backend!r}")
    if backend == TWIN:
        return aggregator_command("bmv2", [*arguments, "--profile", "tofino"])
    if backend == "dpdk" and "--hugepages" not in arguments:
        # Off unless the test asks: with the default (auto) a data plane of another pytest run
        # (the sanitized ones run two at once) took the pages test_dpdk_packets had reserved.
        arguments = [*arguments, "--hugepages", "off"]
    if backend not in LOCAL_BACKENDS:
        return _star(backend).add_site().aggregator_command(arguments, backend)
    return local_command(backend, arguments)


def _star(backend: str) -> Any:
    """The bridge the dpdk and bmv2 aggregators hang off (skips the test without root, or
    without DPDK or the P4 toolchain, with the reason)."""
    import pytest
    from ncina.aggregator.backends.bmv2 import toolchain
    from ncina.aggregator.backends.dpdk import binding, netns

    reason = netns.missing() or (binding.missing() if backend == "dpdk" else toolchain.missing())
    if reason:
        pytest.skip(f"{backend} backend: {reason}")
    return netns.shared_star()


def worker_host(backend: str) -> str:
    """The address from which test sockets reach an aggregator of ``backend``."""
    return "127.0.0.1" if backend in LOCAL_BACKENDS else _star(backend).host_ip


def source_address(destination: Address) -> str:
    """The local address the kernel picks to reach ``destination``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((destination[0], 9))
        return probe.getsockname()[0]


def start_aggregator(backend: str, workdir: Path, **options: Any) -> RunningAggregator:
    """``ncina.harness.aggregators.start_aggregator`` for any backend of
    ``AGGREGATOR_BACKENDS`` (``aggregator_command``)."""
    return aggregators.start_aggregator(backend, workdir, command=aggregator_command, **options)


def launch_aggregator(backend: str, workdir: Path, **options: Any) -> RunningAggregator:
    """``ncina.harness.aggregators.launch_aggregator`` for any backend of
    ``AGGREGATOR_BACKENDS`` (``aggregator_command``); ``wait_ready`` waits for it."""
    return aggregators.launch_aggregator(backend, workdir, command=aggregator_command, **options)


def uplink(
    *,
    job: int,
    rank: int,
    slot: int,
    offset: int,
    codes: bytes | Sequence[int],
    emin: int,
    pool: int = 0,
    retx: bool = False,
    **fields: Any,
) -> bytes:
    """A worker's datagram (ncina header and NC8 payload) built with scapy.

    ``count`` defaults to the number of codes; any other header field can be overridden through
    ``fields`` (``flags=...``, ``format=1``, ``version=2``, ``count=...``) to craft bad packets.
    """
    payload = bytes(codes)
    header: dict[str, Any] = {
        "flags": (0x04 if pool else 0) | (0x02 if retx else 0),
        "format": 0,
        "emin": emin,
        "job": job,
        "rank": rank,
        "slot": slot,
        "count": len(payload),
        "offset": offset,
    }
    header.update(fields)
    return bytes(NcinaHeader(**header) / Raw(payload))


def code_values(codes: Iterable[int]) -> list[int]:
    """Integer value of each NC8 code in units of 2**e_min: 0 or +-2**(c - 1), computed here
    independently of the codec under test."""
    return [0 if c & 0x7F == 0 else (-1 if c & 0x80 else 1) << ((c & 0x7F) - 1) for c in codes]


def exact_sums(per_worker_codes: Iterable[Sequence[int]]) -> list[int]:
    """Element-wise exact sum of the workers' code values (units of 2**e_min)."""
    return [sum(column) for column in zip(*(code_values(c) for c in per_worker_codes), strict=True)]


def is_nc8_rounding(code: int, exact: int) -> bool:
    """Whether ``code`` is one of the two powers of two around ``exact`` (same sign), as the
    aggregator's unbiased re-compression must produce; ``exact == 0`` needs code 0."""
    value = code_values([code])[0]
    if exact == 0:
        return value == 0
    low = 1 << (abs(exact).bit_length() - 1)  # 2**h <= |exact| < 2**(h + 1)
    return value in ((low, 2 * low) if exact > 0 else (-low, -2 * low))


def dissect(datagram: bytes) -> tuple[dict[str, int], bytes]:
    """Header fields and payload of a datagram, dissected with the scapy layer."""
    layer = NcinaHeader(datagram)
    fields = {f.name: int(layer.getfieldval(f.name)) for f in NcinaHeader.fields_desc}
    return fields, bytes(layer.payload)


class Worker:
    """A worker's UDP socket on 127.0.0.1 (its own port) talking to one aggregator address."""

    def __init__(self, aggregator: Address, timeout: float = 10.0) -> None:
        self.aggregator = aggregator
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((source_address(aggregator), 0))
        self.socket.settimeout(timeout)
        self.address: Address = self.socket.getsockname()

    def send(self, datagram: bytes) -> None:
        self.socket.sendto(datagram, self.aggregator)

    def receive(self) -> bytes:
        """The next datagram (``TimeoutError`` if none comes); it must come from the aggregator's
        listening address and port."""
        data, source = self.socket.recvfrom(0xFFFF)
        assert source == self.aggregator, f"datagram from {source}, not {self.aggregator}"
        return data

    def close(self) -> None:
        self.socket.close()



def window_e_min(workers: int, e_max: int = 10, sum_bits: int = 62) -> int:
    """The job's e_min as docs/protocol.md derives it: e_max - (62 - ceil(log2(workers))), or
    with ``sum_bits`` 30 (int32 results) e_max - (30 - ceil(log2(workers)))."""
    return e_max - (sum_bits - (workers - 1).bit_length())


class Cluster:
    """One job on a running aggregator, with one ``Worker`` socket per rank.

    ``open`` completes the ``PING_SLOTS`` first slots (version 0) once, so every rank's address
    is learned and any rank can ``ping``: a retransmission for one of them, whose stored result
    must be the next datagram the rank receives, which proves that nothing else was sent to it
    meanwhile and that the aggregator has handled everything sent before. Pings take the slots
    in turn: rule 2 answers a member 4 times at once per slot (then once a second), and a
    module's tests ping more often than that.
    """

    PING_SLOTS = 16

    def __init__(self, aggregator: RunningAggregator, *, job: int, workers: int, k: int) -> None:
        self.aggregator = aggregator
        self.job = job
        self.k = k
        self.emin = window_e_min(workers)
        self.workers = [Worker(aggregator.address) for _ in range(workers)]
        self._next_slot = self.PING_SLOTS
        self._pings = [0] * workers

    def open(self) -> Cluster:
        """Complete the ping slots; returns self. Every rank's first packet completes no slot
        (the last rank's is slot 1's, the others' slot 0's) and the aggregator learns every
        rank (``wait_learned``) before the first result: a copy of a result for a rank whose
        entries the twin's control plane has not installed yet is lost."""
        ones = [[1] * self.k] * len(self.workers)
        last = len(self.workers) - 1
        for rank in range(last):
            self.send(rank, 0, ones[rank])
        self.send(last, 1, ones[last])
        wait_learned(self.aggregator, len(self.workers))
        self.send(last, 0, ones[last])
        results = [[self.receive(rank)[:2] for rank in range(last + 1)]]
        for rank in range(last):
            self.send(rank, 1, ones[rank])
        results.append([self.receive(rank)[:2] for rank in range(last + 1)])
        results += [self.reduce(slot, ones) for slot in range(2, self.PING_SLOTS)]
        # Per rank, per ping slot: the stored result a ping gets.
        self._ping_replies = [[slot[rank][0] for slot in results]
                              for rank in range(len(self.workers))]  # fmt: skip
        # The aggregator's generation (docs/protocol.md), in bits 3-6 of every result's flags.
        self.generation = results[0][0][1]["flags"] >> 3 & 0xF
        return self

    def next_slot(self) -> int:
        """A slot no test has used yet (tests sharing a cluster each take their own)."""
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def packet(
        self, rank: int, slot: int, codes: bytes | Sequence[int], *, offset: int | None = None,
        **fields: Any,
    ) -> bytes:  # fmt: skip
        """Rank's uplink datagram for ``slot`` (offset ``slot * k`` unless given)."""
        offset = slot * self.k if offset is None else offset
        fields = {"job": self.job, "emin": self.emin, **fields}
        return uplink(rank=rank, slot=slot, offset=offset, codes=codes, **fields)

    def send(self, rank: int, slot: int, codes: bytes | Sequence[int], **fields: Any) -> None:
        self.workers[rank].send(self.packet(rank, slot, codes, **fields))

    def receive(self, rank: int) -> tuple[bytes, dict[str, int], bytes]:
        """The next datagram of ``rank``: raw, header fields, payload."""
        datagram = self.workers[rank].receive()
        fields, payload = dissect(datagram)
        return datagram, fields, payload

    def reduce(
        self, slot: int, codes: Sequence[Sequence[int]], **fields: Any
    ) -> list[tuple[bytes, dict[str, int]]]:
        """Every rank sends its codes for ``slot``; returns each rank's result (raw, fields)."""
        for rank, c in enumerate(codes):
            self.send(rank, slot, c, **fields)
        return [self.receive(rank)[:2] for rank in range(len(self.workers))]

    def ping(self, rank: int) -> None:
        """Assert that the next datagram of ``rank`` is the reply to a retransmission now."""
        slot = self._pings[rank] % self.PING_SLOTS
        self._pings[rank] += 1
        self.send(rank, slot, [1] * self.k, retx=True)
        datagram, fields, _ = self.receive(rank)
        assert datagram == self._ping_replies[rank][slot], (
            f"unexpected datagram before ping: {fields}")

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def wait_learned(aggregator: RunningAggregator, members: int, timeout: float = 10.0) -> None:
    """Wait until ``aggregator`` addresses ``members`` ranks' copies of a result. The twin
    learns a rank through a digest and its control plane's entries (its stats' ``learning``
    section, docs/tofino.md "How the twin learns members"); every other backend at the rank's
    first valid packet, which a later datagram's answer proves handled."""
    deadline = time.monotonic() + timeout
    while (learning := aggregator.stats().get("learning")) is not None:
        if learning["members"] >= members:
            return
        assert time.monotonic() < deadline, f"{members} members not learned: {learning}"
        time.sleep(0.01)


def counters(stats: dict[str, Any], job: int) -> collections.Counter[str]:
    """The document flattened to ``section.counter`` / ``section.drops.reason`` counts."""
    flat: collections.Counter[str] = collections.Counter()
    for name, section in (("global", stats["global"]), ("job", stats["jobs"][str(job)])):
        for key, value in section.items():
            if key == "drops":
                flat.update({f"{name}.drops.{r}": n for r, n in value.items()})
            else:
                flat[f"{name}.{key}"] = value
    return flat


def assert_sent_once_plus_retransmissions(fabric: dict[str, Any], chunks: int) -> None:
    """Workers' counters (``AllreduceClient.stats``, or their sum) of a run that sent ``chunks``
    chunks: each one sent at least once, and any more sends were retransmissions. Their number
    depends on the machine's load (a busy scheduler outruns the timer), so it is not fixed; a
    re-send refused by a full send buffer counts in ``retransmissions`` only."""
    assert chunks <= fabric["packets_sent"] <= chunks + fabric["retransmissions"], (
        f"{fabric['packets_sent']} packets sent for {chunks} chunks and "
        f"{fabric['retransmissions']} retransmissions"
    )


class RankRelay(threading.Thread):
    """A UDP relay on loopback between ``ranks`` workers and an aggregator, one socket pair per
    rank (so the aggregator sees one address per rank), on a thread of its own: rank ``rank``
    sends to ``address(rank)``. Subclasses decide per datagram: ``uplink`` (a worker's: forward
    it, and take its source as the rank's address?) and ``downlink`` (the aggregator's: forward
    it to the rank?). ``error`` is what stopped the thread early, if anything (a dead relay
    looks like a hang to the test)."""

    def __init__(self, aggregator: Address, ranks: int) -> None:
        super().__init__(daemon=True)
        self.aggregator = aggregator
        self.selector = selectors.DefaultSelector()
        self.front: list[socket.socket] = []  # where rank r sends
        self.back: list[socket.socket] = []  # rank r's socket towards the aggregator
        for rank in range(ranks):
            for side, sockets in (("front", self.front), ("back", self.back)):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind(("127.0.0.1", 0))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                sock.setblocking(False)
                self.selector.register(sock, selectors.EVENT_READ, (side, rank))
                sockets.append(sock)
        self.workers: list[Address | None] = [None] * ranks
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def address(self, rank: int) -> Address:
        return self.front[rank].getsockname()

    def uplink(self, rank: int, data: bytes) -> bool:
        """Whether rank ``rank``'s datagram goes on to the aggregator."""
        return True

    def downlink(self, rank: int, data: bytes) -> bool:
        """Whether the aggregator's datagram for rank ``rank`` goes on to it."""
        return True

    def run(self) -> None:
        try:
            self._forward()
        except BaseException as exc:  # reported by the test
            self.error = exc
            raise

    def _forward(self) -> None:
        while not self.stopping.is_set():
            for entry, _ in self.selector.select(0.05):
                side, rank = entry.data
                while True:
                    try:
                        data, source = entry.fileobj.recvfrom(65535)  # type: ignore[union-attr]
                    except BlockingIOError:
                        break
                    if side == "front":
                        if self.uplink(rank, data):
                            self.workers[rank] = source
                            self.back[rank].sendto(data, self.aggregator)
                    elif self.downlink(rank, data) and self.workers[rank] is not None:
                        self.front[rank].sendto(data, self.workers[rank])

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        for sock in (*self.front, *self.back):
            sock.close()


class HoldingRelay(RankRelay):
    """A ``RankRelay``, started at once, that stops forwarding either way at a chosen point of
    the job, whatever the machine's speed: the workers then stand still there until
    :meth:`release` (a test restarts the aggregator meanwhile). ``held`` is set while it
    holds. ``received`` counts the datagrams rank 0 got from the aggregator, ``results`` each
    rank's distinct results (their ``offset``, the chunk's sequence number: a result resent
    after a retransmission counts once)."""

    def __init__(self, aggregator: Address, ranks: int) -> None:
        super().__init__(aggregator, ranks)
        self.received = 0
        self.results: list[set[int]] = [set() for _ in range(ranks)]
        self.hold_after: int | None = None  # datagrams to rank 0
        self.hold_before: int | None = None  # distinct results to any rank
        self.held = threading.Event()
        self.start()

    def hold_at(self, count: int) -> None:
        """Hold once rank 0 has received ``count`` datagrams in all."""
        self.held.clear()
        self.hold_after = count

    def hold_before_result(self, count: int) -> None:
        """Hold as soon as some rank is about to receive its ``count``-th distinct result (held
        too). A call's results exist only once every rank has completed the call before, so
        holding before the first result of call ``n`` leaves every rank with ``n - 1`` calls
        completed and none with ``n``: all of them fail call ``n`` together."""
        self.held.clear()
        self.hold_before = count

    def release(self) -> None:
        self.hold_after = self.hold_before = None
        self.held.clear()

    def uplink(self, rank: int, data: bytes) -> bool:
        return not self.held.is_set()  # dropped both ways while held: the aggregator is "gone"

    def downlink(self, rank: int, data: bytes) -> bool:
        if self.held.is_set():
            return False
        if len(data) >= HEADER.size:
            _, flags, fmt, _, _, _, _, count, offset = HEADER.unpack_from(data)
            result = flags & FLAG_RESULT and count and fmt != Format.JOB  # not a notice, a hello
            if result and offset not in self.results[rank]:
                if self.hold_before is not None and len(self.results[rank]) + 1 >= self.hold_before:
                    self.held.set()
                    return False
                self.results[rank].add(offset)
        if rank == 0:
            self.received += 1
            if self.hold_after is not None and self.received >= self.hold_after:
                self.held.set()  # this one still goes through
        return True


def engine_process(
    engine: Any, datagram: bytes, src: tuple[str, int], agg_ip: str, stride: int = 2048
) -> list[tuple[bytes, tuple[str, int]]]:
    """One datagram from ``src`` through the C engine (``ncina.aggregator.engine.Engine``)
    offline, as the aggregator at ``agg_ip``; its replies as (datagram, (host, port)), each at
    most ``stride`` bytes."""
    import ipaddress

    ffi, lib = engine.ffi, engine.lib
    out = ffi.new(f"uint8_t[{stride * 64}]")
    lens, ips, ports = ffi.new("uint32_t[64]"), ffi.new("uint32_t[64]"), ffi.new("uint16_t[64]")
    n = lib.nce_process_datagram(datagram, len(datagram), ipaddress.IPv4Address(src[0]).packed,
                                 src[1], ipaddress.IPv4Address(agg_ip).packed, out, stride, 64,
                                 lens, ips, ports)  # fmt: skip
    assert n >= 0, "reply buffers too small"
    buf, addresses = ffi.buffer(out), bytes(ffi.buffer(ips))  # addresses in network order
    replies = []
    for i in range(n):
        host = str(ipaddress.IPv4Address(addresses[4 * i : 4 * i + 4]))
        replies.append((bytes(buf[i * stride : i * stride + lens[i]]), (host, int(ports[i]))))
    return replies
