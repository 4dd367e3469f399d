"""The DDP hook's staged path (ncina.worker.staging), driven with CPU tensors.

``HostCopier`` performs the staging steps of a CUDA bucket (copy into a staging buffer, wait,
mean written into the buffer, copy back, future completed by the copier) with CPU tensors; a
recording subclass logs every copy into one log with the fake fabric's calls, so that these tests
check on a machine without a GPU what the CUDA path does: one copy each way per bucket, one
staging buffer per bucket reused across iterations, the next bucket copied to the host while the
previous one is on the wire, failures completing their futures, and no memory of a bucket's size
allocated per call after the first iteration. tests/test_cuda_hook.py runs the CUDA copier itself
where a GPU exists.
"""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest
import torch
from ncina.worker.staging import BucketStaging, HostCopier
from ncina.worker.torch_hook import InaHookState, ina_hook

Log = list[tuple[str, int]]


class RecordingCopier(HostCopier):
    """``HostCopier`` that logs each copy as ``("to_host" | "to_device", bucket)``; the bucket
    is told by its first element, which the tests set to the bucket's index."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, ready: None, staged: None) -> None:
        self.log.append(("to_host", int(src[0])))
        super().to_host(src, dst, ready, staged)

    def to_device(
        self, src: torch.Tensor, dst: torch.Tensor, future: torch.futures.Future[torch.Tensor]
    ) -> None:
        self.log.append(("to_device", int(dst[0])))
        super().to_device(src, dst, future)


class InPlaceFabric:
    """Writes ``x * 2`` into ``out`` (the real fabric's contract), logs ``("start" | "end",
    bucket)`` around it, and keeps the addresses it was given; waits for ``release`` first, and
    fails on the bucket ``fail_on`` (once)."""

    def __init__(self, log: Log, fail_on: int | None = None) -> None:
        self.log = log
        self.release = threading.Event()
        self.release.set()
        self.fail_on = fail_on
        self.addresses: list[tuple[int, int]] = []

    def allreduce(
        self, x: np.ndarray, tensor: int, out: np.ndarray, op: str = "mean"
    ) -> np.ndarray:
        assert op == "mean"  # what the DDP hook asks for
        self.log.append(("start", tensor))
        assert self.release.wait(30)
        self.addresses.append((x.ctypes.data, out.ctypes.data))
        if tensor == self.fail_on:
            self.fail_on = None
            raise TimeoutError(f"allreduce: no result for bucket {tensor}")
        np.multiply(x, 2, out=out)
        self.log.append(("end", tensor))
        return out


class Bucket:
    """What the hook reads of a ``dist.GradBucket``: a flat buffer and its index."""

    def __init__(self, index: int, size: int) -> None:
        self._buffer = torch.full((size,), float(index))
        self._index = index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def refill(self) -> None:
        """The next iteration's gradients (the index again, as the log reads it)."""
        self._buffer.fill_(float(self._index))


def staged_state(fabric: InPlaceFabric, log: Log) -> InaHookState:
    return InaHookState(fabric, staging=BucketStaging(RecordingCopier(log)))  # type: ignore[arg-type]


def test_one_copy_each_way_per_bucket_through_one_reused_buffer_per_bucket() -> None:
    log: Log = []
    fabric = InPlaceFabric(log)
    state = staged_state(fabric, log)
    buckets = [Bucket(i, size) for i, size in enumerate((5, 3, 8))]
    buffers = {}
    for iteration in range(3):
        for b in buckets:
            b.refill()
        futures = [ina_hook(state, b) for b in buckets]  # type: ignore[arg-type]
        results = [f.wait() for f in futures]
        for bucket, result in zip(buckets, results, strict=True):
            assert result is bucket.buffer()  # the bucket itself, its mean copied back in
            assert result.tolist() == [2.0 * bucket.index()] * result.numel()
        copies = [entry for entry in log if entry[0].startswith("to_")]
        assert sorted(copies) == sorted([("to_host", i) for i in range(3)]
                                        + [("to_device", i) for i in range(3)])  # fmt: skip
        slots = state.staging.slots
        if iteration == 0:
            buffers = {i: slot.host for i, slot in slots.items()}
        assert len(slots) == 3 and all(slots[i].host is buffers[i] for i in range(3))
        assert all(s.bucket is None for s in slots.values())  # every slot free again
        log.clear()
    assert state.staging.nbytes == 4 * (5 + 3 + 8)
    # The fabric read the staging buffer and wrote the mean into it: no array of its own.
    staging = {b.data_ptr() for b in buffers.values()}
    assert {x for x, _ in fabric.addresses} == staging
    assert all(x == out for x, out in fabric.addresses)
    state.close()


