"""Compressor wire formats: hand-computed golden payloads, round trips, edge cases, the registry.

Statistical properties (unbiasedness, variance) are in test_compressors_stats.py.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ncina.proto.compressors import REGISTRY, ErrorFeedback, State, create
from ncina.proto.compressors.bits import (
    omega_bits,
    omega_decode,
    omega_encode,
    pack_bits,
    unpack_bits,
)
from ncina.proto.compressors.fft import offset_float_base, offset_float_decode, offset_float_encode
from ncina.proto.compressors.threelc import (
    quartic_decode,
    quartic_encode,
    zero_run_decode,
    zero_run_encode,
)

# One spec per method and payload mode (the registry's defaults plus the other modes).
SPECS = [
    "nc",
    "natdither",
    "natdither:p=inf,s=4",
    "natdither:packed=1,s=3",
    "natdither:packed=1,nc_norm=0,s=5",
    "qsgd",
    "qsgd:encoding=sparse,s=2,bucket=64",
    "qsgd:bucket=0,s=7",
    "terngrad",
    "topk:ratio=0.1",
    "randk:ratio=0.1",
    "signsgd",
    "onebit",
    "fft",
    "fft:bits=32,theta=0.5",
    "fft:bits=6,mantissa=2",
    "3lc",
    "3lc:s=1.5",
]


def bitstring(data: bytes, nbits: int | None = None) -> str:
    """The bits of ``data``, MSB first, optionally only the first ``nbits``."""
    return "".join(map(str, np.unpackbits(np.frombuffer(data, dtype=np.uint8))[:nbits]))


def head(tag: int, n: int, fmt: str, *fields: object) -> bytes:
    """The common header and a method's fields, as documented."""
    return struct.pack("!BI" + fmt.lstrip("!"), tag, n, *fields)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# --- bits: fixed-width packing and Elias omega --------------------------------------------------


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (1, "0"),
        (2, "100"),
        (3, "110"),
        (4, "101000"),
        (7, "101110"),
        (8, "1110000"),
        (15, "1111110"),
        (16, "10100100000"),
        (17, "10100100010"),
        (100, "1011011001000"),
        (2**32 - 1, "10" + "100" + "11111" + "1" * 32 + "0"),
    ],
)
def test_elias_omega_golden(value: int, code: str) -> None:
    data = omega_encode(np.array([value]))
    assert bitstring(data, len(code)) == code
    assert len(data) == (len(code) + 7) // 8 and bitstring(data)[len(code) :].strip("0") == ""
    assert omega_bits(np.array([value])) == len(code)
    decoded, used = omega_decode(data, 1)
    assert decoded.tolist() == [value] and used == len(code)


def test_elias_omega_concatenates_codes() -> None:
    # 0 | 100 | 110 | 10100100010, padded to 3 bytes
    data = omega_encode(np.array([1, 2, 3, 17]))
    assert bitstring(data) == "0100110" + "10100100010" + "000000"
    assert omega_decode(data, 4)[0].tolist() == [1, 2, 3, 17]


@pytest.mark.parametrize("bad", [0, -1, 2**32])
def test_elias_omega_rejects_values_outside_its_range(bad: int) -> None:
    with pytest.raises(ValueError, match="Elias omega"):
        omega_encode(np.array([3, bad]))


def test_elias_omega_decode_rejects_truncated_streams() -> None:
    with pytest.raises(ValueError, match="ends before code 0"):
        omega_decode(omega_encode(np.array([17]))[:1], 1)  # 10100100: the last group is cut
    with pytest.raises(ValueError, match="ends before code 8"):
        omega_decode(b"\x00", 9)  # eight times omega(1), then nothing
    with pytest.raises(ValueError, match="ends before code 0"):
        omega_decode(b"\xff", 1)  # 1111 1111: a group that runs past the end


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 2**32 - 1), max_size=200))
def test_elias_omega_round_trip(values: list[int]) -> None:
    data = omega_encode(np.array(values, dtype=np.uint64))
    decoded, used = omega_decode(data, len(values))
    assert decoded.tolist() == values
    assert used == omega_bits(np.array(values, dtype=np.uint64)) <= 8 * len(data)


