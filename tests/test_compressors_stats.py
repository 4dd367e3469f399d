"""Statistical properties of the compressors, measured with fixed seeds.

Unbiasedness is tested on tiled vectors: one call compresses many copies of a short pattern, and
the mean over the copies of each pattern element must be within 6 standard errors of it. Rare
events (an element kept once in a million) leave too few samples to estimate a variance, so for
an element with fewer than 10 non-zero samples the test uses the bound A |x| on the variance of
any unbiased estimate of x of fixed sign bounded by A (E Z^2 <= A E|Z|), A the largest output
magnitude. The
variance figures are the papers' bounds (NC: second moment <= 9/8; QSGD: variance <=
min(d / s**2, sqrt(d) / s); random-k: n / k - 1; TernGrad: its closed form) and the direction of
Theorem 5 of the Natural Compression paper (natural dithering beats standard dithering with the
same number of levels).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from ncina.proto.compressors import State, create

# Norm-independent methods: any pattern works.
PATTERN = np.array([0.3, -1.7, 5e-3, 2.5, -0.05, 1.0, 0.7, -3.1e-4], dtype=np.float32)
# With the inf norm a largest element of 4 makes the norm exact under NC.
INF_PATTERN = np.array([0.3, -1.7, 5e-3, 2.5, -0.05, 1.0, 0.7, -4.0], dtype=np.float32)
# For natural dithering with p = 2 the norm is itself naturally compressed (one random draw per
# call), so the pattern has an exact power-of-two norm: 4096 copies of (5, -5, 3, -1, 2) / 8 have
# ||x||_2 = sqrt(4096 * 64 / 64) = 64. Its ratios y are not powers of two, and 1/8 / 64 lies
# below the lowest of 8 levels, so both rounding regimes are exercised.
DYADIC = np.array([5, -5, 3, -1, 2], dtype=np.float32) / 8


def relative_error(spec: str, x: np.ndarray, seed: int = 0) -> float:
    """||C(x) - x||^2 / ||x||^2 of one call."""
    comp = create(spec)
    out = comp.decompress(comp.compress(x, State(np.random.default_rng(seed)))).astype(np.float64)
    return float(np.sum((out - x) ** 2) / np.sum(x.astype(np.float64) ** 2))


def assert_unbiased(spec: str, pattern: np.ndarray, copies: int, calls: int = 1) -> None:
    comp = create(spec)
    state = State(np.random.default_rng(7))
    x = np.tile(pattern, copies)
    samples = np.concatenate(
        [comp.decompress(comp.compress(x, state)).reshape(copies, -1) for _ in range(calls)]
    ).astype(np.float64)
    mean = samples.mean(axis=0)
    rare = np.count_nonzero(samples, axis=0) < 10
    var = np.where(rare, np.abs(samples).max() * np.abs(pattern), samples.var(axis=0))
    stderr = np.sqrt(var / samples.shape[0])
    assert np.all(np.abs(mean - pattern) <= 6 * stderr + 1e-7 * np.abs(pattern)), (
        f"{spec}: mean {mean} vs {pattern}, stderr {stderr}"
    )


@pytest.mark.parametrize(
    ("spec", "pattern", "copies", "calls"),
    [
        ("nc", PATTERN, 50_000, 1),
        ("natdither:s=8", DYADIC, 4096, 20),
        ("natdither:s=3,packed=1", DYADIC, 4096, 20),
        ("natdither:p=inf,s=4", INF_PATTERN, 20_000, 1),
        ("natdither:s=5,packed=1,nc_norm=0", PATTERN, 20_000, 1),
        ("qsgd:s=4,bucket=64", PATTERN, 20_000, 1),
        ("qsgd:s=2,bucket=16,encoding=sparse", PATTERN, 20_000, 5),
        ("terngrad", PATTERN, 50_000, 1),
        ("randk:ratio=0.25", PATTERN, 20_000, 5),
    ],
)
def test_unbiased(spec: str, pattern: np.ndarray, copies: int, calls: int) -> None:
    assert_unbiased(spec, pattern, copies, calls)


def test_topk_is_biased() -> None:
    """The control: the same test catches a biased method."""
    with pytest.raises(AssertionError):
        assert_unbiased("topk:ratio=0.25", PATTERN, 20_000)


def test_nc_second_moment_is_at_most_nine_eighths() -> None:
    """Theorem 1: E C(x)^2 <= 9/8 x^2, tight at x = 4/3 * 2**k (rounds to 1 or 2 times 2**k)."""
    rng = np.random.default_rng(1)
    gaussian = rng.standard_normal(200_000).astype(np.float32)
    worst = np.full(200_000, 4 / 3, dtype=np.float32) * np.exp2(rng.integers(-20, 5, 200_000))
    comp = create("nc")
    for x, low, high in ((gaussian, 1.0, 1.125), (worst.astype(np.float32), 1.12, 1.13)):
        out = comp.decompress(comp.compress(x, State(np.random.default_rng(2))))
        moment = float(np.sum(out.astype(np.float64) ** 2) / np.sum(x.astype(np.float64) ** 2))
        assert low <= moment <= high


def qsgd_error_moments(x: np.ndarray, s: int, d: int) -> tuple[float, float]:
    """Mean and standard deviation of ||Q(x) - x||^2 / ||x||^2 over QSGD's dithering, exactly,
    for this ``x`` (seed 001): in a bucket of float32 norm N an element at y = s |x_i| / N,
    p = y - floor(y), goes up a level with probability p, so its error is (1 - p) N / s with
    probability p and p N / s otherwise: E e^2 = (N/s)^2 p (1 - p), E e^4 = (N/s)^4 (p (1 - p)^4
    + (1 - p) p^4), independent across elements."""
    v = x.astype(np.float64).reshape(-1, d)
    norms = np.linalg.norm(v, axis=1).astype(np.float32).astype(np.float64)[:, None]
    y = s * np.abs(v) / norms
    p = y - np.floor(y)
    step = (norms / s) ** 2
    second = step * p * (1 - p)
    fourth = step**2 * (p * (1 - p) ** 4 + (1 - p) * p**4)
    scale = float(np.sum(v**2))
    return float(second.sum()) / scale, math.sqrt(float(np.sum(fourth - second**2))) / scale


def test_qsgd_variance_bound() -> None:
    """E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2 per bucket (the worst case), and for
    this Gaussian input the error is its exact expectation over the dithering within 6 standard
    deviations: at s = 16 that is 0.167 against the bound's 1.0, so a QSGD with half the levels
    (0.664) fails here though it keeps to the bound."""
    x = np.random.default_rng(3).standard_normal(65_536).astype(np.float32)
    for s, d in ((1, 256), (4, 256), (16, 256), (2, 4096)):
        bound = min(d / s**2, math.sqrt(d) / s)
        measured = relative_error(f"qsgd:s={s},bucket={d}", x)
        assert measured <= bound
        mean, sd = qsgd_error_moments(x, s, d)
        assert mean <= bound
        assert abs(measured - mean) <= 6 * sd, (s, d, measured, mean, sd)


def test_randk_variance_is_n_over_k_minus_one() -> None:
    x = np.random.default_rng(4).standard_normal(4000).astype(np.float32)
    errors = [relative_error("randk:ratio=0.1", x, seed) for seed in range(40)]
    assert np.mean(errors) == pytest.approx(9.0, rel=0.05)


def test_terngrad_variance_matches_its_closed_form() -> None:
    """Each element is scale or 0: variance sum |x_i| (scale - |x_i|)."""
    x = np.random.default_rng(5).standard_normal(100_000).astype(np.float64)
    a = np.abs(x)
    expected = float(np.sum(a * (a.max() - a)) / np.sum(x**2))
    assert relative_error("terngrad", x.astype(np.float32)) == pytest.approx(expected, rel=0.02)


def test_natural_dithering_beats_standard_dithering_with_as_many_levels() -> None:
    """Theorem 5: with the same s, natural dithering's variance is at least ~2**(s-1)/s times
    smaller (the lowest level is 2**(1-s) instead of 1/s; same levels at s = 2)."""
    x = np.random.default_rng(6).standard_normal(16_384).astype(np.float32)
    for s in range(2, 9):
        natural = relative_error(f"natdither:s={s}", x)
        standard = relative_error(f"qsgd:s={s},bucket=0", x)
        assert standard / natural >= 0.9 * 2 ** (s - 1) / s


def test_standard_dithering_needs_exponentially_more_levels() -> None:
    """Theorem 5 and the paper's Fig. 10: u = 2**(s-1) standard levels match s natural ones."""
    x = np.random.default_rng(6).standard_normal(16_384).astype(np.float32)
    for s in range(3, 9):
        natural = relative_error(f"natdither:s={s}", x)
        standard = relative_error(f"qsgd:s={2 ** (s - 1)},bucket=0", x)
        assert 0.8 < natural / standard < 1.25


