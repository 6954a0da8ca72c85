"""Bit-exact encode / decode of the DeepSeek-V4 checkpoint number formats.

Bit layouts, tables and rounding rules with their reasons: ``docs/semantics.md``, "Number formats".

Scalar formats
--------------
* **E4M3** (``torch.float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf;
  bytes 0x7F / 0xFF are NaN; largest finite 448; subnormals ``m * 2^-9``.
  *Decode* reads the bit fields through a 256-entry table built from that definition (not from
  torch's cast, so the tests can use torch and ml_dtypes as independent oracles).
  *Encode* clamps to +-448 and then uses torch's ``float8_e4m3fn`` cast (round to nearest, ties
  to even).  Consequences: +-inf saturate to +-448, NaN stays NaN (0x7F, or 0xFF when the sign
  bit is set), -0.0 stays -0.0.  torch (and ml_dtypes) cast float64 through float32, which rounds
  twice and can land one e4m3 step off for a float64 value within 2^-24 (relative) of a
  midpoint; a float64 input is therefore first rounded to float32 *to odd*, which makes the
  second rounding exact, so the result is the correctly rounded e4m3 value for every input dtype.
* **E2M1** (FP4): codes 0..15, value table :data:`E2M1_VALUES`; bit 3 is the sign.
  *Encode* rounds to the nearest value, ties to the *even code* (the one whose mantissa bit is
  0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturates beyond +-6 (so +-inf -> +-6),
  keeps the sign of zero (``-0.0`` and tiny negatives give code 8) and raises
  :class:`InputError` on NaN, which E2M1 cannot represent.  This is ml_dtypes'
  ``float4_e2m1fn`` for every input, and ModelOpt's ``_cast_fp4`` (which wrote the NVFP4
  checkpoints we read) for every input but ``-0.0``: ModelOpt takes the sign bit from
  ``x < 0`` and encodes ``-0.0`` as code 0.  Both codes decode to zero; keeping the sign bit
  makes quantize(dequantize(codes)) return the same bytes for every code (tested).
* **Packing**: two codes per byte, element ``2j`` in the low nibble, element ``2j + 1`` in the high
  nibble of byte ``j``.  Packed tensors may arrive as ``uint8`` (NVIDIA checkpoints, vLLM
  params), ``int8`` (the official Flash checkpoint stores ``I8``) or ``torch.float4_e2m1fn_x2``;
  all are *reinterpreted* as uint8 bytes with ``.view``, never converted numerically (an int8
  right shift would smear the sign bit into the high nibble).
* **E8M0 / UE8M0** (``torch.float8_e8m0fnu``): byte ``b`` decodes to exactly ``2^(b-127)``;
  byte 0 decodes to 2^-127 (the true value; vLLM's ``b << 23`` shift trick gives 0.0 there) and
  byte 255 to NaN (the shift trick gives +inf).  Scales given as ``torch.float8_e8m0fnu`` are
  reinterpreted with ``.view(torch.uint8)``; a numeric ``.to(torch.uint8)`` would turn 2^-7
  into 0 and destroy the exponent.  A ``uint8`` scale tensor is always read as raw E8M0 bytes.
  *Encode* accepts only positive powers of two in [2^-127, 2^127] (and NaN -> 255); anything
  else raises :class:`InputError`.

Block formats (weights ``w`` of shape (N, K); K is the input / reduction dim)
------------------------------------------------------------------------------
* **FP8 block** (attention, shared experts, e/h_proj; Flash-Base experts): q (N, K) E4M3 and one
  scale per ``block x block`` tile, shape (ceil(N/block), ceil(K/block)); edge tiles are partial
  (the amax is taken over the elements that exist).  ``w ~= q * scale`` (the scale is a
  multiplier, whatever vLLM's ``weight_scale_inv`` name says).

  - ``scale_fmt="e8m0"`` (alias ``"ue8m0"``): ``scale = 2^ceil(log2(amax / 448))``, computed
    exactly as the smallest k with ``amax <= 448 * 2^k`` (frexp of the float64 ratio, not a
    floating log2, which can round across a power of two).  So ``|w / scale| <= 448`` always and
    no clamping happens.  k is clamped to >= -127 for tiny blocks; a float64 block whose k would
    exceed 127 raises :class:`InputError`.
  - ``scale_fmt="float32"``: ``scale = float32(amax) / 448`` in float32.  The codes are the
    correctly rounded e4m3 values of the exact quotient ``w / scale`` (saturating at +-448):
    dividing in float32 first would round twice, and a quotient within a float32 ulp of an e4m3
    midpoint would then tie to even on the wrong side (amax 25.5 gives the scale 0.05691964;
    1.1953125 / scale = 21.0000004 must encode 22, the float32 quotient 21.0 ties to 20).
  - All-zero block: scale 1.0 (E8M0 byte 127) in both cases; its codes are zeros.  A float32
    scale that would underflow to 0 (amax < 448 * 2^-150) is also stored as 1.0.

* **MXFP4** (OCP MX, V4-Flash / V4-Pro routed experts): packed E2M1 (N, K/2) and one E8M0 scale
  per 32 consecutive K elements, (N, K/32); K must be a multiple of 32.
  ``scale = 2^(floor(log2(amax)) - 2)`` (2 = emax of E2M1), floor(log2) taken exactly with
  frexp, exponent clamped to [-127, 127]; the block's largest element lands in [4, 8) and values
  above 6 saturate (the OCP definition).  All-zero block: byte 127 (scale 1.0), the same choice
  as FP8, so our quantizers never emit the bytes 0 and 255 whose decoding differs between
  implementations; only a block with amax < 2^-125 gets byte 0 (from the clamp).

* **NVFP4** (ModelOpt, NVIDIA re-quantized routed experts): packed E2M1 (N, K/2), E4M3 block
  scale per 16 K elements (N, K/16) and a float32 0-d ``weight_scale_2``.  Quantization follows
  ModelOpt's ``NVFP4QTensor`` (float32 arithmetic, same operation order):

  - ``weight_scale_2 = float32(amax) / 2688`` (= 448 * 6), unless given (a w1/w3 pair shares
    the scale of their joint amax).  An all-zero weight gets 1.0 (ModelOpt would divide 0 by 0).
  - ``ratio = float32(block_amax) / (6 * weight_scale_2)``; ``ratio == 0`` (all-zero block) is
    replaced by 1.0 and ratios below 2^-9 are raised to 2^-9 (ModelOpt's current rule, so a block
    scale never underflows to 0); ``block_scale = encode_e4m3(ratio)`` (which also clamps a
    ratio above 448, reachable only with a caller-supplied, too-small ``weight_scale_2``).
  - ``codes = encode_e2m1(w / (float(block_scale) * weight_scale_2))``.
  - Dequantization is ``(code * block_scale) * weight_scale_2``: the first product is exact in
    float32, so the result is the correctly rounded value of the triple product (a GEMM that
    applies ``weight_scale_2`` in its epilogue computes the same).  ModelOpt's own dequantizer
    multiplies by ``float32(block_scale * weight_scale_2)`` and can differ by one float32 ulp.
    A zero block scale (possible in foreign checkpoints) decodes to zeros.

Dequantizers accept leading batch dims (e.g. stacked experts (E, N, K/2)), compute in
``promote(dtype, float32)`` (float64 stays float64), write the result once and multiply the scales
in place through views, so peak memory is about one output plus one int32 index tensor.  Decoded
products are exact in float32 except where they overflow (E8M0 bytes >= 253 times a large code,
inf) or round (FP8 with an arbitrary float32 scale); NaN scales or codes propagate as NaN.
The quantizers take a 2-D weight, reject non-finite values and are for building test data and
simulating quantization; they are not on any hot path.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_finite,
    check_ndim,
    check_shape,
    compute_dtype,
)
from dsv4mtp.errors import InputError

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "FP8_BLOCK",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "NVFP4_SCALE_2_DIVISOR",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e8m0",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "encode_e2m1",
    "encode_e4m3",
    "encode_e8m0",
    "pack_e2m1",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "unpack_e2m1",
]

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""Value of each E2M1 code 0..15 (bit 3 = sign)."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_BLOCK = 128
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
NVFP4_SCALE_2_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688: weight_scale_2 = amax / 2688

ScaleFormat = Literal["e8m0", "ue8m0", "float32"]

DECODE_DTYPES = (torch.float32, torch.float64)
PACKED_DTYPES = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2)
E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
E4M3_DTYPES = (torch.uint8, torch.float8_e4m3fn)

# Midpoints between consecutive E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# --------------------------------------------------------------------------------------------
# Lookup tables (built once per dtype and device from the format definitions)
# --------------------------------------------------------------------------------------------


def _e4m3_value(byte: int) -> float:
    """Value of one E4M3FN byte from its bit fields."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:  # subnormal: m/8 * 2^(1-7)
        return sign * math.ldexp(mantissa / 8, -6)
    return sign * math.ldexp(1 + mantissa / 8, exponent - 7)


