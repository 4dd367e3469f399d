"""The aggregator's side of the job handshake (docs/protocol.md, "Job handshake").

A worker sends a ``job`` datagram (its descriptor, ``ncina.proto.descriptor``) before its first
chunk; the aggregator answers with the descriptor of the job of that id as it holds it, or with
"no such job", or, when the hello's authentication is not what the job asks for, with "not
authentic" (the descriptor all the same: a job's parameters are no secret, and the worker then
names the key as the mismatch). An authentic hello that says a new set of workers has come
(``Members.new_set_comes``: a rank of this set with a new incarnation nonce, or a hello to a job
quiet for ``RESTART_IDLE`` seconds) and finds the job idle (no round partly filled) starts its
slots afresh (``JobSlots.restart_if_idle``) and a new set (``Members.new_set``), so that a new
set of workers, from new ports and counting offsets from 0 again, is not taken for strangers
and late packets; a retransmitted hello, a recovery's or a probe carries its client's nonce and
changes nothing, so a rank of a job in use keeps its stored results and its address. A set
started by a new nonce (gated) learns each rank's address from its first hello in it and takes
no other rank (``Members.said_hello``).

An authentic hello joins its rank to this start of the aggregator (``JobSlots.joined``); a
probe (``FLAG_PROBE``) does not, and its answer carries ``FLAG_PROBE`` when the rank has not
joined: the worker's aggregator restarted, whatever generation it drew (docs/protocol.md,
"Generations and notices").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ncina.aggregator.backends.python.admission import UNKNOWN_JOB
from ncina.aggregator.backends.python.members import NEW_INCARNATION, authentic
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.stats import GlobalStats, count_drop
from ncina.proto.descriptor import (
    FLAG_PROBE,
    MODE_SERVER,
    NO_SUCH_JOB,
    NOT_AUTHENTIC,
    NOWHERE,
    OK,
    Descriptor,
    compressor_hash,
    hello_nonce,
    job_datagram_length,
    pack_job_datagram,
)
from ncina.proto.header import BAD_COUNT, BAD_FLAGS, BAD_LENGTH, FLAG_RESULT, HEADER

from ncina.common.address import Address

RESTART_IDLE = 10.0
"""Seconds a job must have been quiet before a hello restarts it: the workers' default deadline
(``AllreduceClient(deadline=...)``), the longest a rank keeps asking for a lost result."""


def job_descriptor(config: JobConfig, compressor: object | None = None) -> Descriptor:
    """The descriptor of a job: INA mode with its result format, or server mode with the hash of
    ``compressor`` (a ``ServerSlots`` job's)."""
    window = config.window
    return Descriptor(
        mode=MODE_SERVER if compressor is not None else int(config.result_format),
        workers=config.workers,
        pool_size=config.pool_size,
        k=config.k,
        e_max=window.e_max,
        e_min=window.e_min,
        keyed=config.key is not None,
        compressor=compressor_hash(compressor) if compressor is not None else 0,
        uplink=int(config.uplink_format),  # UPLINK_MODE (nc8) or UPLINK_INT (a spine)
    )


def answer(
    jobs: Mapping[int, Any],
    global_stats: GlobalStats,
    generation: int,
    datagram: bytes | bytearray | memoryview,
    source: Address,
    quiet: tuple[float, float],
) -> Sequence[tuple[bytes, Address]]:
    """The answer to a ``job`` datagram (``is_job_datagram``) from ``source``; ``jobs`` maps a
    job id to its ``JobSlots``; ``quiet`` is ``(now, restart_idle)``: the job restarts only if
    its last activity (``JobSlots.active_at``) is ``restart_idle`` seconds or more before now.
    Counts it: under the job as a handshake (or a drop when it is malformed), globally as
    ``unknown_job`` when no job has its id (answered all the same)."""
    size = len(datagram)
    _, flags, _, _, job_id, rank, _, count, _ = HEADER.unpack_from(datagram)
    slots = jobs.get(job_id)
    reason = None
    if size != job_datagram_length(flags):
        reason = BAD_LENGTH
    elif count != 1:
        reason = BAD_COUNT
    if slots is None:
        count_drop(global_stats, reason or UNKNOWN_JOB, size)
        if reason is not None:
            return ()
        reply = pack_job_datagram(NOWHERE, job=job_id, rank=rank, status=NO_SUCH_JOB,
                                  answer=True, generation=generation)  # fmt: skip
        return ((reply, source),)
    stats = slots.stats
    stats.packets_in += 1
    stats.bytes_in += size
    if reason is None and flags & FLAG_RESULT:
        reason = BAD_FLAGS
    if reason is not None:
        stats.drops[reason] += 1
        return ()
    key = slots.key
    is_authentic = authentic(key, flags, datagram)
    now, restart_idle = quiet
    nonce = hello_nonce(datagram)
    probe = bool(flags & FLAG_PROBE)
    members = slots.members
    comes = members.new_set_comes(rank, nonce, source, probe=probe,
                                  quiet=now - slots.active_at >= restart_idle)  # fmt: skip
    if is_authentic and comes and slots.restart_if_idle():
        members.new_set(gated=comes == NEW_INCARNATION)
    unjoined = False
    if is_authentic and rank < slots.workers:
        if probe:  # a probe asks and does not join
            unjoined = not slots.joined >> rank & 1
        else:
            slots.joined |= 1 << rank
            if nonce:
                members.said_hello(rank, nonce, source)
    descriptor = job_descriptor(slots.config, getattr(slots, "compressor", None))
    reply = pack_job_datagram(
        descriptor, job=job_id, rank=rank, status=OK if is_authentic else NOT_AUTHENTIC,
        answer=True, generation=generation, key=key if is_authentic else None, probe=unjoined,
    )
    stats.handshakes += 1
    stats.packets_out += 1
    stats.bytes_out += len(reply)
    return ((reply, source),)
