"""``ncina bench reliability``: all-reduce through an aggregator that loses, duplicates and
reorders packets, against a lossless run of the same inputs in the same session; then the
faults: a worker killed mid-allreduce, and the aggregator restarted mid-allreduce.

Each scenario starts a Python aggregator with its seeded fault knobs (``--drop-up`` ...), runs
the workers as threads of this process (one ``AllreduceClient`` each, the same inputs and seeds
in every scenario), and reports whether the result is bit-identical to the lossless run's, the
completion time as a ratio to the lossless run's, the retransmissions and the faults counted.
With ``--result int`` (exact sums, the default) "identical" is the guarantee under test; with
``nc8`` the aggregator's re-compression keys follow completion order, which loss changes, so
only the lossless run itself is expected to match (docs/reliability.md).

In the fault scenarios nothing may return a wrong or partial result: a killed worker makes the
others raise ``TimeoutError`` naming its rank after their deadline, a restarted aggregator makes
every worker still in the call raise ``AggregatorRestartedError`` at once.

Then several jobs at once on one aggregator (2 and 4, each its own workers, K, pool and its
own file in ``--jobs-dir``): each job's result must be bit-identical to the same job alone.
Last, ``--fuzz-packets`` hostile datagrams from a stranger during a job
(``ncina.bench.fuzzing``): exact results, every datagram one counted drop, flat memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.aggregator.jobs import JobConfig
from ncina.bench.fuzzing import fuzz_during_allreduce, hostile_datagrams
from ncina.progress import progress
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
    stats_path = workdir / "stats.json"
    arguments = [
        "--backend", "python", "--listen", "127.0.0.1:0", "--job", str(JOB),
        "--workers", str(workers), "--k", str(k), "--result", result, "--seed", "3",
        "--stats", str(stats_path), "--fault-seed", str(fault_seed),
    ]  # fmt: skip
    for name, p in faults.items():
        arguments += [f"--{name.replace('_', '-')}", str(p)]
    proc, address = aggproc.start(arguments, workdir / "aggregator.log")

    def worker(rank: int) -> tuple[np.ndarray, dict[str, int], float, float]:
        with AllreduceClient(
            address, job=JOB, rank=rank, workers=workers, k=k, result_format=result,
            seed=100 + rank, timeout=timeout, max_timeout=max_timeout, deadline=deadline,
        ) as client:  # fmt: skip
            began = time.monotonic()
            out = client.allreduce(inputs[rank], op="sum")
            return out, client.stats, began, time.monotonic()

    try:
        with ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(worker, range(workers)))
        document = aggproc.request_stats(proc, stats_path)
    finally:
        aggproc.stop(proc)
    seconds = max(d[3] for d in done) - min(d[2] for d in done)
    return Run([d[0] for d in done], [d[1] for d in done], document, seconds)


# Concurrent jobs: (job id, workers, K, pool size); the first is the job of the flags. Results
# are int, so that a job alone and among others must give the same bits.
JOBS = ((JOB, 4, 128, 64), (22, 2, 64, 32), (23, 3, 100, 48), (24, 2, 182, 16))


@dataclass
class JobsRun:
    """What several jobs all-reducing at once on one aggregator gave."""

    outputs: dict[int, list[np.ndarray]]  # per job, per rank
    seconds: float  # from the first worker's start to the last worker's end
    retransmissions: int  # over every worker of every job


def allreduce_jobs(jobs: Sequence[tuple[int, int, int, int]], elements: int, workdir: Path,
                   seed: int) -> JobsRun:  # fmt: skip
    """All-reduce ``elements`` per worker in every job of ``jobs`` at the same time on one Python
    aggregator (the first job from its flags, the others from ``--jobs-dir``); worker ``r`` of
    job ``j`` is seeded ``100 * j + r`` and its input drawn from ``(seed, j, r)``."""
    jobs_dir = workdir / "jobs"
    jobs_dir.mkdir()
    first, *others = jobs
    for job, workers, k, pool in others:
        (jobs_dir / f"{job}.json").write_text(json.dumps(
            {"job": job, "workers": workers, "k": k, "result_format": "int", "pool_size": pool}
        ))  # fmt: skip
    job, workers, k, pool = first
    stats_path = workdir / "stats.json"
    proc, address = aggproc.start([
        "--backend", "python", "--listen", "127.0.0.1:0", "--job", str(job), "--workers",
        str(workers), "--k", str(k), "--result", "int", "--pool-size", str(pool), "--stats",
        str(stats_path), "--jobs-dir", str(jobs_dir),
    ], workdir / "aggregator.log")  # fmt: skip
    try:
        wanted = {str(j[0]) for j in jobs}
        while not wanted <= set(aggproc.request_stats(proc, stats_path)["jobs"]):
            time.sleep(0.05)  # the directory is read every 0.2 s

        def worker(spec: tuple[int, int, int, int], rank: int) -> tuple[Any, ...]:
            job, workers, k, pool = spec
            x = np.random.default_rng((seed, job, rank)).standard_normal(elements)
            with AllreduceClient(address, job=job, rank=rank, workers=workers, k=k,
                                 pool_size=pool, result_format="int", seed=100 * job + rank,
                                 timeout=0.02, max_timeout=0.2) as client:  # fmt: skip
                began = time.monotonic()
                out = client.allreduce(x.astype(np.float32), op="sum")
                return job, rank, out, client.stats["retransmissions"], began, time.monotonic()

        tasks = [(spec, rank) for spec in jobs for rank in range(spec[1])]
        with ThreadPoolExecutor(len(tasks)) as pool_:
            done = list(pool_.map(lambda t: worker(*t), tasks))
    finally:
        aggproc.stop(proc)
    outputs: dict[int, list[np.ndarray]] = {j[0]: [] for j in jobs}
    for job, _, out, *_ in done:
        outputs[job].append(out)
    return JobsRun(outputs, max(d[5] for d in done) - min(d[4] for d in done),
                   sum(d[3] for d in done))  # fmt: skip


def fuzz_row(workdir: Path, packets: int, elements: int) -> dict[str, Any]:
    """The hostile-input row: ``packets`` datagrams of ``hostile_datagrams`` during a job of
    three configured members on a Python aggregator."""
    workers, k, pool = 3, 128, 64
    ports = [aggproc.free_udp_port() for _ in range(workers)]
    stats_path = workdir / "stats.json"
    proc, address = aggproc.start([
        "--backend", "python", "--listen", "127.0.0.1:0", "--job", str(JOB), "--workers",
        str(workers), "--k", str(k), "--result", "int", "--pool-size", str(pool), "--stats",
        str(stats_path), *(f"--member={r}=127.0.0.1:{p}" for r, p in enumerate(ports)),
    ], workdir / "aggregator.log")  # fmt: skip
    try:
        emin = JobConfig.create(job=JOB, workers=workers, k=k, result_format="int").window.e_min
        datagrams = hostile_datagrams(packets, seed=7, job=JOB, workers=workers, k=k, emin=emin,
                                      pool_size=pool)  # fmt: skip
        report = fuzz_during_allreduce(
            address, "127.0.0.1", ports, lambda: aggproc.request_stats(proc, stats_path),
            proc.pid, lambda send: [send(d) for d in datagrams], job=JOB, k=k, pool_size=pool,
            elements=elements,
        )
        alive = proc.poll() is None
    finally:
        code = aggproc.stop(proc)
    return {
        "scenario": f"{report.sent:,} fuzzed datagrams during a job",
        "elements": elements,
        "exact": report.exact,
        "seconds": round(report.seconds, 3),
        "crashes": int(not alive or code != 0),
        "every_datagram_one_drop": report.dropped == report.sent and report.accepted == 0,
        "drops": report.drops,
        "rss_kib_before_after": list(report.rss_kib),
    }


@dataclass
class FaultRun:
    """How each rank's all-reduce ended when a worker or the aggregator died during it."""

    outcomes: list[np.ndarray | BaseException | None]  # result, exception, or None (killed)
    seconds: float  # from the first worker's start until the last surviving worker returned
    retransmissions: int  # summed over the surviving workers
    killed_at: int  # slots the aggregator had completed when the process was killed


