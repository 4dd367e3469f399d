"""The NC8 codec (ncina.proto.nc8) against docs/protocol.md, "The NC8 code".

Exact tables for hand-picked values, a plain-Python transcription of the spec (the oracle) that
both implementations must match byte for byte, statistical checks with fixed seeds (unbiasedness,
the 9/8 second-moment bound), C/numpy parity on random bit patterns, the cffi build helper, and
the aggregator's result bits (keys pinned from a separate transcription, statistics over many
chunks' keys, C/numpy parity).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
from ncina.proto import nc8
from ncina.proto.nc8 import Window

from ncina.cli import main
from ncina.common.cbuild import _check_toolchain as check_toolchain
from ncina.common.cbuild import build_extension

W4 = Window.for_job(4)  # [-50, 10], the paper's window
M64 = (1 << 64) - 1
F32_MAX = float(np.finfo(np.float32).max)


def c_codec() -> nc8.Codec:
    """The C codec. Skipped, with the reason, only where a tool it needs is missing (a C
    compiler, Python's headers: ``ncina.common.cbuild``'s toolchain check) or ``NCINA_NO_C`` asks
    for numpy; a build that fails on a machine with the tools is a failure, not a skip."""
    if os.environ.get("NCINA_NO_C", "") not in ("", "0"):
        pytest.skip("NCINA_NO_C is set")
    try:
        check_toolchain()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return nc8.codec("c")


@pytest.fixture(params=["numpy", "c"])
def codec(request: pytest.FixtureRequest) -> nc8.Codec:
    """Each implementation in turn (C as ``c_codec`` gives it)."""
    return c_codec() if request.param == "c" else nc8.codec("numpy")


def both_codecs() -> tuple[nc8.Codec, nc8.Codec]:
    return nc8.codec("numpy"), c_codec()


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def rngs(n: int = 3) -> list[np.random.Generator]:
    return [np.random.default_rng(seed) for seed in range(n)]


# --- the spec, transcribed element by element ----------------------------------------------------


def splitmix64(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def stream_word(key: int, i: int) -> int:
    return splitmix64((key + (i + 1) * 0x9E3779B97F4A7C15) & M64)


def key_of(seed: int) -> int:
    """The key a call draws from ``default_rng(seed)`` (documented: one uint64 per call)."""
    return int(np.random.default_rng(seed).integers(0, 2**64, dtype=np.uint64))


def oracle_encode(x: np.ndarray, key: int, w: Window) -> list[int]:
    codes = []
    for i, bits in enumerate(x.astype(np.float32).view(np.uint32).tolist()):
        z = stream_word(key, i)
        sign, biased, mantissa = bits >> 31, (bits >> 23) & 0xFF, bits & 0x7FFFFF
        up = (z & 0x7FFFFF) < mantissa
        if biased == 0:  # zero, or a subnormal rounded to 0 or 2**-126
            if not up:
                codes.append(0)
                continue
            e = -126
        else:
            e = biased - 127 + up
        if e > w.e_max:
            c = w.span + 1
        elif e >= w.e_min:
            c = e - w.e_min + 1
        else:
            gap = w.e_min - e
            c = int(gap <= 41 and (z >> 23) >> (41 - gap) == 0)
        codes.append(c | sign << 7 if c else 0)
    return codes


def int_key_of(seed: int) -> int:
    """The 32-bit key ``int_to_codes`` draws from ``default_rng(seed)`` (documented)."""
    return int(np.random.default_rng(seed).integers(0, 2**32, dtype=np.uint64))


def crc32_linear(data: bytes) -> int:
    """CRC-32's linear part (zero register, no final xor), bit by bit from the polynomial: a
    transcription separate from the package's byte tables."""
    reg = 0
    for byte in data:
        reg ^= byte
        for _ in range(8):
            reg = reg >> 1 ^ (0xEDB88320 if reg & 1 else 0)
    return reg


def rounding_word(key: int, i: int) -> int:
    """Element ``i``'s rounding word of a re-compression keyed ``key`` (lane 0's word)."""
    return key ^ crc32_linear(i.to_bytes(4, "big"))


def oracle_int_to_codes(sums: np.ndarray, key: int) -> list[int]:
    codes = []
    for i, s in enumerate(sums.tolist()):
        if s == 0:
            codes.append(0)
            continue
        mag = abs(s)
        h = mag.bit_length() - 1
        below = (rounding_word(key, i) << 32) >> (64 - h)  # the top h bits of word << 32
        c = h + 1 + (below < mag - 2**h)
        codes.append(c | (0x80 if s < 0 else 0))
    return codes


def unsplitmix64(z: int) -> int:
    """Inverse of the splitmix64 finalizer (xor-shifts and odd multipliers are invertible)."""
    z ^= z >> 31 ^ z >> 62
    z = z * pow(0x94D049BB133111EB, -1, 1 << 64) & M64
    z ^= z >> 27 ^ z >> 54
    z = z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64) & M64
    return z ^ z >> 30 ^ z >> 60


class KeyedRng:
    """Stands in for a Generator whose one draw of a call is ``key``."""

    def __init__(self, key: int) -> None:
        self.key = key

    def integers(self, low: int, high: int, dtype: type) -> np.uint64:
        assert (low, dtype) == (0, np.uint64) and high in (2**32, 2**64) and self.key < high
        return np.uint64(self.key)


def rng_giving_word(z: int) -> KeyedRng:
    """An rng whose call gives element 0 the random word ``z``."""
    return KeyedRng((unsplitmix64(z) - nc8.GAMMA) & M64)


