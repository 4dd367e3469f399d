"""The window and the chunks of one all-reduce in the Python data path (``Transfer``); the C
data path's twin is ``worker/transfer.c``, and ``ncina.worker.client.AllreduceClient`` chooses
between them, makes the handshake and turns what a transfer reports into its errors.

- ``schedule``: chunk ``i`` of a tensor goes into slot ``i % S`` as the slot's next use ``u``:
  pool version ``u & 1``, offset ``u * S + slot`` (mod 2**32), the chunk's sequence number
  (docs/protocol.md, "Late and duplicate packets"); the use counts outlive a call.
- ``Transfer``: self-clocking (at most one chunk per slot is outstanding; a slot's result
  releases its next chunk when the congestion window has room, ``ncina.worker.window``), the
  result checks, retransmission of a slot whose result has not
  come back within its timeout (``RETX``, the timeout backed off; ``ncina.worker.timing``), the
  aggregator's notices and generations (docs/protocol.md, "Generations and notices").
  A transfer does not build the client's errors: it raises ``Stalled`` (no progress for
  ``deadline`` seconds, with what the notices said) or ``Restarted`` (another generation), as
  the C loop returns ``NCW_TIMEOUT`` or ``NCW_RESTARTED``.

Per-packet work is kept to a few Python operations: a result is accepted when its 16-byte header
equals the header expected for the slot's outstanding chunk (one comparison that covers what
``header.parse`` checks plus job, rank, window, slot, pool version, offset, count and format) and
its length is right; its payload is copied into a buffer for the whole tensor, which the client
decodes once at the end.
"""

from __future__ import annotations

import math
import select
import socket
import time

import numpy as np
from ncina.proto import tag
from ncina.proto.header import (
    ELEMENT_SIZE,
    FLAG_POOL,
    FLAG_RESULT,
    FLAG_RETX,
    FLAG_TAG,
    GENERATION_MASK,
    GENERATION_SHIFT,
    HEADER,
    HEADER_DTYPE,
    NOTICE,
    Format,
)
from ncina.proto.wire import HEADER_SIZE, TAG_SIZE
from ncina.worker.timing import RtoEstimator
from ncina.worker.window import CongestionWindow


class Stalled(Exception):
    """No valid result for ``deadline`` seconds. ``outstanding`` are the slots still waiting,
    ``waiting`` per such slot its chunk's element count and the bitmap of the ranks the
    aggregator holds for that chunk according to its latest notice (None: no notice about it)."""

    def __init__(self, outstanding: list[int], waiting: list[tuple[int, int | None]]) -> None:
        super().__init__(f"{len(outstanding)} slots outstanding")
        self.outstanding = outstanding
        self.waiting = waiting


class Restarted(Exception):
    """A result or notice of ``generation``, not the one learned: the aggregator restarted."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"generation {generation}")
        self.generation = generation


def schedule(slot_uses: np.ndarray, chunks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot, pool version and INA offset of each of ``chunks`` chunks of a tensor; advances
    ``slot_uses`` (the uses of each of the S slots so far, across calls). Chunk ``i`` is use
    ``u`` of slot ``i % S`` (``u`` counts the slot's earlier uses): version ``u & 1``, offset
    ``u * S + slot`` mod 2**32, the chunk's sequence number, which grows by ``2 S`` from one round
    of a slot version to the next (docs/protocol.md, "Late and duplicate packets")."""
    s = slot_uses.size
    index = np.arange(chunks, dtype=np.int64)
    slots = index % s
    use = slot_uses[slots] + index // s
    slot_uses += np.bincount(slots, minlength=s)
    return slots, use & 1, (use * s + slots) & 0xFFFFFFFF


