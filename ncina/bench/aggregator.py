"""``ncina bench aggregator``: aggregator throughput over veth, as ratios measured in one run.

Four emulated workers (one connected UDP socket each, driven by a C closed loop: a window of
slots per rank, the next chunk into a slot when its result is back) send K-element NC8 chunks
through a Linux bridge and a veth pair to an aggregator in its own namespace. The same load runs
against the chosen backend (dpdk; socket: the C engine behind a kernel UDP socket; or bmv2: the
P4 program on simple_switch_grpc), the Python backend, and a no-op forwarder on the chosen
backend's I/O path (it echoes every datagram: one reply per packet, like the aggregator; the I/O
limit of this machine): DPDK's on the af_packet path, for socket the socket backend's own
(``--socket-mode forward``). Needs root and DPDK (``apt-get install dpdk libdpdk-dev``; the load
generator is in its extension); bmv2 needs p4c and BMv2 too (docs/bmv2.md). For bmv2 the run
also measures the same simple_switch_grpc running p4/echo/echo.p4, a P4 program that only echoes
each datagram (``--bmv2-mode forward``), and reports ``vs_forwarder``: how close the aggregator
program comes to what BMv2 itself forwards; ``--profile tofino`` measures the Tofino program's
v1model twin (p4/twin/) instead of p4/, beside the same echo, at the twin's K and with int
results unless ``--k`` and ``--result`` say otherwise (``ncina.proto.profiles``).

``--lcores 1,2`` measures the DPDK aggregator and its forwarder at each strand count (docs/dpdk.md,
"Several lcores") in the same run and reports ``lcores_scaling``: completed work at the last
count over completed work at the first. ``--repeat R`` runs every measurement R times,
interleaved, and reports the run of median completed work (all runs' rates are kept as
``completed_per_s_runs`` and ``packets_per_s_runs``).

Every figure of work, and so every ratio, counts what came back answered (``completed_per_s``:
chunks whose result, or echo, reached their rank), never what was sent: a baseline that
answered nothing still sends its retransmissions. A ratio whose baseline failed, completed
nothing or retransmitted is not printed: the JSON has None and ``<ratio>_refused``, the reason.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ncina.aggregator import process as aggproc
from ncina.common.options import deprecated_alias
from ncina.common.progress import progress
from ncina.harness.load_figures import load_figures, median_run, put_ratios
from ncina.proto.header import PORT
from ncina.proto.job import JobSpec
from ncina.proto.profiles import TOFINO, TOFINO_MAX_K, TOFINO_NC8_MAX_K, tofino_max_k

JOB = 1
K = 256
"""The benchmark's K without ``--k`` (the default profile)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench aggregator``."""
    p = subparsers.add_parser(
        "aggregator",
        help="aggregator packets/s and elements/s over veth, against Python and a no-op forwarder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=("dpdk", "socket", "python", "bmv2"), default="dpdk",
                   help="the backend measured (default: %(default)s)")  # fmt: skip
    job = JobSpec.add_arguments(p, "workers", "k", "pool_size", workers=4, k=None, rules={
        "k": f"{K}; the Tofino design's {TOFINO_MAX_K} with --profile tofino "
        f"({TOFINO_NC8_MAX_K} with --result nc8)"})  # fmt: skip
    deprecated_alias(p, "--window", job["pool_size"])
    p.add_argument("--seconds", type=float, default=5.0,
                   help="duration of each measurement (default: %(default)s)")  # fmt: skip
    JobSpec.add_arguments(p, "result", result=None,
                          rules={"result": "nc8; int with --profile tofino"})  # fmt: skip
    timeout = p.add_argument("--timeout", type=float, default=0.05, metavar="S",
                             help="the load generator re-sends a slot unanswered this long; raise "
                             "it for a slow switch (bmv2 at K=256: 1) (default: %(default)s)")
    deprecated_alias(p, "--retransmit-timeout", timeout)
    p.add_argument("--dpdk-pmd", choices=("af_packet", "af_xdp"), default="af_packet",
                   help="how the DPDK aggregator and forwarder attach to their veth "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--idle-sleep-us", type=int, default=20,
                   help="the DPDK loop's idle sleep (0: poll flat out) (default: %(default)s)")
    p.add_argument("--lcores", type=_lcores, default=(1,), metavar="N[,N...]",
                   help="dpdk: strand counts to measure the aggregator and forwarder at, e.g. 1,2 "
                   "(default: 1)")  # fmt: skip
    profile = JobSpec.add_arguments(p, "profile")["profile"]
    deprecated_alias(p, "--p4-profile", profile)  # the bmv2 program's, before --profile
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each measurement; the median's figures are reported "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=Path("runs/bench/aggregator"))
    return p