@pytest.mark.parametrize("packed", [False, True], ids=["ina", "packed"])
@pytest.mark.parametrize("norm", [1e-3, 0.7, 1265.0, 4.1e4, 1e6])
def test_natural_dithering_is_unbiased_at_every_norm(norm: float, packed: bool) -> None:
    """E<C(x), x> / ||x||^2 = 1 for norms from 1e-3 to 1e6. Regression: the norm was NC8-coded
    inside the job's window ([2^-50, 2^10]), so every tensor of norm above 1024 came back
    scaled down as a whole (0.81 for 4 N(0,1) of 1e5 elements, norm ~1265, with the default
    window). In the INA mode the window must still hold the largest *value*: e_max is sized for
    the largest element (the default 10 where that suffices, as at norm 1265), never for the
    norm, and no value saturates."""
    x = np.random.default_rng(3).standard_normal(1000)
    x = (x * (norm / np.linalg.norm(x))).astype(np.float32)
    e_max = max(10, math.ceil(math.log2(2 * float(np.abs(x).max()))))
    spec = f"natdither:packed={int(packed)},e_max={e_max}"
    comp, state, calls = create(spec), State(np.random.default_rng(11)), 2000
    x64 = x.astype(np.float64)
    ratios = np.array([np.dot(comp.decompress(comp.compress(x, state)).astype(np.float64), x64)
                       for _ in range(calls)]) / np.dot(x64, x64)  # fmt: skip
    # The NC'd norm alone has variance at most 1/8 of its square: bound the spread by it too,
    # since a rare round-up of the norm (1e-3: 2.4 % of calls) may not show in the samples.
    stderr = math.sqrt((ratios.var() + 1 / 8) / calls)
    assert abs(ratios.mean() - 1) <= 6 * stderr, (spec, norm, ratios.mean(), stderr)
    assert state.saturated == 0


