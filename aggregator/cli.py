"""``ncina aggregator``: run an aggregator backend for a job (and more from ``--jobs-dir``)."""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path
from typing import Any

from ncina.aggregator import hierarchy, metrics
from ncina.aggregator.bmv2 import driver as bmv2_driver
from ncina.aggregator.control import DEFAULT_MAX_JOBS, jobs_directory
from ncina.aggregator.dpdk import driver as dpdk_driver
from ncina.aggregator.faults import FaultConfig
from ncina.aggregator.handshake import RESTART_IDLE
from ncina.aggregator.jobs import (
    DEFAULT_POOL_SIZE,
    DEFAULT_WINDOW_MAX,
    JobConfig,
    check_mtu_range,
    check_server_mtu,
    default_k,
    parse_member,
)
from ncina.aggregator.pipeline import Aggregator
from ncina.aggregator.python_backend import PythonBackend
from ncina.aggregator.slots import DEFAULT_MAX_RESIDUAL_ELEMENTS
from ncina.aggregator.socket import driver as socket_driver
from ncina.proto.compressors import create
from ncina.proto.compressors.base import Compressor, largest_fitting
from ncina.proto.header import ELEMENT_SIZE, MAX_GENERATION, PORT
from ncina.proto.tag import key_file_argument
from ncina.proto.wire import (
    DEFAULT_MTU,
    MAX_K,
    MAX_MTU,
    MAX_POOL_SIZE,
    MAX_WORKERS,
    MIN_MTU,
    payload_room,
)

from ncina.common.address import bind_address

BACKENDS = ("python", "socket", "dpdk", "bmv2")

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
socket is bound. SIGUSR1 writes the stats now; SIGTERM and SIGINT write them and exit with 0.
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


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _mtu(text: str) -> int:
    try:
        mtu = int(text)
        check_mtu_range(mtu)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return mtu


