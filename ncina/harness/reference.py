"""The reference model of a timed all-reduce run (``ncina bench allreduce``, ``bench fabric``):
what each rank all-reduces and what every result must then be, computed here without an
aggregator.

Rank ``r`` of a run seeded ``seed`` all-reduces ``worker_input(seed, r, elements)`` through a
client seeded ``client_seed(seed, r)``, after one warm-up all-reduce of ``WARMUP``; so the NC8
codes it sends are known (``sent_codes``), and so are their exact integer sums
(``build_reference``). ``exact_mismatches`` counts the elements of a result that the sums rule
out: with ``int`` results the float32 of the exact sum, with ``nc8`` results one of the two
roundings of it.

``powers_of_two`` makes inputs whose NC8 codes are exact, so that any sum of them is known
exactly and an all-reduce must return it bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ncina.proto import nc8
from ncina.proto.profiles import DEFAULT, capped

BLOCK = 1 << 20  # elements per block of the reference computations (bounded temporaries)
WARMUP = np.zeros(1, dtype=np.float32)
"""The warm-up all-reduce's tensor; its NC8 encoding draws the first key of a client's stream."""


def worker_input(seed: int, rank: int, elements: int) -> np.ndarray:
    """The tensor rank ``rank`` all-reduces: standard normal float32, seeded by (seed, rank)."""
    return np.random.default_rng([seed, rank]).standard_normal(elements, dtype=np.float32)


def client_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s ``AllreduceClient`` (its NC8 rounding stream)."""
    return seed * 1000 + rank


class Reference(NamedTuple):
    """The workers' inputs (workers x elements) and the exact integer sums of the NC8 codes
    they send (units of ``2**window.e_min``)."""

    inputs: np.ndarray
    sums: np.ndarray
    window: nc8.Window


def sent_codes(seed: int, rank: int, x: np.ndarray, window: nc8.Window) -> np.ndarray:
    """The NC8 codes rank ``rank`` sends for ``x``: its client's rounding stream
    (``client_seed``) draws one key for the warm-up all-reduce, then one for ``x``."""
    rng = np.random.default_rng(client_seed(seed, rank))
    nc8.encode(WARMUP, window, rng)
    return nc8.encode(x, window, rng).codes


def build_reference(
    *, workers: int, elements: int, seed: int, window_max: int, sum_bits: int = nc8.SUM_BITS,
    profile: str = DEFAULT,
) -> Reference:
    """Recompute every worker's input and codes, and the exact sums of the codes, of a run of
    ``workers`` ranks all-reducing ``elements`` each (seed ``seed``, window up to
    ``2**window_max`` keeping sums within ``2**sum_bits``: ``nc8.sum_bits`` of the result
    format; under ``profile`` ``tofino`` its codes capped: ``ncina.proto.profiles``)."""
    window = capped(nc8.Window.for_job(workers, window_max, sum_bits), workers, profile)
    inputs = np.stack([worker_input(seed, r, elements) for r in range(workers)])
    sums = np.zeros(elements, dtype=np.int64)
    for rank in range(workers):
        nc8.accumulate(sums, sent_codes(seed, rank, inputs[rank], window))
    return Reference(inputs, sums, window)


def exact_mismatches(
    result: np.ndarray, sums: np.ndarray, window: nc8.Window, workers: int, result_format: str
) -> int:
    """How many elements of a worker's mean ``result`` the reference model rules out.

    ``int`` and ``int32`` results: the mean must be bit for bit the client's float32 of the exact
    integer sum (``ints_to_float`` divided by N). ``nc8`` results: the aggregator rounds each
    exact sum ``S`` (``2**h <= |S| < 2**(h+1)``) to ``2**h`` or ``2**(h+1)``, sign kept, 0 stays
    0; the mean must be the decoded value of one of those two codes divided by N.
    """
    n = np.float32(workers)
    y = np.asarray(result, dtype=np.float32).reshape(-1)
    if y.shape != sums.shape:
        raise ValueError(f"result of {y.size} elements against {sums.size} sums")
    bad = 0
    for a in range(0, sums.size, BLOCK):
        s, r = sums[a : a + BLOCK], y[a : a + BLOCK]
        if result_format in ("int", "int32"):
            bad += int(np.count_nonzero(r != nc8.ints_to_float(s, window) / n))
            continue
        magnitude = np.abs(s).astype(np.uint64)  # |S| < 2**63: the window rules overflow out
        h = np.zeros(s.shape, dtype=np.int64)
        nonzero = magnitude > 0
        _, exponent = np.frexp(magnitude[nonzero].astype(np.float64))
        estimate = exponent.astype(np.int64) - 1  # float64 rounding may be one off: fix below
        low = np.left_shift(np.uint64(1), estimate.astype(np.uint64))
        estimate -= low > magnitude[nonzero]
        low = np.left_shift(np.uint64(1), estimate.astype(np.uint64))
        estimate += (magnitude[nonzero] - low) >= low
        h[nonzero] = estimate
        sign = np.where(s < 0, 0x80, 0).astype(np.uint8)
        down = np.where(nonzero, (h + 1).astype(np.uint8) | sign, 0).astype(np.uint8)
        up = np.where(nonzero, (h + 2).astype(np.uint8) | sign, 0).astype(np.uint8)
        ok = (r == nc8.decode(down, window) / n) | (r == nc8.decode(up, window) / n)
        bad += int(np.count_nonzero(~ok))
    return bad


def powers_of_two(n: int, seed: int, lowest: int = -40) -> np.ndarray:
    """Signed powers of two ``2**e`` with ``lowest <= e < 8``, about 10 % zeros: well inside every
    test window, so NC8 encodes them exactly and their sums are exact."""
    rng = np.random.default_rng(seed)
    x = np.ldexp(rng.choice([-1.0, 1.0], n), rng.integers(lowest, 8, n)).astype(np.float32)
    x[rng.random(n) < 0.1] = 0.0
    return x
