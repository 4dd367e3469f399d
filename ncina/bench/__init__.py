"""``ncina bench``: benchmarks that print one JSON line of figures and write it to a file.

Speed targets are measured here, never by timed assertions in tests. Each benchmark is one module
of this package exposing ``add_parser(subparsers)`` and ``run(args) -> dict`` (the figures).
``ncina soak`` (``soak_cli``, ``soak``) lives here too: it drives the topology runner with the
harness, so its floor is above both.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from ncina.proto.profiles import DEFAULT_RESULTS

BENCHMARKS: dict[str, str] = {
    "codec": "ncina.bench.codec",
    "allreduce": "ncina.bench.allreduce",
    "fabric": "ncina.bench.fabric",
    "compressors": "ncina.bench.compressors",
    "aggregator": "ncina.bench.aggregator",
    "reliability": "ncina.bench.reliability",
    "training": "ncina.bench.training",
    "tag": "ncina.bench.tag",
    "ddp": "ncina.bench.ddp",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench`` and its benchmarks."""
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark; prints a JSON line and writes it to --output",
        description="Benchmarks. Each prints one JSON line of figures and appends it to a file.",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(module)
        p = mod.add_parser(sub)
        p.add_argument(
            "--output",
            default=f"runs/bench/{name}.jsonl",
            help="file the JSON line is appended to (default: %(default)s)",
        )
        p.set_defaults(_bench=mod.run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark, print its figures as JSON and append them to ``--output``."""
    figures: dict[str, Any] = {
        "benchmark": args.benchmark,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }
    if getattr(args, "result", "") is None:  # the job's profile decides (bench allreduce, fabric)
        args.result = DEFAULT_RESULTS[args.profile]
    figures.update(args._bench(args))
    line = json.dumps(figures, sort_keys=False)
    print(line)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(line + "\n")
    return 0
