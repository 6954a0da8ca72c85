"""Checkpoint number formats: decoders against independent oracles, encoders against an exact
nearest-value oracle, block quantizers against re-derived formulas and error bounds.

Oracles: torch's float8 dtypes and ml_dtypes (``float8_e4m3fn``, ``float8_e8m0fnu``,
``float4_e2m1fn``) give the decoded value of every bit pattern; :func:`nearest_code` below is a
from-scratch "nearest representable value, ties to the even code, saturating" rule working on
exact float64 midpoints, fed with ml_dtypes' value tables.
"""

from __future__ import annotations

import json
import math
import struct
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4mtp.formats import (
    E2M1_VALUES,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
    pack_e2m1,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_e2m1,
)
from dsv4mtp.reference import InputError

ALL_BYTES = torch.arange(256, dtype=torch.uint8)
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

# ------------------------------------------------------------------------------------ oracles
# Magnitudes of the non-negative codes, in code order (both formats are monotonic in the code).
E4M3_MAGS = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E2M1_MAGS = np.arange(8, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def nearest_code(x: np.ndarray, mags: np.ndarray, sign_bit: int) -> np.ndarray:
    """Code of the representable value nearest to x (no NaN), saturating at mags[-1], exact ties
    to the even code, sign bit from x (so -0.0 and tiny negatives give negative zero)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), mags[-1])
    hi = np.searchsorted(mags, a, side="left")  # first magnitude >= a
    lo = np.maximum(hi - 1, 0)
    mid = (mags[lo] + mags[hi]) / 2  # exact: few significant bits
    pick = np.where(a < mid, lo, np.where(a > mid, hi, np.where(lo % 2 == 0, lo, hi)))
    return (pick | (np.signbit(x).astype(np.int64) << sign_bit)).astype(np.uint8)


def e4m3_oracle(x: np.ndarray) -> np.ndarray:
    return nearest_code(x, E4M3_MAGS, 7)


def e2m1_oracle(x: np.ndarray) -> np.ndarray:
    return nearest_code(x, E2M1_MAGS, 3)


def _nearest_e4m3_exact(q: Fraction) -> int:
    """Byte of the e4m3 value nearest to the exact rational q (ties to the even code)."""
    a = min(abs(q), Fraction(448))
    mags = [Fraction(float(m)) for m in E4M3_MAGS]
    hi = next(i for i, m in enumerate(mags) if m >= a)
    lo = max(hi - 1, 0)
    mid = (mags[lo] + mags[hi]) / 2
    pick = lo if a < mid else hi if a > mid else (lo if lo % 2 == 0 else hi)
    return pick | (0x80 if q < 0 else 0)


def e4m3_quotient_oracle(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Nearest e4m3 of the exact quotient w / s.  The float64 quotient decides except within
    2^-40 (relative) of an e4m3 midpoint, where exact rational arithmetic decides."""
    w, s = np.broadcast_arrays(np.asarray(w, np.float64), np.asarray(s, np.float64))
    y = w / s
    out = e4m3_oracle(y)
    mids = midpoints(E4M3_MAGS)
    a = np.minimum(np.abs(y), 448)
    j = np.clip(np.searchsorted(mids, a), 1, len(mids) - 1)
    gap = np.minimum(np.abs(a - mids[j]), np.abs(a - mids[j - 1]))
    for idx in zip(*np.nonzero(gap <= a * 2.0**-40), strict=True):
        if w[idx] != 0:
            out[idx] = _nearest_e4m3_exact(Fraction(float(w[idx])) / Fraction(float(s[idx])))
    return out


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def all_finite_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float type (bf16 / fp16), as that dtype."""
    t = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return t[torch.isfinite(t)]


def midpoints(mags: np.ndarray) -> np.ndarray:
    return (mags[:-1] + mags[1:]) / 2


def weights(seed: int, n: int, k: int, dtype: torch.dtype, zero_rows: int = 0) -> torch.Tensor:
    """Normal weights with per-row magnitudes spread over 2^-12 .. 2^12 and optional zero rows
    (whole zero blocks), like real layers with a few dead channels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=F64)
    w *= torch.exp2(torch.randint(-12, 13, (n, 1), generator=g).to(F64))
    w[:zero_rows] = 0
    return w.to(dtype)


# ------------------------------------------------------------------------------- decoders
def test_decode_e4m3_every_byte_matches_torch_and_ml_dtypes() -> None:
    ours = decode_e4m3(ALL_BYTES)
    via_torch = ALL_BYTES.view(torch.float8_e4m3fn).to(F32)
    via_ml = torch.from_numpy(ALL_BYTES.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert ours.dtype == F32
    for oracle in (via_torch, via_ml):
        assert torch.equal(torch.isnan(ours), torch.isnan(oracle))
        finite = ~torch.isnan(oracle)
        assert torch.equal(ours[finite], oracle[finite])
        assert torch.equal(torch.signbit(ours[finite]), torch.signbit(oracle[finite]))
    assert torch.isnan(ours).nonzero().flatten().tolist() == [0x7F, 0xFF]
    # The float8 input path and the float64 output are the same values.
    assert torch.equal(
        decode_e4m3(ALL_BYTES.view(torch.float8_e4m3fn)).nan_to_num(), ours.nan_to_num()
    )
    assert torch.equal(decode_e4m3(ALL_BYTES, dtype=F64).nan_to_num(), ours.double().nan_to_num())


def test_decode_e8m0_every_byte_matches_torch_ml_dtypes_and_definition() -> None:
    ours = decode_e8m0(ALL_BYTES)
    via_torch = ALL_BYTES.view(torch.float8_e8m0fnu).to(F32)
    via_ml = torch.from_numpy(ALL_BYTES.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    exact = torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], dtype=F64)
    for oracle in (via_torch, via_ml, exact.float()):
        assert torch.equal(ours.nan_to_num(), oracle.nan_to_num())
    assert torch.equal(decode_e8m0(ALL_BYTES, dtype=F64).nan_to_num(), exact.nan_to_num())
    assert torch.isnan(ours).nonzero().flatten().tolist() == [255]
    assert float(ours[0]) == 2.0**-127 and float(ours[127]) == 1.0 and float(ours[128]) == 2.0
    # float8_e8m0fnu input is read by bits, not converted.
    assert torch.equal(
        decode_e8m0(ALL_BYTES.view(torch.float8_e8m0fnu)).nan_to_num(), ours.nan_to_num()
    )


