"""PyTorch DDP communication hook that all-reduces gradient buckets through the INA fabric.

``model.register_comm_hook(InaHookState(fabric), ina_hook)`` makes every gradient bucket of a
``DistributedDataParallel`` model go through the aggregator(s) instead of gloo: the bucket's
flattened buffer is NC8-encoded, summed in the switch, decoded, averaged, copied back into the
buffer, and the buffer is returned in an already completed future (the fabric call blocks, so there
is nothing to overlap). DDP copies the returned tensor into the parameters' ``.grad``.

DDP calls the hook for buckets in index order on every rank, and rebuilds its buckets once after the
first iteration (in gradient-ready order, the same on every rank); the hook keeps no per-bucket
state, so the rebuilt buckets need nothing special: every rank sends the same sequence of tensors
and the fabric's slot sequence stays in step.

:func:`verifying_hook` wraps the hook for tests and ``ncina train --verify``: it also all-reduces
the raw bucket with gloo and records how far the fabric's mean is from the exact one, against the
error bounds of natural compression.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects, not strings.
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ncina.worker.sharding import ShardedAllreduce

from ncina.bench.allreduce import nc_error_model

# Relative slack for float32 rounding of the decoded mean (decode, divide by N).
FLOAT_SLACK = 2.0**-20


@dataclass
class InaHookState:
    """The hook's state: the fabric every bucket goes through."""

    fabric: ShardedAllreduce


def ina_hook(state: InaHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Replace the bucket's gradients with their mean over the workers, through the fabric."""
    buffer = bucket.buffer()
    if buffer.dtype != torch.float32:
        raise TypeError(f"the INA hook handles float32 gradients, bucket has {buffer.dtype}")
    mean = state.fabric.allreduce(buffer.detach().numpy())
    buffer.copy_(torch.from_numpy(mean))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


@dataclass
class VerifyingState:
    """State of :func:`verifying_hook`: the INA state and one record per hook call."""

    ina: InaHookState
    records: list[dict[str, Any]] = field(default_factory=list)


def verifying_hook(
    state: VerifyingState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """:func:`ina_hook`, plus gloo collectives on the same bucket to compare against.

    Appends to ``state.records``: the bucket's index and size; ``max_abs_error``, the largest
    difference between the fabric's mean and gloo's fp32 all-reduce (divided by N);
    ``worst_ratio``, the largest error (against the exact float64 mean of the gathered inputs)
    over its hard per-element bound; ``variance_ratio``, the squared error over the bound on its
    expectation. The bounds are :func:`ncina.bench.allreduce.nc_error_model`'s, plus what values
    below the job's window can add (less than ``2**e_min`` per worker and rounding, which that
    model leaves out). ``worst_ratio <= 1`` always holds; ``variance_ratio`` is about 1 or less.
    """
    workers = dist.get_world_size()
    client = state.ina.fabric.clients[0]
    x = bucket.buffer().detach().clone()
    gathered = [torch.empty_like(x) for _ in range(workers)]
    dist.all_gather(gathered, x)
    dist.all_reduce(x)
    x /= workers
    future = ina_hook(state.ina, bucket)
    got = future.value()
    inputs = torch.stack(gathered).numpy()
    model = nc_error_model(inputs, client.result_format)
    floor = 2.0**client.window.e_min
    mean = got.double().numpy()
    error = np.abs(mean - inputs.astype(np.float64).mean(axis=0))
    worst = model["max_error"] + 2.0 * floor + FLOAT_SLACK * np.abs(mean)
    variance = model["var_high"] + floor**2 / workers
    state.records.append(
        {
            "bucket": bucket.index(),
            "elements": int(x.numel()),
            "max_abs_error": float((got - x).abs().max()),
            "worst_ratio": float((error / worst).max()),
            "variance_ratio": float((error**2).sum() / variance.sum()),
        }
    )
    return future
