"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019; 3LC's error accumulation): send
``C(x + e)`` and keep ``e <- x + e - decompress(C(x + e))`` for the next call.

Wraps any compressor, typically a biased one (top-k, sign, 3LC, FFT), so that what one payload
drops is sent later. The memory ``e`` is ``State.residual`` of the tensor's :class:`State`,
float32, the tensor's flat length, and starts at zero. The residual is computed from the decoded
payload, so it is exactly what the receiver did not get. The payload format is the inner
compressor's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ncina.proto.compressors.base import Compressor, State, as_vector


@dataclass(frozen=True)
class ErrorFeedback(Compressor):
    """``inner`` with error feedback; ``name`` is ``"ef+" + inner.name``."""

    inner: Compressor

    unbiased = False

    def __post_init__(self) -> None:
        if isinstance(self.inner, ErrorFeedback):
            raise ValueError("error feedback is already applied")

    @property
    def name(self) -> str:  # type: ignore[override]
        return "ef+" + self.inner.name

    @property
    def tag(self) -> int:  # type: ignore[override]
        return self.inner.tag

    @property
    def ina(self) -> bool:  # type: ignore[override]
        return self.inner.ina

    def nominal_bits(self, n: int) -> float:
        return self.inner.nominal_bits(n)

    def max_payload_size(self, n: int) -> int:
        return self.inner.max_payload_size(n)

    def compress(self, x: np.ndarray, state: State) -> bytes:
        v = as_vector(x)
        if state.residual is not None:
            if state.residual.shape != v.shape:
                raise ValueError(
                    f"error feedback memory has {state.residual.size} elements, tensor {v.size}"
                )
            v = v + state.residual
        payload = self.inner.compress(v, state)
        state.residual = v - self.inner.decompress(payload)
        return payload

    def decompress(self, payload: bytes) -> np.ndarray:
        return self.inner.decompress(payload)