@pytest.mark.parametrize("value", [3.0, 1e-3, 1265.0, 1e30, 2.0**-60, 64.0])
def test_natural_round_is_nc_without_a_window(value: float) -> None:
    from ncina.proto.compressors.natdither import natural_round

    rng = np.random.default_rng(5)
    draws = np.array([natural_round(value, rng) for _ in range(40_000)])
    low = 2.0 ** math.floor(math.log2(value))
    assert set(np.unique(draws)) <= {low, 2 * low}
    assert abs(draws.mean() - value) <= 6 * math.sqrt(value**2 / 8 / draws.size)
    assert natural_round(0.0, rng) == 0.0


@pytest.mark.parametrize("spec", ["qsgd", "natdither", "natdither:nc_norm=0,packed=1"])
def test_a_norm_that_overflows_float32_is_an_error_not_zeros(spec: str) -> None:
    """Finite inputs whose 2-norm exceeds float32 (1000 x 3e37: 9.5e38) gave all-zero payloads
    with only a RuntimeWarning; the norm is computed in float64 and refused."""
    x = np.full(1000, 3e37, dtype=np.float32)
    with pytest.raises(ValueError, match="exceeds float32"):
        create(spec).compress(x, State())
    y = np.full(1000, 3e36, dtype=np.float32)  # norm 9.5e37 fits: a real payload
    out = create(spec).decompress(create(spec).compress(y, State()))
    assert np.all(np.isfinite(out)) and np.any(out != 0)
