"""Ratios of measured figures, and why one is refused: the one definition the benchmarks'
figures (``ncina.harness.figures``) and a topology run's report (``ncina.topo.report``) share.

A ratio is to three significant digits. A ratio against a baseline is of completed work
(replies, completed slots, finished all-reduces, samples), and only of a baseline that did its
work: one that failed, completed nothing or retransmitted is no yardstick. :func:`put_ratio`
then writes ``None`` and, beside it, ``<ratio>_refused``: why (:func:`refusal`). The runs' own
ratios are quoted by their :func:`spread`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


def ratio(a: float, b: float) -> float | None:
    """``a / b`` to three significant digits (None when ``b`` is not positive: no ratio)."""
    return float(f"{a / b:.3g}") if b > 0 else None


def refusal(work: float, *, retransmissions: int = 0, error: str | None = None) -> str | None:
    """Why a baseline that completed ``work`` (replies, slots, all-reduces per second: any
    measure of finished work) after ``retransmissions`` rounds of copies, or failed with
    ``error``, cannot divide anything; None when it can."""
    if error:
        return f"the baseline failed: {error}"
    if not work > 0:
        return "the baseline completed nothing"
    if retransmissions:
        return f"the baseline retransmitted ({retransmissions})"
    return None


def put_ratio(
    figures: dict[str, Any], name: str, work: float, baseline: float, refused: str | None
) -> None:
    """``figures[name]`` = ``work / baseline`` (:func:`ratio`), or, when the baseline is
    ``refused`` (:func:`refusal`, or no positive ``baseline``), None and
    ``figures[name + "_refused"]`` the reason."""
    value = ratio(work, baseline) if refused is None else None
    if value is None:
        figures[f"{name}_refused"] = refused or "the baseline completed nothing"
    figures[name] = value


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """The minimum, lower median and maximum of the runs' values of one ratio (the runs whose
    ratio was refused, None, left out; None when every one was)."""
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return None
    return {"min": ordered[0], "median": statistics.median_low(ordered), "max": ordered[-1]}
