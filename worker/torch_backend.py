"""``ncina`` as a ``torch.distributed`` process-group backend (docs/pytorch.md).

``dist.init_process_group("ncina", ...)`` (registered by :mod:`ncina.torch`, which torch loads
at import through the ``torch.backends`` entry point) makes a :class:`NcinaProcessGroup`: a
Python subclass of ``torch.distributed.ProcessGroup`` (the route PyTorch 2.13 offers a backend
written in Python: ``Backend.register_backend`` with a creator that returns a ``ProcessGroup``
subclass, whose methods the C++ callers, DDP's reducer among them, reach through the pybind
trampoline). It holds two paths:

- **INA**: ``all_reduce`` with ``SUM`` or ``AVG`` of a float32, float16 or bfloat16 tensor (any
  size, contiguous or not, CPU or CUDA) goes through the aggregator(s) of the job over the INA
  protocol: the fabric is a :class:`~ncina.worker.sharding.ShardedAllreduce` of
  :class:`~ncina.worker.client.AllreduceClient` s and the tensor is handed to the DDP hook's
  communication thread (:meth:`ncina.worker.torch_hook.InaHookState.submit`), so the call
  returns at once with a :class:`NcinaWork` whose future completes when the result is in the
  tensor. A float32 contiguous tensor is reduced in place (a CUDA one staged through pinned
  memory, as the hook stages its buckets); any other is reduced in a float32 contiguous copy
  on its device, copied back (cast) when the result is in;
- **gloo**: every other collective (broadcast, all_gather, reduce_scatter, barrier, all_to_all,
  send/recv, ...) and the all-reduces INA cannot do (MAX, MIN, PRODUCT, integer tensors,
  several tensors at once) go to a ``ProcessGroupGloo`` made over the same store, so DDP's
  parameter broadcast, ZeRO and metric gathering work as with gloo.

:attr:`NcinaProcessGroup.paths` counts which path each call took (``"allreduce/ina"``,
``"broadcast/gloo"``, ...); :func:`paths` reads it for a group. Only the default group has an
aggregator job (its workers are the world); a group made later with ``new_group(...,
backend="ncina")`` sends everything to gloo.

The job's parameters come from ``init_process_group(..., pg_options=NcinaOptions(...))`` or
the ``NCINA_*`` environment variables (:meth:`NcinaOptions.from_env`). The group checks the job
with the aggregator when it is made (a one-element all-reduce on every rank): a job that differs
(``JobMismatchError``, naming each parameter), no aggregator (``TimeoutError``) or any other
failure raises ``torch.distributed.DistBackendError`` from ``init_process_group``; a later
all-reduce that fails raises it from ``wait()``.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ncina.aggregator.jobs import parse_address
from ncina.proto.tag import read_key_file
from ncina.proto.wire import DEFAULT_MTU
from ncina.worker.client import RESULT_FORMATS, AllreduceClient
from ncina.worker.sharding import ShardedAllreduce
from ncina.worker.torch_hook import InaHookState
from torch._C._distributed_c10d import Work

NAME = "ncina"
INA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INA_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean"}

# Environment variable -> (NcinaOptions field, parser).
ENVIRONMENT: dict[str, tuple[str, Callable[[str], Any]]] = {
    "NCINA_AGGREGATOR": ("aggregators", lambda s: [parse_address(a) for a in s.split(",")]),
    "NCINA_JOB": ("job", int),
    "NCINA_RESULT": ("result_format", str),
    "NCINA_KEY_FILE": ("key", read_key_file),
    "NCINA_K": ("k", int),
    "NCINA_POOL_SIZE": ("pool_size", int),
    "NCINA_WINDOW_MAX": ("window_max", int),
    "NCINA_MTU": ("mtu", int),
    "NCINA_DEADLINE": ("deadline", float),
    "NCINA_SEED": ("seed", int),
}


@dataclass
class NcinaOptions:
    """The job's parameters, as the aggregator holds them (``ncina aggregator``'s flags of the
    same names; environment variables in :data:`ENVIRONMENT`). ``aggregators``: one or more
    ``(host, port)`` (several shard every tensor, as ``ncina train`` does); ``seed`` seeds each
    rank's stochastic rounding with ``(seed << 16) + rank``; ``deadline`` is the client's
    longest wait for progress (s)."""

    aggregators: list[tuple[str, int]] = field(default_factory=list)
    job: int = 1
    result_format: str = "nc8"
    key: bytes | None = None
    k: int | None = None
    pool_size: int = 64
    window_max: int = 10
    mtu: int = DEFAULT_MTU
    deadline: float = 30.0
    seed: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NcinaOptions:
        """Options from ``NCINA_*`` variables (``environ``, default ``os.environ``); unset ones
        keep their defaults. ``ValueError`` names a variable whose value does not parse."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for variable, (name, parse) in ENVIRONMENT.items():
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
        if self.result_format not in RESULT_FORMATS:
            raise ValueError(f"result format must be one of {sorted(RESULT_FORMATS)}, "
                             f"got {self.result_format!r}")  # fmt: skip


def make_fabric(options: NcinaOptions, rank: int, workers: int) -> ShardedAllreduce:
    """One client per aggregator of ``options`` for ``rank`` of ``workers``."""
    return ShardedAllreduce([
        AllreduceClient(
            address, job=options.job, rank=rank, workers=workers, k=options.k,
            pool_size=options.pool_size, window_max=options.window_max,
            result_format=options.result_format, seed=(options.seed << 16) + rank,
            deadline=options.deadline, key=options.key, mtu=options.mtu,
        )
        for address in options.aggregators
    ])  # fmt: skip


class NcinaWork(Work):
    """The ``Work`` of an INA all-reduce: its future completes with ``[tensor]`` once the
    result is in the tensor; :meth:`wait` raises a failure as ``DistBackendError``."""

    def __init__(self, future: torch.futures.Future[list[torch.Tensor]]) -> None:
        super().__init__()
        self.future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self.future.wait()
        except Exception as exc:
            raise dist.DistBackendError(f"ncina all_reduce failed: {exc}") from exc
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.future


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
    ) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self.state = None if fabric is None else InaHookState(fabric)
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
        self.gloo.shutdown()

    def _count(self, key: str) -> None:
        with self._lock:
            self.paths[key] += 1

    def ina_op(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> str | None:
        """``sum`` or ``mean`` when this all-reduce goes through INA, else None."""
        if self.state is None or len(tensors) != 1 or tensors[0].dtype not in INA_DTYPES:
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
        self._count("allreduce/ina")
        return NcinaWork(self._ina_allreduce(tensors[0], op))

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
    return NcinaProcessGroup(store, rank, size, backend_options.timeout, fabric)


def paths(group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """How many calls of ``group`` (default: the default group) took each path,
    ``{"allreduce/ina": 12, "broadcast/gloo": 3, ...}``; ``ValueError`` for a group of another
    backend."""
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, NcinaProcessGroup):
        raise ValueError(f"not an ncina process group: {type(pg).__name__}")
    return dict(pg.paths)