def edge_values(w: Window) -> np.ndarray:
    """Powers and near-powers around and across the window, zeros, subnormals, extremes."""
    exps = np.arange(max(w.e_min - 45, -126), min(w.e_max + 3, 128))
    powers = np.exp2(exps.astype(np.float64))
    mults = [1.0, 1.5, 4 / 3, 1.0000001, 1.9999999]
    special = [0.0, -0.0, 1e-45, 2.0**-130, 2.0**-127, 1.1754942e-38, 2.0**-126, F32_MAX]
    vals = np.concatenate([np.outer(powers, mults).ravel(), special])
    vals = np.concatenate([vals, -vals]).astype(np.float32)
    return vals[np.isfinite(vals)]


def random_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    """Uniformly random finite float32 bit patterns: every exponent, subnormals included."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint32)
    return bits[((bits >> 23) & 0xFF) != 0xFF].view(np.float32)


WINDOWS = [
    Window.for_job(1),
    W4,
    Window.for_job(1000),
    Window.for_job(1, e_max=-64),  # e_min = -126: subnormals reach the window
    Window.for_job(1, e_max=125),  # e_min = 63, the highest allowed
    Window(e_min=-90, span=0),
]


# --- Window --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "e_max", "e_min", "span"),
    [(1, 10, -52, 62), (2, 10, -51, 61), (3, 10, -50, 60), (4, 10, -50, 60), (5, 10, -49, 59),
     (8, 10, -49, 59), (9, 10, -48, 58), (1000, 10, -42, 52), (4, 12, -48, 60)],
)  # fmt: skip
def test_window_for_job(workers: int, e_max: int, e_min: int, span: int) -> None:
    w = Window.for_job(workers, e_max)
    assert (w.e_min, w.span, w.e_max, w.max_code) == (e_min, span, e_max, span + 1)
    assert workers * 2**w.span <= 2**62 < (2 * workers) * 2**w.span  # as wide as is safe


@pytest.mark.parametrize(
    ("workers", "e_max", "match"),
    [(0, 10, "at least 1 worker"), (-3, 10, "at least 1 worker"),
     (4, -67, "e_min -127"), (4, 124, "e_min 64"), (1, 126, "e_min 64")],
)  # fmt: skip
def test_window_for_job_invalid(workers: int, e_max: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Window.for_job(workers, e_max)


def test_window_bounds_are_inclusive() -> None:
    assert Window.for_job(4, -66).e_min == -126
    assert Window.for_job(4, 123).e_min == 63
    with pytest.raises(ValueError, match="span"):
        Window(e_min=0, span=63)


# --- exact tables ------------------------------------------------------------------------------


def test_powers_in_window_encode_exactly(codec: nc8.Codec) -> None:
    exps = np.arange(W4.e_min, W4.e_max + 1)
    x = np.exp2(exps.astype(np.float64)).astype(np.float32)
    expected = (exps - W4.e_min + 1).astype(np.uint8)
    assert expected[0] == 1 and expected[-1] == W4.max_code == 61
    for rng in rngs():
        pos, neg = codec.encode(x, W4, rng), codec.encode(-x, W4, rng)
        assert pos.codes.tolist() == expected.tolist() and pos.saturated == 0
        assert neg.codes.tolist() == (expected | 0x80).tolist() and neg.saturated == 0
        assert np.array_equal(codec.decode(pos.codes, W4), x)
        assert np.array_equal(codec.decode(neg.codes, W4), -x)


def test_zero_encodes_to_0x00(codec: nc8.Codec) -> None:
    for rng in rngs():
        assert codec.encode(f32(0.0, -0.0, 0.0), W4, rng).codes.tolist() == [0, 0, 0]


def test_above_window_saturates_and_counts(codec: nc8.Codec) -> None:
    x = f32(2.0**11, -(2.0**11), 2.0**40, F32_MAX, -F32_MAX, 2.0**10)
    enc = codec.encode(x, W4, np.random.default_rng(0))
    assert enc.codes.tolist() == [61, 0x80 | 61, 61, 61, 0x80 | 61, 61]
    assert enc.saturated == 5  # 2**e_max itself is in the window


def test_saturation_after_rounding_up(codec: nc8.Codec) -> None:
    """1.5 * 2**e_max rounds to 2**(e_max + 1) half of the time: those are the saturated ones."""
    enc = codec.encode(np.full(20_000, 1.5 * 2.0**10, np.float32), W4, np.random.default_rng(1))
    assert set(enc.codes.tolist()) == {61}
    assert abs(enc.saturated - 10_000) < 5 * math.sqrt(20_000 * 0.25)


def assert_frequency(hits: int, n: int, p: float) -> None:
    assert abs(hits - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (hits, n, p)


@pytest.mark.parametrize(
    ("value", "p"),
    [(2.0**-51, 1 / 2), (2.0**-53, 1 / 8), (-(2.0**-56), 1 / 64), (1.5 * 2.0**-52, 3 / 8)],
)
def test_below_window_rounds_to_zero_or_smallest_power(
    codec: nc8.Codec, value: float, p: float
) -> None:
    n = 100_000
    codes = codec.encode(np.full(n, value, np.float32), W4, np.random.default_rng(7)).codes
    smallest = 0x81 if value < 0 else 0x01
    assert set(codes.tolist()) <= {0, smallest}
    assert_frequency(int(np.count_nonzero(codes)), n, p)


def test_far_below_window_is_zero(codec: nc8.Codec) -> None:
    x = f32(2.0**-92, -(2.0**-100), 2.0**-126, 1e-40, 1e-45)  # gaps of 42 and more
    for rng in rngs():
        assert codec.encode(np.tile(x, 1000), W4, rng).codes.tolist() == [0] * 5000


@pytest.mark.parametrize(
    ("e_max", "value", "p"),
    [(-64, 2.0**-127, 1 / 2), (-64, 2.0**-130, 1 / 16), (-64, -(2.0**-149), 0.0),
     (-62, 2.0**-127, 1 / 8)],  # e_min = -124: to 2**-126 (1/2), then two below (1/4)
)  # fmt: skip
def test_subnormals(codec: nc8.Codec, e_max: int, value: float, p: float) -> None:
    w = Window.for_job(1, e_max=e_max)
    n = 100_000
    codes = codec.encode(np.full(n, value, np.float32), w, np.random.default_rng(3)).codes
    assert set(codes.tolist()) <= {0, 0x81 if value < 0 else 0x01}
    assert_frequency(int(np.count_nonzero(codes)), n, p)


def test_decode_table(codec: nc8.Codec) -> None:
    for w in (W4, Window.for_job(1, e_max=-64), Window.for_job(1, e_max=125)):
        valid = np.array([b for b in range(256) if (b & 0x7F) <= 64], dtype=np.uint8)
        got = codec.decode(valid, w)
        for b, v in zip(valid.tolist(), got.tolist(), strict=True):
            c = b & 0x7F
            want = 0.0 if c == 0 else (-1.0) ** (b >> 7) * 2.0 ** (w.e_min + c - 1)
            assert v == want and math.isfinite(v), (w, b)
        assert codec.decode(np.array([0x80], np.uint8), w).view(np.uint32)[0] == 0  # +0.0


def test_decode_rejects_codes_above_64(codec: nc8.Codec) -> None:
    codes = np.zeros((2, 5), np.uint8)
    codes[1, 2] = 0x80 | 65
    with pytest.raises(ValueError, match="index 7"):
        codec.decode(codes, W4)


def test_int_table(codec: nc8.Codec) -> None:
    valid = [b for b in range(256) if (b & 0x7F) <= 63]
    got = codec.codes_to_int(np.array(valid, np.uint8)).tolist()
    want = [0 if b & 0x7F == 0 else (-1) ** (b >> 7) * 2 ** ((b & 0x7F) - 1) for b in valid]
    assert got == want
    assert codec.codes_to_int(np.array([1, 0x81, 63, 0x80 | 63], np.uint8)).tolist() == [
        1, -1, 2**62, -(2**62)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="index 1"):
        codec.codes_to_int(np.array([1, 64], np.uint8))


def test_accumulate(codec: nc8.Codec) -> None:
    codes = np.array([[0, 1, 0x81], [3, 0x80 | 63, 63]], np.uint8)
    acc = np.full((2, 3), 10, np.int64)
    codec.accumulate(acc, codes)
    assert acc.tolist() == [[10, 11, 9], [14, 10 - 2**62, 10 + 2**62]]
    before = acc.copy()
    with pytest.raises(ValueError, match="index 2"):
        codec.accumulate(acc, np.array([[0, 1, 0x40], [0, 0, 0]], np.uint8))
    assert np.array_equal(acc, before)  # nothing added
    with pytest.raises(ValueError, match="shape"):
        codec.accumulate(acc, codes[0])
    with pytest.raises(TypeError):
        codec.accumulate(acc.astype(np.int32), codes)


def test_int_to_codes_exact_cases(codec: nc8.Codec) -> None:
    s = np.array([0, 1, -1, 2, 4, -(2**40), 2**62, -(2**62), -(2**63)], np.int64)
    want = [0, 1, 0x81, 2, 3, 0x80 | 41, 63, 0x80 | 63, 0x80 | 64]
    for rng in rngs():
        assert codec.int_to_codes(s, rng).tolist() == want


@pytest.mark.parametrize(("s", "low", "p_up"), [(5, 3, 1 / 4), (-7, 0x83, 3 / 4), (3, 2, 1 / 2)])
def test_int_to_codes_frequency(codec: nc8.Codec, s: int, low: int, p_up: float) -> None:
    n = 100_000
    codes = codec.int_to_codes(np.full(n, s, np.int64), np.random.default_rng(11))
    assert set(codes.tolist()) <= {low, low + 1}
    assert_frequency(int(np.count_nonzero(codes == low + 1)), n, p_up)


def test_ints_to_float() -> None:
    s = np.array([[0, 1, -3], [2**62, -(2**63), 5]], np.int64)
    assert nc8.ints_to_float(s, W4).tolist() == [
        [0.0, 2.0**-50, -3 * 2.0**-50], [2.0**12, -(2.0**13), 5 * 2.0**-50]
    ]  # fmt: skip


# --- errors and arguments ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises_with_index(codec: nc8.Codec, bad: float) -> None:
    x = np.ones((3, 4), np.float32)
    x[1, 3] = bad
    x[2, 0] = bad
    with pytest.raises(ValueError, match=r"(nan|inf) at flat index 7"):
        codec.encode(x, W4, np.random.default_rng(0))


def test_float64_input_is_converted_and_overflow_reported(codec: nc8.Codec) -> None:
    x = np.array([1.0, 2.0**-50, -4.0])
    assert codec.encode(x, W4, np.random.default_rng(0)).codes.tolist() == [51, 1, 0x80 | 53]
    with pytest.raises(ValueError, match=r"1e\+300 at flat index 1"):
        codec.encode(np.array([1.0, 1e300]), W4, np.random.default_rng(0))
    with pytest.raises(TypeError):
        codec.encode(np.arange(3), W4, np.random.default_rng(0))


def test_shapes_and_out(codec: nc8.Codec) -> None:
    x = np.random.default_rng(0).standard_normal((4, 5, 6)).astype(np.float32)
    out = np.empty((4, 5, 6), np.uint8)
    enc = codec.encode(x, W4, np.random.default_rng(1), out=out)
    assert enc.codes is out
    assert np.array_equal(out, codec.encode(x, W4, np.random.default_rng(1)).codes)
    assert np.array_equal(  # a non-contiguous input gives the codes of its contiguous copy
        codec.encode(x.transpose(), W4, np.random.default_rng(1)).codes,
        codec.encode(x.transpose().copy(), W4, np.random.default_rng(1)).codes,
    )
    dec = np.empty((4, 5, 6), np.float32)
    assert codec.decode(out, W4, out=dec) is dec
    for wrong in (np.empty(120, np.uint8), np.empty((4, 5, 6), np.int8)):
        with pytest.raises(ValueError, match="out"):
            codec.encode(x, W4, np.random.default_rng(1), out=wrong)
    assert codec.encode(np.empty(0, np.float32), W4, np.random.default_rng(0)).codes.size == 0
    assert codec.decode(np.empty(0, np.uint8), W4).size == 0


# --- statistics --------------------------------------------------------------------------------

DISTRIBUTIONS = {
    "normal": lambda r, n: r.standard_normal(n) * 1e-2,
    "uniform": lambda r, n: r.uniform(-1.0, 1.0, n),
    # wide: exponents across the whole window and six powers below it
    "log-uniform": lambda r, n: r.choice([-1.0, 1.0], n) * np.exp2(r.uniform(-56.0, 10.0, n)),
}


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_encode_is_unbiased(codec: nc8.Codec, dist: str) -> None:
    rng = np.random.default_rng(2024)
    n, repeats = 256, 4000
    x = DISTRIBUTIONS[dist](rng, n).astype(np.float32)
    enc = codec.encode(np.tile(x, repeats), W4, rng)
    assert enc.saturated == 0
    mean = codec.decode(enc.codes, W4).reshape(repeats, n).astype(np.float64).mean(axis=0)
    assert_unbiased(mean, x.astype(np.float64), encode_variance(x, W4), repeats)


def encode_variance(x: np.ndarray, w: Window) -> np.ndarray:
    """Var[C(x)] by the spec, for normal float32 ``x`` in or below the window (float64)."""
    a = np.abs(x.astype(np.float64))
    lo = np.exp2(np.frexp(a)[1] - 1.0)  # 2**floor(log2 a)
    p_up = np.where(a > 0, a / np.where(a > 0, lo, 1.0) - 1.0, 0.0)

    def second_moment(power: np.ndarray) -> np.ndarray:  # E[C^2] once rounded to `power`
        return np.where(power >= 2.0**w.e_min, power * power, 2.0**w.e_min * power)

    return (1 - p_up) * second_moment(lo) + p_up * second_moment(2 * lo) - a * a


def assert_unbiased(mean: np.ndarray, exact: np.ndarray, var: np.ndarray, repeats: int) -> None:
    """Each mean of ``repeats`` draws within 5.5 standard errors; no spread means exact."""
    assert np.array_equal(mean[var == 0], exact[var == 0])
    se = np.sqrt(var[var > 0] / repeats)
    z = (mean[var > 0] - exact[var > 0]) / se
    assert np.max(np.abs(z)) < 5.5, np.max(np.abs(z))
    total = np.sum(mean - exact) / math.sqrt(np.sum(var) / repeats)
    assert abs(total) < 4, total


def test_second_moment_is_at_most_nine_eighths(codec: nc8.Codec) -> None:
    """E[C(x)^2] / x^2 = (1 + 3t) / (1 + t)^2 for x = 2^e (1 + t): at most 9/8, at t = 1/3."""
    t = np.linspace(0.0, 1.0, 25, endpoint=False)
    x = (2.0**-3 * (1.0 + t)).astype(np.float32)
    t = x.astype(np.float64) / 2.0**-3 - 1.0  # t of the float32 values
    repeats = 20_000
    values = codec.decode(codec.encode(np.tile(x, repeats), W4, np.random.default_rng(5)).codes, W4)
    ratio = (values.reshape(repeats, -1).astype(np.float64) / x) ** 2
    mean, se = ratio.mean(axis=0), ratio.std(axis=0) / math.sqrt(repeats)
    theory = (1 + 3 * t) / (1 + t) ** 2
    assert np.all(theory <= 9 / 8 + 1e-12)
    assert np.all(np.abs(mean - theory) <= 5 * se + 1e-12)


@pytest.mark.parametrize(("mult", "var_ratio"), [(4 / 3, 1 / 8), (1.5, 1 / 9), (1.0, 0.0)])
def test_variance_ratio(codec: nc8.Codec, mult: float, var_ratio: float) -> None:
    """Var[C(x)] / x^2 peaks at 1/8 for x = 4/3 * 2^e (1/9 at 1.5 * 2^e), 0 on powers of two."""
    x = np.float32(mult * 2.0**-7)
    values = codec.decode(codec.encode(np.full(200_000, x), W4, np.random.default_rng(9)).codes, W4)
    ratio = np.var(values.astype(np.float64)) / float(x) ** 2
    assert abs(ratio - var_ratio) < 0.002, ratio


def test_int_to_codes_is_unbiased(codec: nc8.Codec) -> None:
    rng = np.random.default_rng(77)
    n, repeats = 192, 4000
    workers = [codec.encode(rng.standard_normal(n) * 1e-3, W4, rng).codes for _ in range(4)]
    sums = np.concatenate([
        rng.integers(-1000, 1000, n),
        rng.choice([-1, 1], n) * rng.integers(0, 2**62, n),
        np.sum([codec.codes_to_int(c) for c in workers], axis=0),  # a real slot of 4 workers
    ])  # fmt: skip
    codes = codec.int_to_codes(np.tile(sums, repeats), rng)
    mean = codec.codes_to_int(codes).reshape(repeats, -1).astype(np.float64).mean(axis=0)
    var = []  # |S| = 2**h + r is 2**h or 2**(h + 1), up with probability r / 2**h
    for s in sums.tolist():
        low = 1 << (abs(s).bit_length() - 1) if s else 0
        var.append(float((abs(s) - low) * (2 * low - abs(s))))
    assert_unbiased(mean, sums.astype(np.float64), np.array(var), repeats)


# --- the spec oracle and C/numpy parity --------------------------------------------------------


def f32_bits(bits: int) -> np.ndarray:
    return np.array([bits], np.uint32).view(np.float32)


R = 0x2A5F3C  # the r23 of the words below


@pytest.mark.parametrize(
    ("word", "x", "window", "code"),
    [
        (5, 2.0**-91, W4, 0x01),  # gap 41: kept iff the top 41 bits are zero
        (5, -(2.0**-91), W4, 0x81),
        (5, 2.0**-92, W4, 0x00),  # gap 42: always zero
        (1 << 23, 2.0**-91, W4, 0x00),  # the lowest of the 41 bits is set
        (1 << 23, 2.0**-90, W4, 0x01),  # ... and not among the top 40
        ((1 << 63) - 1, 2.0**-51, W4, 0x01),  # gap 1: top bit clear
        ((1 << 63) - 1, 2.0**-52, W4, 0x00),  # gap 2: top two bits 01
        (1 << 63 | R, 2.0**-51, W4, 0x00),
        (7 << 40 | R, f32_bits(127 << 23 | R), W4, 51),  # mantissa == r23: not up
        (7 << 40 | R, f32_bits(127 << 23 | (R + 1)), W4, 52),  # mantissa == r23 + 1: up
        (7 << 40 | R, f32_bits(1 << 31 | R), Window.for_job(1, e_max=-64), 0x00),  # subnormal
        (7 << 40 | R, f32_bits(1 << 31 | (R + 1)), Window.for_job(1, e_max=-64), 0x81),
    ],
)
def test_encode_random_word_boundaries(
    codec: nc8.Codec, word: int, x: float | np.ndarray, window: Window, code: int
) -> None:
    """Keys chosen (by inverting splitmix64) so that element 0 sits on each comparison's edge."""
    assert splitmix64(unsplitmix64(word)) == word
    got = codec.encode(np.asarray(x, np.float32).reshape(1), window, rng_giving_word(word))
    assert got.codes.tolist() == [code]