def _job_counter(proc: subprocess.Popen[bytes], stats_path: Path, name: str) -> int:
    document = aggproc.request_stats(proc, stats_path)
    return document["jobs"][str(JOB)][name]


def _chunks_completed(proc: subprocess.Popen[bytes], stats_path: Path) -> int:
    return _job_counter(proc, stats_path, "slots_completed")


def _await_handshake(child: subprocess.Popen[bytes], aggregator: subprocess.Popen[bytes],
                     stats_path: Path) -> None:  # fmt: skip
    """Wait until the aggregator has answered ``child``'s hello (the job's first), so that the
    threads started next do not wait out their deadline for a process still importing."""
    while _job_counter(aggregator, stats_path, "handshakes") < 1:
        if child.poll() is not None:
            raise RuntimeError(f"the worker process exited ({child.returncode}) before its hello")
        time.sleep(0.005)


def _kill_when(proc: subprocess.Popen[bytes], aggregator: subprocess.Popen[bytes],
               stats_path: Path, completed: int) -> int:  # fmt: skip
    """SIGKILL ``proc`` (by PID) once the aggregator has completed ``completed`` slots; return
    the number it had then."""
    while (done := _chunks_completed(aggregator, stats_path)) < completed:
        if proc.poll() is not None:
            raise RuntimeError(f"the process to kill exited ({proc.returncode}) after {done} "
                               f"of the {completed} slots it was to see completed")
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    return done


