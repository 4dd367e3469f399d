"""``ncina bench reliability``: all-reduce through an aggregator that loses, duplicates and
reorders packets, against a lossless run of the same inputs in the same session.

Each scenario starts a Python aggregator with its seeded fault knobs (``--drop-up`` ...), runs
the workers as threads of this process (one ``AllreduceClient`` each, the same inputs and seeds
in every scenario), and reports whether the result is bit-identical to the lossless run's, the
completion time as a ratio to the lossless run's, the retransmissions and the faults counted.
With ``--result int`` (exact sums, the default) "identical" is the guarantee under test; with
``nc8`` the aggregator's re-compression keys follow completion order, which loss changes, so
only the lossless run itself is expected to match (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.worker.client import AllreduceClient

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
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario once, in one session; returns the table rows."""
    rng = np.random.default_rng(args.seed)
    inputs = [rng.standard_normal(args.elements).astype(np.float32) for _ in range(args.workers)]
    rows = []
    baseline: Run | None = None
    with tempfile.TemporaryDirectory(prefix="ncina-bench-reliability-") as tmp:
        for i, (name, faults) in enumerate(SCENARIOS.items()):
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
    return {"workers": args.workers, "k": args.k, "result": args.result, "rows": rows}