@pytest.mark.parametrize(
    ("s", "code"), [(2**10 + 300, 11), (2**10 + 301, 12), (-(2**10 + 301), 0x8C)]
)
def test_int_to_codes_random_word_boundary(codec: nc8.Codec, s: int, code: int) -> None:
    """The top 10 bits of element 0's rounding word (the key: lane_term(0) is 0) are 300:
    |S| = 2**10 + r rounds up iff 300 < r."""
    rng = KeyedRng(300 << 22 | 12345)
    assert codec.int_to_codes(np.array([s], np.int64), rng).tolist() == [code]


@pytest.mark.parametrize("w", WINDOWS, ids=str)
def test_encode_matches_spec_oracle(codec: nc8.Codec, w: Window) -> None:
    rng = np.random.default_rng(w.e_min + 126)
    below = np.exp2(rng.uniform(w.e_min - 8, w.e_min, 100)) * rng.choice([-1, 1], 100)
    x = np.concatenate([edge_values(w)[::7], random_floats(rng, 150), below]).astype(np.float32)
    for seed in range(2):
        enc = codec.encode(x, w, np.random.default_rng(seed))
        want = oracle_encode(x, key_of(seed), w)
        assert enc.codes.tolist() == want
        top = [(b & 0x7F) == w.max_code for b in want]
        assert enc.saturated <= sum(top)


