"""Reply: the datagrams the aggregator sends about its slots (docs/protocol.md, "Slots, pool
versions and loss recovery", "Generations and notices", and the flags of "Order of checks").

A complete slot's stored result goes to every member (one unicast each: the emulated multicast),
a member that lost it gets it again alone, and a notice answers a stale packet or a duplicate.
Each carries the aggregator's generation, and a keyed job's tag (one per datagram: the ``rank``
field differs per destination). Every datagram sent is counted here. The C engine's ``reply.c``
and P4's ``reply.p4`` (with ``rewrite.p4`` for the multicast copies) write the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ncina.proto import tag
from ncina.proto.header import FLAG_POOL, FLAG_RESULT, GENERATION_SHIFT, HEADER, NOTICE, VERSION

from ncina.common.address import Address

if TYPE_CHECKING:
    from ncina.aggregator.backends.python.slots import JobSlots

Datagrams = Sequence[tuple[bytes, Address]]
"""What to send: ``(UDP payload, destination)`` pairs, in order."""

NOTHING: Datagrams = ()


def flags(job: JobSlots, version: int) -> int:
    """The flags of a result or notice of ``job`` for pool ``version``: ``RESULT``, ``POOL``,
    the generation and ``TAG`` for a keyed job (``RETX`` clear)."""
    return (
        FLAG_RESULT | (FLAG_POOL if version else 0) | job.generation << GENERATION_SHIFT
        | job.tag_flag
    )


def results(job: JobSlots, version: int, slot: int, ranks: Sequence[int]) -> Datagrams:
    """The stored result of ``(slot, version)``, one datagram for each of ``ranks``, each to the
    rank's address."""
    payload = job.results[version][slot]
    head = flags(job, version)
    offset = job.offsets[version][slot]
    count = job.counts[version][slot]
    fmt, emin, job_id, members = job.result_format, job.emin, job.config.job, job.members
    out = [
        (HEADER.pack(VERSION, head, fmt, emin, job_id, rank, slot, count, offset) + payload,
         members[rank])
        for rank in ranks
    ]  # fmt: skip
    if job.key is not None:
        out = [(tag.sign(job.key, datagram), to) for datagram, to in out]
    stats = job.stats
    stats.packets_out += len(out)
    stats.bytes_out += sum(len(datagram) for datagram, _ in out)
    return out  # type: ignore[return-value]  # every rank of a complete slot has an address


def notice(
    job: JobSlots, rank: int, version: int, slot: int, offset: int, bitmap: int | None,
    destination: Address,
) -> Datagrams:  # fmt: skip
    """A notice to ``rank`` about its packet for ``(slot, version)`` at ``offset``: the
    aggregator's generation in the flags and the bitmap of the contributors it holds, or, with
    ``bitmap`` None, no bitmap (a restart notice: the header alone, no longer than any packet
    that reaches the generation check, so that it answers a stale packet of any length without
    amplifying a forged one)."""
    datagram = HEADER.pack(
        VERSION, flags(job, version), job.result_format, job.emin, job.config.job,
        rank, slot, 0, offset,
    ) + (b"" if bitmap is None else NOTICE.pack(bitmap))
    if job.key is not None:
        datagram = tag.sign(job.key, datagram)
    stats = job.stats
    stats.notices_sent += 1
    stats.packets_out += 1
    stats.bytes_out += len(datagram)
    return ((datagram, destination),)
