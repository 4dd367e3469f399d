"""Hierarchical (leaf-spine) aggregation: a leaf aggregator's upstream side, and a spine's slots.

docs/protocol.md, "Hierarchical aggregation", is the specification. In short:

- a **leaf** (``LeafAggregator`` around one ``LeafSlots`` job) serves its ``W`` workers like a
  one-level aggregator, but a slot version that completes is not encoded: its exact integer sum
  goes to the spine as an ``int`` uplink datagram (same job, slot, pool version, offset and count,
  rank the leaf's index at the spine) and is kept. The spine's result for that chunk is stored as
  the slot's result and sent to the leaf's workers, exactly as a one-level aggregator sends its
  own; a worker's retransmission while the leaf waits for the spine re-sends the partial sum;
- a **spine** (``SpineSlots``) is an aggregator whose members are the ``L`` leaves: it adds their
  int partial sums (each bounded by what ``N / L`` workers can sum, else ``bad_code``) in the
  same slots and rules, and re-compresses or sends int results;
- every aggregator and worker of the job uses the window of the total number of workers ``N``,
  so codes, partial sums and results share one fixed-point scale and the spine's sum is the
  one-level sum over all ``N`` workers, bit for bit (with nc8 results: the same rounding bits,
  keyed by the chunk, not by the topology).

Before serving, a leaf does the spine's job handshake as a member (``LeafAggregator.join``); a
mismatch raises ``JobMismatchError`` naming each parameter, as a worker's handshake does.
"""

from __future__ import annotations

import argparse
import select
import socket
import time
from typing import Any, Protocol

import numpy as np
from ncina.aggregator import reply
from ncina.aggregator.admission import BAD_SLOT, STALE_GENERATION, UNKNOWN_JOB, WINDOW_MISMATCH
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.members import BAD_TAG, NON_MEMBER
from ncina.aggregator.pipeline import Aggregator
from ncina.aggregator.reply import NOTHING, Datagrams
from ncina.aggregator.slots import JobSlots
from ncina.aggregator.stats import JobStats
from ncina.proto import tag
from ncina.proto.descriptor import (
    JOB_DATAGRAM_SIZE,
    NO_SUCH_JOB,
    NOT_AUTHENTIC,
    OK,
    UPLINK_INT,
    Descriptor,
    JobMismatchError,
    is_job_datagram,
    job_datagram_length,
    key_mismatch,
    mismatches,
    pack_job_datagram,
)
from ncina.proto.header import (
    BAD_COUNT,
    BAD_FLAGS,
    BAD_FORMAT,
    BAD_LENGTH,
    BAD_VERSION,
    FLAG_POOL,
    FLAG_RESULT,
    FLAG_RETX,
    FLAG_TAG,
    GENERATION_MASK,
    GENERATION_SHIFT,
    HEADER,
    INT_DTYPE,
    NOTICE,
    TRUNCATED,
    VERSION,
    Format,
    ProtocolError,
    parse,
)
from ncina.proto.job import JobSpec
from ncina.proto.wire import HEADER_SIZE, TAG_SIZE

from ncina.common.address import Address, peer_address

HANDSHAKE_TIMEOUT = 5.0  # seconds a leaf waits for its spine's answer (the spine may start late)
HANDSHAKE_INTERVAL = 0.1  # seconds between two hellos while no answer came (as a worker's)

_INT = int(Format.INT)

# Why a datagram from the spine was dropped at a leaf (the ``upstream`` stats section).
UPSTREAM_DROP_REASONS = (
    TRUNCATED,
    BAD_VERSION,
    BAD_FORMAT,
    BAD_COUNT,
    BAD_LENGTH,
    UNKNOWN_JOB,
    BAD_TAG,
    BAD_FLAGS,
    NON_MEMBER,
    WINDOW_MISMATCH,
    BAD_SLOT,
    STALE_GENERATION,
)
UPSTREAM_COUNTERS = (
    "packets_in",
    "bytes_in",
    "packets_out",
    "bytes_out",
    "sent",
    "resent",
    "results",
    "late",
    "notices",
    "handshakes",
    "hellos",
)


