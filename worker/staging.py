"""Pinned host staging of GPU gradient buckets for the DDP hook (:mod:`ncina.worker.torch_hook`).

The fabric all-reduces host memory, so a CUDA bucket makes one trip each way:

- on DDP's thread, when the hook is called (:meth:`BucketStaging.stage`): an event recorded on the
  current stream (where the bucket was just filled) is waited for by a dedicated copy stream, which
  copies the bucket into the bucket's pinned staging buffer without blocking, and records a
  ``staged`` event. The hook returns at once, so the copy of bucket ``i + 1`` runs while bucket
  ``i`` is on the wire;
- on the hook's communication thread (:meth:`BucketStaging.host`): the ``staged`` event is waited
  for, and the fabric writes the mean into the same pinned buffer (``out=``);
- then (:meth:`BucketStaging.finish`) one non-blocking copy back into the bucket on the copy
  stream, and the future completes: it was made with the bucket's device
  (``torch.futures.Future(devices=[device])``) and its result is set with the copy stream
  current, so it records an event there that DDP's wait makes its own stream wait for (the
  documented contract of ``Future.set_result`` for GPU tensors); the communication thread does
  not wait for the copy.

Memory: one staging buffer per bucket index, allocated at the bucket's first call and reused
every iteration after (DDP keeps its buckets; when it rebuilds them after the first iteration a
bucket whose size changed gets a new buffer in place of its old one), plus two events. The
pinned memory is thus the size of the model's gradients (and of any first-layout buckets beyond
the rebuilt count); nothing is allocated per call after the first iteration. One buffer per
bucket suffices: DDP hands a bucket over again only in the next backward pass, after its future
completed, and on the copy stream the next copy into the buffer queues behind the copy out of it.
A bucket handed over again before its all-reduce finished is refused (``RuntimeError``).

The device operations sit behind a small :class:`Copier`: :class:`CudaCopier` (streams, events,
pinned memory) and :class:`HostCopier`, the same steps with synchronous copies and no events,
which stages CPU tensors, so that everything but the CUDA calls runs in tests on a machine
without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Copier(Protocol):
    """The device operations of the staging (see the module doc)."""

    pin_memory: bool

    def handles(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer``'s bucket goes through staging."""

    def new_event(self) -> Any:
        """An event a staging buffer keeps (reused every iteration)."""

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, ready: Any, staged: Any) -> None:
        """On DDP's thread: queue the copy of ``src`` into ``dst`` after the work queued so far
        on the current stream (``ready``), then record ``staged``."""

    def wait(self, staged: Any) -> None:
        """Block until the copy that recorded ``staged`` is done."""

    def future(self, device: torch.device) -> torch.futures.Future[torch.Tensor]:
        """A pending future that may hold a tensor on ``device``."""

    def to_device(
        self, src: torch.Tensor, dst: torch.Tensor, future: torch.futures.Future[torch.Tensor]
    ) -> None:
        """Queue the copy of ``src`` into ``dst`` and complete ``future`` with ``dst`` so that
        its consumer waits for the copy."""


class CudaCopier:
    """CUDA buckets: one copy stream per device (made at its first bucket), CUDA events,
    non-blocking copies from and to pinned memory."""

    pin_memory = True

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def handles(self, buffer: torch.Tensor) -> bool:
        return buffer.is_cuda

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The copy stream of ``device``."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def to_host(
        self, src: torch.Tensor, dst: torch.Tensor, ready: torch.cuda.Event,
        staged: torch.cuda.Event,
    ) -> None:  # fmt: skip
        stream = self.stream(src.device)
        ready.record(torch.cuda.current_stream(src.device))
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            staged.record(stream)
        src.record_stream(stream)  # the allocator keeps the bucket's memory until the copy ran

    def wait(self, staged: torch.cuda.Event) -> None:
        staged.synchronize()

    def future(self, device: torch.device) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future(devices=[device])

    def to_device(
        self, src: torch.Tensor, dst: torch.Tensor, future: torch.futures.Future[torch.Tensor]
    ) -> None:
        stream = self.stream(dst.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            future.set_result(dst)  # records an event on the copy stream for the consumers
        dst.record_stream(stream)


class HostCopier:
    """The staging steps on CPU tensors: synchronous copies, no events, pageable memory. It
    stages every bucket (a CPU bucket too), so that tests drive :class:`BucketStaging` and the
    hook's staged path on a machine without CUDA."""

    pin_memory = False

    def handles(self, buffer: torch.Tensor) -> bool:
        return True

    def new_event(self) -> None:
        return None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, ready: None, staged: None) -> None:
        dst.copy_(src)

    def wait(self, staged: None) -> None:
        pass

    def future(self, device: torch.device) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    def to_device(
        self, src: torch.Tensor, dst: torch.Tensor, future: torch.futures.Future[torch.Tensor]
    ) -> None:
        dst.copy_(src)
        future.set_result(dst)


@dataclass
class Slot:
    """A bucket index's staging buffer (``host``), its events, and the bucket whose all-reduce
    is using it (``None`` when free)."""

    host: torch.Tensor
    ready: Any
    staged: Any
    bucket: torch.Tensor | None = None


class BucketStaging:
    """The staging buffers of the hook's device buckets, one per bucket index (module doc)."""

    def __init__(self, copier: Copier | None = None) -> None:
        self.copier: Copier = copier if copier is not None else CudaCopier()
        self.slots: dict[int, Slot] = {}

    def handles(self, buffer: torch.Tensor) -> bool:
        """Whether the bucket ``buffer`` is staged (a CUDA bucket, with the default copier)."""
        return self.copier.handles(buffer)

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory held (pinned, with the CUDA copier)."""
        return sum(s.host.numel() * s.host.element_size() for s in self.slots.values())

    def stage(self, buffer: torch.Tensor, index: int) -> Slot:
        """On DDP's thread: queue the copy of bucket ``index`` (``buffer``) into its staging
        buffer, allocated at its first call or when its size changed; returns the slot, busy
        until :meth:`finish` or :meth:`release`."""
        slot = self.slots.get(index)
        if slot is not None and slot.bucket is not None:
            raise RuntimeError(f"bucket {index} handed over again before its all-reduce finished")
        if slot is None or slot.host.numel() != buffer.numel() or slot.host.dtype != buffer.dtype:
            host = torch.empty(buffer.numel(), dtype=buffer.dtype,
                               pin_memory=self.copier.pin_memory)  # fmt: skip
            slot = self.slots[index] = Slot(host, self.copier.new_event(), self.copier.new_event())
        slot.bucket = buffer
        self.copier.to_host(buffer.detach(), slot.host, slot.ready, slot.staged)
        return slot

    def future(self, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The pending future of the staged bucket ``buffer`` (on its device)."""
        return self.copier.future(buffer.device)

    def host(self, slot: Slot) -> torch.Tensor:
        """On the communication thread: the staging buffer, once the bucket's copy is in it."""
        self.copier.wait(slot.staged)
        return slot.host

    def finish(self, slot: Slot, future: torch.futures.Future[torch.Tensor]) -> None:
        """Queue the copy of the staging buffer back into the bucket, free the slot, and
        complete ``future`` with the bucket (its consumer waits for the copy)."""
        bucket = slot.bucket
        if bucket is None:
            raise RuntimeError("finish of a staging slot that holds no bucket")
        slot.bucket = None  # free before the future completes: DDP may hand the bucket over next
        self.copier.to_device(slot.host, bucket, future)

    def release(self, slot: Slot) -> None:
        """Free the slot without copying back (its all-reduce failed)."""
        slot.bucket = None
