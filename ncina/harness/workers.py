"""Worker processes of a timed all-reduce (``ncina bench allreduce``, ``bench fabric``): the
parent's side, :func:`run_workers`, and the worker's, ``python -m ncina.harness.workers SPEC
RANK``, which runs rank ``RANK`` of the run described by the JSON file ``SPEC`` in one of two
modes:

- ``ina``: one ``AllreduceClient`` through the aggregator at ``spec["aggregator"]``, or in a
  leaf-spine tree (``spec["leaf_workers"]`` W) through leaf ``RANK // W`` of ``spec["leaves"]``
  as its worker ``RANK % W`` (the job's total is ``spec["workers"]``);
- ``gloo``: ``torch.distributed`` with the gloo backend (ring all-reduce of float32), rendezvous
  at ``spec["master"]``, on the interface ``spec["ifaces"][RANK]`` (``GLOO_SOCKET_IFNAME``).

Both do the same steps, so the two timings compare like with like: build the input
(``ncina.harness.reference.worker_input``), rendezvous and warm up with an all-reduce of one
element (the aggregator learns the worker's address; gloo connects its pairs; the INA client
reserves its buffers for the timed size, ``AllreduceClient.reserve``), write
``ready-RANK`` into the spec's directory, wait for the ``go`` file, which holds a
``CLOCK_MONOTONIC`` instant shared by every process of the machine (network namespaces share the
clock), start at that instant, time the all-reduce call alone, and write ``report-RANK.json``:
start and end instants, CPU time, the client's counters, a digest of the result, the peak
resident set size, or the error. Rank 0 also saves its result when ``spec["result_path"]`` names
a file (the benchmark checks it against the reference model).

The parent starts the processes through a ``Launch`` (``local_launch`` here, a Mininet host's
for ``bench fabric``), writes the go file once all are ready and stops every process by its PID
before :func:`run_workers` returns or raises.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.common import cpu
from ncina.harness.reference import WARMUP, client_seed, worker_input
from ncina.proto.job import JobSpec

T = TypeVar("T")

GO = "go"
POLL = 0.002  # seconds between looks for the go file
START_TIMEOUT = 60.0  # seconds for an aggregator or the workers to get ready
GO_DELAY = 0.1  # seconds from the go file to the common start instant



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


def timed(call: Callable[[], T]) -> tuple[dict[str, Any], T]:
    """Run ``call``: its start and end instants (``CLOCK_MONOTONIC``), this process's CPU time
    over it, and the machine's CPU counters just before and just after (``machine_at``:
    ``ncina.common.cpu.snapshot``; the bench takes the CPU no process was charged over the
    ranks' common window from them, not over their start-up, when other work on the machine
    would count too); and its result."""
    machine = cpu.snapshot()
    spent, began = time.process_time(), time.monotonic()
    result = call()
    ended, spent = time.monotonic(), time.process_time() - spent
    machine_at = [machine, cpu.snapshot()]
    return {"began": began, "ended": ended, "cpu": spent, "machine_at": machine_at}, result


def job_of(spec: dict[str, Any]) -> JobSpec:
    """The job of a worker spec: its ``job_args``, the options ``JobSpec.to_args`` wrote."""
    parser = argparse.ArgumentParser(prog="ncina.harness.workers", add_help=False)
    JobSpec.add_arguments(parser)
    return JobSpec.from_args(parser.parse_args(spec["job_args"]))


def run_ina(spec: dict[str, Any], rank: int, x: np.ndarray, directory: Path) -> dict[str, Any]:
    """Warm up, wait for the go instant, time one ``AllreduceClient.allreduce``."""
    from ncina.worker.client import AllreduceClient

    host, port = spec["aggregator"]
    local_rank = rank
    if spec.get("leaf_workers"):  # leaf-spine: the rank's leaf, as one of its W workers
        width = spec["leaf_workers"]
        host, port = spec["leaves"][rank // width]
        local_rank = rank % width
    with AllreduceClient.for_job(
        (host, port), job_of(spec), rank=local_rank, seed=client_seed(spec["seed"], rank),
        timeout=spec["timeout"], deadline=spec["deadline"],
    ) as client:  # fmt: skip
        client.allreduce(WARMUP)
        client.reserve(x.size)  # the buffers a training step's calls reuse
        before = client.stats
        ready_path(directory, rank).touch()
        wait_for_go(directory, time.monotonic() + spec["start_timeout"])
        # In place, as gloo's all_reduce (run_gloo) and the DDP hook's reused buffers: a new
        # 40 MB output would have the kernel zero its pages inside the timed call.
        timing, y = timed(lambda: client.allreduce(x, out=x))
        after = client.stats
    # The counters of the timed call alone (rates and gauges as they are at its end).
    stats = {key: value - before[key] if key in before and not key.endswith("_s") else value
             for key, value in after.items()}  # fmt: skip
    return {**timing, "stats": stats, "y": y}


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
        timing, _ = timed(lambda: dist.all_reduce(tensor))
    finally:
        dist.destroy_process_group()
    return {**timing, "stats": {}, "y": x}


Launch = Callable[[int, list[str], Path], "subprocess.Popen[bytes]"]
"""Starts a worker process: its rank, command line and log file (stdout and stderr)."""


class Workers(NamedTuple):
    """What :func:`run_workers` returns: the reports in rank order, and what its ``probe``
    returned just before the go signal and just after the last worker exited."""

    reports: list[dict[str, Any]]
    before: Any
    after: Any


def local_launch(rank: int, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a worker process in this namespace (any rank)."""
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def run_workers(
    spec: dict[str, Any], directory: Path, launch: Launch, deadline: float,
    probe: Callable[[], Any] = lambda: None,
) -> Workers:  # fmt: skip
    """Run one all-reduce: start ``spec["workers"]`` worker processes with ``launch``, wait
    until all are warmed up, give them a common start instant, and return their reports.
    ``probe`` (e.g. interface counters) is called just before the go signal and after the
    last exit. Raises ``RuntimeError`` naming the first rank that failed, or when the
    all-reduce takes longer than ``deadline`` seconds; every process started here is stopped
    by its PID before this returns."""
    directory.mkdir(parents=True, exist_ok=True)
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps({**spec, "time_limit": deadline}))
    workers = spec["workers"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(workers):
            argv = [sys.executable, "-m", "ncina.harness.workers", str(spec_path), str(rank)]
            procs.append(launch(rank, argv, directory / f"worker-{rank}.log"))
        limit = time.monotonic() + START_TIMEOUT
        while not all(ready_path(directory, r).exists() for r in range(workers)):
            _check_alive(procs, directory)
            if time.monotonic() > limit:
                raise RuntimeError(f"workers not ready within {START_TIMEOUT:g} s ({directory})")
            time.sleep(0.01)
        before = probe()
        go = directory / f"{GO}.tmp"
        go.write_text(repr(time.monotonic() + GO_DELAY))
        go.replace(directory / GO)
        limit = time.monotonic() + GO_DELAY + deadline
        while any(p.poll() is None for p in procs):
            _check_alive(procs, directory)
            if time.monotonic() > limit:
                raise RuntimeError(f"the all-reduce took longer than {deadline:g} s ({directory})")
            time.sleep(0.01)
        _check_alive(procs, directory)
        after = probe()
    finally:
        for proc in procs:
            aggproc.stop(proc, grace=5.0)
    reports = [json.loads(report_path(directory, r).read_text()) for r in range(workers)]
    return Workers(reports, before, after)


def _check_alive(procs: Sequence[subprocess.Popen[bytes]], directory: Path) -> None:
    """Raise for the first worker that exited with an error, with its reason."""
    for rank, proc in enumerate(procs):
        if proc.poll() not in (None, 0):
            try:
                reason = json.loads(report_path(directory, rank).read_text())["error"]
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                reason = aggproc.tail(directory / f"worker-{rank}.log")
            raise RuntimeError(f"worker {rank} exited with status {proc.returncode}: {reason}")


def wall_time(reports: Sequence[dict[str, Any]]) -> float:
    """The all-reduce's wall time: from the earliest start to the latest end."""
    return max(r["ended"] for r in reports) - min(r["began"] for r in reports)


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
