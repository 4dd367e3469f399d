"""The aggregator's logic without sockets: datagram in, datagrams out (docs/protocol.md).

``JobSlots`` is one job's SwitchML slot state machine: given a parsed uplink header, its payload
and the sender's address it validates the packet against the job, updates the slot, and returns
the result datagrams to send. ``Aggregator`` is the whole data plane's logic: it parses raw
datagrams, routes them to their job by id and counts what no job can claim.

Backends with their own data path (DPDK, BMv2) are checked against this module: feed the same
datagrams to both and compare what comes out and the counters.

Per-packet cost matters (the Python backend runs this for every packet): the state lives in flat
lists indexed by ``[version][slot]`` and one ``(2, S, K)`` int64 array per job, allocated once.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
from ncina.aggregator import handshake
from ncina.aggregator.jobs import Address, JobConfig
from ncina.aggregator.stats import GlobalStats, JobStats, LimitStats
from ncina.proto import nc8, tag
from ncina.proto.compressors import Compressor, State
from ncina.proto.compressors.base import HEAD
from ncina.proto.descriptor import is_job_datagram
from ncina.proto.header import (
    BAD_COUNT,
    BAD_FLAGS,
    BAD_FORMAT,
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
    Header,
    ProtocolError,
    parse,
)
from ncina.proto.wire import HEADER_SIZE, TAG_SIZE

# Job-level drop reasons (the parse-level ones are in ncina.proto.header).
NON_MEMBER = "non_member"
WINDOW_MISMATCH = "window_mismatch"
BAD_SLOT = "bad_slot"
BAD_CODE = "bad_code"
BAD_PAYLOAD = "bad_payload"
CHUNK_MISMATCH = "chunk_mismatch"
STALE_GENERATION = "stale_generation"
LATE = "late"
BAD_TAG = "bad_tag"
UNKNOWN_JOB = "unknown_job"

Datagrams = Sequence[tuple[bytes, Address]]
"""What to send: ``(UDP payload, destination)`` pairs, in order."""

NOTHING: Datagrams = ()

_NC8 = int(Format.NC8)  # a plain int: enum attribute lookups are slow on the per-packet path

_OFFSET_MASK = 0xFFFFFFFF
_HALF_OFFSET = 1 << 31  # serial-number arithmetic on the 32-bit offset (RFC 1982)

_JOB_FIELD = struct.Struct("!H")
_JOB_FIELD_OFFSET = 4


def _code_values(max_code: int) -> np.ndarray:
    """The switch ALU's input for every byte: ``nc8.codes_to_int`` of the valid uplink codes
    (exponent code up to ``max_code``), 0 for the others (which are dropped before use).

    One ``take`` from this table per packet is the aggregator's decode: measured about three times
    cheaper than ``nc8.accumulate``, whose argument checks dominate at K <= 1024.
    """
    byte = np.arange(256, dtype=np.uint8)
    valid = (byte & 0x7F) <= max_code
    table = np.zeros(256, dtype=np.int64)
    table[valid] = nc8.codes_to_int(byte[valid])
    table.setflags(write=False)
    return table


class JobSlots:
    """The slot pool of one job and the rules of docs/protocol.md, "Order of checks" and "Late
    and duplicate packets". Counts into ``stats`` (a fresh ``JobStats`` unless one is given).

    INA mode: NC8 contributions summed as integers. ``ServerSlots`` keeps the same slot rules and
    replaces the payload hooks (``_decode``, ``_encode``) and the class attributes below.
    """

    _uplink_format = _NC8
    _accumulator_dtype: type = np.int64
    _undecodable = BAD_CODE  # the drop reason of a payload ``_decode`` rejects
    # Offsets are the slot's running element counter, so a version's rounds have increasing
    # offsets and an older one is late (docs/protocol.md, "Late and duplicate packets").
    _ordered = True

    def __init__(self, config: JobConfig, stats: JobStats | None = None) -> None:
        self.config = config
        self.stats = stats if stats is not None else JobStats()
        n, s, k = config.workers, config.pool_size, config.k
        self._workers = n
        self._pool_size = s
        self._k = k
        self._job = config.job
        self._emin = config.window.e_min
        self._result_format = int(config.result_format)
        # Every byte that is not a valid uplink code: c & 0x7f above the window's top code.
        top = config.window.max_code
        self._bad_codes = bytes(c for c in range(256) if (c & 0x7F) > top)
        self._code_values = _code_values(top)
        # The seed of the nc8 results' rounding bits (docs/protocol.md, "Re-compression"), and
        # per [version][slot] the completions so far (the bits' `use`).
        self._result_seed = config.result_seed()
        self._uses = [[0] * s, [0] * s]
        # The aggregator's generation, set by ``Aggregator.add_job``; 0 is an aggregator without
        # generations (no notices; generation bits on uplink are ``bad_flags``).
        self.generation = 0
        # The tag's key (None: an untagged job) and the flag bit every datagram of the job has.
        self.key = config.key
        self._tag_flag = FLAG_TAG if config.key is not None else 0
        # Member addresses by rank: configured, or learned from the rank's first valid packet.
        self.members: list[Address | None] = [config.members.get(r) for r in range(n)]
        # Per [version][slot]: contributors' bitmap, contributions since the slot's first one,
        # the chunk's offset and count, and the encoded result payload (valid once complete).
        self._bitmap = [[0] * s, [0] * s]
        self._seen = [[0] * s, [0] * s]
        self._offset = [[0] * s, [0] * s]
        self._count = [[0] * s, [0] * s]
        self._result = [[b""] * s, [b""] * s]
        self.accumulators = np.zeros((2, s, k), dtype=self._accumulator_dtype)
        self._rows = [list(self.accumulators[0]), list(self.accumulators[1])]

    def handle(self, header: Header, payload: memoryview | bytes, source: Address) -> Datagrams:
        """Process one parsed uplink packet of this job from ``source``; return what to send.

        ``header`` and ``payload`` come from ``ncina.proto.header.parse`` (so version, flag bits,
        format value, count >= 1 and payload length are already checked). Drops are counted in
        ``stats.drops`` and return nothing.
        """
        stats = self.stats
        stats.packets_in += 1
        _, flags, fmt, emin, _, rank, slot, count, offset = header
        stats.bytes_in += HEADER_SIZE + len(payload) + (TAG_SIZE if flags & FLAG_TAG else 0)
        if flags & FLAG_RESULT:
            return self._drop(BAD_FLAGS)
        if fmt != self._uplink_format:
            return self._drop(BAD_FORMAT)
        if rank >= self._workers:
            return self._drop(NON_MEMBER)
        known = self.members[rank]
        if known is not None and known != source:
            return self._drop(NON_MEMBER)
        if emin != self._emin:
            return self._drop(WINDOW_MISMATCH)
        if slot >= self._pool_size:
            return self._drop(BAD_SLOT)
        if count > self._k:
            return self._drop(BAD_COUNT)
        stamp = flags & GENERATION_MASK
        if stamp and stamp != self.generation << GENERATION_SHIFT:
            if not self.generation:
                return self._drop(BAD_FLAGS)
            self.stats.drops[STALE_GENERATION] += 1
            return self._notice(rank, flags & FLAG_POOL, slot, offset, 0, source)
        values = self._decode(payload, count)
        if values is None:
            return self._drop(self._undecodable)
        if known is None:
            self.members[rank] = source
        if flags & FLAG_RETX:
            stats.retx_seen += 1
        version = (flags & FLAG_POOL) >> 2
        return self._apply(version, slot, rank, offset, count, values)

    def restart_if_idle(self) -> bool:
        """Start the job afresh when no round is partly filled: its slots and the member
        addresses it learned (configured ones stay). An authentic hello calls it: a new set of
        workers comes from new ports and counts its offsets from 0 again, which the member
        check and the slot rules would take for strangers and late packets (docs/protocol.md,
        "Job handshake"). The nc8 results' ``use`` counts go on. Returns whether it did."""
        workers = self._workers
        if any(0 < seen < workers for row in self._seen for seen in row):
            return False
        s = self._pool_size
        self._bitmap = [[0] * s, [0] * s]
        self._seen = [[0] * s, [0] * s]
        self._offset = [[0] * s, [0] * s]
        self._count = [[0] * s, [0] * s]
        self._result = [[b""] * s, [b""] * s]
        self.members = [self.config.members.get(r) for r in range(workers)]
        return True

    def _decode(self, payload: memoryview | bytes, count: int) -> np.ndarray | None:
        """The switch ALU's integer inputs of an NC8 payload, or ``None`` if a code is outside
        the job's window (``bad_code``)."""
        codes = bytes(payload)
        if len(codes.translate(None, self._bad_codes)) != count:
            return None
        return self._code_values.take(np.frombuffer(codes, dtype=np.uint8))

    def _encode(self, acc: np.ndarray, version: int, slot: int, offset: int) -> bytes:
        """The result payload of a complete slot's sum ``acc`` (chunk at ``offset`` in
        ``(slot, version)``, called once per completion); nc8 rounding bits keyed by the chunk
        and the slot version's use, not by the order of completions."""
        use = self._uses[version][slot]
        self._uses[version][slot] = use + 1 & 0xFFFFFFFF
        if self._result_format == _NC8:
            key = nc8.result_key(self._result_seed, self._job, slot, version, offset, use)
            return nc8.recompress(acc, key).tobytes()
        return acc.astype(INT_DTYPE).tobytes()

    def _apply(
        self, version: int, slot: int, rank: int, offset: int, count: int, values: np.ndarray
    ) -> Datagrams:
        """The slot rules (docs/protocol.md, "Late and duplicate packets") for a valid packet of
        ``rank`` for ``(slot, version)`` whose decoded contribution is ``values``."""
        stats = self.stats
        bit = 1 << rank
        workers = self._workers
        other = 1 - version
        if self._bitmap[other][slot] & bit and self._seen[other][slot] < workers:
            return self._drop(LATE)  # L1: rank waits for the other version's result
        bitmaps = self._bitmap[version]
        bitmap = bitmaps[slot]
        seen = self._seen[version][slot]
        held = (
            seen and self._offset[version][slot] == offset and self._count[version][slot] == count
        )
        if bitmap & bit:  # L2: rank's latest contribution is to this version
            if held:
                if seen >= workers:
                    return self._resend(version, slot, rank)
                stats.duplicates += 1
                if not self.generation:
                    return NOTHING
                return self._notice(rank, version, slot, offset, bitmap, self.members[rank])
            return self._drop(LATE if self._older(version, slot, offset) else CHUNK_MISMATCH)
        if bitmap:  # L3: a round others contribute to
            if held:
                if seen >= workers:
                    return self._drop(LATE)  # rank moved on from this complete round
            else:
                return self._drop(LATE if self._older(version, slot, offset) else CHUNK_MISMATCH)
        elif seen and self._ordered and self._not_after(version, slot, offset):
            return self._drop(LATE)  # L4: a chunk of this version's last round, or older
        row = self._rows[version][slot]
        acc = row if count == self._k else row[:count]
        if not bitmap:  # the first contribution starts a round
            acc[:] = values
            self._offset[version][slot] = offset
            self._count[version][slot] = count
            seen = 0
        else:
            acc += values
        bitmaps[slot] = bitmap | bit
        self._bitmap[other][slot] &= ~bit
        stats.contributions += 1
        seen += 1
        self._seen[version][slot] = seen
        if seen != workers:
            return NOTHING
        stats.slots_completed += 1
        return self._complete(version, slot, acc, offset)

    def _complete(self, version: int, slot: int, acc: np.ndarray, offset: int) -> Datagrams:
        """A slot's last contribution arrived (its sum is ``acc``): encode and store the result
        and send it to every member. A leaf aggregator sends the sum upstream instead
        (``ncina.aggregator.hierarchy``)."""
        self._result[version][slot] = self._encode(acc, version, slot, offset)
        self.stats.results_sent += self._workers
        return self._send(version, slot, range(self._workers))

    def _resend(self, version: int, slot: int, rank: int) -> Datagrams:
        """Rule 2: ``rank`` retransmitted the chunk of a complete slot, so it lost the result:
        send it the stored result again. A leaf still waiting for its spine's result re-sends
        its partial sum upstream instead (``ncina.aggregator.hierarchy``)."""
        self.stats.results_resent += 1
        return self._send(version, slot, (rank,))

    def _not_after(self, version: int, slot: int, offset: int) -> bool:
        """Whether ``offset`` is the offset of ``(slot, version)``'s last round or before it, in
        serial-number arithmetic mod 2**32 (RFC 1982): ``(held - offset) mod 2**32 < 2**31``."""
        return (self._offset[version][slot] - offset) & _OFFSET_MASK < _HALF_OFFSET

    def _older(self, version: int, slot: int, offset: int) -> bool:
        """Whether ``offset`` is strictly before the held round's offset (INA mode only)."""
        return (
            self._ordered
            and offset != self._offset[version][slot]
            and self._not_after(version, slot, offset)
        )

    def _send(self, version: int, slot: int, ranks: Sequence[int]) -> Datagrams:
        """The stored result of ``(slot, version)``, one datagram for each of ``ranks``."""
        payload = self._result[version][slot]
        flags = self._downlink_flags(version)
        offset = self._offset[version][slot]
        count = self._count[version][slot]
        out = [
            (
                HEADER.pack(
                    VERSION,
                    flags,
                    self._result_format,
                    self._emin,
                    self._job,
                    rank,
                    slot,
                    count,
                    offset,
                )
                + payload,
                self.members[rank],
            )
            for rank in ranks
        ]
        if self.key is not None:
            out = [(tag.sign(self.key, datagram), to) for datagram, to in out]
        stats = self.stats
        stats.packets_out += len(out)
        stats.bytes_out += sum(len(datagram) for datagram, _ in out)
        return out  # type: ignore[return-value]  # every rank of a complete slot has an address

    def _downlink_flags(self, version: int) -> int:
        """The flags of a result or notice for pool ``version``."""
        return (
            FLAG_RESULT | (FLAG_POOL if version else 0) | self.generation << GENERATION_SHIFT
            | self._tag_flag
        )

    def _notice(
        self, rank: int, version: int, slot: int, offset: int, bitmap: int, destination: Address
    ) -> Datagrams:
        """A notice to ``rank`` about its packet for ``(slot, version)`` at ``offset``: the
        aggregator's generation in the flags and the bitmap of the contributors it holds."""
        datagram = HEADER.pack(
            VERSION, self._downlink_flags(version), self._result_format, self._emin, self._job,
            rank, slot, 0, offset,
        ) + NOTICE.pack(bitmap)
        if self.key is not None:
            datagram = tag.sign(self.key, datagram)
        stats = self.stats
        stats.notices_sent += 1
        stats.packets_out += 1
        stats.bytes_out += len(datagram)
        return ((datagram, destination),)

    def describe(self) -> str:
        """One line naming the job's settings (``JobConfig.describe``)."""
        return self.config.describe()

    def count_malformed(self, reason: str, size: int) -> None:
        """Count a datagram of ``size`` bytes naming this job that ``parse`` rejected."""
        stats = self.stats
        stats.packets_in += 1
        stats.bytes_in += size
        stats.drops[reason] += 1

    def _drop(self, reason: str) -> Datagrams:
        self.stats.drops[reason] += 1
        return NOTHING


