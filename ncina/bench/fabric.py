"""``ncina bench fabric``: the INA all-reduce and gloo's ring all-reduce over a Mininet fabric.

The network is the project's star (``ncina.topo``): ``--workers`` hosts, each on a link shaped to
``--bw`` Mbit/s (tc HTB on both ends, Mininet's TCLink), and the aggregator on a host of its own
behind an unshaped link (it stands in for the switch's data plane), all on one Linux bridge (no
Open vSwitch). Node and interface names carry a per-process prefix. Each repeat starts a fresh
``ncina aggregator --backend B`` on the aggregator host and one worker process per worker host
(``ncina.harness.workers``: one ``AllreduceClient``) for the INA all-reduce of ``--elements``
float32 elements per worker, then runs gloo's all-reduce of the same tensors over the same
links; both warm up, start at one instant and time the all-reduce call alone (as
``bench allreduce``).

``link_fraction`` is the useful bit rate of the INA all-reduce on a worker's uplink over the
link's bandwidth: the frames that carry each of the worker's chunks once (Ethernet, IPv4, UDP
and ncina headers included: ``ncina.harness.links.useful_frame_bytes``), over the wall time.
Retransmitted copies take the link but do no work, so they are left out of it and counted in
``wire_fraction``: everything on the wire, the bytes the HTB class of the worker's end of its
link sent (every GSO or TSO segment with its headers: ``ncina.harness.links``) between just
before the start and after the last worker ended, over the wall time, the mean over the
workers (each run's per-worker values are kept as ``wire_fractions``).
``gloo_link_fraction`` is gloo's TCP traffic on the wire the same way (TCP's copies cannot be
told apart there).

In a star each repeat then measures the fabric's own packet limit at the job's packet size
(``ncina.harness.echo``: the socket backend's no-op forwarder on the aggregator's host, a C
closed-loop echo load on every worker host, for ``--limit-seconds``): ``fabric_limit_pps``, and
``vs_fabric_limit``, INA's datagrams per second over it (refused with the reason when the echo
answered nothing, retransmitted or could not run).

The links' checksum offloads are on where the fabric allows them (a star, python or socket
backend; ``--no-offloads`` turns them off; ``ncina.topo.topos.link_options``): the workers' and
the socket aggregator's UDP GSO runs then cross the fabric whole instead of being cut into
datagrams at the sender's veth (docs/performance.md, "The workers' packet path at K = 64");
HTB still counts and charges every datagram. The echo batches as the workers do (GSO runs out,
GRO buffers in), so that its runs cross whole too.

``--bw`` and ``--mtu`` take comma-separated lists (``--bw 100,200,500,1000 --mtu 1500,9000``):
then every pair runs on a fabric of its own, in one invocation, and the figures are ``rows``
(one single-pair result each) and ``faithful_bw_mbit``, per MTU the highest bandwidth whose
``link_fraction`` reached ``FAITHFUL_LINK_FRACTION``: the fastest link this machine emulates
with its software out of the way (and ``faithful_bw_mbit_per_k``, the same per K).

``--topo leafspine`` builds ``ncina topo``'s leaf-spine fabric instead (docs/protocol.md,
"Hierarchical aggregation"): ``--leaves`` leaf switches, each with ``--workers / --leaves``
workers and a leaf aggregator, joined by leaf uplinks shaped like the worker links to a spine
switch with the spine aggregator. The workers reach their leaf, the leaves the spine;
``leaf_link_fraction`` is ``link_fraction`` of the leaf uplinks (the spine switch's receive
counters: the leaves' int partial sums, 8 bytes per element against a worker's 1). The result
is checked against the reference model as in a star: the tree's sum is the one-level sum.
Everything started here is stopped by PID and the network is removed on the way out, on error
and on Ctrl-C or SIGTERM alike (never by Mininet's machine-wide cleanup). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.bench import allreduce as bench
from ncina.common import cpu
from ncina.common.options import positive_int
from ncina.common.progress import progress
from ncina.harness import echo
from ncina.harness.figures import (
    faithful_bandwidths,
    ina_advantage,
    medians,
    per_packet,
)
from ncina.harness.links import (
    fractions,
    ina_link_figures,
    sent_bytes,
    time_limit,
    uplinks,
    useful_frame_bytes,
)
from ncina.harness.reference import Reference
from ncina.harness.workers import START_TIMEOUT, run_workers
from ncina.proto.header import PORT
from ncina.proto.job import JobSpec, job_args
from ncina.proto.wire import DEFAULT_MTU

FAITHFUL_LINK_FRACTION = 0.9
"""A run whose INA all-reduce used at least this share of its links measured the fabric, not
this machine's CPU."""
ECHO_START_S = 3.0
"""Seconds from starting the echo loads to their common start instant (a Python start each)."""
ECHO_RETX_AFTER = 1.0
"""Seconds without an echo before the echo load re-sends: a stall of the loaded machine's
scheduler is no loss, and a yardstick that retransmitted is refused."""
GLOO_PORT = 29500  # gloo's rendezvous on worker 0; + repeat, so no run meets a TIME_WAIT


