"""The client's data paths: how one transfer of a tensor's chunks goes through the slot window
(docs/protocol.md). In INA mode the C loop (``ncina.worker.cpath``, the default: the NC8 encode
fused into the send, the decode into the receive) or the Python loop
(``ncina.worker.transfer.Transfer``, the reference); in server mode the Python loop with one
BLOB a chunk, each compressed once with the state of its own range of offsets. Every transfer
handshakes first (``ncina.worker.client.handshake``), stamps the aggregator's generation, and
turns a restart into ``Restart`` (``ncina.worker.client.recovery`` recovers from it) and a stall
into ``TimeoutError``; any other failure makes the client unusable (``broken``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import numpy as np
from ncina.proto import nc8
from ncina.proto.compressors import Compressor, State
from ncina.proto.header import (
    ELEMENT_SIZE,
    FLAG_TAG,
    GENERATION_SHIFT,
    SUM_DTYPES,
    Format,
    pack_blobs,
    pack_chunks,
)
from ncina.proto.wire import TAG_SIZE
from ncina.worker import cpath
from ncina.worker.client.errors import Restart, timed_out
from ncina.worker.client.handshake import Handshake
from ncina.worker.client.link import Link
from ncina.worker.timing import RtoEstimator
from ncina.worker.transfer import Restarted, Stalled, Transfer, schedule
from ncina.worker.window import CongestionWindow

log = logging.getLogger("ncina.worker.client")

DATA_PATHS = ("c", "python")  # the default first
DATA_PATH_ENV = "NCINA_DATA_PATH"  # overrides the default data path ("c") when data_path is None


class DataPath:
    """The transfers of rank ``rank`` of job ``job`` (``workers`` ranks) over ``link``, after
    ``hello``: ``k`` elements per INA packet, ``chunk`` per server-mode one, ``pool_size``
    slots, results of ``result_format`` (``Format.BLOB`` in server mode) in ``window``, the RTO
    ``timer`` and the ``congestion`` window the client keeps, ``deadline`` the longest wait for
    progress. ``use_c`` runs INA transfers in C (``RuntimeError`` saying how to select the
    Python loop when the extension is unavailable). ``compressor`` and ``rng`` are the client's;
    ``stats`` its counters."""

    def __init__(
        self, link: Link, hello: Handshake, *, job: int, rank: int, workers: int, k: int,
        chunk: int, pool_size: int, result_format: Format, window: nc8.Window,
        key: bytes | None, timer: RtoEstimator, congestion: CongestionWindow, deadline: float,
        compressor: Compressor | None, rng: np.random.Generator, stats: dict[str, float],
        use_c: bool,
    ) -> None:  # fmt: skip
        self.link = link
        self.hello = hello
        self.job, self.rank, self.workers = job, rank, workers
        self.k, self.chunk, self.pool_size = k, chunk, pool_size
        self.format = result_format
        self.window = window
        self.key = key
        self.timer, self.congestion, self.deadline = timer, congestion, deadline
        self.compressor = compressor
        self.rng = rng
        self.stats = stats
        self.generation = 0  # the aggregator's, from its first result (0: not known yet)
        # Uses of each slot so far, across calls: the parity is the pool version of its next
        # use, and its next INA chunk's offset is ``uses * S + slot`` (mod 2**32).
        self.slot_uses = np.zeros(pool_size, dtype=np.int64)
        # Per (tensor, size): the first offset of its range (server mode) and the compressor
        # states, by offset of its chunk (server mode) or of the tensor (INA mode).
        self._ranges: dict[tuple[Hashable, int], int] = {}
        self._states: dict[int, State] = {}
        self.broken = ""  # why the client is unusable, if it is
        self.c: cpath.CTransfer | None = None
        if use_c:
            try:
                self.c = cpath.CTransfer(
                    link.sock, link.aggregator, job=job, rank=rank, pool_size=pool_size, k=k,
                    e_min=window.e_min, span=window.span, result_format=result_format,
                    key=key, slot_uses=self.slot_uses,
                )
            except (RuntimeError, OSError) as exc:
                raise RuntimeError(
                    f"the C data path is unavailable: {exc}; pass data_path='python' or set "
                    f"{DATA_PATH_ENV}=python to use the Python loop"
                ) from exc

    def handshake(self, timeout: float | None = None) -> None:
        """The job handshake, once, before the first chunk (:meth:`Handshake.run`); learns the
        aggregator's generation from its answer."""
        if not self.hello.done:
            self.generation = self.hello.run(timeout) or self.generation

    def reset(self) -> None:
        """Forget the aggregator (it restarted): its slots are new, every rank starts at slot
        use 0, its generation is not known yet, and the handshake is made anew."""
        self.slot_uses[:] = 0
        self.generation = 0
        if self.hello.timeout is not None:
            self.hello.done = False

    def fail(self, error: BaseException) -> None:
        """Make the client unusable for ``error`` and raise it."""
        self.broken = f"{type(error).__name__}: {error}"
        raise error

    @contextmanager
    def broken_unless_restart(self) -> Iterator[None]:
        """Any failure inside but a ``Restart`` makes the client unusable (the other ranks are
        in calls this rank left); a restart propagates to be recovered from."""
        try:
            yield
        except Restart:
            raise
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise

    def _timed_out(self, outstanding: list[int], waiting: list[tuple[int, int | None]]
                   ) -> TimeoutError:  # fmt: skip
        return timed_out(self.link.aggregator, job=self.job, rank=self.rank,
                         workers=self.workers, deadline=self.deadline,
                         outstanding=outstanding, waiting=waiting)  # fmt: skip

    def warn_saturated(self, saturated: int, n: int) -> None:
        """Log that ``saturated`` of the call's ``n`` elements were clipped (biased: rare by
        design, so a warning says the window is too small)."""
        log.warning(
            "job %d rank %d: %d of %d elements saturated at 2**%d (window too small?)",
            self.job, self.rank, saturated, n, self.window.e_max,
        )

    def prepare(self, flat: np.ndarray, rng: np.random.Generator | None = None) -> object:
        """What a transfer of ``flat`` needs that must not change when it is redone: the NC8
        codes (Python path) or the key of the C path's fused encode, drawn from ``rng`` (default
        the client's random stream) as ``nc8.encode`` draws it. Raises ``ValueError`` for NaN or
        infinity."""
        n = flat.size
        rng = self.rng if rng is None else rng
        if self.c is None:
            encoded = nc8.encode(flat, self.window, rng)
            if encoded.saturated:
                self.stats["saturated"] += encoded.saturated
                self.warn_saturated(encoded.saturated, n)
            return encoded.codes
        key = nc8._draw_key(rng)  # nc8.encode's key for the same call
        bad = self.c.first_nonfinite(flat)
        if bad < n:
            raise ValueError(f"cannot encode {float(flat[bad])} at flat index {bad}")
        return key

    def transfer(
        self, flat: np.ndarray, prepared: object, out: np.ndarray | None, divisor: int = 1,
        keep: np.ndarray | None = None,
    ) -> np.ndarray:  # fmt: skip
        """One transfer of the call prepared by :meth:`prepare`: its sum divided by
        ``divisor``, into ``out`` (C path) or a new array; the undivided sum also into ``keep``
        (``ncina.worker.client.recovery.Recovery.keep_room``) when given. Raises ``Restart``
        when the aggregator restarted; any other failure makes the client unusable."""
        if self.c is not None:
            return self._c_allreduce(flat, prepared, out, divisor, keep)
        return self._python_allreduce(prepared, divisor, keep)

    def sum_internal(self, values: np.ndarray) -> np.ndarray:
        """The sum of ``values`` (float32 powers of two, exact in NC8) over the workers, for the
        recovery's own calls: not counted as a call, no compressor, the input kept, and no key
        drawn from the client's random stream (exact values round the same with any key), so
        the agreement after the handshake leaves the calls' rounding as it was."""
        prepared = self.prepare(values, np.random.default_rng(0))
        return self.transfer(values, prepared, None)

    def _c_allreduce(
        self, flat: np.ndarray, key: int, out: np.ndarray | None = None, divisor: int = 1,
        keep: np.ndarray | None = None,
    ) -> np.ndarray:  # fmt: skip
        """The sum of ``flat`` (float32, 1-D, checked finite) over the workers through the C
        data path with NC8 stream key ``key``, divided by ``divisor`` in the decode, into ``out``
        (1-D float32 of ``flat``'s size, may be ``flat``: see ``AllreduceClient.allreduce``) or a
        new array; returns it. The undivided results also go into ``keep`` when given. The timer
        and the generation are the client's, copied in and back out. Raises ``Restart`` when the
        aggregator restarted."""
        c = self.c
        assert c is not None
        n = flat.size
        if out is None:
            out = np.empty(n, dtype=np.float32)
        self.handshake()
        try:
            outcome = c.run(flat, out, key, self.timer, self.congestion, self.generation,
                            self.deadline, divisor, keep)
        except BaseException as exc:  # e.g. KeyboardInterrupt between two waits
            self.broken = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            for name, value in c.counters().items():
                self.stats[name] += value
            self.generation = c.generation
        if outcome.saturated:
            self.warn_saturated(outcome.saturated, n)
        if outcome.status == cpath.TIMEOUT:
            self.fail(self._timed_out(outcome.outstanding, outcome.waiting))
        elif outcome.status == cpath.RESTARTED:
            raise Restart(outcome.seen_generation)
        elif outcome.status < 0:
            self.fail(OSError(-outcome.status, os.strerror(-outcome.status)))
        if outcome.bad_code is not None:
            index, code = outcome.bad_code
            raise ValueError(f"code 0x{code:02x} at flat index {index} is above the NC8 range")
        return out

    def _python_allreduce(
        self, codes: np.ndarray, divisor: int = 1, keep: np.ndarray | None = None
    ) -> np.ndarray:
        """The sum of the tensor of NC8 ``codes`` over the workers, divided by ``divisor``,
        through the Python loop (the reference of the C path): packed at once, ``Transfer``, one
        decode at the end; the undivided sum into ``keep`` as the C path keeps it."""
        n = codes.size
        element_size = ELEMENT_SIZE[self.format]
        received = bytearray(n * element_size)
        chunks = -(-n // self.k)
        slots, pools, offsets = schedule(self.slot_uses, chunks)
        frames, lengths = pack_chunks(
            codes, k=self.k, job=self.job, rank=self.rank, emin=self.window.e_min,
            slots=slots, pools=pools, offsets=offsets,
        )
        self._exchange(frames, lengths, pools, received)
        if self.format == Format.NC8:
            codes = np.frombuffer(received, dtype=np.uint8)
            total = nc8.decode(codes, self.window)
        else:
            sums = np.frombuffer(received, dtype=SUM_DTYPES[self.format]).astype(np.int64)
            total = nc8.ints_to_float(sums, self.window)
            codes = total.view(np.uint8)
        if keep is not None:
            np.copyto(keep, codes)
        if divisor != 1:
            total /= np.float32(divisor)
        return total

    def server_allreduce(self, flat: np.ndarray, tensor: Hashable) -> np.ndarray:
        """Server mode: the mean of ``flat`` (float32, 1-D) over the workers, one BLOB a chunk.

        Each chunk is compressed once (a retransmission re-sends the same payload) with its own
        state; the results are the server's compressed means, decompressed into the output.
        Raises ``Restart`` when the aggregator restarted (server mode has no recovery: its
        compressors are lossy).
        """
        assert self.compressor is not None
        n, c = flat.size, self.chunk
        self.stats["allreduce_calls"] += 1
        self.stats["elements"] += n
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        starts = np.arange(0, n, c, dtype=np.int64)
        counts = np.minimum(c, n - starts)
        offsets = self.range(tensor, n) + starts
        payloads = [
            self.compressor.compress(flat[start : start + c], self.state(int(offset)))
            for start, offset in zip(starts.tolist(), offsets.tolist(), strict=True)
        ]
        slots, pools, _ = schedule(self.slot_uses, starts.size)  # offsets: the tensors' ranges
        frames, lengths = pack_blobs(
            payloads, counts=counts, offsets=offsets, job=self.job, rank=self.rank,
            emin=self.window.e_min, slots=slots, pools=pools,
        )
        results: list[bytes] = [b""] * starts.size
        self._exchange(frames, lengths, pools, results)
        out = np.empty(n, dtype=np.float32)
        for start, count, payload in zip(starts.tolist(), counts.tolist(), results, strict=True):
            values = self.compressor.decompress(payload)
            if values.size != count:
                raise ValueError(
                    f"allreduce: a result for {count} elements decodes to {values.size}"
                )
            out[start : start + count] = values
        return out

    def range(self, tensor: Hashable, n: int) -> int:
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

    def state(self, offset: int) -> State:
        """The compressor state of the chunk (or INA tensor) at ``offset``; the random stream
        is the client's."""
        state = self._states.get(offset)
        if state is None:
            state = self._states[offset] = State(rng=self.rng)
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
        self.handshake()
        frames[:, 1] |= self.generation << GENERATION_SHIFT
        if self.key is not None:  # room for the tag after the longest chunk, and the flag
            frames = np.pad(frames, ((0, 0), (0, TAG_SIZE)))
            frames[:, 1] |= FLAG_TAG
        link = self.link
        transfer = Transfer(
            link.sock, link.poll, link.buf, link.aggregator, job=self.job, rank=self.rank,
            pool_size=self.pool_size, k=self.k, result_format=self.format, key=self.key,
            timer=self.timer, window=self.congestion, generation=self.generation,
            deadline=self.deadline,
            stats=self.stats, frames=frames, lengths=lengths, pools=pools, received=received,
        )
        try:
            try:
                transfer.run()
            finally:
                self.generation = transfer.generation
        except Stalled as stall:
            self.fail(self._timed_out(stall.outstanding, stall.waiting))
        except Restarted as restart:
            raise Restart(restart.generation) from None
        except BaseException as exc:  # the job's slots moved on without this worker's chunks
            self.broken = f"{type(exc).__name__}: {exc}"
            raise
