"""``ncina bench allreduce``: end-to-end all-reduce through a local aggregator, with figures.

Each repeat starts a fresh aggregator (``ncina aggregator``, its stats to a temporary file) and
``--workers`` worker processes on loopback; every worker all-reduces ``--elements`` random
normal float32 elements (seeded by rank). Reported: the wall time of the all-reduce (earliest
worker start to latest worker end; the median over repeats leads), elements/s, the packets the
aggregator handled per second (``packets_in`` and ``packets_in + packets_out``, from its stats)
and per second of its own CPU time (all processes share the host's cores, so the CPU figure is
the one that says what the aggregator could do alone), retransmissions, and the error against
the exact mean next to the NC bounds derived in ``nc_error_model``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.proto import nc8

JOB = 1
START_TIMEOUT = 30.0  # seconds for an aggregator or a worker to get ready


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench allreduce``."""
    p = subparsers.add_parser(
        "allreduce",
        help="N workers all-reduce random tensors through a local aggregator",
        description="Start an aggregator and N worker processes on loopback, all-reduce random "
        "float32 tensors, and report time, packet rates, aggregator CPU and the error against "
        "the exact mean.",
    )
    p.add_argument("--workers", type=int, default=4, help="default: %(default)s")
    p.add_argument("--elements", type=int, default=10_000_000, help="default: %(default)s")
    p.add_argument("--backend", choices=("python",), default="python", help="aggregator backend")
    p.add_argument("--k", type=int, default=256, help="elements per packet (default: %(default)s)")
    p.add_argument("--pool-size", type=int, default=64, help="default: %(default)s")
    p.add_argument("--result", choices=("nc8", "int"), default="nc8", help="default: %(default)s")
    p.add_argument("--window-max", type=int, default=10, metavar="E", help="default: %(default)s")
    p.add_argument("--repeat", type=int, default=3, help="default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="input and rounding seed")
    p.add_argument("--timeout", type=float, default=0.05, help="initial RTO (s)")
    p.add_argument("--deadline", type=float, default=30.0, help="worker deadline (s)")
    return p


def worker_input(seed: int, rank: int, elements: int) -> np.ndarray:
    """The tensor rank ``rank`` all-reduces: standard normal float32, seeded by (seed, rank)."""
    return np.random.default_rng([seed, rank]).standard_normal(elements, dtype=np.float32)


def nc_error_model(inputs: np.ndarray, result_format: str) -> dict[str, np.ndarray]:
    """Per-element error bounds of the mean of ``inputs`` (workers x elements) under NC8.

    Uplink: NC rounds ``x`` with ``|x|`` in ``[2^e, 2^(e+1))`` to ``2^e`` or ``2^(e+1)`` without
    bias, so its error is at most ``2^e <= |x|`` and its variance exactly
    ``(2^(e+1) - |x|)(|x| - 2^e)`` (at most ``x^2 / 8``, the paper's omega = 1/8). The workers
    round independently, so the integer sum ``T`` has ``E[T] = sum x`` and
    ``Var T = V_up = sum_i var_i``.
    Downlink (``nc8`` results): the aggregator rounds ``T`` the same way, error at most
    ``|T| <= 2 sum |x|``, conditional variance at most ``T^2 / 8``; by the law of total variance
    the result's variance lies in ``[V_up, V_up + E[T^2] / 8]`` with
    ``E[T^2] = (sum x)^2 + V_up``. (``int`` results: exactly ``V_up``, error at most ``sum |x|``.)
    Dividing by N for the mean divides errors by N and variances by N^2. Values below the window
    (irrelevant for normal inputs) would add up to ``2^e_min`` per worker.

    Returns ``max_error`` (a hard bound), ``var_low`` and ``var_high`` (bounds of the expected
    squared error), each per element.
    """
    n = inputs.shape[0]
    x = np.abs(inputs.astype(np.float64))
    _, exponent = np.frexp(x)  # x = m * 2^exponent with m in [0.5, 1)
    # 2^e with |x| in [2^e, 2^(e+1)); a zero is sent exactly (frexp gives it exponent 0)
    low = np.where(x > 0, np.ldexp(0.5, exponent), 0.0)
    v_up = ((2 * low - x) * (x - low)).sum(axis=0)
    total = inputs.astype(np.float64).sum(axis=0)
    absolute = x.sum(axis=0)
    if result_format == "nc8":
        max_error = 3 * absolute
        var_high = v_up + (total * total + v_up) / 8
    else:
        max_error = absolute
        var_high = v_up
    return {"max_error": max_error / n, "var_low": v_up / n**2, "var_high": var_high / n**2}


def _worker(
    args: dict[str, Any], rank: int, barrier: Any, results: Any, result_path: str
) -> None:
    """One worker process: build its input and client, wait for the start, all-reduce, report."""
    from ncina.worker.client import AllreduceClient

    try:
        x = worker_input(args["seed"], rank, args["elements"])
        with AllreduceClient(
            args["aggregator"], job=JOB, rank=rank, workers=args["workers"], k=args["k"],
            pool_size=args["pool_size"], window_max=args["window_max"],
            result_format=args["result"], seed=args["seed"] * 1000 + rank,
            timeout=args["timeout"], deadline=args["deadline"],
        ) as client:
            barrier.wait(START_TIMEOUT)
            cpu = time.process_time()
            began = time.monotonic()
            y = client.allreduce(x)
            ended = time.monotonic()
            cpu = time.process_time() - cpu
            stats = client.stats
        if rank == 0:
            np.save(result_path, y)
        digest = hashlib.blake2b(y.tobytes(), digest_size=16).hexdigest()
        results.put((rank, {"began": began, "ended": ended, "cpu": cpu, "stats": stats,
                            "digest": digest}))
    except BaseException as exc:
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        barrier.abort()  # nobody waits for a worker that will not come
        raise


def start_aggregator(
    args: argparse.Namespace, tmp: Path
) -> tuple[subprocess.Popen[bytes], tuple[str, int], Path]:
    """Start ``ncina aggregator`` on a free loopback port, its stats and log in ``tmp``; return
    the process and its address once its readiness line is in the log, and the stats path."""
    stats_path = tmp / "aggregator-stats.json"
    arguments = [
        "--backend", args.backend, "--listen", "127.0.0.1:0", "--job", str(JOB),
        "--workers", str(args.workers), "--k", str(args.k), "--result", args.result,
        "--pool-size", str(args.pool_size), "--window-max", str(args.window_max),
        "--seed", str(args.seed), "--stats", str(stats_path),
    ]  # fmt: skip
    proc, address = aggproc.start(arguments, tmp / "aggregator.log", START_TIMEOUT)
    return proc, address, stats_path


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_repeat(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Start an aggregator and the workers, run one all-reduce, collect figures and the result."""
    result_path = tmp / "result.npy"
    aggregator, address, stats_path = start_aggregator(args, tmp)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(args.workers + 1)
    results = context.Queue()
    settings = {**vars(args), "aggregator": address}
    settings = {key: value for key, value in settings.items() if not key.startswith("_")}
    workers = [
        context.Process(
            target=_worker, args=(settings, rank, barrier, results, str(result_path)),
            name=f"ncina-bench-worker-{rank}",
        )
        for rank in range(args.workers)
    ]
    try:
        for worker in workers:
            worker.start()
        try:
            barrier.wait(START_TIMEOUT + 60)
        except threading.BrokenBarrierError:
            rank, report = results.get(timeout=10)
            raise RuntimeError(f"worker {rank}: {report.get('error', 'did not start')}") from None
        cpu_start = cpu_seconds(aggregator.pid)
        reports: dict[int, dict[str, Any]] = {}
        while len(reports) < args.workers:
            rank, report = results.get(timeout=args.deadline + 60)
            if "error" in report:
                raise RuntimeError(f"worker {rank}: {report['error']}")
            reports[rank] = report
        aggregator_cpu = cpu_seconds(aggregator.pid) - cpu_start
    finally:
        for worker in workers:
            if worker.pid is None:  # never started
                continue
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM)
            worker.join(10)
        aggproc.stop(aggregator)
    job = json.loads(stats_path.read_text())["jobs"][str(JOB)]
    wall = max(r["ended"] for r in reports.values()) - min(r["began"] for r in reports.values())
    return {
        "wall": wall,
        "aggregator_cpu": aggregator_cpu,
        "worker_cpu": sum(r["cpu"] for r in reports.values()),
        "job": job,
        "workers": [reports[rank]["stats"] for rank in range(args.workers)],
        "identical": len({r["digest"] for r in reports.values()}) == 1,
        "result": np.load(result_path),
    }


def accuracy(args: argparse.Namespace, result: np.ndarray) -> dict[str, Any]:
    """Compare ``result`` with the exact mean of the workers' inputs and the NC error model."""
    inputs = np.stack([worker_input(args.seed, r, args.elements) for r in range(args.workers)])
    exact = inputs.astype(np.float64).mean(axis=0)
    model = nc_error_model(inputs, args.result)
    error = result.astype(np.float64) - exact
    mse = float(np.mean(error * error))
    return {
        "max_abs_error": float(np.max(np.abs(error))),
        "max_error_over_bound": float(np.max(np.abs(error) / np.maximum(model["max_error"],
                                                                         1e-300))),
        "rms_error": mse**0.5,
        "rms_exact_mean": float(np.sqrt(np.mean(exact * exact))),
        "mse": mse,
        "mse_model_low": float(np.mean(model["var_low"])),
        "mse_model_high": float(np.mean(model["var_high"])),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``--repeat`` all-reduces; the figures of the median-time repeat lead."""
    nc8.Window.for_job(args.workers, args.window_max)  # a bad window fails here, not in workers
    repeats = []
    with tempfile.TemporaryDirectory(prefix="ncina-bench-") as tmp:
        for _ in range(args.repeat):
            repeats.append(one_repeat(args, Path(tmp)))
    walls = [r["wall"] for r in repeats]
    median = sorted(repeats, key=lambda r: r["wall"])[(len(repeats) - 1) // 2]
    job = median["job"]
    packets = job["packets_in"] + job["packets_out"]
    wall = median["wall"]
    figures: dict[str, Any] = {
        "backend": args.backend,
        "workers": args.workers,
        "elements": args.elements,
        "k": args.k,
        "pool_size": args.pool_size,
        "result": args.result,
        "repeat": args.repeat,
        "wall_s": round(wall, 4),  # the median repeat's (the lower median for even counts)
        "wall_s_all": [round(w, 4) for w in walls],
        "elements_per_s": round(args.elements / wall),
        "aggregator_packets_in": job["packets_in"],
        "aggregator_packets_out": job["packets_out"],
        "aggregator_packets_in_per_s": round(job["packets_in"] / wall),
        "aggregator_packets_per_s": round(packets / wall),
        "aggregator_cpu_s": round(median["aggregator_cpu"], 3),
        "aggregator_packets_per_cpu_s": round(packets / max(median["aggregator_cpu"], 1e-9)),
        "worker_cpu_s": round(median["worker_cpu"], 3),
        "aggregator_duplicates": job["duplicates"],
        "aggregator_results_resent": job["results_resent"],
        "retransmissions": sum(w["retransmissions"] for w in median["workers"]),
        "results_ignored": sum(w["results_ignored"] for w in median["workers"]),
        "saturated": sum(w["saturated"] for w in median["workers"]),
        "results_identical_across_workers": median["identical"],
    }
    figures.update(accuracy(args, median["result"]))
    figures["within_bounds"] = figures["max_error_over_bound"] <= 1.0
    return figures
