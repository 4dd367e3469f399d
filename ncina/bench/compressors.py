"""``ncina bench compressors``: size, error and speed of every compressor, and the seeds' claims.

Two kinds of data: a float32 N(0, 1) vector, and real gradients: the per-parameter gradients
of the project's digits MLP (scikit-learn's bundled digits, no download) over the first
``--steps`` steps of plain SGD from a fixed seed, each parameter tensor compressed on its own
(as a training hook would, one :class:`State` per tensor carried over the steps, so error
feedback runs as in training). For each method:

- bits per element: ``8 * len(payload) / n``, headers included, and the compression ratio
  against float32; on the gradients, summed over a step's tensors and averaged over the steps;
- normalised error ``||C(v) - v||^2 / ||v||^2`` of what the compressor was asked to send (``v``
  is the gradient plus the error-feedback memory for ``ef+`` methods), summed over a step's
  tensors, averaged over steps;
- compress and decompress throughput on the Gaussian vector, millions of elements per second,
  median of ``--repeat`` runs, one core.

Then the figures the seed papers claim, measured: NC's second moment (<= 9/8), natural against
standard dithering (same levels, and ``2**(s-1)`` standard levels), QSGD's bits per element in
the dense and sparse regimes against the slides' bounds, FFT against top-k at the same
``theta``, and 3LC's compression ratio on real gradients against the 39-107x of its paper.
``--markdown FILE`` writes the tables of ``docs/compressors.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from ncina.common.progress import progress
from ncina.proto.compressors import ErrorFeedback, State, create

METHODS = (
    "nc",
    "natdither:s=8",
    "natdither:s=8,packed=1",
    "natdither:s=4,p=inf,packed=1",
    "qsgd:s=16,bucket=256",
    "qsgd:s=2,bucket=1024,encoding=sparse",
    "terngrad",
    "topk:ratio=0.01",
    "ef+topk:ratio=0.01",
    "randk:ratio=0.01",
    "signsgd",
    "onebit",
    "fft:theta=0.85,bits=10",
    "ef+fft:theta=0.85,bits=10",
    "3lc:s=1.0",
    "3lc:s=1.9",
)
"""Default method specs of the table (``signsgd``, ``onebit`` and ``3lc`` carry error feedback)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench compressors``."""
    parser = subparsers.add_parser(
        "compressors",
        help="compressor sizes, errors, speeds and the seed papers' claims",
        description="Bits per element, compression ratio, normalised error and throughput of "
        "every compressor on Gaussian vectors and digits-MLP gradients, and the seeds' claims.",
    )
    parser.add_argument(
        "--elements", type=int, default=1 << 20, help="Gaussian elements (default: %(default)s)"
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="digits MLP gradient steps (default: %(default)s)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed runs, median kept (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data and compressors (0)")
    parser.add_argument(
        "--methods",
        default=";".join(METHODS),
        help="';'-separated compressor specs (default: the table of docs/compressors.md)",
    )
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    return parser


Step = list[np.ndarray]
"""The tensors of one step, each compressed on its own."""


def digits_gradients(steps: int, seed: int) -> list[Step]:
    """Per-parameter float32 gradients of the digits MLP over ``steps`` SGD steps (batch 32,
    learning rate 0.1)."""
    try:
        import torch

        from ncina.worker.data import digits
        from ncina.worker.models import mlp
    except ImportError as exc:  # the train extra
        raise RuntimeError(f"gradients of the digits MLP need PyTorch: {exc}") from None
    torch.manual_seed(seed)
    train, _ = digits(seed)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    order = np.random.default_rng(seed).permutation(len(train))
    grads = []
    for step in range(steps):
        start = step * 32 % len(train)
        images, labels = train[order[start : start + 32]]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        grads.append([p.grad.numpy().reshape(-1).copy() for p in model.parameters()])
        optimizer.step()
    return grads


def sq(x: np.ndarray) -> float:
    """Squared 2-norm, in float64."""
    return float(np.sum(np.square(x, dtype=np.float64)))


def trace(spec: str, steps: list[Step], seed: int) -> tuple[list[float], list[float]]:
    """Bits per element and normalised error of each step, its tensors compressed one by one,
    each tensor's state carried over the steps (so error feedback works as in training)."""
    comp = create(spec)
    states = [State(np.random.default_rng([seed, i])) for i in range(len(steps[0]))]
    bits, errors = [], []
    for tensors in steps:
        nbits = elements = err = energy = 0.0
        for x, state in zip(tensors, states, strict=True):
            memory = state.residual if isinstance(comp, ErrorFeedback) else None
            v = x if memory is None else x + memory
            payload = comp.compress(x, state)
            nbits, elements = nbits + 8 * len(payload), elements + x.size
            err, energy = err + sq(comp.decompress(payload) - v), energy + sq(v)
        bits.append(nbits / elements)
        errors.append(err / energy)
    return bits, errors