def test_int_to_codes_matches_spec_oracle(codec: nc8.Codec) -> None:
    rng = np.random.default_rng(4)
    sums = np.concatenate([
        np.array([0, 1, -1, 2, 3, -(2**63), 2**63 - 1, 2**62, 2**62 - 1]),
        rng.integers(-(2**63), 2**63 - 1, 200, endpoint=True),
        rng.integers(-100, 100, 100),
    ]).astype(np.int64)  # fmt: skip
    for seed in range(2):
        got = codec.int_to_codes(sums, np.random.default_rng(seed)).tolist()
        assert got == oracle_int_to_codes(sums, int_key_of(seed))
        assert max(c & 0x7F for c in got) <= 64


@pytest.mark.parametrize("w", WINDOWS, ids=str)
def test_c_and_numpy_give_identical_bytes(w: Window) -> None:
    ref, fast = both_codecs()
    rng = np.random.default_rng([w.span, w.e_min + 126])
    x = np.concatenate([edge_values(w), random_floats(rng, 150_000)])
    rng.shuffle(x)
    for seed in range(3):
        a = ref.encode(x, w, np.random.default_rng(seed))
        b = fast.encode(x, w, np.random.default_rng(seed))
        assert a.saturated == b.saturated
        assert np.array_equal(a.codes, b.codes), np.flatnonzero(a.codes != b.codes)[:5]
    codes = rng.integers(0, 256, 70_000, dtype=np.uint8)
    codes = codes[(codes & 0x7F) <= 64]
    assert np.array_equal(
        ref.decode(codes, w).view(np.uint32), fast.decode(codes, w).view(np.uint32)
    )


