"""``ncina`` as a ``torch.distributed`` process-group backend (docs/pytorch.md).

``dist.init_process_group("ncina", ...)`` (registered by :mod:`ncina.torch`, which torch loads
at import through the ``torch.backends`` entry point) makes a :class:`NcinaProcessGroup`: a
Python subclass of ``torch.distributed.ProcessGroup`` (the route PyTorch 2.13 offers a backend
written in Python: ``Backend.register_backend`` with a creator that returns a ``ProcessGroup``
subclass, whose methods the C++ callers, DDP's reducer among them, reach through the pybind
trampoline). It holds two paths:

- **exact**: ``all_reduce`` with ``SUM`` or ``AVG`` of a float tensor of fewer than
  ``exact_below`` elements (:data:`DEFAULT_EXACT_BELOW`), inside ``with`` :func:`exact`, or on
  a group made with ``NcinaOptions(exact=True)``, goes to gloo (AVG: gloo's SUM, then divided
  by the world size in the tensor's dtype);
- **INA**: the other ``SUM`` or ``AVG`` all-reduces of a dense float32, float16 or bfloat16
  tensor (any shape, contiguous or not, CPU or CUDA) go through the aggregator(s) of the job
  over the INA protocol, lossy (NC8), with the hook's per-call agreement
  (:mod:`ncina.worker.torch_hook`: a non-finite value on any rank sends the call exact on
  every rank through the group's second gloo group, ``gloo-ina/``; the range follows the
  call's largest magnitude, so nothing saturates): the fabric is a
  :class:`~ncina.worker.sharding.ShardedAllreduce` of
  :class:`~ncina.worker.client.AllreduceClient` s and the tensor is handed to the DDP hook's
  communication thread (:meth:`ncina.worker.torch_hook.InaHookState.submit`), so the call
  returns at once with a :class:`NcinaWork` whose future completes when the result is in the
  tensor. A float32 contiguous tensor is reduced in place (a CUDA one staged through pinned
  memory, as the hook stages its buckets); any other is reduced in a float32 contiguous copy
  on its device, copied back (cast) when the result is in;
- **gloo**: every other collective (broadcast, all_gather, reduce_scatter, barrier, all_to_all,
  send/recv, ...) and the all-reduces INA cannot do (MAX, MIN, PRODUCT, integer or sparse
  tensors, several tensors at once) go to a ``ProcessGroupGloo`` made over the same store, so
  DDP's parameter broadcast, ZeRO and metric gathering work as with gloo. ``barrier`` first
  waits for the INA work before it. That gloo group is also the group's registered CPU
  backend, which gives the group the name ``_functional_collectives`` looks up; their calls
  still come to :meth:`NcinaProcessGroup.allreduce`.

:attr:`NcinaProcessGroup.paths` counts which path each call took (``"allreduce/ina"``,
``"broadcast/gloo"``, ...); :func:`paths` reads it for a group. Only the default group has an
aggregator job (its workers are the world); a group made later with ``new_group(...,
backend="ncina")`` sends everything to gloo.

The job's parameters come from ``init_process_group(..., pg_options=NcinaOptions(...))`` or
the ``NCINA_*`` environment variables (:meth:`NcinaOptions.from_env`): every field of the job
but its workers (the world) by the field's name (``JobSpec``), its variable the name of its
option in capitals (``--pool-size``: ``NCINA_POOL_SIZE``). The group checks the job
with the aggregator when it is made (a one-element all-reduce on every rank): a job that differs
(``JobMismatchError``, naming each parameter), no aggregator (``TimeoutError``) or any other
failure raises ``torch.distributed.DistBackendError`` from ``init_process_group``; a later
all-reduce that fails raises it from ``wait()``.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ncina.proto.header import Format
from ncina.proto.job import FORMATS, OPTIONS, JobSpec, role_fields
from ncina.worker.client import AllreduceClient
from ncina.worker.sharding import ShardedAllreduce
from ncina.worker.torch_hook import InaHookState
from torch._C._distributed_c10d import Work

from ncina.common.address import parse_address

NAME = "ncina"
INA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INA_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean"}

# The group's own environment variables -> (NcinaOptions field, parser); a job field's is
# job_variable's, parsed as its option is.
ENVIRONMENT: dict[str, tuple[str, Callable[[str], Any]]] = {
    "NCINA_AGGREGATOR": (
        "aggregators", lambda s: [parse_address(a, port_zero=False) for a in s.split(",")]
    ),
    "NCINA_DEADLINE": ("deadline", float),
    "NCINA_SEED": ("seed", int),
    "NCINA_EXACT_BELOW": ("exact_below", int),
    "NCINA_EXACT": ("exact", lambda s: _flag("NCINA_EXACT", s)),
}
# Below this many elements an all-reduce is exact (gloo): the INA path's fixed cost measured
# on loopback (~0.5 ms: the thread hand-off, the agreement, the slots' round trips) is repaid
# by NC8's smaller transfer from ~2K elements at 100 Mbit/s and ~20K at 1 Gbit/s
# (docs/pytorch.md, "Exact, lossy, non-finite, range").
DEFAULT_EXACT_BELOW = 16384


def _flag(name: str, value: str) -> bool:
    """``1``/``0`` (or ``true``/``false``, ``yes``/``no``) as a bool; ``ValueError`` else."""
    words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
    if value.lower() not in words:
        raise ValueError(f"${name} must be 1 or 0, got {value!r}")
    return words[value.lower()]


def job_fields() -> tuple[str, ...]:
    """The job fields a group's options carry: a worker's (``ncina.proto.job.role_fields``),
    but the workers and the total workers, which the world is (its size; one level)."""
    return tuple(name for name in role_fields("worker")
                 if name not in ("workers", "total_workers"))  # fmt: skip


def job_variable(name: str) -> str:
    """The environment variable of job field ``name``: its option's name in capitals,
    ``NCINA_POOL_SIZE`` for ``--pool-size``, ``NCINA_KEY_FILE`` for the key's ``--key-file``."""
    return "NCINA_" + OPTIONS[name].flag.removeprefix("--").upper().replace("-", "_")


