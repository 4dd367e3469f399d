"""The DDP communication hook against gloo, with two real ranks and loopback aggregators.

Each test starts Python aggregators and two rank processes running this file as a script
(``python tests/test_torch_hook.py SPEC``); the ranks train a model of three independent linear
branches with DDP, the hook wrapped by ``verifying_hook`` (which also all-reduces every bucket with
gloo and records the difference), and write the records as JSON.

- ``int`` results, inputs and loss weights that are powers of two: every gradient is a power of two,
  NC8 encodes it exactly and the aggregator sums it exactly, so the hook's mean must equal gloo's
  bit for bit, before and after DDP rebuilds its buckets (which it does after the first
  iteration: the branches run in an order that differs from their registration order);
- ``nc8`` results on Gaussian gradients: every element within the deterministic NC bound, the
  squared error within the variance bound;
- the same exact check with the tensor sharded across two aggregators (the ``multi`` topology),
  and with the buckets staged as CUDA buckets are (``HostCopier``: the same steps on CPU tensors;
  tests/test_cuda_hook.py runs the real CUDA path where a GPU exists);
- the hook is asynchronous: it returns a pending future, buckets are reduced one at a time in
  call order, a failure completes the future with the error (DDP's ``backward()`` raises it,
  with a real aggregator that never answers), and ``comm_total_s`` adds up the time spent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ncina.worker.client import AllreduceClient
from ncina.worker.sharding import ShardedAllreduce
from ncina.worker.staging import BucketStaging, HostCopier
from ncina.worker.torch_hook import (
    InaHookState,
    VerifyingState,
    ina_hook,
    verifying_hook,
)
from ncina.worker.training import release_ddp
from ncina_testlib import start_aggregator
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WORLD = 2
ITERATIONS = 3
K = 64
POOL = 16
BUCKET_CAP_MB = 0.002  # about 500 floats: several buckets once DDP rebuilds them
BRANCHES = ((16, 32), (8, 8), (32, 16))  # (in, out) of each linear branch
FORWARD_ORDER = (2, 0, 1)  # not the registration order, so the rebuilt buckets differ


class Branches(nn.Module):
    """Independent linear branches, run in ``FORWARD_ORDER``; the loss weighs each output."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(i, o) for i, o in BRANCHES)

    def forward(self, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
        return sum((self.branches[b](inputs[b]) * weights[b]).sum() for b in FORWARD_ORDER)


def run_ranks(
    tmp_path: Path, result: str, gradients: str, aggregators: int = 1, **options: str
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Start the aggregators and both ranks; return each rank's records per iteration and the
    aggregators' stats. ``options``: ``device`` (``"cuda"``: the model and its buckets on the
    GPU), ``staging`` (``"host"``: CPU buckets staged as CUDA ones are, ``HostCopier``)."""
    running = [
        start_aggregator(
            "python", tmp_path / f"aggregator{j}", job=1, workers=WORLD, k=K, result=result,
            extra=["--pool-size", str(POOL), "--seed", str(j)],
        )
        for j in range(aggregators)
    ]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(WORLD):
            spec = {
                "rank": rank, "result": result, "gradients": gradients,
                "aggregators": [list(a.address) for a in running],
                "rendezvous": str(tmp_path / "rendezvous"), "out": str(tmp_path / f"{rank}.json"),
                **options,
            }
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
            procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(spec)], env=env))
        for proc in procs:
            assert proc.wait(timeout=180) == 0
        stats = [agg.stats()["jobs"]["1"] for agg in running]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for agg in running:
            agg.stop()
    records = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD)]
    return records, stats


def test_int_results_equal_gloo_across_bucket_rebuild(tmp_path: Path) -> None:
    ranks, _ = run_ranks(tmp_path, "int", "powers")
    for iterations in ranks:
        assert len(iterations) == ITERATIONS
        layouts = [[r["elements"] for r in records] for records in iterations]
        total = sum(i * o + o for i, o in BRANCHES)
        assert all(sum(layout) == total for layout in layouts)
        assert layouts[0] != layouts[1], "DDP did not rebuild its buckets"
        assert len(layouts[1]) > 1 and layouts[1] == layouts[2]
        for records in iterations:
            assert [r["max_abs_error"] for r in records] == [0.0] * len(records)
    assert ranks[0] == ranks[1]  # both ranks saw the same buckets and the same (zero) errors


def test_nc8_results_within_nc_bounds(tmp_path: Path) -> None:
    ranks, _ = run_ranks(tmp_path, "nc8", "gaussian")
    records = [r for iterations in ranks for records in iterations for r in records]
    assert max(r["worst_ratio"] for r in records) <= 1.0
    assert max(r["variance_ratio"] for r in records) <= 2.0
    assert sum(r["variance_ratio"] for r in records) / len(records) <= 1.0
    assert max(r["max_abs_error"] for r in records) > 0  # NC8 is lossy: the check is not vacuous


def test_sharded_across_two_aggregators_is_exact(tmp_path: Path) -> None:
    ranks, stats = run_ranks(tmp_path, "int", "powers", aggregators=2)
    for iterations in ranks:
        for records in iterations:
            assert [r["max_abs_error"] for r in records] == [0.0] * len(records)
    # Every bucket is cut in two halves on chunk boundaries, one per aggregator.
    buckets = [r["elements"] for records in ranks[0] for r in records]
    chunks = [-(-n // K) for n in buckets]
    assert [s["slots_completed"] for s in stats] == [  # + 1: the agreement after the handshake
        sum(c // 2 for c in chunks) + 1, sum(c - c // 2 for c in chunks) + 1
    ]


def test_staged_buckets_equal_gloo_across_bucket_rebuild(tmp_path: Path) -> None:
    """The GPU path's staging (copy to a staging buffer, mean written into it, copy back,
    future completed by the copier) with CPU buckets (``HostCopier``): exact, as unstaged."""
    ranks, _ = run_ranks(tmp_path, "int", "powers", staging="host")
    for iterations in ranks:
        assert len(iterations) == ITERATIONS
        for records in iterations:
            assert records and [r["max_abs_error"] for r in records] == [0.0] * len(records)
    assert ranks[0] == ranks[1]


class HeldFabric:
    """A fabric whose all-reduces wait for ``release`` and record their order (x + 1 each,
    written into ``out`` as the real fabric does)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.release = threading.Event()
        self.calls: list[int] = []
        self.fail_on = fail_on

    def allreduce(
        self, x: np.ndarray, tensor: int, out: np.ndarray, op: str = "mean"
    ) -> np.ndarray:
        assert self.release.wait(30)
        self.calls.append(tensor)
        if tensor == self.fail_on:
            raise TimeoutError(f"allreduce: no result for bucket {tensor}")
        return np.add(x, 1, out=out)


