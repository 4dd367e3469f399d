"""PyTorch DDP communication hook that all-reduces gradient buckets through the INA fabric.

``model.register_comm_hook(InaHookState(fabric), ina_hook)`` makes every gradient bucket of a
``DistributedDataParallel`` model go through the aggregator(s) instead of gloo: the bucket's
flattened buffer is NC8-encoded, summed in the switch, decoded, averaged and written back into
the buffer. The hook returns at once with a pending ``torch.futures.Future``; the state's one
communication thread all-reduces the buckets in the order the hook was called (the same on every
rank, so the fabric's slot sequence stays in step) and completes each future, while autograd goes
on computing the gradients of the later buckets: communication overlaps the backward pass. DDP
waits for every future at the end of ``backward()`` and copies the results into ``.grad``. A
failed all-reduce (aggregator gone, deadline, more restarts than the clients recover from:
``AllreduceClient``'s ``restart_retries``) completes its future with the exception, so
``backward()`` raises it instead of hanging; the client then refuses later calls, which fail
the same way. With ``InaHookState(fallback="gloo")`` the failed bucket and every later one go
through gloo instead, on every rank: the rank whose call failed says so in the per-call
agreement's all-reduce (below), where the others meet it whether they failed the same bucket
or completed it and wait to agree on the next one; a rank one bucket ahead hands its result of
the failed bucket over (``_fall_back``), so that no rank keeps a result the others do not have.
``fallen_back`` says why, ``fallback_buckets`` counts the buckets.

**Agreed per call** (docs/pytorch.md, "Exact, lossy, non-finite, range"): before each
all-reduce the ranks agree, with one exact 40-byte all-reduce (MAX) on :attr:`InaHookState.group`,
on whether any rank's tensor holds an infinity or a NaN, on the largest magnitude of the call,
on how many buckets each rank has completed and on whether a rank is falling back. A
non-finite value anywhere sends the call, on every rank, through that gloo group
(exact: the infinities and NaNs land where gloo puts them, so AMP's ``GradScaler`` sees them).
Otherwise the tensor is scaled by an exact power of two, ``2**shift``, that puts the agreed
largest magnitude just below the job's ``2**e_max`` (``shift = e_max - 1 - floor(log2(peak))``)
before NC8 encodes it, and the result is scaled back by ``2**-shift``: the window follows the
data, so no value saturates; a call whose sum could leave float32's range goes exact too. The
group is used only by the communication thread, in call order, so its collectives pair up on
every rank. The agreement sits between two INA calls, so a rank waiting in it could starve a rank
whose last result an aggregator restart lost, and which waits in that call's recovery for every
rank: while the agreement stalls (:data:`PROBE_AFTER_S`), each waiting rank asks its aggregators
whether they restarted and, if one did, joins the recovery from there
(:meth:`AllreduceClient.recover_if_restarted`; issue 38, case 5). A rank can wait for the others
anywhere else between two calls too: in a gloo collective of the program's own (DDP's
``broadcast_buffers`` before each forward of a model with buffers, a barrier, the ``ncina``
backend's delegated collectives) or in its own computation. So whenever the communication thread
has had nothing to do for :data:`PROBE_AFTER_S`, the state's prober queues the same question on
it (on that thread, so that it never races a call): one hello per aggregator per period while
idle.

A bucket in host memory is all-reduced in place (the fabric writes the mean into it). A CUDA bucket
goes through :mod:`ncina.worker.staging`: the hook queues its copy into a pinned buffer of its
own on a copy stream, so the copy of one bucket overlaps the transfer of the previous one; the
communication thread waits for that copy, has the fabric write the mean into the same buffer, and
queues the copy back; the future (made with the bucket's device) makes DDP's stream wait for it.
One copy each way per bucket, and after the first iteration no memory allocated per bucket.

With a compressor on the fabric's clients (INA or server mode) the bucket goes through it the
same way; the bucket's index names the tensor, so each bucket keeps its own compressor state.

DDP calls the hook for buckets in index order on every rank, and rebuilds its buckets once after the
first iteration (in gradient-ready order, the same on every rank); the rebuilt buckets need
nothing special: every rank sends the same sequence of tensors and the fabric's slot sequence
stays in step (a compressor's state is per bucket index and size, so a rebuilt bucket of another
size starts afresh; so does a GPU bucket's staging buffer).

:func:`verifying_hook` wraps the hook for tests and ``ncina train --verify``: it also all-reduces
the raw bucket with gloo and records how far the fabric's mean is from the exact one, against the
error bounds of natural compression (:mod:`ncina.proto.nc_bounds`).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects, not strings.
import logging
import math
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ncina.proto.nc_bounds import bounds_from_sums
from ncina.worker.sharding import ShardedAllreduce
from ncina.worker.staging import BucketStaging, Slot
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

log = logging.getLogger(__name__)

# Relative slack for float32 rounding of the decoded mean (decode, divide by N).
FLOAT_SLACK = 2.0**-20
# A sum below 2**128 is a finite float32.
MAX_FLOAT32_EXPONENT = 127
MAX_OPTIONS = dist.AllreduceOptions()
MAX_OPTIONS.reduceOp = dist.ReduceOp.MAX
# Seconds the agreement may wait for the other ranks before the waiting rank asks its aggregators
# whether they restarted (the module doc): a rank still computing its gradients makes it wait
# too, and costs one hello per aggregator per period.
PROBE_AFTER_S = 0.5


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed before a call (:meth:`InaHookState._exchange`): whether a rank is
    falling back to gloo, whether a tensor holds an infinity or a NaN, the largest magnitude,
    the group's size, the most and the fewest buckets a rank has completed, and the lowest rank
    that completed the most."""

    fall_back: bool
    nonfinite: bool
    peak: float
    world: int
    most_done: int
    least_done: int
    first_ahead: int


