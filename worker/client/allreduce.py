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

The client is a package of the concepts above, each a file: ``handshake`` (the job
handshake), ``recovery`` (restart recovery), ``datapath`` (the C, Python and server-mode
transfers), ``link`` (the socket), ``errors`` (the errors a transfer's outcome becomes); this
module holds the public call: the client's checks, the choice of data path, the encoding and
decoding of a tensor, and its counters.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from types import TracebackType
from typing import Any

import numpy as np
from ncina.proto import descriptor as desc
from ncina.proto import tag
from ncina.proto.compressors import Compressor, create
from ncina.proto.compressors.base import largest_fitting
from ncina.proto.header import Format
from ncina.proto.job import (
    DEFAULT_POOL_SIZE,
    DEFAULT_RESTART_RETRIES,
    DEFAULT_WINDOW_MAX,
    FORMATS,
    JobSpec,
    default_k,
)
from ncina.proto.profiles import DEFAULT, PROFILES, job_window
from ncina.proto.wire import DEFAULT_MTU, MAX_TOTAL_WORKERS, payload_room
from ncina.worker.client.datapath import DATA_PATH_ENV, DATA_PATHS, DataPath
from ncina.worker.client.errors import Restart
from ncina.worker.client.handshake import HANDSHAKE_TIMEOUT, Handshake
from ncina.worker.client.link import Link
from ncina.worker.client.recovery import PROBE_TIMEOUT, Recovery
from ncina.worker.timing import RtoEstimator
from ncina.worker.window import WINDOW_ENV, WINDOW_MODES, CongestionWindow

OPS = ("mean", "sum")
MODES = ("ina", "server")

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
    (:meth:`Recovery.call`; every rank of the job must recover, so give them all the same);
    0, server mode and hierarchical jobs fail the call at the first one. An INA client of a job
    of two workers or more with the handshake makes the recovery's agreement once after its
    first handshake, before its first call (``Recovery.agree_first``: one chunk of ``workers``
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
        restart_retries: int = DEFAULT_RESTART_RETRIES,
        profile: str = DEFAULT,
    ) -> None:
        if result_format not in FORMATS:
            raise ValueError(f"result_format must be one of {sorted(FORMATS)}")
        if k is None:
            # Under a leaf the tree's K is the leaf's: its partial sums go up as int lanes.
            under_leaf = total_workers is not None and total_workers > workers
            k = default_k(mtu, result_format, key is not None, partial_sums=under_leaf,
                          profile=profile)  # fmt: skip
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
        self.timer = RtoEstimator(timeout, max_timeout, min_timeout)
        self.congestion = CongestionWindow(pool_size, _choose_window(cwnd))
        self._format = FORMATS[result_format]
        self._rng = np.random.default_rng(seed)
        self.compressor: Compressor | None = (
            None
            if compressor is None
            else create(compressor, workers=self.total_workers, e_max=window_max)
        )
        self.compressor_spec = compressor
        self.handshake_timeout = handshake_timeout
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
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self.data_path = "python" if mode == "server" else _choose_data_path(data_path)
        self._link = Link(aggregator, bind)
        self.aggregator = self._link.aggregator
        self._hello = Handshake(
            self._link, self.descriptor, job=job, rank=rank, key=self.key,
            compressor=compressor, timeout=handshake_timeout, stats=self._stats,
        )
        try:
            self._path = DataPath(
                self._link, self._hello, job=job, rank=rank, workers=workers, k=k,
                chunk=self.chunk, pool_size=pool_size, result_format=self._format,
                window=self.window, key=self.key, timer=self.timer, congestion=self.congestion,
                deadline=deadline, compressor=self.compressor, rng=self._rng, stats=self._stats,
                use_c=self.data_path == "c",
            )
        except BaseException:
            self._link.close()
            raise
        self._recovery = Recovery(
            self._path, rank=rank, workers=workers, total_workers=self.total_workers,
            retries=restart_retries, ina=mode == "ina", handshake_timeout=handshake_timeout,
            deadline=deadline, stats=self._stats,
        )
        self._hello.start()

    @property
    def deadline(self) -> float:
        """The longest wait, in seconds, for a call's valid result before it times out (and for
        a recovery's handshake): the data path's and the recovery's, which read it per call."""
        return self._path.deadline

    @deadline.setter
    def deadline(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"deadline must be positive, got {seconds}")
        self._path.deadline = self._recovery.deadline = seconds

    @classmethod
    def for_job(
        cls, aggregator: tuple[str, int], spec: JobSpec, *, rank: int, **settings: Any
    ) -> AllreduceClient:
        """The client of rank ``rank`` of the job ``spec`` (``ncina.proto.job``: every job
        parameter comes from it, the one place that maps a ``JobSpec`` to the keywords above);
        ``settings`` are the client's own keywords (seed, timeouts, deadline, bind, compressor,
        mode, data path, window, handshake, restart retries). Server mode takes ``k`` from
        ``settings`` when given there (its compressor's payloads bound it, not the MTU)."""
        job = {
            "job": spec.job, "workers": spec.workers, "total_workers": spec.total_workers,
            "k": spec.k, "pool_size": spec.pool_size, "window_max": spec.window_max,
            "result_format": spec.result.name.lower(), "key": spec.key, "mtu": spec.mtu,
            "profile": spec.profile, "restart_retries": spec.restart_retries,
        }  # fmt: skip
        return cls(aggregator, rank=rank, **{**job, **settings})

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

    @property
    def generation(self) -> int:
        """The aggregator's generation, from its first result or answer (0: not known yet)."""
        return self._path.generation

    @property
    def recovers(self) -> bool:
        """Whether a restart of the aggregator during a call is recovered from (INA mode, one
        level, ``restart_retries`` > 0): see ``Recovery.call``."""
        return self._recovery.recovers

    @property
    def address(self) -> tuple[str, int]:
        """The local address results come back to."""
        return self._link.address

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
        self._link.close()

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
        if self._path.broken:
            raise RuntimeError(f"client unusable after an earlier failure: {self._path.broken}")
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"allreduce needs a floating-point array, got {x.dtype}")
        dest = None if out is None else _destination(out, x.shape)
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        n = flat.size
        if n >= 1 << 32:
            raise ValueError(f"{n} elements do not fit the 32-bit offset field")
        if self.mode == "server":
            try:
                total = self._path.server_allreduce(flat, tensor)
            except Restart as restart:  # server mode has no recovery (its compressors are lossy)
                self._path.fail(self._recovery.error(restart.generation, 0))
            if op == "sum":
                total *= np.float32(self.workers)
        else:
            if self.compressor is not None:  # an INA method: values are NC8-exact powers of two
                state = self._path.state(self._path.range(tensor, n))
                flat = self.compressor.decompress(self.compressor.compress(flat, state))
            divisor = self.total_workers if op == "mean" else 1
            total = self._recovery.call(flat, dest, divisor)
        if out is None:
            return total.reshape(x.shape)
        if total is not dest:
            np.copyto(dest, total)
        return out

    def reserve(self, elements: int) -> None:
        """Allocate now, and touch, the buffers this client keeps between INA calls for calls
        of up to ``elements`` elements: the two buffers a restart recovery keeps results in
        (one call's, the one before's, in turn) and, on the C data path, the scratch an
        in-place call (``out`` is ``x``) decodes into. Without it the first two calls of a new
        size allocate them, and the kernel zeroes their pages in the middle of those calls:
        at 10M elements and K = 64, more than half of a worker's CPU in the call
        (docs/performance.md, "The issue 36 targets"). Calls reuse them either way; a client
        that does not recover from restarts keeps none. The benchmarks reserve the timed
        call's size in their warm-up."""
        if elements < 0:
            raise ValueError(f"cannot reserve {elements} elements")
        if self.mode != "server":
            self._recovery.reserve(elements)

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
        return self._recovery.between_calls(timeout)


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