def default_backend() -> str:
    """``socket`` (the C aggregator on kernel sockets) where ``ncina aggregator`` has it, else
    ``python``."""
    return "socket" if "socket" in bench.backends() else "python"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench fabric``."""
    p = subparsers.add_parser(
        "fabric",
        help="INA vs gloo all-reduce over a bandwidth-limited Mininet fabric (root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # --mtu takes a list here
    )
    bench.add_common_arguments(p, backend=default_backend(), workers=4)
    p.add_argument("--bw", type=number_list(float), default=[100.0], metavar="MBIT[,MBIT...]",
                   help="Mbit/s of each worker's link; a list runs each (default: 100)")
    p.add_argument("--mtu", type=number_list(int), default=[DEFAULT_MTU],
                   metavar="MTU[,MTU...]",
                   help="MTU whose largest K is the default --k; a list runs each "
                   f"(default: {DEFAULT_MTU})")  # fmt: skip
    p.add_argument("--topo", choices=("star", "leafspine"), default="star",
                   help="star: every worker and the aggregator on one switch; leafspine: "
                   "--leaves leaf switches, each with its workers and a leaf aggregator, under a "
                   "spine switch with the spine aggregator (the default --k is then the "
                   "largest for int lanes) "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--leaves", type=positive_int, default=2,
                   help="leafspine: leaf switches, each with --workers / LEAVES workers "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--limit-seconds", type=float, default=3.0, metavar="S",
                   help="star: seconds of the no-op echo at the job's packet size that "
                   "measures the fabric's own packet limit after each repeat (vs_fabric_limit; "
                   "0: none) (default: %(default)s)")  # fmt: skip
    p.add_argument("--offloads", action=argparse.BooleanOptionalAction, default=None,
                   help="the links' checksum offloads, so that the workers' and the "
                   "aggregator's UDP GSO runs (and gloo's TSO segments) cross the fabric whole "
                   "(default: on for a star with the python or socket backend; off elsewhere, "
                   "where --offloads is refused)")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the logs and stats here (default: a temporary directory)")
    return p


def number_list(kind: type[float] | type[int]) -> Any:
    """An argparse type: one number or a comma-separated list of them, each positive."""

    def parse(text: str) -> list[Any]:
        try:
            values = [kind(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             f"{kind.__name__}s") from None  # fmt: skip
        if not all(v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"every value of {text!r} must be positive")
        return values

    return parse


def check_arguments(args: argparse.Namespace) -> None:
    """Reject what cannot run before any network is built."""
    if os.geteuid() != 0:
        raise RuntimeError("bench fabric needs root (Mininet)")
    job = {}
    if args.topo == "leafspine":  # every backend of --backend serves as a leaf and a spine
        if args.workers % args.leaves:
            raise ValueError(f"--workers {args.workers} cannot be split evenly over --leaves "
                             f"{args.leaves}")  # fmt: skip
        # a leaf's job: its K (default: int lanes, the partial sums going up) and the window
        job = {"workers": args.workers // args.leaves, "total_workers": args.workers}
    if args.backend == "dpdk":
        bench.check_dpdk(args.mtu)
    bench.check_arguments(args, **job)


def one_repeat(
    args: argparse.Namespace, net: Any, topo: Any, procs: Any, directory: Path, index: int,
    ref: Reference,
) -> dict[str, Any]:  # fmt: skip
    """One INA all-reduce through a fresh aggregator and one gloo all-reduce on the fabric."""
    from ncina.topo.topos import worker_ip

    directory.mkdir(parents=True, exist_ok=True)
    limit = time_limit(args.elements, args.bw, args.deadline)
    hosts = [net.get(name) for name in topo.worker_names]
    # The workers' uplinks, then (leaf-spine) the leaves' uplinks, counted over the timed call.
    w = args.workers
    ends = uplinks(net, topo) + leaf_uplinks(net, topo)

    def launch(rank: int, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        return procs.start(hosts[rank], argv, log)

    def probe() -> list[int]:
        return sent_bytes(ends)

    aggregators, stats_paths, where = start_aggregators(args, net, topo, procs, directory)
    result_path = directory / "result.npy"
    try:
        spec = bench.worker_spec(args, "ina", result_path=str(result_path), **where)
        ina, ina_cpu = cpu.measure(
            lambda: run_workers(spec, directory / "ina", launch, limit, probe),
            [a.pid for a in aggregators])
    finally:
        procs.stop(aggregators)
    # The job as a whole: the one aggregator's, or in a tree the spine's (its stats come last).
    job = json.loads(stats_paths[-1].read_text())["jobs"][str(bench.JOB)]
    result = np.load(result_path)
    result_path.unlink()
    spec = bench.worker_spec(args, "gloo", master=[worker_ip(0), GLOO_PORT + index],
                             ifaces=[h.defaultIntf().name for h in hosts])  # fmt: skip
    gloo = run_workers(spec, directory / "gloo", launch, limit, probe)
    figures = bench.repeat_figures(args, ref, ina.reports, gloo.reports, result, ina_cpu)
    gloo_links = fractions(gloo.before[:w], gloo.after[:w], figures["gloo_wall_s"], args.bw)
    figures["extra"] = {
        **ina_link_figures(ina.before[:w], ina.after[:w], figures["wall_s"], args),
        "gloo_link_fraction": round(statistics.mean(gloo_links), 4),
        "gloo_link_fractions": gloo_links,
        "gloo_uplink_bytes": [a - b for b, a in zip(gloo.before[:w], gloo.after[:w], strict=True)],
        "uplink_bytes": [a - b for b, a in zip(ina.before[:w], ina.after[:w], strict=True)],
        "retransmissions": sum(w["retransmissions"] for w in figures["workers"]),
    }
    if len(ends) > w:
        leaf_links = fractions(ina.before[w:], ina.after[w:], figures["wall_s"], args.bw)
        figures["extra"] |= {"leaf_link_fraction": round(statistics.mean(leaf_links), 4),
                             "leaf_link_fractions": leaf_links}  # fmt: skip
    if args.topo == "star" and args.limit_seconds > 0:
        figures["extra"] |= fabric_limit(args, net, topo, procs, directory / "echo", hosts)
    figures["job"] = job
    return figures


def fabric_limit(
    args: argparse.Namespace, net: Any, topo: Any, procs: Any, directory: Path, hosts: list[Any]
) -> dict[str, Any]:  # fmt: skip
    """The fabric's own packet limit at the job's packet size (``ncina.harness.echo``): the
    socket backend's no-op forwarder on the aggregator's host, an echo load on every worker
    host for ``--limit-seconds`` from one instant; ``echo.limit_figures`` of their counters, or
    of none with the reason when the echo could not run."""
    from ncina.topo.topos import aggregator_ip, worker_ip

    directory.mkdir(parents=True, exist_ok=True)
    frame = useful_frame_bytes(args.k, args.k)  # one chunk's frame

    def refused(error: str) -> dict[str, Any]:
        return echo.limit_figures([], frame, args.bw, error=error)

    if "socket" not in bench.backends():
        return refused("the socket backend's no-op forwarder is not built here")
    try:
        from ncina.aggregator.backends.dpdk.binding import load

        load()  # build the load generator once, before every host imports it
    except (RuntimeError, ImportError) as e:
        return refused(f"no echo load generator: {e}")
    log_path, stats_path = directory / "forwarder.log", directory / "forwarder.json"
    argv = [sys.executable, "-m", "ncina.cli", "aggregator", "--backend", "socket",
            "--socket-mode", "forward", "--listen", f"{aggregator_ip(0)}:{PORT}",
            *bench.aggregator_arguments(args, stats_path)]  # fmt: skip
    forwarder = procs.start(net.get(topo.aggregator_names[0]), argv, log_path)
    loads = []
    try:
        aggproc.wait_ready(forwarder, log_path, START_TIMEOUT)
        start_at = time.monotonic() + ECHO_START_S
        for rank, host in enumerate(hosts):
            loads.append(procs.start(host, [
                sys.executable, "-m", "ncina.harness.echo",
                "--target", f"{aggregator_ip(0)}:{PORT}", "--bind", worker_ip(rank),
                *job_args(k=args.k), "--window", str(args.pool_size),
                "--seconds", str(args.limit_seconds), "--retx-after", str(ECHO_RETX_AFTER),
                "--start-at", str(start_at), "--output", str(directory / f"echo{rank}.json"),
            ], directory / f"echo{rank}.log"))  # fmt: skip
        deadline = start_at + args.limit_seconds + START_TIMEOUT
        for rank, proc in enumerate(loads):
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                tail = (directory / f"echo{rank}.log").read_text()[-300:]
                return refused(f"the echo load of rank {rank} exited {rc}: {tail}")
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return refused(f"the echo did not run: {e}")
    finally:
        procs.stop([*loads, forwarder])
    counters = [json.loads((directory / f"echo{r}.json").read_text()) for r in range(len(hosts))]
    return echo.limit_figures(counters, frame, args.bw) | {"fabric_limit_hosts": counters}


def start_aggregators(
    args: argparse.Namespace, net: Any, topo: Any, procs: Any, directory: Path
) -> tuple[list[subprocess.Popen[bytes]], list[Path], dict[str, Any]]:
    """Start the run's aggregator (star) or its tree (the spine, then each leaf with
    ``--upstream`` the spine) on fresh processes and wait until they serve; return them, their
    stats files (the spine's last) and what the worker spec needs to reach them."""
    from ncina.topo.topos import aggregator_ip

    def start(j: int, extra: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        stats_path, log_path = directory / f"aggregator{j}.json", directory / f"aggregator{j}.log"
        host = net.get(topo.aggregator_names[j])
        argv = [sys.executable, "-m", "ncina.cli", "aggregator", "--backend", args.backend,
                "--listen", f"{aggregator_ip(j)}:{PORT}",
                *bench.aggregator_arguments(args, stats_path), *extra]  # fmt: skip
        if args.backend == "dpdk":  # the data plane serves the host's interface
            from ncina.aggregator.backends.dpdk import netns

            argv += [*netns.prepare_host(host), "--vdev-options", bench.DPDK_VDEV_OPTIONS]
        proc = procs.start(host, argv, log_path)
        try:
            aggproc.wait_ready(proc, log_path, START_TIMEOUT)
        except RuntimeError:
            procs.stop([proc])
            raise
        return proc, stats_path

    if args.topo == "star":
        proc, stats_path = start(0, [])
        return [proc], [stats_path], {"aggregator": [aggregator_ip(0), PORT]}
    leaves = args.leaves
    total = str(args.workers)
    spine, spine_stats = start(leaves, ["--workers", str(leaves), "--total-workers", total,
                                        "--uplink", "int"])  # fmt: skip
    started, stats_paths = [], []
    try:
        for i in range(leaves):
            proc, stats_path = start(i, [
                "--workers", str(args.workers // leaves), "--total-workers", total,
                "--upstream", f"{aggregator_ip(leaves)}:{PORT}", "--upstream-rank", str(i),
            ])  # fmt: skip
            started.append(proc)
            stats_paths.append(stats_path)
    except RuntimeError:
        procs.stop([*started, spine])
        raise
    where = {
        "aggregator": [aggregator_ip(leaves), PORT],
        "leaves": [[aggregator_ip(i), PORT] for i in range(leaves)],
        "leaf_workers": args.workers // leaves,
    }
    return [*started, spine], [*stats_paths, spine_stats], where


def leaf_uplinks(net: Any, topo: Any) -> list[Any]:
    """The leaf switch's end of each leaf switch's uplink, in leaf order (none in a star): its
    HTB class counts what the leaf sent up."""
    spine = net.get(topo.switch_name)
    ends = []
    for name in getattr(topo, "leaf_switch_names", []):
        [link] = net.linksBetween(net.get(name), spine)
        ends.append(link.intf2 if link.intf1.node is spine else link.intf1)
    return ends


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One fabric per ``--bw`` and ``--mtu`` pair: its figures alone, or the rows of every pair
    and the highest faithful bandwidth per MTU."""
    pairs = [(bw, mtu) for mtu in args.mtu for bw in args.bw]
    rows = []
    for bw, mtu in pairs:
        row = argparse.Namespace(**{**vars(args), "bw": bw, "mtu": mtu})
        if args.workdir is not None and len(pairs) > 1:
            row.workdir = args.workdir / f"bw{bw:g}-mtu{mtu}"
        rows.append(run_one(row))
    if len(rows) == 1:
        return rows[0]
    faithful = faithful_bandwidths(rows, args.mtu, FAITHFUL_LINK_FRACTION)
    per_k = faithful_bandwidths(rows, sorted({r["k"] for r in rows}), FAITHFUL_LINK_FRACTION,
                                key="k")  # fmt: skip
    return {"rows": rows, "faithful_bw_mbit": faithful, "faithful_bw_mbit_per_k": per_k,
            "faithful_link_fraction": FAITHFUL_LINK_FRACTION, "cores": os.cpu_count()}


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Build the fabric, run ``--repeat`` INA and gloo all-reduces on it, remove it."""
    check_arguments(args)
    from ncina.topo.config import TopoConfig
    from ncina.topo.runner import Processes, build_net, check_backend, set_mtu

    check_backend(args.backend)
    with tempfile.TemporaryDirectory(prefix="ncina-fabric-") as tmp:
        workdir = args.workdir or Path(tmp)
        cfg = TopoConfig(out=workdir, workers=args.workers, backend=args.backend, bw=args.bw,
                         topo=args.topo, leaves=args.leaves,
                         job=JobSpec(job=bench.JOB, workers=args.workers, k=args.k,
                                     mtu=args.mtu),
                         prefix=f"b{os.getpid() % 100000}", offloads=args.offloads)  # fmt: skip
        args.offloads = cfg.offloads  # the default resolved: on where the fabric allows it
        ref = bench.reference(args)
        net, topo = build_net(cfg)
        procs = Processes()
        with bench.sigterm_interrupts():
            try:
                net.start()
                if args.mtu != DEFAULT_MTU:
                    set_mtu(net, args.mtu)
                runs = progress(range(args.repeat), desc="bench fabric", unit="run")
                repeats = [one_repeat(args, net, topo, procs, workdir / f"run{i}", i, ref)
                           for i in runs]  # fmt: skip
            finally:
                procs.stop_all()
                net.stop()
    median = statistics.median_low
    figures: dict[str, Any] = {
        "backend": args.backend, "workers": args.workers, "elements": args.elements,
        "bw_mbit": args.bw, "k": args.k, "mtu": args.mtu, "pool_size": args.pool_size,
        "result": args.result, "repeat": args.repeat, "topo": args.topo,
        "profile": args.profile,
        "link_fraction": median(r["extra"]["link_fraction"] for r in repeats),
        "wire_fraction": median(r["extra"]["wire_fraction"] for r in repeats),
        "gloo_link_fraction": median(r["extra"]["gloo_link_fraction"] for r in repeats),
        "offloads": args.offloads,
    }  # fmt: skip
    figures |= medians(repeats, workers=args.workers, elements=args.elements)
    figures |= per_packet(repeats)
    # What INA's advantage in bytes is made of, in theory, and gloo's bytes over INA's useful
    # ones as measured on the uplinks (the two differ by the headers and gloo's ACKs, copies)
    useful = useful_frame_bytes(args.elements, args.k)
    figures["advantage"] = {
        **ina_advantage(args.workers),
        "measured_bytes_ratio": round(median(statistics.mean(r["extra"]["gloo_uplink_bytes"])
                                             / useful for r in repeats), 3),
    }  # fmt: skip
    figures["retransmissions"] = median(r["extra"]["retransmissions"] for r in repeats)
    if "fabric_limit_pps" in repeats[0]["extra"]:
        figures |= echo.limit_ratio(repeats, args.workers, args.elements, args.k)
    if args.topo == "leafspine":
        figures["leaves"] = args.leaves
        figures["leaf_link_fraction"] = median(r["extra"]["leaf_link_fraction"] for r in repeats)
    return figures
