"""Slots: one job's pool of slots, two versions each (the SwitchML shadow copy), the slot rules
of docs/protocol.md ("Late and duplicate packets", L1-L4) and rule 1 of "Slots, pool versions and
loss recovery": a contribution added into the slot version's accumulators, the rank's bit set in
its bitmap and cleared in the other version's; the last of N completes the slot, whose result is
encoded once and stored (re-compression, "The NC8 code").

``JobSlots`` is one job in INA mode (NC8 codes summed as integers, as a switch ALU would) and the
state the other concepts read: its ``members`` (``members.py``), counters and generation.
``ServerSlots`` is server mode: the same rules on compressed blobs summed in float32. The C
engine's ``slots.c`` and P4's ``slots.p4`` (with the generated lanes) hold the same state.

Per-packet cost matters (the Python backend runs this for every packet): the state lives in flat
lists indexed by ``[version][slot]`` and one ``(2, S, K)`` array per job, allocated once.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

import numpy as np
from ncina.aggregator.backends.python.members import Members
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.stats import JobStats, LimitStats
from ncina.proto import nc8
from ncina.proto.compressors import Compressor, State
from ncina.proto.compressors.base import HEAD
from ncina.proto.header import FLAG_TAG, SUM_DTYPES, Format

if TYPE_CHECKING:
    from ncina.aggregator.hierarchy import Upstream

# What the slot rules make of an admitted packet (``JobSlots.rule``): one of three actions, or a
# drop reason.
CONTRIBUTE = "contribute"  # rule 1: a new contribution
RESEND = "resend"  # rule 2: the stored result, to the sender
DUPLICATE = "duplicate"  # rule 3: ignored (answered by a notice)
LATE = "late"
CHUNK_MISMATCH = "chunk_mismatch"
RESEND_LIMIT = "resend_limit"  # rule 2 past its budget: dropped

RESEND_BURST = 4
"""How often one member may be sent one round's stored result again (rule 2) at once, per slot
version (docs/protocol.md, "Slots, pool versions and loss recovery"); past that, once per
``RESEND_INTERVAL``. A worker asks again once per timeout (20 ms doubling to 200 ms), so the
burst covers four losses in a row of one result; a fifth waits for the interval, never for good.
Copies of a member's retransmission sent by someone else (an unkeyed job's source can be forged)
make at most ``RESEND_BURST + T / RESEND_INTERVAL`` results in ``T`` seconds: 4 for a burst of
40 (issue 37)."""

RESEND_INTERVAL = 1.0
"""Seconds between two results sent again to one member for one slot version once its round's
``RESEND_BURST`` is spent."""

_NC8 = int(Format.NC8)  # a plain int: enum attribute lookups are slow on the per-packet path

_OFFSET_MASK = 0xFFFFFFFF
_HALF_OFFSET = 1 << 31  # serial-number arithmetic on the 32-bit offset (RFC 1982)


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
    """The slot pool of one job in INA mode. Counts into ``stats`` (a fresh ``JobStats`` unless
    one is given).

    ``ServerSlots`` keeps the same slot rules and replaces the payload hooks (``decode``,
    ``encode``) and the class attributes below.
    """

    uplink_format = _NC8
    # A leaf aggregator's way to its spine (``ncina.aggregator.hierarchy``): set, a complete
    # slot's exact sum goes up instead of a result down (``pipeline.py``). None: one level.
    upstream: Upstream | None = None
    _accumulator_dtype: type = np.int64
    # Offsets are the slot's running element counter, so a version's rounds have increasing
    # offsets and an older one is late (docs/protocol.md, "Late and duplicate packets").
    _ordered = True

    def __init__(self, config: JobConfig, stats: JobStats | None = None) -> None:
        self.config = config
        self.stats = stats if stats is not None else JobStats()
        n, s, k = config.workers, config.pool_size, config.k
        self.workers = n
        self.pool_size = s
        self.k = k
        self.emin = config.window.e_min
        self.result_format = int(config.result_format)
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
        self.tag_flag = FLAG_TAG if config.key is not None else 0
        self.members = Members(config.members, n)
        # Bit r: rank r said an authentic hello to this start of the aggregator (handshake.py).
        # A packet that carries the generation from a rank that did not is stale: it was sent
        # to an earlier start that may have drawn the same generation (admission.py). Only a
        # new start clears it: a job started afresh keeps it.
        self.joined = 0
        # Per [version][slot]: contributors' bitmap, contributions since the slot's first one,
        # the chunk's offset and count, and the encoded result payload (valid once complete).
        self.bitmaps = [[0] * s, [0] * s]
        self.seen = [[0] * s, [0] * s]
        self.offsets = [[0] * s, [0] * s]
        self.counts = [[0] * s, [0] * s]
        self.results = [[b""] * s, [b""] * s]
        # Per version, per slot and rank (slot * n + rank): results sent again this round, and
        # when the last of them went (the aggregator's clock).
        self.resends = [bytearray(s * n), bytearray(s * n)]
        self.resent_at = [[-math.inf] * (s * n), [-math.inf] * (s * n)]
        # When (the aggregator's clock) a slot last completed or a result was sent again: a
        # hello restarts the job only after it was quiet for a while (``handshake.py``).
        self.active_at = -math.inf
        self.accumulators = np.zeros((2, s, k), dtype=self._accumulator_dtype)
        self._rows = [list(self.accumulators[0]), list(self.accumulators[1])]

    def rule(self, version: int, slot: int, rank: int, offset: int, count: int) -> str:
        """What the slot rules (docs/protocol.md, "Late and duplicate packets", L1-L4) make of
        an admitted packet of ``rank`` for ``(slot, version)``: ``CONTRIBUTE``, ``RESEND``,
        ``DUPLICATE``, or the drop reason ``LATE`` or ``CHUNK_MISMATCH``."""
        bit = 1 << rank
        workers = self.workers
        other = 1 - version
        if self.bitmaps[other][slot] & bit and self.seen[other][slot] < workers:
            return LATE  # L1: rank waits for the other version's result
        bitmap = self.bitmaps[version][slot]
        seen = self.seen[version][slot]
        held = (
            seen and self.offsets[version][slot] == offset and self.counts[version][slot] == count
        )
        if bitmap & bit:  # L2: rank's latest contribution is to this version
            if held:
                return RESEND if seen >= workers else DUPLICATE
            return LATE if self._older(version, slot, offset) else CHUNK_MISMATCH
        if bitmap:  # L3: a round others contribute to
            if held:
                return LATE if seen >= workers else CONTRIBUTE  # complete: rank moved on
            return LATE if self._older(version, slot, offset) else CHUNK_MISMATCH
        if seen and self._ordered and self._not_after(version, slot, offset):
            return LATE  # L4: a chunk of this version's last round, or older
        return CONTRIBUTE

    def contribute(
        self, version: int, slot: int, rank: int, offset: int, count: int, values: np.ndarray
    ) -> bool:
        """Rule 1 for a packet ``rule`` let in: add ``values`` into ``(slot, version)`` (the first
        contribution of a round overwrites and records the chunk), set the rank's bit there and
        clear it in the other version. Returns whether the slot is now complete; its result is
        then encoded and stored (``results``)."""
        bit = 1 << rank
        bitmaps = self.bitmaps[version]
        bitmap = bitmaps[slot]
        row = self._rows[version][slot]
        acc = row if count == self.k else row[:count]
        if not bitmap:  # the first contribution starts a round
            acc[:] = values
            self.offsets[version][slot] = offset
            self.counts[version][slot] = count
            n = self.workers
            self.resends[version][slot * n : slot * n + n] = bytes(n)
            seen = 0
        else:
            acc += values
            seen = self.seen[version][slot]
        bitmaps[slot] = bitmap | bit
        self.bitmaps[1 - version][slot] &= ~bit  # the shadow copy's bit
        self.stats.contributions += 1
        seen += 1
        self.seen[version][slot] = seen
        if seen != self.workers:
            return False
        self.results[version][slot] = self.encode(acc, version, slot, offset)
        return True

    def restart_if_idle(self) -> bool:
        """Empty every slot when no round is partly filled; returns whether it did. An authentic
        hello calls it (``handshake.py``, which then forgets the learned members): a new set of
        workers counts its offsets from 0 again, which the slot rules would take for late
        packets (docs/protocol.md, "Job handshake"). The nc8 results' ``use`` counts go on."""
        workers = self.workers
        if any(0 < seen < workers for row in self.seen for seen in row):
            return False
        s = self.pool_size
        self.bitmaps = [[0] * s, [0] * s]
        self.seen = [[0] * s, [0] * s]
        self.offsets = [[0] * s, [0] * s]
        self.counts = [[0] * s, [0] * s]
        self.results = [[b""] * s, [b""] * s]
        self.resends = [bytearray(s * workers), bytearray(s * workers)]
        self.resent_at = [[-math.inf] * (s * workers), [-math.inf] * (s * workers)]
        return True

    def may_resend(
        self, version: int, slot: int, rank: int, now: float, interval: float = RESEND_INTERVAL
    ) -> bool:
        """Whether rule 2 may send ``rank`` the stored result of ``(slot, version)`` again at
        ``now`` (seconds): ``RESEND_BURST`` times in the round, then once per ``interval``
        since the last; counts the resend when it may."""
        at = slot * self.workers + rank
        sent = self.resends[version][at]
        if sent >= RESEND_BURST and now - self.resent_at[version][at] < interval:
            return False
        self.resends[version][at] = min(sent + 1, RESEND_BURST)
        self.resent_at[version][at] = now
        return True

    def decode(self, payload: memoryview | bytes, count: int) -> np.ndarray | None:
        """The switch ALU's integer inputs of an NC8 payload, or ``None`` if a code is outside
        the job's window (step 15 of "Order of checks": ``admission.admit`` asks)."""
        codes = bytes(payload)
        if len(codes.translate(None, self._bad_codes)) != count:
            return None
        return self._code_values.take(np.frombuffer(codes, dtype=np.uint8))

    def encode(self, acc: np.ndarray, version: int, slot: int, offset: int) -> bytes:
        """The result payload of a complete slot's sum ``acc`` (chunk at ``offset`` in
        ``(slot, version)``, called once per completion): the re-compression to nc8, its
        rounding bits keyed by the chunk and the slot version's use, not by the order of
        completions; or the exact sums, int64 or int32 (the window keeps them within 2**30
        for int32: docs/protocol.md, "int32 results")."""
        use = self._uses[version][slot]
        self._uses[version][slot] = use + 1 & 0xFFFFFFFF
        if self.result_format == _NC8:
            key = nc8.result_key(self._result_seed, self.config.job, slot, version, offset, use)
            return nc8.recompress(acc, key).tobytes()
        return acc.astype(SUM_DTYPES[self.result_format]).tobytes()

    def _not_after(self, version: int, slot: int, offset: int) -> bool:
        """Whether ``offset`` is the offset of ``(slot, version)``'s last round or before it, in
        serial-number arithmetic mod 2**32 (RFC 1982): ``(held - offset) mod 2**32 < 2**31``."""
        return (self.offsets[version][slot] - offset) & _OFFSET_MASK < _HALF_OFFSET

    def _older(self, version: int, slot: int, offset: int) -> bool:
        """Whether ``offset`` is strictly before the held round's offset (INA mode only)."""
        return (
            self._ordered
            and offset != self.offsets[version][slot]
            and self._not_after(version, slot, offset)
        )

    def describe(self) -> str:
        """One line naming the job's settings (``JobConfig.describe``)."""
        return self.config.describe()


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

    uplink_format = int(Format.BLOB)
    _accumulator_dtype = np.float32
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
        self.result_format = int(Format.BLOB)
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

    def decode(self, payload: memoryview | bytes, count: int) -> np.ndarray | None:
        # The payload's own element count is checked before decompressing, so a forged count
        # (up to 2**32 - 1) costs nothing instead of a huge allocation.
        if len(payload) < HEAD.size or HEAD.unpack_from(payload)[1] != count:
            return None
        try:
            values = self.compressor.decompress(bytes(payload))
        except (ValueError, struct.error):
            return None
        return values if values.size == count else None

    def encode(self, acc: np.ndarray, version: int, slot: int, offset: int) -> bytes:
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
        return self.compressor.compress(acc / np.float32(self.workers), state)