@dataclass
class InaHookState:
    """The hook's state: the fabric every bucket goes through, the communication thread,
    ``comm_total_s``: seconds spent inside all-reduces so far (with ``buckets``, their count),
    ``last_call``: when DDP last handed over a bucket (Unix seconds; after a backward pass,
    when this rank's last gradients were ready, the end of its compute), and ``error``: the
    first exception an all-reduce raised. DDP re-raises a failed future in ``backward()`` as a
    RuntimeError whose text is "Unable to cast <error> to Tensor"; ``raise state.error from
    exc`` gives the caller the original one.

    ``staging`` holds the pinned buffers of CUDA buckets (:mod:`ncina.worker.staging`; a
    ``BucketStaging(HostCopier())`` stages CPU buckets the same way, for tests). Call
    :meth:`close` when training ends (it waits for the bucket in flight, if any).

    ``group`` is the process group of the per-call agreement and of the exact path (module
    doc): a gloo ``ProcessGroup`` (or ``Backend``) that only the communication thread uses;
    None: the default group when ``torch.distributed`` is initialized (safe for DDP, whose
    main thread waits in ``backward()`` while the hook's calls run, but not with
    ``find_unused_parameters=True``, whose used-parameter all-reduce runs during the backward
    pass: give a ``dist.new_group(backend="gloo")`` then, as ``ncina train`` always does),
    else no agreement (one process with a stand-in fabric: the tensor goes to the fabric as it
    is). ``exact_calls``
    counts the calls that went exact, by reason (``nonfinite``, ``range``); ``last_shift`` is
    the power of two the last INA call was scaled by.
    """

    fabric: ShardedAllreduce
    comm_total_s: float = 0.0
    buckets: int = 0
    last_call: float = 0.0
    error: BaseException | None = None
    staging: BucketStaging = field(default_factory=BucketStaging, repr=False)
    fallback: str | None = None  # "gloo": go on through gloo when the fabric fails
    fallen_back: str = ""  # the fabric's failure that made the hook fall back ("" while not)
    fallback_buckets: int = 0  # buckets all-reduced through gloo after falling back
    group: Any = None
    exact_calls: Counter[str] = field(default_factory=Counter)
    last_shift: int = 0
    _done: int = field(default=0, repr=False)  # buckets the fabric completed
    _last: torch.Tensor | None = field(default=None, repr=False)  # the last one's mean
    _thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="ncina-hook"),
        repr=False,
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Tasks queued on the communication thread and not ended, when the last one ended, and the
    # prober that asks the aggregators while there are none (module doc).
    _busy: int = field(default=0, repr=False)
    _idle_since: float = field(default_factory=time.monotonic, repr=False)
    _prober: threading.Thread | None = field(default=None, repr=False)
    _closing: threading.Event = field(default_factory=threading.Event, repr=False)

    def close(self) -> None:
        """Stop the prober and the communication thread."""
        self._closing.set()
        if self._prober is not None:
            self._prober.join()
        self._thread.shutdown(wait=True)

    def drain(self) -> None:
        """Return once every all-reduce submitted so far has ended (completed or failed)."""
        self._thread.submit(lambda: None).result()

    def submit(
        self, buffer: torch.Tensor, index: int, op: str = "mean"
    ) -> torch.futures.Future[torch.Tensor]:
        """Queue the all-reduce (``op``: ``mean`` or ``sum``) of the float32 tensor ``buffer``
        (contiguous; in host memory, or staged when :attr:`staging` handles it, under
        ``index``) on the communication thread; returns its pending future, completed with
        ``buffer`` once the result is in it, or with the exception that stopped the all-reduce.
        The DDP hook and the ``ncina`` process-group backend (:mod:`ncina.worker.torch_backend`)
        both hand their tensors over here."""
        if not self.staging.handles(buffer):
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            self._queue(self.reduce, buffer, index, future, None, op)
            return future
        future = self.staging.future(buffer)
        try:
            slot = self.staging.stage(buffer, index)
        except Exception as exc:  # fail like an all-reduce: the future's consumer raises it
            self._fail(future, exc, None)
            return future
        self._queue(self.reduce, buffer, index, future, slot, op)
        return future

    def _queue(self, task: Any, *args: Any) -> None:
        """Run ``task(*args)`` on the communication thread, busy until it ends; the first task
        of a fabric with INA clients starts the prober."""
        with self._lock:
            self._busy += 1
            if self._prober is None and self.clients():
                self._prober = threading.Thread(target=self._probe_while_idle, daemon=True,
                                                name="ncina-probe")  # fmt: skip
                self._prober.start()
        self._thread.submit(self._run, task, *args)

    def _run(self, task: Any, *args: Any) -> None:
        """On the communication thread: ``task(*args)``, then idle from now unless more is
        queued."""
        try:
            task(*args)
        finally:
            with self._lock:
                self._busy -= 1
                self._idle_since = time.monotonic()

    def _probe_while_idle(self) -> None:
        """The prober (module doc): each time the communication thread has been idle for
        :data:`PROBE_AFTER_S`, queue :meth:`_probe` on it, until :meth:`close`."""
        while not self._closing.wait(PROBE_AFTER_S / 4):
            with self._lock:
                idle = self._busy == 0 and time.monotonic() - self._idle_since >= PROBE_AFTER_S
            if idle:
                self._queue(self._probe)

    def _probe(self) -> None:
        """On the communication thread, between two calls: ask every client whether its
        aggregator restarted, and recover now if it did (serving a rank behind its last
        result). A failed recovery leaves the client unusable, and its next call raises why.
        Nothing once the hook has fallen back to gloo."""
        if self.fallen_back:
            return
        for client in self.clients():
            try:
                client.recover_if_restarted()
            except Exception as exc:  # the client keeps it; its next call says it
                log.warning("restart recovery between calls failed: %s: %s",
                            type(exc).__name__, exc)  # fmt: skip

    def reduce(
        self,
        buffer: torch.Tensor,
        index: int,
        future: torch.futures.Future[torch.Tensor],
        slot: Slot | None,
        op: str = "mean",
    ) -> None:
        """On the communication thread: the bucket's mean (or sum) into ``buffer`` (through its
        staging ``slot``, if any), then complete ``future`` with it, or with the exception that
        stopped the all-reduce."""
        try:
            self._allreduce(buffer, index, slot, op)
            if slot is None:
                future.set_result(buffer)
            else:
                self.staging.finish(slot, future)  # the copy back queued, then the result set
        except Exception as exc:  # the future carries it to DDP, which raises it in backward()
            self._fail(future, exc, slot)

    def _allreduce(
        self, buffer: torch.Tensor, index: int, slot: Slot | None, op: str = "mean"
    ) -> None:
        """The mean (or sum) written over the bucket's host memory: the bucket itself, or its
        staging buffer once the copy into it is done; timed and counted."""
        start = time.perf_counter()
        try:
            host = buffer.detach() if slot is None else self.staging.host(slot)
            if self.fallen_back:
                self._gloo(host, op)
                return
            agreed = self._agree(host)
            if agreed is not None and agreed.fall_back:  # another rank's fabric call failed
                self._fall_back(host, op, agreed, "another rank's INA all-reduce failed")
                return
            shift = 0 if agreed is None else self._plan(agreed.nonfinite, agreed.peak, agreed.world)
            if shift is None:  # exact, on every rank
                self._exact(host, op)
            else:
                backup = host.clone() if self.fallback else None  # a failed call may write
                array = host.numpy()
                try:
                    if shift:
                        np.ldexp(array, shift, out=array)  # exact: a power of two
                    self.fabric.allreduce(array, tensor=index, out=array, op=op)
                    if shift:
                        np.ldexp(array, -shift, out=array)
                except Exception as exc:
                    if backup is None or self._group() is None:
                        raise
                    host.copy_(backup)
                    agreed = self._exchange(host, falling_back=True)
                    self._fall_back(host, op, agreed, f"{type(exc).__name__}: {exc}")
                    return
            self._done += 1
            if self.fallback:
                self._last = host.clone()
        finally:
            with self._lock:
                self.comm_total_s += time.perf_counter() - start
                self.buckets += 1

    def _group(self) -> Any:
        """The group of the agreement and the exact path (class doc), or None."""
        if self.group is not None:
            return self.group
        return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None

    def _agree(self, host: torch.Tensor) -> Agreement | None:
        """Agree with the other ranks on this call (module doc); None without a group or for an
        empty tensor (the tensor goes to the fabric as it is)."""
        if self._group() is None or host.numel() == 0:
            return None
        return self._exchange(host, falling_back=False)

    def _exchange(self, host: torch.Tensor, falling_back: bool) -> Agreement:
        """The agreement's one all-reduce (MAX, 40 bytes) on :meth:`_group`, which a rank whose
        fabric call failed joins too (``falling_back``): whatever the other ranks are doing
        there, agreeing on their next call or falling back themselves, they all learn it
        (:meth:`_fall_back`). A rank that falls back does not ask its aggregators while it
        waits: its own clients just failed."""
        group = self._group()
        world, rank = group.size(), group.rank()
        low, high = (float(v) for v in torch.aminmax(host))  # NaN propagates, inf is kept
        finite = math.isfinite(low) and math.isfinite(high)
        place = self._done * world + (world - 1 - rank)  # its MAX: the lowest rank of the most
        flags = torch.tensor([float(falling_back), 0.0 if finite else 1.0,
                              max(-low, high) if finite else 0.0, float(place),
                              float(-self._done)], dtype=torch.float64)  # fmt: skip
        wait_between_calls(group.allreduce([flags], MAX_OPTIONS),
                           () if falling_back else self.clients())  # fmt: skip
        fall_back, nonfinite, peak, best, fewest = (float(v) for v in flags)
        return Agreement(fall_back=fall_back > 0, nonfinite=nonfinite > 0, peak=peak,
                         world=world, most_done=int(best) // world, least_done=-int(fewest),
                         first_ahead=world - 1 - int(best) % world)  # fmt: skip

    def clients(self) -> tuple[Any, ...]:
        """The fabric's INA clients (one per aggregator), or none for another fabric."""
        return tuple(getattr(self.fabric, "clients", ()))

    def _plan(self, nonfinite: bool, peak: float, world: int) -> int | None:
        """The agreed call's path: None (exact) for a non-finite value on some rank or a sum
        that could leave float32's range, else the scale's exponent (0 for a fabric with a
        compressor, whose state lives in the tensor's units, or an all-zero call)."""
        if nonfinite:
            self.exact_calls["nonfinite"] += 1
            return None
        clients = self.clients()
        if peak == 0.0 or not clients or any(
            c.compressor is not None or c.mode != "ina" for c in clients
        ):
            return 0
        top = math.frexp(peak)[1] - 1  # 2**top <= peak < 2**(top + 1)
        if top + 1 + (world - 1).bit_length() > MAX_FLOAT32_EXPONENT:
            self.exact_calls["range"] += 1
            return None
        self.last_shift = clients[0].window.e_max - 1 - top
        return self.last_shift

    def _exact(self, host: torch.Tensor, op: str) -> None:
        """The sum (``op`` "mean": divided by the group's size) of ``host`` through
        :meth:`_group`, exact: gloo's result, infinities and NaNs included."""
        group = self._group()
        group.allreduce([host], dist.AllreduceOptions()).wait()
        if op == "mean":
            host.div_(group.size())

    def _fall_back(self, host: torch.Tensor, op: str, agreed: Agreement, why: str) -> None:
        """From now on every bucket goes through gloo (``why``: the fabric's failure). A rank
        whose fabric call failed restored ``host`` (its input) and joined the agreement's
        all-reduce saying so (:meth:`_exchange`); every other rank learns it there too, whether
        it failed the same bucket or, having completed it, waits to agree on the next one
        (``host``: that next bucket). So the ranks may be one bucket apart: equal counts
        all-reduce ``host`` through gloo; otherwise the lowest rank that is one bucket ahead
        broadcasts the result it has of the bucket the others failed (its last), which they
        take as theirs, and the ranks ahead then all-reduce their current one."""
        self.fallen_back = why
        most, least = agreed.most_done, agreed.least_done
        if most == least:
            self._gloo(host, op)
            return
        if most - least > 1 or (self._done == most and self._last is None):
            raise RuntimeError(f"gloo fallback: ranks completed {least} to {most} buckets")
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = agreed.first_ahead, 0
        if self._done == most:
            assert self._last is not None
            self._group().broadcast([self._last], options).wait()
            self._gloo(host, op)
        else:
            self._group().broadcast([host], options).wait()

    def _gloo(self, host: torch.Tensor, op: str) -> None:
        """``host``'s mean (or sum) over the ranks through gloo, after falling back."""
        self._exact(host, op)
        self.fallback_buckets += 1

    def _fail(
        self, future: torch.futures.Future[torch.Tensor], exc: Exception, slot: Slot | None
    ) -> None:
        """Complete ``future`` with ``exc`` (kept as :attr:`error` if it is the first) and free
        the bucket's staging slot."""
        if slot is not None:
            self.staging.release(slot)
        if self.error is None:
            self.error = exc
        future.set_exception(exc)