class UpstreamStats:
    """A leaf's counters of its traffic with the spine (docs/protocol.md, "Counters":
    ``upstream``)."""

    __slots__ = (*UPSTREAM_COUNTERS, "drops")

    def __init__(self) -> None:
        for name in UPSTREAM_COUNTERS:
            setattr(self, name, 0)
        self.drops = dict.fromkeys(UPSTREAM_DROP_REASONS, 0)

    def to_json(self) -> dict[str, Any]:
        """The counters, in the order of the document (``drops`` last)."""
        doc: dict[str, Any] = {name: getattr(self, name) for name in UPSTREAM_COUNTERS}
        doc["drops"] = dict(self.drops)
        return doc


class Upstream:
    """Where a leaf sends its partial sums: the spine's ``address``, the leaf's ``rank`` there,
    the spine's generation (learned by the handshake) and the counters."""

    def __init__(self, address: Address, rank: int) -> None:
        self.address = address
        self.rank = rank
        self.generation = 0
        self.stats = UpstreamStats()

    def forward(self, leaf: JobSlots, version: int, slot: int, retx: bool = False) -> Datagrams:
        """The exact sum of the leaf's waiting ``(slot, version)`` as an uplink datagram to the
        spine: when the slot completes (``sent``), and again, with ``RETX``, for a worker's
        retransmission while it waits (``resent``). ``pipeline.py`` calls it for a job whose
        ``upstream`` is set. The sum is the slot version's accumulators, which no packet can
        change while it waits (every worker's bit is set: the slot rules answer each packet
        with a resend, a drop or a duplicate, none with a contribution)."""
        stats = self.stats
        if retx:
            stats.resent += 1
        else:
            stats.sent += 1
        flags = (
            (FLAG_POOL if version else 0) | (FLAG_RETX if retx else 0)
            | self.generation << GENERATION_SHIFT | leaf.tag_flag
        )
        count = leaf.counts[version][slot]
        datagram = HEADER.pack(
            VERSION, flags, _INT, leaf.emin, leaf.config.job, self.rank, slot, count,
            leaf.offsets[version][slot],
        ) + leaf.accumulators[version, slot, :count].astype(INT_DTYPE).tobytes()  # fmt: skip
        if leaf.key is not None:
            datagram = tag.sign(leaf.key, datagram)
        stats.packets_out += 1
        stats.bytes_out += len(datagram)
        return ((datagram, self.address),)


class SpineLink(Protocol):
    """Where a leaf's job handshake talks to its spine (``LeafAggregator.join``): a socket
    (``SocketLink``), or a data plane's port (the dpdk backend)."""

    def send(self, datagram: bytes) -> None:
        """Send ``datagram`` to the spine (it may be lost: the handshake asks again)."""

    def receive(self, timeout: float) -> tuple[bytes, Address] | None:
        """The next datagram to the leaf and its source, waiting at most ``timeout`` seconds;
        None when none came."""


class SocketLink:
    """``SpineLink`` over a UDP socket (the leaf's own: the spine learns its address from it)."""

    def __init__(self, sock: socket.socket, spine: Address) -> None:
        self.sock = sock
        self.spine = spine

    def send(self, datagram: bytes) -> None:
        self.sock.sendto(datagram, self.spine)

    def receive(self, timeout: float) -> tuple[bytes, Address] | None:
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable:
            return None
        datagram, source = self.sock.recvfrom(0xFFFF)
        return datagram, source


class SpineSlots(JobSlots):
    """A spine's job: the slot rules of ``JobSlots`` over ``int`` uplink payloads, the exact
    partial sums of leaves of ``total / workers`` workers each.

    An element beyond what that many workers can sum (``N / L * 2**span`` in absolute value) is
    dropped as ``bad_code``: the bound keeps the sum of the ``L`` partial sums within
    ``N * 2**span <= 2**62``, so no input can overflow the accumulators."""

    uplink_format = _INT

    def __init__(self, config: JobConfig, stats: JobStats | None = None) -> None:
        if config.uplink_format != Format.INT:
            raise ValueError("a spine's job has int uplink (JobConfig.uplink_format)")
        super().__init__(config, stats)
        self._bound = config.total // config.workers << config.window.span

    def decode(self, payload: memoryview | bytes, count: int) -> np.ndarray | None:
        """The int partial sums of a payload, or ``None`` if one is beyond the bound
        (``bad_code``)."""
        values = np.frombuffer(payload, dtype=INT_DTYPE).astype(np.int64)
        bound = self._bound
        if ((values > bound) | (values < -bound)).any():
            return None
        return values


