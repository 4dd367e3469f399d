"""``ncina train``: one rank of data-parallel SGD (``--model``, ``--data``), INA+NC8 or gloo.

Every rank runs this command (``ncina topo`` starts one per worker host), or ``torchrun`` starts
them: ``torchrun --nproc-per-node N -m ncina.cli train --aggregator AGG:PORT ...`` (torchrun's
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``--rank``, ``--workers`` and
``--master`` override them). ``torch.distributed`` (gloo; a TCP rendezvous at ``--master``, or
torchrun's store) brings the ranks together and DDP broadcasts rank 0's initial parameters. The
gradient all-reduce then goes either

- through the in-network aggregator(s) given with ``--aggregator`` (NC8 uplink, the job's result
  format downlink), by the DDP communication hook of :mod:`ncina.worker.torch_hook`; with
  ``--compressor SPEC`` through that method instead: ``--mode ina`` (the default) for methods
  whose payloads a switch can add (NC8 codes), ``--mode server`` for any method (the aggregator,
  started with ``--mode server --compressor SPEC``, averages the decompressed payloads and sends
  the compressed mean); or
- with ``--backend ncina --aggregator ...``: DDP with no hook on the ``ncina`` process-group
  backend (:mod:`ncina.worker.torch_backend`, docs/pytorch.md), whose float all-reduces go
  through the aggregator(s) and everything else through gloo; or
- (no ``--aggregator``) through gloo's own fp32 ring all-reduce: the baseline.

``--device cuda`` trains on a GPU (``$LOCAL_RANK``'s under torchrun): the model, its batches and
DDP's gradient buckets live there, and the hook stages each bucket through pinned host memory
(docs/worker.md, "GPU gradient buckets"); without a CUDA GPU the command refuses in one line.

Each rank trains on its shard of the training set (``DistributedSampler``, same shuffle on all
ranks), evaluates the full test set after every epoch, prints progress lines and appends JSON events
to ``--metrics``: ``start``; ``step`` (loss, counters); ``epoch`` (test loss and accuracy);
``verify`` (with ``--verify``); ``end``. Times are training time: the clock stops while the test
set is evaluated. Bytes and packets are the deltas, since training started, of the interface
counters (``/sys/class/net/<--iface>/statistics``): everything the host put on its link, whichever
protocol carried it, so both modes are measured the same way.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ncina.proto.compressors import create
from ncina.proto.job import JobSpec
from ncina.worker.cli import add_data_path_argument
from ncina.worker.client import MODES, check_mode

from ncina.common.address import peer_address
from ncina.common.options import deprecated_alias

LACKS = ("total_workers",)
"""The job fields of a worker's role that ``ncina train`` does not take: ``--workers`` and
``--leaf-workers`` give the total."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina train``."""
    p = subparsers.add_parser(
        "train",
        help="one rank of data-parallel training (INA hook, or gloo baseline), also under torchrun",
        description="One rank of data-parallel SGD of --model on its data set; run it once per "
        "rank. Gradients go through the aggregator(s) given with --aggregator (NC8, or "
        "--compressor in --mode ina or server), or through gloo's fp32 all-reduce without it.",
    )
    p.add_argument("--rank", type=int, help="this rank (default: $RANK, set by torchrun)")
    workers = JobSpec.add_arguments(
        p, "workers", rules={"workers": "$WORLD_SIZE, set by torchrun"})["workers"]
    deprecated_alias(p, "--world-size", workers)
    p.add_argument("--master", type=peer_address, metavar="HOST:PORT",
                   help="gloo rendezvous address, rank 0 listens there (default: torchrun's "
                   "store at $MASTER_ADDR:$MASTER_PORT)")
    aggregator = p.add_argument(
        "--aggregator", type=peer_address, action="append", default=[], metavar="HOST:PORT",
        help="aggregator; repeat to shard tensors across several (none: gloo baseline)")
    deprecated_alias(p, "--ina", aggregator)
    p.add_argument("--backend", choices=("gloo", "ncina"), default="gloo",
                   help="the process group's backend: gloo (the gradients go through the INA "
                   "comm hook with --aggregator, else gloo's all-reduce) or ncina (DDP with no "
                   "hook on the ncina backend: its float all-reduces through the --aggregator, "
                   "the rest through gloo; docs/pytorch.md) (default: %(default)s)")
    JobSpec.add_arguments(p, "job", job=1)
    p.add_argument("--leaf-workers", type=int, metavar="W",
                   help="hierarchical aggregation (docs/protocol.md): the --aggregator is a "
                   "leaf of W workers, this rank its rank RANK mod W; the job's total is "
                   "--workers (default: one level, the --aggregator serves every rank)")
    p.add_argument("--iface", help="interface whose counters measure the traffic (and gloo binds)")
    p.add_argument("--model", default="mlp",
                   help="mlp, cnn (digits), resnet20, resnet18, vgg11, alexnet (synthetic "
                   "32x32 images), transformer (a character LM on Python's own sources), or "
                   "module:factory, your own (default: %(default)s)")
    p.add_argument("--data", metavar="NAME",
                   help="digits, synthetic-images, python-source, or module:factory (a function "
                   "of the seed returning train and test datasets); default: the model's")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--max-steps", type=int, help="stop after this many steps in all")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default: %(default)s)")
    p.add_argument("--lr", type=float,
                   help="SGD step size, used as given (default: the model's recipe, "
                   "ncina.worker.models: 0.1; for the 32x32 image nets 0.02 per 128 samples of "
                   "global batch, after a 5-step warm-up)")
    p.add_argument("--momentum", type=float, help="default: the model's recipe (0.9)")
    p.add_argument("--weight-decay", type=float,
                   help="L2 weight decay (default: the model's recipe: 0, 5e-4 for the 32x32 "
                   "image nets)")
    p.add_argument("--warmup-steps", type=int,
                   help="steps of linear warm-up of the step size to --lr (default: the "
                   "model's recipe: 0, 5 for the 32x32 image nets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=device_name, default="cpu",
                   help="cpu, cuda (GPU $LOCAL_RANK under torchrun, else the rank, modulo the "
                   "GPU count) or cuda:N; on a GPU the INA hook stages each gradient bucket "
                   "through pinned host memory (docs/worker.md); refused when PyTorch sees no "
                   "CUDA GPU (default: %(default)s)")
    p.add_argument("--bucket-cap-mb", type=float,
                   help="DDP bucket size in MB (default: from --link-mbit, "
                   "ncina.worker.tuning.bucket_cap_mb: 4 at 100 Mbit/s; 25 without it)")
    p.add_argument("--link-mbit", type=float, metavar="MBIT",
                   help="this worker's link rate in Mbit/s, when known: sizes the default "
                   "--bucket-cap-mb (ncina topo and bench ddp give their --bw)")
    JobSpec.add_arguments(p, "k", "mtu")
    add_data_path_argument(p)
    JobSpec.add_arguments(p, "pool_size", "window_max", "result", "profile")
    p.add_argument("--compressor", metavar="SPEC",
                   help="gradient compressor [ef+]name[:key=value,...] (docs/compressors.md; "
                   "default: NC8 of the raw gradients, INA mode)")
    p.add_argument("--mode", choices=MODES, default="ina",
                   help="where the sum is made: ina (the switch adds NC8 codes; only methods "
                   "whose payloads are integer-summable) or server (the aggregator decompresses, "
                   "averages and re-compresses; any method, aggregator started with --mode "
                   "server --compressor SPEC); default: %(default)s")
    JobSpec.add_arguments(p, "key")
    p.add_argument("--deadline", type=float, default=30.0,
                   help="seconds without progress before an all-reduce fails")
    p.add_argument("--fallback", choices=["gloo"],
                   help="when an INA all-reduce fails (aggregator gone past --deadline, more "
                   "restarts than --restart-retries), go on through gloo, said once and "
                   "counted in the results (default: fail)")
    p.add_argument("--verify", action="store_true",
                   help="also all-reduce every bucket exactly with gloo and record the NC error")
    p.add_argument("--metrics", type=Path,
                   help="JSON-lines file the events are appended to; {rank} in it is replaced "
                   "by the rank (one file per rank under torchrun)")
    p.add_argument("--log-every", type=int, default=1, help="print every Nth step")
    JobSpec.add_arguments(p, role="worker", lacks=LACKS)  # every field not placed above
    return p