def test_pack_bits_golden() -> None:
    assert pack_bits(np.array([1, 2, 3]), 2) == bytes([0b01101100])
    # 1 | 11 | (nothing) | 101
    assert pack_bits(np.array([1, 3, 0, 5]), np.array([1, 2, 0, 3])) == bytes([0b11110100])
    assert pack_bits(np.array([], dtype=np.int64), 4) == b""
    assert unpack_bits(bytes([0b01101100]), 2, 3).tolist() == [1, 2, 3]


def test_pack_bits_rejects_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        pack_bits(np.array([4]), 2)
    with pytest.raises(ValueError, match="negative"):
        pack_bits(np.array([-1]), 2)
    with pytest.raises(ValueError, match="fewer than"):
        unpack_bits(b"\x00", 3, 3)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 57), st.data())
def test_pack_bits_round_trip(width: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, 2**width - 1), max_size=100))
    packed = pack_bits(np.array(values, dtype=np.uint64), width)
    assert len(packed) == (width * len(values) + 7) // 8
    assert unpack_bits(packed, width, len(values)).tolist() == values


# --- 3LC: quartic and zero-run encoding ----------------------------------------------------------


def test_quartic_golden() -> None:
    # digits q + 1 = 2 1 0 1 1: 2*81 + 1*27 + 0*9 + 1*3 + 1 = 193
    assert quartic_encode(np.array([1, 0, -1, 0, 0], dtype=np.int8)).tolist() == [193]
    assert quartic_encode(np.zeros(5, dtype=np.int8)).tolist() == [121]
    assert quartic_encode(np.full(5, -1, dtype=np.int8)).tolist() == [0]
    assert quartic_encode(np.ones(5, dtype=np.int8)).tolist() == [242]
    # one trit, padded with four zeros (digit 1): 2 1 1 1 1 = 162 + 27 + 9 + 3 + 1 = 202
    assert quartic_encode(np.array([1], dtype=np.int8)).tolist() == [202]
    assert quartic_decode(np.array([193, 202], dtype=np.uint8), 6).tolist() == [1, 0, -1, 0, 0, 1]
    with pytest.raises(ValueError, match="above 242"):
        quartic_decode(np.array([243], dtype=np.uint8), 5)


@pytest.mark.parametrize(
    ("plain", "encoded"),
    [
        ([121], [121]),
        ([121, 121], [243]),
        ([121] * 14, [255]),
        ([121] * 15, [255, 121]),
        ([121] * 17, [255, 244]),
        ([121] * 28, [255, 255]),
        ([7, 121, 121, 121, 9, 121], [7, 244, 9, 121]),
        ([0, 242, 120, 122], [0, 242, 120, 122]),
        ([], []),
    ],
)
def test_zero_run_golden(plain: list[int], encoded: list[int]) -> None:
    data = np.array(plain, dtype=np.uint8)
    assert zero_run_encode(data).tolist() == encoded
    assert zero_run_decode(np.array(encoded, dtype=np.uint8)).tolist() == plain


def test_3lc_payload_golden() -> None:
    # M = max|x| * s = 1; trits 1 0 -1 0 0 | 0 0 0 0 0 | 0 0 0 0 0 -> 193, 121, 121 -> 193, 243
    x = np.zeros(15, dtype=np.float32)
    x[:3] = [1.0, 0.2, -0.6]
    payload = create("3lc").compress(x, State())
    assert payload == head(10, 15, "f", 1.0) + bytes([193, 243])
    assert create("3lc").decompress(payload).tolist() == [1, 0, -1] + [0] * 12


# --- golden payloads of the other methods --------------------------------------------------------


def test_nc_payload_golden() -> None:
    # 4 workers, e_max 10: e_min = -50, so 2**e is code e + 51; powers of two are exact.
    x = f32(1.0, -2.0, 0.0, 0.25)
    payload = create("nc").compress(x, State())
    assert payload == head(1, 4, "Hb", 4, 10) + bytes([51, 0x80 | 52, 0, 49])
    assert create("nc").decompress(payload).tolist() == x.tolist()


