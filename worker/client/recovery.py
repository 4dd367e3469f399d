"""Restart recovery (docs/reliability.md, "A restarted aggregator"): an INA call that meets a
restarted aggregator handshakes anew, agrees with every rank on how many calls each completed
(one small all-reduce, a lane per rank), and then either every rank redoes the call, or a rank
that completed it serves its sum to the others bit for bit. ``Recovery`` holds what that needs
(the calls completed, the last call's sum) and runs the calls that recover: an INA call
(:meth:`Recovery.call`), the agreement after the first handshake (:meth:`Recovery.agree_first`)
and the probe between two calls (:meth:`Recovery.between_calls`)."""

from __future__ import annotations

import logging

import numpy as np
from ncina.proto import nc8
from ncina.proto.header import Format
from ncina.worker.client.datapath import DataPath
from ncina.worker.client.errors import AggregatorRestartedError, Restart, restarted

log = logging.getLogger("ncina.worker.client")

PROBE_TIMEOUT = 0.2  # seconds :meth:`Recovery.between_calls` waits for an answer
NIBBLES = 8  # lanes of 4 bits that carry one float32 when a recovery serves a sum


class Recovery:
    """The restart recovery of the client whose transfers ``path`` makes: rank ``rank`` of
    ``workers`` at its aggregator, ``total_workers`` in the tree, ``retries`` restarts a call
    recovers from (``restart_retries``), ``handshake_timeout`` the client's (None: no
    handshake, no agreement before the first call), ``stats`` its counters."""

    def __init__(
        self, path: DataPath, *, rank: int, workers: int, total_workers: int, retries: int,
        ina: bool, handshake_timeout: float | None, deadline: float, stats: dict[str, float],
    ) -> None:  # fmt: skip
        self.path = path
        self.rank, self.workers, self.total_workers = rank, workers, total_workers
        self.retries = retries
        self.handshake_timeout = handshake_timeout
        self.deadline = deadline
        self.stats = stats
        # Whether a restart during a call is recovered from (INA mode, one level, retries > 0).
        self.recovers = retries > 0 and total_workers == workers
        # The INA calls this client completed, the sum of the last one (what a rank behind it
        # may need served) and a buffer the C path decodes into when the caller's ``out`` is
        # its input.
        self.completed = 0
        # Whether this client made the recovery's agreement in its aggregator's start: once
        # after its first handshake (``agree_first``), so that a rank recovering from a start it
        # completed no call in meets a fresh rank there (issue 38, case 4). Every rank of a job
        # must make it, so it depends on the job only: INA, a handshake, two workers or more in
        # the tree (a one-worker job has nobody to meet).
        self.agreed = not (ina and handshake_timeout is not None and total_workers > 1)
        self._kept = [np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.uint8)]
        self._last_kept = 0  # the buffer of _kept that holds the last call's results
        self._last: tuple[str, int, np.ndarray | None] = ("kept", 0, None)
        self._scratch = np.zeros(0, dtype=np.float32)

    def error(self, generation: int, recovered: int) -> AggregatorRestartedError:
        """The error of a call that saw ``generation`` after ``recovered`` recoveries in it."""
        path = self.path
        return restarted(path.link.aggregator, job=path.job, rank=self.rank,
                         known=path.generation, generation=generation, recovers=self.recovers,
                         retries=self.retries, recovered=recovered)  # fmt: skip

    def call(self, flat: np.ndarray, out: np.ndarray | None, divisor: int = 1) -> np.ndarray:
        """The sum of ``flat`` (float32, 1-D) over the workers in INA mode, divided by
        ``divisor`` (float32: ``sum / np.float32(divisor)``, the C path in its decode pass), on
        the data path in use, into ``out`` or a new array (returned).

        A restart of the aggregator (a result or notice of another generation) is recovered
        from up to ``retries`` times in this call (docs/reliability.md, "A restarted
        aggregator"): the client forgets the old aggregator (handshake anew, slot uses from 0),
        every rank of the job says with one small all-reduce how many calls it completed, and
        then either every rank redoes this call with the same codes, or, when some ranks had
        completed it (or, for a rank already in its next call, the previous one) before the
        restart, the lowest of them serves its sum to the others bit for bit, and the ranks
        that served redo their current call. So every rank returns the same bits for every
        call. One restart more raises ``AggregatorRestartedError`` and the client is unusable.
        """
        path = self.path
        n = flat.size
        prepared = path.prepare(flat)  # NaN or infinity raises before the call is counted
        self.stats["allreduce_calls"] += 1
        self.stats["elements"] += n
        if n == 0:
            return np.zeros(0, dtype=np.float32) if out is None else out
        if path.c is not None and self.recovers and out is not None and np.may_share_memory(
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
                elif not self.agreed:
                    self.agree_first()
                total = path.transfer(flat, prepared, out, divisor, keep)
                if self.recovers:
                    self._last_kept = 1 - self._last_kept
                    self._last = ("kept", n, None)
                break
            except Restart as restart:
                restarts += 1
                if restarts > self.retries or not self.recovers:
                    path.fail(self.error(restart.generation, restarts - 1))
                recover = True
        if self.recovers:
            self.completed += 1
        return total

    def between_calls(self, timeout: float = PROBE_TIMEOUT) -> bool:
        """``AllreduceClient.recover_if_restarted``: ask the aggregator with one probe whether
        it restarted since the last call, and if it did, run the recovery now; returns whether
        it recovered."""
        path = self.path
        if (
            path.broken or not self.recovers or not path.hello.done or path.generation == 0
            or self.handshake_timeout is None
        ):
            return False
        asked = path.hello.ask_generation(timeout)
        if asked is None or asked == (path.generation, False):
            return False
        restarts = 0
        while True:
            try:
                served = self._recovered(0)
            except Restart as restart:
                restarts += 1
                if restarts > self.retries:
                    path.fail(self.error(restart.generation, restarts - 1))
                continue
            if served is not None:  # a rank ahead of one that waits between calls cannot be
                path.fail(RuntimeError("restart recovery between calls: another rank "
                                       "completed a call this rank has not started"))
            return True

    def reserve(self, n: int) -> None:
        """``AllreduceClient.reserve``: make this client's buffers for an INA call of ``n``
        elements now (both keep buffers, and on the C path the scratch an in-place call
        decodes into) and write every page of them, so that the kernel zeroes their pages here
        rather than inside the calls that first use them."""
        if not self.recovers:
            return
        if self.path.c is not None and self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.float32)
            self._scratch.fill(0)
        for which in (0, 1):
            if self._kept[which].size < self._keep_bytes(n):
                self._keep_room(which, n).fill(0)

    def _keep_room(self, which: int, n: int) -> np.ndarray:
        """Keep buffer ``which`` (0 or 1), grown to hold ``n`` results (NC8 codes, 1 byte each;
        int sums, float32): reused from call to call, so that after the first call of a size
        keeping the results costs no allocation, no page faults, no pass of its own."""
        need = self._keep_bytes(n)
        if self._kept[which].size < need:
            self._kept[which] = np.empty(need, dtype=np.uint8)
        return self._kept[which][:need]

    def _keep_bytes(self, n: int) -> int:
        """The bytes a keep buffer needs for ``n`` results (NC8 codes, or float32 sums)."""
        return n * (1 if self.path.format == Format.NC8 else 4)

    def _last_sum(self) -> np.ndarray:
        """The sum (float32) of the last call this client completed, as it was computed."""
        kind, n, served = self._last
        if kind == "served":
            return served
        kept = self._kept[self._last_kept]
        if self.path.format == Format.NC8:
            return nc8.decode(kept[:n], self.path.window)
        return kept[: 4 * n].view(np.float32)

    def _recovered(self, n: int) -> np.ndarray | None:
        """:meth:`_recover`; a failure other than another restart makes the client unusable
        (the other ranks are in the recovery's calls)."""
        with self.path.broken_unless_restart():
            return self._recover(n)

    def _recover(self, n: int) -> np.ndarray | None:
        """After a restart: handshake with the new aggregator, agree with every rank on where
        each one is, and serve or receive the sum of a call that some ranks completed and
        others did not (:meth:`_agree`). Returns that sum when this rank was behind (its current
        call, of ``n`` elements, is then complete), None when this rank must (re)do its current
        call. Raises ``Restart`` if the aggregator restarts again meanwhile."""
        path = self.path
        self.stats["restarts"] += 1
        log.warning("job %d rank %d: aggregator %s:%d restarted; recovering", path.job,
                    self.rank, *path.link.aggregator)  # fmt: skip
        path.reset()  # the new aggregator's slots are new: every rank starts at 0
        if self.handshake_timeout is not None:
            path.handshake(max(self.handshake_timeout, self.deadline))
        return self._agree(n)

    def agree_first(self) -> None:
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
        self.path.handshake()
        with self.path.broken_unless_restart():
            if self.total_workers != self.workers:
                self.path.sum_internal(np.zeros(self.total_workers, dtype=np.float32))
                self.agreed = True
            elif self._agree(0) is not None:  # a rank ahead needs this rank's first call
                raise RuntimeError("restart recovery: another rank completed a call before "
                                   "this rank's first")  # fmt: skip

    def _agree(self, n: int) -> np.ndarray | None:
        """The recovery's agreement (and serve call, when the ranks are one call apart) with
        every rank, in this client's aggregator's start: see :meth:`_recover`."""
        window = self.path.window
        one = np.float32(2.0**window.e_min)
        # Each rank's number of completed calls, mod 4, in a lane of its own: a lane has one
        # contributor, so its sum is one power of two, exact in either result format.
        lanes = np.zeros(self.workers, dtype=np.float32)
        lanes[self.rank] = one * np.float32(2 ** (self.completed % 4))
        seen = _exponents(self.path.sum_internal(lanes) / one)
        self.agreed = True
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
        got = self.path.sum_internal(nibbles.reshape(-1)).reshape(size, NIBBLES)
        codes = _exponents(got / one).astype(np.uint32)
        served = (codes << (4 * np.arange(NIBBLES, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
        if mine:
            return None  # this rank had it: it goes on with its current call
        return served.view(np.float32)


def _exponents(values: np.ndarray) -> np.ndarray:
    """The exponents of ``values``, each of which must be 2**e with 0 <= e < 16: a recovery
    lane, which has exactly one contributor (``RuntimeError`` otherwise)."""
    mantissa, exponent = np.frexp(values)
    if not (np.all(mantissa == 0.5) and np.all((exponent >= 1) & (exponent <= 16))):
        raise RuntimeError("restart recovery: a lane's sum is not one rank's power of two")
    return exponent.astype(np.int64) - 1
