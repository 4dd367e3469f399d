"""The worker side of one all-reduce job: NC8 uplink, SwitchML slot window, retransmission.

``AllreduceClient`` sums a float32 tensor with the other workers of a job through an aggregator
(any backend), following ``docs/protocol.md``:

- the tensor is encoded once (``ncina.proto.nc8.encode``) and packed into one datagram per chunk
  of ``k`` elements (``ncina.proto.header.pack_chunks``); chunk ``i`` goes to slot ``i % S``, and
  the slot's pool version flips on every use. The chunk's ``offset`` is its sequence number,
  ``uses * S + slot`` (mod 2**32), so the aggregator can tell a late packet from the slot's next
  use (docs/protocol.md, "Late and duplicate packets"). Use counts outlive a call, so
  consecutive tensors continue the sequence and every worker of the job stays in step
  (SwitchML);
- self-clocking: at most one chunk per slot is outstanding; the result of a slot releases the
  slot's next chunk;
- loss recovery: a slot whose result has not come back within its retransmission timeout (RTO) is
  re-sent with the ``RETX`` flag and its RTO doubles up to a cap. The RTO of a fresh chunk
  adapts to the measured round-trip time (RFC 6298, ``RtoEstimator``); the aggregator answers a
  duplicate of a completed slot with the stored result. With no valid result for ``deadline``
  seconds the call gives up with ``TimeoutError``, naming the ranks the aggregator's notices
  said it still waits for;
- restarts: the client learns the aggregator's generation from its first result and stamps it on
  every packet; a result or notice of another generation, or a restart notice of its own about
  its outstanding chunk (a new start that drew the same generation, which this rank has not
  said hello to), means the aggregator restarted and lost its slots: the client handshakes anew
  and agrees with the other ranks on the call, which is redone or served by a rank that
  completed it, up to ``restart_retries`` times a call, after
  which the call fails with ``AggregatorRestartedError`` (docs/protocol.md, "Generations and
  notices"; docs/reliability.md, "A restarted aggregator");
- authentication (optional, ``key``): every datagram carries the ``TAG`` flag and a keyed tag
  (``ncina.proto.tag``); a datagram from the aggregator whose tag does not verify is ignored
  before anything in it is believed (docs/protocol.md, "Authentication tag");
- compressors (optional, ``compressor``, docs/compressors.md): in INA mode a method whose
  payloads a switch can add (``ina``) quantizes the tensor first, and its powers of two go out as
  NC8 codes as above; in server mode (``mode="server"``, any method) every chunk is one BLOB, the
  method's payload of the chunk, and the aggregator sends back the compressed mean
  (docs/protocol.md, "Server mode"). The same slot machinery carries both.

Data paths: in INA mode the whole transfer of a tensor runs in C by default
(``ncina.worker.cpath``, ``worker/transfer.c``: the same loop, the NC8 encode fused into the send
and the decode into the receive, batched system calls, the GIL released); the Python loop
(``ncina.worker.transfer.Transfer``) is the reference, selected with ``data_path="python"`` or the
environment variable ``NCINA_DATA_PATH=python``, and the one server mode always uses. Both put the
same bytes on the wire for the same seed, and both share the RTO estimator
(``ncina.worker.timing``).

This module holds the public client: its checks, the job handshake, the choice of data path, the
encoding and decoding of a tensor, and the errors a transfer's outcome becomes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
import os
import select
import socket
import time
from collections.abc import Hashable
from types import TracebackType

import numpy as np
from ncina.proto import descriptor as desc
from ncina.proto import nc8, tag
from ncina.proto.compressors import Compressor, State, create
from ncina.proto.compressors.base import largest_fitting
from ncina.proto.header import (
    ELEMENT_SIZE,
    FLAG_RESULT,
    FLAG_TAG,
    GENERATION_MASK,
    GENERATION_SHIFT,
    HEADER,
    SUM_DTYPES,
    Format,
    pack_blobs,
    pack_chunks,
)
from ncina.proto.job import DEFAULT_POOL_SIZE, DEFAULT_WINDOW_MAX, FORMATS, default_k
from ncina.proto.profiles import DEFAULT, PROFILES, TOFINO, TOFINO_MAX_K, job_window
from ncina.proto.wire import (
    DEFAULT_MTU,
    HEADER_SIZE,
    MAX_DATAGRAM,
    MAX_TOTAL_WORKERS,
    TAG_SIZE,
    payload_room,
)
from ncina.worker import cpath
from ncina.worker.timing import RtoEstimator
from ncina.worker.transfer import Restarted, Stalled, Transfer, schedule
from ncina.worker.window import WINDOW_ENV, WINDOW_MODES, CongestionWindow

__all__ = [  # the public API, as users import it (RtoEstimator is ncina.worker.timing's)
    "DATA_PATHS",
    "DATA_PATH_ENV",
    "HANDSHAKE_INTERVAL",
    "HANDSHAKE_TIMEOUT",
    "MODES",
    "OPS",
    "STAT_KEYS",
    "AggregatorRestartedError",
    "AllreduceClient",
    "RtoEstimator",
    "check_mode",
]

log = logging.getLogger(__name__)

OPS = ("mean", "sum")
MODES = ("ina", "server")
DATA_PATHS = ("c", "python")  # the default first
DATA_PATH_ENV = "NCINA_DATA_PATH"  # overrides the default data path ("c") when data_path is None
SOCKET_BUFFER = 4 << 20  # requested SO_RCVBUF/SO_SNDBUF; the kernel caps it at rmem_max/wmem_max

STAT_KEYS = (
    "packets_sent",
    "packets_received",
    "bytes_sent",
    "bytes_received",
    "retransmissions",
    "bytes_retransmitted",
    "timeouts",
    "results_ignored",
    "notices",
    "bad_tag",
    "saturated",
    "send_refused",
    "held_back",
    "allreduce_calls",
    "elements",
    "handshakes",
    "restarts",
)
HANDSHAKE_TIMEOUT = 1.0  # seconds a worker waits for the aggregator's job descriptor
HANDSHAKE_INTERVAL = 0.1  # seconds between two hellos while no answer came
PROBE_TIMEOUT = 0.2  # seconds :meth:`AllreduceClient.recover_if_restarted` waits for an answer
NIBBLES = 8  # lanes of 4 bits that carry one float32 when a recovery serves a sum


class AggregatorRestartedError(RuntimeError):
    """The aggregator restarted (a result or notice of another generation): the slot state of
    the all-reduce in progress is lost, so it cannot complete; nothing partial is returned."""


def check_mode(compressor: Compressor, mode: str) -> None:
    """Raise ``ValueError`` unless ``compressor`` can run in ``mode`` (``ina`` or ``server``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "ina" and not compressor.ina:
        raise ValueError(
            f"{compressor.name} payloads cannot be summed by a switch, so it cannot run in INA "
            "mode: use --mode server (the aggregator decompresses, averages and re-compresses)"
        )


class AllreduceClient:
    """One worker (``rank`` of ``workers``) of job ``job`` at ``aggregator``; see the module doc.

    ``k`` elements per packet (default: the most that fit a packet of ``mtu`` bytes both ways,
    ``ncina.proto.header.largest_k``; under a leaf, int lanes, as the leaf's), ``pool_size``
    slots, ``window_max`` the largest in-window
    exponent (the window is ``nc8.Window.for_job(total_workers, window_max, sum_bits)``,
    ``total_workers`` the workers of the whole tree under a leaf aggregator, default ``workers``:
    docs/protocol.md, "Hierarchical aggregation"; ``mean`` divides by it; ``sum_bits`` 30 for
    int32 results, else 62: "int32 results"); ``result_format`` is the job's downlink format
    (``nc8``, ``int`` or ``int32``), which must match the aggregator's. ``seed`` seeds
    the stochastic rounding. ``timeout`` is the retransmission timeout until the first RTT sample,
    ``min_timeout``/``max_timeout`` the floor and cap of the adaptive one, ``deadline`` the longest
    wait for any progress. After a ``TimeoutError`` the slot sequence is out of step with the job's,
    so the client refuses further calls. ``key`` is the job's shared secret when the aggregator's
    job has one (``ncina.proto.tag``).

    ``compressor`` is a spec ``[ef+]name[:k=v]`` (docs/compressors.md) and ``mode`` where the sum
    is made: ``ina`` (the switch adds NC8 codes; the method must be ``ina``: it quantizes, NC8
    carries its values) or ``server`` (the aggregator runs the same spec: see the module doc).
    In server mode ``result_format`` is unused and each chunk holds at most ``k`` elements, fewer
    when the method's largest payload (``max_payload_size``) would not fit a datagram on a link of
    ``mtu`` bytes. Compressor state (random stream, error-feedback memory) is kept per tensor in
    INA mode and per chunk in server mode, where every tensor also gets its own range of offsets
    (so that the server's error-feedback memory, kept per offset and length, is its own): see
    :meth:`allreduce`'s ``tensor``.

    ``data_path`` chooses the INA transfer loop: ``"c"`` (``ncina.worker.cpath``) or ``"python"``
    (the reference); None takes ``$NCINA_DATA_PATH``, else ``"c"``. Server mode always runs the
    Python loop. When the C extension cannot be built the constructor raises ``RuntimeError``
    saying why and how to select the Python loop (it never falls back silently). ``data_path``
    (the attribute) is the loop in use.

    ``cwnd`` chooses how many slots are in flight (``ncina.worker.window``, docs/reliability.md,
    "The congestion window"): ``"adaptive"`` (a delay-based congestion window, at most the pool)
    or ``"fixed"`` (the whole pool); None takes ``$NCINA_CWND``, else ``"fixed"`` (the A/B in
    docs/reliability.md: the adaptive window takes copies off the wire but costs link use and
    slows recovery from heavy random loss). The window (``congestion``) lives as long as the
    client, on both data paths, like the RTO.

    Before its first chunk the client sends its job descriptor (docs/protocol.md, "Job
    handshake"; the first one already when it is made) every ``HANDSHAKE_INTERVAL`` seconds
    until the aggregator answers, at most ``handshake_timeout`` seconds from the first call: a
    job that differs in any parameter (mode and result format, workers, pool size, k, window,
    server mode's compressor, the key) raises
    ``JobMismatchError`` naming each one with both values, no job of that id at the aggregator
    raises it naming the job id, and no answer at all ``TimeoutError``. A failed handshake is
    tried again by the next call. ``handshake_timeout=None`` skips it (an aggregator that does
    not speak it). The limits on ``job``, ``workers``, ``k`` and ``pool_size`` are the
    aggregator's (``ncina.proto.descriptor.check_job``).

    ``profile`` is the job's (``ncina.proto.profiles``: ``tofino`` caps the window's codes as
    the Tofino design does, and its default K is the design's), which must match the
    aggregator's.

    ``restart_retries`` is how many restarts of the aggregator one INA call recovers from
    (:meth:`_ina_allreduce`; every rank of the job must recover, so give them all the same);
    0, server mode and hierarchical jobs fail the call at the first one. An INA client of a job
    of two workers or more with the handshake makes the recovery's agreement once after its
    first handshake, before its first call (:meth:`_agree_first`: one chunk of ``workers``
    elements, whatever ``restart_retries``, since every rank of the job must make it).
    """

    def __init__(
        self,
        aggregator: tuple[str, int],
        *,
        job: int,
        rank: int,
        workers: int,
        k: int | None = None,
        pool_size: int = DEFAULT_POOL_SIZE,
        window_max: int = DEFAULT_WINDOW_MAX,
        result_format: str = "nc8",
        seed: int | None = None,
        timeout: float = 0.05,
        max_timeout: float = 1.0,
        min_timeout: float = 0.02,
        deadline: float = 10.0,
        bind: tuple[str, int] = ("0.0.0.0", 0),
        key: bytes | None = None,
        compressor: str | None = None,
        mode: str = "ina",
        mtu: int = DEFAULT_MTU,
        data_path: str | None = None,
        cwnd: str | None = None,
        handshake_timeout: float | None = HANDSHAKE_TIMEOUT,
        total_workers: int | None = None,
        restart_retries: int = 3,
        profile: str = DEFAULT,
    ) -> None:
        if result_format not in FORMATS:
            raise ValueError(f"result_format must be one of {sorted(FORMATS)}")
        if k is None:
            # Under a leaf the tree's K is the leaf's: its partial sums go up as int lanes.
            under_leaf = total_workers is not None and total_workers > workers
            fmt = Format.INT if under_leaf else FORMATS[result_format]
            k = default_k(mtu, fmt, key is not None)
            k = min(k, TOFINO_MAX_K) if profile == TOFINO else k
        desc.check_job(job=job, workers=workers, k=k, pool_size=pool_size)
        desc.check_range("rank", rank, 0, workers - 1, f" (job of {workers} workers)")
        if handshake_timeout is not None and not handshake_timeout > 0:
            raise ValueError(f"handshake_timeout must be positive or None, got {handshake_timeout}")
        if deadline <= 0:
            raise ValueError(f"deadline must be positive, got {deadline}")
        if restart_retries < 0:
            raise ValueError(f"restart_retries must be 0 or more, got {restart_retries}")
        self.restart_retries = restart_retries
        self.key = None if key is None else tag.check_key(key)
        self.job = job
        self.rank = rank
        self.workers = workers
        # Hierarchical aggregation (docs/protocol.md): the workers of the whole tree, whose
        # window every member of the job uses and whose sum the results are.
        if total_workers is not None:
            desc.check_range("total_workers", total_workers, workers, MAX_TOTAL_WORKERS,
                             f" (at least the {workers} workers of this aggregator)")  # fmt: skip
            if mode == "server" and total_workers != workers:
                raise ValueError("server mode has no hierarchical aggregation (total_workers)")
        self.total_workers = total_workers or workers
        self.k = k
        self.pool_size = pool_size
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        if profile != DEFAULT and (mode != "ina" or compressor is not None):
            raise ValueError(f"the {profile} profile adds the NC8 codes of its window only: "
                             "INA mode, no compressor")  # fmt: skip
        self.profile = profile
        self.window = job_window(
            self.total_workers, window_max,
            FORMATS[result_format] if mode == "ina" else Format.NC8, profile,
        )
        self.result_format = result_format
        self.deadline = deadline
        self.timer = RtoEstimator(timeout, max_timeout, min_timeout)
        self.congestion = CongestionWindow(pool_size, _choose_window(cwnd))
        self._format = FORMATS[result_format]
        self._rng = np.random.default_rng(seed)
        self.compressor = (
            None
            if compressor is None
            else create(compressor, workers=self.total_workers, e_max=window_max)
        )
        self.compressor_spec = compressor
        self.handshake_timeout = handshake_timeout
        self._handshaken = handshake_timeout is None
        # This client's incarnation nonce, in every hello it sends (docs/protocol.md, "A new set
        # of workers"): a new client of a rank starts a new set of workers at once.
        self._nonce = desc.draw_nonce()
        self.mode = mode
        if self.compressor is None and mode != "ina":
            raise ValueError(f"mode {mode!r} needs a compressor")
        self.chunk = k  # elements per chunk
        if self.compressor is not None:
            check_mode(self.compressor, mode)
        if mode == "server":
            self._format = Format.BLOB
            room = payload_room(mtu, self.key is not None)
            self.chunk = largest_fitting(self.compressor, room, k)
            if not self.chunk:
                raise ValueError(f"no {compressor} payload fits a datagram at MTU {mtu}")
        # Per (tensor, size): the first offset of its range (server mode) and the compressor
        # states, by offset of its chunk (server mode) or of the tensor (INA mode).
        self._ranges: dict[tuple[Hashable, int], int] = {}
        self._states: dict[int, State] = {}
        self.generation = 0  # the aggregator's, from its first result (0: not known yet)
        # Uses of each slot so far, across calls: the parity is the pool version of its next
        # use, and its next INA chunk's offset is ``uses * S + slot`` (mod 2**32).
        self._slot_uses = np.zeros(pool_size, dtype=np.int64)
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._broken = ""  # why the client is unusable, if it is
        # Restart recovery (docs/reliability.md, "A restarted aggregator"): the INA calls this
        # client completed, the sum of the last one (what a rank behind it may need served)
        # and a buffer the C path decodes into when the caller's ``out`` is its input.
        self._completed = 0
        # Whether this client made the recovery's agreement in its aggregator's start: once
        # after its first handshake (``_agree_first``), so that a rank recovering from a start it
        # completed no call in meets a fresh rank there (issue 38, case 4). Every rank of a job
        # must make it, so it depends on the job only: INA, a handshake, two workers or more in
        # the tree (a one-worker job has nobody to meet).
        self._agreed = not (
            mode == "ina" and handshake_timeout is not None and self.total_workers > 1
        )
        self._kept = [np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.uint8)]
        self._last_kept = 0  # the buffer of _kept that holds the last call's results
        self._last: tuple[str, int, np.ndarray | None] = ("kept", 0, None)
        self._scratch = np.zeros(0, dtype=np.float32)
        # Resolve once: sendto() with a host name would resolve it on every packet.
        family, _, _, _, address = socket.getaddrinfo(
            aggregator[0], aggregator[1], socket.AF_INET, socket.SOCK_DGRAM
        )[0]
        self.aggregator: tuple[str, int] = address
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                self._sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            self._sock.bind(bind)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._buf = bytearray(MAX_DATAGRAM)
        self.data_path = "python" if mode == "server" else _choose_data_path(data_path)
        self._c: cpath.CTransfer | None = None
        if self.data_path == "c":
            try:
                self._c = cpath.CTransfer(
                    self._sock, self.aggregator, job=job, rank=rank, pool_size=pool_size, k=k,
                    e_min=self.window.e_min, span=self.window.span, result_format=self._format,
                    key=self.key, slot_uses=self._slot_uses,
                )
            except (RuntimeError, OSError) as exc:
                self._sock.close()
                raise RuntimeError(
                    f"the C data path is unavailable: {exc}; pass data_path='python' or set "
                    f"{DATA_PATH_ENV}=python to use the Python loop"
                ) from exc
        # The first hello goes now, so that its answer is usually waiting when the first call
        # starts: workers that reach their first call together then start sending together (a
        # handshake made only then staggers them by round trips, and the first window of the
        # earliest worker times out waiting for the others).
        self._hello_at: float | None = None
        if not self._handshaken:
            with contextlib.suppress(OSError):  # no route yet: the first call asks again
                self._send_hello()
                self._hello_at = time.monotonic()

    @property
    def descriptor(self) -> desc.Descriptor:
        """The job as this worker holds it (what its handshake sends)."""
        server = self.mode == "server"
        return desc.Descriptor(
            mode=desc.MODE_SERVER if server else int(self._format),
            workers=self.workers,
            pool_size=self.pool_size,
            k=self.chunk,
            e_max=self.window.e_max,
            e_min=self.window.e_min,
            keyed=self.key is not None,
            compressor=desc.compressor_hash(self.compressor) if server else 0,
        )

    def _handshake(self, timeout: float | None = None) -> None:
        """Compare this worker's job with the aggregator's, once, before the first chunk (see
        the class doc), waiting ``timeout`` seconds at most (default ``handshake_timeout``).
        Learns the aggregator's generation from its answer."""
        if self._handshaken:
            return
        assert self.handshake_timeout is not None
        timeout = timeout or self.handshake_timeout
        mine = self.descriptor
        host, port = self.aggregator
        where = f"job {self.job} at {host}:{port}"
        no_such_job = False
        now = time.monotonic()
        end = now + timeout
        next_hello = now if self._hello_at is None else self._hello_at + HANDSHAKE_INTERVAL
        self._hello_at = None
        while now < end:
            if now >= next_hello:
                self._send_hello()
                next_hello = now + HANDSHAKE_INTERVAL
            answer = self._next_answer(min(next_hello, end))
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
            wrong = desc.mismatches(mine, theirs, self.compressor_spec)
            if wrong:
                raise desc.JobMismatchError(wrong, where)
            self.generation = generation or self.generation
            self._handshaken = True
            return
        if no_such_job:
            raise desc.JobMismatchError([("job id", str(self.job), "has no such job")], where)
        raise TimeoutError(
            f"no answer to the job handshake from aggregator {host}:{port} within "
            f"{timeout:g} s (job {self.job}, rank {self.rank}): is it running, "
            "and does it speak the job handshake? (handshake_timeout=None skips it)"
        )

    def _next_answer(self, until: float) -> tuple[int, desc.Descriptor, int, bool] | None:
        """The aggregator's next answer to a hello (:meth:`_judge_answer`) that arrives before
        the monotonic time ``until``, or None; whatever else arrives meanwhile is counted and
        dropped (:meth:`_ignore`)."""
        while (now := time.monotonic()) < until:
            if not self._poll.poll(max(1, math.ceil((until - now) * 1000))):
                continue
            while True:
                try:
                    size, sender = self._sock.recvfrom_into(self._buf)
                except BlockingIOError:
                    break
                if sender != self.aggregator:  # only the aggregator's answer is believed
                    self._ignore(size)
                    continue
                answer = self._judge_answer(size)
                if answer is not None:
                    return answer
        return None

    def _send_hello(self, probe: bool = False) -> None:
        """Send this worker's job descriptor to the aggregator (a full send buffer skips it:
        the next hello goes ``HANDSHAKE_INTERVAL`` later); a ``probe`` asks without joining
        (``desc.FLAG_PROBE``)."""
        self._stats["handshakes"] += 1
        hello = desc.pack_job_datagram(self.descriptor, job=self.job, rank=self.rank, key=self.key,
                                       probe=probe, nonce=self._nonce)  # fmt: skip
        with contextlib.suppress(BlockingIOError, PermissionError):  # lost: hellos repeat
            self._sock.sendto(hello, self.aggregator)

    def _ignore(self, size: int) -> None:
        """Count the datagram of ``size`` bytes in the receive buffer, met while waiting for an
        answer to a hello, as ignored; in a keyed job, one that does not authenticate (a forged
        result) as ``bad_tag`` too, as a call counts it."""
        self._stats["results_ignored"] += 1
        view = memoryview(self._buf)[:size]
        if self.key is not None and not (
            size > 1 and view[1] & FLAG_TAG and tag.verify(self.key, view)
        ):
            self._stats["bad_tag"] += 1

    def _judge_answer(self, size: int) -> tuple[int, desc.Descriptor, int, bool] | None:
        """``(status, descriptor, generation, unjoined)`` of the datagram of ``size`` bytes in
        the receive buffer if it is an answer to this worker's hello, else None (counted as
        ignored); ``unjoined``: the answer to a probe says this rank has not joined this start
        of the aggregator. An ``OK`` answer of a keyed job must carry a tag that verifies; the
        refusals carry none."""
        view = memoryview(self._buf)[:size]
        if not desc.is_job_datagram(view) or size < desc.JOB_DATAGRAM_SIZE:
            self._ignore(size)
            return None
        _, flags, _, _, job, rank, _, count, _ = HEADER.unpack_from(view)
        if (
            not flags & FLAG_RESULT or job != self.job or rank != self.rank or count != 1
            or size != desc.job_datagram_length(flags)
        ):
            self._stats["results_ignored"] += 1
            return None
        if flags & FLAG_TAG and (self.key is None or not tag.verify(self.key, view)):
            self._stats["results_ignored"] += 1
            self._stats["bad_tag"] += 1
            return None
        status, theirs = desc.Descriptor.unpack(view[HEADER_SIZE : desc.JOB_DATAGRAM_SIZE])
        if status == desc.OK and self.key is not None and not flags & FLAG_TAG:
            self._stats["results_ignored"] += 1
            self._stats["bad_tag"] += 1
            return None
        generation = (flags & GENERATION_MASK) >> GENERATION_SHIFT
        return status, theirs, generation, bool(flags & desc.FLAG_PROBE)

    @property
    def address(self) -> tuple[str, int]:
        """The local address results come back to."""
        return self._sock.getsockname()

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counters (a copy). ``timeouts`` counts timer checks that found expired
        slots; ``retransmissions`` the chunks re-sent by them and ``bytes_retransmitted`` their
        bytes (part of ``bytes_sent`` unless the send buffer was full); ``results_ignored``
        datagrams that were not the expected result of an outstanding chunk (stale, duplicate,
        foreign, malformed).
        ``notices`` counts the aggregator's notices (slot status, docs/protocol.md), which are
        also in ``results_ignored``. ``rtt_samples`` counts the RTT measurements taken,
        ``rtt_outliers`` those skipped as a wait for another worker's recovery, ``rto_s`` is
        the current RTO (s). ``cwnd`` is the congestion window (slots, fractional),
        ``stalls`` the timer checks that found
        no result for an RTO, and ``held_back`` the expired chunks such a check did not re-send
        (not in ``retransmissions``).
        """
        timer, window = self.timer, self.congestion
        return {**self._stats, "rtt_samples": timer.samples, "rtt_outliers": timer.outliers,
                "rto_s": timer.rto, "cwnd": window.cwnd,
                "stalls": window.stalls}

    def close(self) -> None:
        """Close the socket."""
        self._sock.close()

    def __enter__(self) -> AllreduceClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def allreduce(
        self,
        x: np.ndarray,
        op: str = "mean",
        tensor: Hashable = None,
        *,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Sum (``op="sum"``) or average (``"mean"``) ``x`` over the job's workers.

        ``x`` is a floating-point array (cast to float32); the result is float32 of the same
        shape. NaN or infinity raises ``ValueError`` before anything is sent. Raises
        ``TimeoutError`` when no valid result arrives for ``deadline`` seconds, and
        ``AggregatorRestartedError`` when the aggregator restarted during the call more often
        than the client recovers from (``restart_retries``).

        ``out``, a writable C-contiguous float32 array of ``x``'s shape, receives the result
        (and is returned) instead of a new array; it may be ``x`` itself (every chunk is read
        before its result is written, and no chunk's result lands outside its own elements).
        On the C data path with no compressor nothing of the tensor's size is allocated then:
        the results are decoded straight into it (the DDP hook's pinned staging buffers). If
        the call fails, ``out`` may hold some chunks' results.

        ``tensor`` names the tensor for the compressor's state: calls with the same name and
        size continue one tensor (its error-feedback memory, its offsets in server mode), and
        every worker must make the same calls in the same order. Without a compressor it is
        unused.
        """
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if self._broken:
            raise RuntimeError(f"client unusable after an earlier failure: {self._broken}")
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"allreduce needs a floating-point array, got {x.dtype}")
        dest = None if out is None else _destination(out, x.shape)
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        n = flat.size
        if n >= 1 << 32:
            raise ValueError(f"{n} elements do not fit the 32-bit offset field")
        if self.mode == "server":
            total = self._server_allreduce(flat, tensor)
            if op == "sum":
                total *= np.float32(self.workers)
        else:
            if self.compressor is not None:  # an INA method: values are NC8-exact powers of two
                state = self._state(self._range(tensor, n))
                flat = self.compressor.decompress(self.compressor.compress(flat, state))
            divisor = self.total_workers if op == "mean" else 1
            total = self._ina_allreduce(flat, dest, divisor)
        if out is None:
            return total.reshape(x.shape)
        if total is not dest:
            np.copyto(dest, total)
        return out

    @property
    def recovers(self) -> bool:
        """Whether a restart of the aggregator during a call is recovered from (INA mode, one
        level, ``restart_retries`` > 0): see :meth:`_ina_allreduce`."""
        return self.restart_retries > 0 and self.total_workers == self.workers

    def _ina_allreduce(
        self, flat: np.ndarray, out: np.ndarray | None, divisor: int = 1
    ) -> np.ndarray:
        """The sum of ``flat`` (float32, 1-D) over the workers in INA mode, divided by
        ``divisor`` (float32: ``sum / np.float32(divisor)``, the C path in its decode pass), on
        the data path in use, into ``out`` or a new array (returned).

        A restart of the aggregator (a result or notice of another generation) is recovered
        from up to ``restart_retries`` times in this call (docs/reliability.md, "A restarted
        aggregator"): the client forgets the old aggregator (handshake anew, slot uses from 0),
        every rank of the job says with one small all-reduce how many calls it completed, and
        then either every rank redoes this call with the same codes, or, when some ranks had
        completed it (or, for a rank already in its next call, the previous one) before the
        restart, the lowest of them serves its sum to the others bit for bit, and the ranks
        that served redo their current call. So every rank returns the same bits for every
        call. One restart more raises ``AggregatorRestartedError`` and the client is unusable.
        """
        n = flat.size
        prepared = self._prepare(flat)  # NaN or infinity raises before the call is counted
        self._stats["allreduce_calls"] += 1
        self._stats["elements"] += n
        if n == 0:
            return np.zeros(0, dtype=np.float32) if out is None else out
        if self._c is not None and self.recovers and out is not None and np.may_share_memory(
            out, flat
        ):  # keep the input whole for a redo: decode elsewhere, copied into out at the end
            if self._scratch.size < n:
                self._scratch = np.empty(n, dtype=np.float32)
            out = self._scratch[:n]
        # The undivided results are kept (a rank behind may need them served) in the buffer
        # that does not hold the last call's, which a restart during this call may need.
        keep = self._keep_room(1 - self._last_kept, n) if self.recovers else None
        restarts = 0
        recover = False
        while True:
            try:
                if recover:
                    served = self._recovered(n)
                    if served is not None:
                        total = served if out is None else out
                        if served is not out:
                            np.copyto(total, served)
                        self._last = ("served", n, served.copy())  # recovers, so keeps
                        if divisor != 1:
                            total /= np.float32(divisor)
                        break
                elif not self._agreed:
                    self._agree_first()
                total = self._transfer(flat, prepared, out, divisor, keep)
                if self.recovers:
                    self._last_kept = 1 - self._last_kept
                    self._last = ("kept", n, None)
                break
            except _Restart as restart:
                restarts += 1
                if restarts > self.restart_retries or not self.recovers:
                    self._fail(_restarted(self, restart.generation, restarts - 1))
                recover = True
        if self.recovers:
            self._completed += 1
        return total

    def recover_if_restarted(self, timeout: float = PROBE_TIMEOUT) -> bool:
        """Between two calls, while this rank waits for the others somewhere else (a gloo
        collective, such as the DDP hook's per-call agreement): ask the aggregator with one
        hello whether it restarted since this client's last call, and if it did, run the
        restart recovery now rather than at the next call. A rank whose result of the last call
        was lost in the restart is recovering inside that call and needs every rank in the
        recovery's own calls; a rank that waits in gloo for that rank would otherwise never
        make one (issue 38, case 5). Every rank that waits must probe, so that all of them
        meet in the recovery. Returns whether it recovered; raises as a call's recovery does.
        """
        if (
            self._broken or not self.recovers or not self._handshaken or self.generation == 0
            or self.handshake_timeout is None
        ):
            return False
        asked = self._ask_generation(timeout)
        if asked is None or asked == (self.generation, False):
            return False
        restarts = 0
        while True:
            try:
                served = self._recovered(0)
            except _Restart as restart:
                restarts += 1
                if restarts > self.restart_retries:
                    self._fail(_restarted(self, restart.generation, restarts - 1))
                continue
            if served is not None:  # a rank ahead of one that waits between calls cannot be
                self._fail(RuntimeError("restart recovery between calls: another rank "
                                        "completed a call this rank has not started"))
            return True

    def _ask_generation(self, timeout: float) -> tuple[int, bool] | None:
        """``(generation, unjoined)`` of the aggregator's answer to one probe (a hello that
        does not join) within ``timeout`` seconds, or None (no answer, or not an ``OK`` one:
        the call that follows finds out why); ``unjoined``: this rank has not said hello to
        this start of the aggregator, which restarted whatever generation it drew. What else
        arrives meanwhile (late copies of the last call's results) is ignored, as a call would
        ignore it."""
        self._send_hello(probe=True)
        answer = self._next_answer(time.monotonic() + timeout)
        if answer is None:
            return None
        status, _, generation, unjoined = answer
        return (generation, unjoined) if status == desc.OK else None

    def _keep_room(self, which: int, n: int) -> np.ndarray:
        """Keep buffer ``which`` (0 or 1), grown to hold ``n`` results (NC8 codes, 1 byte each;
        int sums, float32): reused from call to call, so that after the first call of a size
        keeping the results costs no allocation, no page faults, no pass of its own."""
        need = n * (1 if self._format == Format.NC8 else 4)
        if self._kept[which].size < need:
            self._kept[which] = np.empty(need, dtype=np.uint8)
        return self._kept[which][:need]

    def _last_sum(self) -> np.ndarray:
        """The sum (float32) of the last call this client completed, as it was computed."""
        kind, n, served = self._last
        if kind == "served":
            return served
        kept = self._kept[self._last_kept]
        if self._format == Format.NC8:
            return nc8.decode(kept[:n], self.window)
        return kept[: 4 * n].view(np.float32)

    def _prepare(self, flat: np.ndarray, rng: np.random.Generator | None = None) -> object:
        """What a transfer of ``flat`` needs that must not change when it is redone: the NC8
        codes (Python path) or the key of the C path's fused encode, drawn from ``rng`` (default
        the client's random stream) as ``nc8.encode`` draws it. Raises ``ValueError`` for NaN or
        infinity."""
        n = flat.size
        rng = self._rng if rng is None else rng
        if self._c is None:
            encoded = nc8.encode(flat, self.window, rng)
            if encoded.saturated:
                self._stats["saturated"] += encoded.saturated
                self._warn_saturated(encoded.saturated, n)
            return encoded.codes
        key = nc8._draw_key(rng)  # nc8.encode's key for the same call
        bad = self._c.first_nonfinite(flat)
        if bad < n:
            raise ValueError(f"cannot encode {float(flat[bad])} at flat index {bad}")
        return key

    def _transfer(
        self, flat: np.ndarray, prepared: object, out: np.ndarray | None, divisor: int = 1,
        keep: np.ndarray | None = None,
    ) -> np.ndarray:  # fmt: skip
        """One transfer of the call prepared by :meth:`_prepare`: its sum divided by
        ``divisor``, into ``out`` (C path) or a new array; the undivided sum also into ``keep``
        (see :meth:`_keep_room`) when given. Raises ``_Restart`` when the aggregator restarted;
        any other failure makes the client unusable."""
        if self._c is not None:
            return self._c_allreduce(flat, prepared, out, divisor, keep)
        return self._python_allreduce(prepared, divisor, keep)

    def _python_allreduce(
        self, codes: np.ndarray, divisor: int = 1, keep: np.ndarray | None = None
    ) -> np.ndarray:
        """The sum of the tensor of NC8 ``codes`` over the workers, divided by ``divisor``,
        through the Python loop (the reference of the C path): packed at once, ``Transfer``, one
        decode at the end; the undivided sum into ``keep`` as the C path keeps it."""
        n = codes.size
        element_size = ELEMENT_SIZE[self._format]
        received = bytearray(n * element_size)
        chunks = -(-n // self.k)
        slots, pools, offsets = schedule(self._slot_uses, chunks)
        frames, lengths = pack_chunks(
            codes, k=self.k, job=self.job, rank=self.rank, emin=self.window.e_min,
            slots=slots, pools=pools, offsets=offsets,
        )
        self._exchange(frames, lengths, pools, received)
        if self._format == Format.NC8:
            codes = np.frombuffer(received, dtype=np.uint8)
            total = nc8.decode(codes, self.window)
        else:
            sums = np.frombuffer(received, dtype=SUM_DTYPES[self._format]).astype(np.int64)
            total = nc8.ints_to_float(sums, self.window)
            codes = total.view(np.uint8)
        if keep is not None:
            np.copyto(keep, codes)
        if divisor != 1:
            total /= np.float32(divisor)
        return total

    def _sum_internal(self, values: np.ndarray) -> np.ndarray:
        """The sum of ``values`` (float32 powers of two, exact in NC8) over the workers, for the
        recovery's own calls: not counted as a call, no compressor, the input kept, and no key
        drawn from the client's random stream (exact values round the same with any key), so
        the agreement after the handshake leaves the calls' rounding as it was."""
        prepared = self._prepare(values, np.random.default_rng(0))
        return self._transfer(values, prepared, None)

    def _recovered(self, n: int) -> np.ndarray | None:
        """:meth:`_recover`; a failure other than another restart makes the client unusable
        (the other ranks are in the recovery's calls)."""
        try:
            return self._recover(n)
        except _Restart:
            raise
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def _recover(self, n: int) -> np.ndarray | None:
        """After a restart: handshake with the new aggregator, agree with every rank on where
        each one is, and serve or receive the sum of a call that some ranks completed and
        others did not (:meth:`_agree`). Returns that sum when this rank was behind (its current
        call, of ``n`` elements, is then complete), None when this rank must (re)do its current
        call. Raises ``_Restart`` if the aggregator restarts again meanwhile."""
        self._stats["restarts"] += 1
        log.warning("job %d rank %d: aggregator %s:%d restarted; recovering", self.job,
                    self.rank, *self.aggregator)  # fmt: skip
        self._slot_uses[:] = 0  # the new aggregator's slots are new: every rank starts at 0
        self.generation = 0
        if self.handshake_timeout is not None:
            self._handshaken = False
            self._handshake(max(self.handshake_timeout, self.deadline))
        return self._agree(n)

    def _agree_first(self) -> None:
        """The recovery's agreement, made once after this client's first handshake, before its
        first call (every count 0, so nobody serves): a rank whose first handshake a start of the
        aggregator answered, and which recovers when that start is replaced before it completed
        a call there, makes the same agreement in the new start's slot 0, where a rank that
        handshook only with the new start meets it (issue 38, case 4). A restart during it is
        recovered as during a call, and the recovery's agreement takes its place. A failed
        handshake is tried again by the next call; any other failure makes the client unusable.

        A worker under a leaf (no recovery: the leaf sees the spine restart) sends zeros of the
        same size instead, so that a tree's slot sequence, and so its results, stay a one-level
        job's of all its workers (the aggregators' rounding keys follow the slot sequence)."""
        self._handshake()
        try:
            if self.total_workers != self.workers:
                self._sum_internal(np.zeros(self.total_workers, dtype=np.float32))
                self._agreed = True
            elif self._agree(0) is not None:  # a rank ahead needs this rank's first call
                raise RuntimeError("restart recovery: another rank completed a call before "
                                   "this rank's first")  # fmt: skip
        except _Restart:
            raise
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def _agree(self, n: int) -> np.ndarray | None:
        """The recovery's agreement (and serve call, when the ranks are one call apart) with
        every rank, in this client's aggregator's start: see :meth:`_recover`."""
        one = np.float32(2.0**self.window.e_min)
        # Each rank's number of completed calls, mod 4, in a lane of its own: a lane has one
        # contributor, so its sum is one power of two, exact in either result format.
        lanes = np.zeros(self.workers, dtype=np.float32)
        lanes[self.rank] = one * np.float32(2 ** (self._completed % 4))
        seen = _exponents(self._sum_internal(lanes) / one)
        self._agreed = True
        residues = set(seen.tolist())
        if len(residues) == 1:
            return None  # nobody has more than this rank: everyone (re)does the current call
        low, high = sorted(residues)[0], sorted(residues)[-1]
        if len(residues) > 2 or ((low + 1) % 4 != high and (high + 1) % 4 != low):
            raise RuntimeError(f"restart recovery: ranks disagree beyond one call: {seen}")
        ahead = high if (low + 1) % 4 == high else low
        server = int(np.flatnonzero(seen == ahead)[0])
        mine = seen[self.rank] == ahead
        last = self._last_sum() if mine else None
        size = last.size if last is not None else n
        nibbles = np.zeros((size, NIBBLES), dtype=np.float32)
        if self.rank == server:  # 4 bits a lane, 2**(e_min + bits): never 0, exact
            assert last is not None
            bits = last.view(np.uint32)[:, None] >> (4 * np.arange(NIBBLES, dtype=np.uint32))
            nibbles[:] = one * np.exp2((bits & 0xF).astype(np.float32))
        got = self._sum_internal(nibbles.reshape(-1)).reshape(size, NIBBLES)
        codes = _exponents(got / one).astype(np.uint32)
        served = (codes << (4 * np.arange(NIBBLES, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
        if mine:
            return None  # this rank had it: it goes on with its current call
        return served.view(np.float32)

    def _fail(self, error: BaseException) -> None:
        """Make the client unusable for ``error`` and raise it."""
        self._broken = f"{type(error).__name__}: {error}"
        raise error

    def _warn_saturated(self, saturated: int, n: int) -> None:
        """Log that ``saturated`` of the call's ``n`` elements were clipped (biased: rare by
        design, so a warning says the window is too small)."""
        log.warning(
            "job %d rank %d: %d of %d elements saturated at 2**%d (window too small?)",
            self.job, self.rank, saturated, n, self.window.e_max,
        )

    def _c_allreduce(
        self, flat: np.ndarray, key: int, out: np.ndarray | None = None, divisor: int = 1,
        keep: np.ndarray | None = None,
    ) -> np.ndarray:  # fmt: skip
        """The sum of ``flat`` (float32, 1-D, checked finite) over the workers through the C
        data path with NC8 stream key ``key``, divided by ``divisor`` in the decode, into ``out``
        (1-D float32 of ``flat``'s size, may be ``flat``: see :meth:`allreduce`) or a new array;
        returns it. The undivided results also go into ``keep`` when given. The timer and the
        generation are the client's, copied in and back out. Raises ``_Restart`` when the
        aggregator restarted."""
        c = self._c
        assert c is not None
        n = flat.size
        if out is None:
            out = np.empty(n, dtype=np.float32)
        self._handshake()
        try:
            outcome = c.run(flat, out, key, self.timer, self.congestion, self.generation,
                            self.deadline, divisor, keep)
        except BaseException as exc:  # e.g. KeyboardInterrupt between two waits
            self._broken = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            for name, value in c.counters().items():
                self._stats[name] += value
            self.generation = c.generation
        if outcome.saturated:
            self._warn_saturated(outcome.saturated, n)
        if outcome.status == cpath.TIMEOUT:
            self._fail(_timed_out(self, outcome.outstanding, outcome.waiting))
        elif outcome.status == cpath.RESTARTED:
            raise _Restart(outcome.seen_generation)
        elif outcome.status < 0:
            self._fail(OSError(-outcome.status, os.strerror(-outcome.status)))
        if outcome.bad_code is not None:
            index, code = outcome.bad_code
            raise ValueError(f"code 0x{code:02x} at flat index {index} is above the NC8 range")
        return out

    def _server_allreduce(self, flat: np.ndarray, tensor: Hashable) -> np.ndarray:
        """Server mode: the mean of ``flat`` (float32, 1-D) over the workers, one BLOB a chunk.

        Each chunk is compressed once (a retransmission re-sends the same payload) with its own
        state; the results are the server's compressed means, decompressed into the output.
        """
        assert self.compressor is not None
        n, c = flat.size, self.chunk
        self._stats["allreduce_calls"] += 1
        self._stats["elements"] += n
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        starts = np.arange(0, n, c, dtype=np.int64)
        counts = np.minimum(c, n - starts)
        offsets = self._range(tensor, n) + starts
        payloads = [
            self.compressor.compress(flat[start : start + c], self._state(int(offset)))
            for start, offset in zip(starts.tolist(), offsets.tolist(), strict=True)
        ]
        slots, pools, _ = schedule(self._slot_uses, starts.size)  # offsets: the tensors' ranges
        frames, lengths = pack_blobs(
            payloads, counts=counts, offsets=offsets, job=self.job, rank=self.rank,
            emin=self.window.e_min, slots=slots, pools=pools,
        )
        results: list[bytes] = [b""] * starts.size
        try:
            self._exchange(frames, lengths, pools, results)
        except _Restart as restart:  # server mode has no recovery (its compressors are lossy)
            self._fail(_restarted(self, restart.generation, 0))
        out = np.empty(n, dtype=np.float32)
        for start, count, payload in zip(starts.tolist(), counts.tolist(), results, strict=True):
            values = self.compressor.decompress(payload)
            if values.size != count:
                raise ValueError(
                    f"allreduce: a result for {count} elements decodes to {values.size}"
                )
            out[start : start + count] = values
        return out

    def _range(self, tensor: Hashable, n: int) -> int:
        """The first offset of the range of ``n`` offsets of ``tensor`` (allocated on first
        use, one after the other, so every worker allocates the same ranges)."""
        key = (tensor, n)
        base = self._ranges.get(key)
        if base is None:
            base = sum(size for _, size in self._ranges)
            if base + n > 1 << 32:
                raise ValueError(
                    f"tensor {tensor!r} of {n} elements: the tensors so far ({base} elements) "
                    "and it do not fit the 32-bit offset field"
                )
            self._ranges[key] = base
        return base

    def _state(self, offset: int) -> State:
        """The compressor state of the chunk (or INA tensor) at ``offset``; the random stream
        is the client's."""
        state = self._states.get(offset)
        if state is None:
            state = self._states[offset] = State(rng=self._rng)
        return state

    def _exchange(
        self,
        frames: np.ndarray,
        lengths: np.ndarray,
        pools: np.ndarray,
        received: bytearray | list[bytes],
    ) -> None:
        """Send every chunk of ``frames`` (``pack_chunks`` or ``pack_blobs``); put each chunk's
        result payload into ``received``: at its place for fixed-size formats, as item ``i``
        of the list for BLOBs."""
        self._handshake()
        frames[:, 1] |= self.generation << GENERATION_SHIFT
        if self.key is not None:  # room for the tag after the longest chunk, and the flag
            frames = np.pad(frames, ((0, 0), (0, TAG_SIZE)))
            frames[:, 1] |= FLAG_TAG
        transfer = Transfer(
            self._sock, self._poll, self._buf, self.aggregator, job=self.job, rank=self.rank,
            pool_size=self.pool_size, k=self.k, result_format=self._format, key=self.key,
            timer=self.timer, window=self.congestion, generation=self.generation,
            deadline=self.deadline,
            stats=self._stats, frames=frames, lengths=lengths, pools=pools, received=received,
        )
        try:
            try:
                transfer.run()
            finally:
                self.generation = transfer.generation
        except Stalled as stall:
            self._fail(_timed_out(self, stall.outstanding, stall.waiting))
        except Restarted as restart:
            raise _Restart(restart.generation) from None
        except BaseException as exc:  # the job's slots moved on without this worker's chunks
            self._broken = f"{type(exc).__name__}: {exc}"
            raise


class _Restart(Exception):
    """A transfer met another generation (the aggregator restarted): recovered from, or
    turned into ``AggregatorRestartedError``."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"generation {generation}")
        self.generation = generation


def _exponents(values: np.ndarray) -> np.ndarray:
    """The exponents of ``values``, each of which must be 2**e with 0 <= e < 16: a recovery
    lane, which has exactly one contributor (``RuntimeError`` otherwise)."""
    mantissa, exponent = np.frexp(values)
    if not (np.all(mantissa == 0.5) and np.all((exponent >= 1) & (exponent <= 16))):
        raise RuntimeError("restart recovery: a lane's sum is not one rank's power of two")
    return exponent.astype(np.int64) - 1


def _destination(out: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``out`` flattened (a view) after checking that an all-reduce of ``shape`` can write its
    result there: ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(out, np.ndarray):
        raise ValueError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype != np.float32 or out.shape != shape:
        raise ValueError(f"out must be float32 of shape {shape}, got {out.dtype} of {out.shape}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be a writable C-contiguous array")
    return out.reshape(-1)


def _choose(requested: str | None, name: str, env: str, choices: tuple[str, ...]) -> str:
    """The choice asked for (argument ``name``), else ``$env``, else the first of ``choices``;
    a value not among them is refused naming where it came from."""
    value = requested or os.environ.get(env) or choices[0]
    if value not in choices:
        where = name if requested else env
        raise ValueError(f"{where} must be one of {choices}, got {value!r}")
    return value


def _choose_window(requested: str | None) -> str:
    """The window mode asked for, else ``$NCINA_CWND``, else ``"fixed"``; checked."""
    return _choose(requested, "cwnd", WINDOW_ENV, WINDOW_MODES)


def _choose_data_path(requested: str | None) -> str:
    """The data path asked for, else ``$NCINA_DATA_PATH``, else ``"c"``; checked."""
    return _choose(requested, "data_path", DATA_PATH_ENV, DATA_PATHS)


def _restarted(
    client: AllreduceClient, generation: int, recovered: int
) -> AggregatorRestartedError:
    """The error of a call that saw ``generation``, not the client's, after ``recovered``
    recoveries in the call: the aggregator restarted once more than the client recovers from."""
    host, port = client.aggregator
    if not client.recovers:
        why = ("server mode and hierarchical jobs do not recover" if client.restart_retries
               else "restart_retries is 0")  # fmt: skip
    else:
        why = f"after {recovered} recoveries in this call (restart_retries)"
    drawn = ("the same again" if generation == client.generation  # it said a restart notice
             else f"now {generation}")  # fmt: skip
    return AggregatorRestartedError(
        f"allreduce: aggregator {host}:{port} restarted (generation "
        f"{client.generation}, {drawn}; job {client.job}, rank {client.rank}): "
        f"the slots of this call are lost, nothing is returned ({why}); every rank must "
        f"start a new client"
    )


def _timed_out(
    client: AllreduceClient, outstanding: list[int], waiting: list[tuple[int, int | None]]
) -> TimeoutError:
    """The error of a call without progress for ``deadline`` seconds. ``outstanding`` are the
    slots still waiting, ``waiting`` per slot its chunk's element count and the bitmap of the
    ranks the aggregator holds for that chunk according to its latest notice (None: no notice
    about that chunk); the message names the ranks every such notice says is missing, else
    those any says. Every live rank sends the lowest chunk no slot completed whatever its
    congestion window (``ncina.worker.transfer.Transfer``), but a later one only when its window
    has room: a rank missing from some chunks may just be behind, one missing from all is not."""
    host, port = client.aggregator
    everyone = (1 << client.workers) - 1
    gaps = [everyone & ~held for _, held in waiting if held is not None]
    missing = 0
    if gaps:
        missing = functools.reduce(operator.and_, gaps) or functools.reduce(operator.or_, gaps)
    if missing:
        ranks = [r for r in range(client.workers) if missing >> r & 1]
        why = f"the aggregator has nothing from rank(s) {_ranges(ranks)} for them"
    else:
        why = "no notice from the aggregator names a missing rank"
    elements = sum(count for count, _ in waiting)
    return TimeoutError(
        f"allreduce: no result from aggregator {host}:{port} for {client.deadline:g} s "
        f"(job {client.job}, rank {client.rank}): {len(outstanding)} slots outstanding "
        f"{_ranges(outstanding)} holding {elements} elements; {why}"
    )


def _ranges(values: list[int]) -> str:
    """``[0-3, 7, 9-10]`` for sorted integers, so an error message stays short."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return "[" + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) + "]"