def test_natural_dithering_payload_golden() -> None:
    # inf norm 4 (exact under NC); y = 1, 1/2, 1/4, 0 are levels of s = 3: deterministic.
    x = f32(4.0, -2.0, 1.0, 0.0)
    ina = create("natdither:p=inf,s=3").compress(x, State())
    assert ina == head(2, 4, "BBHbf", 3, 0, 4, 10, 4.0) + bytes([53, 0x80 | 52, 51, 0])
    # packed: sign bit + 2-bit level index j (level 2**(1 - j)): 0 01 | 1 10 | 0 11 | 0 00
    packed = create("natdither:p=inf,s=3,packed=1").compress(x, State())
    assert packed == head(2, 4, "BBHbf", 3, 1, 4, 10, 4.0) + bytes([0b00111001, 0b10000000])
    for payload in (ina, packed):
        assert create("natdither").decompress(payload).tolist() == x.tolist()
    # the float32 norm itself: 3 (not a power of two); 3/3 = level 1, 1.5/3 = level 1/2
    exact = create("natdither:s=2,p=inf,packed=1,nc_norm=0").compress(f32(3.0, -1.5), State())
    assert exact == head(2, 2, "BBHbf", 2, 1, 4, 10, 3.0) + bytes([0b00111000])


def test_qsgd_payload_golden() -> None:
    # One bucket, s = 5, norm 5: s|x|/norm = 3, 0, 4, 0 are integers, so the levels are exact.
    x = f32(3.0, 0.0, -4.0, 0.0)
    common = head(3, 4, "HIBI", 5, 4, 0, 2) + struct.pack("!f", 5.0) + bytes([0b01000000])
    dense = create("qsgd:s=5,bucket=0").compress(x, State())
    # omega(l + 1): omega(4) omega(1) omega(5) omega(1) = 101000 0 101010 0
    assert dense == common + bytes([0b10100001, 0b01010000])
    sparse = create("qsgd:s=5,bucket=0,encoding=sparse").compress(x, State())
    # omega(nnz + 1 = 3) = 110, then (gap, level): (1, 3) = 0 110, (2, 4) = 100 101000
    assert sparse == head(3, 4, "HIBI", 5, 4, 1, 2) + common[-5:] + bytes([0b11001101, 0b00101000])
    for payload in (dense, sparse):
        assert create("qsgd").decompress(payload).tolist() == x.tolist()


def test_terngrad_payload_golden() -> None:
    # scale 2; |x|/scale is 1, 1, 0, 1: trits +, -, 0, + = 01 10 00 01
    x = f32(2.0, -2.0, 0.0, 2.0)
    payload = create("terngrad").compress(x, State())
    assert payload == head(4, 4, "f", 2.0) + bytes([0b01100001])
    assert create("terngrad").decompress(payload).tolist() == x.tolist()


def test_topk_payload_golden() -> None:
    # k = 2 of 4: indices 1, 3 in 2 bits each (01 11), values -3, 2
    x = f32(0.5, -3.0, 1.0, 2.0)
    payload = create("topk:ratio=0.5").compress(x, State())
    assert payload == head(5, 4, "I", 2) + struct.pack("!ff", -3.0, 2.0) + bytes([0b01110000])
    assert create("topk").decompress(payload).tolist() == [0, -3, 0, 2]


def test_sign_payloads_golden() -> None:
    x = f32(1.0, -3.0, 2.0, 0.0)  # sign bits 0100
    sign = create("signsgd").compress(x, State())
    assert sign == head(7, 4, "f", 1.5) + bytes([0b01000000])  # mean |x| = 6 / 4
    assert create("signsgd").decompress(sign).tolist() == [1.5, -1.5, 1.5, 1.5]
    onebit = create("onebit").compress(x, State())
    assert onebit == head(8, 4, "ff", 1.0, -3.0) + bytes([0b01000000])  # means of 1 2 0 and -3
    assert create("onebit").decompress(onebit).tolist() == [1, -3, 1, 1]


def test_offset_float_golden() -> None:
    # N = 8, m = 3: the top code 127 is 4.0 (pattern 0x408 after the 20-bit shift), so
    # pbase = 0x408 - 126 = 906 and eps has the pattern 906 << 20 = 0x38A00000 = 1.25 * 2**-14.
    pbase = offset_float_base(4.0, 8, 3)
    assert pbase == 906
    values = f32(4.0, -4.0, 0.0, 1.0, 1.25 * 2**-14, 1.0625, 1.1)
    fields = offset_float_encode(values, 8, 3, pbase)
    # 1.0 is pattern 0x3F8 = 1016: code 1016 - 906 + 1 = 111; 1.0625 is halfway to 1.125:
    # rounds up to 112; 1.1 rounds to 1.125 too.
    assert fields.tolist() == [127, 0xFF, 0, 111, 1, 112, 112]
    assert offset_float_decode(fields, 8, 3, pbase).tolist() == [
        4.0, -4.0, 0.0, 1.0, 1.25 * 2**-14, 1.125, 1.125
    ]


