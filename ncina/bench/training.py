"""``ncina bench training``: train the digits MLP with each compression method in its mode.

For every method (``--methods``, default ``ncina.harness.training.METHODS``): start a Python
aggregator on loopback (INA mode for the methods whose payloads a switch can add, server mode
with the same spec for the others), run ``--workers`` ranks of ``ncina train --compressor SPEC
--mode MODE`` for ``--epochs`` epochs (``ncina.harness.training.train_one``), and report the
final test accuracy and loss and the bytes each worker's client sent (UDP payloads: headers and
compressed gradients; in all, and without the retransmissions: the method's own cost) and
received. The first row is NC8 of the raw
gradients, ``ncina train``'s default. ``--markdown FILE`` writes the table of
docs/compressors.md ("Training on the digits MLP with each method").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from ncina.common.options import deprecated_alias
from ncina.common.progress import progress
from ncina.harness.training import METHODS, NC8, train_one
from ncina.proto.job import JobSpec


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
    JobSpec.add_arguments(p, "workers", workers=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    run_timeout = p.add_argument("--run-timeout", type=float, default=900.0,
                                 help="seconds per training run (default: %(default)s)")
    deprecated_alias(p, "--timeout", run_timeout)
    p.add_argument("--markdown", type=Path, help="also write the table to this file")
    return p


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
            rows.append(train_one(spec, workdir, workers=args.workers, epochs=args.epochs,
                                  seed=args.seed, timeout=args.run_timeout))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(rows, args))
    return {"workers": args.workers, "epochs": args.epochs, "runs": rows}