class LeafSlots(JobSlots):
    """A leaf's job: the slot rules of ``JobSlots`` for its workers, but a complete slot's sum is
    not encoded: it stays in the accumulators and goes to the spine (``upstream``, which
    ``pipeline.py`` calls), and the spine's result becomes the slot's result (``take_result``).
    A slot version is *waiting* from its completion at the leaf until the spine's result for it
    arrives: complete, with an empty stored result."""

    def __init__(
        self, config: JobConfig, upstream: Upstream, stats: JobStats | None = None
    ) -> None:
        if config.uplink_format != Format.NC8:
            raise ValueError("a leaf's workers send nc8 codes: a spine cannot be a leaf")
        super().__init__(config, stats)
        self.upstream = upstream
        self.restarts = 0  # times a hello started the job afresh (``LeafAggregator.handle``)

    def waiting(self, version: int, slot: int) -> bool:
        """Whether ``(slot, version)`` is complete here and its spine result has not come."""
        return self.seen[version][slot] >= self.workers and not self.results[version][slot]

    def encode(self, acc: np.ndarray, version: int, slot: int, offset: int) -> bytes:
        """No result yet: the sum goes to the spine, the slot waits (an empty result)."""
        return b""

    def take_result(
        self, version: int, slot: int, offset: int, count: int, payload: memoryview | bytes
    ) -> Datagrams | None:
        """The spine's result for ``(slot, version)`` at ``offset``: stored and sent to every
        worker if the slot waits for exactly that chunk, else None (a late or duplicate result,
        which changes nothing)."""
        if (
            not self.waiting(version, slot)
            or self.offsets[version][slot] != offset
            or self.counts[version][slot] != count
        ):
            return None
        self.results[version][slot] = bytes(payload)
        self.stats.results_sent += self.workers
        return reply.results(self, version, slot, range(self.workers))

    def restart_if_idle(self) -> bool:
        """As ``JobSlots.restart_if_idle``; a slot waiting for the spine is not idle."""
        if any(self.waiting(v, s) for v in (0, 1) for s in range(self.pool_size)):
            return False
        restarted = super().restart_if_idle()
        self.restarts += restarted
        return restarted


