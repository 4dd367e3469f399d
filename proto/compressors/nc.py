"""Natural compression (NC, Horvath et al. 2019, Def. 1): every element rounded without bias to
one of its two neighbouring powers of two, sent as the foundation's NC8 code.

This is the codec of ``ncina.proto.nc8`` behind the compressor contract: payloads are NC8 codes of
the job's window, so a switch adds them as integers (``ina``). Second moment at most 9/8 of the
input's (the paper's Theorem 1), inside the window.

Payload (network byte order)::

    HEAD (tag 1, n) | workers: uint16 | e_max: int8 | n NC8 codes (uint8)

``workers`` and ``e_max`` give the window (:meth:`Window.for_job`), so a payload decodes alone.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from ncina.proto import nc8
from ncina.proto.compressors.base import Compressor, State, as_vector, expect_end, take


@dataclass(frozen=True)
class NaturalCompression(Compressor):
    """NC8 codes of a job of ``workers`` workers whose largest exponent is ``e_max``."""

    workers: int = 4
    e_max: int = 10

    name: ClassVar[str] = "nc"
    tag: ClassVar[int] = 1
    ina: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True
    layout: ClassVar[struct.Struct] = struct.Struct("!Hb")

    def __post_init__(self) -> None:
        self.window()  # ValueError for a window no job can have

    def window(self) -> nc8.Window:
        """The NC8 window of the job."""
        return nc8.Window.for_job(self.workers, self.e_max)

    def nominal_bits(self, n: int) -> float:
        return 8.0

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        enc = nc8.encode(v, self.window(), state.rng)
        state.saturated += enc.saturated
        return self.header(v.size, self.workers, self.e_max) + enc.codes.tobytes()

    def decompress(self, payload: bytes) -> np.ndarray:
        n, (workers, e_max), body = self.parse(payload)
        codes, rest = take(body, n, "NC8 codes")
        expect_end(rest, self.name)
        return nc8.decode(np.frombuffer(codes, dtype=np.uint8), nc8.Window.for_job(workers, e_max))
