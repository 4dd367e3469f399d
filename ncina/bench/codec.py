"""``ncina bench codec``: NC8 encode and decode throughput, as ratios to memcpy in the same run.

Throughput is in GB/s of float32 (4 bytes per element, both directions), one core, the median of
``--repeat`` runs. Each repeat times a numpy memcpy of the same array first and then every asked
implementation, so the ratios compare figures taken under the same machine load. Outputs are
preallocated and touched once before timing (``out=``, as the data path uses them), so page
faults are not measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ncina.common.progress import progress
from ncina.proto import nc8
from ncina.proto.job import JobSpec

IMPLS = ("c", "numpy")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench codec``."""
    parser = subparsers.add_parser(
        "codec",
        help="NC8 encode/decode throughput against memcpy",
        description="NC8 encode and decode throughput (GB/s of float32, one core, medians), "
        "as ratios to a numpy memcpy of the same array timed in the same run.",
    )
    parser.add_argument(
        "--elements", type=int, default=10_000_000, help="float32 elements (default: %(default)s)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="timed runs, the median is kept (default: %(default)s)",
    )
    parser.add_argument(
        "--impl", choices=[*IMPLS, "both"], default="both", help="implementation (default: both)"
    )
    JobSpec.add_arguments(parser, "workers", workers=4)  # the job whose window codes are in
    parser.add_argument("--seed", type=int, default=0, help="seed of data and codes (0)")
    return parser


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time memcpy, encode and decode; return GB/s medians and ratios per implementation."""
    if args.elements < 1 or args.repeat < 1:
        raise ValueError("--elements and --repeat must be at least 1")
    names = IMPLS if args.impl == "both" else (args.impl,)
    codecs = {name: nc8.codec(name) for name in names}  # RuntimeError says why C is missing
    window = nc8.Window.for_job(args.workers)
    x = (np.random.default_rng(args.seed).standard_normal(args.elements) * 1e-3).astype(np.float32)
    gigabytes = x.nbytes / 1e9

    copy = np.empty_like(x)
    codes = {name: np.empty(x.shape, np.uint8) for name in names}
    values = {name: np.empty_like(x) for name in names}
    for name, codec in codecs.items():  # warm up: build caches, touch every output page
        codec.decode(codec.encode(x, window, np.random.default_rng(0), out=codes[name]).codes,
                     window, out=values[name])  # fmt: skip
    np.copyto(copy, x)

    times: dict[str, list[float]] = {"memcpy": []}
    for r in progress(range(args.repeat), desc="bench codec", unit="run"):
        times["memcpy"].append(_seconds(lambda: np.copyto(copy, x)))
        for name, codec in codecs.items():
            rng = np.random.default_rng([args.seed, r])  # same key for every implementation
            times.setdefault(f"{name}.encode", []).append(
                _seconds(lambda c=codec, o=codes[name], g=rng: c.encode(x, window, g, out=o))
            )
            times.setdefault(f"{name}.decode", []).append(
                _seconds(lambda c=codec, n=name: c.decode(codes[n], window, out=values[n]))
            )

    memcpy = gigabytes / statistics.median(times["memcpy"])
    figures: dict[str, Any] = {
        "elements": args.elements,
        "repeat": args.repeat,
        "data": "float32 normal(0, 1e-3)",
        "window": {"workers": args.workers, "e_min": window.e_min, "e_max": window.e_max},
        "active_implementation": nc8.IMPLEMENTATION,
        "memcpy_gbps": round(memcpy, 3),
    }
    for name in names:
        enc = gigabytes / statistics.median(times[f"{name}.encode"])
        dec = gigabytes / statistics.median(times[f"{name}.decode"])
        figures[name] = {
            "encode_gbps": round(enc, 3),
            "decode_gbps": round(dec, 3),
            "encode_vs_memcpy": round(enc / memcpy, 4),
            "decode_vs_memcpy": round(dec / memcpy, 4),
        }
    if len(names) == 2:  # the last repeat used the same key for both
        figures["identical_codes"] = bool(np.array_equal(codes["c"], codes["numpy"]))
    return figures
