"""Gradient compressors behind one contract (:mod:`.base`), one module per method.

``create("qsgd:s=16,bucket=256")`` builds a compressor from a spec ``[ef+]name[:key=value,...]``;
values are read as int, else float, else text. ``ef+`` wraps the method in
:class:`ErrorFeedback`; methods defined with error feedback (1-bit, sign, 3LC) get it without
asking. Each tensor needs its own :class:`State` (random generator, error-feedback memory).
The methods, their payload layouts and measured figures are in ``docs/compressors.md``.
"""

from __future__ import annotations

import dataclasses

from ncina.proto.compressors.base import Compressor, State
from ncina.proto.compressors.ef import ErrorFeedback
from ncina.proto.compressors.fft import FFTSparsify
from ncina.proto.compressors.natdither import NaturalDithering
from ncina.proto.compressors.nc import NaturalCompression
from ncina.proto.compressors.onebit import OneBitSGD, SignSGD
from ncina.proto.compressors.qsgd import QSGD
from ncina.proto.compressors.randk import RandomK
from ncina.proto.compressors.terngrad import TernGrad
from ncina.proto.compressors.threelc import ThreeLC
from ncina.proto.compressors.topk import TopK

REGISTRY: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        NaturalCompression,
        NaturalDithering,
        QSGD,
        TernGrad,
        TopK,
        RandomK,
        SignSGD,
        OneBitSGD,
        FFTSparsify,
        ThreeLC,
    )
}
"""Method name -> compressor class."""

EF_PREFIX = "ef+"

__all__ = ["EF_PREFIX", "REGISTRY", "Compressor", "ErrorFeedback", "State", "create"]


def _value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def create(spec: str, *, workers: int | None = None, e_max: int | None = None) -> Compressor:
    """The compressor of ``spec`` = ``[ef+]name[:key=value,...]``, e.g. ``ef+topk:ratio=0.01``.

    ``workers`` and ``e_max`` are the job's: a method with an NC8 window of its own (``nc``,
    ``natdither``: fields ``workers`` and ``e_max``) gets the job's window, so that its codes are
    the job's and the same spec builds the same compressor on every side of the job; a spec that
    sets one of them to another value than the job's is refused. Raises ``ValueError`` for an
    unknown name, a malformed or unknown parameter, a bad value, or a window not the job's.
    """
    ef = spec.startswith(EF_PREFIX)
    name, _, params = spec.removeprefix(EF_PREFIX).partition(":")
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(REGISTRY)}")
    kwargs: dict[str, int | float | str] = {}
    for item in filter(None, params.split(",")):
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"compressor parameter {item!r} is not key=value")
        kwargs[key.strip()] = _value(text.strip())
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for key, job_value in (("workers", workers), ("e_max", e_max)):
        if job_value is None or key not in fields:
            continue
        if kwargs.setdefault(key, job_value) != job_value:
            raise ValueError(
                f"compressor {name}: {key}={kwargs[key]} in the spec, but the job's {key} is "
                f"{job_value} (leave it out: the job's window is the compressor's)"
            )
    try:
        compressor = cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"bad parameters for {name}: {exc}") from None
    return ErrorFeedback(compressor) if ef or cls.error_feedback else compressor
