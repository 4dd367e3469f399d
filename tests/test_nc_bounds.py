"""The NC error bounds (ncina.proto.nc_bounds): hand-computed values, Theorem 1's omega = 1/8,
and the real NC8 encoder's statistics against the exact variance (fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest
from ncina.proto import nc8
from ncina.proto.nc_bounds import OMEGA, bounds_from_inputs, bounds_from_sums, rounding_variance

WORKERS = 2
WINDOW = nc8.Window.for_job(WORKERS, e_max=10)


def test_rounding_variance_by_hand() -> None:
    # (2^(e+1) - |x|)(|x| - 2^e): 1.5 -> 0.5 * 0.5; -3 -> 1 * 1; powers of two and 0 are exact.
    x = np.array([1.5, -3.0, 1.0, 0.0, 0.25, 4 / 3])
    expected = [0.25, 1.0, 0.0, 0.0, 0.0, 2 / 9]
    np.testing.assert_allclose(rounding_variance(x), expected, rtol=1e-15, atol=0)
    assert rounding_variance(np.array([4 / 3]))[0] == pytest.approx(OMEGA * (4 / 3) ** 2)


def test_rounding_variance_is_at_most_omega_x_squared() -> None:
    """Theorem 1: NC's variance is at most x^2 / 8, over magnitudes from 2^-20 to 2^20."""
    x = np.random.default_rng(3).standard_normal(100_000) * 2.0 ** np.arange(-20, 20).repeat(2500)
    assert np.all(rounding_variance(x) <= OMEGA * x * x * (1 + 1e-12))


def test_the_encoder_has_the_exact_variance() -> None:
    """NC8 codes of one value, decoded: unbiased, with the variance ``rounding_variance`` says.
    A rounding takes two values, so over n = 200,000 the sample mean's standard error is
    sqrt(var / n) and the sample variance's sqrt((mu4 - var^2) / n), at most 1.5 var / sqrt(n)
    for these values; 6 standard errors are far beyond chance with the fixed seed."""
    values = np.array([1.5, 1.25, -3.0, 0.3], dtype=np.float32)
    n = 200_000
    x = np.repeat(values[None, :], n, axis=0)
    decoded = nc8.decode(nc8.encode(x, WINDOW, np.random.default_rng(5)).codes, WINDOW)
    decoded = decoded.astype(np.float64)
    exact = rounding_variance(values)
    np.testing.assert_array_less(np.abs(decoded.mean(axis=0) - values), 6 * np.sqrt(exact / n))
    np.testing.assert_array_less(np.abs(decoded.var(axis=0) - exact), 6 * 1.5 * exact / np.sqrt(n))


def test_bounds_from_sums_by_hand() -> None:
    # Exact zeros (dead ReLU units) cost nothing but the window's floor.
    floor = 2.0**WINDOW.e_min
    zeros = np.zeros(4)
    for result in ("nc8", "int"):
        bounds = bounds_from_sums(zeros, zeros, zeros, WORKERS, WINDOW.e_min, result)
        assert np.all((bounds.max_error > 0) & (bounds.max_error <= 2 * floor))
        assert np.all((bounds.var_high > 0) & (bounds.var_high <= floor**2))
    # Two workers, 1.5 and 0: uplink error < 1.5, downlink < 2 * 1.5 (and the window floor).
    one = np.array([1.5])
    bounds = bounds_from_sums(one, one**2, one, WORKERS, WINDOW.e_min, "nc8")
    assert bounds.max_error == pytest.approx(4.5 / 2)
    assert bounds.var_high == pytest.approx((2.25 / 8 + (2.25 + 2.25 / 8) / 8) / 4)
    bounds = bounds_from_sums(one, one**2, one, WORKERS, WINDOW.e_min, "int")
    assert bounds.max_error == pytest.approx(1.5 / 2)
    assert bounds.var_high == pytest.approx(2.25 / 8 / 4)


def test_bounds_from_inputs_by_hand() -> None:
    # Workers 1.5 and -3: V_up = 0.25 + 1, S = -1.5, sum |x| = 4.5.
    inputs = np.array([[1.5], [-3.0]])
    nc8_bounds = bounds_from_inputs(inputs, "nc8")
    assert nc8_bounds.max_error[0] == 3 * 4.5 / 2
    assert nc8_bounds.var_low[0] == 1.25 / 4
    assert nc8_bounds.var_high[0] == (1.25 + (2.25 + 1.25) / 8) / 4
    int_bounds = bounds_from_inputs(inputs, "int")
    assert (int_bounds.max_error[0], int_bounds.var_low[0], int_bounds.var_high[0]) == (
        4.5 / 2, 1.25 / 4, 1.25 / 4)  # fmt: skip


def test_exact_variance_is_within_the_sums_bound() -> None:
    """The per-element model from the inputs is tighter than the one from the sums alone."""
    inputs = np.random.default_rng(7).standard_normal((4, 10_000))
    x = inputs.astype(np.float64)
    for result in ("nc8", "int"):
        exact = bounds_from_inputs(inputs, result)
        bound = bounds_from_sums(np.abs(x).sum(0), (x * x).sum(0), x.sum(0), 4, WINDOW.e_min,
                                 result)  # fmt: skip
        assert np.all(exact.var_high <= bound.var_high)
        assert np.all(exact.max_error <= bound.max_error)


def test_unknown_result_format() -> None:
    with pytest.raises(ValueError, match="blob"):
        bounds_from_inputs(np.ones((2, 1)), "blob")
