"""``ncina soak``: train over Mininet for a given time under aggregator restarts, link loss and
a stranger's hostile datagrams; a JSON summary under runs/ and a non-zero exit status when a
target fails (docs/reliability.md, "Soak"). Mininet is imported only when the command runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ncina.aggregator.backends import names
from ncina.common.options import deprecated_alias
from ncina.proto.job import JobSpec
from ncina.proto.profiles import LACKS, TOFINO
from ncina.topo.cli import ROOT_NEEDED
from ncina.topo.config import SoakConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina soak``."""
    d = SoakConfig
    p = subparsers.add_parser(
        "soak",
        help="Mininet: train for --minutes while the aggregator is killed and restarted, links "
        "lose packets and a stranger sends hostile datagrams; check every target",
        description="Train the default model (mlp on digits, 4 workers, a keyed job) over the "
        "Mininet star in runs of --steps-per-run steps for --minutes, while the aggregator is "
        "SIGKILLed and restarted at seeded random times (and in a run's last step every "
        "--last-bucket-every runs), every worker link loses --loss percent each way (iptables), "
        "and a stranger host sends fuzzed datagrams, unkeyed hellos, spoofed retransmissions and "
        "forged results. Writes soak.json (steps, hangs, digests per checkpoint, recovery_s, "
        "memory over time, drops by reason, hostile datagrams counted and not) and exits 1 "
        "naming each failed target: a hang (no rank's step count grows for --hang-s), "
        "different digests, memory growth over 5% after warm-up, a hostile datagram not "
        "counted. Needs root.",
    )
    p.add_argument("--minutes", type=float, default=d.minutes, help="default: %(default)s")
    p.add_argument("--backend", choices=names(), default=d.backend, help="default: %(default)s")
    JobSpec.add_arguments(p, "workers", workers=d.workers)
    p.add_argument("--loss", type=float, default=d.loss,
                   help="percent lost per worker link direction (default: %(default)s)")
    p.add_argument("--bw", type=float, default=d.bw,
                   help="worker link Mbit/s (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seeds the kills, the stranger and training (default: %(default)s)")
    p.add_argument("--steps-per-run", type=int, default=d.steps_per_run,
                   help="steps of one ncina train run (default: %(default)s)")
    p.add_argument("--restart-s", type=float, nargs=2, default=d.restart_s, metavar=("MIN", "MAX"),
                   help="seconds between two kills, uniform (default: 10 40)")
    p.add_argument("--last-bucket-every", type=int, default=d.last_bucket_every, metavar="N",
                   help="every Nth run, a kill when rank 0 enters the last step (0: never; "
                   "default: %(default)s)")
    p.add_argument("--generations", choices=("random", "distinct"), default=None,
                   help="random: each aggregator start draws its generation (1 in 15 repeats "
                   "the last); distinct: a seeded one other than the last (default: random; "
                   "distinct under --profile tofino, whose design detects no repeat)")
    p.add_argument("--stranger-every", type=float, default=d.stranger_every, metavar="S",
                   help="seconds between the stranger's rounds (0: no stranger; default: "
                   "%(default)s)")
    for kind, what in (("fuzz", "fuzzed datagrams"), ("hellos", "unkeyed hellos"),
                       ("spoofed", "spoofed retransmissions"), ("forged", "forged results")):
        p.add_argument(f"--{kind}", type=int, default=getattr(d, kind),
                       help=f"{what} per round (default: %(default)s)")
    p.add_argument("--hang-s", type=float, default=d.hang_s,
                   help="a stall of every rank's steps this long is a hang (default: %(default)s)")
    p.add_argument("--deadline", type=float, default=d.deadline,
                   help="the workers' --deadline (default: %(default)s)")
    p.add_argument("--workdir", type=Path, help="run directory (default: runs/soak-<timestamp>)")
    profile = JobSpec.add_arguments(p, "profile")["profile"]  # bmv2 only: tofino runs the twin
    deprecated_alias(p, "--p4-profile", profile)
    return p


def run(args: argparse.Namespace) -> int:
    """Check root, run the soak, print its figures; 1 when a target failed."""
    if os.geteuid() != 0:
        raise PermissionError(ROOT_NEEDED.replace("ncina topo", "ncina soak")
                              .replace(", or make topo,", ""))  # fmt: skip
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be positive, not {args.minutes}")
    if args.profile != SoakConfig.profile and args.backend != "bmv2":
        raise ValueError(f"--profile {args.profile} needs --backend bmv2 (the soak runs the "
                         "Tofino design as its twin)")
    generations = args.generations or ("distinct" if args.profile == TOFINO else "random")
    if generations == "random" and args.profile == TOFINO:
        raise ValueError(f"--generations random under --profile {TOFINO}: {LACKS['joined']}, "
                         "so the workers would end at their deadline: use distinct")
    out = args.workdir or Path("runs", time.strftime("soak-%Y%m%d-%H%M%S"))
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--workdir {out} is not empty: the workers append to their metrics "
                         "files, so a previous soak's would be read as this one's")
    from ncina.bench.soak import SUMMARY, Soak

    cfg = SoakConfig(
        out=out,
        minutes=args.minutes, backend=args.backend, workers=args.workers, loss=args.loss,
        bw=args.bw, seed=args.seed, steps_per_run=args.steps_per_run,
        restart_s=tuple(args.restart_s), last_bucket_every=args.last_bucket_every,
        generations=generations, stranger_every=args.stranger_every, fuzz=args.fuzz,
        hellos=args.hellos, spoofed=args.spoofed, forged=args.forged, hang_s=args.hang_s,
        deadline=args.deadline, profile=args.profile,
    )  # fmt: skip
    summary = Soak(cfg).run()
    brief = {k: summary[k] for k in ("seconds", "steps", "recovery_s", "unrecovered_restarts",
                                     "digests_equal", "drops", "hostile")}  # fmt: skip
    brief["restarts"] = len(summary["restarts"])
    brief["hangs"] = len(summary["hangs"])
    print(json.dumps(brief, indent=1))
    print(f"summary: {cfg.out / SUMMARY}")
    for reason in summary["targets_failed"]:
        print(f"ncina soak: target failed: {reason}", file=sys.stderr)
    return 1 if summary["targets_failed"] else 0
