"""``ncina aggregator``: run an aggregator backend for a job (and more from ``--jobs-dir``)."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

from ncina.aggregator import backends, hierarchy, metrics
from ncina.aggregator.backends import BACKENDS, Serving
from ncina.aggregator.backends.python.handshake import RESTART_IDLE
from ncina.aggregator.control import DEFAULT_MAX_JOBS, jobs_directory
from ncina.aggregator.jobs import (
    JobConfig,
    check_server_mtu,
    parse_member,
)
from ncina.proto.compressors import create
from ncina.proto.compressors.base import Compressor, largest_fitting
from ncina.proto.header import MAX_GENERATION, PORT, Format
from ncina.proto.job import JobSpec, default_k
from ncina.proto.wire import (
    MAX_K,
    MAX_MTU,
    MAX_POOL_SIZE,
    MAX_WORKERS,
    MIN_MTU,
    payload_room,
)

from ncina.common.address import bind_address
from ncina.common.options import deprecated_alias, positive_int

DESCRIPTION = f"""\
Run an in-network aggregator for a job (more with --jobs-dir): workers send NC8-coded chunks over
UDP, the aggregator adds them in 64-bit integer slots (SwitchML pool of --pool-size slots, two
versions each) and sends each completed slot's sum back to every worker, re-compressed to NC8
(--result nc8) or as exact integers (--result int). --mode server --compressor SPEC is for
compressors whose payloads a switch cannot add: each worker's payload is decompressed, the
float mean re-compressed with SPEC and sent back (no --result). The wire format is
docs/protocol.md.

Backends: python (the reference: one Python loop per datagram), socket (the C slot engine
behind one kernel UDP socket with batched recvmmsg/sendmmsg: the same datagrams and counters,
several times faster, no root; docs/socket.md), dpdk (the same C engine on a DPDK port: needs
root and --iface or --pci; docs/dpdk.md), bmv2 (the P4 program on BMv2; docs/bmv2.md). Server mode
and the fault options are python's; in two-level aggregation (docs/protocol.md, "Hierarchical
aggregation") a spine (--uplink int) and a leaf (--upstream) run on python, socket or dpdk (a
dpdk leaf resolves its spine's MAC by ARP); --jobs-dir works on every backend but bmv2.

