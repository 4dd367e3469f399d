"""``ncina allreduce``: all-reduce one tensor from a ``.npy`` file through an aggregator.

One process is one worker: it reads its float tensor, runs ``AllreduceClient.allreduce`` and
writes the job's float32 result; run it once per rank. A summary line goes to stderr, the
client's counters optionally to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from ncina.proto.job import JobSpec
from ncina.worker.client import (
    DATA_PATH_ENV,
    DATA_PATHS,
    HANDSHAKE_TIMEOUT,
    OPS,
    AllreduceClient,
)
from ncina.worker.window import WINDOW_ENV, WINDOW_MODES

from ncina.common.address import peer_address


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina allreduce``."""
    p = subparsers.add_parser(
        "allreduce",
        help="all-reduce a .npy tensor with the other workers of a job",
        description="Act as one worker of a job: send the tensor in --input through the "
        "aggregator (NC8 uplink) and write the job's sum or mean to --output (float32).",
    )
    p.add_argument("--aggregator", type=peer_address, required=True, metavar="HOST:PORT")
    JobSpec.add_arguments(p, "job", required=("job",))
    p.add_argument("--rank", type=int, required=True, help="this worker's rank, 0..N-1")
    JobSpec.add_arguments(p, "workers", "total_workers", "k", "mtu", required=("workers",))
    p.add_argument("--input", type=Path, required=True, metavar="X.npy", help="float tensor")
    p.add_argument("--output", type=Path, required=True, metavar="Y.npy", help="float32 result")
    p.add_argument("--op", choices=OPS, default="mean", help="default: %(default)s")
    p.add_argument("--seed", type=int, default=None, help="seed of the stochastic rounding")
    JobSpec.add_arguments(p, "pool_size", "window_max", "result", "profile")
    p.add_argument(
        "--timeout", type=float, default=0.05, metavar="S",
        help="initial retransmission timeout in seconds (default: %(default)s)",
    )
    p.add_argument(
        "--max-timeout", type=float, default=1.0, metavar="S",
        help="largest retransmission timeout in seconds (default: %(default)s)",
    )
    p.add_argument(
        "--deadline", type=float, default=10.0, metavar="S",
        help="give up after this many seconds without progress (default: %(default)s)",
    )
    JobSpec.add_arguments(p, "key")
    add_data_path_argument(p)
    p.add_argument("--stats", type=Path, default=None, metavar="FILE", help="counters as JSON")
    JobSpec.add_arguments(p, role="worker")  # every field not placed above
    return p


def add_data_path_argument(p: argparse.ArgumentParser) -> None:
    """``--data-path c|python``: the worker's transfer loop (AllreduceClient's data_path),
    ``--cwnd adaptive|fixed`` (its congestion window, AllreduceClient's cwnd), and
    ``--handshake-timeout S`` (AllreduceClient's handshake_timeout; 0 skips the handshake)."""
    p.add_argument(
        "--handshake-timeout", type=float, default=HANDSHAKE_TIMEOUT, metavar="S",
        help="seconds to wait for the aggregator's answer to the job handshake, which fails "
        "at once, naming the parameter, when the worker's job differs from the aggregator's; "
        "0 skips it (an aggregator that does not answer it) (default: %(default)s)",
    )
    p.add_argument(
        "--data-path", choices=DATA_PATHS, default=None,
        help=f"the INA transfer loop: c (the fast path) or python (the reference); default: "
        f"${DATA_PATH_ENV}, else c",
    )
    p.add_argument(
        "--cwnd", choices=WINDOW_MODES, default=None,
        help=f"slots in flight: adaptive (a delay-based congestion window, at most the pool; "
        f"docs/reliability.md) or fixed (the whole pool); default: ${WINDOW_ENV}, else fixed",
    )


def load_tensor(path: Path) -> np.ndarray:
    """Read a float tensor as float32; other float widths are cast with a note on stderr."""
    x = np.load(path, allow_pickle=False)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{path}: expected a float array, got dtype {x.dtype}")
    if x.dtype != np.float32:
        print(f"ncina allreduce: note: casting {path} from {x.dtype} to float32", file=sys.stderr)
        x = x.astype(np.float32)
    return x


def run(args: argparse.Namespace) -> int:
    """All-reduce ``--input`` and write ``--output``; returns the exit status."""
    job = JobSpec.from_args(args)  # the job's validation, before any I/O
    x = load_tensor(args.input)
    began = time.monotonic()
    with AllreduceClient.for_job(
        args.aggregator,
        job,
        rank=args.rank,
        seed=args.seed,
        timeout=args.timeout,
        max_timeout=args.max_timeout,
        deadline=args.deadline,
        data_path=args.data_path,
        cwnd=args.cwnd,
        handshake_timeout=args.handshake_timeout or None,
    ) as client:
        result = client.allreduce(x, op=args.op)
        stats = client.stats
    seconds = time.monotonic() - began
    np.save(args.output, result)
    if args.stats is not None:
        args.stats.write_text(json.dumps(stats, indent=2) + "\n")
    print(
        f"ncina allreduce: rank {args.rank}: {stats['elements']} elements, "
        f"{stats['packets_sent']} packets sent, {stats['packets_received']} received, "
        f"{stats['retransmissions']} retransmissions, {seconds:.3f} s",
        file=sys.stderr,
    )
    return 0