class Bucket:
    """What the hook reads of a ``dist.GradBucket``: its flat buffer and its index."""

    def __init__(self, index: int, values: list[float]) -> None:
        self._buffer = torch.tensor(values, dtype=torch.float32)
        self._index = index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index


def test_the_hook_returns_a_pending_future_and_reduces_buckets_in_order() -> None:
    fabric = HeldFabric()
    state = InaHookState(fabric)  # type: ignore[arg-type]
    buckets = [Bucket(i, [float(i)] * (i + 1)) for i in (2, 0, 1)]
    futures = [ina_hook(state, b) for b in buckets]  # type: ignore[arg-type]
    assert not any(f.done() for f in futures)  # nothing waited for the fabric
    fabric.release.set()
    results = [f.wait() for f in futures]
    assert fabric.calls == [2, 0, 1]  # the order of the hook's calls, one at a time
    for bucket, result in zip(buckets, results, strict=True):
        assert result is bucket.buffer()  # reduced in place: DDP copies it into .grad
        assert result.tolist() == [bucket.index() + 1.0] * (bucket.index() + 1)
    assert state.buckets == 3 and state.comm_total_s > 0
    state.close()


def test_a_failed_allreduce_completes_its_future_with_the_error() -> None:
    fabric = HeldFabric(fail_on=1)
    state = InaHookState(fabric)  # type: ignore[arg-type]
    futures = [ina_hook(state, Bucket(i, [1.0])) for i in range(3)]  # type: ignore[arg-type]
    fabric.release.set()
    assert futures[0].wait().tolist() == [2.0]
    with pytest.raises(TimeoutError, match="no result for bucket 1"):
        futures[1].wait()
    assert futures[2].wait().tolist() == [2.0]  # the fake fabric recovers; a real client refuses
    state.close()