def device_name(text: str) -> str:
    """``--device``'s value, checked without importing PyTorch: cpu, cuda or cuda:N."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def run(args: argparse.Namespace) -> int:
    """Train (PyTorch is imported here); returns 0. Errors raise."""
    resolve_launch(args, os.environ)
    check_options(args)
    job = job_spec(args)
    from ncina.worker.training import run_rank

    run_rank(args, job)
    return 0


def job_spec(args: argparse.Namespace) -> JobSpec:
    """The job of the flags (``JobSpec.from_args``, whose validation refuses a bad one before
    anything starts). With ``--leaf-workers W`` the aggregator is a leaf of W ranks, and the
    job's total the world size. In server mode the compressor's payloads bound K (the
    client's rule, ``AllreduceClient``), not the result format: ``--k`` is passed on as given
    (``make_fabric``), and the spec holds the default."""
    leaf = getattr(args, "leaf_workers", None)
    server = {"k": None} if args.mode == "server" else {}
    return JobSpec.from_args(args, workers=leaf or args.workers, total_workers=args.workers,
                             **server)  # fmt: skip


def resolve_launch(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill ``args.rank`` and ``args.workers`` from torchrun's ``RANK`` and ``WORLD_SIZE``
    where the flags leave them unset; without ``--master`` the rendezvous is torchrun's
    (``env://``: ``MASTER_ADDR``, ``MASTER_PORT``). ``ValueError`` names what is missing."""
    for name, variable in (("rank", "RANK"), ("workers", "WORLD_SIZE")):
        if getattr(args, name) is not None:
            continue
        text = environ.get(variable)
        if text is None:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is missing and ${variable} is not set: give {flag}, or "
                             "start the ranks with torchrun")  # fmt: skip
        try:
            setattr(args, name, int(text))
        except ValueError:
            raise ValueError(f"${variable}={text!r} is not a number") from None
    if args.master is None and not {"MASTER_ADDR", "MASTER_PORT"} <= environ.keys():
        raise ValueError("--master is missing and $MASTER_ADDR/$MASTER_PORT are not set: give "
                         "--master HOST:PORT, or start the ranks with torchrun")  # fmt: skip
    if not 0 <= args.rank < args.workers:
        raise ValueError(f"rank {args.rank} is not one of 0..{args.workers - 1}")


def check_options(args: argparse.Namespace) -> None:
    """Refuse a compressor/mode combination that cannot work, before anything starts."""
    leaf = getattr(args, "leaf_workers", None)  # ncina topo checks its options here too
    if getattr(args, "backend", "gloo") == "ncina" and (
        not args.aggregator or args.compressor or leaf or args.verify
    ):
        raise ValueError("--backend ncina needs --aggregator, and takes no --compressor, "
                         "--mode server, --leaf-workers nor --verify (the comm hook's)")
    if leaf is not None and not (
        leaf >= 1 and args.workers % leaf == 0 and len(args.aggregator) == 1
        and args.mode == "ina"
    ):
        raise ValueError(
            f"--leaf-workers {leaf}: a leaf aggregator (one --aggregator, INA mode) serves W "
            f"ranks, W >= 1 dividing the {args.workers} workers"
        )
    if args.compressor is None:
        if args.mode != "ina":
            raise ValueError(f"--mode {args.mode} needs --compressor")
        return
    check_mode(create(args.compressor), args.mode)
    if args.verify:
        raise ValueError("--verify checks NC8's error bounds: it does not go with --compressor")