class LeafAggregator(Aggregator):
    """An aggregator whose one job (``add_leaf``) is a leaf of the spine at ``upstream``:
    datagrams from the spine's address go to ``from_spine``, every other one to the ordinary
    path. ``join`` does the spine's job handshake before serving."""

    def __init__(
        self, upstream: Upstream, generation: int = 0,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:  # fmt: skip
        super().__init__(generation)
        self.upstream = upstream
        self.handshake_timeout = handshake_timeout
        self.leaf: LeafSlots | None = None

    def add_leaf(self, config: JobConfig) -> LeafSlots:
        """Install the leaf's job; ``config.total`` must be a multiple of its workers."""
        if config.total % config.workers:
            raise ValueError(
                f"a leaf's {config.total} total workers must be a multiple of its "
                f"{config.workers} workers (every leaf of the spine serves as many)"
            )
        leaves = config.total // config.workers
        if not 0 <= self.upstream.rank < leaves:
            raise ValueError(
                f"upstream rank {self.upstream.rank} is not in 0..{leaves - 1}: the spine has "
                f"{leaves} leaves ({config.total} workers in total, {config.workers} a leaf)"
            )
        leaf = LeafSlots(config, self.upstream)
        self.install(leaf)
        self.leaf = leaf
        return leaf

    def handle(self, datagram: bytes | bytearray | memoryview, source: Address) -> Datagrams:
        """As ``Aggregator.handle``; datagrams from the spine go to ``from_spine``. A worker's
        hello that starts the leaf's job afresh (a new set of workers, offsets from 0 again) also
        sends the leaf's hello to the spine, which then starts afresh too if it is idle (else
        the spine would take the new partial sums for late ones)."""
        if source == self.upstream.address:
            return self.from_spine(datagram)
        leaf = self.leaf
        restarts = leaf.restarts if leaf is not None else 0
        out = super().handle(datagram, source)
        if leaf is not None and leaf.restarts != restarts:
            return [*out, (self.hello(), self.upstream.address)]
        return out

    def hello(self) -> bytes:
        """The leaf's hello to the spine (``hello_datagram``), counted: the caller sends it."""
        hello = self.hello_datagram()
        stats = self.upstream.stats
        stats.hellos += 1
        stats.packets_out += 1
        stats.bytes_out += len(hello)
        return hello

    def hello_datagram(self) -> bytes:
        """The leaf's hello to the spine, its descriptor of the spine's job as member ``R``
        (the C engine's leaf sends it too: ``Engine.set_upstream``)."""
        leaf = self.leaf
        assert leaf is not None
        config = leaf.config
        return pack_job_datagram(self.spine_descriptor(), job=config.job,
                                 rank=self.upstream.rank, key=config.key)  # fmt: skip

    def spine_descriptor(self) -> Descriptor:
        """The spine's job as this leaf holds it: ``N / W`` members sending int partial sums,
        the leaf's result format, pool, K and the window of ``N``."""
        leaf = self.leaf
        assert leaf is not None
        config = leaf.config
        return Descriptor(
            mode=int(config.result_format), workers=config.total // config.workers,
            pool_size=config.pool_size, k=config.k, e_max=config.window.e_max,
            e_min=config.window.e_min, keyed=config.key is not None, compressor=0,
            uplink=UPLINK_INT,
        )  # fmt: skip

    def from_spine(self, datagram: bytes | bytearray | memoryview) -> Datagrams:
        """A datagram from the spine's address: a result for a waiting slot is stored and sent
        to the workers; anything else is counted (``upstream`` section) and changes nothing."""
        up = self.upstream
        st = up.stats
        size = len(datagram)
        st.packets_in += 1
        st.bytes_in += size
        if is_job_datagram(datagram):  # an answer to a hello (a late one: only counted)
            st.handshakes += 1
            return NOTHING
        leaf = self.leaf
        assert leaf is not None
        if size < HEADER_SIZE:
            return self._drop_upstream(TRUNCATED)
        version_field, flags, fmt, emin, job, rank, slot, count, offset = HEADER.unpack_from(
            datagram
        )
        if version_field != VERSION:
            return self._drop_upstream(BAD_VERSION)
        if job != leaf.config.job:
            return self._drop_upstream(UNKNOWN_JOB)
        key = leaf.key
        if (key is not None or flags & FLAG_TAG) and not (
            flags & FLAG_TAG and key is not None and tag.verify(key, datagram)
        ):
            return self._drop_upstream(BAD_TAG)
        if not flags & FLAG_RESULT:
            return self._drop_upstream(BAD_FLAGS)
        generation = (flags & GENERATION_MASK) >> GENERATION_SHIFT
        if count == 0:  # a notice: the spine still waits for another leaf
            body = size - HEADER_SIZE - (TAG_SIZE if flags & FLAG_TAG else 0)
            if body not in (0, NOTICE.size):  # a restart notice has no bitmap
                return self._drop_upstream(BAD_LENGTH)
            if generation != up.generation:
                return self._drop_upstream(STALE_GENERATION)
            st.notices += 1
            return NOTHING
        try:
            _, payload = parse(datagram)
        except ProtocolError as exc:
            return self._drop_upstream(exc.reason)
        if fmt != int(leaf.config.result_format):
            return self._drop_upstream(BAD_FORMAT)
        if emin != leaf.config.window.e_min:
            return self._drop_upstream(WINDOW_MISMATCH)
        if rank != up.rank:
            return self._drop_upstream(NON_MEMBER)
        if slot >= leaf.config.pool_size:
            return self._drop_upstream(BAD_SLOT)
        if count > leaf.config.k:
            return self._drop_upstream(BAD_COUNT)
        if generation != up.generation:  # the spine restarted: its slots are lost
            return self._drop_upstream(STALE_GENERATION)
        out = leaf.take_result((flags & FLAG_POOL) >> 2, slot, offset, count, payload)
        if out is None:
            st.late += 1
            return NOTHING
        st.results += 1
        return out

    def _drop_upstream(self, reason: str) -> Datagrams:
        self.upstream.stats.drops[reason] += 1
        return NOTHING

    def join(self, link: socket.socket | SpineLink) -> None:
        """The spine's job handshake, on the leaf's own socket or port (``link``: the spine
        learns the leaf's address from its partial sums, sent from there): a hello every
        ``HANDSHAKE_INTERVAL`` seconds until the spine answers, at most ``handshake_timeout``
        seconds. Learns the spine's generation. Raises ``JobMismatchError`` naming every
        parameter the spine's job has otherwise (or the job id, or the key), ``TimeoutError``
        without an answer. Datagrams from other sources meanwhile are not served (workers ask
        again)."""
        if isinstance(link, socket.socket):
            link = SocketLink(link, self.upstream.address)
        leaf = self.leaf
        assert leaf is not None
        up = self.upstream
        config = leaf.config
        mine = self.spine_descriptor()
        host, port = up.address
        where = f"job {config.job} at spine {host}:{port}"
        sides = ("leaf", "spine")
        no_such_job = False
        now = time.monotonic()
        end = now + self.handshake_timeout
        next_hello = now
        while now < end:
            if now >= next_hello:
                link.send(self.hello())
                next_hello = now + HANDSHAKE_INTERVAL
            received = link.receive(max(0.0, min(next_hello, end) - now))
            if received is not None:
                datagram, source = received
                answer = None
                if source == up.address:  # anything else from the spine is of no use yet
                    up.stats.packets_in += 1
                    up.stats.bytes_in += len(datagram)
                    answer = self._answer(datagram)
                    if answer is None:
                        up.stats.drops[BAD_FLAGS] += 1
                if answer is not None:
                    status, theirs, generation = answer
                    up.stats.handshakes += 1
                    if status == NOT_AUTHENTIC:
                        raise JobMismatchError(
                            [key_mismatch(config.key is not None, theirs.keyed)], where, sides
                        )
                    if status == NO_SUCH_JOB:  # it may be installed yet: keep asking
                        no_such_job = True
                    else:
                        wrong = mismatches(mine, theirs)
                        if wrong:
                            raise JobMismatchError(wrong, where, sides)
                        up.generation = generation
                        return
            now = time.monotonic()
        if no_such_job:
            raise JobMismatchError([("job id", str(config.job), "has no such job")], where, sides)
        raise TimeoutError(
            f"no answer to the job handshake from spine {host}:{port} within "
            f"{self.handshake_timeout:g} s (job {config.job}, leaf rank {up.rank}): is it "
            "running with --uplink int?"
        )

    def _answer(self, datagram: bytes) -> tuple[int, Descriptor, int] | None:
        """``(status, descriptor, generation)`` of the spine's answer to this leaf's hello, or
        None for any other datagram (an ``OK`` answer of a keyed job must verify)."""
        leaf = self.leaf
        assert leaf is not None
        size = len(datagram)
        if not is_job_datagram(datagram) or size < HEADER_SIZE:
            return None
        _, flags, _, _, job, rank, _, count, _ = HEADER.unpack_from(datagram)
        key = leaf.key
        if (
            not flags & FLAG_RESULT or job != leaf.config.job or rank != self.upstream.rank
            or count != 1 or size != job_datagram_length(flags)
            or (flags & FLAG_TAG and (key is None or not tag.verify(key, datagram)))
        ):
            return None
        status, theirs = Descriptor.unpack(datagram[HEADER_SIZE:JOB_DATAGRAM_SIZE])
        if status == OK and key is not None and not flags & FLAG_TAG:
            return None
        return status, theirs, (flags & GENERATION_MASK) >> GENERATION_SHIFT

    def upstream_document(self) -> dict[str, Any]:
        """The ``upstream`` section of the stats document."""
        up = self.upstream
        host, port = up.address
        return {"spine": f"{host}:{port}", "rank": up.rank, "generation": up.generation,
                **up.stats.to_json()}  # fmt: skip


# ---- ``ncina aggregator`` options ----

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The hierarchical aggregation options of ``ncina aggregator``."""
    group = parser.add_argument_group(
        "hierarchical aggregation (a spine or a leaf: python, socket, dpdk; "
        "docs/protocol.md, 'Hierarchical aggregation')"
    )
    JobSpec.add_arguments(group, "total_workers", "uplink")
    group.add_argument(
        "--upstream", type=peer_address, default=None, metavar="HOST:PORT",
        help="be a leaf of the spine at HOST:PORT: complete slots go up as int partial sums, "
        "the spine's results come back down to this aggregator's workers",
    )  # fmt: skip
    group.add_argument(
        "--upstream-rank", type=int, default=None, metavar="R",
        help="this leaf's rank at the spine, 0..(total workers / workers) - 1",
    )  # fmt: skip
    group.add_argument(
        "--upstream-timeout", type=float, default=HANDSHAKE_TIMEOUT, metavar="SECONDS",
        help="how long a leaf waits for its spine's answer to the job handshake before it "
        "serves (default: %(default)s)",
    )  # fmt: skip


def check_arguments(args: argparse.Namespace) -> bool:
    """Raise ``ValueError`` (one line, the reason) unless the hierarchical options make sense
    together and with the backend and mode; return whether the job is a leaf's or a spine's."""
    leaf = args.upstream is not None
    spine = args.uplink == "int"
    total = args.total_workers
    if not (leaf or spine or args.upstream_rank is not None or total not in (None, args.workers)):
        return False
    if args.backend == "bmv2":
        raise ValueError(
            "hierarchical aggregation (--upstream, --uplink int, --total-workers) is not "
            "available on bmv2: the P4 program does not carry int partial sums"
        )
    if args.mode == "server":
        raise ValueError("hierarchical aggregation is INA mode's: server mode sums floats")
    if leaf and spine:
        raise ValueError("a spine (--uplink int) has no --upstream: the tree has two levels")
    if leaf != (args.upstream_rank is not None):
        raise ValueError("--upstream and --upstream-rank go together (a leaf needs both)")
    if not (leaf or spine):
        raise ValueError("--total-workers is for a leaf (--upstream) or a spine (--uplink int)")
    if args.jobs_dir is not None:
        raise ValueError("--jobs-dir: a leaf or a spine serves the one job of its flags")
    if not args.upstream_timeout > 0:
        raise ValueError(f"--upstream-timeout must be positive, not {args.upstream_timeout}")
    return True


def check_int_frames(config: JobConfig, mtu: int) -> None:
    """Raise ``ValueError`` unless the int partial sums of ``config``'s K elements, which
    leaves send to the spine, fit a link of ``mtu``."""
    try:
        config.check_mtu(mtu, Format.INT)
    except ValueError as exc:
        raise ValueError(f"partial sums sent up as int: {exc}") from None


def check_int_frame_room(config: JobConfig, room: int, limit: str) -> None:
    """Raise ``ValueError`` unless a frame of ``config``'s K int partial sums fits ``room``
    bytes (a data plane's packet buffer, described by ``limit``), as ``check_int_frames``
    does for a link."""
    try:
        config.check_frame_room(room, limit, fmt=Format.INT)
    except ValueError as exc:
        raise ValueError(f"partial sums sent up as int: {exc}") from None


def make_leaf(
    config: JobConfig, args: argparse.Namespace, generation: int
) -> LeafAggregator | None:
    """A C backend's leaf (``--upstream``: the handshake and counters its engine job runs
    with), or None for any other job."""
    if args.upstream is None:
        return None
    made = make_aggregator(config, args, generation)
    assert isinstance(made, LeafAggregator)
    return made


def make_aggregator(
    config: JobConfig, args: argparse.Namespace, generation: int
) -> Aggregator:
    """The aggregator of a leaf (``--upstream``) or a spine (``--uplink int``) for ``config``."""
    check_int_frames(config, args.mtu)
    if args.upstream is None:
        spine = Aggregator(generation)
        spine.install(SpineSlots(config))
        return spine
    leaf = LeafAggregator(Upstream(args.upstream, args.upstream_rank), generation,
                          args.upstream_timeout)  # fmt: skip
    leaf.add_leaf(config)
    return leaf
