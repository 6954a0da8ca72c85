"""RoPE and the elementwise q / kv paths of attention (Triton): what ``apply_rope``,
``q_head_norm_rope`` and ``kv_norm_rope`` run.  The math: docs/semantics.md, "Attention with
sinks" ("Query", "Key/value latent", "RoPE") and "Activation and KV quantization".

One kernel, three uses.  Rows of width D, viewed as x (T, H, D) with row strides
(``stride_t``, ``stride_h``; unit stride along D), out (T, H, D) likewise (``ostride_t``,
``ostride_h``; contiguous, or x itself for an in-place rotation), positions (T,) int32 / int64,
freqs (Dr/2,) bf16 / fp32.  Columns ``[0, DN)`` are the non-rotary dims,
``[DN, D)`` the Dr = D - DN rotary dims in interleaved pairs ``(x[DN+2i], x[DN+2i+1])``.

* ``apply_rope``: NORM 0, DN 0: rotate every pair of the row by ``pos * f_i`` (``-pos * f_i``
  with INVERSE).  x may be a strided view (the output's rope dims ``o[..., Dn:]``), and out
  the same view: every stored pair is computed from the values loaded at its own addresses,
  and the programs' rows are disjoint when out's rows do not overlap (optimized/rope.py checks).
* ``q_head_norm_rope``: NORM 1 on q (T, H, Dh): the unweighted per-head RMS norm with the
  reference's rounding after each op (square, mean, rsqrt, product, each rounded to the
  activation dtype), then RoPE of the last Dr dims.
* ``kv_norm_rope``: NORM 2 on kv (T, 1, Dh): RMSNorm with the kv_norm weight (fp32 statistics;
  the weight in fp32 and one rounding, or with VLLM_ORDER the normalized row rounded first and
  the weight multiplied in the activation dtype), RoPE of the last Dr dims, and with FP8 the
  non-rotary dims rounded through e4m3 with one power-of-two scale per QBLOCK (64) values.

Schedule.  One program per (block of BLOCK_T tokens, block of BLOCK_H heads); it holds the
non-rotary part as a (BLOCK_T, BLOCK_H, DN_P2) tile and the rotary part as a
(BLOCK_T, BLOCK_H, DR_P2) tile that it splits into its pairs.  cos and sin are computed once
per token in fp32 and shared by the program's heads.  Every value depends on its own row only
(the norm reduces within a row, in an order fixed by the tile shape, which depends on H and D
only), so every schedule is batch invariant.

Numerics.  The angle is ``fp32(pos) * f`` rounded to fp32, as the reference forms it for bf16 /
fp32 inputs; cos / sin are libdevice's ``cosf`` / ``sinf`` on the GPU (full range reduction,
a few ulps, as torch's CUDA cos / sin) and numpy's under the interpreter; torch's CPU cos / sin
(the reference on CPU) may differ from either by an ulp, and fp32 contraction of
``a * cos - b * sin`` into an FMA by another: the declared tolerances cover that.  The rsqrt of
both norms is ``1 / sqrt`` with both operations correctly rounded, as torch computes it on CPU.
Under the interpreter every rounding to bf16 goes through :func:`rne_bf16_if_interpreted` (its
conversion truncates).

Bytes per call (V4-Flash: H 64, Dh 512, Dr 64, bf16): q_head_norm_rope reads and writes
T * H * Dh * 2 B each (64 KiB each per token; 512 MiB in all at T 4096), kv_norm_rope
T * Dh * 2 B each plus the weight, apply_rope on the output's rope dims T * H * Dr * 2 B each
(8 KiB each per token), plus positions and freqs.  Nothing is re-read from HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import (
    INTERPRET,
    TritonLaunch,
    cdiv,
    next_pow2,
    rne_bf16_if_interpreted,
    triton_launch,
)

__all__ = [
    "NORM_HEAD",
    "NORM_NONE",
    "NORM_RMS",
    "RopeSchedule",
    "norm_rope_triton",
    "rope_launch",
    "rope_schedule",
]

NORM_NONE, NORM_HEAD, NORM_RMS = 0, 1, 2


@triton.jit
def _round_to(v, ty: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``v`` rounded to nearest-even ``ty`` and back to fp32 (a no-op for fp32)."""
    if ty == tl.float32:
        return v
    return rne_bf16_if_interpreted(v, ty, INTERP).to(ty).to(tl.float32)