def measure(spec: str, steps: list[Step], seed: int) -> dict[str, float]:
    """Mean bits per element, compression ratio and normalised error over the steps."""
    bits, errors = trace(spec, steps, seed)
    return {
        "bits": round(statistics.mean(bits), 4),
        "ratio": round(32 / statistics.mean(bits), 2),
        "error": round(statistics.mean(errors), 5),
    }


def throughput(spec: str, x: np.ndarray, repeat: int, seed: int) -> dict[str, float]:
    """Compress and decompress speed on ``x``: millions of elements per second, medians."""
    comp = create(spec)
    enc, dec = [], []
    for r in range(repeat):
        state = State(np.random.default_rng([seed, r]))
        start = time.perf_counter()
        payload = comp.compress(x, state)
        middle = time.perf_counter()
        comp.decompress(payload)
        enc.append(middle - start)
        dec.append(time.perf_counter() - middle)
    return {
        "compress_meps": round(x.size / statistics.median(enc) / 1e6, 2),
        "decompress_meps": round(x.size / statistics.median(dec) / 1e6, 2),
    }


def relative_error(spec: str, steps: list[Step], seed: int) -> float:
    """Mean over steps of ||C(x) - x||^2 / ||x||^2, fresh states (no error feedback memory)
    with a different seed at every step."""
    return statistics.mean(trace(spec, [step], seed + k)[1][0] for k, step in enumerate(steps))


def nc_second_moment(gaussian: np.ndarray, grads: list[Step], seed: int) -> dict[str, Any]:
    """E||C(x)||^2 / ||x||^2 (Theorem 1: at most 9/8), also at the worst case |x| = 4/3."""
    comp = create("nc")
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], gaussian.size)
    worst = (4 / 3 * signs).astype(np.float32)

    def moment(tensors: Step, key: int) -> float:
        state = State(np.random.default_rng([seed, key]))
        out = [comp.decompress(comp.compress(x, state)) for x in tensors]
        return sum(map(sq, out)) / sum(map(sq, tensors))

    return {
        "bound": 9 / 8,
        "gaussian": round(moment([gaussian], 0), 5),
        "worst_case_4/3": round(moment([worst], 0), 5),
        "digits_gradients": round(statistics.mean(moment(g, k) for k, g in enumerate(grads)), 5),
    }


def dithering(n: int, grads: list[Step], seed: int) -> list[dict[str, Any]]:
    """Natural (s levels) against standard dithering (s, and 2**(s-1) levels), 2-norm, one
    bucket per tensor: mean normalised variance over 10 Gaussian vectors of ``n`` elements and
    over the gradient steps. ``natural`` sends the float32 norm, as in the paper's experiments
    (levels alone); ``natural_nc`` compresses it with NC, as the INA payload does."""
    rng = np.random.default_rng(seed)
    data = {
        "gaussian": [[rng.standard_normal(n).astype(np.float32)] for _ in range(10)],
        "digits": grads,
    }
    rows = []
    for s in range(2, 11):
        row: dict[str, Any] = {"s": s, "u": 2 ** (s - 1)}
        for name, steps in data.items():
            for label, spec in (
                ("natural", f"natdither:s={s},packed=1,nc_norm=0"),
                ("natural_nc", f"natdither:s={s}"),
                ("standard_s", f"qsgd:s={s},bucket=0"),
                ("standard_u", f"qsgd:s={2 ** (s - 1)},bucket=0"),
            ):
                row[f"{name}_{label}"] = round(relative_error(spec, steps, seed), 4)
        row["theorem5_factor"] = round(2 ** (s - 1) / s, 2)
        rows.append(row)
    return rows


def qsgd_bits(x: np.ndarray, seed: int) -> list[dict[str, Any]]:
    """Measured bits per element of QSGD against the slides' bounds (F = 32): the linear
    theorem's ``F + 2.8 d`` at ``s = sqrt(d)``, the sublinear theorem (``bound``, the compressor's
    nominal bits) and, for ``s = 1``, the simple scheme's ``F + sqrt(d) (log d + log 2e)``."""
    rows = []
    for d in (64, 256, 1024, 4096):
        cases = [("dense", math.isqrt(d))] + [("sparse", s) for s in (1, 2)]
        for encoding, s in cases:
            comp = create(f"qsgd:s={s},bucket={d},encoding={encoding}")
            payload = comp.compress(x, State(np.random.default_rng(seed)))
            rows.append(
                {
                    "bucket": d,
                    "s": s,
                    "encoding": encoding,
                    "bits": round(8 * len(payload) / x.size, 3),
                    "bound": round(comp.nominal_bits(x.size), 3),
                    "slides_2.8+F/d": round(2.8 + 32 / d, 3) if encoding == "dense" else None,
                    "slides_s=1": round((32 + math.sqrt(d) * math.log2(2 * math.e * d)) / d, 3)
                    if s == 1
                    else None,
                }
            )
    return rows


