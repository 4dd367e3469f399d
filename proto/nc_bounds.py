"""Error bounds of the mean an NC8 all-reduce delivers: the one derivation the DDP hook's check
(``ncina.worker.torch_hook.verifying_hook``), ``ncina bench allreduce`` and the tests use.

Natural compression (Horvath et al., "Natural Compression for Distributed Deep Learning", 2019;
``seeds/000``) rounds ``x`` with ``|x|`` in ``[2^e, 2^(e+1))`` to ``2^e`` or ``2^(e+1)`` (same
sign) with the probabilities that keep it unbiased (Definition 1, eq. 3). Its error is below
``2^e <= |x|`` and its variance is exactly ``(2^(e+1) - |x|)(|x| - 2^e)``, at most ``x^2 / 8``:
Theorem 1 (Sec. 3.1) puts NC in ``U(9/8)``, a second moment ``E[C(x)^2] <= 9/8 x^2`` (Definition
2, eq. 5), so a variance ``omega x^2`` with ``omega = 1/8`` (``OMEGA``), reached at
``|x| = 4/3 2^e``. The NC8 window (``ncina.proto.nc8.Window``) adds a floor: a value below
``2^e_min`` goes to 0 or ``2^e_min``, error below ``2^e_min``, variance at most ``4^e_min / 4``.

The all-reduce composes two such roundings (the paper's bidirectional compression, Algorithm 1;
the composition bound of Theorem 3 is the same tower-property argument):

- uplink: the workers round independently, so the integer sum ``T`` has ``E[T] = S = sum x_i``,
  ``|T - S| <= sum |x_i| (+ N 2^e_min)`` and ``Var T = V_up``, the sum of their variances;
- ``nc8`` results: the aggregator rounds ``T`` again, error at most ``|T| <= 2 sum |x_i|
  (+ N 2^e_min)``, conditional variance at most ``T^2 / 8``; by the law of total variance the
  result's variance lies in ``[V_up, V_up + (S^2 + V_up) / 8]``. ``int`` results deliver ``T``;
- the mean divides errors by ``N`` and variances by ``N^2``.

Values above the window saturate (biased, counted): they are outside these bounds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

OMEGA = 1.0 / 8.0
"""NC's variance relative to ``x^2`` (Theorem 1: second moment at most ``9/8 x^2``)."""


class MeanErrorBounds(NamedTuple):
    """Per-element bounds of the error of an all-reduced mean against the exact one."""

    max_error: np.ndarray
    """A hard bound on ``|mean' - mean|``."""
    var_low: np.ndarray
    """The uplink's share of ``E[(mean' - mean)^2]``: a lower bound of it when the uplink
    variance is exact (:func:`bounds_from_inputs`)."""
    var_high: np.ndarray
    """An upper bound of ``E[(mean' - mean)^2]``."""


def rounding_variance(x: np.ndarray) -> np.ndarray:
    """The exact variance of NC rounding of each element of ``x`` (float64; zeros are exact):
    ``(2^(e+1) - |x|)(|x| - 2^e)`` for ``|x|`` in ``[2^e, 2^(e+1))``, at most ``OMEGA x^2``.
    Rounding below a window's ``2^e_min`` is not modelled."""
    magnitude = np.abs(np.asarray(x, dtype=np.float64))
    _, exponent = np.frexp(magnitude)  # |x| = m 2^exponent with m in [0.5, 1); 0 for zeros
    low = np.where(magnitude > 0, np.ldexp(0.5, exponent), 0.0)
    return (2 * low - magnitude) * (magnitude - low)


def _mean_bounds(
    abs_sum: np.ndarray, uplink_variance: np.ndarray, total: np.ndarray, workers: int,
    result_format: str, floor: float,
) -> MeanErrorBounds:  # fmt: skip
    """The module's composition, from the sums over workers of ``|x_i|``, the uplink variances
    and ``x_i``; ``floor`` is ``2^e_min`` (0: the window's floor is not modelled)."""
    worst = abs_sum + workers * floor
    high = uplink_variance
    if result_format == "nc8":
        worst = worst + 2.0 * abs_sum + workers * floor
        high = uplink_variance + OMEGA * (total * total + uplink_variance)
    elif result_format not in ("int", "int32"):  # exact sums: the uplink's error only
        raise ValueError(f"result format {result_format!r} is not nc8, int or int32")
    return MeanErrorBounds(worst / workers, uplink_variance / workers**2, high / workers**2)


def bounds_from_inputs(inputs: np.ndarray, result_format: str) -> MeanErrorBounds:
    """Bounds of the mean of ``inputs`` (workers x elements) with the uplink variance computed
    exactly per element (:func:`rounding_variance`); the window's floor is not modelled (for
    inputs far above ``2^e_min``, such as the benchmark's normal ones)."""
    x = np.asarray(inputs, dtype=np.float64)
    return _mean_bounds(np.abs(x).sum(axis=0), rounding_variance(x).sum(axis=0),
                        x.sum(axis=0), x.shape[0], result_format, 0.0)  # fmt: skip


def bounds_from_sums(
    abs_sum: np.ndarray, sq_sum: np.ndarray, total: np.ndarray, workers: int, e_min: int,
    result_format: str,
) -> MeanErrorBounds:  # fmt: skip
    """Bounds of the mean of ``workers`` vectors known only by their element-wise sums of
    ``|x_i|``, ``x_i^2`` and ``x_i`` (float64; what one all-reduce gives every rank, no worker
    needing the others' vectors), with the window's floor ``2^e_min``: the uplink variance is
    bounded by ``OMEGA sum x_i^2 + N 4^e_min / 4``."""
    floor = 2.0**e_min
    uplink = OMEGA * sq_sum + workers * floor * floor / 4
    return _mean_bounds(abs_sum, uplink, total, workers, result_format, floor)