def test_fft_payload_golden() -> None:
    # rfft of a constant: 4, 0, 0. theta 0.5 keeps ceil(0.5 * 4 / 2) = 1 frequency: status 100.
    x = f32(1.0, 1.0, 1.0, 1.0)
    payload = create("fft:theta=0.5,bits=32").compress(x, State())
    assert payload == head(9, 4, "BBII", 32, 0, 0, 1) + bytes([0b10000000]) + struct.pack(
        "!ff", 4.0, 0.0
    )
    assert create("fft").decompress(payload).tolist() == x.tolist()


# --- every method: round trips and edge cases ---------------------------------------------------


# --- the methods' definitions, written again from docs/compressors.md and the seeds -------------
# An independent reference for what a round trip may return: for the stochastic methods the set
# of values each element may take (its two neighbouring levels), for the deterministic ones the
# value itself, for FFT sparsification the kept spectrum within the N-bit floats' rounding. A
# sign, scale or permutation error in a compressor, its packing or its decoder leaves that set.

FLOAT32_ULP = 2.0**-23  # relative spacing of float32: the tolerance of a float32 field or result


def neighbours(y: np.ndarray, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The largest level <= y and the smallest level >= y (``levels`` ascending, from 0)."""
    hi_at = np.clip(np.searchsorted(levels, y, side="left"), 0, levels.size - 1)
    lo_at = np.clip(np.searchsorted(levels, y, side="right") - 1, 0, levels.size - 1)
    return levels[lo_at], levels[hi_at]


def powers_around(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The powers of two 2^floor(log2 a) and 2^ceil(log2 a) of positive ``a``."""
    mantissa, exponent = np.frexp(a)  # a = mantissa 2^exponent, mantissa in [0.5, 1)
    lo = np.ldexp(1.0, exponent - 1)
    return lo, np.where(mantissa == 0.5, lo, 2 * lo)


def one_of(out: np.ndarray, *allowed: np.ndarray, rtol: float = 4 * FLOAT32_ULP) -> np.ndarray:
    """Per element: ``out`` equals one of the ``allowed`` values (within float32 rounding)."""
    return np.any([np.abs(out - a) <= rtol * np.abs(a) for a in allowed], axis=0)


def in_window(magnitude: np.ndarray, smallest: float) -> tuple[np.ndarray, np.ndarray]:
    """NC8's rounding below its window: a value under 2^e_min goes to 0 or 2^e_min."""
    below = (magnitude > 0) & (magnitude < smallest)
    return np.where(below, 0.0, magnitude), np.where(below, smallest, magnitude)


def assert_defined_output(spec: str, x: np.ndarray, out: np.ndarray) -> None:
    """``out`` is a result the definition of ``spec``'s method allows for ``x``."""
    comp = create(spec)
    comp = getattr(comp, "inner", comp)  # the method inside error feedback (a zero residual)
    v = x.astype(np.float64)
    o = out.astype(np.float64)
    n = v.size
    assert o.shape == (n,)
    if n == 0:
        return  # nothing else to compare
    if comp.name == "fft":
        assert_fft_output(comp, v, o)
        return
    # Every other method sends sign(x_i) times a magnitude (or 0).
    assert np.all(o * v >= 0), f"{spec}: an element's sign flipped"
    if comp.name == "nc":
        lo, hi = powers_around(np.abs(v))
        smallest = 2.0 ** comp.window().e_min
        ok = one_of(np.abs(o), *in_window(lo, smallest), *in_window(hi, smallest))
    elif comp.name == "natdither":
        norm = float(np.linalg.norm(v, ord=comp.p))
        levels = np.concatenate([[0.0], 2.0 ** -np.arange(comp.s - 1, -1, -1.0)])
        lo, hi = neighbours(np.abs(v) / norm, levels)
        # one norm per call: NC's two powers of two around it, or the float32 norm itself
        scales = [float(a[0]) for a in powers_around(np.array([norm]))] if comp.nc_norm else [
            float(np.float32(norm))
        ]
        smallest = 0.0 if comp.packed else 2.0 ** comp.window().e_min
        candidates = [one_of(np.abs(o), *in_window(lo * scale, smallest),
                             *in_window(hi * scale, smallest)) for scale in scales]  # fmt: skip
        ok = max(candidates, key=np.count_nonzero)
    elif comp.name == "qsgd":
        d = comp.bucket or max(n, 1)
        ok = np.zeros(n, dtype=bool)
        for begin in range(0, n, d):
            part = slice(begin, begin + d)
            norm = float(np.float32(np.linalg.norm(v[part])))  # the float32 norm sent
            y = comp.s * np.abs(v[part]) / norm
            ok[part] = one_of(np.abs(o[part]), np.floor(y) * norm / comp.s,
                              np.ceil(y) * norm / comp.s)  # fmt: skip
    elif comp.name == "terngrad":
        ok = one_of(np.abs(o), np.zeros(n), np.full(n, np.abs(v).max()))
    elif comp.name in ("topk", "randk"):
        k = min(n, math.ceil(comp.ratio * n - 1e-9))
        kept = o != 0
        assert np.count_nonzero(kept) == k, f"{spec}: {np.count_nonzero(kept)} kept, not {k}"
        scale = n / k if comp.name == "randk" else 1.0
        ok = np.where(kept, one_of(o, v * scale), True)
        if comp.name == "topk" and 0 < k < n:
            assert np.abs(v[kept]).min() >= np.abs(v[~kept]).max(), f"{spec}: not the top {k}"
    elif comp.name == "signsgd":
        ok = one_of(o, np.where(v < 0, -1.0, 1.0) * np.abs(v).mean())
    elif comp.name == "onebit":
        negative = v < 0
        pos = v[~negative].mean() if np.any(~negative) else 0.0
        neg = v[negative].mean() if np.any(negative) else 0.0
        ok = one_of(o, np.where(negative, neg, pos))
    elif comp.name == "3lc":
        scale = float(np.float32(np.abs(v).max() * comp.s))  # M, a float32 field
        ok = one_of(o, np.round(v / scale) * scale)
    else:
        raise AssertionError(f"no definition written for {spec}")
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, (
        f"{spec}: {bad.size} of {n} elements not allowed, e.g. x[{bad[:3]}] = {v[bad[:3]]} "
        f"gave {o[bad[:3]]}"
    )


def assert_fft_output(comp: object, v: np.ndarray, o: np.ndarray) -> None:
    """The ``k`` largest frequencies of the real FFT, each real and imaginary part rounded to
    an N-bit offset float (seed 002, Algorithm 1): its error is at most half a step of ``m``
    mantissa bits, 2^-(m+1) of the value, above ``eps`` and ``eps / 2`` below (``eps`` is at
    most 2^-floor((2^(N-1) - 2) / 2^m) of the largest part, the top code being the largest);
    with the tuned ``m``, at most the error of ``m = 0``, a third of each part (to the nearer
    of two powers of two). Compared in the frequency domain, with float32's rounding of the
    signal (Parseval: at most sqrt(n) 2^-24 ||out|| per frequency vector)."""
    n = v.size
    spectrum = np.fft.rfft(v)
    k = min(spectrum.size, math.ceil(math.ceil((1 - comp.theta) * n - 1e-9) / 2))
    kept = np.zeros(spectrum.size, dtype=bool)
    kept[np.argsort(np.abs(spectrum), kind="stable")[spectrum.size - k :]] = True
    reference = np.where(kept, spectrum, 0)
    parts = np.abs(np.concatenate([reference.real, reference.imag]))
    if comp.bits == 32:
        bound = 2 * FLOAT32_ULP * float(np.linalg.norm(parts))
    elif comp.mantissa < 0:
        bound = float(np.linalg.norm(parts)) / 3
    else:
        top = parts.max() * (1 + 2.0 ** -(comp.mantissa + 1))  # the top code, rounded
        eps = top * 2.0 ** -((2 ** (comp.bits - 1) - 2) // 2**comp.mantissa)
        per_part = np.maximum(parts * 2.0 ** -(comp.mantissa + 1), eps / 2)
        bound = float(np.linalg.norm(np.where(parts > 0, per_part, 0)))
    bound += FLOAT32_ULP * float(np.linalg.norm(parts))  # the parts are cast to float32 first
    bound += math.sqrt(n) * FLOAT32_ULP * float(np.linalg.norm(o)) + 1e-12
    error = float(np.linalg.norm(np.fft.rfft(o) - reference))
    assert error <= bound, f"fft: spectrum off by {error}, bound {bound}"


def roundtrip(spec: str, x: np.ndarray, seed: int = 0) -> np.ndarray:
    comp = create(spec)
    payload = comp.compress(x, State(np.random.default_rng(seed)))
    assert isinstance(payload, bytes)
    out = comp.decompress(payload)
    assert out.dtype == np.float32 and out.shape == (np.asarray(x).size,)
    # the payload alone decodes: a default-parameter compressor of the method reads it
    np.testing.assert_array_equal(create(spec.partition(":")[0]).decompress(payload), out)
    return out


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1001])
def test_round_trip_lengths(spec: str, n: int) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    out = roundtrip(spec, x)
    assert np.all(np.isfinite(out))
    assert_defined_output(spec, x, out)