@dataclass(init=False)
class NcinaOptions:
    """The group's job and options. ``job`` holds the job's fields by ``JobSpec``'s names
    (``NcinaOptions(job=7, k=128, result="int", profile="tofino")``; :func:`job_fields`: every
    field but the workers; ``result_format`` is ``result``'s older name): as the aggregator
    holds them, ``ncina aggregator``'s flags; unset ones take ``JobSpec``'s defaults, the job
    id 1. ``aggregators``: one or more ``(host, port)`` (several shard every tensor, as ``ncina
    train`` does); ``seed`` seeds each rank's stochastic rounding with ``(seed << 16) + rank``;
    ``deadline`` is the client's longest wait for progress (s). ``exact_below``: an all-reduce
    of fewer elements is exact (gloo); ``exact``: every all-reduce is (the group behaves as
    gloo, the aggregator idle). Environment variables: :data:`ENVIRONMENT` and
    :func:`job_variable`."""

    aggregators: list[tuple[str, int]]
    job: dict[str, Any]
    deadline: float
    seed: int
    exact_below: int
    exact: bool

    def __init__(
        self, aggregators: list[tuple[str, int]] | None = None, *, deadline: float = 30.0,
        seed: int = 0, exact_below: int = DEFAULT_EXACT_BELOW, exact: bool = False,
        result_format: str | None = None, **job: Any,
    ) -> None:  # fmt: skip
        unknown = job.keys() - set(job_fields())
        if unknown:
            raise TypeError(f"NcinaOptions: {', '.join(sorted(unknown))} is no field of the "
                            f"job it carries ({', '.join(job_fields())})")  # fmt: skip
        if result_format is not None:
            job["result"] = result_format
        if isinstance(job.get("result"), Format):
            job["result"] = job["result"].name.lower()
        self.aggregators = list(aggregators or [])
        self.job = {"job": 1, **{name: value for name, value in job.items() if value is not None}}
        self.deadline, self.seed, self.exact_below, self.exact = deadline, seed, exact_below, exact

    @classmethod
    def for_job(
        cls, aggregators: list[tuple[str, int]], job: JobSpec, **options: Any
    ) -> NcinaOptions:
        """The options of ``job`` (every field a group carries, :func:`job_fields`) and the
        group's own ``options`` (``deadline``, ``seed``, ...)."""
        return cls(aggregators, **{name: getattr(job, name) for name in job_fields()}, **options)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NcinaOptions:
        """Options from ``NCINA_*`` variables (``environ``, default ``os.environ``); unset ones
        keep their defaults. ``ValueError`` names a variable whose value does not parse."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        job = [(job_variable(name), (name, OPTIONS[name].parse)) for name in job_fields()]
        for variable, (name, parse) in [*ENVIRONMENT.items(), *job]:
            if variable in environ:
                try:
                    values[name] = parse(environ[variable])
                except ValueError as exc:
                    raise ValueError(f"${variable}={environ[variable]!r}: {exc}") from None
        return cls(**values)

    def check(self) -> None:
        """``ValueError`` unless an aggregator is given and the result format is known."""
        if not self.aggregators:
            raise ValueError("the ncina backend needs an aggregator: set $NCINA_AGGREGATOR="
                             "HOST:PORT or pass pg_options=NcinaOptions(aggregators=[...])")
        result = self.job.get("result", "nc8")
        if result not in FORMATS:
            raise ValueError(f"result format must be one of {sorted(FORMATS)}, got {result!r}")


def make_fabric(options: NcinaOptions, rank: int, workers: int) -> ShardedAllreduce:
    """One client per aggregator of ``options`` for ``rank`` of ``workers``; the job is
    validated, and its K defaulted, as ``JobSpec`` does (``ValueError`` naming every problem)."""
    job = JobSpec(workers=workers, **options.job)
    return ShardedAllreduce([
        AllreduceClient.for_job(
            address, job, rank=rank, seed=(options.seed << 16) + rank,
            deadline=options.deadline,
        )
        for address in options.aggregators
    ])  # fmt: skip


class NcinaWork(Work):
    """The ``Work`` of an INA all-reduce: its future completes with ``[tensor]`` once the
    result is in the tensor; :meth:`wait` raises a failure as ``DistBackendError``, and so
    does a ``timeout`` (as gloo's ``wait``) that passes first: the all-reduce goes on, and its
    result still lands in the tensor."""

    def __init__(self, future: torch.futures.Future[list[torch.Tensor]]) -> None:
        super().__init__()
        self.future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = 0.0 if timeout is None else timeout.total_seconds()
        if seconds > 0 and not self.future.done():  # 0: torch's "no timeout"
            ended = threading.Event()
            self.future.add_done_callback(lambda _: ended.set())
            if not ended.wait(seconds):
                raise dist.DistBackendError(
                    f"ncina all_reduce: not complete after the wait's timeout of {seconds:g} s")
        try:
            self.future.wait()
        except Exception as exc:
            raise dist.DistBackendError(f"ncina all_reduce failed: {exc}") from exc
        return True

    def result(self) -> list[torch.Tensor]:
        """``[tensor]``, once complete (waits; raises as :meth:`wait`)."""
        self.wait()
        return self.future.value()

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        if not self.future.done():
            raise RuntimeError("is_success: the all-reduce has not completed")
        try:
            self.future.value()
        except Exception:
            return False
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.future


# Per thread: inside ``with exact():``, all-reduces go exact (see :func:`exact`).
_LOCAL = threading.local()


@contextmanager
def exact() -> Iterator[None]:
    """Inside the block, this thread's all-reduces on an ``ncina`` group are exact (gloo),
    whatever their size: ``with exact(): dist.all_reduce(correct)`` for a metric. Every rank
    must make the same calls exact (as every rank makes the same calls)."""
    depth = getattr(_LOCAL, "exact", 0)
    _LOCAL.exact = depth + 1
    try:
        yield
    finally:
        _LOCAL.exact = depth


class NcinaProcessGroup(dist.ProcessGroup):
    """A process group whose float all-reduces go through INA, the rest through gloo (see the
    module doc). ``fabric`` None: every call goes to gloo."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        fabric: ShardedAllreduce | None,
        exact_below: int = DEFAULT_EXACT_BELOW,
        exact_group: bool = False,
    ) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                               self.gloo)  # fmt: skip
        self.state = None
        if fabric is not None:  # the per-call agreement's own gloo group (torch_hook's doc)
            agreement = dist.ProcessGroupGloo(dist.PrefixStore("gloo-ina/", store), rank, size,
                                              timeout)  # fmt: skip
            self.state = InaHookState(fabric, group=agreement)
        self.exact_below = exact_below
        self.exact_group = exact_group
        self.paths: Counter[str] = Counter()
        self._lock = threading.Lock()

    def getBackendName(self) -> str:  # noqa: N802 (the name torch calls)
        return NAME

    def size(self) -> int:
        return self._size

    def shutdown(self) -> None:
        """``destroy_process_group``: wait for the all-reduce in flight, stop the communication
        thread, close the clients' sockets and gloo's group."""
        if self.state is not None:
            self.state.close()
            self.state.fabric.close()
            self.state.group.shutdown()
        self.gloo.shutdown()

    def _count(self, key: str) -> None:
        with self._lock:
            self.paths[key] += 1

    def ina_op(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> str | None:
        """``sum`` or ``mean`` when this all-reduce could go through INA (one dense float
        tensor, SUM or AVG), else None."""
        if self.state is None or len(tensors) != 1:
            return None
        tensor = tensors[0]
        if tensor.dtype not in INA_DTYPES or tensor.layout != torch.strided:  # sparse: gloo
            return None
        return next((op for red, op in INA_OPS.items() if opts.reduceOp == red), None)

    def allreduce(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> Work:
        opts = dist.AllreduceOptions() if opts is None else opts
        op = self.ina_op(tensors, opts)
        if op is None:
            self._count("allreduce/gloo")
            return self.gloo.allreduce(tensors, opts)
        tensor = tensors[0]
        if self.exact_group or getattr(_LOCAL, "exact", 0) or tensor.numel() < self.exact_below:
            self._count("allreduce/exact")
            return self._exact_allreduce(tensor, op)
        self._count("allreduce/ina")
        return NcinaWork(self._ina_allreduce(tensor, op))

    def _exact_allreduce(self, tensor: torch.Tensor, op: str) -> Work:
        """gloo's SUM of ``tensor`` (``op`` "mean": divided by the world size after it, in
        the tensor's dtype, as ``all_reduce(SUM); t /= world`` on gloo)."""
        work = self.gloo.allreduce([tensor], dist.AllreduceOptions())
        if op == "sum":
            return work

        def divide(result: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
            result.value()[0].div_(self._size)  # raises gloo's error
            return [tensor]

        return NcinaWork(work.get_future().then(divide))

    def _ina_allreduce(
        self, tensor: torch.Tensor, op: str
    ) -> torch.futures.Future[list[torch.Tensor]]:
        """Hand ``tensor`` (or its float32 contiguous copy) to the communication thread; the
        future completes with ``[tensor]`` once the result is in it."""
        assert self.state is not None
        direct = tensor.dtype == torch.float32 and tensor.is_contiguous()
        work = tensor.detach() if direct else tensor.detach().to(
            dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)  # fmt: skip
        # The staging buffer of a CUDA tensor is kept per key: the storage's address.
        future = self.state.submit(work, work.data_ptr(), op)

        def done(result: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            value = result.value()  # raises the all-reduce's error
            if not direct:
                tensor.copy_(value)
            return [tensor]

        return future.then(done)


def _delegate(name: str, target: str) -> Callable[..., Any]:
    """A method ``name`` of :class:`NcinaProcessGroup` that counts the call (as
    ``name/gloo``) and hands it to gloo's ``target``."""

    def method(self: NcinaProcessGroup, *args: Any, **kwargs: Any) -> Any:
        self._count(f"{name}/gloo")
        return getattr(self.gloo, target)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"gloo's ``{target}`` (counted as ``{name}/gloo``)."
    return method


# Every method torch.distributed (or DDP's C++ reducer) calls on a group but allreduce, and
# the name of the same collective on gloo's Backend, where it differs.
GLOO_METHODS = {
    "allreduce_coalesced": "allreduce_coalesced", "broadcast": "broadcast",
    "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
    "all_gather_single": "_allgather_base", "_allgather_base": "_allgather_base",
    "reduce": "reduce", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "_reduce_scatter_base",
    "_reduce_scatter_base": "_reduce_scatter_base", "gather": "gather", "scatter": "scatter",
    "alltoall": "alltoall", "all_to_all_single": "alltoall_base",
    "alltoall_base": "alltoall_base", "barrier": "barrier",
    "monitored_barrier": "monitored_barrier", "send": "send", "recv": "recv",
    "recv_anysource": "recv_anysource",
}  # fmt: skip
for _name, _target in GLOO_METHODS.items():
    setattr(NcinaProcessGroup, _name, _delegate(_name, _target))


def _after_ina(name: str) -> Callable[..., Any]:
    """A barrier ``name`` of :class:`NcinaProcessGroup` that first waits for the INA
    all-reduces submitted before it (gloo's barrier waits for the group's earlier work), then
    is gloo's (counted as ``name/gloo``)."""
    delegate = _delegate(name, GLOO_METHODS[name])

    def method(self: NcinaProcessGroup, *args: Any, **kwargs: Any) -> Any:
        if self.state is not None:
            self.state.drain()
        return delegate(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"The INA work before it ended, then {delegate.__doc__}"
    return method


for _name in ("barrier", "monitored_barrier"):
    setattr(NcinaProcessGroup, _name, _after_ina(_name))


def create(
    backend_options: dist._DistributedBackendOptions, options: NcinaOptions | None
) -> NcinaProcessGroup:
    """The creator ``Backend.register_backend`` calls (``extended_api``): ``options`` is
    ``init_process_group``'s ``pg_options`` (None: the ``NCINA_*`` environment). The default
    group gets the job's fabric, checked with the aggregator before it returns."""
    store, rank, size = backend_options.store, backend_options.group_rank, \
        backend_options.group_size  # fmt: skip
    fabric = None
    if not dist.is_initialized():  # the default group: the world is the job's workers
        options = NcinaOptions.from_env() if options is None else options
        options.check()
        try:
            fabric = make_fabric(options, rank, size)
        except (ValueError, RuntimeError, OSError) as exc:
            raise dist.DistBackendError(f"ncina: {exc}") from exc
        try:
            fabric.allreduce(np.zeros(1, dtype=np.float32))  # the job handshake, on every rank
        except Exception as exc:
            fabric.close()
            raise dist.DistBackendError(f"ncina: {exc}") from exc
    options = options or NcinaOptions()  # a later group: only the exact switches matter
    return NcinaProcessGroup(store, rank, size, backend_options.timeout, fabric,
                             exact_below=options.exact_below,
                             exact_group=options.exact)  # fmt: skip


def paths(group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """How many calls of ``group`` (default: the default group) took each path,
    ``{"allreduce/ina": 12, "broadcast/gloo": 3, ...}``; ``ValueError`` for a group of another
    backend."""
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, NcinaProcessGroup):
        raise ValueError(f"not an ncina process group: {type(pg).__name__}")
    counted = dict(pg.paths)
    if pg.state is not None:  # INA calls the agreement sent exact (torch_hook's doc)
        counted.update({f"allreduce/ina-exact:{why}": n for why, n in pg.state.exact_calls.items()})
    return counted

