"""The aggregator's logic without sockets: datagram in, datagrams out (docs/protocol.md).

``Aggregator.handle`` takes one datagram through the concepts in the order of "Order of
checks": parse (steps 1-5, ``parse.py``), the job (6, ``admission.py``), the tag (7,
``members.py``), the job's checks (8-15, ``admission.py``, which asks ``members.py`` at 10), the
member learned (16), the slot rules and the contribution (``slots.py``) and what goes back
(``reply.py``). A ``job`` datagram is the handshake (``handshake.py``). The C engine's
``pipeline.c`` (``nce_input``) and P4's ingress control (``ncina.p4``) run the same order.

Backends with their own data path (socket, DPDK, BMv2) are checked against this module: feed the
same datagrams to both and compare what comes out and the counters. docs/architecture.md maps
every concept to its file in each backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ncina.aggregator.backends.python import admission, handshake, members, parse, reply
from ncina.aggregator.backends.python.reply import NOTHING, Datagrams
from ncina.aggregator.backends.python.slots import (
    CONTRIBUTE,
    DEFAULT_MAX_RESIDUAL_ELEMENTS,
    DUPLICATE,
    RESEND,
    RESEND_INTERVAL,
    RESEND_LIMIT,
    JobSlots,
    ServerSlots,
)
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.stats import GlobalStats, LimitStats, count_drop
from ncina.proto.compressors import Compressor
from ncina.proto.descriptor import is_job_datagram
from ncina.proto.header import FLAG_POOL, FLAG_RETX

from ncina.common.address import Address


class Aggregator:
    """Every job of one aggregator, keyed by job id, and the datagram-level validation.

    ``generation`` (1..15) goes on every result and notice; uplink packets that carry another
    non-zero generation are stale (docs/protocol.md, "Generations and notices"). 0, the
    default, keeps protocol version 1 without generations: no notices, and generation bits on
    uplink are dropped as ``bad_flags`` (what a backend that does not implement them does).

    ``restart_idle``: the seconds a job must have been quiet (no completion, no result sent
    again) before an authentic hello may start it afresh (docs/protocol.md, "A new set of
    workers"); ``resend_interval``: the seconds between two results sent again to a member for
    a slot version once its round's burst is spent (``slots.RESEND_INTERVAL``); ``clock``: the
    monotonic clock that measures both."""

    def __init__(
        self, generation: int = 0, max_residual_elements: int = DEFAULT_MAX_RESIDUAL_ELEMENTS,
        restart_idle: float = handshake.RESTART_IDLE, clock: Callable[[], float] = time.monotonic,
        resend_interval: float = RESEND_INTERVAL,
    ) -> None:  # fmt: skip
        self.generation = generation
        self.restart_idle = restart_idle
        self.resend_interval = resend_interval
        self.clock = clock
        self.jobs: dict[int, JobSlots] = {}
        self.stats = GlobalStats()
        self.limits = LimitStats()
        self.max_residual_elements = max_residual_elements  # per server-mode job

    def add_job(self, config: JobConfig, compressor: Compressor | None = None) -> JobSlots:
        """Install a job; its id must be new. With a ``compressor`` the job runs in server mode
        (``ServerSlots``), otherwise in INA mode."""
        if compressor is None:
            slots: JobSlots = JobSlots(config)
        else:
            slots = ServerSlots(config, compressor, limits=self.limits,
                                max_residual_elements=self.max_residual_elements)  # fmt: skip
        return self.install(slots)

    def install(self, slots: JobSlots) -> JobSlots:
        """Install a job's slots made elsewhere (a leaf's or a spine's,
        ``ncina.aggregator.hierarchy``); its id must be new."""
        config = slots.config
        if config.job in self.jobs:
            raise ValueError(f"job {config.job} is already installed")
        self.jobs[config.job] = slots
        slots.generation = self.generation
        return slots

    def remove_job(self, job: int) -> JobSlots:
        """Uninstall a job (its slots and counters go with it); return what it was."""
        return self.jobs.pop(job)

    def handle(self, datagram: bytes | bytearray | memoryview, source: Address) -> Datagrams:
        """Process one received UDP payload from ``source``; return what to send.

        A malformed datagram counts under its job when its header is readable (16 bytes,
        version 1) and names an installed job, otherwise under ``stats`` (the global section).
        """
        if is_job_datagram(datagram):
            quiet = (self.clock(), self.restart_idle)
            return handshake.answer(self.jobs, self.stats, self.generation, datagram, source,
                                    quiet)  # fmt: skip
        size = len(datagram)
        parsed = parse.uplink(datagram)  # 1-5
        if isinstance(parsed, str):
            job = self.jobs.get(parse.job_named(datagram, parsed))
            count_drop(job.stats if job is not None else self.stats, parsed, size)
            return NOTHING
        header, payload = parsed
        _, flags, _, _, job_id, rank, slot, count, offset = header
        job = self.jobs.get(job_id)  # 6
        if job is None:
            count_drop(self.stats, admission.UNKNOWN_JOB, size)
            return NOTHING
        stats = job.stats
        stats.packets_in += 1
        stats.bytes_in += size
        if not members.authentic(job.key, flags, datagram):  # 7
            stats.drops[members.BAD_TAG] += 1
            return NOTHING
        values = admission.admit(job, header, payload, source)  # 8-15
        if isinstance(values, str):
            stats.drops[values] += 1
            # Answered by a restart notice, the header alone: shorter than any packet that gets
            # here, so a forged source gets no amplified reflection.
            if values == admission.STALE_GENERATION:
                return reply.notice(job, rank, flags & FLAG_POOL, slot, offset, None, source)
            return NOTHING
        job.members.learn(rank, source)  # 16: a valid packet
        if flags & FLAG_RETX:
            stats.retx_seen += 1
        version = (flags & FLAG_POOL) >> 2
        rule = job.rule(version, slot, rank, offset, count)
        if rule is CONTRIBUTE:  # rule 1
            if not job.contribute(version, slot, rank, offset, count, values):
                return NOTHING
            stats.slots_completed += 1
            job.active_at = self.clock()
            if job.upstream is not None:  # a leaf: the exact sum goes to its spine (hierarchy.py)
                return job.upstream.forward(job, version, slot)
            stats.results_sent += job.workers
            return reply.results(job, version, slot, range(job.workers))
        if rule is RESEND:  # rule 2: the worker lost the result
            job.active_at = self.clock()
            if job.upstream is not None and not job.results[version][slot]:
                # still waiting: ask the spine again (no budget: a leaf whose uplinks were lost
                # would stall)
                return job.upstream.forward(job, version, slot, retx=True)
            if not job.may_resend(version, slot, rank, job.active_at, self.resend_interval):
                stats.drops[RESEND_LIMIT] += 1
                return NOTHING
            stats.results_resent += 1
            return reply.results(job, version, slot, (rank,))
        if rule is DUPLICATE:  # rule 3: ignored, and a notice at a generation
            stats.duplicates += 1
            if not job.generation:
                return NOTHING
            bitmap = job.bitmaps[version][slot]
            return reply.notice(job, rank, version, slot, offset, bitmap, job.members[rank])
        stats.drops[rule] += 1  # late or chunk_mismatch
        return NOTHING
