"""The worker's side of the job handshake (docs/protocol.md, "Job handshake"; the aggregator's
side is ``ncina.aggregator.backends.python.handshake``): the hello that carries the worker's job
descriptor, the answer it waits for and how an answer is judged, and the probe, a hello that
asks the aggregator's generation without joining (``ncina.worker.client.recovery``)."""

from __future__ import annotations

import contextlib
import math
import time

from ncina.proto import descriptor as desc
from ncina.proto import tag
from ncina.proto.header import FLAG_RESULT, FLAG_TAG, GENERATION_MASK, GENERATION_SHIFT, HEADER
from ncina.proto.wire import HEADER_SIZE
from ncina.worker.client.link import Link

HANDSHAKE_TIMEOUT = 1.0  # seconds a worker waits for the aggregator's job descriptor
HANDSHAKE_INTERVAL = 0.1  # seconds between two hellos while no answer came


class Handshake:
    """The handshake of rank ``rank`` of job ``job`` over ``link``: ``descriptor`` is the job as
    the worker holds it, ``compressor`` its server-mode spec (named in a mismatch), ``key`` the
    job's secret. ``timeout`` None skips the handshake (``done`` from the start). Every datagram
    sent or met is counted in ``stats`` (the client's counters)."""

    def __init__(
        self, link: Link, descriptor: desc.Descriptor, *, job: int, rank: int,
        key: bytes | None, compressor: str | None, timeout: float | None,
        stats: dict[str, float],
    ) -> None:  # fmt: skip
        self.link = link
        self.descriptor = descriptor
        self.job = job
        self.rank = rank
        self.key = key
        self.compressor = compressor
        self.timeout = timeout
        self.stats = stats
        self.done = timeout is None
        # This client's incarnation nonce, in every hello it sends (docs/protocol.md, "A new set
        # of workers"): a new client of a rank starts a new set of workers at once.
        self.nonce = desc.draw_nonce()
        self.hello_at: float | None = None

    def start(self) -> None:
        """Send the first hello now, so that its answer is usually waiting when the first call
        starts: workers that reach their first call together then start sending together (a
        handshake made only then staggers them by round trips, and the first window of the
        earliest worker times out waiting for the others)."""
        if not self.done:
            with contextlib.suppress(OSError):  # no route yet: the first call asks again
                self.send()
                self.hello_at = time.monotonic()

    def run(self, timeout: float | None = None) -> int:
        """Compare this worker's job with the aggregator's (see ``AllreduceClient``'s doc),
        waiting ``timeout`` seconds at most (default ``self.timeout``); returns the aggregator's
        generation from its answer (0: none given)."""
        assert self.timeout is not None
        timeout = timeout or self.timeout
        mine = self.descriptor
        host, port = self.link.aggregator
        where = f"job {self.job} at {host}:{port}"
        no_such_job = False
        now = time.monotonic()
        end = now + timeout
        next_hello = now if self.hello_at is None else self.hello_at + HANDSHAKE_INTERVAL
        self.hello_at = None
        while now < end:
            if now >= next_hello:
                self.send()
                next_hello = now + HANDSHAKE_INTERVAL
            answer = self.next_answer(min(next_hello, end))
            now = time.monotonic()
            if answer is None:
                continue
            status, theirs, generation, _ = answer
            if status == desc.NO_SUCH_JOB:  # it may be installed yet: keep asking
                no_such_job = True
                continue
            if status == desc.NOT_AUTHENTIC:
                raise desc.JobMismatchError(
                    [desc.key_mismatch(self.key is not None, theirs.keyed)], where
                )
            wrong = desc.mismatches(mine, theirs, self.compressor)
            if wrong:
                raise desc.JobMismatchError(wrong, where)
            self.done = True
            return generation
        if no_such_job:
            raise desc.JobMismatchError([("job id", str(self.job), "has no such job")], where)
        raise TimeoutError(
            f"no answer to the job handshake from aggregator {host}:{port} within "
            f"{timeout:g} s (job {self.job}, rank {self.rank}): is it running, "
            "and does it speak the job handshake? (handshake_timeout=None skips it)"
        )

    def next_answer(self, until: float) -> tuple[int, desc.Descriptor, int, bool] | None:
        """The aggregator's next answer to a hello (:meth:`judge`) that arrives before the
        monotonic time ``until``, or None; whatever else arrives meanwhile is counted and
        dropped (:meth:`ignore`)."""
        link = self.link
        while (now := time.monotonic()) < until:
            if not link.poll.poll(max(1, math.ceil((until - now) * 1000))):
                continue
            while True:
                try:
                    size, sender = link.sock.recvfrom_into(link.buf)
                except BlockingIOError:
                    break
                if sender != link.aggregator:  # only the aggregator's answer is believed
                    self.ignore(size)
                    continue
                answer = self.judge(size)
                if answer is not None:
                    return answer
        return None

    def send(self, probe: bool = False) -> None:
        """Send this worker's job descriptor to the aggregator (a full send buffer skips it:
        the next hello goes ``HANDSHAKE_INTERVAL`` later); a ``probe`` asks without joining
        (``desc.FLAG_PROBE``)."""
        self.stats["handshakes"] += 1
        hello = desc.pack_job_datagram(self.descriptor, job=self.job, rank=self.rank, key=self.key,
                                       probe=probe, nonce=self.nonce)  # fmt: skip
        with contextlib.suppress(BlockingIOError, PermissionError):  # lost: hellos repeat
            self.link.sock.sendto(hello, self.link.aggregator)

    def ignore(self, size: int) -> None:
        """Count the datagram of ``size`` bytes in the receive buffer, met while waiting for an
        answer to a hello, as ignored; in a keyed job, one that does not authenticate (a forged
        result) as ``bad_tag`` too, as a call counts it."""
        self.stats["results_ignored"] += 1
        view = memoryview(self.link.buf)[:size]
        if self.key is not None and not (
            size > 1 and view[1] & FLAG_TAG and tag.verify(self.key, view)
        ):
            self.stats["bad_tag"] += 1

    def judge(self, size: int) -> tuple[int, desc.Descriptor, int, bool] | None:
        """``(status, descriptor, generation, unjoined)`` of the datagram of ``size`` bytes in
        the receive buffer if it is an answer to this worker's hello, else None (counted as
        ignored); ``unjoined``: the answer to a probe says this rank has not joined this start
        of the aggregator. An ``OK`` answer of a keyed job must carry a tag that verifies; the
        refusals carry none."""
        view = memoryview(self.link.buf)[:size]
        if not desc.is_job_datagram(view) or size < desc.JOB_DATAGRAM_SIZE:
            self.ignore(size)
            return None
        _, flags, _, _, job, rank, _, count, _ = HEADER.unpack_from(view)
        if (
            not flags & FLAG_RESULT or job != self.job or rank != self.rank or count != 1
            or size != desc.job_datagram_length(flags)
        ):
            self.stats["results_ignored"] += 1
            return None
        if flags & FLAG_TAG and (self.key is None or not tag.verify(self.key, view)):
            self.stats["results_ignored"] += 1
            self.stats["bad_tag"] += 1
            return None
        status, theirs = desc.Descriptor.unpack(view[HEADER_SIZE : desc.JOB_DATAGRAM_SIZE])
        if status == desc.OK and self.key is not None and not flags & FLAG_TAG:
            self.stats["results_ignored"] += 1
            self.stats["bad_tag"] += 1
            return None
        generation = (flags & GENERATION_MASK) >> GENERATION_SHIFT
        return status, theirs, generation, bool(flags & desc.FLAG_PROBE)

    def ask_generation(self, timeout: float) -> tuple[int, bool] | None:
        """``(generation, unjoined)`` of the aggregator's answer to one probe (a hello that
        does not join) within ``timeout`` seconds, or None (no answer, or not an ``OK`` one:
        the call that follows finds out why); ``unjoined``: this rank has not said hello to
        this start of the aggregator, which restarted whatever generation it drew. What else
        arrives meanwhile (late copies of the last call's results) is ignored, as a call would
        ignore it."""
        self.send(probe=True)
        answer = self.next_answer(time.monotonic() + timeout)
        if answer is None:
            return None
        status, _, generation, unjoined = answer
        return (generation, unjoined) if status == desc.OK else None