class Transfer:
    """The send/receive loop of one tensor: slot state, result checks, timers.

    Per slot it keeps the outstanding chunk (-1: none), the header and length its result must
    have, its send time and its RTO. The hot loop copies what it touches into locals. The RTT is
    sampled from slot 0 only, once per round of the window (RFC 6298 asks for at least one sample
    per RTT), which keeps the estimator off the per-packet path; ``clean`` says slot 0's chunk was
    sent once (Karn). After a retransmission slot 0's next chunk keeps the backed-off timeout, so
    that a path slower than the RTO still yields a sample.

    After a timer check that re-sent chunks (``probe``), the first re-sent chunk (any slot) whose
    result arrives in order, before the result of any later chunk, may give a sample too, timed
    from its first send (``RtoEstimator.spurious`` decides: when it came later than a round trip
    after the re-send). Every worker sends its chunks in order and each link is FIFO, so results
    come back in chunk order unless a packet is lost; a lost chunk waits a whole timeout for its
    retransmission, during which the chunks after it are normally answered, so its result comes
    out of order and gives nothing. In order, the result answers the first copy when the window
    queues behind a slow link (the re-sent copy waits behind the whole queue): the retransmission
    was spurious. That is what a window that queues longer than the RTO looks like (the RTO was
    learnt on the idle path): every slot times out, slot 0 too, so slot 0 gives no sample for
    rounds, while slots keep expiring check after check (their send times are spread over the
    round) and the in-order results, one per such check, bring the RTO above the queueing delay
    within the first round. One per check, because a transient stall (a descheduled process)
    expires every slot in one check and then answers them all in order: one sample of it is a
    lone outlier for the streak.

    The congestion window ``window`` (``ncina.worker.window``) limits how many slots have a chunk
    outstanding: a slot whose result came back is idle until the window has room, then takes
    its next chunk (``following``: chunk ``i``'s slot takes ``i + S``), the idle slot with the
    lowest next chunk first; so a slot is still reused only after its result arrived and each
    slot's chunks go out in order. One exception to the window: an idle slot whose next chunk
    is lower than every outstanding one starts it at once. Every worker then sends the lowest
    chunk no slot has completed, whatever its window, so the workers' windows cannot wait on
    each other (a worker's window full of chunks another worker has not sent, and the other's
    full of chunks it has not sent: without the exception, a deadlock). Every result feeds the
    window, with an RTT when its chunk was sent once. A timer check with no result for an RTO
    is a stall (``CongestionWindow.stall``): it re-sends one expired chunk, the oldest of those
    the aggregator is not known to hold (no notice with this rank's bit about it; else the
    oldest), and holds the others back (their timers restart,
    backed off, nothing is sent): a whole window that waits for another worker needs no copies
    on the wire, and the aggregator answers a re-sent copy of a chunk it holds with a notice
    while the slot waits for others. Each stall check so probes another chunk, so no two
    workers can hold back each other's missing chunks for ever. The next result ends the hold:
    if no notice came meanwhile, the first copies were lost, and the held chunks expire at once
    (re-sent by the next check, which is no stall); else their timers run.

    The transfer uses the client's socket (``sock``, bound and non-blocking, watched by
    ``poller``), receive buffer ``buf``, RTO estimator ``timer`` and counters ``stats`` (updated
    in place); ``generation`` is the aggregator's as the client knows it (0: not yet), adopted
    from the first result that carries one: the client reads ``generation`` back after ``run``.
    Only datagrams from ``aggregator``'s address and port are believed: anything else is counted
    as ignored (an off-path host cannot forge an unkeyed job's results or notices).

    Results of a fixed-size format (``received`` a buffer) have a known length and are copied to
    their place in it; BLOB results (``received`` a list, ``want_length`` 0) have any length that
    holds more than a header and are stored as item ``i`` of the list.
    """

    def __init__(
        self,
        sock: socket.socket,
        poller: select.poll,
        buf: bytearray,
        aggregator: tuple[str, int],
        *,
        job: int,
        rank: int,
        pool_size: int,
        k: int,
        result_format: Format,
        key: bytes | None,
        timer: RtoEstimator,
        window: CongestionWindow,
        generation: int,
        deadline: float,
        stats: dict[str, int],
        frames: np.ndarray,
        lengths: np.ndarray,
        pools: np.ndarray,
        received: bytearray | list[bytes],
    ) -> None:
        self.sock = sock
        self.poller = poller
        self.buf = buf
        self.aggregator = aggregator
        self.job = job
        self.rank = rank
        self.pool_size = pool_size
        self.k = k
        self.timer = timer
        self.window = window
        self.generation = generation
        self.deadline = deadline
        self.stats = stats
        self.chunks = frames.shape[0]
        self.row = frames.shape[1]
        self.frame_array = frames
        self.frames = memoryview(frames.reshape(-1))
        self.sizes: list[int] = lengths.tolist()
        headers = frames[:, :HEADER_SIZE].view(HEADER_DTYPE)[:, 0]
        self.counts: list[int] = headers["count"].tolist()
        self.offsets: list[int] = headers["offset"].tolist()
        self.element_size = ELEMENT_SIZE.get(result_format, 0)  # 0: BLOB, any length
        self.key = key
        self.tag_size = 0 if key is None else TAG_SIZE
        # The header each chunk's result must carry, byte for byte: the uplink header with the
        # RESULT flag (no RETX) and the job's result format.
        expected = frames[:, :HEADER_SIZE].copy()
        expected[:, 1] = np.where(pools != 0, FLAG_RESULT | FLAG_POOL, FLAG_RESULT)
        expected[:, 1] |= generation << GENERATION_SHIFT
        if key is not None:
            expected[:, 1] |= FLAG_TAG
        expected[:, 2] = result_format
        self.expected = expected.tobytes()
        self.blobs = received if isinstance(received, list) else []
        self.out = memoryview(received if isinstance(received, bytearray) else b"")
        s = pool_size
        self.current = [-1] * s
        self.want_header: list[bytes | None] = [None] * s
        self.want_length = [0] * s
        self.sent_at = [0.0] * s  # the last send (first or re-sent)
        self.first_sent = [0.0] * s  # the outstanding chunk's first send
        self.rto = [timer.rto] * s
        self.following = list(range(s))  # each slot's next chunk
        self.outstanding = 0  # slots with a chunk outstanding
        self.held: set[int] = set()  # slots a stall held back
        self.waited = False  # a notice came while chunks were held: the stall was a wait
        self.stalled_at = -1.0  # the last stall (a chunk sent before it waited in it)
        self.clean = False
        self.probe = False  # a timer check re-sent chunks: take one in-order sample
        # Per slot, the last notice: (offset of the chunk it is about, bitmap of the ranks whose
        # contribution the aggregator holds).
        self.notices: dict[int, tuple[int, int]] = {}

    def send(self, i: int, slot: int, now: float) -> None:
        """Send chunk ``i`` into ``slot``. A full send buffer, or a local firewall rule that
        refuses the datagram (EPERM, counted as ``send_refused``), loses the packet like the
        network would; the slot's timer re-sends it."""
        start = i * self.row
        size = self.sizes[i]
        self.sent_at[slot] = now
        if self.key is not None:  # the tag covers the flags as they are now (RETX, generation)
            end = start + size
            size += TAG_SIZE
            self.frames[end : end + TAG_SIZE] = tag.compute(self.key, self.frames[start:end])
        try:
            self.sock.sendto(self.frames[start : start + size], self.aggregator)
        except BlockingIOError:
            return
        except PermissionError:
            self.stats["send_refused"] += 1
            return
        stats = self.stats
        stats["packets_sent"] += 1
        stats["bytes_sent"] += size

    def start(self, i: int, slot: int, now: float) -> None:
        """Make chunk ``i`` the outstanding chunk of ``slot`` and send it."""
        begin = i * HEADER_SIZE
        self.current[slot] = i
        self.following[slot] = i + self.pool_size
        self.outstanding += 1
        self.first_sent[slot] = now
        self.want_header[slot] = self.expected[begin : begin + HEADER_SIZE]
        self.want_length[slot] = (
            HEADER_SIZE + self.counts[i] * self.element_size + self.tag_size
            if self.element_size else 0
        )
        if slot:
            self.rto[slot] = self.timer.rto
        else:
            if self.clean:  # else keep the backed-off timeout until a sample comes back (Karn)
                self.rto[0] = self.timer.rto
            self.clean = True
        self.send(i, slot, now)

    def fill(self, now: float) -> None:
        """Start the next chunk of idle slots, the lowest first, while the window has room or
        the chunk is lower than every outstanding one (the class docstring)."""
        current, following, chunks = self.current, self.following, self.chunks
        limit = self.window.limit
        while True:
            slot, lowest = -1, chunks  # the idle slot with the lowest next chunk; outstanding's
            for t, i in enumerate(current):
                if i >= 0:
                    lowest = min(lowest, i)
                elif following[t] < chunks and (slot < 0 or following[t] < following[slot]):
                    slot = t
            if slot < 0 or (self.outstanding >= limit and following[slot] > lowest):
                return
            self.start(following[slot], slot, now)

    def run(self) -> None:
        """Drive the window until every chunk's result is in."""
        s, chunks, timer = self.pool_size, self.chunks, self.timer
        recvfrom_into, poll, aggregator = self.sock.recvfrom_into, self.poller.poll, self.aggregator
        buf = self.buf
        view = memoryview(buf)
        out, blobs, current, want_header, want_length = (
            self.out, self.blobs, self.current, self.want_header, self.want_length,
        )
        shortest_blob = HEADER_SIZE + self.tag_size + 1
        stride = self.k * self.element_size
        key, payload_end = self.key, -self.tag_size or None
        clock, window = time.monotonic, self.window
        now = clock()
        self.fill(now)
        done = received = received_bytes = ignored = 0
        top = -1  # the highest chunk answered so far
        frames, row, first_sent = self.frames, self.row, self.first_sent
        last_progress = now
        next_check = now + timer.rto
        try:
            while done < chunks:
                try:
                    size, sender = recvfrom_into(buf)
                except BlockingIOError:
                    size = -1
                now = clock()
                if size >= 0:
                    received += 1
                    received_bytes += size
                    slot = (buf[8] << 8) | buf[9] if size >= HEADER_SIZE else s
                    if sender != aggregator:
                        slot = s  # not the aggregator's: nothing in it is believed
                    elif key is not None and not self.authentic(size):
                        slot = s  # nothing in it is believed
                    elif slot < s and buf[1] & FLAG_RETX:
                        buf[1] ^= FLAG_RETX  # an echoed RETX flag does not make it foreign
                    if (
                        slot >= s
                        or (
                            size != want_length[slot]
                            and (want_length[slot] or size < shortest_blob)
                        )
                        or buf[:HEADER_SIZE] != want_header[slot]
                    ) and not self.unexpected(size, slot):
                        ignored += 1
                    else:
                        i = current[slot]
                        body = view[HEADER_SIZE:size][:payload_end]
                        if stride:
                            begin = i * stride
                            out[begin : begin + len(body)] = body
                        else:
                            blobs[i] = bytes(body)
                        done += 1
                        last_progress = now
                        self.outstanding -= 1
                        if self.held and self.release(now):
                            next_check = now
                        retx = frames[i * row + 1] & FLAG_RETX
                        rtt = -1.0 if retx else now - first_sent[slot]
                        if not retx and first_sent[slot] <= self.stalled_at:
                            window.resume()  # it waited in the stall: no RTT
                            rtt = -1.0
                        window.sample(rtt)
                        if slot == 0 and self.clean:
                            timer.sample(now - self.sent_at[0])
                        if i > top:  # in order: no later chunk was answered before it
                            if (
                                retx
                                and self.probe
                                and timer.spurious(
                                    now - first_sent[slot], now - self.sent_at[slot]
                                )
                            ):
                                self.probe = False
                            top = i
                        current[slot] = -1
                        want_header[slot] = None
                        self.fill(now)
                elif now < next_check:
                    poll(max(1, math.ceil((next_check - now) * 1000)))
                    continue
                # The timers wait until the socket is empty (results that already came must not
                # be re-sent for: a descheduled worker finds a backlog), at most an RTO more.
                if now >= next_check and (size < 0 or now - next_check >= timer.rto):
                    next_check = self.check_timers(now, last_progress)
        finally:
            stats = self.stats
            stats["packets_received"] += received
            stats["bytes_received"] += received_bytes
            stats["results_ignored"] += ignored

    def holds(self, slot: int) -> bool:
        """Whether the aggregator's latest notice about ``slot``'s outstanding chunk says it
        holds this rank's contribution."""
        offset, held = self.notices.get(slot, (-1, 0))
        return offset == self.offsets[self.current[slot]] and bool(held >> self.rank & 1)

    def release(self, now: float) -> bool:
        """End a stall's hold at a result; says whether the held chunks were made to expire
        now (no notice came during the hold: their first copies are taken as lost)."""
        lost = not self.waited
        if lost:
            for slot in self.held:
                if self.current[slot] >= 0:
                    self.sent_at[slot] = now - self.rto[slot]
        self.held.clear()
        self.waited = False
        return lost

    def unexpected(self, size: int, slot: int) -> bool:
        """Look closer at a datagram in ``buf`` that is not the expected result of ``slot``
        (off the per-packet path; its tag, if the job has a key, is verified): a notice is
        noted, another generation than the one learned raises ``Restarted``, and the first
        result of a generation is adopted. Returns True when the datagram is the expected
        result after all."""
        buf = self.buf
        if slot >= self.pool_size or self.current[slot] < 0:  # slot >= S also if size < 16
            return False
        _, flags, _, _, job, rank, _, count, offset = HEADER.unpack_from(buf)
        if not flags & FLAG_RESULT or job != self.job or rank != self.rank:
            return False
        generation = (flags & GENERATION_MASK) >> GENERATION_SHIFT
        if self.generation and generation != self.generation:
            raise Restarted(generation)
        if count == 0:
            if size == HEADER_SIZE + NOTICE.size + self.tag_size:
                self.stats["notices"] += 1
                self.waited = bool(self.held)
                self.notices[slot] = (offset, NOTICE.unpack_from(buf, HEADER_SIZE)[0])
            elif size == HEADER_SIZE + self.tag_size and self._about_current(slot):
                # A restart notice of the generation learned, about this very chunk: a new
                # start of the aggregator that drew the same generation, and this rank has
                # not said hello to it.
                raise Restarted(generation)
            return False
        if not generation:
            return False
        bits = generation << GENERATION_SHIFT
        header = bytearray(buf[:HEADER_SIZE])
        header[1] ^= bits
        want = self.want_length[slot]
        if (size != want if want else size <= HEADER_SIZE + self.tag_size) or (
            header != self.want_header[slot]
        ):
            return False
        self.generation = generation
        self.frame_array[:, 1] |= bits
        expected = np.frombuffer(self.expected, dtype=np.uint8).reshape(-1, HEADER_SIZE).copy()
        expected[:, 1] |= bits
        self.expected = expected.tobytes()
        for s, i in enumerate(self.current):
            if i >= 0:
                self.want_header[s] = self.expected[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
        return True

    def _about_current(self, slot: int) -> bool:
        """Whether the header in ``buf`` is the expected result's of ``slot``'s outstanding
        chunk but for its count (a notice's is 0): the generation learned included."""
        want = self.want_header[slot]
        return want is not None and self.buf[:10] == want[:10] and (
            self.buf[12:HEADER_SIZE] == want[12:]
        )

    def authentic(self, size: int) -> bool:
        """Whether the datagram of ``size`` bytes in ``buf`` carries the ``TAG`` flag and a tag
        that verifies with the job's key (a failure is counted as ``bad_tag``)."""
        buf = self.buf
        key = self.key
        if key is not None and buf[1] & FLAG_TAG and tag.verify(key, memoryview(buf)[:size]):
            return True
        self.stats["bad_tag"] += 1
        return False

    def check_timers(self, now: float, last_progress: float) -> float:
        """Re-send expired slots with RETX; raise ``Stalled`` past the deadline.

        Returns the time of the next check: the earliest expiry, and no later than one fresh
        chunk's RTO from now (a chunk sent after this check expires no earlier than that, unless
        an RTT sample lowers the RTO meanwhile: it then waits for this check).

        No result for an RTO makes the check a stall (the class docstring): one expired chunk
        is re-sent (``probe``), the others are held back.
        """
        outstanding = [slot for slot, i in enumerate(self.current) if i >= 0]
        if now - last_progress >= self.deadline:
            waiting = []
            for slot in outstanding:
                i = self.current[slot]
                offset, held = self.notices.get(slot, (-1, 0))
                waiting.append((self.counts[i], held if offset == self.offsets[i] else None))
            raise Stalled(outstanding, waiting)
        timer, current, row = self.timer, self.current, self.row
        stalled = now - last_progress >= timer.rto
        probe = -1  # in a stall: the slot whose chunk is re-sent
        if stalled:
            due = [s for s in outstanding if self.sent_at[s] + self.rto[s] <= now]
            if not due or not self.window.stall():
                stalled = False
            else:
                self.stalled_at = now
                unknown = [s for s in due if not self.holds(s)]
                probe = min(unknown or due, key=current.__getitem__)
        next_check = now + timer.rto
        expired = resent = held = 0
        for slot in outstanding:
            due = self.sent_at[slot] + self.rto[slot]
            if due <= now:
                i = current[slot]
                flags = i * row + 1
                self.rto[slot] = timer.backoff(self.rto[slot])
                if slot == 0:
                    self.clean = False
                expired += 1
                if stalled and slot != probe:
                    self.sent_at[slot] = now  # held back: its timer restarts, nothing is sent
                    self.held.add(slot)
                    held += 1
                else:
                    self.frames[flags] |= FLAG_RETX
                    self.send(i, slot, now)
                    resent += self.sizes[i] + self.tag_size
                due = now + self.rto[slot]
            next_check = min(next_check, due)
        if expired:
            if expired > held:
                self.probe = True
            self.stats["retransmissions"] += expired - held
            self.stats["bytes_retransmitted"] += resent
            self.stats["held_back"] += held
            self.stats["timeouts"] += 1
        return next_check