# Server mode's error-feedback memory per job, in float32 elements: 2**28 (about 1 GiB with the
# states' own objects), the residuals of a 90M-parameter model in chunks of 256, 180M in 1024.
DEFAULT_MAX_RESIDUAL_ELEMENTS = 1 << 28


class ServerSlots(JobSlots):
    """Server mode (docs/protocol.md, "Server mode"): the same slot rules on BLOB payloads.

    Each contribution is decompressed with ``compressor`` on arrival and added in float32; a
    complete slot's mean is compressed with ``compressor`` and that payload is the stored result.
    A payload that does not decode to exactly ``count`` elements is dropped as ``bad_payload``.
    ``compressor`` keeps one ``State`` per chunk (offset and length), so with an error-feedback
    compressor (``ef+`` spec, or a method defined with it) the server compensates its own
    compression error chunk by chunk: DoubleSqueeze's server-side error feedback. The job's
    result format is unused.

    The chunks' offsets come from the packets, so the states are capped: each one is charged its
    chunk's elements plus ``STATE_OVERHEAD`` (the state's own objects), and a chunk whose state
    would take the job past ``max_residual_elements`` is compressed with a fresh state that is
    not kept (no error feedback for it; counted in ``limits.residuals_unkept``).
    """

    STATE_OVERHEAD = 512  # elements (2 KB): the State, its generator and the dict entry

    _uplink_format = int(Format.BLOB)
    _accumulator_dtype = np.float32
    _undecodable = BAD_PAYLOAD
    _ordered = False  # offsets name the chunk for the error-feedback memory: they repeat

    def __init__(
        self,
        config: JobConfig,
        compressor: Compressor,
        stats: JobStats | None = None,
        *,
        max_residual_elements: int = DEFAULT_MAX_RESIDUAL_ELEMENTS,
        limits: LimitStats | None = None,
    ) -> None:
        super().__init__(config, stats)
        self.compressor = compressor
        self._result_format = int(Format.BLOB)
        self._seed = config.seed
        self._states: dict[tuple[int, int], State] = {}
        self.max_residual_elements = max_residual_elements
        self.residual_elements = 0  # charged to the kept states so far
        self.limits = limits if limits is not None else LimitStats()

    def describe(self) -> str:
        return self.config.describe(f"server mode ({self.compressor.name} blob results)")

    def restart_if_idle(self) -> bool:
        """As ``JobSlots.restart_if_idle``; a new set of workers also starts without the last
        set's error-feedback memory."""
        restarted = super().restart_if_idle()
        if restarted:
            self._states.clear()
        return restarted

    def _decode(self, payload: memoryview | bytes, count: int) -> np.ndarray | None:
        # The payload's own element count is checked before decompressing, so a forged count
        # (up to 2**32 - 1) costs nothing instead of a huge allocation.
        if len(payload) < HEAD.size or HEAD.unpack_from(payload)[1] != count:
            return None
        try:
            values = self.compressor.decompress(bytes(payload))
        except (ValueError, struct.error):
            return None
        return values if values.size == count else None

    def _encode(self, acc: np.ndarray, version: int, slot: int, offset: int) -> bytes:
        # One error-feedback memory per chunk (offset and length): chunks of different lengths at
        # the same offset (the last chunks of tensors of different sizes) never share one.
        key = (offset, acc.size)
        state = self._states.get(key)
        if state is None:
            seed = None if self._seed is None else (self._seed, offset, acc.size)
            state = State(rng=np.random.default_rng(seed))
            charge = acc.size + self.STATE_OVERHEAD
            if self.residual_elements + charge <= self.max_residual_elements:
                self._states[key] = state
                self.residual_elements += charge
            else:
                self.limits.residuals_unkept += 1
        return self.compressor.compress(acc / np.float32(self._workers), state)


