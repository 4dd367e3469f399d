"""The DDP hook with CUDA gradient buckets (``CudaCopier``: copy stream, events, pinned memory).

Skipped without a GPU. Written on a machine without one: these tests have not run here; the same
steps on CPU tensors are checked by tests/test_staging.py and by the staged DDP run of
tests/test_torch_hook.py.

- two ranks train the branches model of tests/test_torch_hook.py on the GPU (both ranks may share
  one) with DDP, through the hook and a loopback aggregator with ``int`` results: the mean equals
  gloo's all-reduce of the same CUDA buckets bit for bit, before and after DDP rebuilds them, and
  every bucket index kept one staging buffer of its bucket's size;
- ``ncina train --device cuda`` trains two ranks through an aggregator;
- one CUDA bucket through the real copier: its mean comes back into the device buffer, through one
  pinned buffer per bucket index, the same tensor on the next iteration, and the future's value
  is usable on the current stream after ``wait()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ncina.topo import report
from ncina.worker.staging import CudaCopier
from ncina.worker.torch_hook import InaHookState, ina_hook
from ncina_testlib import start_aggregator
from test_staging import Bucket, InPlaceFabric, Log
from test_torch_hook import ITERATIONS, run_ranks
from test_train_loopback import STEPS, WORLD, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_ddp_through_the_hook_equals_gloo(tmp_path: Path) -> None:
    ranks, _ = run_ranks(tmp_path, "int", "powers", device="cuda")
    for iterations in ranks:
        assert len(iterations) == ITERATIONS
        layouts = [[r["elements"] for r in records] for records in iterations]
        assert layouts[0] != layouts[1], "DDP did not rebuild its buckets"
        for records in iterations:
            assert records and [r["max_abs_error"] for r in records] == [0.0] * len(records)
    assert ranks[0] == ranks[1]


def test_a_cuda_bucket_goes_through_one_pinned_buffer_and_back() -> None:
    log: Log = []
    fabric = InPlaceFabric(log)
    state = InaHookState(fabric)  # type: ignore[arg-type]
    assert isinstance(state.staging.copier, CudaCopier)
    bucket = Bucket(3, 1000)
    bucket._buffer = bucket._buffer.cuda()
    staged = []
    for _ in range(2):  # the second iteration reuses the first one's buffer
        bucket._buffer.fill_(3.0)
        result = ina_hook(state, bucket).wait()  # type: ignore[arg-type]
        assert result is bucket.buffer() and result.is_cuda
        assert result.cpu().tolist() == [6.0] * 1000
        staged.append(state.staging.slots[3].host)
    assert staged[0] is staged[1] and staged[0].is_pinned() and staged[0].device.type == "cpu"
    assert len(state.staging.slots) == 1 and state.staging.slots[3].bucket is None
    assert {x for x, _ in fabric.addresses} == {staged[0].data_ptr()}
    assert [e[0] for e in log] == ["start", "end"] * 2
    state.close()


def test_ncina_train_on_the_gpu_through_an_aggregator(tmp_path: Path) -> None:
    agg = start_aggregator("python", tmp_path / "aggregator", job=1, workers=WORLD, k=256,
                           result="nc8", extra=["--seed", "0"])  # fmt: skip
    try:
        host, port = agg.address
        metrics = train(tmp_path, "ina", [f"{host}:{port}"], extra=["--device", "cuda"])
    finally:
        assert agg.stop() == 0
    for path in metrics:
        events = report.read_events(path)
        assert events[0]["device"].startswith("cuda:") and events[-1]["steps"] == STEPS
