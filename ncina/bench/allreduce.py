"""``ncina bench allreduce``: the INA all-reduce on loopback beside gloo's, with figures.

Each repeat starts a fresh aggregator (``ncina aggregator --backend B``, its stats to a temporary
file) and ``--workers`` worker processes (``ncina.harness.workers``), every one all-reducing
``--elements`` random normal float32 elements (seeded by rank) through one ``AllreduceClient``;
then as many processes all-reduce the same tensors with ``torch.distributed``'s gloo backend
(ring all-reduce of float32) on loopback. Both sides warm up with an all-reduce of one element
(the INA client then reserves its buffers for the timed size: ``AllreduceClient.reserve``),
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
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.common import cpu
from ncina.common.options import positive_int
from ncina.common.progress import progress
from ncina.harness.figures import (
    conditions,
    job_packets,
    median_repeat,
    medians,
    per_packet,
    retx_fraction,
)
from ncina.harness.reference import BLOCK, Reference, build_reference, exact_mismatches
from ncina.harness.workers import START_TIMEOUT, local_launch, run_workers, wall_time
from ncina.proto import nc8
from ncina.proto.header import PORT
from ncina.proto.job import FORMATS, JobSpec
from ncina.proto.nc_bounds import bounds_from_inputs
from ncina.proto.wire import DEFAULT_MTU

JOB = 1
DPDK_VDEV_OPTIONS = "framecnt=4096,qdisc_bypass=1"  # as in bench aggregator

def backends() -> tuple[str, ...]:
    """The aggregator backends an all-reduce benchmark can drive: every ``ncina aggregator``
    backend but a switch (bmv2, which serves only Mininet's topologies)."""
    from ncina.aggregator.backends import names

    return names(switch=False)


def add_common_arguments(p: argparse.ArgumentParser, backend: str, workers: int) -> None:
    """The options ``bench allreduce`` and ``bench fabric`` share."""
    p.add_argument("--backend", choices=backends(), default=backend,
                   help="aggregator backend (default: %(default)s)")  # fmt: skip
    JobSpec.add_arguments(p, "workers", workers=workers)
    p.add_argument("--elements", type=positive_int, default=10_000_000,
                   help="float32 elements per worker (default: %(default)s)")  # fmt: skip
    JobSpec.add_arguments(p, "mtu", "k", "pool_size", "result", "window_max", "profile",
                          result=None, rules={"result": "nc8; int32 under --profile tofino"})
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="runs; figures are their lower median (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="input and rounding seed")
    p.add_argument("--timeout", type=float, default=0.05, help="initial RTO (s)")
    p.add_argument("--deadline", type=float, default=30.0, help="worker deadline (s)")
    JobSpec.add_arguments(p, role="run")  # every field not placed above


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


def check_arguments(args: argparse.Namespace, **job: Any) -> None:
    """Validate the benchmark's job (``JobSpec.from_args``: every problem at once) and fill in
    its K, the default rule's where ``--k`` is not given, before any process starts; ``job``
    replaces fields (``bench fabric``'s leaves: a leaf's workers and the tree's total)."""
    args.k = JobSpec.from_args(args, job=JOB, **job).k


# ---------------------------------------------------------------------------------------------
# Worker processes (ncina.harness.workers) and the reference model (ncina.harness.reference)

def worker_spec(args: argparse.Namespace, mode: str, **extra: Any) -> dict[str, Any]:
    """What every worker process of a run reads (``ncina.harness.workers``): the job as its
    options (``JobSpec.to_args``), so that every field of it reaches the workers; under a leaf
    (``leaf_workers`` in ``extra``) the leaf's job, whose total is the run's workers."""
    leaf = extra.get("leaf_workers")
    tree = {"workers": leaf, "total_workers": args.workers} if leaf else {}
    return {
        "mode": mode, "job_args": JobSpec.from_args(args, job=JOB, **tree).to_args(),
        "workers": args.workers, "elements": args.elements, "seed": args.seed,
        "timeout": args.timeout, "deadline": args.deadline, "start_timeout": START_TIMEOUT,
        **extra,
    }  # fmt: skip



def reference(args: argparse.Namespace) -> Reference:
    """The reference model of the run ``args`` describes (``ncina.harness.reference``)."""
    return build_reference(workers=args.workers, elements=args.elements, seed=args.seed,
                           window_max=args.window_max,
                           sum_bits=nc8.sum_bits(FORMATS[args.result]),
                           profile=args.profile)  # fmt: skip


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
    """``ncina aggregator`` options of the benchmark's job (backend and address aside): every
    field of it an aggregator takes (``JobSpec.to_args``, the aggregator's role)."""
    return [
        *JobSpec.from_args(args, job=JOB).to_args(role="aggregator"),
        "--seed", str(args.seed), "--stats", str(stats_path),
    ]  # fmt: skip


def check_dpdk(mtu: int) -> None:
    """Raise with the reason when the dpdk backend cannot run here."""
    from ncina.aggregator.backends.dpdk import binding, netns

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
        run, ina_cpu = cpu.measure(
            lambda: run_workers(spec, directory / "ina", local_launch, args.deadline + 60),
            [aggregator.pid])
    finally:
        aggproc.stop(aggregator)
    job = json.loads(stats_path.read_text())["jobs"][str(JOB)]
    result = np.load(result_path)
    result_path.unlink()
    spec = worker_spec(args, "gloo", master=["127.0.0.1", free_tcp_port()],
                       ifaces=["lo"] * args.workers)  # fmt: skip
    gloo = run_workers(spec, directory / "gloo", local_launch, args.deadline + 60)
    figures = repeat_figures(args, ref, run.reports, gloo.reports, result, ina_cpu)
    return figures | {"job": job}


def repeat_figures(
    args: argparse.Namespace, ref: Reference, ina: list[dict[str, Any]],
    gloo: list[dict[str, Any]], result: np.ndarray, ina_cpu: cpu.Usage,
) -> dict[str, Any]:  # fmt: skip
    """The figures of one run from its worker reports, rank 0's INA result and the CPU time
    of the aggregators' processes over the INA run (``ina_cpu``; idle, they use none): a
    side's ``cpu_s`` adds its ranks' own CPU time during the call and the CPU time no process
    was charged over the ranks' common window (``cpu.window_unattributed_s``: the kernel's
    packet work on idle CPUs and in ksoftirqd; each CPU-second counted once)."""
    mismatches = exact_mismatches(result, ref.sums, ref.window, args.workers, args.result)
    worker_cpu = sum(r["cpu"] for r in ina)
    gloo_worker_cpu = sum(r["cpu"] for r in gloo)
    kernel, gloo_kernel = cpu.window_unattributed_s(ina), cpu.window_unattributed_s(gloo)
    retransmissions = sum(r["stats"]["retransmissions"] for r in ina)
    return {
        "wall_s": wall_time(ina),
        "gloo_wall_s": wall_time(gloo),
        "exact": mismatches == 0 and len({r["digest"] for r in ina}) == 1,
        "exact_mismatches": mismatches,
        "identical": len({r["digest"] for r in ina}) == 1,
        "peak_rss": [r["peak_rss"] for r in ina],
        "gloo_peak_rss": [r["peak_rss"] for r in gloo],
        "worker_cpu": worker_cpu,
        "aggregator_cpu": ina_cpu.processes_s,
        "unattributed_s": kernel,
        "gloo_unattributed_s": gloo_kernel,
        "cpu_s": worker_cpu + ina_cpu.processes_s + kernel,
        "gloo_cpu_s": gloo_worker_cpu + gloo_kernel,
        "workers": [r["stats"] for r in ina],
        "packets": job_packets(args.workers, args.elements, args.k, retransmissions),
        "retx_fraction": retx_fraction(r["stats"] for r in ina),
        "accuracy": accuracy(ref, result, args.result),
    }


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
                from ncina.aggregator.backends.dpdk import netns

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
        "repeat": args.repeat, "profile": args.profile,
    }  # fmt: skip
    figures |= medians(repeats, workers=args.workers, elements=args.elements)
    figures |= per_packet(repeats)
    loopback_mtu = int(Path("/sys/class/net/lo/mtu").read_text())
    figures |= conditions(args.backend, args.mtu, loopback_mtu)
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
        "unattributed_s": round(chosen["unattributed_s"], 3),
        "gloo_unattributed_s": round(chosen["gloo_unattributed_s"], 3),
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
