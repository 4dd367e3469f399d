"""``ncina bench allreduce``: the INA all-reduce on loopback beside gloo's, with figures.

Each repeat starts a fresh aggregator (``ncina aggregator --backend B``, its stats to a temporary
file) and ``--workers`` worker processes (``ncina.bench.worker``), every one all-reducing
``--elements`` random normal float32 elements (seeded by rank) through one ``AllreduceClient``;
then as many processes all-reduce the same tensors with ``torch.distributed``'s gloo backend
(ring all-reduce of float32) on loopback. Both sides warm up with an all-reduce of one element,
start at one instant and time the all-reduce call alone; a run's wall time is the earliest start
to the latest end. ``--backend dpdk`` puts the aggregator in its own network namespace behind a
veth pair (needs root and DPDK); the workers stay in this namespace.

Reported, as the lower median over ``--repeat`` runs (each run's values kept under ``runs``):
``wall_s``, ``gloo_wall_s``, ``vs_gloo`` (their ratio), ``elements_per_s``, the workers' peak
resident set sizes; ``exact``, whether every run's result is the reference model's (see
:func:`exact_mismatches`); and, of the median run, the packets the aggregator handled per second
and per second of its own CPU time (all processes share the host's cores, so the CPU figure says
what the aggregator could do alone), retransmissions, and the error against the exact mean next
to the NC bounds (``ncina.proto.nc_bounds.bounds_from_inputs``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ncina.aggregator import jobs
from ncina.aggregator import process as aggproc
from ncina.aggregator.cli import positive_int
from ncina.bench.worker import GO, WARMUP, client_seed, ready_path, report_path, worker_input
from ncina.progress import progress
from ncina.proto import nc8
from ncina.proto.header import PORT, Format
from ncina.proto.nc_bounds import bounds_from_inputs
from ncina.proto.wire import DEFAULT_MTU, MAX_K

__all__ = ["worker_input"]  # ncina.bench.worker's, kept importable from here

JOB = 1
START_TIMEOUT = 60.0  # seconds for an aggregator or the workers to get ready
GO_DELAY = 0.1  # seconds from the go file to the common start instant
BLOCK = 1 << 20  # elements per block of the reference computations (bounded temporaries)
RESULT_FORMATS = {"nc8": Format.NC8, "int": Format.INT}
DPDK_VDEV_OPTIONS = "framecnt=4096,qdisc_bypass=1"  # as in bench aggregator

Launch = Callable[[int, list[str], Path], "subprocess.Popen[bytes]"]
"""Starts a worker process: its rank, command line and log file (stdout and stderr)."""


class Workers(NamedTuple):
    """What :func:`run_workers` returns: the reports in rank order, and what its ``probe``
    returned just before the go signal and just after the last worker exited."""

    reports: list[dict[str, Any]]
    before: Any
    after: Any


def backends() -> tuple[str, ...]:
    """The aggregator backends an all-reduce benchmark can drive: every ``ncina aggregator``
    backend but bmv2 (a switch, which serves only Mininet's topologies)."""
    from ncina.aggregator.cli import BACKENDS

    return tuple(b for b in BACKENDS if b != "bmv2")


def default_k(mtu: int, result: str) -> int:
    """The aggregator's default K for ``mtu`` (``ncina.aggregator.jobs.default_k``), or
    ``ValueError`` when not even one element fits."""
    k = jobs.default_k(mtu, result)
    if k < 1:
        raise ValueError(f"no {result} chunk fits an MTU of {mtu} bytes")
    return k


def add_common_arguments(p: argparse.ArgumentParser, backend: str, workers: int) -> None:
    """The options ``bench allreduce`` and ``bench fabric`` share."""
    p.add_argument("--backend", choices=backends(), default=backend,
                   help="aggregator backend (default: %(default)s)")  # fmt: skip
    p.add_argument("--workers", type=positive_int, default=workers, help="default: %(default)s")
    p.add_argument("--elements", type=positive_int, default=10_000_000,
                   help="float32 elements per worker (default: %(default)s)")  # fmt: skip
    p.add_argument("--mtu", type=positive_int, default=DEFAULT_MTU,
                   help="MTU whose largest K is the default --k (default: %(default)s)")
    p.add_argument("--k", type=positive_int, default=None,
                   help="elements per packet (default: the largest that fits --mtu both ways, "
                   f"at most {MAX_K})")  # fmt: skip
    p.add_argument("--pool-size", type=positive_int, default=64, help="default: %(default)s")
    p.add_argument("--result", choices=tuple(RESULT_FORMATS), default="nc8",
                   help="default: %(default)s")  # fmt: skip
    p.add_argument("--window-max", type=int, default=10, metavar="E", help="default: %(default)s")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="runs; figures are their lower median (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="input and rounding seed")
    p.add_argument("--timeout", type=float, default=0.05, help="initial RTO (s)")
    p.add_argument("--deadline", type=float, default=30.0, help="worker deadline (s)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench allreduce``."""
    p = subparsers.add_parser(
        "allreduce",
        help="N workers all-reduce through a local aggregator, and with gloo, on loopback",
        description="Start an aggregator and N worker processes on loopback, all-reduce random "
        "float32 tensors, then all-reduce the same tensors with torch.distributed's gloo; "
        "report times against gloo, packet rates, aggregator CPU, the workers' peak memory, "
        "exactness against the reference model and the error against the exact mean "
        "(docs/performance.md).",
    )
    add_common_arguments(p, backend="python", workers=4)
    return p


def check_arguments(args: argparse.Namespace) -> None:
    """Fill in the default K and reject a bad window before any process starts."""
    if args.k is None:
        args.k = default_k(args.mtu, args.result)
    nc8.Window.for_job(args.workers, args.window_max)


# ---------------------------------------------------------------------------------------------
# Worker processes

def local_launch(rank: int, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a worker process in this namespace (any rank)."""
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def worker_spec(args: argparse.Namespace, mode: str, **extra: Any) -> dict[str, Any]:
    """What every worker process of a run reads (``ncina.bench.worker``)."""
    return {
        "mode": mode, "job": JOB, "workers": args.workers, "elements": args.elements,
        "seed": args.seed, "k": args.k, "pool_size": args.pool_size,
        "window_max": args.window_max, "result": args.result, "timeout": args.timeout,
        "deadline": args.deadline, "mtu": args.mtu, "start_timeout": START_TIMEOUT, **extra,
    }  # fmt: skip


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
            argv = [sys.executable, "-m", "ncina.bench.worker", str(spec_path), str(rank)]
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


# ---------------------------------------------------------------------------------------------
# The reference model

class Reference(NamedTuple):
    """The workers' inputs (workers x elements) and the exact integer sums of the NC8 codes
    they send (units of ``2**window.e_min``)."""

    inputs: np.ndarray
    sums: np.ndarray
    window: nc8.Window


def sent_codes(seed: int, rank: int, x: np.ndarray, window: nc8.Window) -> np.ndarray:
    """The NC8 codes rank ``rank`` sends for ``x``: its client's rounding stream
    (``client_seed``) draws one key for the warm-up all-reduce, then one for ``x``."""
    rng = np.random.default_rng(client_seed(seed, rank))
    nc8.encode(WARMUP, window, rng)
    return nc8.encode(x, window, rng).codes


def reference(args: argparse.Namespace) -> Reference:
    """Recompute every worker's input and codes, and the exact sums of the codes."""
    window = nc8.Window.for_job(args.workers, args.window_max)
    inputs = np.stack([worker_input(args.seed, r, args.elements) for r in range(args.workers)])
    sums = np.zeros(args.elements, dtype=np.int64)
    for rank in range(args.workers):
        nc8.accumulate(sums, sent_codes(args.seed, rank, inputs[rank], window))
    return Reference(inputs, sums, window)


def exact_mismatches(
    result: np.ndarray, sums: np.ndarray, window: nc8.Window, workers: int, result_format: str
) -> int:
    """How many elements of a worker's mean ``result`` the reference model rules out.

    ``int`` results: the mean must be bit for bit the client's float32 of the exact integer sum
    (``ints_to_float`` divided by N). ``nc8`` results: the aggregator rounds each exact sum
    ``S`` (``2**h <= |S| < 2**(h+1)``) to ``2**h`` or ``2**(h+1)``, sign kept, 0 stays 0; the
    mean must be the decoded value of one of those two codes divided by N.
    """
    n = np.float32(workers)
    y = np.asarray(result, dtype=np.float32).reshape(-1)
    if y.shape != sums.shape:
        raise ValueError(f"result of {y.size} elements against {sums.size} sums")
    bad = 0
    for a in range(0, sums.size, BLOCK):
        s, r = sums[a : a + BLOCK], y[a : a + BLOCK]
        if result_format == "int":
            bad += int(np.count_nonzero(r != nc8.ints_to_float(s, window) / n))
            continue
        magnitude = np.abs(s).astype(np.uint64)  # |S| < 2**63: the window rules overflow out
        h = np.zeros(s.shape, dtype=np.int64)
        nonzero = magnitude > 0
        _, exponent = np.frexp(magnitude[nonzero].astype(np.float64))
        estimate = exponent.astype(np.int64) - 1  # float64 rounding may be one off: fix below
        low = np.left_shift(np.uint64(1), estimate.astype(np.uint64))
        estimate -= low > magnitude[nonzero]
        low = np.left_shift(np.uint64(1), estimate.astype(np.uint64))
        estimate += (magnitude[nonzero] - low) >= low
        h[nonzero] = estimate
        sign = np.where(s < 0, 0x80, 0).astype(np.uint8)
        down = np.where(nonzero, (h + 1).astype(np.uint8) | sign, 0).astype(np.uint8)
        up = np.where(nonzero, (h + 2).astype(np.uint8) | sign, 0).astype(np.uint8)
        ok = (r == nc8.decode(down, window) / n) | (r == nc8.decode(up, window) / n)
        bad += int(np.count_nonzero(~ok))
    return bad


def accuracy(ref: Reference, result: np.ndarray, result_format: str) -> dict[str, Any]:
    """Compare ``result`` with the exact mean of the workers' inputs and the NC error model
    (block by block: a 100M-element run must not need gigabytes of float64 temporaries)."""
    n = ref.inputs.shape[1]
    totals = dict.fromkeys(("sq_error", "sq_exact", "var_low", "var_high"), 0.0)
    max_error = worst = 0.0
    for a in range(0, n, BLOCK):
        block = ref.inputs[:, a : a + BLOCK]
        exact = block.astype(np.float64).mean(axis=0)
        model = bounds_from_inputs(block, result_format)
        error = np.abs(result[a : a + BLOCK].astype(np.float64) - exact)
        max_error = max(max_error, float(error.max()))
        worst = max(worst, float(np.max(error / np.maximum(model.max_error, 1e-300))))
        totals["sq_error"] += float(np.sum(error * error))
        totals["sq_exact"] += float(np.sum(exact * exact))
        totals["var_low"] += float(np.sum(model.var_low))
        totals["var_high"] += float(np.sum(model.var_high))
    mse = totals["sq_error"] / n
    return {
        "max_abs_error": max_error,
        "max_error_over_bound": worst,
        "rms_error": mse**0.5,
        "rms_exact_mean": (totals["sq_exact"] / n) ** 0.5,
        "mse": mse,
        "mse_model_low": totals["var_low"] / n,
        "mse_model_high": totals["var_high"] / n,
    }


# ---------------------------------------------------------------------------------------------
# Aggregators

def aggregator_arguments(args: argparse.Namespace, stats_path: Path) -> list[str]:
    """``ncina aggregator`` options of the benchmark's job (backend and address aside)."""
    return [
        "--job", str(JOB), "--workers", str(args.workers), "--k", str(args.k),
        "--result", args.result, "--pool-size", str(args.pool_size),
        "--window-max", str(args.window_max), "--seed", str(args.seed),
        "--mtu", str(args.mtu), "--stats", str(stats_path),
    ]  # fmt: skip


def check_dpdk(mtu: int) -> None:
    """Raise with the reason when the dpdk backend cannot run here."""
    from ncina.aggregator.dpdk import binding, netns

    reason = netns.missing() or binding.missing()
    if reason:
        raise RuntimeError(f"--backend dpdk: {reason}")
    if mtu > DEFAULT_MTU:  # af_packet's default frame size holds a 1500-byte MTU's frames
        raise ValueError(f"--backend dpdk serves veths of MTU {DEFAULT_MTU}, not {mtu}")


def start_aggregator(
    args: argparse.Namespace, directory: Path, site: Any = None
) -> tuple[subprocess.Popen[bytes], tuple[str, int], Path]:
    """Start the aggregator (``site``: the dpdk backend's namespace) and wait until it serves;
    return the process, its address and its stats file."""
    directory.mkdir(parents=True, exist_ok=True)
    stats_path, log_path = directory / "aggregator-stats.json", directory / "aggregator.log"
    arguments = aggregator_arguments(args, stats_path)
    if site is None:
        proc, address = aggproc.start(
            ["--backend", args.backend, "--listen", "127.0.0.1:0", *arguments],
            log_path, START_TIMEOUT,
        )  # fmt: skip
        return proc, address, stats_path
    arguments += ["--vdev-options", DPDK_VDEV_OPTIONS, "--listen", f"0.0.0.0:{PORT}"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(site.aggregator_command(arguments, "dpdk"),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)  # fmt: skip
    try:
        return proc, aggproc.wait_ready(proc, log_path, START_TIMEOUT), stats_path
    except RuntimeError:
        aggproc.stop(proc)
        raise


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM raises ``KeyboardInterrupt`` as Ctrl-C does, so that a run's cleanup
    (its processes stopped by PID, its namespaces or network removed) runs for both."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_tcp_port() -> int:
    """A loopback TCP port that was free a moment ago (gloo's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Runs and figures

def one_repeat(
    args: argparse.Namespace, directory: Path, ref: Reference, site: Any
) -> dict[str, Any]:
    """One INA all-reduce through a fresh aggregator and one gloo all-reduce; their figures."""
    result_path = directory / "result.npy"
    aggregator, address, stats_path = start_aggregator(args, directory, site)
    try:
        spec = worker_spec(args, "ina", aggregator=address, result_path=str(result_path))
        cpu = cpu_seconds(aggregator.pid)
        ina = run_workers(spec, directory / "ina", local_launch, args.deadline + 60).reports
        aggregator_cpu = cpu_seconds(aggregator.pid) - cpu
    finally:
        aggproc.stop(aggregator)
    job = json.loads(stats_path.read_text())["jobs"][str(JOB)]
    result = np.load(result_path)
    result_path.unlink()
    spec = worker_spec(args, "gloo", master=["127.0.0.1", free_tcp_port()],
                       ifaces=["lo"] * args.workers)  # fmt: skip
    gloo = run_workers(spec, directory / "gloo", local_launch, args.deadline + 60).reports
    return repeat_figures(args, ref, ina, gloo, result) | {
        "aggregator_cpu": aggregator_cpu, "job": job,
    }  # fmt: skip


def repeat_figures(
    args: argparse.Namespace, ref: Reference, ina: list[dict[str, Any]],
    gloo: list[dict[str, Any]], result: np.ndarray,
) -> dict[str, Any]:  # fmt: skip
    """The figures of one run from its worker reports and rank 0's INA result."""
    mismatches = exact_mismatches(result, ref.sums, ref.window, args.workers, args.result)
    return {
        "wall_s": wall_time(ina),
        "gloo_wall_s": wall_time(gloo),
        "exact": mismatches == 0 and len({r["digest"] for r in ina}) == 1,
        "exact_mismatches": mismatches,
        "identical": len({r["digest"] for r in ina}) == 1,
        "peak_rss": [r["peak_rss"] for r in ina],
        "gloo_peak_rss": [r["peak_rss"] for r in gloo],
        "worker_cpu": sum(r["cpu"] for r in ina),
        "workers": [r["stats"] for r in ina],
        "accuracy": accuracy(ref, result, args.result),
    }


def ratio(a: float, b: float) -> float:
    """``a / b`` to three significant digits (inf when ``b`` is 0)."""
    return float(f"{a / b:.3g}") if b > 0 else float("inf")


def medians(args: argparse.Namespace, repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures every all-reduce benchmark reports: lower medians over the runs of the
    times, ratios and peak memory, ``exact`` over all runs, and every run's own values."""
    median = statistics.median_low
    wall = median(r["wall_s"] for r in repeats)
    gloo = median(r["gloo_wall_s"] for r in repeats)
    ranks = range(args.workers)
    return {
        "wall_s": round(wall, 6),
        "gloo_wall_s": round(gloo, 6),
        "vs_gloo": ratio(wall, gloo),
        "elements_per_s": round(args.elements / wall),
        "exact": all(r["exact"] for r in repeats),
        "peak_rss": [median(r["peak_rss"][i] for r in repeats) for i in ranks],
        "gloo_peak_rss": [median(r["gloo_peak_rss"][i] for r in repeats) for i in ranks],
        "input_bytes": 4 * args.elements,
        "peak_rss_over_input": ratio(max(max(r["peak_rss"]) for r in repeats), 4 * args.elements),
        "runs": [run_values(args, r) for r in repeats],
    }


def run_values(args: argparse.Namespace, r: dict[str, Any]) -> dict[str, Any]:
    """One run's own values of the median figures (and its ``extra`` ones)."""
    return {
        "wall_s": round(r["wall_s"], 6),
        "gloo_wall_s": round(r["gloo_wall_s"], 6),
        "vs_gloo": ratio(r["wall_s"], r["gloo_wall_s"]),
        "elements_per_s": round(args.elements / r["wall_s"]),
        "exact": r["exact"],
        "exact_mismatches": r["exact_mismatches"],
        "peak_rss": r["peak_rss"],
        "gloo_peak_rss": r["gloo_peak_rss"],
        **r.get("extra", {}),
    }


def median_repeat(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run of the lower-median INA wall time."""
    return sorted(repeats, key=lambda r: r["wall_s"])[(len(repeats) - 1) // 2]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``--repeat`` INA and gloo all-reduces; medians lead, the median run's details follow."""
    check_arguments(args)
    if args.backend == "dpdk":
        check_dpdk(args.mtu)
    ref = reference(args)
    star = None
    with sigterm_interrupts(), tempfile.TemporaryDirectory(prefix="ncina-bench-") as tmp:
        try:
            if args.backend == "dpdk":
                from ncina.aggregator.dpdk import netns

                star = netns.Star.create()
            site = star.add_site() if star else None
            runs = progress(range(args.repeat), desc="bench allreduce", unit="run")
            repeats = [one_repeat(args, Path(tmp, f"run{i}"), ref, site) for i in runs]
        finally:
            if star is not None:
                star.close()
    chosen = median_repeat(repeats)
    job = chosen["job"]
    packets = job["packets_in"] + job["packets_out"]
    wall = chosen["wall_s"]
    figures: dict[str, Any] = {
        "backend": args.backend, "workers": args.workers, "elements": args.elements,
        "k": args.k, "mtu": args.mtu, "pool_size": args.pool_size, "result": args.result,
        "repeat": args.repeat,
    }  # fmt: skip
    figures |= medians(args, repeats)
    figures |= {
        "wall_s_all": [round(r["wall_s"], 6) for r in repeats],
        "aggregator_packets_in": job["packets_in"],
        "aggregator_packets_out": job["packets_out"],
        "aggregator_contributions": job["contributions"],
        "aggregator_slots_completed": job["slots_completed"],
        "aggregator_packets_in_per_s": round(job["packets_in"] / wall),
        "aggregator_packets_per_s": round(packets / wall),
        "aggregator_cpu_s": round(chosen["aggregator_cpu"], 3),
        "aggregator_packets_per_cpu_s": round(packets / max(chosen["aggregator_cpu"], 1e-9)),
        "worker_cpu_s": round(chosen["worker_cpu"], 3),
        "aggregator_duplicates": job["duplicates"],
        "aggregator_results_resent": job["results_resent"],
        "retransmissions": sum(w["retransmissions"] for w in chosen["workers"]),
        "results_ignored": sum(w["results_ignored"] for w in chosen["workers"]),
        "saturated": sum(w["saturated"] for w in chosen["workers"]),
        "results_identical_across_workers": chosen["identical"],
    }
    figures |= chosen["accuracy"]
    figures["within_bounds"] = figures["max_error_over_bound"] <= 1.0
    return figures
