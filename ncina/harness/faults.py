"""All-reduce runs through an aggregator that misbehaves, for ``ncina bench reliability`` and the
tests (tests/test_faults.py, tests/test_failures.py); docs/reliability.md says what each must
give.

- ``allreduce_with_faults``: a Python aggregator with seeded loss, duplication and reordering
  (``ncina aggregator --drop-up ...``, one of ``SCENARIOS``), the workers threads of this
  process; returns their results, counters and the aggregator's stats.
- ``allreduce_with_dead_worker``: the last rank an ``ncina allreduce`` process, SIGKILLed once
  the aggregator has completed a number of slots; the survivors must raise ``TimeoutError``.
- ``allreduce_across_restart``: the aggregator SIGKILLed and started again on the same port
  (generation 2); every worker must raise ``AggregatorRestartedError``.
- ``vs_lossless``: a run's time over the lossless run's, refused when that one retransmitted.

Every process started here is stopped by its PID before a function returns or raises; the
aggregators are ``ncina.harness.aggregators``'s (stats and log in the work directory).
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ncina.common.ratios import put_ratio, refusal
from ncina.harness.aggregators import RunningAggregator, start_aggregator
from ncina.proto.job import JobSpec
from ncina.worker.client import AggregatorRestartedError, AllreduceClient

JOB = 21
SCENARIOS: dict[str, dict[str, float]] = {
    "lossless": {},
    "loss 1% up": {"drop_up": 0.01},
    "loss 5% up": {"drop_up": 0.05},
    "loss 10% up": {"drop_up": 0.10},
    "loss 1% down": {"drop_down": 0.01},
    "loss 5% down": {"drop_down": 0.05},
    "loss 10% down": {"drop_down": 0.10},
    "loss 1% both": {"drop_up": 0.01, "drop_down": 0.01},
    "loss 5% both": {"drop_up": 0.05, "drop_down": 0.05},
    "loss 10% both": {"drop_up": 0.10, "drop_down": 0.10},
    "dup 5% + reorder 5%": {"duplicate": 0.05, "reorder": 0.05},
}


@dataclass
class Run:
    """What one all-reduce through a faulty aggregator gave."""

    outputs: list[np.ndarray]  # per rank
    clients: list[dict[str, int]]  # each client's counters
    aggregator: dict[str, Any]  # the aggregator's stats document at the end
    seconds: float  # from the first worker's start to the last worker's end


def allreduce_with_faults(
    inputs: list[np.ndarray],
    workdir: Path,
    *,
    k: int,
    result: str,
    faults: dict[str, float],
    fault_seed: int = 11,
    timeout: float = 0.02,
    max_timeout: float = 0.2,
    deadline: float = 30.0,
) -> Run:
    """Sum ``inputs`` (one tensor per rank) through a Python aggregator with the given fault
    probabilities (``FaultConfig`` field names); client ``r`` is seeded ``100 + r``."""
    workers = len(inputs)
    spec = JobSpec(job=JOB, workers=workers, k=k, result=result)
    knobs = ["--seed", "3", "--fault-seed", str(fault_seed)]
    for name, p in faults.items():
        knobs += [f"--{name.replace('_', '-')}", str(p)]
    aggregator = start_aggregator("python", workdir, spec=spec, extra=knobs)

    def worker(rank: int) -> tuple[np.ndarray, dict[str, int], float, float]:
        with AllreduceClient.for_job(
            aggregator.address, spec, rank=rank, seed=100 + rank, timeout=timeout,
            max_timeout=max_timeout, deadline=deadline,
        ) as client:  # fmt: skip
            began = time.monotonic()
            out = client.allreduce(inputs[rank], op="sum")
            return out, client.stats, began, time.monotonic()

    try:
        with ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(worker, range(workers)))
        document = aggregator.stats()
    finally:
        aggregator.stop()
    seconds = max(d[3] for d in done) - min(d[2] for d in done)
    return Run([d[0] for d in done], [d[1] for d in done], document, seconds)


@dataclass
class FaultRun:
    """How each rank's all-reduce ended when a worker or the aggregator died during it."""

    outcomes: list[np.ndarray | BaseException | None]  # result, exception, or None (killed)
    seconds: float  # from the first worker's start until the last surviving worker returned
    retransmissions: int  # summed over the surviving workers
    killed_at: int  # slots the aggregator had completed when the process was killed
    # Each surviving worker's return (time.monotonic), and a time before every worker's last
    # progress (kill_when): a deadline after the last progress ends no call before it + deadline.
    ends: list[float] = field(default_factory=list)
    progress_after: float = 0.0
    # From the restarted aggregator's readiness until the last worker returned (None: no
    # restart): the workers' recovery (handshake, agreement, the call redone or served).
    recovery_s: float | None = None


def _job_counter(aggregator: RunningAggregator, name: str) -> int:
    return aggregator.stats()["jobs"][str(JOB)][name]


def _await_handshake(child: subprocess.Popen[bytes], aggregator: RunningAggregator) -> None:
    """Wait until the aggregator has answered ``child``'s hello (the job's first), so that the
    threads started next do not wait out their deadline for a process still importing."""
    while _job_counter(aggregator, "handshakes") < 1:
        if child.poll() is not None:
            raise RuntimeError(f"the worker process exited ({child.returncode}) before its hello")
        time.sleep(0.005)