@pytest.mark.parametrize("spec", [*SPECS, "qsgd:encoding=sparse,s=1,bucket=16", "topk:ratio=1"])
def test_max_payload_size_bounds_every_payload(spec: str) -> None:
    """No payload exceeds ``max_payload_size`` (what server mode sizes its chunks by), for
    Gaussian, heavy-tailed, constant and alternating inputs, and the bound is not loose for the
    fixed-size formats (within the two padding bytes it allows)."""
    compressor = create(spec)
    rng = np.random.default_rng(7)
    for n in (1, 2, 5, 63, 256, 1000):
        bound = compressor.max_payload_size(n)
        inputs = [rng.standard_normal(n), rng.standard_t(1, n), np.ones(n),
                  np.where(np.arange(n) % 2, -1.0, 1.0)]  # fmt: skip
        sizes = [len(compressor.compress(x.astype(np.float32), State(rng))) for x in inputs]
        assert max(sizes) <= bound, (n, sizes, bound)
        if not spec.startswith(("qsgd", "3lc")):
            assert max(sizes) >= bound - 2, (n, sizes, bound)


@pytest.mark.parametrize("spec", SPECS)
def test_zero_vector_stays_zero(spec: str) -> None:
    assert not roundtrip(spec, np.zeros(33, dtype=np.float32)).any()


