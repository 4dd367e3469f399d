"""``ncina topo``: train over an emulated network, INA+NC8 against the gloo fp32 baseline.

``make topo`` runs this command; see ``docs/topo.md``. Mininet (and with it the runner) is imported
only when the command runs, so ``ncina --help`` works without it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from ncina.proto.job import DEFAULT_POOL_SIZE, JobSpec, default_k
from ncina.proto.profiles import DEFAULT, TOFINO_MAX_K
from ncina.proto.tag import read_key_file
from ncina.proto.wire import DEFAULT_MTU
from ncina.topo.config import BMV2_POOL_SIZE, FIXED_K, JOB, TopoConfig
from ncina.worker import tuning
from ncina.worker.client import MODES
from ncina.worker.train import check_options

from ncina.common.options import deprecated_alias

ROOT_NEEDED = (
    "ncina topo needs root: Mininet creates network namespaces, virtual links and a bridge "
    "(run it, or make topo, as root)"
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina topo``."""
    p = subparsers.add_parser(
        "topo",
        help="Mininet: train over the emulated switch, INA+NC8 then the gloo fp32 baseline",
        description="Bring up a Mininet topology (workers and aggregator nodes on a Linux "
        "bridge; with --backend bmv2, workers on a P4 switch that aggregates), train a model "
        "with its gradients summed by the aggregator (NC8, or --compressor in --mode ina or "
        "server), then train again with gloo's fp32 ring all-reduce on the same network; write "
        "results.json, logs and a plot under runs/.",
    )
    d = TopoConfig  # the defaults
    p.add_argument("--topo", choices=("star", "multi", "leafspine"), default=d.topo,
                   help="star: one aggregator; multi: tensors sharded across --aggregators; "
                   "leafspine: --leaves leaf switches, each with its workers and a leaf "
                   "aggregator, under a spine switch and the spine aggregator (python backend "
                   "by default, or socket or dpdk: docs/topo.md)")
    p.add_argument("--leaves", type=int, default=d.leaves,
                   help="leafspine: leaf switches, the workers split evenly over them "
                   "(default: %(default)s)")
    JobSpec.add_arguments(p, "workers", workers=d.workers)
    p.add_argument("--aggregators", type=int, help="aggregator nodes (star: 1, multi: default 2)")
    p.add_argument("--backend",
                   help="aggregator backend: socket, python, dpdk or bmv2 (the switch itself, "
                   "star only) (default: socket; python with --mode server)")  # fmt: skip
    p.add_argument("--bw", type=float, help="worker link bandwidth in Mbit/s (default: unshaped)")
    p.add_argument("--agg-bw", type=float,
                   help="aggregator link bandwidth in Mbit/s (default: unshaped, like the switch)")
    p.add_argument("--loss", type=float, default=d.loss,
                   help="percent of packets lost per worker link direction (iptables; default: 0)")
    JobSpec.add_arguments(p, "mtu")
    p.add_argument("--model", default=d.model,
                   help="a name from ncina.worker.models.MODELS (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="default: %(default)s")
    p.add_argument("--max-steps", type=int, help="stop each training run after this many steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="per worker (default: %(default)s)")
    p.add_argument("--bucket-cap-mb", type=float,
                   help="DDP gradient bucket size in MB (default: from --bw, "
                   "ncina.worker.tuning.bucket_cap_mb: 4 at 100 Mbit/s, 25 unshaped)")
    p.add_argument("--lr", type=float,
                   help="SGD step size, used as given (default: the model's recipe, "
                   "ncina.worker.models: 0.1; for the 32x32 image nets 0.02 per 128 samples of "
                   "global batch, after a 5-step warm-up)")
    p.add_argument("--seed", type=int, default=d.seed, help="default: %(default)s")
    JobSpec.add_arguments(
        p, "k", "pool_size", "window_max", "result", pool_size=None, rules={
            "k": "the largest that fits --mtu, 1456 for nc8 results at 1500; "
            f"{FIXED_K} with --backend bmv2 or --mode server",
            "pool_size": "from --bw and K, ncina.worker.tuning.pool_size: 4 ms of the link, 34 "
            f"at 100 Mbit/s and MTU 1500, 8 at --mtu 9000; unshaped {DEFAULT_POOL_SIZE}, "
            f"fewer for a larger K, so that about {DEFAULT_POOL_SIZE} MTU-1500 chunks are in "
            f"flight: 10 at --mtu 9000; {BMV2_POOL_SIZE} with --backend bmv2, measured best "
            "through the switch (docs/bmv2.md)",
        },
    )  # fmt: skip
    JobSpec.add_arguments(p, "profile")  # tofino: a run under it beside the default's
    p.add_argument("--compressor", metavar="SPEC",
                   help="workers' gradient compressor [ef+]name[:key=value,...] "
                   "(docs/compressors.md; default: NC8 of the raw gradients)")
    p.add_argument("--mode", choices=MODES, default=d.mode,
                   help="ina: the aggregator adds NC8 codes (integer-summable methods only); "
                   "server: it is started with --mode server and the same --compressor, and "
                   "averages the decompressed payloads (any method); default: %(default)s")
    p.add_argument("--key-file", type=Path, metavar="FILE",
                   help="a shared secret (hex, 16-64 bytes) for the job: the aggregators require "
                   "the authentication tag and the workers send it (docs/protocol.md)")
    p.add_argument("--verify", action="store_true",
                   help="check every INA result against an exact gloo all-reduce (extra traffic)")
    p.add_argument("--pcaps", action="store_true",
                   help="capture for Wireshark (docs/wireshark.md): tcpdump writes the job's UDP "
                   "on each aggregator's link to the run's ina/pcaps/aggregator<j>.pcap; with "
                   "--backend bmv2 the switch writes pcaps of every port (ina/pcaps/ and "
                   "gloo/pcaps/)")
    p.add_argument("--repeat", type=int, default=d.repeat,
                   help="train this many times per mode on the same network; results.json and "
                   "the table give the median and the spread (default: %(default)s)")
    p.add_argument("--torch-backend", action="store_true",
                   help="also train through the ncina process-group backend (DDP with no hook, "
                   "ncina train --backend ncina; docs/pytorch.md) after the hook's run")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the gloo fp32 run")
    p.add_argument("--offloads", action=argparse.BooleanOptionalAction, default=None,
                   help="the links' checksum offloads, so that the workers' and the "
                   "aggregator's UDP GSO runs (and gloo's TSO segments) cross the fabric whole "
                   "(default: on for a star without --loss on a kernel-socket backend, socket "
                   "or python; off elsewhere, where --offloads is refused)")  # fmt: skip
    workdir = p.add_argument("--workdir", type=Path,
                             help="run directory (default: runs/<timestamp>)")
    deprecated_alias(p, "--out", workdir)
    JobSpec.add_arguments(p, role="run")  # every field not placed above
    return p


def topo_k(
    backend: str, mode: str, result: str, tagged: bool, mtu: int = DEFAULT_MTU,
    topo: str = "star",
) -> int:  # fmt: skip
    """The K a topology's job gets without --k: ``FIXED_K`` on BMv2 and in server mode, else the
    largest whose packets fit ``mtu`` (``ncina.proto.job.default_k``; in leaf-spine, whose
    leaves send int partial sums, for int)."""
    if backend == "bmv2" or mode == "server":
        return FIXED_K
    return default_k(mtu, result, tagged, partial_sums=topo == "leafspine")


def topo_pool_size(backend: str | None, k: int, bw: float | None = None) -> int:
    """The pool a topology's job gets without --pool-size: ``BMV2_POOL_SIZE`` on BMv2; on a
    link of ``bw`` Mbit/s, what ``ncina.worker.tuning.pool_size`` gives (a few ms of the link);
    on an unshaped link ``DEFAULT_POOL_SIZE`` chunks of MTU 1500's K in bytes (at least 8, at
    most that many slots): a larger K needs fewer slots to keep a link busy, and more only queue
    in front of it, where their round trips grow until the retransmission timer fires."""
    if backend == "bmv2":
        return BMV2_POOL_SIZE
    pool = DEFAULT_POOL_SIZE * default_k(DEFAULT_MTU, "nc8") // k
    return tuning.pool_size(k, bw, unknown=max(8, min(DEFAULT_POOL_SIZE, pool)))


FAITHFUL_MBIT_PER_CORE = 200.0
"""Worker-link Mbit/s (summed over the workers) that one core emulates faithfully: measured on
2 cores, 4 workers reach a link_fraction of 0.97 at 100 Mbit/s with MTU 9000 and 0.85 with
MTU 1500, and no more than 0.79 from 200 Mbit/s up (docs/performance.md, "Headroom")."""


def headroom_warning(workers: int, bw: float | None, cores: int | None) -> str | None:
    """One sentence when the run asks for more link bandwidth than this machine's ``cores``
    emulate faithfully (``FAITHFUL_MBIT_PER_CORE``), else None; unshaped links have no rate."""
    if bw is None or not cores:
        return None
    limit = FAITHFUL_MBIT_PER_CORE * cores
    if workers * bw <= limit:
        return None
    return (f"ncina topo: warning: {workers} workers at {bw:g} Mbit/s ask for "
            f"{workers * bw:g} Mbit/s of links, more than the {limit:g} Mbit/s that {cores} "
            "cores emulate faithfully (docs/performance.md, \"Headroom\"): times will measure "
            "this machine's CPU more than the links")


def run(args: argparse.Namespace) -> int:
    """Check root and options, then run the topology (see :mod:`ncina.topo.runner`)."""
    check_options(args)
    if args.mode == "server" and args.backend not in (None, "python"):
        raise ValueError("server mode runs on the python backend: drop --backend or give "
                         "--backend python")  # fmt: skip
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, not {args.repeat}")
    if args.key_file is not None:
        read_key_file(args.key_file)  # a clear error now, not in every host's log later
    if args.profile != DEFAULT and (args.mode == "server" or args.compressor or args.key_file
                                    or args.topo == "leafspine"):  # fmt: skip
        raise ValueError(f"--profile {args.profile} trains with NC8 codes in INA mode on a star "
                         "or multi topology: no --mode server, --compressor, --key-file or "
                         "--topo leafspine (the design adds NC8 uplinks of workers only)")
    if os.geteuid() != 0:
        raise PermissionError(ROOT_NEEDED)
    if args.topo == "star" and args.aggregators not in (None, 1):
        raise ValueError("the star topology has one aggregator; use --topo multi")
    if args.topo == "leafspine" and args.aggregators is not None:
        raise ValueError("leafspine has one aggregator per leaf and the spine's: give --leaves")
    from ncina.topo.runner import run_topology

    warning = headroom_warning(args.workers, args.bw, os.cpu_count())
    if warning:
        print(warning, file=sys.stderr)
    k = args.k or topo_k(args.backend, args.mode, args.result, args.key_file is not None, args.mtu,
                         args.topo)  # fmt: skip
    run_topology(
        TopoConfig(
            out=args.workdir or Path("runs", time.strftime("%Y%m%d-%H%M%S")),
            topo=args.topo,
            workers=args.workers,
            aggregators=args.aggregators or (2 if args.topo == "multi" else 1),
            leaves=args.leaves,
            backend=args.backend,
            bw=args.bw,
            agg_bw=args.agg_bw,
            loss=args.loss,
            model=args.model,
            epochs=args.epochs,
            max_steps=args.max_steps,
            batch_size=args.batch_size,
            bucket_cap_mb=args.bucket_cap_mb or tuning.bucket_cap_mb(args.bw),
            lr=args.lr,
            seed=args.seed,
            # every job option (the key travels as --key-file); the profile is a run's
            job=JobSpec.from_args(args, job=JOB, k=k, key=None, profile=DEFAULT,
                                  pool_size=args.pool_size or topo_pool_size(args.backend, k,
                                                                             args.bw)),
            compressor=args.compressor,
            pcaps=args.pcaps,
            mode=args.mode,
            key_file=args.key_file,
            verify=args.verify,
            baseline=args.baseline,
            torch_backend=args.torch_backend,
            repeat=args.repeat,
            profile=args.profile,
            profile_pool_size=args.pool_size or topo_pool_size(
                args.backend, min(k, TOFINO_MAX_K), args.bw),
            offloads=args.offloads,
        )
    )
    return 0