def _lcores(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of strand counts") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: strand counts are 1 or more")
    return counts


def measure(
    args: argparse.Namespace, job: JobSpec, star: Any, kind: str, lcores: int = 1
) -> dict[str, Any]:
    """One measurement of ``job`` (the options' ``JobSpec``): an aggregator of ``kind``
    (python, socket, dpdk, bmv2, forward: DPDK's no-op forwarder, socket_forward: the socket
    backend's) on a new site; the DPDK ones on ``lcores`` strands."""
    from ncina.aggregator.backends.dpdk.binding import load

    site = star.add_site()
    work = args.workdir / kind
    work.mkdir(parents=True, exist_ok=True)
    stats_path, log_path = work / "stats.json", work / "aggregator.log"
    backends = {"forward": "dpdk", "socket_forward": "socket", "bmv2_forward": "bmv2"}
    backend = backends.get(kind, kind)
    cmd = [
        sys.executable, "-m", "ncina.cli", "aggregator", "--backend", backend,
        *job.to_args("job", "workers", "k", "result", "pool_size"),
        "--seed", "1",
        "--stats", str(stats_path), "--stats-interval", "60", "--listen", f"{site.ip}:{PORT}",
    ]  # fmt: skip
    if backend in ("python", "socket"):  # a kernel socket needs the address on the interface
        subprocess.run(["ip", "-n", site.ns, "addr", "add", f"{site.ip}/24", "dev", site.iface],
                       check=True)  # fmt: skip
        if kind == "socket_forward":
            cmd += ["--socket-mode", "forward"]
    elif backend == "bmv2":  # the switch answers ARP and serves the site's address itself
        cmd += ["--iface", site.iface, "--switch-log", str(work / "switch.log")]
        if kind == "bmv2_forward":
            cmd += ["--bmv2-mode", "forward"]
        else:
            cmd += ["--profile", args.profile]
    else:
        cmd += ["--iface", site.iface, "--idle-sleep-us", str(args.idle_sleep_us),
                "--dpdk-pmd", args.dpdk_pmd, "--lcores", str(lcores)]  # fmt: skip
        if args.dpdk_pmd == "af_packet":
            cmd += ["--vdev-options", "framecnt=4096,qdisc_bypass=1"]
        if kind == "forward":
            cmd += ["--dpdk-mode", "forward"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(site.command(cmd), stdout=log, stderr=subprocess.STDOUT)
    try:
        # (bmv2 may first compile p4/ for K: minutes for K = 256)
        aggproc.wait_ready(proc, log_path, timeout=900.0 if backend == "bmv2" else 120.0)
        module = load()
        ffi, lib = module.ffi, module.lib
        socks = []
        for _ in range(job.workers):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            s.bind((star.host_ip, 0))
            s.connect((site.ip, PORT))
            socks.append(s)
        rng = np.random.default_rng(0)
        codes = (rng.integers(1, 20, job.k) | (rng.integers(0, 2, job.k) << 7)).astype(np.uint8)
        fds = ffi.new("int[]", [s.fileno() for s in socks])
        st = ffi.new("struct ncd_gen_stats *")
        before = aggproc.request_stats(proc, stats_path)
        rc = lib.ncd_gen_run(fds, job.workers, JOB, job.window.e_min, job.k, job.pool_size,
                             args.seconds, args.timeout, ffi.from_buffer(codes),
                             st)  # fmt: skip
        after = aggproc.request_stats(proc, stats_path)
        for s in socks:
            s.close()
        if rc != 0:
            raise ValueError("bad load parameters")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    job_b, job_a = before["jobs"][str(JOB)], after["jobs"][str(JOB)]
    return load_figures(st, slots_completed=job_a["slots_completed"] - job_b["slots_completed"],
                        k=job.k, lcores=lcores)  # fmt: skip


def bench_job(args: argparse.Namespace) -> JobSpec:
    """The measured job of the options: K and the result format as given, else ``K`` and nc8,
    or under ``--profile tofino`` the Tofino design's K and int results (what the twin
    returns). Raises ``ValueError`` for a job no backend runs (``JobSpec``)."""
    twin = args.profile == TOFINO
    result = args.result or ("int" if twin else "nc8")
    return JobSpec.from_args(args, job=JOB, k=args.k or (tofino_max_k(result) if twin else K),
                             result=result)  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the chosen backend, the Python backend and the no-op forwarder; return figures."""
    from ncina.aggregator.backends.dpdk import binding, netns

    if args.profile != "default" and args.backend != "bmv2":
        raise ValueError("--profile tofino is measured on the bmv2 backend only (the Tofino "
                         "program's twin beside the echo program)")
    job = bench_job(args)  # the job's validation, before anything is set up
    reason = netns.missing() or binding.missing()
    if reason:
        raise RuntimeError(f"the aggregator benchmark needs root and DPDK: {reason}")
    if args.backend == "bmv2":
        from ncina.aggregator.backends.bmv2 import toolchain

        reason = toolchain.missing()
        if reason:
            raise RuntimeError(f"the bmv2 benchmark cannot run: {reason}")
    if args.repeat < 1:
        raise ValueError("--repeat must be 1 or more")
    dpdk_kinds = ("dpdk", "forward")
    if args.lcores != (1,) and args.backend != "dpdk":
        raise ValueError("--lcores is the dpdk backend's")
    star = netns.Star.create()
    figures: dict[str, Any] = {
        "workers": job.workers, "k": job.k, "pool_size": job.pool_size,
        "result": job.result.name.lower(),
        "seconds": args.seconds, "backend": args.backend,
        "timeout": args.timeout, "dpdk_pmd": args.dpdk_pmd, "repeat": args.repeat,
        "lcores": list(args.lcores), "profile": args.profile,
    }  # fmt: skip
    forward = "socket_forward" if args.backend == "socket" else "forward"
    kinds = ["python", forward] + ([args.backend] if args.backend != "python" else [])
    if args.backend == "bmv2":  # the same switch running a program that only echoes
        kinds.append("bmv2_forward")
    # Every (kind, strand count) measured once per repeat, interleaved: slow drifts of a shared
    # machine's load spread over all of them.
    plan = [(kind, n) for kind in kinds
            for n in (args.lcores if kind in dpdk_kinds else args.lcores[:1])]  # fmt: skip
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in plan}
    try:
        steps = [key for _ in range(args.repeat) for key in plan]
        for kind, n in progress(steps, desc="bench aggregator", unit="run"):
            try:
                runs[kind, n].append(measure(args, job, star, kind, n))
            except Exception as exc:  # a failed run is a figure: no ratio of it
                runs[kind, n].append({"lcores": n, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        star.close()
    for (kind, n), results in runs.items():
        name = kind if n == args.lcores[0] else f"{kind}_lcores{n}"
        figures[name] = median_run(results)
    put_ratios(figures, args.backend, args.lcores)
    return figures
