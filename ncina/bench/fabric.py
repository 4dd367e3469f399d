"""``ncina bench fabric``: the INA all-reduce and gloo's ring all-reduce over a Mininet fabric.

The network is the project's star (``ncina.topo``): ``--workers`` hosts, each on a link shaped to
``--bw`` Mbit/s (tc HTB on both ends, Mininet's TCLink), and the aggregator on a host of its own
behind an unshaped link (it stands in for the switch's data plane), all on one Linux bridge (no
Open vSwitch). Node and interface names carry a per-process prefix. Each repeat starts a fresh
``ncina aggregator --backend B`` on the aggregator host and one worker process per worker host
(``ncina.bench.worker``: one ``AllreduceClient``) for the INA all-reduce of ``--elements`` float32
elements per worker, then runs gloo's all-reduce of the same tensors over the same links; both
warm up, start at one instant and time the all-reduce call alone (as ``bench allreduce``).

``link_fraction`` is the bit rate the INA all-reduce put on a worker's uplink, whole frames
(Ethernet, IPv4, UDP and ncina headers included), over the link's bandwidth: the bytes are the
switch port's receive counter of that worker's link, read just before the start and after the
last worker ended, divided by the wall time; the figure is the mean over the workers (each run's
per-worker values are kept). ``gloo_link_fraction`` is the same for gloo's TCP traffic.
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
from pathlib import Path
from typing import Any

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.bench import allreduce as bench
from ncina.progress import progress
from ncina.proto.header import PORT
from ncina.proto.wire import DEFAULT_MTU

GLOO_PORT = 29500  # gloo's rendezvous on worker 0; + repeat, so no run meets a TIME_WAIT
MIN_TIME_LIMIT = 120.0  # seconds one all-reduce may take at least (see time_limit)


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
    )
    bench.add_common_arguments(p, backend=default_backend(), workers=4)
    p.add_argument("--bw", type=float, default=100.0,
                   help="Mbit/s of each worker's link (default: %(default)s)")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the logs and stats here (default: a temporary directory)")
    return p


def link_fraction(frame_bytes: int, seconds: float, bw_mbit: float) -> float:
    """The share of a ``bw_mbit`` Mbit/s link that ``frame_bytes`` bytes of frames in
    ``seconds`` take."""
    return frame_bytes * 8 / seconds / (bw_mbit * 1e6)


def time_limit(args: argparse.Namespace) -> float:
    """Seconds one all-reduce may take: three times what gloo's ring needs on the links
    (each worker sends about twice its tensor), and at least ``MIN_TIME_LIMIT``."""
    return max(MIN_TIME_LIMIT, 3 * 2 * 32 * args.elements / (args.bw * 1e6) + args.deadline)


def check_arguments(args: argparse.Namespace) -> None:
    """Reject what cannot run before any network is built."""
    if os.geteuid() != 0:
        raise RuntimeError("bench fabric needs root (Mininet)")
    if not args.bw > 0:
        raise ValueError(f"--bw must be positive, not {args.bw:g}")
    if args.backend == "dpdk":
        bench.check_dpdk(args.mtu)
    bench.check_arguments(args)


def uplink_ports(net: Any, topo: Any) -> list[str]:
    """The switch-side interface of each worker's link, in rank order: its receive counters
    count what the worker put on its uplink."""
    switch = net.get(topo.switch_name)
    ports = []
    for name in topo.worker_names:
        [link] = net.linksBetween(net.get(name), switch)
        ports.append((link.intf1 if link.intf1.node is switch else link.intf2).name)
    return ports


def rx_bytes(ports: list[str]) -> list[int]:
    """Receive byte counters of interfaces of this namespace (the bridge's ports)."""
    return [int(Path("/sys/class/net", p, "statistics", "rx_bytes").read_text()) for p in ports]


def fractions(before: list[int], after: list[int], seconds: float, bw: float) -> list[float]:
    """Per worker, the link fraction of the bytes counted between ``before`` and ``after``."""
    return [round(link_fraction(a - b, seconds, bw), 4) for b, a in zip(before, after, strict=True)]


def one_repeat(
    args: argparse.Namespace, net: Any, topo: Any, procs: Any, directory: Path, index: int,
    ref: bench.Reference,
) -> dict[str, Any]:  # fmt: skip
    """One INA all-reduce through a fresh aggregator and one gloo all-reduce on the fabric."""
    from ncina.topo.topos import aggregator_ip, worker_ip

    directory.mkdir(parents=True, exist_ok=True)
    hosts = [net.get(name) for name in topo.worker_names]
    ports = uplink_ports(net, topo)

    def launch(rank: int, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        return procs.start(hosts[rank], argv, log)

    def probe() -> list[int]:
        return rx_bytes(ports)

    agg_host = net.get(topo.aggregator_names[0])
    address = (aggregator_ip(0), PORT)
    stats_path, log_path = directory / "aggregator-stats.json", directory / "aggregator.log"
    argv = [sys.executable, "-m", "ncina.cli", "aggregator", "--backend", args.backend,
            "--listen", f"{address[0]}:{PORT}", *bench.aggregator_arguments(args, stats_path)]
    if args.backend == "dpdk":  # the data plane serves the host's interface
        from ncina.aggregator.dpdk import netns

        argv += [*netns.prepare_host(agg_host), "--vdev-options", bench.DPDK_VDEV_OPTIONS]
    aggregator = procs.start(agg_host, argv, log_path)
    result_path = directory / "result.npy"
    try:
        aggproc.wait_ready(aggregator, log_path, bench.START_TIMEOUT)
        spec = bench.worker_spec(args, "ina", aggregator=list(address),
                                 result_path=str(result_path))  # fmt: skip
        ina = bench.run_workers(spec, directory / "ina", launch, time_limit(args), probe)
    finally:
        procs.stop([aggregator])
    job = json.loads(stats_path.read_text())["jobs"][str(bench.JOB)]
    result = np.load(result_path)
    result_path.unlink()
    spec = bench.worker_spec(args, "gloo", master=[worker_ip(0), GLOO_PORT + index],
                             ifaces=[h.defaultIntf().name for h in hosts])  # fmt: skip
    gloo = bench.run_workers(spec, directory / "gloo", launch, time_limit(args), probe)
    figures = bench.repeat_figures(args, ref, ina.reports, gloo.reports, result)
    ina_links = fractions(ina.before, ina.after, figures["wall_s"], args.bw)
    gloo_links = fractions(gloo.before, gloo.after, figures["gloo_wall_s"], args.bw)
    figures["extra"] = {
        "link_fraction": round(statistics.mean(ina_links), 4),
        "link_fractions": ina_links,
        "gloo_link_fraction": round(statistics.mean(gloo_links), 4),
        "gloo_link_fractions": gloo_links,
        "uplink_bytes": [a - b for b, a in zip(ina.before, ina.after, strict=True)],
        "retransmissions": sum(w["retransmissions"] for w in figures["workers"]),
    }
    figures["job"] = job
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the fabric, run ``--repeat`` INA and gloo all-reduces on it, remove it."""
    check_arguments(args)
    from ncina.topo.config import TopoConfig
    from ncina.topo.runner import Processes, build_net, check_backend, set_mtu

    check_backend(args.backend)
    with tempfile.TemporaryDirectory(prefix="ncina-fabric-") as tmp:
        workdir = args.workdir or Path(tmp)
        cfg = TopoConfig(out=workdir, workers=args.workers, backend=args.backend, bw=args.bw,
                         prefix=f"b{os.getpid() % 100000}")  # fmt: skip
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
        "result": args.result, "repeat": args.repeat,
        "link_fraction": median(r["extra"]["link_fraction"] for r in repeats),
        "gloo_link_fraction": median(r["extra"]["gloo_link_fraction"] for r in repeats),
    }  # fmt: skip
    figures |= bench.medians(args, repeats)
    figures["retransmissions"] = median(r["extra"]["retransmissions"] for r in repeats)
    return figures