def test_decode_e8m0_vs_vllm_shift_trick_differs_only_at_0_and_255() -> None:
    """vLLM decodes with ``int32(b) << 23`` viewed as float32: exact for 1..254 only."""
    shifted = (ALL_BYTES.to(torch.int32) << 23).view(F32)
    ours = decode_e8m0(ALL_BYTES)
    assert torch.equal(ours[1:255], shifted[1:255])
    assert float(shifted[0]) == 0.0 and float(ours[0]) == 2.0**-127
    assert math.isinf(float(shifted[255])) and math.isnan(float(ours[255]))


def test_decode_e2m1_every_code_matches_ml_dtypes_and_table() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    ours = decode_e2m1(codes)
    via_ml = torch.from_numpy(codes.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert torch.equal(ours, via_ml)
    assert torch.equal(torch.signbit(ours), torch.signbit(via_ml))
    assert ours.tolist() == list(E2M1_VALUES)
    assert torch.equal(torch.signbit(ours), codes >= 8)  # code 8 is -0.0
    assert torch.equal(decode_e2m1(codes, dtype=F64), ours.double())


# ------------------------------------------------------------------------------- encoders
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_encode_e4m3_every_16bit_float(dtype: torch.dtype) -> None:
    """All finite bf16 / fp16 values: covers every e4m3 midpoint (5 significant bits), the
    subnormal range, and the saturation range up to the type's max."""
    x = all_finite_patterns(dtype)
    x64 = x.double().numpy()
    got = bytes_of(encode_e4m3(x))
    assert np.array_equal(got, e4m3_oracle(x64))
    via_ml = np.clip(x64.astype(np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(got, via_ml.view(np.uint8))


def e4m3_hard_values(dtype: np.dtype) -> np.ndarray:
    """Every e4m3 midpoint and its neighbours one ulp of ``dtype`` away, both signs."""
    m = midpoints(E4M3_MAGS).astype(dtype)
    near = np.concatenate([m, np.nextafter(m, np.inf), np.nextafter(m, -np.inf), E4M3_MAGS])
    near = np.concatenate([near, [448, 464, 464.0001, 480, 1e30, 2**-10, 2**-11, 1e-40]])
    return np.concatenate([near, -near]).astype(dtype)


@pytest.mark.parametrize("np_dtype", [np.float32, np.float64])
def test_encode_e4m3_ties_and_neighbours(np_dtype: type) -> None:
    x = e4m3_hard_values(np.dtype(np_dtype))
    got = bytes_of(encode_e4m3(torch.from_numpy(x)))
    assert np.array_equal(got, e4m3_oracle(x))


def test_encode_e4m3_float64_is_rounded_once() -> None:
    """1.0625 is the midpoint of 1.0 and 1.125.  1.0625 + 2^-40 must go up; a float64 -> float32
    -> e4m3 cast (what torch and ml_dtypes do) rounds to the midpoint first and then down."""
    x = torch.tensor([1.0625 + 2**-40, -(1.0625 + 2**-40), 1.0625 - 2**-40, 1.0625], dtype=F64)
    assert decode_e4m3(encode_e4m3(x)).tolist() == [1.125, -1.125, 1.0, 1.0]
    assert float(x[0].to(torch.float8_e4m3fn).float()) == 1.0  # the double rounding we avoid


def test_encode_e4m3_specials() -> None:
    x = torch.tensor([math.inf, -math.inf, 1e9, -0.0, -1e-30, math.nan])
    got = bytes_of(encode_e4m3(x)).tolist()
    assert got[:5] == [0x7E, 0xFE, 0x7E, 0x80, 0x80]
    assert got[5] in (0x7F, 0xFF)  # NaN stays NaN


def test_encode_e4m3_inverts_decode_on_every_non_nan_byte() -> None:
    ok = ~torch.isnan(decode_e4m3(ALL_BYTES))
    for dtype in (F32, F64):
        back = encode_e4m3(decode_e4m3(ALL_BYTES[ok], dtype=dtype))
        assert torch.equal(back.view(torch.uint8), ALL_BYTES[ok])


_float_lists = st.lists(
    st.one_of(
        st.floats(width=32, allow_nan=False),
        st.floats(-(2.0**-5), 2.0**-5, width=32),  # e4m3 subnormals and below
        st.floats(400, 1e6, width=32),  # past 448
        st.sampled_from(e4m3_hard_values(np.dtype(np.float32)).tolist()),
    ),
    min_size=1,
    max_size=64,
)


@given(values=_float_lists)
def test_encode_e4m3_nearest_float32(values: list[float]) -> None:
    x = np.array(values, dtype=np.float32)
    got = bytes_of(encode_e4m3(torch.from_numpy(x)))
    assert np.array_equal(got, e4m3_oracle(x))


@given(
    values=st.lists(st.floats(allow_nan=False), min_size=1, max_size=64), shift=st.integers(-60, 10)
)
def test_encode_e4m3_nearest_float64(values: list[float], shift: int) -> None:
    x = np.array(values, dtype=np.float64)
    # Also probe float64 values within a few float64 ulps of e4m3 midpoints.
    m = np.resize(midpoints(E4M3_MAGS), len(values))
    x = np.concatenate([x, m * (1 + 2.0**shift), m * (1 - 2.0**shift)])
    got = bytes_of(encode_e4m3(torch.from_numpy(x)))
    assert np.array_equal(got, e4m3_oracle(x))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_encode_e2m1_every_16bit_float(dtype: torch.dtype) -> None:
    x = all_finite_patterns(dtype)
    x64 = x.double().numpy()
    got = encode_e2m1(x).numpy()
    assert np.array_equal(got, e2m1_oracle(x64))
    via_ml = x64.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(got, via_ml)


def test_encode_e2m1_ties_go_to_the_even_code() -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert encode_e2m1(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert encode_e2m1(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14]
    specials = torch.tensor([math.inf, -math.inf, 7.0, 1e30, -0.0, -1e-30, 0.0])
    assert encode_e2m1(specials).tolist() == [7, 15, 7, 7, 8, 8, 0]


def test_encode_e2m1_agrees_with_modelopt_except_negative_zero() -> None:
    """ModelOpt's ``_cast_fp4``, written out as it computes (bounds, ordinal, round-up at the odd
    bounds, sign bit from x < 0), on every bf16 value: the codes agree except for -0.0, which
    ModelOpt encodes as 0 and we keep as 8 (both decode to zero)."""
    x = all_finite_patterns(BF16).float()
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    odd = torch.tensor([0, 1, 0, 1, 0, 1, 0], dtype=torch.bool)
    ordinal = torch.searchsorted(bounds, x.abs(), out_int32=True)
    round_up = ((x.abs()[:, None] == bounds) & odd).any(-1)
    modelopt = ((x < 0).int() * 8 + ordinal + round_up.int()).to(torch.uint8)
    ours = encode_e2m1(x)
    negative_zero = (x == 0) & torch.signbit(x)
    assert torch.equal(ours[~negative_zero], modelopt[~negative_zero])
    assert ours[negative_zero].tolist() == [8] and modelopt[negative_zero].tolist() == [0]


@given(
    values=st.lists(
        st.one_of(
            st.floats(allow_nan=False),
            st.floats(-8, 8),
            st.sampled_from([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -5.0, -0.25]),
        ),
        min_size=1,
        max_size=64,
    ),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_encode_e2m1_nearest(values: list[float], dtype: type) -> None:
    with np.errstate(over="ignore"):  # float64 -> float32 overflow gives inf, which saturates
        x: np.ndarray = np.array(values, dtype=np.float64).astype(dtype)
    m: np.ndarray = midpoints(E2M1_MAGS).astype(dtype)
    x = np.concatenate([x, np.nextafter(m, np.inf), np.nextafter(m, -np.inf)])
    got = encode_e2m1(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, e2m1_oracle(x))


def test_encode_e8m0_every_power_of_two_and_nan() -> None:
    k = torch.arange(-127, 128)
    for dtype in (F32, F64):
        values = torch.exp2(k.to(dtype))
        assert torch.equal(encode_e8m0(values), (k + 127).to(torch.uint8))
    nan = torch.tensor([math.nan])
    assert encode_e8m0(nan).tolist() == [255]
    assert torch.equal(encode_e8m0(decode_e8m0(ALL_BYTES)), ALL_BYTES)


# ------------------------------------------------------------------------------- packing
def test_pack_nibble_order_known_answer() -> None:
    codes = torch.tensor([[1, 2, 15, 7]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x7F]]  # element 0 low nibble, element 1 high nibble
    assert torch.equal(unpack_e2m1(packed), codes)
    # int8 (the official checkpoint's I8) and float4_e2m1fn_x2 views unpack to the same codes.
    assert torch.equal(unpack_e2m1(packed.view(torch.int8)), codes)
    assert torch.equal(unpack_e2m1(packed.view(torch.float4_e2m1fn_x2)), codes)


@given(seed=st.integers(0, 2**31 - 1), lead=st.integers(1, 3), k=st.integers(1, 40))
def test_pack_unpack_round_trip(seed: int, lead: int, k: int) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (lead, 3, 2 * k), generator=g).to(torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (lead, 3, k)
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(packed & 0xF, codes[..., 0::2])


# ------------------------------------------------------------------------------- FP8 block
def expected_fp8_scales(w: torch.Tensor, block: int, fmt: str) -> np.ndarray:
    """Scales re-derived tile by tile in Python (float64 amax)."""
    n, k = w.shape
    wd = w.double()
    out = []
    for i in range(0, n, block):
        row: list[float] = []
        for j in range(0, k, block):
            amax = float(wd[i : i + block, j : j + block].abs().max())
            if fmt == "float32":
                s = np.float32(np.float32(amax) / np.float32(448))
                row.append(1.0 if s == 0 else float(s))
            elif amax == 0:
                row.append(127)
            else:
                e = math.ceil(math.log2(amax / 448))
                while amax > 448 * 2.0**e:
                    e += 1
                while amax <= 448 * 2.0 ** (e - 1):
                    e -= 1
                row.append(max(e, -127) + 127)
        out.append(row)
    return np.array(out, dtype=np.float32 if fmt == "float32" else np.uint8)


def fp8_scale_values(scale: torch.Tensor) -> torch.Tensor:
    return scale.double() if scale.dtype == F32 else decode_e8m0(scale, dtype=F64)


def expand(s: torch.Tensor, rows: int, cols: int, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


@pytest.mark.parametrize("fmt", ["e8m0", "float32"])
@given(
    seed=st.integers(0, 2**31 - 1),
    block=st.sampled_from([128, 8]),
    n_blocks=st.integers(1, 3),
    k_blocks=st.integers(1, 3),
    n_extra=st.integers(-7, 0),
    k_extra=st.integers(-7, 0),
    dtype=st.sampled_from([F32, BF16, F64]),
    zero_rows=st.integers(0, 9),
)
def test_fp8_block_quantize(
    fmt: str,
    seed: int,
    block: int,
    n_blocks: int,
    k_blocks: int,
    n_extra: int,
    k_extra: int,
    dtype: torch.dtype,
    zero_rows: int,
) -> None:
    """Scales re-derived independently; q is the oracle-nearest e4m3 of w / scale; error bound:
    e4m3 keeps 4 significant bits, so the rounding error of y = w/s is <= |y| 2^-4 (normal
    range) or <= 2^-10 (subnormal half-step), plus float32 slack 2^-20 (|w| + s) for the float32
    scale's division and product (an e8m0 scale divides and multiplies exactly)."""
    n, k = n_blocks * block + min(n_extra, 0), k_blocks * block + min(k_extra, 0)
    n, k = max(n, 1), max(k, 1)
    w = weights(seed, n, k, dtype, zero_rows)
    q, scale = quantize_fp8_block(w, scale_fmt=fmt, block=block)  # type: ignore[arg-type]
    nb, kb = -(-n // block), -(-k // block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert scale.shape == (nb, kb)
    assert scale.dtype == (F32 if fmt == "float32" else torch.float8_e8m0fnu)
    assert np.array_equal(
        bytes_of(scale.contiguous()), expected_fp8_scales(w, block, fmt).view(np.uint8)
    )

    s = expand(fp8_scale_values(scale), block, block, n, k)  # (N, K) float64
    # The codes are the nearest e4m3 of the exact quotient (one rounding, either scale format).
    assert np.array_equal(bytes_of(q), e4m3_quotient_oracle(w.double().numpy(), s.numpy()))

    deq = dequantize_fp8_block(q, scale, block=block, dtype=F64)  # exact: 4 + 24 bits
    assert torch.equal(dequantize_fp8_block(q, scale, block=block), deq.float())
    err = (deq - w.double()).abs()
    slack = 2.0**-20 * (w.double().abs() + s) if fmt == "float32" else 0
    assert bool((err <= w.double().abs() * 2.0**-4 + s * 2.0**-10 + slack).all())
    assert torch.equal(deq[:zero_rows], torch.zeros_like(deq[:zero_rows]))
    if fmt == "e8m0":  # power-of-two scales make quantization a projection
        q2, s2 = quantize_fp8_block(deq, scale_fmt="e8m0", block=block)
        assert torch.equal(dequantize_fp8_block(q2, s2, block=block, dtype=F64), deq)


@pytest.mark.parametrize("dtype", [BF16, F32, F64])
def test_fp8_block_float32_scale_rounds_the_exact_quotient_once(dtype: torch.dtype) -> None:
    """A bf16 block with amax 25.5 stores the float32 scale 0.05691964 (25.5 / 448 rounded);
    1.1953125 / that scale = 21.0000004, just above the midpoint of 20 and 22, so it must encode
    22; a float32 division rounds the quotient to 21.0 and ties to even would give 20.  The rest
    of the block is every e4m3 midpoint times the scale, rounded to the input dtype, and the
    inputs one ulp either side: each must encode the nearest e4m3 of its exact quotient."""
    head = torch.tensor([25.5, 1.1953125, -1.1953125], dtype=F64)
    scale = np.float32(np.float32(25.5) / np.float32(448))
    at_mid = torch.from_numpy(midpoints(E4M3_MAGS) * np.float64(scale)).to(dtype)
    near = torch.cat(
        [at_mid, torch.nextafter(at_mid, at_mid * 2), torch.nextafter(at_mid, at_mid * 0)]
    )
    near = near[near.abs() < 25.5]  # amax stays 25.5
    flat = torch.cat([head.to(dtype), near, -near])
    w = torch.nn.functional.pad(flat, (0, -flat.numel() % 128)).reshape(-1, 128)  # one block
    assert w.shape[0] <= 128
    q, s = quantize_fp8_block(w, scale_fmt="float32")
    assert s.dtype == F32 and float(s) == float(scale)
    assert decode_e4m3(q)[0, 1:3].tolist() == [22.0, -22.0]
    assert np.array_equal(bytes_of(q), e4m3_quotient_oracle(w.double().numpy(), float(scale)))


def test_fp8_block_known_answer_and_zero_block() -> None:
    q = torch.tensor([[0x38, 0x7E], [0x01, 0xB8]], dtype=torch.uint8)  # 1, 448, 2^-9, -1
    scale = torch.tensor([[120]], dtype=torch.uint8)  # 2^-7
    got = dequantize_fp8_block(q.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu))
    assert got.tolist() == [[2.0**-7, 3.5], [2.0**-16, -(2.0**-7)]]
    assert torch.equal(dequantize_fp8_block(q, scale), got)  # raw uint8 inputs read the same
    for fmt, one in (("e8m0", 127), ("float32", 0x3F800000)):
        q0, s0 = quantize_fp8_block(torch.zeros(3, 130), scale_fmt=fmt)  # type: ignore[arg-type]
        assert s0.shape == (1, 2)
        raw = s0.view(torch.uint8) if fmt == "e8m0" else s0.view(torch.int32)
        assert raw.flatten().tolist() == [one, one]
        assert not bytes_of(q0).any()


@pytest.mark.parametrize("np_dtype", [np.float32, np.float64])
def test_block_scale_exponents_at_power_of_two_edges(np_dtype: type) -> None:
    """FP8 e8m0: amax = 448 * 2^k exactly keeps 2^k, one ulp above needs 2^(k+1).  MXFP4:
    amax = 2^j gives exponent j - 2, one ulp below gives j - 3."""
    dt = torch.from_numpy(np.zeros(1, dtype=np_dtype)).dtype
    for k in (-30, -1, 0, 3, 40):
        edge = np_dtype(448 * 2.0**k)
        for amax, want in (
            (edge, k),
            (np.nextafter(edge, np_dtype(np.inf)), k + 1),
            (np.nextafter(edge, np_dtype(0)), k),
        ):
            w = torch.zeros(2, 3, dtype=dt)
            w[1, 2] = -float(amax)
            assert quantize_fp8_block(w)[1].view(torch.uint8).item() == 127 + want
        pow2 = np_dtype(2.0**k)
        for amax, want in ((pow2, k - 2), (np.nextafter(pow2, np_dtype(0)), k - 3)):
            w = torch.zeros(1, 32, dtype=dt)
            w[0, 5] = float(amax)
            assert quantize_mxfp4(w)[1].item() == 127 + want


# ------------------------------------------------------------------------------- MXFP4
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 6),
    k_blocks=st.integers(1, 4),
    dtype=st.sampled_from([F32, BF16, F64]),
    zero_rows=st.integers(0, 2),
)
def test_mxfp4_quantize(
    seed: int, n: int, k_blocks: int, dtype: torch.dtype, zero_rows: int
) -> None:
    """Scale byte = floor(log2 amax) - 2 + 127 (127 for a zero block); codes are the
    oracle-nearest e2m1 of w / scale.  Error bound: with y = w/s, |y| < 8; e2m1 steps are 0.5 on
    [0, 2), 1 on [2, 4), 2 on [4, 6], so the rounding error is <= max(|y|, 1)/4, and
    saturation of |y| in (6, 8) errs by |y| - 6 <= |y|/4 too: |w - deq| <= max(|w|, s)/4, exact
    in float64."""
    k = 32 * k_blocks
    w = weights(seed, n, k, dtype, zero_rows)
    packed, scale = quantize_mxfp4(w)
    assert (packed.dtype, packed.shape, scale.dtype, scale.shape) == (
        torch.uint8, (n, k // 2), torch.uint8, (n, k // 32),
    )  # fmt: skip
    amax = w.double().abs().view(n, k // 32, 32).amax(-1)
    want = [
        [127 if a == 0 else max(math.frexp(a)[1] - 1 - 2, -127) + 127 for a in row]
        for row in amax.tolist()
    ]
    assert scale.tolist() == want
    s = decode_e8m0(scale, dtype=F64).repeat_interleave(32, -1)  # (N, K)
    y = w.double() / s
    assert np.array_equal(unpack_e2m1(packed).numpy(), e2m1_oracle(y.numpy()))

    deq = dequantize_mxfp4(packed, scale, dtype=F64)
    assert bool(((deq - w.double()).abs() <= torch.maximum(w.double().abs(), s) / 4).all())
    assert torch.equal(quantize_mxfp4(deq)[0], packed)  # a projection: bytes are fixed points
    assert torch.equal(quantize_mxfp4(deq)[1], scale)


def test_mxfp4_known_answer() -> None:
    """The vLLM test's facts: low nibble = even element, E8M0 127 -> x1, 128 -> x2."""
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    packed[0, 0], packed[1, 0] = 0x21, 0xF7
    scale = torch.tensor([[128], [127]], dtype=torch.uint8)
    got = dequantize_mxfp4(packed, scale)
    assert got[0, :3].tolist() == [1.0, 2.0, 0.0] and got[1, :3].tolist() == [6.0, -6.0, 0.0]
    assert not got[:, 2:].any()
    # Scale byte 0 is the true 2^-127 (code 1 = 0.5 -> 2^-128, a float32 subnormal).
    tiny = dequantize_mxfp4(
        torch.full((1, 16), 0x11, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8)
    )
    assert bool((tiny == 2.0**-128).all())
    # Byte 254 times 6 overflows float32 (inf) but not float64; byte 255 is NaN.
    big = torch.full((1, 16), 0x77, dtype=torch.uint8)
    assert bool(torch.isinf(dequantize_mxfp4(big, torch.tensor([[254]], dtype=torch.uint8))).all())
    assert (
        float(dequantize_mxfp4(big, torch.tensor([[254]], dtype=torch.uint8), dtype=F64)[0, 0])
        == 6 * 2.0**127
    )
    assert bool(torch.isnan(dequantize_mxfp4(big, torch.tensor([[255]], dtype=torch.uint8))).all())


# ------------------------------------------------------------------------------- NVFP4
def nvfp4_expected(w: torch.Tensor, ws2: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """ModelOpt's recipe in numpy float32: block scale bytes and codes."""
    n, k = w.shape
    blocks = w.double().numpy().reshape(n, k // 16, 16)
    bamax = np.abs(blocks).max(-1).astype(np.float32)
    ratio = bamax / (np.float32(6) * ws2)
    ratio = np.where(ratio == 0, np.float32(1), ratio)
    ratio = np.clip(ratio, np.float32(2.0**-9), np.float32(448)).astype(np.float32)
    bs = ratio.astype(ml_dtypes.float8_e4m3fn)
    denom = bs.astype(np.float32) * ws2  # float32 product
    if w.dtype == F64:
        y = blocks / denom.astype(np.float64)[..., None]
    else:
        y = w.float().numpy().reshape(n, k // 16, 16) / denom[..., None]
    return bs.view(np.uint8), e2m1_oracle(y.reshape(n, k))


@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 6),
    k_blocks=st.integers(1, 6),
    dtype=st.sampled_from([F32, BF16, F64]),
    zero_rows=st.integers(0, 2),
    given_scale=st.sampled_from([None, "amax", "twice"]),
)
def test_nvfp4_quantize(
    seed: int, n: int, k_blocks: int, dtype: torch.dtype, zero_rows: int, given_scale: str | None
) -> None:
    """Block scales and codes re-derived from ModelOpt's recipe.  Error bound, with
    u = block_scale * weight_scale_2 and y = w/u: where |y| <= 6, e2m1 rounding errs by at most
    max(|y|, 1)/4; beyond 6 the code saturates and the error is |w| - 6u; plus float32 slack
    2^-20 |w| for the division and the final product."""
    k = 16 * k_blocks
    w = weights(seed, n, k, dtype, zero_rows)
    amax32 = np.float32(float(w.double().abs().max()))
    auto = np.float32(amax32 / np.float32(2688)) if amax32 > 0 else np.float32(1)
    arg: float | torch.Tensor | None = None
    if given_scale == "amax":
        arg = torch.tensor(float(auto))
    elif given_scale == "twice":
        arg = float(auto) * 2
    packed, block_scale, ws2 = quantize_nvfp4(w, arg)
    assert (packed.dtype, packed.shape) == (torch.uint8, (n, k // 2))
    assert (block_scale.dtype, block_scale.shape) == (torch.float8_e4m3fn, (n, k // 16))
    assert (ws2.dtype, ws2.shape) == (F32, ())
    want_ws2 = auto * np.float32(2) if given_scale == "twice" else auto
    assert float(ws2) == float(want_ws2)
    want_bs, want_codes = nvfp4_expected(w, np.float32(float(ws2)))
    assert np.array_equal(bytes_of(block_scale), want_bs)
    assert np.array_equal(unpack_e2m1(packed).numpy(), want_codes)

    deq = dequantize_nvfp4(packed, block_scale, ws2, dtype=F64)  # exact: 2 + 4 + 24 bits
    # float32 output is the exact product rounded once: (code * block_scale) is exact first.
    assert torch.equal(dequantize_nvfp4(packed, block_scale, ws2), deq.float())
    u = (decode_e4m3(block_scale, dtype=F64) * float(ws2)).repeat_interleave(16, -1)
    wd = w.double()
    bound = torch.where(wd.abs() <= 6 * u, torch.maximum(wd.abs(), u) / 4, wd.abs() - 6 * u)
    assert bool(((deq - wd).abs() <= bound + 2.0**-20 * wd.abs()).all())
    assert torch.equal(deq[:zero_rows], torch.zeros_like(deq[:zero_rows]))
    if zero_rows:  # all-zero blocks get block scale 1.0 (0x38), as in ModelOpt
        assert bool((block_scale[:zero_rows].view(torch.uint8) == 0x38).all())


def test_nvfp4_known_answer_and_product_order() -> None:
    """code 6.0 x block scale 448 x weight_scale_2 = amax; the product is (code*bs)*ws2."""
    packed = torch.full((1, 8), 0x77, dtype=torch.uint8)
    bs = torch.tensor([[448.0]]).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(0.1, dtype=F32)
    got = dequantize_nvfp4(packed, bs, ws2)
    assert bool((got == torch.tensor(2688.0) * ws2).all())
    # A saturated block: the tensor max lands exactly on code 6 x 448.
    w = torch.zeros(1, 16)
    w[0, 3] = -5.0
    p, b, s = quantize_nvfp4(w)
    assert float(s) == float(torch.tensor(5.0) / 2688) and bytes_of(b).tolist() == [[0x7E]]
    assert unpack_e2m1(p)[0, 3] == 15
    # A too-small caller weight_scale_2 clamps block scales at 448 and saturates codes.
    p, b, _ = quantize_nvfp4(w, 1e-6)
    assert bytes_of(b).tolist() == [[0x7E]] and unpack_e2m1(p)[0, 3] == 15


# ------------------------------------------------------------------------------- batching, dtypes
def test_dequantizers_accept_stacked_experts_and_output_dtypes() -> None:
    ws = [weights(s, 40, 64, F32) for s in range(3)]
    # FP8 (block 16 so that the 40 rows end in a partial tile).
    qs = [quantize_fp8_block(w, block=16) for w in ws]
    q, s = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
    single = torch.stack([dequantize_fp8_block(a, b, block=16) for a, b in qs])
    assert torch.equal(dequantize_fp8_block(q, s, block=16), single)
    assert torch.equal(dequantize_fp8_block(q, s, block=16, dtype=BF16), single.bfloat16())
    # MXFP4
    ms = [quantize_mxfp4(w) for w in ws]
    p, sc = torch.stack([a for a, _ in ms]), torch.stack([b for _, b in ms])
    single = torch.stack([dequantize_mxfp4(a, b) for a, b in ms])
    assert torch.equal(dequantize_mxfp4(p, sc), single)
    assert torch.equal(dequantize_mxfp4(p, sc, dtype=F64), single.double())  # exact products
    assert torch.equal(dequantize_mxfp4(p, sc, dtype=BF16), single.bfloat16())
    # NVFP4: one weight_scale_2 per expert, or one shared scalar.
    ns = [quantize_nvfp4(w) for w in ws]
    p, bs, s2 = (torch.stack([t[i] for t in ns]) for i in range(3))
    single = torch.stack([dequantize_nvfp4(*t) for t in ns])
    assert s2.shape == (3,)
    assert torch.equal(dequantize_nvfp4(p, bs, s2), single)
    assert torch.equal(dequantize_nvfp4(p, bs, s2, dtype=BF16), single.bfloat16())
    shared = dequantize_nvfp4(p, bs, s2[0])
    assert torch.equal(shared[0], single[0])


# ------------------------------------------------------------------------------- safetensors
def header_dtypes(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return {k: v["dtype"] for k, v in json.loads(raw[8 : 8 + size]).items() if k != "__metadata__"}


def test_scales_survive_safetensors_round_trip(tmp_path: Path) -> None:
    """E8M0 scales stored as F8_E8M0 (the official layout) and as raw U8 bytes, MXFP4 packed as
    I8 (official) and U8, NVFP4 block scales as F8_E4M3 and weight_scale_2 as a 0-d F32: all
    load back bit-identical and dequantize to the same values."""
    w = weights(7, 130, 256, BF16, zero_rows=2)
    w[5, :32] = 2.0**-100  # a block whose e8m0 scale is far below 1
    q8, s8 = quantize_fp8_block(w)
    q32, s32 = quantize_fp8_block(w, scale_fmt="float32")
    packed, mx_scale = quantize_mxfp4(w)
    nv_packed, nv_bs, nv_ws2 = quantize_nvfp4(w)
    tensors = {
        "fp8.weight": q8,
        "fp8.scale": s8,
        "fp8.scale_u8": s8.view(torch.uint8).clone(),
        "fp8f.weight": q32,
        "fp8f.scale": s32,
        "mx.weight": packed.view(torch.int8).clone(),
        "mx.scale": mx_scale.view(torch.float8_e8m0fnu).clone(),
        "mx.scale_u8": mx_scale,
        "nv.weight": nv_packed,
        "nv.weight_scale": nv_bs,
        "nv.weight_scale_2": nv_ws2,
    }
    path = tmp_path / "formats.safetensors"
    save_file(tensors, str(path))
    assert header_dtypes(path) == {
        "fp8.weight": "F8_E4M3", "fp8.scale": "F8_E8M0", "fp8.scale_u8": "U8",
        "fp8f.weight": "F8_E4M3", "fp8f.scale": "F32",
        "mx.weight": "I8", "mx.scale": "F8_E8M0", "mx.scale_u8": "U8",
        "nv.weight": "U8", "nv.weight_scale": "F8_E4M3", "nv.weight_scale_2": "F32",
    }  # fmt: skip
    with safe_open(str(path), framework="pt") as f:
        loaded = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(
            loaded[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        ), name

    want = dequantize_fp8_block(q8, s8)
    assert torch.equal(dequantize_fp8_block(loaded["fp8.weight"], loaded["fp8.scale"]), want)
    assert torch.equal(dequantize_fp8_block(loaded["fp8.weight"], loaded["fp8.scale_u8"]), want)
    assert torch.equal(
        dequantize_fp8_block(loaded["fp8f.weight"], loaded["fp8f.scale"]),
        dequantize_fp8_block(q32, s32),
    )
    want = dequantize_mxfp4(packed, mx_scale)
    for scale_name in ("mx.scale", "mx.scale_u8"):
        assert torch.equal(dequantize_mxfp4(loaded["mx.weight"], loaded[scale_name]), want)
    got = dequantize_nvfp4(
        loaded["nv.weight"], loaded["nv.weight_scale"], loaded["nv.weight_scale_2"]
    )
    assert torch.equal(got, dequantize_nvfp4(nv_packed, nv_bs, nv_ws2))
    # The data are discriminating: a numeric cast of the loaded E8M0 tensor (instead of a view)
    # would change the scales, so the equalities above could have failed.
    assert not torch.equal(loaded["mx.scale"].to(torch.uint8), mx_scale)


# ------------------------------------------------------------------------------- bad input
def _u8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)


BAD_INPUTS = [
    (
        lambda: quantize_mxfp4(torch.randn(4, 48)),
        r"w: expected the last dim K to be a multiple of 32, got shape \(4, 48\)",
    ),
    (
        lambda: quantize_nvfp4(torch.randn(4, 24)),
        r"w: expected the last dim K to be a multiple of 16, got shape \(4, 24\)",
    ),
    (
        lambda: quantize_fp8_block(torch.randn(2, 3, 4)),
        r"w: expected 2 dimensions, got shape \(2, 3, 4\)",
    ),
    (lambda: quantize_fp8_block(torch.tensor([[1.0, math.nan]])), r"w: expected finite values"),
    (
        lambda: quantize_fp8_block(torch.randn(4, 4), scale_fmt="fp8"),
        r"scale_fmt: expected .*got 'fp8'",
    ),  # type: ignore[arg-type]
    (lambda: quantize_fp8_block(torch.randn(4, 4).int()), r"w: expected dtype in .*got int32"),
    (
        lambda: quantize_nvfp4(torch.randn(4, 16), 0.0),
        r"weight_scale_2: expected a finite positive value, got 0.0",
    ),
    (
        lambda: quantize_nvfp4(torch.randn(4, 16), math.inf),
        r"weight_scale_2: expected a finite positive value, got inf",
    ),
    (
        lambda: quantize_nvfp4(torch.randn(4, 16), torch.ones(2)),
        r"weight_scale_2: expected one value, got shape \(2,\)",
    ),
    (
        lambda: dequantize_mxfp4(_u8(4, 16), _u8(4, 2)),
        r"scale: expected shape \(4, 1\), got \(4, 2\)",
    ),
    (
        lambda: dequantize_mxfp4(_u8(4, 24), _u8(4, 1)),
        r"packed: expected last dim K/2 to be a multiple of 16 \(K a multiple of 32\), got shape \(4, 24\)",
    ),
    (
        lambda: dequantize_mxfp4(_u8(4, 16).float(), _u8(4, 1)),
        r"packed: expected dtype in \(uint8, int8, float4_e2m1fn_x2\), got float32",
    ),
    (
        lambda: dequantize_mxfp4(_u8(4, 16), _u8(4, 1).float()),
        r"scale: expected dtype in \(uint8, float8_e8m0fnu\), got float32",
    ),
    (
        lambda: dequantize_mxfp4(_u8(16), _u8(1)),
        r"packed: expected shape \(..., N, K/2\), got \(16,\)",
    ),
    (
        lambda: dequantize_mxfp4(_u8(4, 16), _u8(4, 1), dtype=torch.int32),
        r"dtype: expected one of .*got torch.int32",
    ),
    (
        lambda: dequantize_fp8_block(_u8(130, 200).float(), torch.ones(2, 2)),
        r"q: expected dtype in \(uint8, float8_e4m3fn\), got float32",
    ),
    (
        lambda: dequantize_fp8_block(_u8(130, 200), torch.ones(1, 2)),
        r"scale: expected shape \(2, 2\), got \(1, 2\)",
    ),
    (
        lambda: dequantize_fp8_block(_u8(3, 130, 200), torch.ones(2, 2, 2)),
        r"scale: expected shape \(3, 2, 2\), got \(2, 2, 2\)",
    ),
    (
        lambda: dequantize_fp8_block(_u8(4, 4), torch.ones(1, 1).bfloat16()),
        r"scale: expected dtype in \(float32, uint8, float8_e8m0fnu\), got bfloat16",
    ),
    (
        lambda: dequantize_nvfp4(_u8(4, 8), _u8(4, 1), torch.tensor(1.0)),
        r"block_scale: expected dtype in \(float8_e4m3fn\), got uint8",
    ),
    (
        lambda: dequantize_nvfp4(_u8(4, 8), _u8(4, 2).view(torch.float8_e4m3fn), torch.tensor(1.0)),
        r"block_scale: expected shape \(4, 1\), got \(4, 2\)",
    ),
    (
        lambda: dequantize_nvfp4(_u8(4, 8), _u8(4, 1).view(torch.float8_e4m3fn), torch.ones(3)),
        r"weight_scale_2: expected shape \(\) or \(\) .*got \(3,\)",
    ),
    (
        lambda: dequantize_nvfp4(
            _u8(2, 4, 8), _u8(2, 4, 1).view(torch.float8_e4m3fn), torch.ones(3)
        ),
        r"weight_scale_2: expected shape \(\) or \(2,\) .*got \(3,\)",
    ),
    (
        lambda: dequantize_nvfp4(
            _u8(4, 8), _u8(4, 1).view(torch.float8_e4m3fn), torch.tensor(1.0, dtype=F64)
        ),
        r"weight_scale_2: expected dtype in \(float32\), got float64",
    ),
    (lambda: encode_e2m1(torch.tensor([1.0, math.nan])), r"x: E2M1 has no NaN, found 1 NaN"),
    (
        lambda: encode_e8m0(torch.tensor([3.0])),
        r"values: expected powers of two in \[2\^-127, 2\^127\] or NaN, got e.g. \[3.0\]",
    ),
    (lambda: encode_e8m0(torch.tensor([0.0, -2.0, math.inf])), r"values: .*3 of 3 invalid"),
    (lambda: encode_e8m0(torch.tensor([2.0**128], dtype=F64)), r"values: expected powers of two"),
    (
        lambda: decode_e2m1(torch.tensor([16], dtype=torch.uint8)),
        r"codes: expected E2M1 codes in 0..15, got max 16",
    ),
    (
        lambda: decode_e4m3(torch.ones(2)),
        r"t: expected dtype in \(uint8, float8_e4m3fn\), got float32",
    ),
    (lambda: decode_e8m0(ALL_BYTES, dtype=BF16), r"dtype: expected float32 or float64"),
    (lambda: pack_e2m1(_u8(2, 3)), r"codes: expected an even last dim K, got shape \(2, 3\)"),
]


@pytest.mark.parametrize(("call", "message"), BAD_INPUTS, ids=[m[:40] for _, m in BAD_INPUTS])
def test_bad_input_raises_input_error(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match=message):
        call()