def fft_vs_topk(gaussian: np.ndarray, grads: list[Step], seed: int) -> list[dict[str, Any]]:
    """Reconstruction error of FFT sparsification and of top-k keeping as many reals."""
    rows = []
    for theta in (0.5, 0.75, 0.85, 0.95):
        row: dict[str, Any] = {"theta": theta}
        for name, steps in (("gaussian", [[gaussian]]), ("digits", grads)):
            for label, spec in (
                ("topk", f"topk:ratio={1 - theta:.2f}"),
                ("fft_f32", f"fft:theta={theta},bits=32"),
                ("fft_10bit", f"fft:theta={theta},bits=10"),
            ):
                row[f"{name}_{label}"] = round(relative_error(spec, steps, seed), 4)
        rows.append(row)
    return rows


def threelc_ratio(grads: list[Step], seed: int) -> list[dict[str, Any]]:
    """3LC compression ratio on the gradients, error accumulation carried over the steps."""
    rows = []
    for s in (1.0, 1.5, 1.9):
        bits, errors = trace(f"3lc:s={s}", grads, seed)
        rows.append(
            {
                "s": s,
                "bits": round(statistics.mean(bits), 4),
                "ratio": round(32 / statistics.mean(bits), 1),
                "ratio_min": round(32 / max(bits), 1),
                "ratio_max": round(32 / min(bits), 1),
                "error": round(statistics.mean(errors), 4),
            }
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every method and every claim; optionally write the markdown tables."""
    if args.elements < 16 or args.steps < 1 or args.repeat < 1:
        raise ValueError("need --elements >= 16, --steps >= 1 and --repeat >= 1")
    specs = [spec.strip() for spec in args.methods.split(";") if spec.strip()]
    gaussian = np.random.default_rng(args.seed).standard_normal(args.elements).astype(np.float32)
    grads = digits_gradients(args.steps, args.seed)
    methods = []
    for spec in progress(specs, desc="bench compressors", unit="method"):
        comp = create(spec)
        methods.append(
            {
                "method": spec,
                "ina": comp.ina,
                "unbiased": comp.unbiased,
                "nominal_bits": round(comp.nominal_bits(args.elements), 3),
                "gaussian": measure(spec, [[gaussian]], args.seed),
                "digits": measure(spec, grads, args.seed),
                **throughput(spec, gaussian, args.repeat, args.seed),
            }
        )
    figures: dict[str, Any] = {
        "elements": args.elements,
        "digits_parameters": sum(g.size for g in grads[0]),
        "digits_tensors": len(grads[0]),
        "steps": args.steps,
        "methods": methods,
        "nc_second_moment": nc_second_moment(gaussian, grads, args.seed),
        "dithering": dithering(1 << 14, grads, args.seed),
        "qsgd_bits": qsgd_bits(gaussian, args.seed),
        "fft_vs_topk": fft_vs_topk(gaussian, grads, args.seed),
        "threelc_ratio": threelc_ratio(grads, args.seed),
    }
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(figures))
    return figures


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    for row in rows:
        cells = ("" if row.get(c) is None else str(row[c]) for c in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(figures: dict[str, Any]) -> str:
    """The benchmark's tables as markdown, for ``docs/compressors.md``."""
    rows = [
        {
            "method": f"`{m['method']}`",
            "INA": "yes" if m["ina"] else "",
            "nominal bits": m["nominal_bits"],
            **{f"{k} {d}": m[d][k] for d in ("gaussian", "digits") for k in m[d]},
            "compress Me/s": m["compress_meps"],
            "decompress Me/s": m["decompress_meps"],
        }
        for m in figures["methods"]
    ]
    cols = list(rows[0]) if rows else []
    nc = figures["nc_second_moment"]
    parts = [
        f"Gaussian: {figures['elements']} float32 N(0, 1) elements. Digits: "
        f"{figures['digits_parameters']}-parameter MLP ({figures['digits_tensors']} tensors, "
        f"each compressed alone), {figures['steps']} SGD steps.",
        "",
        _table(rows, cols),
        "",
        "NC second moment E||C(x)||^2/||x||^2 (bound 9/8 = 1.125): "
        f"Gaussian {nc['gaussian']}, worst case |x| = 4/3 {nc['worst_case_4/3']}, "
        f"digits gradients {nc['digits_gradients']}.",
        "",
        _table(figures["dithering"], list(figures["dithering"][0])),
        "",
        _table(figures["qsgd_bits"], list(figures["qsgd_bits"][0])),
        "",
        _table(figures["fft_vs_topk"], list(figures["fft_vs_topk"][0])),
        "",
        _table(figures["threelc_ratio"], list(figures["threelc_ratio"][0])),
        "",
    ]
    return "\n".join(parts)