def test_backward_raises_when_the_aggregator_never_answers(tmp_path: Path) -> None:
    """A real DDP model and client whose aggregator address has nobody behind it: the pending
    future fails (the client's job handshake gets no answer) and ``backward()`` raises, instead
    of hanging."""
    script = f"""
import gc
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from ncina.aggregator.process import free_udp_port
from ncina.worker.client import AllreduceClient
from ncina.worker.sharding import ShardedAllreduce
from ncina.worker.torch_hook import InaHookState, ina_hook
dist.init_process_group("gloo", init_method="file://{tmp_path / 'rendezvous'}", rank=0,
                        world_size=1)
model = DistributedDataParallel(torch.nn.Linear(8, 4))
client = AllreduceClient(("127.0.0.1", free_udp_port()), job=1, rank=0, workers=1, k=64,
                         deadline=1.0)
state = InaHookState(ShardedAllreduce([client]))
model.register_comm_hook(state, ina_hook)
try:
    model(torch.ones(2, 8)).sum().backward()
except Exception as exc:
    print("raised:", type(exc).__name__, exc)
print("recorded:", type(state.error).__name__, state.error)
state.close()
del model  # DDP, then the process group, while Python is alive (training.release_ddp)
gc.collect()
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("raised:") and "no answer to the job handshake" in proc.stdout, (
        proc.stdout + proc.stderr
    )
    # the state keeps the client's own error, which DDP's text wraps ("Unable to cast ...")
    recorded = "\nrecorded: TimeoutError no answer to the job handshake from aggregator"
    assert recorded in proc.stdout, proc.stdout


# One rank of the fallback tests: four buckets of four elements (rank r, bucket i: each element
# r + 10 i) through a stand-in fabric that answers bucket i with 1000 + i on every rank, or fails
# the buckets listed for this rank as a real client fails at its deadline; the hook falls back
# to gloo (a group of its own, as ``ncina train`` gives it). Prints what the rank ended with.
FALLBACK_RANK = """
import json, sys
from datetime import timedelta
import numpy as np, torch, torch.distributed as dist
from ncina.worker.torch_hook import InaHookState
rank, fails, rendezvous = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=20))

class Fabric:
    def allreduce(self, x, tensor, out, op="mean"):
        if tensor in fails:
            raise TimeoutError(f"allreduce: no result for bucket {tensor}")
        out[:] = 1000 + tensor
        return out

state = InaHookState(Fabric(), fallback="gloo", group=dist.new_group(backend="gloo"))
futures = [state.submit(torch.full((4,), rank + 10.0 * i), i) for i in range(4)]
results = [f.wait().tolist() for f in futures]
state.close()
dist.destroy_process_group()  # gloo's threads end while Python is alive (training.release_ddp)
print(json.dumps({"results": results, "fallen_back": state.fallen_back,
                  "fallback_buckets": state.fallback_buckets}))