class Aggregator:
    """Every job of one aggregator, keyed by job id, and the datagram-level validation.

    ``generation`` (1..15) goes on every result and notice; uplink packets that carry another
    non-zero generation are stale (docs/protocol.md, "Generations and notices"). 0, the
    default, keeps protocol version 1 without generations: no notices, and generation bits on
    uplink are dropped as ``bad_flags`` (what a backend that does not implement them does)."""

    def __init__(
        self, generation: int = 0, max_residual_elements: int = DEFAULT_MAX_RESIDUAL_ELEMENTS
    ) -> None:
        self.generation = generation
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
        A ``job`` datagram is the handshake (``ncina.aggregator.handshake``).
        """
        if is_job_datagram(datagram):
            return handshake.answer(self.jobs, self.stats, self.generation, datagram, source)
        try:
            header, payload = parse(datagram)
        except ProtocolError as exc:
            return self._malformed(datagram, exc.reason)
        job = self.jobs.get(header.job)
        if job is None:
            return self._drop_global(UNKNOWN_JOB, len(datagram))
        if (job.key is not None or header.flags & FLAG_TAG) and not (
            header.flags & FLAG_TAG and job.key is not None and tag.verify(job.key, datagram)
        ):
            job.count_malformed(BAD_TAG, len(datagram))
            return NOTHING
        return job.handle(header, payload, source)

    def _malformed(self, datagram: bytes | bytearray | memoryview, reason: str) -> Datagrams:
        size = len(datagram)
        if reason not in (TRUNCATED, BAD_VERSION):
            job = self.jobs.get(_JOB_FIELD.unpack_from(datagram, _JOB_FIELD_OFFSET)[0])
            if job is not None:
                job.count_malformed(reason, size)
                return NOTHING
        return self._drop_global(reason, size)

    def _drop_global(self, reason: str, size: int) -> Datagrams:
        stats = self.stats
        stats.packets_in += 1
        stats.bytes_in += size
        stats.drops[reason] += 1
        return NOTHING
