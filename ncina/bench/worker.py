"""One worker process of the all-reduce benchmarks (``bench allreduce``, ``bench fabric``).

``python -m ncina.bench.worker SPEC RANK`` runs rank ``RANK`` of the run described by the JSON
file ``SPEC``, in one of two modes:

- ``ina``: one ``AllreduceClient`` through the aggregator at ``spec["aggregator"]``;
- ``gloo``: ``torch.distributed`` with the gloo backend (ring all-reduce of float32), rendezvous
  at ``spec["master"]``, on the interface ``spec["ifaces"][RANK]`` (``GLOO_SOCKET_IFNAME``).

Both do the same steps, so the two timings compare like with like: build the input
(:func:`worker_input`), rendezvous and warm up with an all-reduce of one element (the aggregator
learns the worker's address; gloo connects its pairs), write ``ready-RANK`` into the spec's
directory, wait for the ``go`` file, which holds a ``CLOCK_MONOTONIC`` instant shared by every
process of the machine (network namespaces share the clock), start at that instant, time the
all-reduce call alone, and write ``report-RANK.json``: start and end instants, CPU time, the
client's counters, a digest of the result, the peak resident set size, or the error. Rank 0
also saves its result when ``spec["result_path"]`` names a file (the bench checks it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

GO = "go"
POLL = 0.002  # seconds between looks for the go file
WARMUP = np.zeros(1, dtype=np.float32)
"""The warm-up all-reduce's tensor; its NC8 encoding draws the first key of a client's stream."""


def worker_input(seed: int, rank: int, elements: int) -> np.ndarray:
    """The tensor rank ``rank`` all-reduces: standard normal float32, seeded by (seed, rank)."""
    return np.random.default_rng([seed, rank]).standard_normal(elements, dtype=np.float32)


def client_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s ``AllreduceClient`` (its NC8 rounding stream)."""
    return seed * 1000 + rank


def ready_path(directory: Path, rank: int) -> Path:
    """The file rank ``rank`` writes once it is warmed up."""
    return directory / f"ready-{rank}"


def report_path(directory: Path, rank: int) -> Path:
    """The file rank ``rank`` writes its report to."""
    return directory / f"report-{rank}.json"


def wait_for_go(directory: Path, deadline: float) -> None:
    """Wait for the go file, then until the instant written in it."""
    go = directory / GO
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no go signal")
        time.sleep(POLL)
    start = float(go.read_text())
    while (left := start - time.monotonic()) > 0:
        time.sleep(min(left, POLL))


def peak_rss() -> int:
    """This process's peak resident set size in bytes (``VmHWM``). Not ``getrusage``'s
    ``ru_maxrss``: Linux carries that across ``execve``, so a child would report its parent's
    peak when the parent's was higher."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_ina(spec: dict[str, Any], rank: int, x: np.ndarray, directory: Path) -> dict[str, Any]:
    """Warm up, wait for the go instant, time one ``AllreduceClient.allreduce``."""
    from ncina.worker.client import AllreduceClient

    host, port = spec["aggregator"]
    with AllreduceClient(
        (host, port), job=spec["job"], rank=rank, workers=spec["workers"], k=spec["k"],
        pool_size=spec["pool_size"], window_max=spec["window_max"],
        result_format=spec["result"], seed=client_seed(spec["seed"], rank),
        timeout=spec["timeout"], deadline=spec["deadline"], mtu=spec["mtu"],
    ) as client:  # fmt: skip
        client.allreduce(WARMUP)
        before = client.stats
        ready_path(directory, rank).touch()
        wait_for_go(directory, time.monotonic() + spec["start_timeout"])
        cpu, began = time.process_time(), time.monotonic()
        y = client.allreduce(x)
        ended, cpu = time.monotonic(), time.process_time() - cpu
        after = client.stats
    # The counters of the timed call alone (rates and gauges as they are at its end).
    stats = {key: value - before[key] if key in before and not key.endswith("_s") else value
             for key, value in after.items()}  # fmt: skip
    return {"began": began, "ended": ended, "cpu": cpu, "stats": stats, "y": y}


def run_gloo(spec: dict[str, Any], rank: int, x: np.ndarray, directory: Path) -> dict[str, Any]:
    """Join a gloo process group, warm up, wait for the go instant, time one ``all_reduce``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if spec.get("ifaces"):
        os.environ["GLOO_SOCKET_IFNAME"] = spec["ifaces"][rank]
    torch.set_num_threads(1)  # the ranks share the machine's cores
    host, port = spec["master"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=spec["workers"],
        # gloo's timeout covers every collective: the timed one may take the bench's time limit
        timeout=timedelta(seconds=max(spec["start_timeout"], spec["time_limit"])),
    )
    try:
        dist.all_reduce(torch.from_numpy(WARMUP.copy()))
        tensor = torch.from_numpy(x)
        ready_path(directory, rank).touch()
        wait_for_go(directory, time.monotonic() + spec["start_timeout"])
        cpu, began = time.process_time(), time.monotonic()
        dist.all_reduce(tensor)
        ended, cpu = time.monotonic(), time.process_time() - cpu
    finally:
        dist.destroy_process_group()
    return {"began": began, "ended": ended, "cpu": cpu, "stats": {}, "y": x}


def main(argv: list[str]) -> int:
    """Run one rank (``argv``: SPEC RANK) and write its report; 1 on error (in the report)."""
    spec_path, rank = Path(argv[0]), int(argv[1])
    spec = json.loads(spec_path.read_text())
    directory = spec_path.parent
    try:
        x = worker_input(spec["seed"], rank, spec["elements"])
        run = run_ina if spec["mode"] == "ina" else run_gloo
        out = run(spec, rank, x, directory)
        y = out.pop("y")
        if rank == 0 and spec.get("result_path"):
            np.save(spec["result_path"], y)
        # Hash the array's own buffer: tobytes() would copy it and inflate peak_rss by a tensor.
        out["digest"] = hashlib.blake2b(np.ascontiguousarray(y).data, digest_size=16).hexdigest()
        out["peak_rss"] = peak_rss()
        status = 0
    except Exception as exc:  # the bench reports it with the rank
        out, status = {"error": f"{type(exc).__name__}: {exc}"}, 1
    temporary = report_path(directory, rank).with_suffix(".tmp")
    temporary.write_text(json.dumps(out))
    temporary.replace(report_path(directory, rank))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