def wait_between_calls(work: Any, clients: tuple[Any, ...]) -> None:
    """Wait for the gloo ``work`` that a rank runs between two INA calls of ``clients``; each
    :data:`PROBE_AFTER_S` it stalls, ask every client whether its aggregator restarted and
    recover if it did (the module doc). Polls with short sleeps: the agreement usually
    completes within a millisecond."""
    pause = 1e-5
    probe_at = time.monotonic() + PROBE_AFTER_S
    while not work.is_completed():
        if time.monotonic() >= probe_at:
            for client in clients:
                client.recover_if_restarted()
            probe_at = time.monotonic() + PROBE_AFTER_S
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    work.wait()  # raises what the collective failed with


def ina_hook(state: InaHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Replace the bucket's gradients with their mean over the workers, through the fabric;
    returns at once (see the module doc): the future completes on the communication thread. A
    CUDA bucket's copy to host memory is queued here, behind the work that filled it."""
    buffer = bucket.buffer()
    if buffer.dtype != torch.float32:
        raise TypeError(f"the INA hook handles float32 gradients, bucket has {buffer.dtype}")
    state.last_call = time.time()
    return state.submit(buffer, bucket.index())


@dataclass
class GlooHookState:
    """State of :func:`gloo_hook`: ``last_call`` as :attr:`InaHookState.last_call`."""

    last_call: float = 0.0


def gloo_hook(state: GlooHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own gloo all-reduce of the bucket (``default_hooks.allreduce_hook``: the mean over
    the default group), noting when the bucket was handed over, so that the gloo baseline's
    exposed communication is measured as the INA hook's is."""
    state.last_call = time.time()
    return default_hooks.allreduce_hook(None, bucket)


@dataclass
class VerifyingState:
    """State of :func:`verifying_hook`: the INA state and one record per hook call."""

    ina: InaHookState
    records: list[dict[str, Any]] = field(default_factory=list)


def verifying_hook(
    state: VerifyingState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """:func:`ina_hook`, plus gloo all-reduces of the same bucket to compare against.

    Appends to ``state.records``: the bucket's index and size; ``max_abs_error``, the largest
    difference between the fabric's mean and gloo's fp32 all-reduce (divided by N);
    ``worst_ratio``, the largest error (against the exact float64 mean) over its hard bound;
    ``variance_ratio``, the squared error over the bound on its expectation
    (``ncina.proto.nc_bounds.bounds_from_sums``). ``worst_ratio <= 1`` always holds;
    ``variance_ratio`` is about 1 or less.
    """
    workers = dist.get_world_size()
    client = state.ina.fabric.clients[0]
    x = bucket.buffer().detach().clone()
    moments = torch.stack([x.double(), x.double().abs(), x.double() ** 2])
    dist.all_reduce(moments)
    dist.all_reduce(x)
    x /= workers
    future = ina_hook(state.ina, bucket)
    got = future.wait()
    total, abs_sum, sq_sum = moments.cpu().numpy()  # on a GPU bucket's device until here
    bounds = bounds_from_sums(
        abs_sum, sq_sum, total, workers, client.window.e_min, client.result_format
    )
    mean = got.double().cpu().numpy()
    error = np.abs(mean - total / workers)
    state.records.append(
        {
            "bucket": bucket.index(),
            "elements": int(x.numel()),
            "max_abs_error": float((got - x).abs().max()),
            "worst_ratio": float((error / (bounds.max_error + FLOAT_SLACK * np.abs(mean))).max()),
            "variance_ratio": float((error**2).sum() / bounds.var_high.sum()),
        }
    )
    return future