@pytest.mark.parametrize("spec", SPECS)
def test_constant_vector(spec: str) -> None:
    x = np.full(40, -0.5, dtype=np.float32)
    out = roundtrip(spec, x)
    assert_defined_output(spec, x, out)
    exact = ("nc", "natdither:p=inf,s=4", "terngrad", "signsgd", "onebit", "3lc")
    if spec in exact or spec.startswith("fft"):
        # a power of two, the (exact) scale itself, or a single frequency
        np.testing.assert_allclose(out, x, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_rejected_by_index(spec: str, bad: float) -> None:
    x = np.ones(6, dtype=np.float32)
    x[3] = bad
    with pytest.raises(ValueError, match="index 3"):
        create(spec).compress(x, State())


@pytest.mark.parametrize("spec", SPECS)
def test_malformed_payloads_are_rejected(spec: str) -> None:
    comp = create(spec)
    payload = comp.compress(np.linspace(-1, 1, 50, dtype=np.float32), State())
    with pytest.raises(ValueError):
        comp.decompress(payload[:-1])
    with pytest.raises(ValueError):
        comp.decompress(payload + b"\x00")
    with pytest.raises(ValueError):
        comp.decompress(payload[:3])
    other = next(c for c in REGISTRY.values() if c.tag != comp.tag)
    with pytest.raises(ValueError, match="tag"):
        other().decompress(payload)


def test_shapes_are_flattened_in_c_order() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 6
    out = roundtrip("topk:ratio=1", x)
    assert out.tolist() == x.reshape(-1).tolist()


def test_topk_keeps_the_largest_magnitudes() -> None:
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    out = roundtrip("topk:ratio=0.05", x)
    kept = np.flatnonzero(out)
    assert kept.size == 50
    assert np.abs(x[kept]).min() >= np.sort(np.abs(x))[-50]
    np.testing.assert_array_equal(out[kept], x[kept])


def test_fft_without_dropping_or_quantizing_is_exact() -> None:
    x = np.random.default_rng(4).standard_normal(999).astype(np.float32)
    np.testing.assert_allclose(roundtrip("fft:theta=0,bits=32", x), x, atol=1e-5)


def test_fft_keeps_as_many_reals_as_topk() -> None:
    n = 10_000
    fft, topk = create("fft:theta=0.85,bits=32"), create("topk:ratio=0.15")
    assert 2 * fft.kept(n) == 1500 == round(topk.nominal_bits(n) * n / (32 + 14))


def test_randk_scales_the_kept_elements() -> None:
    x = np.arange(1, 101, dtype=np.float32)
    out = roundtrip("randk:ratio=0.1", x)
    kept = np.flatnonzero(out)
    assert kept.size == 10
    np.testing.assert_allclose(out[kept], 10 * x[kept], rtol=1e-6)


# --- registry, contract, error feedback ----------------------------------------------------------


def test_registry_and_contract() -> None:
    assert set(REGISTRY) == {
        "nc", "natdither", "qsgd", "terngrad", "topk", "randk", "signsgd", "onebit", "fft", "3lc"
    }
    assert len({cls.tag for cls in REGISTRY.values()}) == len(REGISTRY)
    ina = {name for name, cls in REGISTRY.items() if cls().ina}
    assert ina == {"nc", "natdither"}
    assert not create("natdither:packed=1").ina
    unbiased = {name for name, cls in REGISTRY.items() if cls.unbiased}
    assert unbiased == {"nc", "natdither", "qsgd", "terngrad", "randk"}
    for spec in SPECS:
        assert create(spec).nominal_bits(1000) > 0


def test_create_parses_specs() -> None:
    comp = create("qsgd:s=4, bucket=128,encoding=sparse")
    assert (comp.s, comp.bucket, comp.encoding) == (4, 128, "sparse")
    assert create("natdither:p=inf").p == np.inf
    ef = create("ef+topk:ratio=0.5")
    assert isinstance(ef, ErrorFeedback) and ef.name == "ef+topk" and ef.inner.ratio == 0.5
    assert not isinstance(create("topk"), ErrorFeedback)
    for defined_with_ef in ("signsgd", "onebit", "3lc", "ef+3lc"):
        comp = create(defined_with_ef)
        assert isinstance(comp, ErrorFeedback) and not isinstance(comp.inner, ErrorFeedback)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown compressor"),
        ("topk:ratio", "key=value"),
        ("topk:k=3", "bad parameters"),
        ("topk:ratio=0", "kept fraction"),
        ("qsgd:encoding=huffman", "encoding"),
        ("natdither:p=1", "norms"),
        ("natdither:s=0", "levels"),
        ("natdither:nc_norm=0", "NC8 payloads"),
        ("3lc:s=2", "multiplier"),
        ("fft:theta=1", "theta"),
        ("fft:bits=40", "bits"),
        ("nc:workers=0", "worker"),
    ],
)
def test_create_rejects_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create(spec)


def test_error_feedback_carries_what_was_not_sent() -> None:
    """Sum of decoded payloads + final memory == sum of inputs (telescoping)."""
    rng = np.random.default_rng(5)
    comp, state = create("ef+topk:ratio=0.05"), State(np.random.default_rng(0))
    sent = np.zeros(500, dtype=np.float64)
    total = np.zeros(500, dtype=np.float64)
    for _ in range(20):
        x = rng.standard_normal(500).astype(np.float32)
        total += x
        sent += comp.decompress(comp.compress(x, state))
    np.testing.assert_allclose(sent + state.residual, total, atol=1e-4)
    with pytest.raises(ValueError, match="memory"):
        comp.compress(np.ones(3, dtype=np.float32), state)


def test_error_feedback_refuses_double_wrapping() -> None:
    with pytest.raises(ValueError, match="already"):
        ErrorFeedback(create("3lc"))


def test_nc_saturation_is_counted() -> None:
    state = State()
    create("nc:e_max=0").compress(f32(8.0, 0.5, -16.0), state)
    assert state.saturated == 2