"""


@pytest.mark.parametrize(
    ("fails", "bucket_1"),
    [
        (([1], []), 1001.0),  # rank 1 completes bucket 1 and waits to agree on bucket 2
        (([1], [1]), 10.5),  # both fail bucket 1: gloo's mean of 1 and 11
    ],
    ids=["one-rank-ahead", "same-bucket"],
)
def test_fallback_meets_a_rank_that_completed_the_failed_bucket(
    tmp_path: Path, fails: tuple[list[int], list[int]], bucket_1: float
) -> None:
    """``fallback="gloo"`` with ranks one bucket apart: rank 0's fabric fails bucket 1, rank 1's
    completes it and goes on to agree on bucket 2 in the hook's own group. Rank 0's fallback
    must meet it there (it once waited on the default group instead, and both ranks hung until
    gloo's timeout): rank 0 takes rank 1's result of bucket 1, and both all-reduce buckets 2
    and 3 through gloo. When both fail bucket 1, gloo all-reduces it."""
    rendezvous = str(tmp_path / "rendezvous")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FALLBACK_RANK, str(rank), json.dumps(fails[rank]), rendezvous],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(WORLD)
    ]
    ends = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        ends.append(json.loads(out))
    for end in ends:
        assert end["results"] == [[1000.0] * 4, [bucket_1] * 4, [20.5] * 4, [30.5] * 4]
    assert ends[0]["fallen_back"] == "TimeoutError: allreduce: no result for bucket 1"
    if fails[1]:
        assert ends[1]["fallen_back"] == ends[0]["fallen_back"]
        assert [end["fallback_buckets"] for end in ends] == [3, 3]
    else:
        assert ends[1]["fallen_back"] == "another rank's INA all-reduce failed"
        assert [end["fallback_buckets"] for end in ends] == [2, 2]  # bucket 1 came from rank 1


def rank_main(spec: dict[str, Any]) -> None:
    """One rank: DDP over the branches, the verifying INA hook, ``ITERATIONS`` backward passes."""
    rank = spec["rank"]
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['rendezvous']}", rank=rank, world_size=WORLD
    )
    torch.manual_seed(0)
    device = torch.device(spec.get("device", "cpu"))
    if device.type == "cuda":  # both ranks may share one GPU: gloo does not mind
        device = torch.device("cuda", rank % torch.cuda.device_count())
        model = DistributedDataParallel(Branches().to(device), device_ids=[device],
                                        bucket_cap_mb=BUCKET_CAP_MB)  # fmt: skip
    else:
        model = DistributedDataParallel(Branches(), bucket_cap_mb=BUCKET_CAP_MB)
    fabric = ShardedAllreduce(
        [
            AllreduceClient(
                tuple(a), job=1, rank=rank, workers=WORLD, k=K, pool_size=POOL,
                result_format=spec["result"], seed=rank,
            )
            for a in spec["aggregators"]
        ]
    )
    staging = BucketStaging(HostCopier()) if spec.get("staging") == "host" else BucketStaging()
    state = VerifyingState(InaHookState(fabric, staging=staging))
    model.register_comm_hook(state, verifying_hook)
    generator = torch.Generator().manual_seed(100 + rank)

    def sample(*shape: int) -> torch.Tensor:
        if spec["gradients"] == "gaussian":
            return torch.randn(*shape, generator=generator)
        signs = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        return signs * 2.0 ** -torch.randint(0, 8, shape, generator=generator).float()

    iterations = []
    for _ in range(ITERATIONS):
        # Batch of one: d(loss)/dW = c x^T and d(loss)/db = c, products of powers of two.
        inputs = [sample(1, i).to(device) for i, _ in BRANCHES]
        weights = [sample(1, o).to(device) for _, o in BRANCHES]
        model.zero_grad()
        model(inputs, weights).backward()
        iterations.append(list(state.records))
        state.records.clear()
    # Every bucket index kept one staging buffer (when staged), of its rebuilt bucket's size.
    staged = {i: s.host.numel() for i, s in state.ina.staging.slots.items()}
    assert not staged or staged == {r["bucket"]: r["elements"] for r in iterations[-1]}, staged
    state.ina.close()  # the communication thread ends before the fabric and the process group
    fabric.close()
    del model  # DDP before the process group, while Python is alive (training.release_ddp)
    release_ddp()
    Path(spec["out"]).write_text(json.dumps(iterations))


if __name__ == "__main__":
    rank_main(json.loads(sys.argv[1]))