def job_k(args: argparse.Namespace, compressor: Compressor | None) -> int:
    """``--k``, or the largest K whose packets fit ``--mtu`` (INA: for the result format and
    tag; server mode: for the compressor's largest payload)."""
    if args.k is not None:
        return int(args.k)
    tagged = args.key_file is not None
    if compressor is None:  # a leaf's or spine's int partial sums must fit too
        partial_sums = args.upstream is not None or args.uplink == "int"
        return default_k(args.mtu, "int" if partial_sums else args.result, tagged)
    room = payload_room(args.mtu, tagged)
    k = largest_fitting(compressor, room, default_k(args.mtu, "nc8", tagged))
    if k == 0:
        raise ValueError(f"not one {compressor.name} element fits a packet of MTU {args.mtu}")
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
        choices=BACKENDS,
        default="python",
        help="data plane implementation: python (reference), socket (C engine, kernel UDP "
        "socket, no root), dpdk (C engine on a DPDK port), bmv2 (P4 switch) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--listen",
        type=bind_address,
        default=("0.0.0.0", PORT),
        metavar="HOST:PORT",
        help=f"IPv4 address and UDP port to serve; port 0 picks a free one, reported in the "
        f"readiness line (default: 0.0.0.0:{PORT})",
    )
    parser.add_argument("--job", type=int, required=True, help="job id (0..65535)")
    parser.add_argument(
        "--workers", type=int, required=True, metavar="N", help="number of workers (ranks 0..N-1)"
    )
    parser.add_argument(
        "--k",
        type=int,
        default=None,
        help="elements per packet (chunk size) of the job (default: the largest whose packets "
        "fit --mtu, for the result format and tag)",
    )
    parser.add_argument(
        "--result",
        choices=[f.name.lower() for f in ELEMENT_SIZE],
        default=None,
        help="INA mode's result payload (required there): nc8 (sums re-compressed to NC8, 1 byte "
        "per element), int (exact sums, 8 bytes per element) or int32 (exact sums, 4 bytes per "
        "element, in a window whose sums stay within 2^30: docs/protocol.md); server mode's "
        "results are always the compressor's payloads (blob), so it takes none",
    )
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
    parser.add_argument(
        "--pool-size",
        type=int,
        default=DEFAULT_POOL_SIZE,
        metavar="S",
        help="slots in the job's pool (default: %(default)s)",
    )
    parser.add_argument(
        "--window-max",
        type=int,
        default=DEFAULT_WINDOW_MAX,
        metavar="E",
        help="largest exponent of the NC8 window, e_max; e_min follows from it and --workers "
        "(default: %(default)s)",
    )
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
    parser.add_argument(
        "--key-file",
        type=key_file_argument,
        default=None,
        metavar="FILE",
        help="the job's shared secret, 16-64 bytes as hex in FILE: every datagram of the job "
        "must then carry a valid authentication tag, and results carry one "
        "(docs/protocol.md, 'Authentication tag')",
    )
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
        "before a worker's hello starts it afresh for a new set of workers: longer than the "
        "workers' deadline, so that a rank of a job in use keeps its results and its address "
        "(docs/protocol.md, 'A new set of workers'; default: %(default)s, the workers' default "
        "deadline; 0: whenever no round is partly filled)",
    )
    parser.add_argument(
        "--mtu",
        type=_mtu,
        default=DEFAULT_MTU,
        help="link MTU in bytes that a result frame must fit (default: %(default)s)",
    )
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
        "--max-residual-elements",
        type=positive_int,
        default=DEFAULT_MAX_RESIDUAL_ELEMENTS,
        metavar="N",
        help="server mode (python backend): the error-feedback memory a job keeps, in float32 "
        "elements (each chunk's state is charged 512 more); a chunk past it gets no error "
        "feedback, counted (limits.residuals_unkept) (default: %(default)s, about 1 GiB)",
    )
    faults = parser.add_argument_group(
        "emulated network faults (python backend; seeded, counted in the stats' faults section)"
    )
    for flag, what in (
        ("--drop-up", "drop each received datagram"),
        ("--drop-down", "drop each result datagram to each worker"),
        ("--duplicate", "process each received datagram twice"),
        ("--reorder", "hold each received datagram back behind the next one"),
    ):
        faults.add_argument(flag, type=float, default=0.0, metavar="P", help=f"{what} with "
                            "probability P (default: 0)")  # fmt: skip
    faults.add_argument("--fault-seed", type=int, default=0, help="seed of the fault decisions")
    faults.add_argument("--drop-every", type=int, default=0, metavar="N",
                        help="also drop the Nth, 2Nth, ... datagram from each source and to "
                        "each destination address: a fixed pattern (default: 0, off)")
    parser.add_argument(
        "--iface",
        metavar="IF",
        help="dpdk: the network interface the data plane serves (or --pci); bmv2: one or "
        "more, comma-separated, the switch's ports 1, 2, ... (required)",
    )
    hierarchy.add_arguments(parser)
    groups = {
        "socket": socket_driver.add_arguments(parser),
        "dpdk": dpdk_driver.add_arguments(parser),
        "bmv2": bmv2_driver.add_arguments(parser),
    }
    # Each backend's options (flag, dest, default), for check_backend_options.
    parser.set_defaults(backend_options={
        name: [(a.option_strings[0], a.dest, a.default) for a in group._group_actions]
        for name, group in groups.items()
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
    if (args.mode == "server") != (args.compressor is not None):
        raise ValueError("--compressor goes with --mode server, and --mode server needs one")
    if args.mode == "ina" and args.result is None:
        raise ValueError("INA mode needs --result nc8 or --result int")
    if args.mode == "server" and args.result is not None:
        raise ValueError("server mode's results are compressor payloads: drop --result")
    hierarchical = hierarchy.check_arguments(args)
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port, args.metrics_host)
    compressor = (
        create(args.compressor, workers=args.workers, e_max=args.window_max)
        if args.compressor is not None
        else None
    )
    config = JobConfig.create(
        job=args.job,
        workers=args.workers,
        k=job_k(args, compressor),
        # Server mode has no result format of its own: ServerSlots sends blobs, nc8 is a filler.
        result_format=args.result or "nc8",
        pool_size=args.pool_size,
        window_max=args.window_max,
        members=args.member,
        seed=args.seed,
        key=args.key_file,
        total_workers=args.total_workers,
        uplink_format=args.uplink,
    )
    if compressor is None:
        config.check_mtu(args.mtu)
    else:
        check_server_mtu(config, compressor, args.mtu)
    faults = FaultConfig(
        drop_up=args.drop_up,
        drop_down=args.drop_down,
        duplicate=args.duplicate,
        reorder=args.reorder,
        seed=args.fault_seed,
        drop_every=args.drop_every,
    )
    generation = args.generation or 1 + secrets.randbelow(MAX_GENERATION)
    if args.backend in ("socket", "dpdk", "bmv2"):
        if compressor is not None:
            raise ValueError("server mode (--mode server) is a python backend feature")
        if faults.active:
            raise ValueError("fault injection (--drop-up ...) is a python backend feature")
        if args.backend == "bmv2" and args.jobs_dir is not None:
            raise ValueError(
                "--jobs-dir is not available on bmv2: the P4 program holds up to 16 jobs, but "
                "adding and removing them while the switch runs (table entries, multicast "
                "groups, a share of the slot registers) is not implemented in its control "
                "plane; run one job per switch, or the python, socket or dpdk backend"
            )
        if args.backend == "bmv2":
            return bmv2_driver.serve(config, args, generation)
        if hierarchical:  # a spine's leaves' int frames, or a (socket) leaf's own
            hierarchy.check_int_frames(config, args.mtu)
        if args.backend == "socket":
            return socket_driver.serve(config, args, generation)
        return dpdk_driver.serve(config, args, generation)
    if hierarchical:
        aggregator = hierarchy.make_aggregator(config, args, generation)
    else:
        aggregator = Aggregator(generation, max_residual_elements=args.max_residual_elements)
        aggregator.add_job(config, compressor)
    aggregator.restart_idle = args.restart_idle
    backend = PythonBackend(
        aggregator,
        args.listen,
        stats_path=args.stats,
        stats_interval=args.stats_interval,
        faults=faults,
        control=jobs_directory(args),
    )
    return backend.run()