def test_c_and_numpy_integer_paths_identical() -> None:
    ref, fast = both_codecs()
    rng = np.random.default_rng(12)
    sums = rng.integers(-(2**63), 2**63 - 1, 100_000, endpoint=True)
    sums[:1000] >>= rng.integers(0, 63, 1000)  # every magnitude
    sums[:4] = [0, -(2**63), 2**63 - 1, 1]
    for seed in range(3):
        a = ref.int_to_codes(sums, np.random.default_rng(seed))
        assert np.array_equal(a, fast.int_to_codes(sums, np.random.default_rng(seed)))
    codes = rng.integers(0, 256, 100_000, dtype=np.uint8) & 0xBF  # exponent codes <= 63
    assert np.array_equal(ref.codes_to_int(codes), fast.codes_to_int(codes))
    acc_a = rng.integers(-(2**62), 2**62, codes.size)
    acc_b = acc_a.copy()
    ref.accumulate(acc_a, codes)
    fast.accumulate(acc_b, codes)
    assert np.array_equal(acc_a, acc_b)


def test_module_functions_use_the_active_implementation() -> None:
    active = nc8.codec(nc8.IMPLEMENTATION)
    x = np.linspace(-3, 3, 1001, dtype=np.float32)
    assert np.array_equal(
        nc8.encode(x, W4, np.random.default_rng(0)).codes,
        active.encode(x, W4, np.random.default_rng(0)).codes,
    )


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_ncina_no_c_forces_numpy() -> None:
    proc = run_python(
        """
        import numpy as np, pytest
        from ncina.proto import nc8
        assert nc8.IMPLEMENTATION == "numpy", nc8.IMPLEMENTATION
        w = nc8.Window.for_job(4)
        x = np.array([1.0, -0.25, 0.0], np.float32)
        codes = nc8.encode(x, w, np.random.default_rng(0)).codes
        assert nc8.decode(codes, w).tolist() == [1.0, -0.25, 0.0]
        with pytest.raises(RuntimeError, match="NCINA_NO_C"):
            nc8.codec("c")
        """,
        NCINA_NO_C="1",
    )
    assert proc.returncode == 0, proc.stderr