def _survivors(inputs: list[np.ndarray], address: tuple[str, int], ranks: range, *, k: int,
               result: str, deadline: float, pool: ThreadPoolExecutor) -> list[Any]:  # fmt: skip
    """Start worker threads for ``ranks``; each future gives (result or exception, stats, end)."""
    def worker(rank: int) -> tuple[np.ndarray | BaseException, dict[str, Any], float]:
        with AllreduceClient(
            address, job=JOB, rank=rank, workers=len(inputs), k=k, result_format=result,
            seed=100 + rank, timeout=0.02, max_timeout=0.2, deadline=deadline,
        ) as client:  # fmt: skip
            try:
                out: np.ndarray | BaseException = client.allreduce(inputs[rank], op="sum")
            except (TimeoutError, AggregatorRestartedError) as exc:
                out = exc
            return out, client.stats, time.monotonic()

    return [pool.submit(worker, rank) for rank in ranks]


def _fault_run(futures: list[Any], began: float, killed_at: int,
               killed: list[None]) -> FaultRun:  # fmt: skip
    done = [f.result() for f in futures]
    return FaultRun(
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
    stats_path = workdir / "stats.json"
    proc, address = aggproc.start([
        "--listen", "127.0.0.1:0", "--job", str(JOB), "--workers", str(workers), "--k", str(k),
        "--result", result, "--stats", str(stats_path),
    ], workdir / "aggregator.log")  # fmt: skip
    np.save(workdir / "x.npy", inputs[-1])
    try:
        with ThreadPoolExecutor(workers - 1) as pool:
            # The process first: its start (imports) may take longer than the threads' deadline.
            child = subprocess.Popen([
                sys.executable, "-m", "ncina.cli", "allreduce", "--aggregator",
                f"{address[0]}:{address[1]}", "--job", str(JOB), "--rank", str(workers - 1),
                "--workers", str(workers), "--k", str(k), "--result", result,
                "--input", str(workdir / "x.npy"), "--output", str(workdir / "y.npy"),
            ], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL)  # fmt: skip
            try:
                _await_handshake(child, proc, stats_path)
                began = time.monotonic()
                futures = _survivors(inputs, address, range(workers - 1), k=k, result=result,
                                     deadline=deadline, pool=pool)  # fmt: skip
                killed_at = _kill_when(child, proc, stats_path, at)
            finally:
                child.kill()
                child.wait()
            return _fault_run(futures, began, killed_at, [None])
    finally:
        aggproc.stop(proc)


def allreduce_across_restart(inputs: list[np.ndarray], workdir: Path, *, k: int, result: str,
                             deadline: float, at: int) -> FaultRun:  # fmt: skip
    """Every rank is a thread; the aggregator (generation 1) is SIGKILLed once it has completed
    ``at`` slots and started again on the same port as generation 2."""
    workers = len(inputs)
    stats_path = workdir / "stats.json"
    arguments = ["--job", str(JOB), "--workers", str(workers), "--k", str(k), "--result", result,
                 "--stats", str(stats_path)]  # fmt: skip
    proc, address = aggproc.start(
        ["--listen", "127.0.0.1:0", "--generation", "1", *arguments], workdir / "first.log"
    )
    try:
        with ThreadPoolExecutor(workers) as pool:
            began = time.monotonic()
            futures = _survivors(inputs, address, range(workers), k=k, result=result,
                                 deadline=deadline, pool=pool)  # fmt: skip
            killed_at = _kill_when(proc, proc, stats_path, at)
            listen = f"{address[0]}:{address[1]}"
            proc, _ = aggproc.start(
                ["--listen", listen, "--generation", "2", *arguments], workdir / "second.log"
            )
            return _fault_run(futures, began, killed_at, [])
    finally:
        aggproc.stop(proc)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench reliability``."""
    p = subparsers.add_parser(
        "reliability",
        help="all-reduce under emulated loss, duplication and reordering vs a lossless run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=4, help="default: %(default)s")
    p.add_argument("--elements", type=int, default=1_000_000, help="default: %(default)s")
    p.add_argument("--k", type=int, default=128,
                   help="elements per packet (int results: at most 182 at MTU 1500)")  # fmt: skip
    p.add_argument("--result", choices=("int", "nc8"), default="int", help="default: int")
    p.add_argument("--seed", type=int, default=42, help="input seed")
    p.add_argument("--deadline", type=float, default=2.0,
                   help="the workers' deadline in the killed-worker scenario (s)")  # fmt: skip
    p.add_argument("--fuzz-packets", type=int, default=100_000, metavar="N",
                   help="hostile datagrams thrown during a job (default: %(default)s)")  # fmt: skip
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario once, in one session; returns the table rows."""
    rng = np.random.default_rng(args.seed)
    inputs = [rng.standard_normal(args.elements).astype(np.float32) for _ in range(args.workers)]
    rows = []
    baseline: Run | None = None
    with tempfile.TemporaryDirectory(prefix="ncina-bench-reliability-") as tmp:
        scenarios = progress(SCENARIOS.items(), desc="bench reliability", unit="scenario")
        for i, (name, faults) in enumerate(scenarios):
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            got = allreduce_with_faults(inputs, workdir, k=args.k, result=args.result,
                                        faults=faults)  # fmt: skip
            baseline = baseline or got
            job = got.aggregator["jobs"][str(JOB)]
            rows.append({
                "scenario": name,
                "elements": args.elements,
                "exact": all(np.array_equal(o, baseline.outputs[0]) for o in got.outputs),
                "seconds": round(got.seconds, 3),
                "time_vs_lossless": round(got.seconds / baseline.seconds, 2),
                "retransmissions": sum(c["retransmissions"] for c in got.clients),
                "slots_completed": job["slots_completed"],
                "faults": got.aggregator.get("faults", {}),
            })  # fmt: skip
        assert baseline is not None
        chunks = -(-args.elements // args.k)
        for name, scenario in (("one worker killed", allreduce_with_dead_worker),
                               ("aggregator restarted", allreduce_across_restart)):  # fmt: skip
            workdir = Path(tmp) / name.replace(" ", "-")
            workdir.mkdir()
            fault = scenario(inputs, workdir, k=args.k, result=args.result,
                             deadline=args.deadline, at=chunks // 4)  # fmt: skip
            rows.append(_fault_row(name, args.elements, fault, baseline.seconds, chunks))
        alone = {}
        for spec in JOBS:
            workdir = Path(tmp) / f"alone-{spec[0]}"
            workdir.mkdir()
            alone[spec[0]] = allreduce_jobs([spec], args.elements, workdir, args.seed)
        for count in (2, 4):
            workdir = Path(tmp) / f"jobs-{count}"
            workdir.mkdir()
            together = allreduce_jobs(JOBS[:count], args.elements, workdir, args.seed)
            exact = all(
                np.array_equal(out, alone[job].outputs[job][0])
                for job, outs in together.outputs.items() for out in outs
            )  # fmt: skip
            rows.append({
                "scenario": f"{count} concurrent jobs",
                "elements": args.elements * count,
                "exact": exact,
                "seconds": round(together.seconds, 3),
                "time_vs_lossless": round(together.seconds / baseline.seconds, 2),
                "time_vs_alone_summed": round(
                    together.seconds / sum(alone[j[0]].seconds for j in JOBS[:count]), 2),
                "retransmissions": together.retransmissions,
                "jobs": [{"job": j, "workers": n, "k": k, "pool": s}
                         for j, n, k, s in JOBS[:count]],
            })  # fmt: skip
        if args.fuzz_packets:
            workdir = Path(tmp) / "fuzz"
            workdir.mkdir()
            rows.append(fuzz_row(workdir, args.fuzz_packets, args.elements // 10))
    return {"workers": args.workers, "k": args.k, "result": args.result, "rows": rows}


def _fault_row(name: str, elements: int, run: FaultRun, lossless: float,
               chunks: int) -> dict[str, Any]:  # fmt: skip
    """A table row for a fault scenario: how every surviving worker's call ended."""
    errors = {type(o).__name__ for o in run.outcomes if isinstance(o, BaseException)}
    returned = sum(isinstance(o, np.ndarray) for o in run.outcomes)
    return {
        "scenario": name,
        "elements": elements,
        "exact": f"no result: {', '.join(sorted(errors))} in every survivor" if not returned
        else f"{returned} rank(s) returned",
        "seconds": round(run.seconds, 3),
        "time_vs_lossless": round(run.seconds / lossless, 2),
        "retransmissions": run.retransmissions,
        "killed_at_slot": f"{run.killed_at}/{chunks}",
        "errors": [str(o) for o in run.outcomes if isinstance(o, BaseException)][:1],
    }