@functools.cache
def _e4m3_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor([_e4m3_value(b) for b in range(256)], dtype=dtype, device=device)


@functools.cache
def _e8m0_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    values = [math.ldexp(1.0, b - E8M0_BIAS) for b in range(255)] + [math.nan]
    return torch.tensor(values, dtype=dtype, device=device)


@functools.cache
def _e2m1_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a uint8 index of any shape (index_select on the flat view is the fast
    gather on CPU; int32 indices halve the index memory)."""
    return table.index_select(0, index.reshape(-1).int()).view(index.shape)


def _check_decode_dtype(dtype: torch.dtype) -> None:
    if dtype not in DECODE_DTYPES:
        raise InputError(f"dtype: expected float32 or float64 for a decode, got {dtype}")


def _check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise InputError(f"dtype: expected one of ({names}), got {dtype}")


def _as_bytes(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Reinterpret a 1-byte tensor as uint8 (bit view, never a numeric cast)."""
    check_dtype(name, t, allowed)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# --------------------------------------------------------------------------------------------
# Scalar formats
# --------------------------------------------------------------------------------------------


def decode_e4m3(t: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3FN bytes -> values.  t: (...) uint8 raw bytes or float8_e4m3fn; returns (...) dtype.

    NaN bytes (0x7F, 0xFF) decode to NaN; 0x80 to -0.0.
    """
    _check_decode_dtype(dtype)
    raw = _as_bytes("t", t, E4M3_DTYPES)
    return _lookup(_e4m3_table(dtype, raw.device), raw)


def _round_to_odd_float32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounding to odd: truncate, then set the last bit if anything was lost.

    Rounding to odd at >= 2 extra bits of precision lets a later round-to-nearest-even to a
    narrower format give the correctly rounded result (no double-rounding error).
    """
    nearest = x.to(torch.float32)
    too_far = nearest.to(torch.float64).abs() > x.abs()
    truncated = torch.where(too_far, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    inexact = truncated.to(torch.float64) != x
    return (truncated.view(torch.int32) | inexact.to(torch.int32)).view(torch.float32)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Values -> nearest E4M3FN (ties to even), saturating at +-448.  x: (...) float -> (...) e4m3.

    NaN stays NaN.  float64 input is correctly rounded (see the module docstring).
    """
    check_dtype("x", x, FLOAT_DTYPES)
    clamped = x.clamp(-E4M3_MAX, E4M3_MAX)
    if clamped.dtype == torch.float64:
        clamped = _round_to_odd_float32(clamped)
    return clamped.to(torch.float8_e4m3fn)


def decode_e2m1(codes: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (...) uint8 in 0..15 -> (...) values in ``dtype`` via :data:`E2M1_VALUES`.

    Codes above 15 raise :class:`InputError` (an unpacked byte, not a nibble, was passed).
    """
    _check_decode_dtype(dtype)
    check_dtype("codes", codes, (torch.uint8,))
    if codes.numel() and int(codes.max()) > 15:
        raise InputError(f"codes: expected E2M1 codes in 0..15, got max {int(codes.max())}")
    return _lookup(_e2m1_table(dtype, codes.device), codes)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Values -> nearest E2M1 code, ties to the even code, saturating at +-6.

    x: (...) float; returns (...) uint8 codes in 0..15.  Comparisons run in x's own precision
    (float32 at least), so the rounding is exact for every input.  NaN raises InputError.
    """
    check_dtype("x", x, FLOAT_DTYPES)
    if bool(torch.isnan(x).any()):
        raise InputError(f"x: E2M1 has no NaN, found {int(torch.isnan(x).sum())} NaN values")
    xf = x.to(compute_dtype(x.dtype))
    magnitude = xf.abs().clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=xf.dtype, device=xf.device)
    # Index of the first midpoint >= magnitude = number of midpoints strictly below it: nearest
    # magnitude code, with an exact tie sent to the lower code.
    code = torch.bucketize(magnitude, midpoints, out_int32=True)  # (...) in 0..7
    # Lower code odd at a tie (0.75, 1.75, 3.5): the even neighbour is the one above.
    at_midpoint = magnitude == midpoints[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = code + (at_midpoint & (code % 2 == 1)).to(code.dtype)
    sign = torch.signbit(xf).to(code.dtype) << 3
    return (sign | code).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) uint8 codes -> (..., K/2) uint8: element 2j in the low nibble, 2j+1 in the high."""
    check_dtype("codes", codes, (torch.uint8,))
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise InputError(f"codes: expected an even last dim K, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise InputError(f"codes: expected E2M1 codes in 0..15, got max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) packed bytes (uint8, int8 or float4_e2m1fn_x2) -> (..., K) uint8 codes."""
    raw = _as_bytes("packed", packed, PACKED_DTYPES)
    if raw.dim() == 0:
        raise InputError("packed: expected at least 1 dimension, got a 0-d tensor")
    low = raw & 0xF  # even elements
    high = raw >> 4  # odd elements
    return torch.stack((low, high), dim=-1).flatten(-2)  # (..., K/2, 2) -> (..., K)


def decode_e8m0(scale: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 bytes (uint8 raw or float8_e8m0fnu) (...) -> 2^(b-127) (...) in ``dtype``; 255 -> NaN."""
    _check_decode_dtype(dtype)
    raw = _as_bytes("scale", scale, E8M0_DTYPES)
    return _lookup(_e8m0_table(dtype, raw.device), raw)


def encode_e8m0(values: torch.Tensor) -> torch.Tensor:
    """Powers of two 2^k, k in [-127, 127], (...) float -> (...) uint8 bytes k + 127; NaN -> 255.

    Anything else (zero, negative, inf, not a power of two) raises InputError: E8M0 cannot
    represent it and a silent rounding would hide a bug upstream.
    """
    check_dtype("values", values, FLOAT_DTYPES)
    v = values.to(compute_dtype(values.dtype))
    is_nan = torch.isnan(v)
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    k = exponent.to(torch.int32) - 1
    ok = is_nan | ((mantissa == 0.5) & (k >= -E8M0_BIAS) & (k <= E8M0_BIAS))
    if not bool(ok.all()):
        bad = v[~ok].flatten()[:4].tolist()
        raise InputError(
            f"values: expected powers of two in [2^-127, 2^127] or NaN, got e.g. {bad} "
            f"({int((~ok).sum())} of {v.numel()} invalid)"
        )
    byte = torch.where(is_nan, torch.full_like(k, E8M0_NAN), k + E8M0_BIAS)
    return byte.to(torch.uint8)


# --------------------------------------------------------------------------------------------
# Shared helpers of the block formats
# --------------------------------------------------------------------------------------------


def _mul_block_scale_(values: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> None:
    """In place: values (..., N, K) *= scale (..., ceil(N/rows), ceil(K/cols)) tile by tile."""
    n, k = values.shape[-2:]
    if rows > 1:  # the scale is small: repeat it along rows, keep columns as a view
        scale = scale.repeat_interleave(rows, dim=-2)[..., :n, :]  # (..., N, kb)
    full_blocks = k // cols
    k_full = full_blocks * cols
    # Splitting the unit-stride last dim is always a view, even of a column slice.
    values[..., :k_full].unflatten(-1, (full_blocks, cols)).mul_(scale[..., :full_blocks, None])
    if k_full < k:  # partial last tile
        values[..., k_full:].mul_(scale[..., full_blocks:])


def _block_amax(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(N, K) -> (ceil(N/rows), ceil(K/cols)) max |w| per tile; zero padding leaves it unchanged."""
    n, k = w.shape
    nb, kb = -(-n // rows), -(-k // cols)
    padded = torch.nn.functional.pad(w.abs(), (0, kb * cols - k, 0, nb * rows - n))
    return padded.view(nb, rows, kb, cols).amax(dim=(1, 3))


def _expand_tiles(scale: torch.Tensor, rows: int, cols: int, n: int, k: int) -> torch.Tensor:
    """(nb, kb) -> (N, K) scale of each element (used by the quantizers only)."""
    return scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


def _check_weight(w: torch.Tensor, k_multiple: int = 1) -> None:
    check_dtype("w", w, FLOAT_DTYPES)
    check_ndim("w", w, 2)
    if w.shape[1] % k_multiple:
        raise InputError(
            f"w: expected the last dim K to be a multiple of {k_multiple}, got shape {tuple(w.shape)}"
        )
    check_finite("w", w)


def _check_packed(packed: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """Returns the uint8 view and K; K/2 must be a multiple of block/2."""
    raw = _as_bytes("packed", packed, PACKED_DTYPES)
    if raw.dim() < 2:
        raise InputError(f"packed: expected shape (..., N, K/2), got {tuple(raw.shape)}")
    if raw.shape[-1] % (block // 2):
        raise InputError(
            f"packed: expected last dim K/2 to be a multiple of {block // 2} (K a multiple of "
            f"{block}), got shape {tuple(raw.shape)}"
        )
    return raw, 2 * raw.shape[-1]


# --------------------------------------------------------------------------------------------
# FP8 block (128 x 128)
# --------------------------------------------------------------------------------------------


def _ceil_log2_ratio(amax: torch.Tensor, denom: float) -> torch.Tensor:
    """Smallest integer k with amax <= denom * 2^k, for amax > 0 (float64) and denom = 448.

    ratio = m * 2^e with m in [0.5, 1): ceil(log2 ratio) is e - 1 when m == 0.5, else e.  The
    rounded division cannot land on a power of two it should not: 448 = 1.75 * 2^8, so a float64
    one ulp away from 448 * 2^k divides to >= 0.57 ulp away from 2^k and rounds away from it.
    """
    mantissa, exponent = torch.frexp(amax / denom)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def _e8m0_bytes_for_exponent(k_exp: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Block scale exponents -> E8M0 bytes: all-zero blocks get 2^0, underflow clamps to 2^-127,
    overflow (reachable only from float64 input) is an error."""
    k_exp = torch.where(amax == 0, torch.zeros_like(k_exp), k_exp)  # all-zero block -> 1.0
    k_exp = k_exp.clamp(min=-E8M0_BIAS)
    if bool((k_exp > E8M0_BIAS).any()):
        raise InputError(
            f"w: block amax {float(amax.max())} needs an E8M0 scale above 2^127 "
            "(only reachable with float64 input)"
        )
    return (k_exp + E8M0_BIAS).to(torch.uint8)


def quantize_fp8_block(
    w: torch.Tensor, *, scale_fmt: ScaleFormat = "e8m0", block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q (N, K) float8_e4m3fn, scale (ceil(N/block), ceil(K/block))).

    The scale is float8_e8m0fnu for ``scale_fmt="e8m0"``/``"ue8m0"`` and float32 for
    ``"float32"``; ``w ~= float(q) * scale`` tile by tile.  Choices: module docstring.
    """
    _check_weight(w)
    if scale_fmt not in ("e8m0", "ue8m0", "float32"):
        raise InputError(f"scale_fmt: expected 'e8m0', 'ue8m0' or 'float32', got {scale_fmt!r}")
    if not isinstance(block, int) or block < 1:
        raise InputError(f"block: expected a positive int, got {block!r}")
    n, k = w.shape
    cd = compute_dtype(w.dtype)
    amax = _block_amax(w.to(cd), block, block)  # (nb, kb)
    if scale_fmt == "float32":
        scale = amax.to(torch.float32) / E4M3_MAX
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # all-zero / underflow
        stored = scale
    else:
        k_exp = _ceil_log2_ratio(amax.to(torch.float64), E4M3_MAX)
        scale_bytes = _e8m0_bytes_for_exponent(k_exp, amax)
        scale = decode_e8m0(scale_bytes, dtype=torch.float64)  # exact powers of two
        stored = scale_bytes.view(torch.float8_e8m0fnu)
    per_element = _expand_tiles(scale.to(cd), block, block, n, k)  # (N, K)
    if scale_fmt == "float32":
        return _encode_e4m3_quotient(w, per_element), stored
    return encode_e4m3(w.to(cd) / per_element), stored  # exact division by a power of two


def _encode_e4m3_quotient(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Correctly rounded e4m3 of the exact quotient ``w / scale`` (ties to even, saturating).

    w (...) float, scale (...) positive finite float32 values.  The float64 quotient brackets the
    exact one between two adjacent e4m3 magnitudes ``lo < hi``; which one is nearer is decided
    by comparing ``|w|`` with ``mid * scale``, ``mid = (lo + hi) / 2``: mid has at most 5
    significant bits and the scale 24, so that product is exact in float64, and so is the
    comparison for every input dtype (float64 included, whose quotient can round onto a midpoint).
    """
    w64, s64 = w.to(torch.float64), scale.to(torch.float64)
    mag = (w64 / s64).abs().clamp(max=E4M3_MAX)
    table = _e4m3_table(torch.float64, w.device)
    nearest = encode_e4m3(mag).view(torch.uint8).long()  # 0..0x7E
    lo = torch.where(table[nearest] > mag, nearest - 1, nearest)
    hi = (lo + 1).clamp(max=0x7E)
    mid_times_s = (table[lo] + table[hi]) / 2 * s64  # exact (see above)
    above = w64.abs() > mid_times_s
    tie = w64.abs() == mid_times_s
    byte = torch.where(above | (tie & (lo % 2 == 1)), hi, lo)  # odd lo at a tie: hi is even
    byte = byte | (torch.signbit(w64).long() << 7)
    return byte.to(torch.uint8).view(torch.float8_e4m3fn)


def dequantize_fp8_block(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block: int = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q (..., N, K) float8_e4m3fn (or uint8 bytes) x scale (..., ceil(N/b), ceil(K/b)) -> (..., N, K).

    ``scale`` is float32 (multiplied as is), float8_e8m0fnu or uint8 (raw E8M0 bytes).
    """
    _check_out_dtype(dtype)
    if not isinstance(block, int) or block < 1:
        raise InputError(f"block: expected a positive int, got {block!r}")
    check_dtype("q", q, E4M3_DTYPES)
    check_dtype("scale", scale, (torch.float32, *E8M0_DTYPES))
    if q.dim() < 2:
        raise InputError(f"q: expected shape (..., N, K), got {tuple(q.shape)}")
    n, k = q.shape[-2:]
    check_shape("scale", scale, (*q.shape[:-2], -(-n // block), -(-k // block)))
    cd = compute_dtype(dtype)
    out = decode_e4m3(q, dtype=cd)  # (..., N, K)
    s = scale.to(cd) if scale.dtype == torch.float32 else decode_e8m0(scale, dtype=cd)
    _mul_block_scale_(out, s, block, block)
    return out.to(dtype)


# --------------------------------------------------------------------------------------------
# MXFP4 (E2M1 + E8M0 per 32)
# --------------------------------------------------------------------------------------------


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float, K % 32 == 0 -> (packed (N, K/2) uint8, scale (N, K/32) uint8 E8M0 bytes)."""
    _check_weight(w, MXFP4_BLOCK)
    n, k = w.shape
    cd = compute_dtype(w.dtype)
    blocks = w.to(cd).view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)  # (N, K/32, 32)
    amax = blocks.abs().amax(dim=-1)  # (N, K/32)
    _, exponent = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    k_exp = exponent.to(torch.int32) - 1 - 2  # - emax(E2M1)
    scale_bytes = _e8m0_bytes_for_exponent(k_exp, amax)
    scale = decode_e8m0(scale_bytes, dtype=cd)  # exact powers of two
    codes = encode_e2m1(blocks / scale[..., None]).view(n, k)
    return pack_e2m1(codes), scale_bytes


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed (..., N, K/2) x scale (..., N, K/32) E8M0 (uint8 bytes or float8_e8m0fnu) -> (..., N, K)."""
    _check_out_dtype(dtype)
    raw, k = _check_packed(packed, MXFP4_BLOCK)
    check_dtype("scale", scale, E8M0_DTYPES)
    check_shape("scale", scale, (*raw.shape[:-1], k // MXFP4_BLOCK))
    cd = compute_dtype(dtype)
    out = decode_e2m1(unpack_e2m1(raw), dtype=cd)  # (..., N, K)
    _mul_block_scale_(out, decode_e8m0(scale, dtype=cd), 1, MXFP4_BLOCK)
    return out.to(dtype)


# --------------------------------------------------------------------------------------------
# NVFP4 (E2M1 + E4M3 per 16 + float32 per tensor)
# --------------------------------------------------------------------------------------------


def _weight_scale_2(w: torch.Tensor, weight_scale_2: float | torch.Tensor | None) -> torch.Tensor:
    if weight_scale_2 is None:
        ws2 = w.abs().amax().to(torch.float32) / NVFP4_SCALE_2_DIVISOR
        return torch.where(ws2 == 0, torch.ones_like(ws2), ws2)  # all-zero weight
    if isinstance(weight_scale_2, torch.Tensor):
        check_dtype("weight_scale_2", weight_scale_2, FLOAT_DTYPES)
        if weight_scale_2.numel() != 1:
            raise InputError(
                f"weight_scale_2: expected one value, got shape {tuple(weight_scale_2.shape)}"
            )
        ws2 = weight_scale_2.detach().reshape(()).to(device=w.device, dtype=torch.float32)
    else:
        ws2 = torch.tensor(float(weight_scale_2), dtype=torch.float32, device=w.device)
    if not (math.isfinite(float(ws2)) and float(ws2) > 0):
        raise InputError(f"weight_scale_2: expected a finite positive value, got {float(ws2)}")
    return ws2


def quantize_nvfp4(
    w: torch.Tensor, weight_scale_2: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) float, K % 16 == 0 -> (packed (N, K/2) uint8, block_scale (N, K/16) float8_e4m3fn,
    weight_scale_2 () float32).  ``weight_scale_2`` defaults to amax / 2688 (ModelOpt).
    """
    _check_weight(w, NVFP4_BLOCK)
    n, k = w.shape
    cd = compute_dtype(w.dtype)
    ws2 = _weight_scale_2(w, weight_scale_2)  # () float32
    blocks = w.to(cd).view(n, k // NVFP4_BLOCK, NVFP4_BLOCK)  # (N, K/16, 16)
    block_amax = blocks.abs().amax(dim=-1).to(torch.float32)  # (N, K/16)
    ratio = block_amax / (E2M1_MAX * ws2)
    ratio = torch.where(ratio == 0, torch.ones_like(ratio), ratio).clamp(min=2.0**-9)
    block_scale = encode_e4m3(ratio)  # (N, K/16)
    denom = block_scale.to(torch.float32) * ws2  # (N, K/16) float32, as ModelOpt rounds it
    if bool((denom == 0).any()):
        raise InputError(
            f"weight_scale_2: {float(ws2)} is so small that block_scale * weight_scale_2 "
            "underflows float32"
        )
    codes = encode_e2m1(blocks / denom.to(cd)[..., None]).view(n, k)
    return pack_e2m1(codes), block_scale, ws2


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """packed (..., N, K/2) x block_scale (..., N, K/16) e4m3 x weight_scale_2 -> (..., N, K).

    ``weight_scale_2`` is float32 of shape () (one scale for everything) or ``(...)``, the
    leading batch dims (one per stacked expert).  Result = (code * block_scale) * weight_scale_2.
    """
    _check_out_dtype(dtype)
    raw, k = _check_packed(packed, NVFP4_BLOCK)
    check_dtype("block_scale", block_scale, (torch.float8_e4m3fn,))
    check_shape("block_scale", block_scale, (*raw.shape[:-1], k // NVFP4_BLOCK))
    check_dtype("weight_scale_2", weight_scale_2, (torch.float32,))
    lead = tuple(raw.shape[:-2])
    if tuple(weight_scale_2.shape) not in ((), lead):
        raise InputError(
            f"weight_scale_2: expected shape () or {lead} (the leading dims of packed), "
            f"got {tuple(weight_scale_2.shape)}"
        )
    cd = compute_dtype(dtype)
    out = decode_e2m1(unpack_e2m1(raw), dtype=cd)  # (..., N, K)
    _mul_block_scale_(out, decode_e4m3(block_scale, dtype=cd), 1, NVFP4_BLOCK)  # exact
    out.mul_(weight_scale_2.to(cd)[..., None, None])
    return out.to(dtype)
