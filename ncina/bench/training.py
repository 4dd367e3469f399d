"""``ncina bench training``: train the digits MLP with each compression method in its mode.

For every method (``--methods``, default :data:`METHODS`): start a Python aggregator on loopback
(INA mode for the methods whose payloads a switch can add, server mode with the same spec for the
others), run ``--workers`` ranks of ``ncina train --compressor SPEC --mode MODE`` for
``--epochs`` epochs, and report the final test accuracy and loss and the bytes each worker's
client sent (UDP payloads: headers and compressed gradients; in all, and without the
retransmissions: the method's own cost) and received. The first row is NC8 of the raw
gradients, ``ncina train``'s default. ``--markdown FILE`` writes the table of
docs/compressors.md ("Training on the digits MLP with each method").
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ncina.aggregator import process as aggproc
from ncina.cli import deprecated_alias
from ncina.progress import progress
from ncina.proto.compressors import create
from ncina.worker.client import check_mode

JOB = 1
NC8 = "nc8"
"""The row of ``ncina train`` without ``--compressor``: NC8 of the raw gradients (INA)."""
METHODS = [
    NC8,
    "natdither:s=8",
    "natdither:s=8,packed=1",
    "qsgd:s=16,bucket=256",
    "qsgd:s=2,bucket=1024,encoding=sparse",
    "terngrad",
    "ef+topk:ratio=0.01",
    "ef+topk:ratio=0.1",
    "randk:ratio=0.25",
    "signsgd",
    "onebit",
    "fft:theta=0.85,bits=10",
    "ef+fft:theta=0.85,bits=10",
    "3lc",
]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench training``."""
    p = subparsers.add_parser(
        "training",
        help="train the digits MLP with each compressor in its mode (INA or server)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--methods", nargs="+", default=METHODS, metavar="SPEC",
                   help=f"compressor specs ({NC8!r}: no compressor, NC8 in INA mode)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    run_timeout = p.add_argument("--run-timeout", type=float, default=900.0,
                                 help="seconds per training run (default: %(default)s)")
    deprecated_alias(p, "--timeout", run_timeout)
    p.add_argument("--markdown", type=Path, help="also write the table to this file")
    return p


def mode_of(spec: str) -> str:
    """INA for the integer-summable methods, server mode for the others."""
    return "ina" if spec == NC8 or create(spec).ina else "server"


def train_one(spec: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One training run of ``spec`` in its mode; its figures."""
    mode = mode_of(spec)
    if spec != NC8:
        check_mode(create(spec), mode)
    agg_args = ["--listen", "127.0.0.1:0", "--job", str(JOB), "--workers", str(args.workers),
                "--k", "256", "--seed", str(args.seed), "--stats", str(workdir / "stats.json")]
    agg_args += (["--mode", "server", "--compressor", spec] if mode == "server"
                 else ["--result", "nc8"])  # fmt: skip
    proc, (host, port) = aggproc.start(agg_args, workdir / "aggregator.log")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = s.getsockname()[1]
    metrics = [workdir / f"worker{rank}.jsonl" for rank in range(args.workers)]
    compressor = [] if spec == NC8 else ["--compressor", spec, "--mode", mode]
    workers = []
    try:
        for rank in range(args.workers):
            with (workdir / f"worker{rank}.log").open("wb") as log:
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "ncina.cli", "train", "--rank", str(rank),
                     "--workers", str(args.workers), "--master", f"127.0.0.1:{master}",
                     "--aggregator", f"{host}:{port}", "--k", "256", "--epochs", str(args.epochs),
                     "--seed", str(args.seed), "--log-every", "1000", "--metrics",
                     str(metrics[rank]),
                     *compressor],
                    stdout=log, stderr=subprocess.STDOUT,
                ))  # fmt: skip
        for rank, w in enumerate(workers):
            if w.wait(timeout=args.run_timeout) != 0:
                log = aggproc.tail(workdir / f"worker{rank}.log")
                raise RuntimeError(f"{spec}: worker {rank} failed:\n{log}")
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        aggproc.stop(proc)
    ends = [next(e for e in map(json.loads, m.read_text().splitlines()) if e["event"] == "end")
            for m in metrics]  # fmt: skip
    n = len(ends)
    return {
        "method": spec,
        "mode": mode,
        "steps": ends[0]["steps"],
        "accuracy": round(ends[0]["test_acc"], 2),
        "test_loss": round(ends[0]["test_loss"], 4),
        "mb_sent_per_worker": round(sum(e["fabric"]["bytes_sent"] for e in ends) / n / 1e6, 3),
        "mb_received_per_worker": round(
            sum(e["fabric"]["bytes_received"] for e in ends) / n / 1e6, 3
        ),
        "mb_first_sends_per_worker": round(
            sum(e["fabric"]["bytes_sent"] - e["fabric"]["bytes_retransmitted"] for e in ends)
            / n / 1e6, 3
        ),
        "retransmissions": sum(e["fabric"]["retransmissions"] for e in ends),
    }


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The table of docs/compressors.md."""
    columns = list(rows[0])
    lines = [
        f"Digits MLP (17226 parameters, one DDP bucket of 68 chunks of K = 256), {args.workers} "
        f"workers on loopback, {args.epochs} epochs ({rows[0]['steps']} steps), SGD lr 0.1 "
        f"momentum 0.9, seed {args.seed}. MB sent and received: the workers' UDP payloads "
        "(ncina headers included), per worker; first sends: without the retransmissions.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        cells = [f"`{v}`" if k == "method" else str(v) for k, v in row.items()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train once per method; optionally write the markdown table."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ncina-bench-training-") as tmp:
        for i, spec in enumerate(progress(args.methods, desc="bench training", unit="method")):
            workdir = Path(tmp, str(i))
            workdir.mkdir()
            rows.append(train_one(spec, args, workdir))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(rows, args))
    return {"workers": args.workers, "epochs": args.epochs, "runs": rows}