def test_failed_c_build_falls_back_with_one_warning(tmp_path: Path) -> None:
    proc = run_python(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from ncina.proto import nc8
        assert nc8.IMPLEMENTATION == "numpy"
        print(len(caught), caught[0].message)
        """,
        PATH="",  # no compiler to be found
        NCINA_CACHE=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("1 ") and "no C compiler" in proc.stdout, proc.stdout


# --- ncina.common.cbuild -------------------------------------------------------------------------

ADD_C = "#include <stdint.h>\nint64_t add(int64_t a, int64_t b) { return a + b; }\n"


def test_build_extension_builds_once_and_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCINA_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "add.c"
    src.write_text(ADD_C)
    mod = build_extension("t_add", "int64_t add(int64_t a, int64_t b);", [src])
    assert mod.lib.add(2**40, -3) == 2**40 - 3
    assert build_extension("t_add", "int64_t add(int64_t a, int64_t b);", [src]) is mod
    assert [p.name[:6] for p in (tmp_path / "cache").iterdir()] == ["t_add-"]


def test_build_extension_concurrent_processes_share_one_build(tmp_path: Path) -> None:
    src = tmp_path / "add.c"
    src.write_text(ADD_C.replace("a + b", "a + b + 1"))
    code = f"""
        from pathlib import Path
        from ncina.common.cbuild import build_extension
        mod = build_extension("t_race", "int64_t add(int64_t a, int64_t b);", [Path({str(src)!r})])
        print(mod.lib.add(1, 2))
        """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            env={**os.environ, "NCINA_CACHE": str(tmp_path / "cache")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["4", "4", "4"]
    (build_dir,) = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in build_dir.iterdir() if p.name != ".lock")[0].endswith(".so")
    assert len([p for p in build_dir.iterdir() if p.name != ".lock"]) == 1  # no temp dirs left


def test_build_extension_reports_compile_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCINA_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "broken.c"
    src.write_text("int broken(void) { return }\n")
    with pytest.raises(RuntimeError, match="building C extension"):
        build_extension("t_broken", "int broken(void);", [src])


def test_codec_benchmark_smoke(tmp_path: Path) -> None:
    """``ncina bench codec`` appends its figures to the results file, both implementations'
    and whether their codes were identical (they must be)."""
    c_codec()  # the benchmark measures C beside numpy: a C codec that does not build fails
    output = tmp_path / "codec.jsonl"
    argv = ["bench", "codec", "--elements", "3000", "--repeat", "2", "--output", str(output)]
    assert main(argv) == 0
    [line] = output.read_text().splitlines()
    figures = json.loads(line)
    assert figures["benchmark"] == "codec" and figures["memcpy_gbps"] > 0
    for name in ("c", "numpy"):
        assert figures[name]["encode_gbps"] > 0 and figures[name]["decode_vs_memcpy"] > 0
    assert figures["identical_codes"] is True


# --- the aggregator's result bits: keyed by the chunk (docs/protocol.md, "Re-compression") -------


def test_splitmix64_is_the_published_generator() -> None:
    """The stream of key k is SplitMix64 seeded with k: the first outputs for seed 1234567 are
    the published ones (Rosetta Code, "Pseudo-random numbers/Splitmix64")."""
    assert [stream_word(1234567, i) for i in range(5)] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
        16408922859458223821,
    ]  # fmt: skip


# (seed, job, slot, version, offset, use) -> key and lane 1's word: zlib's CRC-32 of the bytes
# of docs/protocol.md (seed 8, job 2, slot 2, offset 4, use 4, version 1, lane 4; big-endian).
PINNED_KEYS = [
    ((0, 0, 0, 0, 0, 0), 0xE9CF0E8F, 0x9EC83E19),
    ((42, 9, 3, 1, 4096, 0), 0x9480B54E, 0xE38785D8),
    ((42, 9, 3, 1, 4096, 5), 0xC44D24FD, 0xB34A146B),
    ((0xC0FFEE, 12, 5, 1, 176, 0), 0xD61C2269, 0xA11B12FF),
    ((2**64 - 1, 65535, 65535, 1, 2**32 - 1, 2**32 - 1), 0xA309B055, 0xD40E80C3),
]


def result_bytes(seed: int, job: int, slot: int, version: int, offset: int, use: int,
                 lane: int) -> bytes:  # fmt: skip
    """The bytes whose CRC-32 is a result's rounding word, as docs/protocol.md lists them."""
    return (seed.to_bytes(8, "big") + job.to_bytes(2, "big") + slot.to_bytes(2, "big")
            + offset.to_bytes(4, "big") + use.to_bytes(4, "big") + bytes([version])
            + lane.to_bytes(4, "big"))  # fmt: skip


@pytest.mark.parametrize(("chunk", "key", "word1"), PINNED_KEYS)
def test_result_key_pinned(codec: nc8.Codec, chunk: tuple[int, ...], key: int,
                           word1: int) -> None:  # fmt: skip
    assert codec.result_key(*chunk) == key == zlib.crc32(result_bytes(*chunk, 0))
    assert rounding_word(key, 1) == word1 == zlib.crc32(result_bytes(*chunk, 1))


def test_rounding_words_are_the_crc32_of_each_lane(codec: nc8.Codec) -> None:
    """``key ^ lane_term(i)`` is the CRC-32 of the chunk's bytes with lane i, for lanes a chunk
    has (up to 1,456) and beyond (2**16 and 2**32 - 1): CRC-32 of equal-length inputs is affine
    over GF(2), which lets every backend hash once per result and xor a constant per lane."""
    chunk = (0xC0FFEE, 12, 5, 1, 176, 3)
    key = codec.result_key(*chunk)
    lanes = [*range(1500), 2**16 - 1, 2**16, 2**31, 2**32 - 1]
    want = [zlib.crc32(result_bytes(*chunk, i)) for i in lanes]
    terms = np.concatenate([nc8.lane_terms(0, 1500), *(nc8.lane_terms(i, 1) for i in lanes[1500:])])
    assert (terms ^ np.uint32(key)).tolist() == want
    assert [rounding_word(key, i) for i in lanes] == want


def test_recompress_pinned(codec: nc8.Codec) -> None:
    """Element i of the chunk (seed 42, job 9, slot 3, version 1, offset 4096, use 0): the top h
    bits of its word << 32 against |S| - 2**h, from zlib's CRC-32 of its bytes."""
    key = codec.result_key(42, 9, 3, 1, 4096, 0)
    sums = np.array([5, -7, 1000003, 3 << 40 | 12345], np.int64)
    # top h bits 2 vs excess 1 (down), 3 vs 3 (down), 250998 < 475715 (up),
    # 116296116224 < 2**40 + 12345 (up)
    assert codec.recompress(sums, key).tolist() == [0x03, 0x83, 0x15, 0x2B]
    assert oracle_int_to_codes(sums, key) == [0x03, 0x83, 0x15, 0x2B]


def test_result_key_rejects_fields_out_of_range(codec: nc8.Codec) -> None:
    for bad in ((-1, 0, 0, 0, 0, 0), (0, 65536, 0, 0, 0, 0), (0, 0, 0, 2, 0, 0),
                (0, 0, 0, 0, 2**32, 0), (0, 0, 0, 0, 0, -1)):  # fmt: skip
        with pytest.raises(ValueError, match="result key"):
            codec.result_key(*bad)
    with pytest.raises(ValueError, match="32-bit"):
        codec.recompress(np.array([3]), 2**32)


def chunk_keys(n: int, seed: int = 9) -> list[int]:
    """Result keys of ``n`` distinct chunks of one job: every (slot, version, offset, use) a
    training job would meet, slot by slot."""
    return [nc8.result_key(seed, 4, i % 64, (i // 64) % 2, 256 * (i % 1000), i // 2000)
            for i in range(n)]  # fmt: skip


def test_result_rounding_is_unbiased_over_chunks() -> None:
    """A fixed vector of sums in many chunks (each chunk its key): every element's mean is its
    sum within 5.5 standard errors of the exact variance (|S| - 2^h)(2^(h+1) - |S|)."""
    rng = np.random.default_rng(31)
    sums = np.concatenate([
        np.array([0, 1, 5, -7, 3, 6, 1000003, -(2**61 + 2**59), 2**62 + 1]),
        rng.integers(-1000, 1000, 40),
        rng.choice([-1, 1], 15) * rng.integers(0, 2**62, 15),
    ]).astype(np.int64)  # fmt: skip
    keys = chunk_keys(6000)
    values = np.array([nc8.codes_to_int(nc8.recompress(sums, k)) for k in keys], np.float64)
    low = np.array([1 << (abs(s).bit_length() - 1) if s else 0 for s in sums.tolist()], np.float64)
    mag = np.abs(sums.astype(np.float64))
    assert_unbiased(values.mean(axis=0), sums.astype(np.float64), (mag - low) * (2 * low - mag),
                    len(keys))  # fmt: skip


def test_result_rounding_second_moment_is_at_most_nine_eighths() -> None:
    """E[C(S)^2] / S^2 = (1 + 3t) / (1 + t)^2 for |S| = 2^h (1 + t), at most 9/8 (t = 1/3), over
    the keys of many chunks."""
    h = 40
    t = np.arange(0, 48) / 48
    sums = ((1 + t) * 2.0**h).astype(np.int64)
    t = sums / 2.0**h - 1
    keys = chunk_keys(6000, seed=10)
    ratio = np.array([nc8.codes_to_int(nc8.recompress(sums, k)) for k in keys],
                     np.float64) ** 2 / sums.astype(np.float64) ** 2  # fmt: skip
    mean, se = ratio.mean(axis=0), ratio.std(axis=0) / math.sqrt(len(keys))
    theory = (1 + 3 * t) / (1 + t) ** 2
    assert np.all(theory <= 9 / 8 + 1e-12) and theory.max() > 9 / 8 - 1e-3
    assert np.all(np.abs(mean - theory) <= 5 * se + 1e-12)


def test_c_and_numpy_result_bits_identical() -> None:
    """Keys of 20,000 random chunks and the re-compression of 1.3M random sums with them."""
    ref, fast = both_codecs()
    rng = np.random.default_rng(13)
    for _ in range(20_000):
        chunk = (int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(0, 2**16)),
                 int(rng.integers(0, 2**16)), int(rng.integers(0, 2)),
                 int(rng.integers(0, 2**32)), int(rng.integers(0, 2**32)))  # fmt: skip
        assert ref.result_key(*chunk) == fast.result_key(*chunk), chunk
    sums = rng.integers(-(2**63), 2**63 - 1, (1300, 1000), endpoint=True)
    sums[:, :100] >>= rng.integers(0, 63, (1300, 100))  # every magnitude
    for row, key in zip(sums, chunk_keys(len(sums)), strict=True):
        assert np.array_equal(ref.recompress(row, key), fast.recompress(row, key))


def element_keys(uses: int, pool: int, slot: int = 3, version: int = 1,
                 offset: int | None = None) -> list[int]:  # fmt: skip
    """Result keys of one slot version over its first ``uses`` uses, each use's INA offset
    ``u * pool + slot`` (or a fixed ``offset``): the same elements, round after round."""
    return [nc8.result_key(0xC0FFEE, 12, slot, version,
                           u * pool + slot if offset is None else offset, u)
            for u in range(uses)]  # fmt: skip


@pytest.mark.parametrize("offset", [None, 176], ids=["ina-offsets", "fixed-offset"])
def test_result_rounding_of_one_element_is_unbiased_over_its_uses(offset: int | None) -> None:
    """The same elements of one slot version, use after use (a training job's chunk every
    step): each element's mean over the uses is its sum within 5.5 standard errors, also when
    the offset stays the same, so the word changes with the use alone. A word of (job, offset,
    lane) only would repeat every step: one fixed rounding per element, the mean a code."""
    rng = np.random.default_rng(35)
    sums = np.concatenate([
        np.array([0, 1, 5, -7, 3, 6, 1000003, -(2**31 + 2**29), 2**40 + 2**38]),
        rng.integers(-1000, 1000, 40),
        rng.choice([-1, 1], 15) * rng.integers(0, 2**62, 15),
    ]).astype(np.int64)  # fmt: skip
    keys = element_keys(4000, 48, offset=offset)
    values = np.array([nc8.codes_to_int(nc8.recompress(sums, k)) for k in keys], np.float64)
    low = np.array([1 << (abs(s).bit_length() - 1) if s else 0 for s in sums.tolist()], np.float64)
    mag = np.abs(sums.astype(np.float64))
    assert_unbiased(values.mean(axis=0), sums.astype(np.float64), (mag - low) * (2 * low - mag),
                    len(keys))  # fmt: skip


def test_rounding_words_of_one_element_are_uniform() -> None:
    """The top 8 bits of one element's word over 2**16 uses (offsets of a pool of 48) pass a
    chi-square test (255 degrees of freedom, 5 standard deviations). A pool of 64 makes the
    offsets linear in the use's bits too: the words then cover the top bits exactly evenly."""
    term = int(nc8.lane_terms(5, 1)[0])
    for pool, exact in ((48, False), (64, True)):
        words = np.array(element_keys(2**16, pool), np.uint32) ^ np.uint32(term)
        counts = np.bincount(words >> np.uint32(24), minlength=256)
        chi2 = float(((counts - 256.0) ** 2 / 256.0).sum())
        assert chi2 < 255 + 5 * math.sqrt(2 * 255), (pool, chi2)
        assert (chi2 == 0) == exact, (pool, chi2)