@triton.jit
def _div_rn(a, b: tl.constexpr):
    """``a / b`` correctly rounded (Triton's ``/`` is the approximate ``div.full.f32``)."""
    return tl.math.div_rn(a, tl.full(a.shape, b, tl.float32))


@triton.jit
def _rsqrt_rn(v):
    """``1 / sqrt(v)`` with both operations correctly rounded (torch's CPU rsqrt)."""
    return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.math.sqrt_rn(v))


@triton.jit
def _e4m3_block_roundtrip(y, BT: tl.constexpr, BH: tl.constexpr, N: tl.constexpr,
                          QBLOCK: tl.constexpr):  # fmt: skip
    """Round ``y (BT, BH, N)`` fp32 through e4m3 with one power-of-two scale per QBLOCK values
    along N (dsv4mtp/quant.py: ``2**ceil(log2(max(amax, 1e-4) / 448))``).  Lanes past the row
    hold zeros, so they never raise a block's amax.  A block holding a NaN or an infinity comes
    back all NaN, as the reference's (its scale is then NaN or infinite)."""
    blocks = tl.reshape(y, (BT, BH, N // QBLOCK, QBLOCK))
    mag = tl.abs(blocks)
    bad = tl.max(((mag != mag) | (mag == float("inf"))).to(tl.int32), axis=3) > 0
    amax = tl.max(mag, axis=3)
    # 2**ceil(log2(amax / 448)) from the exponent bits: exact (a rounded log2 could miss by
    # one); the division correctly rounded as torch's, the others multiplications by exact
    # powers of two
    r = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
    rb = r.to(tl.int32, bitcast=True)
    ex = ((rb >> 23) & 0xFF) - 127
    ex = tl.where((rb & 0x7FFFFF) != 0, ex + 1, ex)
    scale = ((ex + 127) << 23).to(tl.float32, bitcast=True)[:, :, :, None]
    inv_scale = ((127 - ex) << 23).to(tl.float32, bitcast=True)[:, :, :, None]
    v = tl.minimum(tl.maximum(blocks * inv_scale, -448.0), 448.0)
    vb = v.to(tl.int32, bitcast=True)
    ve = tl.maximum(((vb >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals share 2**-6's step
    ulp = ((ve - 3 + 127) << 23).to(tl.float32, bitcast=True)
    q = v * ((3 - ve + 127) << 23).to(tl.float32, bitcast=True)  # v / ulp; |q| < 16
    q = (q + 12582912.0) - 12582912.0  # round half to even at integer precision
    q = tl.where(bad[:, :, :, None], float("nan"), q * ulp * scale)
    return tl.reshape(q, (BT, BH, N))


@triton.jit
def norm_rope_kernel(
    x_ptr,
    w_ptr,
    pos_ptr,
    freq_ptr,
    out_ptr,
    T,
    H,
    stride_t,
    stride_h,
    ostride_t,
    ostride_h,
    eps,
    D: tl.constexpr,
    DN: tl.constexpr,
    DN_P2: tl.constexpr,
    DR_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NORM: tl.constexpr,
    VLLM_ORDER: tl.constexpr,
    FP8: tl.constexpr,
    QBLOCK: tl.constexpr,
    INVERSE: tl.constexpr,
    INTERP: tl.constexpr,
):
    o_ty = out_ptr.dtype.element_ty
    HALF: tl.constexpr = (D - DN) // 2
    HALF_P2: tl.constexpr = DR_P2 // 2
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH,)
    t64 = t.to(tl.int64)
    rows = (t < T)[:, None] & (h < H)[None, :]  # (BT, BH)
    row_in = t64[:, None] * stride_t + h[None, :].to(tl.int64) * stride_h
    row_out = t64[:, None] * ostride_t + h[None, :].to(tl.int64) * ostride_h
    rows3 = rows[:, :, None]

    # the rotary tile, split into its pairs (a, b) = (x[DN + 2i], x[DN + 2i + 1])
    cr = tl.arange(0, DR_P2)
    rmask = rows3 & (cr < D - DN)[None, None, :]
    xr = tl.load(x_ptr + row_in[:, :, None] + DN + cr[None, None, :], mask=rmask, other=0.0)
    a, b = tl.split(tl.reshape(xr.to(tl.float32), (BLOCK_T, BLOCK_H, HALF_P2, 2)))
    if DN > 0:
        cn = tl.arange(0, DN_P2)
        nmask = rows3 & (cn < DN)[None, None, :]
        xn = tl.load(x_ptr + row_in[:, :, None] + cn[None, None, :], mask=nmask, other=0.0)
        xn = xn.to(tl.float32)

    if NORM == 1:
        # q's per-head norm as the reference evaluates it in the activation dtype: square,
        # mean and product each rounded; the rsqrt in fp32, rounded once
        ss = tl.sum(_round_to(a * a, o_ty, INTERP), axis=2)
        ss += tl.sum(_round_to(b * b, o_ty, INTERP), axis=2)
        if DN > 0:
            ss += tl.sum(_round_to(xn * xn, o_ty, INTERP), axis=2)
        ms = _round_to(_div_rn(ss, D), o_ty, INTERP)
        r = _round_to(_rsqrt_rn(ms + eps), o_ty, INTERP)[:, :, None]  # (BT, BH, 1)
        a = _round_to(a * r, o_ty, INTERP)
        b = _round_to(b * r, o_ty, INTERP)
        if DN > 0:
            xn = _round_to(xn * r, o_ty, INTERP)
    if NORM == 2:
        # RMSNorm (fp32 statistics), the weight per column
        ss = tl.sum(a * a, axis=2) + tl.sum(b * b, axis=2)
        if DN > 0:
            ss += tl.sum(xn * xn, axis=2)
        r = _rsqrt_rn(_div_rn(ss, D) + eps)[:, :, None]
        wr = tl.load(w_ptr + DN + cr, mask=cr < D - DN, other=0.0).to(tl.float32)
        wa, wb = tl.split(tl.reshape(wr, (HALF_P2, 2)))
        if VLLM_ORDER:
            wa = _round_to(wa, o_ty, INTERP)
            wb = _round_to(wb, o_ty, INTERP)
            a = _round_to(_round_to(a * r, o_ty, INTERP) * wa[None, None, :], o_ty, INTERP)
            b = _round_to(_round_to(b * r, o_ty, INTERP) * wb[None, None, :], o_ty, INTERP)
        else:
            a = _round_to(wa[None, None, :] * (a * r), o_ty, INTERP)
            b = _round_to(wb[None, None, :] * (b * r), o_ty, INTERP)
        if DN > 0:
            wn = tl.load(w_ptr + cn, mask=cn < DN, other=0.0).to(tl.float32)[None, None, :]
            if VLLM_ORDER:
                wn = _round_to(wn, o_ty, INTERP)
                xn = _round_to(_round_to(xn * r, o_ty, INTERP) * wn, o_ty, INTERP)
            else:
                xn = _round_to(wn * (xn * r), o_ty, INTERP)

    # RoPE: angle = fp32(pos) * f in fp32, cos / sin once per token, shared by the heads
    pos = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)  # (BT,)
    i = tl.arange(0, HALF_P2)
    f = tl.load(freq_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
    angle = pos[:, None] * f[None, :]  # (BT, HALF_P2)
    if INVERSE:
        angle = -angle
    c = tl.cos(angle)[:, None, :]
    s = tl.sin(angle)[:, None, :]
    ra = a * c - b * s
    rb = a * s + b * c
    yr = tl.reshape(tl.join(ra, rb), (BLOCK_T, BLOCK_H, DR_P2))
    yr = rne_bf16_if_interpreted(yr, o_ty, INTERP)
    tl.store(out_ptr + row_out[:, :, None] + DN + cr[None, None, :], yr.to(o_ty), mask=rmask)
    if DN > 0:
        if FP8:
            xn = _e4m3_block_roundtrip(xn, BLOCK_T, BLOCK_H, DN_P2, QBLOCK)
        xn = rne_bf16_if_interpreted(xn, o_ty, INTERP)
        tl.store(out_ptr + row_out[:, :, None] + cn[None, None, :], xn.to(o_ty), mask=nmask)


@dataclass(frozen=True)
class RopeSchedule:
    """Tile of :func:`norm_rope_kernel`: BLOCK_T tokens x BLOCK_H heads per program (powers of
    two), and its warps.  Every schedule computes the same function up to the fp32 order of the
    norm's sum of squares, which the tile fixes; the bits of a row do not depend on the other
    rows of the call under any schedule."""

    block_t: int
    block_h: int
    num_warps: int = 4


# About this many elements per program for the tiles that are not rope_schedule's one-warp tile: an
# output-rope program holds 64 heads of 64 (55 registers on sm_90).  A program of several tokens
# computes cos / sin per token row (libdevice's sinf / cosf inlined per row), which costs registers:
# a kv program of 8 tokens of 512 at 4 warps needs 255 registers and spills, so multi-token tiles
# take half the elements and 8 warps (kv: 4 tokens, 101 registers, no spill).
# bench/sm90_resources.py --rope prints these counts.  The interpreter pays per operation, not per
# element (~30 ms per program): there one program takes up to 64 Ki elements, so a CPU-tier call is
# one or two programs.
_TILE_ELEMENTS = 65536 if INTERPRET else 4096


def rope_schedule(H: int, D: int) -> RopeSchedule:
    """The default tile for rows of width D, H rows per token.  On the GPU, rows of 256 to 512
    elements, several per token (q: 64 heads of 512 on V4-Flash), take two heads of one token
    per one-warp program: 36 fp32 values per lane and 89 registers at 512 (sm_90), the most
    programs in flight, each a short reduction; on the H200 185.5 / 26.6 / 4.6 / 3.1 / 3.0 us at
    T 4096 / 512 / 64 / 8 / 1 against 404.2 / 53.9 / 9.6 / 5.3 / 4.6 for 8 heads on 4 warps
    (bench/results/attention-h200.md, "The q norm + RoPE on one warp"; wider rows were not
    measured and keep the rule below).  Otherwise heads first, then tokens, to about
    :data:`_TILE_ELEMENTS` elements.  Reads H and D only, never T."""
    width = next_pow2(D)
    # not under the interpreter, which pays ~30 ms per program: there one program takes many rows
    if H >= 2 and 256 <= width <= 512 and not INTERPRET:
        return RopeSchedule(1, 2, 1)
    block_h = min(next_pow2(H), max(1, _TILE_ELEMENTS // width))
    block_t = max(1, _TILE_ELEMENTS // (width * block_h))
    if block_t > 1 and not INTERPRET:
        return RopeSchedule(max(1, block_t // 2), block_h, 8)
    return RopeSchedule(block_t, block_h, 4)


def rope_launch(
    D: int, DN: int, fp8: bool, norm: int, vllm_order: bool, inverse: bool, sched: RopeSchedule
) -> TritonLaunch:
    qblock = 64
    dn_p2 = next_pow2(DN) if DN else 1
    if fp8:
        dn_p2 = max(dn_p2, qblock)
    return triton_launch(
        norm_rope_kernel,
        D=D,
        DN=DN,
        DN_P2=dn_p2,
        DR_P2=max(2, next_pow2(D - DN)),
        BLOCK_T=sched.block_t,
        BLOCK_H=sched.block_h,
        NORM=norm,
        VLLM_ORDER=vllm_order,
        FP8=fp8,
        QBLOCK=qblock,
        INVERSE=inverse,
        INTERP=INTERPRET,
        num_warps=sched.num_warps,
    )


_LAUNCHES: dict[tuple[object, ...], TritonLaunch] = {}


def norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    out: torch.Tensor,
    *,
    rope_dim: int,
    norm: int = NORM_NONE,
    eps: float = 0.0,
    vllm_order: bool = False,
    fp8: bool = False,
    inverse: bool = False,
    schedule: RopeSchedule | None = None,
) -> torch.Tensor:
    """Launch :func:`norm_rope_kernel` over x (T, H, D) into out (T, H, D), both with unit
    stride along D (out may be x itself: every stored element is computed from the values
    loaded at its own addresses; out's rows must not overlap); the last ``rope_dim`` columns
    are rotated.  ``weight`` (D,)
    contiguous, for ``norm=NORM_RMS`` only; positions (T,) and freqs (rope_dim/2,)
    contiguous."""
    T, H, D = x.shape
    if T == 0 or H == 0:
        return out
    DN = D - rope_dim
    sched = schedule or rope_schedule(H, D)
    key = (D, DN, fp8, norm, vllm_order, inverse, sched)
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = rope_launch(*key)
    grid = (cdiv(T, sched.block_t), cdiv(H, sched.block_h))
    w = weight if weight is not None else freqs
    launch(
        grid, x, w, positions, freqs, out, T, H, x.stride(0), x.stride(1), out.stride(0),
        out.stride(1), float(eps),
    )  # fmt: skip
    return out