def test_the_next_bucket_is_copied_to_the_host_while_the_previous_is_on_the_wire() -> None:
    log: Log = []
    fabric = InPlaceFabric(log)
    fabric.release.clear()  # the first all-reduce holds the wire until the hook has returned
    state = staged_state(fabric, log)
    buckets = [Bucket(i, 4) for i in range(3)]
    futures = [ina_hook(state, b) for b in buckets]  # type: ignore[arg-type]
    assert not any(f.done() for f in futures)
    fabric.release.set()
    for f in futures:
        f.wait()
    state.close()
    assert [e for e in log if e[0] == "start"] == [("start", i) for i in range(3)]  # in order
    for i in range(2):
        assert log.index(("to_host", i + 1)) < log.index(("end", i))
        assert log.index(("end", i)) < log.index(("to_device", i))
    assert log.index(("to_host", 0)) < log.index(("start", 0))


def test_a_failed_allreduce_completes_its_future_and_frees_its_buffer() -> None:
    log: Log = []
    fabric = InPlaceFabric(log, fail_on=1)
    state = staged_state(fabric, log)
    buckets = [Bucket(i, 4) for i in range(3)]
    futures = [ina_hook(state, b) for b in buckets]  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match="no result for bucket 1"):
        futures[1].wait()
    assert futures[0].wait().tolist() == [0.0] * 4 and futures[2].wait().tolist() == [4.0] * 4
    assert isinstance(state.error, TimeoutError)
    assert ("to_device", 1) not in log  # nothing copied back
    buckets[1].refill()
    assert ina_hook(state, buckets[1]).wait().tolist() == [2.0] * 4  # type: ignore[arg-type]
    state.close()


def test_a_bucket_handed_over_again_while_in_flight_fails_its_future() -> None:
    log: Log = []
    fabric = InPlaceFabric(log)
    fabric.release.clear()
    state = staged_state(fabric, log)
    bucket = Bucket(0, 4)
    first = ina_hook(state, bucket)  # type: ignore[arg-type]
    again = ina_hook(state, bucket)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="bucket 0 handed over again before its all-reduce"):
        again.wait()
    fabric.release.set()
    assert first.wait().tolist() == [0.0] * 4
    state.close()


def test_a_rebuilt_bucket_of_another_size_replaces_its_buffer() -> None:
    log: Log = []
    state = staged_state(InPlaceFabric(log), log)
    ina_hook(state, Bucket(0, 4)).wait()  # type: ignore[arg-type]
    old = state.staging.slots[0].host
    ina_hook(state, Bucket(0, 6)).wait()  # type: ignore[arg-type]
    assert state.staging.slots[0].host is not old and state.staging.nbytes == 4 * 6
    state.close()


def test_no_memory_of_a_buckets_size_is_allocated_per_call_after_the_first() -> None:
    """With the staging buffer in place, an iteration allocates nothing the size of the bucket
    (4 MiB here): numpy's allocations (the fabric's side) are traced; on torch's side the
    staging buffer is the same tensor, and the fabric was handed its memory to read and write."""
    log: Log = []
    fabric = InPlaceFabric(log)
    state = staged_state(fabric, log)
    bucket = Bucket(1, 1 << 20)
    ina_hook(state, bucket).wait()  # type: ignore[arg-type]
    buffer = state.staging.slots[1].host
    bucket.refill()
    tracemalloc.start()
    try:
        ina_hook(state, bucket).wait()  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), f"{peak} bytes traced in a staged all-reduce"
    assert state.staging.slots[1].host is buffer and len(state.staging.slots) == 1
    assert fabric.addresses[-1] == (buffer.data_ptr(), buffer.data_ptr())
    assert bucket.buffer()[:3].tolist() == [2.0] * 3
    state.close()


def test_cpu_buckets_are_reduced_in_place_without_staging() -> None:
    """The default staging (CUDA) leaves a CPU bucket alone: the fabric writes into it."""
    log: Log = []
    fabric = InPlaceFabric(log)
    state = InaHookState(fabric)  # type: ignore[arg-type]
    bucket = Bucket(3, 4)
    assert ina_hook(state, bucket).wait().tolist() == [6.0] * 4  # type: ignore[arg-type]
    assert fabric.addresses == [(bucket.buffer().data_ptr(),) * 2]
    assert state.staging.slots == {}
    state.close()
