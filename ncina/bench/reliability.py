"""``ncina bench reliability``: all-reduce through an aggregator that loses, duplicates and
reorders packets, against a lossless run of the same inputs in the same session; then the
faults: a worker killed mid-allreduce, and the aggregator restarted mid-allreduce
(the runs are ``ncina.harness.faults``'s).

Each scenario starts a Python aggregator with its seeded fault knobs (``--drop-up`` ...), runs
the workers as threads of this process (one ``AllreduceClient`` each, the same inputs and seeds
in every scenario), and reports whether the result is bit-identical to the lossless run's, the
completion time as a ratio to the lossless run's, the retransmissions and the faults counted.
With ``--result int`` (exact sums, the default) "identical" is the guarantee under test; with
``nc8`` the aggregator's re-compression keys follow completion order, which loss changes, so
only the lossless run itself is expected to match (docs/reliability.md).

In the fault scenarios nothing may return a wrong or partial result: a killed worker makes the
others raise ``TimeoutError`` naming its rank after their deadline; a restarted aggregator makes
every worker recover (``AllreduceClient``'s ``restart_retries``, default 3: handshake anew, agree,
redo the call) and return the lossless result, ``recovery_s`` being the time from the new
aggregator's readiness until the last worker returned (median of ``--restart-repeats`` runs,
with their range), or, with ``restart_retries=0``, raise ``AggregatorRestartedError`` at once.

Then several jobs at once on one aggregator (2 and 4, each its own workers, K, pool and its
own file in ``--jobs-dir``): each job's result must be bit-identical to the same job alone.
Last, ``--fuzz-packets`` hostile datagrams from a stranger during a job
(``ncina.harness.fuzzing``): exact results, every datagram one counted drop, flat memory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.common.progress import progress
from ncina.harness.aggregators import start_aggregator
from ncina.harness.faults import (
    JOB,
    SCENARIOS,
    FaultRun,
    Run,
    allreduce_across_restart,
    allreduce_with_dead_worker,
    allreduce_with_faults,
    vs_lossless,
)
from ncina.harness.fuzzing import fuzz_during_allreduce, hostile_datagrams
from ncina.proto.job import JobSpec
from ncina.worker.client import AllreduceClient

# Concurrent jobs: (job id, workers, K, pool size); the first is the job of the flags. Results
# are int, so that a job alone and among others must give the same bits.
JOBS = tuple(JobSpec(job=job, workers=workers, k=k, pool_size=pool, result="int")
             for job, workers, k, pool in ((JOB, 4, 128, 64), (22, 2, 64, 32), (23, 3, 100, 48),
                                           (24, 2, 182, 16)))  # fmt: skip


@dataclass
class JobsRun:
    """What several jobs all-reducing at once on one aggregator gave."""

    outputs: dict[int, list[np.ndarray]]  # per job, per rank
    seconds: float  # from the first worker's start to the last worker's end
    retransmissions: int  # over every worker of every job


def allreduce_jobs(jobs: Sequence[JobSpec], elements: int, workdir: Path,
                   seed: int) -> JobsRun:  # fmt: skip
    """All-reduce ``elements`` per worker in every job of ``jobs`` at the same time on one Python
    aggregator (the first job from its flags, the others from ``--jobs-dir``); worker ``r`` of
    job ``j`` is seeded ``100 * j + r`` and its input drawn from ``(seed, j, r)``."""
    jobs_dir = workdir / "jobs"
    jobs_dir.mkdir()
    first, *others = jobs
    for spec in others:  # a job file holds JobConfig's fields (docs/reliability.md)
        (jobs_dir / f"{spec.job}.json").write_text(json.dumps(
            {"job": spec.job, "workers": spec.workers, "k": spec.k,
             "result_format": spec.result.name.lower(), "pool_size": spec.pool_size}
        ))  # fmt: skip
    aggregator = start_aggregator("python", workdir, spec=first,
                                  extra=["--jobs-dir", str(jobs_dir)])  # fmt: skip
    address = aggregator.address
    try:
        wanted = {str(spec.job) for spec in jobs}
        while not wanted <= set(aggregator.stats()["jobs"]):
            time.sleep(0.05)  # the directory is read every 0.2 s

        def worker(spec: JobSpec, rank: int) -> tuple[Any, ...]:
            job = spec.job
            x = np.random.default_rng((seed, job, rank)).standard_normal(elements)
            with AllreduceClient.for_job(address, spec, rank=rank, seed=100 * job + rank,
                                         timeout=0.02, max_timeout=0.2) as client:  # fmt: skip
                began = time.monotonic()
                out = client.allreduce(x.astype(np.float32), op="sum")
                return job, rank, out, client.stats["retransmissions"], began, time.monotonic()

        tasks = [(spec, rank) for spec in jobs for rank in range(spec.workers)]
        with ThreadPoolExecutor(len(tasks)) as pool_:
            done = list(pool_.map(lambda t: worker(*t), tasks))
    finally:
        aggregator.stop()
    outputs: dict[int, list[np.ndarray]] = {spec.job: [] for spec in jobs}
    for job, _, out, *_ in done:
        outputs[job].append(out)
    return JobsRun(outputs, max(d[5] for d in done) - min(d[4] for d in done),
                   sum(d[3] for d in done))  # fmt: skip


def fuzz_row(workdir: Path, packets: int, elements: int) -> dict[str, Any]:
    """The hostile-input row: ``packets`` datagrams of ``hostile_datagrams`` during a job of
    three configured members on a Python aggregator."""
    spec = JobSpec(job=JOB, workers=3, k=128, pool_size=64, result="int")
    ports = [aggproc.free_udp_port() for _ in range(spec.workers)]
    members = [f"--member={r}=127.0.0.1:{p}" for r, p in enumerate(ports)]
    aggregator = start_aggregator("python", workdir, spec=spec, extra=members)
    proc = aggregator.process
    try:
        datagrams = hostile_datagrams(packets, seed=7, job=JOB, workers=spec.workers, k=spec.k,
                                      emin=spec.window.e_min, pool_size=spec.pool_size)
        report = fuzz_during_allreduce(
            aggregator.address, "127.0.0.1", ports, aggregator.stats,
            proc.pid, lambda send: [send(d) for d in datagrams], spec=spec, elements=elements,
        )
        alive = proc.poll() is None
    finally:
        code = aggregator.stop()
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


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench reliability``."""
    p = subparsers.add_parser(
        "reliability",
        help="all-reduce under emulated loss, duplication and reordering vs a lossless run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    JobSpec.add_arguments(p, "workers", workers=4)
    p.add_argument("--elements", type=int, default=1_000_000, help="default: %(default)s")
    JobSpec.add_arguments(p, "k", "result", k=128, result="int")
    p.add_argument("--seed", type=int, default=42, help="input seed")
    p.add_argument("--deadline", type=float, default=2.0,
                   help="the workers' deadline in the killed-worker scenario (s)")  # fmt: skip
    p.add_argument("--restart-repeats", type=int, default=3, metavar="N",
                   help="runs of the recovered-restart scenario, for recovery_s's median "
                   "(default: %(default)s)")  # fmt: skip
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
                **vs_lossless(got.seconds, baseline),
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
            rows.append(_fault_row(name, args.elements, fault, baseline, chunks))
        recoveries = []
        for repeat in range(args.restart_repeats):
            workdir = Path(tmp) / f"recovered-{repeat}"
            workdir.mkdir()
            recoveries.append(allreduce_across_restart(
                inputs, workdir, k=args.k, result=args.result, deadline=30.0, at=chunks // 4,
                restart_retries=3))  # fmt: skip
        if recoveries:
            rows.append(_recovery_row(args.elements, recoveries, baseline, chunks))
        alone = {}
        for spec in JOBS:
            workdir = Path(tmp) / f"alone-{spec.job}"
            workdir.mkdir()
            alone[spec.job] = allreduce_jobs([spec], args.elements, workdir, args.seed)
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
                **vs_lossless(together.seconds, baseline),
                "time_vs_alone_summed": round(
                    together.seconds / sum(alone[j.job].seconds for j in JOBS[:count]), 2),
                "retransmissions": together.retransmissions,
                "jobs": [{"job": j.job, "workers": j.workers, "k": j.k, "pool": j.pool_size}
                         for j in JOBS[:count]],
            })  # fmt: skip
        if args.fuzz_packets:
            workdir = Path(tmp) / "fuzz"
            workdir.mkdir()
            rows.append(fuzz_row(workdir, args.fuzz_packets, args.elements // 10))
    return {"workers": args.workers, "k": args.k, "result": args.result, "rows": rows}


def _recovery_row(elements: int, runs: list[FaultRun], baseline: Run,
                  chunks: int) -> dict[str, Any]:  # fmt: skip
    """The row of the restarts the workers recovered from: exact against the lossless run,
    ``recovery_s`` the median over ``runs`` (and its range)."""
    times = sorted(run.recovery_s or 0.0 for run in runs)
    middle = sorted(runs, key=lambda run: run.recovery_s or 0.0)[(len(runs) - 1) // 2]
    return {
        "scenario": "aggregator restarted, recovered",
        "elements": elements,
        "exact": all(isinstance(o, np.ndarray) and np.array_equal(o, baseline.outputs[0])
                     for run in runs for o in run.outcomes),
        "seconds": round(middle.seconds, 3),
        **vs_lossless(middle.seconds, baseline),
        "retransmissions": middle.retransmissions,
        "killed_at_slot": f"{middle.killed_at}/{chunks}",
        "recovery_s": round(times[(len(times) - 1) // 2], 3),
        "recovery_s_range": [round(times[0], 3), round(times[-1], 3)],
        "repeats": len(runs),
    }


def _fault_row(name: str, elements: int, run: FaultRun, lossless: Run,
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
        **vs_lossless(run.seconds, lossless),
        "retransmissions": run.retransmissions,
        "killed_at_slot": f"{run.killed_at}/{chunks}",
        "errors": [str(o) for o in run.outcomes if isinstance(o, BaseException)][:1],
    }