def kill_when(proc: subprocess.Popen[bytes], aggregator: RunningAggregator,
               completed: int) -> tuple[int, float]:  # fmt: skip
    """SIGKILL ``proc`` (by PID) once the aggregator has completed ``completed`` slots; return
    the number it had then, and a time before which slot ``completed`` was not complete (the
    start of the last read that found fewer; ``time.monotonic``): every worker's last
    progress came after it."""
    unfinished_at = time.monotonic()
    while (done := _job_counter(aggregator, "slots_completed")) < completed:
        if proc.poll() is not None:
            raise RuntimeError(f"the process to kill exited ({proc.returncode}) after {done} "
                               f"of the {completed} slots it was to see completed")
        time.sleep(0.005)
        unfinished_at = time.monotonic()
    proc.kill()
    proc.wait()
    return done, unfinished_at


def _survivors(inputs: list[np.ndarray], address: tuple[str, int], ranks: range, *,
               spec: JobSpec, deadline: float, pool: ThreadPoolExecutor,
               restart_retries: int = 0) -> list[Any]:  # fmt: skip
    """Start worker threads for ``ranks`` of ``spec``; each future gives (result or exception,
    stats, end)."""
    def worker(rank: int) -> tuple[np.ndarray | BaseException, dict[str, Any], float]:
        with AllreduceClient.for_job(
            address, spec, rank=rank, seed=100 + rank, timeout=0.02, max_timeout=0.2,
            deadline=deadline, restart_retries=restart_retries,
        ) as client:  # fmt: skip
            try:
                out: np.ndarray | BaseException = client.allreduce(inputs[rank], op="sum")
            except (TimeoutError, AggregatorRestartedError) as exc:
                out = exc
            return out, client.stats, time.monotonic()

    return [pool.submit(worker, rank) for rank in ranks]


def _fault_run(futures: list[Any], began: float, kill: tuple[int, float], killed: list[None],
               restarted: float | None = None) -> FaultRun:  # fmt: skip
    done = [f.result() for f in futures]
    killed_at, progress_after = kill
    return FaultRun(
        ends=[d[2] for d in done],
        progress_after=progress_after,
        recovery_s=None if restarted is None else max(d[2] for d in done) - restarted,
        outcomes=[d[0] for d in done] + killed,  # type: ignore[operator]
        seconds=max(d[2] for d in done) - began,
        retransmissions=sum(d[1]["retransmissions"] for d in done),
        killed_at=killed_at,
    )


def allreduce_with_dead_worker(inputs: list[np.ndarray], workdir: Path, *, k: int, result: str,
                               deadline: float, at: int) -> FaultRun:  # fmt: skip
    """The last rank is an ``ncina allreduce`` process, SIGKILLed once the aggregator has
    completed ``at`` slots; the other ranks are threads of this process."""
    workers = len(inputs)
    spec = JobSpec(job=JOB, workers=workers, k=k, result=result)
    aggregator = start_aggregator("python", workdir, spec=spec)
    address = aggregator.address
    np.save(workdir / "x.npy", inputs[-1])
    try:
        with ThreadPoolExecutor(workers - 1) as pool:
            # The process first: its start (imports) may take longer than the threads' deadline.
            child = subprocess.Popen([
                sys.executable, "-m", "ncina.cli", "allreduce", "--aggregator",
                f"{address[0]}:{address[1]}", "--rank", str(workers - 1),
                *spec.to_args(role="worker"),
                "--input", str(workdir / "x.npy"), "--output", str(workdir / "y.npy"),
            ], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL)  # fmt: skip
            try:
                _await_handshake(child, aggregator)
                began = time.monotonic()
                futures = _survivors(inputs, address, range(workers - 1), spec=spec,
                                     deadline=deadline, pool=pool)  # fmt: skip
                kill = kill_when(child, aggregator, at)
            finally:
                child.kill()
                child.wait()
            return _fault_run(futures, began, kill, [None])
    finally:
        aggregator.stop()


def allreduce_across_restart(inputs: list[np.ndarray], workdir: Path, *, k: int, result: str,
                             deadline: float, at: int, restart_retries: int = 0,
                             backend: str = "python", generations: tuple[int, int] = (1, 2),
                             ) -> FaultRun:  # fmt: skip
    """Every rank is a thread; the aggregator (``backend``, python or socket, of the first of
    ``generations``) is SIGKILLed once it has completed ``at`` slots and started again on the
    same port, of the second (the same one: a restart that drew the generation again). The
    workers recover from ``restart_retries`` restarts (``AllreduceClient``; 0: the call
    fails)."""
    workers = len(inputs)
    spec = JobSpec(job=JOB, workers=workers, k=k, result=result)
    first, second = (["--generation", str(g)] for g in generations)
    aggregator = start_aggregator(backend, workdir / "first", spec=spec, extra=first)
    address = aggregator.address
    try:
        with ThreadPoolExecutor(workers) as pool:
            began = time.monotonic()
            futures = _survivors(inputs, address, range(workers), spec=spec, deadline=deadline,
                                 pool=pool, restart_retries=restart_retries)  # fmt: skip
            kill = kill_when(aggregator.process, aggregator, at)
            aggregator = start_aggregator(backend, workdir / "second", listen=f"{address[0]}:"
                                          f"{address[1]}", spec=spec, extra=second)
            return _fault_run(futures, began, kill, [], time.monotonic())
    finally:
        aggregator.stop()


def vs_lossless(seconds: float, lossless: Run) -> dict[str, Any]:
    """``time_vs_lossless``: ``seconds`` over the lossless run's, refused (None, and
    ``time_vs_lossless_refused``) when that run retransmitted or took no time: then it was no
    lossless yardstick (``ncina.common.ratios.put_ratio``)."""
    copies = sum(c["retransmissions"] for c in lossless.clients)
    figures: dict[str, Any] = {}
    put_ratio(figures, "time_vs_lossless", seconds, lossless.seconds,
              refusal(lossless.seconds, retransmissions=copies))  # fmt: skip
    return figures