On start it prints one line on stderr, "ncina aggregator: listening on HOST:PORT ...", once the
socket is bound. SIGUSR1 writes the stats now; SIGTERM and SIGINT write them and exit with 0;
SIGUSR2 prints every thread's Python stack on stderr (where a stop that does not end is stuck).
Limits: 1 <= --workers <= {MAX_WORKERS}, 1 <= --k <= {MAX_K}, 1 <= --pool-size <= {MAX_POOL_SIZE},
{MIN_MTU} <= --mtu <= {MAX_MTU}, and a full result frame (Ethernet + IPv4 + UDP + 16-byte header +
K elements, in server mode the compressor's largest payload of K elements) must fit --mtu.
Without --k, K is the largest that fits --mtu (1456 NC8 elements at MTU 1500, 8956 at 9000;
182 for int results at 1500). The dpdk backend sends frames of at most 2048 bytes, BMv2
compiles at most 1024 lanes: give them a smaller --k.
"""


def _member(text: str) -> tuple[int, tuple[str, int]]:
    try:
        return parse_member(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds (below 1e9), not {text}")
    return value


def job_config(args: argparse.Namespace) -> tuple[JobConfig, Compressor | None]:
    """The job of the flags and, in server mode, its compressor. The job's fields, defaults,
    default K and validation are ``JobSpec``'s (``JobSpec.from_args``), with two rules of the
    aggregator's own: a leaf (``--upstream``) sends int partial sums up, so without ``--k`` its
    K is the largest of int lanes; and server mode has no result format (its results are the
    compressor's payloads: nc8 stands in), so its K is ``--k`` or the largest whose compressor
    payload fits ``--mtu``, bounded by ``check_server_mtu`` instead of the result format."""
    if args.compressor is not None:
        spec = JobSpec.from_args(args, result="nc8", k=None)
        compressor = create(args.compressor, workers=spec.workers, e_max=spec.window_max)
        config = dataclasses.replace(
            JobConfig.from_spec(spec, members=args.member, seed=args.seed),
            k=server_k(spec, args.k, compressor),
        )
        check_server_mtu(config, compressor, spec.mtu)
        return config, compressor
    leaf_k = None
    if args.upstream is not None and args.k is None:
        leaf_k = default_k(args.mtu, Format.INT, args.key_file is not None)
    spec = JobSpec.from_args(args, k=leaf_k or args.k)
    return JobConfig.from_spec(spec, members=args.member, seed=args.seed), None


def server_k(spec: JobSpec, k: int | None, compressor: Compressor) -> int:
    """Server mode's K: ``k`` (``--k``), or the largest whose compressor payload fits a
    datagram of the job's MTU (``spec.k``: the nc8 default there, bounds it)."""
    if k is not None:
        return k
    k = largest_fitting(compressor, payload_room(spec.mtu, spec.keyed), spec.k)
    if k == 0:
        raise ValueError(f"not one {compressor.name} element fits a packet of MTU {spec.mtu}")
    return k


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina aggregator`` and its options."""
    parser = subparsers.add_parser(
        "aggregator",
        help="run an aggregator (switch): one job from the flags, more from --jobs-dir",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend",
        choices=backends.names(),
        default="python",
        help="data plane implementation: "
        + ", ".join(f"{b.name} ({b.summary})" for b in BACKENDS)
        + " (default: %(default)s)",
    )
    parser.add_argument(
        "--listen",
        type=bind_address,
        default=("0.0.0.0", PORT),
        metavar="HOST:PORT",
        help=f"IPv4 address and UDP port to serve; port 0 picks a free one, reported in the "
        f"readiness line (default: 0.0.0.0:{PORT})",
    )
    JobSpec.add_arguments(
        parser, "job", "workers", "k", "result", required=("job", "workers"), result=None,
        rules={
            "k": "the most whose packets fit --mtu, for the result format and tag (int lanes on "
            "a spine or a leaf); in server mode, for the compressor's largest payload",
            "result": "none; INA mode requires one, server mode takes none: its results are "
            "always the compressor's payloads (blob)",
        },
    )  # fmt: skip
    parser.add_argument(
        "--mode",
        choices=("ina", "server"),
        default="ina",
        help="ina: NC8 contributions summed as integers (default); server: --compressor payloads "
        "decompressed, averaged in float and the mean re-compressed with the same compressor "
        "(python backend)",
    )
    parser.add_argument(
        "--compressor",
        default=None,
        metavar="SPEC",
        help="server mode's compressor, [ef+]name[:key=value,...] (docs/compressors.md); with "
        "ef+ the server keeps error feedback per chunk (DoubleSqueeze)",
    )
    JobSpec.add_arguments(parser, "pool_size", "window_max")
    parser.add_argument(
        "--member",
        type=_member,
        action="append",
        default=[],
        metavar="RANK=HOST:PORT",
        help="fix a rank's address (repeatable); ranks not given are learned from their first "
        "valid packet, and packets for a rank from any other address are dropped",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed (0..2^64-1) of the rounding of nc8 results, whose random bits are a hash of it "
        "and the chunk (docs/protocol.md, 'Re-compression'), and in server mode of each chunk's "
        "compressor state (default: from the OS)",
    )
    JobSpec.add_arguments(parser, "key")
    parser.add_argument(
        "--generation",
        type=int,
        choices=range(1, MAX_GENERATION + 1),
        default=None,
        metavar="G",
        help=f"this start's generation, 1..{MAX_GENERATION}, stamped on every result so that "
        "workers notice a restart (default: random; pin it to test restarts)",
    )
    parser.add_argument(
        "--restart-idle",
        type=_non_negative_seconds,
        default=RESTART_IDLE,
        metavar="SECONDS",
        help="how long a job must have been quiet (no slot completed, no result sent again) "
        "before a worker's hello without a new incarnation nonce (an older client's, a leaf's) "
        "starts it afresh for a new set of workers: longer than the workers' deadline, so that "
        "a rank of a job in use keeps its results and its address; a rank's new client (a new "
        "nonce) starts it at once (docs/protocol.md, 'A new set of workers'; default: "
        "%(default)s, the workers' default deadline; 0: whenever no round is partly filled)",
    )
    JobSpec.add_arguments(parser, "mtu")
    profile = JobSpec.add_arguments(parser, "profile")["profile"]
    deprecated_alias(parser, "--p4-profile", profile)  # the bmv2 backend's, before --profile
    parser.add_argument(
        "--stats",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the counters as JSON to FILE (atomically) every --stats-interval seconds, "
        "on SIGUSR1 and at exit; without it they are printed on stderr on SIGUSR1 and at exit",
    )
    parser.add_argument(
        "--stats-interval",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="period of the stats file writes (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        choices=range(1, 1 << 16),
        default=None,
        metavar="PORT",
        help="serve the stats document's counters in Prometheus' text format on HTTP PORT "
        "(/metrics; every backend): one family per counter, ncina_<counter>_total, labels job "
        "and reason; refreshed every --stats-interval (docs/deploy.md)",
    )
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        metavar="ADDR",
        help="address the metrics endpoint listens on (default: %(default)s)",
    )
    parser.add_argument(
        "--jobs-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="control interface (python, socket, dpdk): every DIR/*.json file is one more job, "
        "added when the file appears and removed when it goes, while the others run "
        "(docs/reliability.md, 'Several jobs')",
    )
    parser.add_argument(
        "--max-jobs",
        type=positive_int,
        default=DEFAULT_MAX_JOBS,
        metavar="N",
        help="at most N jobs at once, the one of the flags included: a "
        "--jobs-dir file past them is refused, logged and counted (limits.jobs_refused) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--iface",
        metavar="IF",
        help="dpdk: the network interface the data plane serves (or --pci); bmv2: one or "
        "more, comma-separated, the switch's ports 1, 2, ... (required)",
    )
    hierarchy.add_arguments(parser)
    JobSpec.add_arguments(parser, role="aggregator")  # every field not placed above
    # Each backend's options (flag, dest, default), for check_backend_options.
    parser.set_defaults(backend_options={
        backend.name: [(a.option_strings[0], a.dest, a.default)
                       for group in backend.load().add_arguments(parser)
                       for a in group._group_actions]
        for backend in BACKENDS
    })  # fmt: skip
    return parser


def check_backend_options(args: argparse.Namespace) -> None:
    """Refuse an option of another backend than the one chosen (``--lcores`` with socket,
    ``--socket-mode`` with dpdk, ...): that backend would ignore it, and the user would not get
    what they asked for."""
    if args.iface is not None and args.backend not in ("dpdk", "bmv2"):
        raise ValueError(f"--iface is an option of the dpdk and bmv2 backends, not {args.backend}")
    for backend, options in args.backend_options.items():
        if backend == args.backend:
            continue
        for flag, dest, default in options:
            if getattr(args, dest) != default:
                raise ValueError(
                    f"{flag} is an option of the {backend} backend, not {args.backend}"
                )


def run(args: argparse.Namespace) -> int:
    """Validate the job, start the chosen backend and serve until SIGTERM/SIGINT."""
    check_backend_options(args)
    if sys.__stderr__ is not None:  # the process's own stderr (a test's capture has no fd)
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
    if (args.mode == "server") != (args.compressor is not None):
        raise ValueError("--compressor goes with --mode server, and --mode server needs one")
    if args.mode == "ina" and args.result is None:
        raise ValueError("INA mode needs --result nc8 or --result int")
    if args.mode == "server" and args.result is not None:
        raise ValueError("server mode's results are compressor payloads: drop --result")
    tree = hierarchy.tree(args)
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port, args.metrics_host)
    config, compressor = job_config(args)
    backend = backends.get(args.backend)
    if compressor is not None and not backend.server_mode:
        raise ValueError(f"server mode (--mode server) is a "
                         f"{' and '.join(backends.names(server_mode=True))} backend feature")
    serving = Serving(
        listen=args.listen,
        generation=args.generation or 1 + secrets.randbelow(MAX_GENERATION),
        stats=args.stats,
        stats_interval=args.stats_interval,
        restart_idle=args.restart_idle,
        control=jobs_directory(args),
        tree=tree,
        compressor=compressor,
    )
    driver = backend.load()
    return driver.serve(config, driver.options(args, serving))
