"""Grouped expert GEMMs with in-register weight decode, the top-k combine and activation quant.

Layout (what ``optimized/moe.py``'s ``pack_moe`` builds; docs/semantics.md, "MoE: router,
clamped SwiGLU, shared expert"): per expert e, ``w13`` rows are [gate (I) ; up (I)] of D inputs,
``w2`` rows are D outputs of I inputs, exactly as the checkpoint stores them:

======== ============================== =========================================
FMT      codes (E, N, ...)              scales
======== ============================== =========================================
0 bf16   (E, N, K) bf16                 none
1 fp8    (E, N, K) e4m3 bytes (uint8)   (E, N/128, K/128) fp32 (e8m0 widened)
2 mxfp4  (E, N, K/2) uint8, low nibble  (E, N, K/32) e8m0 bytes
         = even column
3 nvfp4  (E, N, K/2) uint8              (E, N, K/16) e4m3 bytes
======== ============================== =========================================

plus ``gscale (E, 3)`` fp32: the per-expert global scales of gate, up and down (NVFP4's
``weight_scale_2``, or the folded fc1_alpha twice and fc2_alpha; ones otherwise), applied to the
fp32 accumulator.

MXFP4 experts are packed by default in the ``"tiles"`` layout (``TILED``; ``pack_moe``,
``mx_tiles``): the same shapes, the bytes reordered so that each (128-row, 128-column) block of
codes is one contiguous 8 KiB run (byte (r, b) of an expert at ((r // 128) * K/128 + b // 64) *
8192 + (r % 128) * 64 + b % 64) and its scales one 512-byte run (((r // 128) * K/128 + g // 4)
* 512 + (r % 128) * 4 + g % 4 for group g), with w13's rows interleaved first: packed row 2c is
gate column c, 2c + 1 up column c.  A K step of a 128-row tile is then one contiguous load
instead of 128 pieces of 64 bytes lying K/2 bytes apart, which capped the weight stream at
2.2-2.4 TB/s (bench/results/moe-h200.md, "The weight stream and the layout"); and the gate/up
kernel streams one set of rows, ``BLOCK_N`` interleaved gate and up rows (``BLOCK_N / 2``
columns of h), one accumulator split into g and u in the epilogue.  K steps are at most 128
columns there (one block).  The tiles layout always loads a whole step (``"mxstep"``; per-group
16-byte pieces of its 64-byte rows compile to plain loads without cp.async in Triton 3.6).

Decode.  An E2M1 nibble n goes into an fp16 bit pattern ``(n & 7) << 9 | (n & 8) << 12`` whose
value is exactly ``e2m1(n) * 2**-14`` (code 1 lands on fp16's subnormal 2**-15), widened to fp32
(a conversion: exact, never flushed) and multiplied by ``block_scale * 2**14``; the product has
at most 2 + 4 significant bits, so its bf16 rounding is exact and the bf16 tensor-core dot sees
the checkpoint's values.  E4M3 bytes (NVFP4 block scales, FP8 codes) decode the same way into
fp16 ``(b & 0x7f) << 7 | (b & 0x80) << 8`` = ``e4m3(b) * 2**-8``.  FP8 weights: the decoded
codes feed the dot and the fp32 128x128 block scale (times 2**8) multiplies the fp32 partial of
each 128-wide K block (fp32 scales are not exact in bf16).  FP4 codes are not interleaved in
registers: the dot runs as ``x[:, 0::2] @ lo^T + x[:, 1::2] @ hi^T``.

Kernels.  ``moe_gate_up_kernel``: grid (M blocks, cdiv(I, BLOCK_N)); one program computes
BLOCK_N gate and the same BLOCK_N up columns (tiles layout: grid (M blocks, cdiv(2I, BLOCK_N)),
BLOCK_N interleaved rows, BLOCK_N / 2 columns) for the BLOCK_M rows of one expert (rows from the
align kernel, or tokens 0..T-1 for the shared expert), applies the global scales, rounds g and u
to the activation dtype (as the reference's linear does), clamps (up both sides, gate from
above), ``h = silu(g) * u * routing weight`` in fp32 and stores h rounded to the activation
dtype.  ``moe_down_kernel``: grid (M blocks, cdiv(D, BLOCK_N)), ``y = h @ w2^T * down scale``,
stored in the activation dtype at the row's slot (t*K + k) of a (T*K, D) workspace.
``moe_reduce_kernel``: out[t] = sum of the valid slots k = 0..K-1 in slot order in fp32 (+ the
shared expert's row), one rounding; no atomics, so the result is deterministic.
Bytes per call: the codes and scales of every expert with a routed row, once per M block (once at
decode sizes), x and h from L2, workspace 2*T*K*D*itemsize (fp32 partials instead with a K split
or the Gluon GEMMs: 4*split*rows*N per GEMM).

Schedule (kernels/moe_schedule.py holds the knobs; ``moe_config`` the defaults).  S = T*K slots;
the align kernel pads each expert's rows to BLOCK_M, so NB = cdiv(S, BLOCK_M) + min(E, S) M
blocks are launched, those past the used ones exiting at once.  Grids at V4-Flash (E 256, top-6,
I 2048, D 4096), MXFP4 experts, default schedules: up to T 768 the routed GEMMs take 128-row
weight tiles (gate/up (NB, I/128 = 16), down (NB, D/128 = 32)), above 64-column tiles (32 and
64); active blocks = experts with a row (about 6 / 44 / 163 at T 1 / 8 / 64, a second block
for the few with more than 8 rows; at T 512 each of ~254 experts holds ~12 rows, one or two
16-row blocks), 2-3 per expert at T 4096 (~96 rows each, BLOCK_M 64); at T <= 2 the default
splits K four ways, at T <= 8 two ways (a third grid axis).  The table is the rows layout's;
in the default tiles layout the gate/up grid has 2I/128 = 32 N tiles of 128 interleaved rows
(twice the programs, each with half the bytes) at every T:

======  ========  ====  ===================  ===================  ================
T       BLOCK_M   NB    gate/up programs     down programs        shared (g/u, dn)
======  ========  ====  ===================  ===================  ================
1       8         7     448 (384 active)     896 (768 active)     128, 256
8       8         54    1728 (~1410 active)  3456 (~2820 active)  64, 128
64      8         304   4864 (~2640 active)  9728 (~5280 active)  128, 256
512     16        448   7168 (~4540 active)  14336 (~9090)        256, 512
4096    64        640   20480                40960                2048, 4096
======  ========  ====  ===================  ===================  ================

A gate/up program on rows streams BLOCK_N gate and BLOCK_N up rows over all of D (over D /
split_k with a split; on tiles BLOCK_N rows in all): at 64 rows MXFP4 2*64*(2048 B codes + 128 B scales) = 272 KB, FP8 2*64*4096 B =
512 KB (+ 4 KB scales); a down program BLOCK_N rows over I: MXFP4 68 KB, FP8 128 KB (twice
each at 128 rows).  Each K step (BLOCK_K = 128) re-loads the block's x rows
(gathered, from L2): the x traffic is NB * (I/BLOCK_N) * 2 * BLOCK_M * D * 2 B for gate/up,
~21 GB at T 4096.  x is read contiguously; without ``fp4_join`` its even and odd columns are
split in registers for the two half-K dots, with it the decoded halves are interleaved and one
dot runs.  At T 1 the shared expert runs on 128 + 256 programs (one M block, split 4).

Decode cost (instructions of the MXFP4 gate/up kernel's sm_90 SASS at 16 x 64 x 128 tiles, and
the H200's whole-moe time; bench/results/moe-h200.md).  ``decode="mxdot"`` (the MXFP4 default
up to T 768, :func:`_mx_groups_step`): Triton's ``dot_scaled`` upcasts the packed nibbles in the
dot operand's own registers and the e8m0 scale multiplies the fp32 partial of each 32-column
group: the gate/up loop takes 4.2 instructions per weight and thread at the default 8 x 128
swapped tiles against 6.2 for ``"asm"`` at 16 x 64 (both 3 programs per SM by registers;
``python bench/sm90_resources.py --moe``), and the whole moe 8-10 % less time at T 1-64, up to
45 % less at T 128-512 where it replaced 64-row tiles (bench/results/moe-h200.md, "The
group-scaled dot").  ``decode="mxstep"`` (the tiles layout's Triton path): the same dots on
the same operands (so the same bits), the step's (BLOCK_N, 64) code bytes loaded at once and
split into the four groups in registers; on the tiles layout the whole moe took 105.4 / 321.9
/ 1059.1 / 2609.3 us at T 1 / 8 / 64 / 512 against the rows layout's 112.5 / 379.9 / 1323.0 /
2973.4 us with ``"mxdot"`` (moe-h200.md, "The tiles layout"; on the rows layout ``"mxstep"``
itself was within 6 % of ``"mxdot"``, its registers 252 against 157 at T 64).  ``decode="asm"``
(every other format, and above T 768): PTX on
four codes at a time (``prmt`` into bf16x2 pairs, shift/mask into bf16 bit patterns, exact
``mul.rn.bf16x2`` by a power of two and by the group scale), about three instructions per
weight for FP4 (two for FP8), 1280 instructions for the kernel; ``"f16"``: and/shift/or into
an fp16 pattern, fp16 -> fp32, fp32 multiply by the group scale, fp32 -> bf16 (two
conversions per weight), 1952 instructions, the whole moe 1.3-1.8x slower than with
``"asm"`` at the same tiles (MXFP4, T 1 to 512); ``"bits"``: the fp32 pattern from integer
ops and selects, the bf16 taken as the product's high half, 2408 instructions, slower still.
All three give the same dot operands bit for bit.  The decode-size GEMMs are limited by
instruction issue, not HBM: a decode with fewer instructions was faster at every T.
``decode="gluon"`` (the default on the tiles layout up to T 1024, and above where the scales
fold) leaves these kernels: the routed GEMMs run as the Gluon kernels of
kernels/moe_gemm_gluon.py (mma_v2 on 8- to 32-row blocks with 3.0-3.6 instructions per weight
and no shared memory; wgmma with the decoded weights as its register operand on 64- and
128-row blocks, and on 32-row blocks with a wgmma tile where the scales fold: ``uses_wgmma``),
whose fp32 partials (split, rows, N) go through the split-K path's ``moe_swiglu_kernel`` and
``moe_reduce_kernel`` below, also unsplit, except the wgmma gate/up with one K split, which
applies the SwiGLU in its epilogue (:data:`WGMMA_SWIGLU_EPILOGUE`); without a compiled launch
(the interpreter) or outside their shapes they fall back to ``"mxstep"``.  The shared expert
of a prefill-sized call (bf16 weights, or FP8 with power-of-two block scales) runs on cuBLAS
(:func:`shared_expert_mm`).

Split-K (``split_k`` > 1): program (m, n, s) covers K slice s; gate/up stores fp32 partials
(split, NB*BLOCK_M, 2I) and ``moe_swiglu_kernel`` sums them in the order 0..split-1 before the
epilogue; down stores unscaled fp32 partials (split, rows, D) at the row's slot and the reduce
kernel forms each slot's row from them (split order, down scale, rounding) before the top-k sum.
No atomics: deterministic, batch invariant for a fixed schedule; the split changes the fp32
summation order only.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from dsv4mtp.errors import ConfigError

from ._launch import INTERPRET, rne_bf16_if_interpreted, triton_launch
from .decode import (
    _e2m1_f32,
    _e2m1_pair_bf16,
    _e2m1_times_2m14,
    _e4m3_bf16,
    _e4m3_f32,
    _e4m3_times_2m8,
)
from .linear import dequant_mm_selected, fp32_reduction, linear_dequant_mm
from .moe_common import jit_loop_bounds
from .moe_gemm_gluon import gluon_applies, moe_mx_gluon, uses_wgmma
from .moe_schedule import DECODES, GemmTile

__all__ = [
    "FMT_BF16",
    "FMT_FP8",
    "FMT_MXFP4",
    "FMT_NVFP4",
    "act_quant_triton",
    "moe_down_triton",
    "moe_gate_up_triton",
    "moe_reduce_triton",
    "shared_expert_mm",
    "shared_mm_selected",
]

FMT_BF16, FMT_FP8, FMT_MXFP4, FMT_NVFP4 = 0, 1, 2, 3
DECODE_F16, DECODE_BITS, DECODE_ASM, DECODE_MXDOT = 0, 1, 2, 3


@triton.jit
def _exact_to(w, ty: tl.constexpr, BITS: tl.constexpr):
    """fp32 ``w`` whose values are exact in ``ty`` -> ``ty``.  With BITS and bf16: the high
    half of the fp32 pattern (exact values need no rounding), no float conversion."""
    if BITS and ty == tl.bfloat16:
        return (w.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return w.to(ty)


@triton.jit
def _dot(a, b, acc, USE_F32: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:
        # numpy's BLAS (the interpreter's tl.dot) rounds a row by where it sits in the tile, so
        # a token's bits would depend on the batch (batch invariance fails on the CPU tier);
        # a broadcast product summed over K is row-independent (as kernels/linear.py's _dot)
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif USE_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dot_xw(x, w, USE_F32: tl.constexpr, SWAP: tl.constexpr, INTERP: tl.constexpr):
    """x (M, K) times w (N, K)^T in fp32: (M, N), or with SWAP computed as w @ x^T: (N, M)."""
    if SWAP:
        acc = tl.zeros((w.shape[0], x.shape[0]), dtype=tl.float32)
        return _dot(w, tl.trans(x), acc, USE_F32, INTERP)
    else:
        acc = tl.zeros((x.shape[0], w.shape[0]), dtype=tl.float32)
        return _dot(x, tl.trans(w), acc, USE_F32, INTERP)


@triton.jit
def _fp4_ptrs(w_base, n, k0, b, KDIM, TILED: tl.constexpr, STEP: tl.constexpr):
    """Pointers (len(n), len(b)) of the FP4 code bytes b (offsets inside the K step) of packed
    rows n for the K step at column k0 (a multiple of STEP <= 128): one expert's (N, KDIM / 2)
    bytes in the checkpoint's rows, or with TILED in the ``"tiles"`` layout's (128-row,
    64-byte) blocks (module doc).  The row part is loop-invariant (hoisted out of the K loop);
    the step part keeps its alignment visible to the compiler, so the loads stay 16-byte
    cp.async copies."""
    if TILED:
        row = (n // 128).to(tl.int64) * (KDIM * 64) + (n % 128) * 64
        inner = tl.multiple_of((k0 % 128) // 2, STEP // 2)
        return w_base + row[:, None] + ((k0 // 128) * 8192 + inner + b)[None, :]
    else:
        return w_base + n[:, None].to(tl.int64) * (KDIM // 2) + (k0 // 2 + b)[None, :]


@triton.jit
def _mx_scale_ptr(s_base, n, k0, KDIM, TILED: tl.constexpr):
    """Pointers (len(n),) of the e8m0 byte of packed rows n for K columns k0 .. k0+31 (the
    bytes of the next groups follow it, up to the end of k0's 128-column block in the tiles
    layout)."""
    if TILED:
        row = (n // 128).to(tl.int64) * (KDIM * 4) + (n % 128) * 4
        return s_base + row + ((k0 // 128) * 512 + (k0 % 128) // 32)
    else:
        return s_base + n.to(tl.int64) * (KDIM // 32) + k0 // 32


@triton.jit
def _k_step(
    x_rows,
    xm,
    k0,
    w_base,
    s_base,
    n,
    nm,
    KDIM,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_F32: tl.constexpr,
    DECODE: tl.constexpr,
    SWAP: tl.constexpr,
    FP4_JOIN: tl.constexpr,
    TILED: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The fp32 product of x_rows[:, k0:k0+BLOCK_K] and the expert rows n, block scales
    applied (FP8: the fp32 block scale on the partial): (BLOCK_M, BLOCK_N), or its transpose
    with SWAP.  TILED: MXFP4 codes and scales in the ``"tiles"`` layout (BLOCK_K <= 128)."""
    BITS: tl.constexpr = DECODE == 1
    ASM: tl.constexpr = DECODE == 2
    if FMT == 2 or FMT == 3:
        BKH: tl.constexpr = BLOCK_K // 2
        GH: tl.constexpr = 16 if FMT == 2 else 8  # bytes per scale group
        NG: tl.constexpr = BKH // GH
        jj = tl.arange(0, BKH)
        codes8 = tl.load(
            _fp4_ptrs(w_base, n, k0, jj, KDIM, TILED and FMT == 2, BLOCK_K),
            mask=nm[:, None],
            other=0,
        )
        codes = codes8.to(tl.int32)
        sg = tl.arange(0, NG)
        if TILED and FMT == 2:
            sptr = _mx_scale_ptr(s_base, n, k0, KDIM, True)[:, None] + sg[None, :]
        else:
            sptr = (
                s_base
                + n[:, None].to(tl.int64) * (KDIM // (2 * GH))
                + (k0 // (2 * GH) + sg)[None, :]
            )
        sraw = tl.load(sptr, mask=nm[:, None], other=0).to(tl.int32)
        if ASM:
            # group scales as bf16 (exact: e8m0 is a power of two, byte 0 the subnormal 2**-127;
            # e4m3 fits bf16), one per code byte, then the PTX decode
            if FMT == 2:
                sb = tl.where(sraw == 0, 0x40, sraw << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
            else:
                sb = _e4m3_f32(sraw).to(tl.bfloat16)
            sfull = tl.broadcast_to(sb[:, :, None], (BLOCK_N, NG, GH)).reshape(BLOCK_N, BKH)
            lo, hi = _e2m1_pair_bf16(codes8, sfull, INTERP)
            if FP4_JOIN:
                w = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
                return _dot_xw(x, w, USE_F32, SWAP, INTERP)
            else:
                # x read contiguously, even and odd columns split in registers
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
                xe, xo = tl.split(x.reshape(x.shape[0], BKH, 2))
                acc = _dot_xw(xe, lo, USE_F32, SWAP, INTERP)
                if SWAP:
                    return _dot(hi, tl.trans(xo), acc, USE_F32, INTERP)
                else:
                    return _dot(xo, tl.trans(hi), acc, USE_F32, INTERP)
        if BITS:
            if FMT == 2:  # e8m0 2**(s-127); byte 0 is 2**-127 (fp32 subnormal 0x400000)
                sf = tl.where(sraw == 0, 0x400000, sraw << 23).to(tl.float32, bitcast=True)
            else:
                sf = _e4m3_f32(sraw)
            lo = _e2m1_f32(codes & 15)
            hi = _e2m1_f32(codes >> 4)
        else:
            if FMT == 2:  # e8m0 2**(s-127), times 2**14; byte 0 is 2**-127 (fp32 subnormal)
                sf = tl.where(
                    sraw == 0, 2.0**-113, (sraw << 23).to(tl.float32, bitcast=True) * 16384.0
                )
            else:  # e4m3, times 2**14
                sf = _e4m3_times_2m8(sraw) * (256.0 * 16384.0)
            lo = _e2m1_times_2m14(codes & 15)
            hi = _e2m1_times_2m14(codes >> 4)
        lo = (lo.reshape(BLOCK_N, NG, GH) * sf[:, :, None]).reshape(BLOCK_N, BKH)
        hi = (hi.reshape(BLOCK_N, NG, GH) * sf[:, :, None]).reshape(BLOCK_N, BKH)
        if FP4_JOIN:
            # columns back in order (low nibble = even column): one dot over contiguous x
            w = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
            return _dot_xw(x, _exact_to(w, x.dtype, BITS), USE_F32, SWAP, INTERP)
        else:
            xe = tl.load(x_rows + (k0 + 2 * jj)[None, :], mask=xm, other=0.0)
            xo = tl.load(x_rows + (k0 + 2 * jj + 1)[None, :], mask=xm, other=0.0)
            acc = _dot_xw(xe, _exact_to(lo, xe.dtype, BITS), USE_F32, SWAP, INTERP)
            if SWAP:
                acc = _dot(_exact_to(hi, xo.dtype, BITS), tl.trans(xo), acc, USE_F32, INTERP)
            else:
                acc = _dot(xo, tl.trans(_exact_to(hi, xo.dtype, BITS)), acc, USE_F32, INTERP)
            return acc
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
        wp = w_base + n[:, None].to(tl.int64) * KDIM + kk[None, :]
        if FMT == 1:
            b8 = tl.load(wp, mask=nm[:, None], other=0)
            b = b8.to(tl.int32)
            if ASM:
                acc = _dot_xw(x, _e4m3_bf16(b8, INTERP), USE_F32, SWAP, INTERP)
                s = tl.load(s_base + (n // 128) * (KDIM // 128) + k0 // 128, mask=nm, other=0.0)
            elif BITS:
                acc = _dot_xw(x, _exact_to(_e4m3_f32(b), x.dtype, BITS), USE_F32, SWAP, INTERP)
                s = tl.load(s_base + (n // 128) * (KDIM // 128) + k0 // 128, mask=nm, other=0.0)
            else:
                acc = _dot_xw(x, _e4m3_times_2m8(b).to(x.dtype), USE_F32, SWAP, INTERP)
                s = tl.load(s_base + (n // 128) * (KDIM // 128) + k0 // 128, mask=nm, other=0.0)
                s = s * 256.0
            if SWAP:
                return acc * s[:, None]
            else:
                return acc * s[None, :]
        else:
            w = tl.load(wp, mask=nm[:, None], other=0.0)
            return _dot_xw(x, w.to(x.dtype), USE_F32, SWAP, INTERP)


@triton.jit
def _mx_scale_words(s_base, n, nm, KDIM, k0, TILED: tl.constexpr):
    """The four e8m0 scale bytes of rows n for K columns k0 .. k0+127, one int32 word per row
    (little-endian: group g in bits 8g..8g+7); the launcher checks the 4-byte alignment."""
    words = _mx_scale_ptr(s_base, n, k0, KDIM, TILED).to(tl.pointer_type(tl.int32))
    return tl.load(words, mask=nm, other=0)


@triton.jit
def _mx_groups_step(
    x_rows,
    xm,
    k0,
    w_base,
    words,
    n,
    nm,
    KDIM,
    BLOCK_N: tl.constexpr,
    SWAP: tl.constexpr,
    ONE_LOAD: tl.constexpr,
    TILED: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``decode="mxdot"`` / ``"mxstep"`` (MXFP4 codes, bf16 x), one 128-column K step: one dot
    per 32-column scale group on the unscaled e2m1 values, the group's e8m0 scale (from
    ``words``, see :func:`_mx_scale_words`, loaded one step ahead by the kernels) applied to the
    fp32 partial.  ``"mxdot"`` loads each group's (BLOCK_N, 16) code bytes on its own;
    ``"mxstep"`` (ONE_LOAD) loads the step's (BLOCK_N, 64) bytes at once (one 8 KiB block of
    the ``"tiles"`` layout at 128 rows) and splits them into the groups in registers: the same
    dots on the same operands, so the two give the same bits.

    Triton's ``dot_scaled`` upcasts the packed nibbles in the dot operand's own register layout
    (the codes arrive through cp.async copies), so no decoded bf16 tile makes a shared-memory
    round trip, and the scale costs one fp32 multiply-add per accumulator element and group
    instead of a bf16 multiply per weight pair.  The e8m0 scale is applied in fp32 (byte 0 as
    the subnormal 2**-127), so every scale byte is exact.  The interpreter has no
    ``dot_scaled``: it runs the same group structure with the integer e2m1 decode and an fp32
    product summed over K (the same products and partial sums; a row's bits independent of its
    place in the tile, see ``_dot``)."""
    kb = tl.arange(0, 16)
    kx = tl.arange(0, 32)
    if SWAP:
        acc = tl.zeros((BLOCK_N, xm.shape[0]), dtype=tl.float32)
    else:
        acc = tl.zeros((xm.shape[0], BLOCK_N), dtype=tl.float32)
    if ONE_LOAD:
        step = tl.load(
            _fp4_ptrs(w_base, n, k0, tl.arange(0, 64), KDIM, TILED, 128),
            mask=nm[:, None],
            other=0,
        )  # (BLOCK_N, 64): group g is bytes 16g .. 16g+15 of each row
        by_group = tl.permute(tl.reshape(step, (BLOCK_N, 4, 16)), (0, 2, 1))  # (BLOCK_N, 16, 4)
        c02, c13 = tl.split(tl.reshape(by_group, (BLOCK_N, 16, 2, 2)))
        c0, c2 = tl.split(c02)
        c1, c3 = tl.split(c13)
    for g in tl.static_range(4):
        kg = k0 + 32 * g
        if ONE_LOAD:
            codes = c0 if g == 0 else c1 if g == 1 else c2 if g == 2 else c3
        else:
            codes = tl.load(
                _fp4_ptrs(w_base, n, k0, 16 * g + kb, KDIM, TILED, 128), mask=nm[:, None], other=0
            )
        x = tl.load(x_rows + (kg + kx)[None, :], mask=xm, other=0.0)
        sraw = (words >> (8 * g)) & 0xFF
        sf = tl.where(sraw == 0, 0x400000, sraw << 23).to(tl.float32, bitcast=True)
        if INTERP:
            c32 = codes.to(tl.int32)
            w = tl.join(_e2m1_f32(c32 & 15), _e2m1_f32(c32 >> 4)).reshape(BLOCK_N, 32)
            part = _dot_xw(x, w, True, SWAP, True)  # row-independent sum (see _dot)
        else:
            if SWAP:
                part = tl.dot_scaled(codes, None, "e2m1", tl.trans(x), None, "bf16")
            else:
                part = tl.dot_scaled(x, None, "bf16", tl.trans(codes), None, "e2m1")
        if SWAP:
            acc += part * sf[:, None]
        else:
            acc += part * sf[None, :]
    return acc


@triton.jit
def _row_stream(
    x_rows,
    xm,
    k_lo,
    k_len,
    w_base,
    s_base,
    n,
    nm,
    KDIM,
    active,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_F32: tl.constexpr,
    DECODE: tl.constexpr,
    SWAP: tl.constexpr,
    FP4_JOIN: tl.constexpr,
    TILED: tl.constexpr,
    ONE_LOAD: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One stream of expert rows n over K columns k_lo .. k_lo + k_len of x_rows, in K steps:
    the fp32 product (BLOCK_N, BLOCK_M) with SWAP, else (BLOCK_M, BLOCK_N); zeros for an
    inactive M block (it streams no weights).  The down GEMM, and the gate/up GEMM on the tiles
    layout (gate and up rows interleaved in n)."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if active and FMT == 2 and DECODE >= 3:
        # the next step's scale words load while this step computes (one step ahead)
        wd = _mx_scale_words(s_base, n, nm, KDIM, k_lo, TILED)
        k_last = k_lo + k_len - BLOCK_K
        for kk in range(0, k_len, BLOCK_K):
            k0 = k_lo + kk
            wd_next = _mx_scale_words(s_base, n, nm, KDIM, tl.minimum(k0 + BLOCK_K, k_last), TILED)
            acc += _mx_groups_step(
                x_rows, xm, k0, w_base, wd, n, nm, KDIM, BLOCK_N, SWAP, ONE_LOAD, TILED, INTERP
            )
            wd = wd_next
    elif active:
        for kk in range(0, k_len, BLOCK_K):
            acc += _k_step(
                x_rows, xm, k_lo + kk, w_base, s_base, n, nm, KDIM,
                FMT, BLOCK_N, BLOCK_K, USE_F32, DECODE, SWAP, FP4_JOIN, TILED, INTERP,
            )  # fmt: skip
    return acc


# ----------------------------------------------------------------------------- tiles
@triton.jit
def _tile_ids(NUM_M, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(M block, N tile, K split) of this program.  GROUP_M 0: the 2-D grid (M block fastest);
    else a 1-D grid walking groups of GROUP_M M blocks, all N tiles of a group first."""
    if GROUP_M == 0:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
    else:
        pid = tl.program_id(0)
        width = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(NUM_M - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        pid_s = tl.program_id(1)
    return pid_m, pid_n, pid_s


@triton.jit
def _rows(
    sorted_ptr,
    block_expert_ptr,
    pid_m,
    T,
    IDENTITY: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(expert, slot or token per row, row valid) of M block pid_m; expert -1 = unused block."""
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if IDENTITY:
        e = pid_m * 0
        slot = r
        ok = r < T
    else:
        e = tl.load(block_expert_ptr + pid_m)
        slot = tl.load(sorted_ptr + r)
        ok = slot >= 0
    return e, slot, ok


@triton.jit
def _swiglu_store(
    acc_g,
    acc_u,
    gs_ptr,
    e,
    slot,
    ok,
    topw_ptr,
    h_ptr,
    pid_m,
    n,
    nm,
    I,
    limit,
    IDENTITY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Global scales, the gate/up roundings, clamp, silu(g) * u * routing weight -> h rows."""
    h_ty = h_ptr.dtype.element_ty
    g = acc_g * tl.load(gs_ptr + e * 3)
    u = acc_u * tl.load(gs_ptr + e * 3 + 1)
    # the reference's gate and up linears return the activation dtype
    g = rne_bf16_if_interpreted(g, h_ty, INTERP).to(h_ty).to(tl.float32)
    u = rne_bf16_if_interpreted(u, h_ty, INTERP).to(h_ty).to(tl.float32)
    if limit > 0:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if not IDENTITY:
        h = h * tl.load(topw_ptr + slot, mask=ok, other=0.0).to(tl.float32)[:, None]
    h = rne_bf16_if_interpreted(h, h_ty, INTERP)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = ok[:, None] & nm[None, :]
    tl.store(h_ptr + r[:, None].to(tl.int64) * I + n[None, :], h.to(h_ty), mask=mask)


# ----------------------------------------------------------------------------- kernels
@jit_loop_bounds("D")
def moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    sorted_ptr,
    block_expert_ptr,
    topw_ptr,
    h_ptr,
    part_ptr,
    T,
    D,
    I,
    TOPK,
    limit,
    W_STRIDE_E,
    S_STRIDE_E,
    NUM_M,
    IDENTITY: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP: tl.constexpr,
    DECODE: tl.constexpr,
    FP4_JOIN: tl.constexpr,
    TILED: tl.constexpr,
    USE_F32: tl.constexpr,
    INTERP: tl.constexpr,
):
    MX: tl.constexpr = FMT == 2 and DECODE >= 3
    # the tiles layout loads whole steps: per-group 16-byte pieces of its 64-byte rows compile
    # to plain loads (no cp.async pipelining) in Triton 3.6, so "mxdot" runs as "mxstep" there
    ONE_LOAD: tl.constexpr = DECODE == 4 or TILED
    # TILED: the packed w13 interleaves gate and up (row 2c gate column c, row 2c+1 up column c),
    # so one stream of BLOCK_N rows gives BLOCK_N / 2 gate and up columns
    pid_m, pid_n, pid_s = _tile_ids(NUM_M, 2 * I if TILED else I, BLOCK_N, GROUP_M)
    e, slot, ok = _rows(sorted_ptr, block_expert_ptr, pid_m, T, IDENTITY, BLOCK_M)
    token = slot if IDENTITY else slot // TOPK
    active = e >= 0  # unused blocks stream no weights
    e = tl.maximum(e, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + token[:, None].to(tl.int64) * D
    xm = ok[:, None]
    w_base = w_ptr + e * W_STRIDE_E
    s_base = s_ptr + e * S_STRIDE_E
    k_lo = 0
    if SPLIT_K > 1:
        k_lo = tl.multiple_of(pid_s * (D // SPLIT_K), BLOCK_K)
    if TILED:
        nm = n < 2 * I
        acc = _row_stream(
            x_rows, xm, k_lo, D // SPLIT_K, w_base, s_base, n, nm, D, active,
            FMT, BLOCK_M, BLOCK_N, BLOCK_K, USE_F32, DECODE, SWAP, FP4_JOIN, TILED, ONE_LOAD,
            INTERP,
        )  # fmt: skip
        if SWAP:
            acc = tl.trans(acc)
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        c = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        nm = n < I
        k_last = k_lo + D // SPLIT_K - BLOCK_K
        if SWAP:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if active and MX:
            wg = _mx_scale_words(s_base, n, nm, D, k_lo, TILED)
            wu = _mx_scale_words(s_base, n + I, nm, D, k_lo, TILED)
            for kk in range(0, D // SPLIT_K, BLOCK_K):
                k0 = k_lo + kk
                k_next = tl.minimum(k0 + BLOCK_K, k_last)
                wg_next = _mx_scale_words(s_base, n, nm, D, k_next, TILED)
                wu_next = _mx_scale_words(s_base, n + I, nm, D, k_next, TILED)
                acc_g += _mx_groups_step(
                    x_rows, xm, k0, w_base, wg, n, nm, D, BLOCK_N, SWAP, ONE_LOAD, TILED, INTERP
                )
                acc_u += _mx_groups_step(
                    x_rows, xm, k0, w_base, wu, n + I, nm, D, BLOCK_N, SWAP, ONE_LOAD, TILED,
                    INTERP,
                )  # fmt: skip
                wg = wg_next
                wu = wu_next
        elif active:
            for kk in range(0, D // SPLIT_K, BLOCK_K):
                k0 = k_lo + kk
                acc_g += _k_step(
                    x_rows, xm, k0, w_base, s_base, n, nm, D,
                    FMT, BLOCK_N, BLOCK_K, USE_F32, DECODE, SWAP, FP4_JOIN, TILED, INTERP,
                )  # fmt: skip
                acc_u += _k_step(
                    x_rows, xm, k0, w_base, s_base, n + I, nm, D,
                    FMT, BLOCK_N, BLOCK_K, USE_F32, DECODE, SWAP, FP4_JOIN, TILED, INTERP,
                )  # fmt: skip
        if SWAP:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        c = n
    cm = c < I
    if SPLIT_K == 1:
        _swiglu_store(
            acc_g, acc_u, gs_ptr, e, slot, ok, topw_ptr, h_ptr, pid_m, c, cm, I, limit,
            IDENTITY, BLOCK_M, INTERP,
        )  # fmt: skip
    else:
        # fp32 partials (SPLIT_K, rows, [gate ; up]); moe_swiglu_kernel sums them in split order
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = (pid_s * NUM_M * BLOCK_M + r[:, None]).to(tl.int64) * (2 * I)
        mask = xm & cm[None, :]
        tl.store(part_ptr + rows + c[None, :], acc_g, mask=mask)
        tl.store(part_ptr + rows + I + c[None, :], acc_u, mask=mask)


@triton.jit
def moe_swiglu_kernel(
    part_ptr,
    gs_ptr,
    sorted_ptr,
    block_expert_ptr,
    topw_ptr,
    h_ptr,
    T,
    I,
    limit,
    NUM_M,
    IDENTITY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Split-K gate/up: sum the SPLIT_K partials in the order 0..SPLIT_K-1, then the epilogue."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, slot, ok = _rows(sorted_ptr, block_expert_ptr, pid_m, T, IDENTITY, BLOCK_M)
    e = tl.maximum(e, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = ok[:, None] & nm[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        row = part_ptr + (s * NUM_M * BLOCK_M + r[:, None]).to(tl.int64) * (2 * I) + n[None, :]
        acc_g += tl.load(row, mask=mask, other=0.0)
        acc_u += tl.load(row + I, mask=mask, other=0.0)
    _swiglu_store(
        acc_g, acc_u, gs_ptr, e, slot, ok, topw_ptr, h_ptr, pid_m, n, nm, I, limit,
        IDENTITY, BLOCK_M, INTERP,
    )  # fmt: skip


@jit_loop_bounds("I")
def moe_down_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    sorted_ptr,
    block_expert_ptr,
    y_ptr,
    T,
    D,
    I,
    W_STRIDE_E,
    S_STRIDE_E,
    NUM_M,
    ROWS_OUT,
    IDENTITY: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP: tl.constexpr,
    DECODE: tl.constexpr,
    FP4_JOIN: tl.constexpr,
    TILED: tl.constexpr,
    USE_F32: tl.constexpr,
    INTERP: tl.constexpr,
):
    # the tiles layout loads whole steps: per-group 16-byte pieces of its 64-byte rows compile
    # to plain loads (no cp.async pipelining) in Triton 3.6, so "mxdot" runs as "mxstep" there
    ONE_LOAD: tl.constexpr = DECODE == 4 or TILED
    pid_m, pid_n, pid_s = _tile_ids(NUM_M, D, BLOCK_N, GROUP_M)
    y_ty = y_ptr.dtype.element_ty
    e, slot, ok = _rows(sorted_ptr, block_expert_ptr, pid_m, T, IDENTITY, BLOCK_M)
    active = e >= 0
    e = tl.maximum(e, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < D
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    h_rows = h_ptr + r[:, None].to(tl.int64) * I
    xm = ok[:, None]
    w_base = w_ptr + e * W_STRIDE_E
    s_base = s_ptr + e * S_STRIDE_E
    k_lo = 0
    if SPLIT_K > 1:
        k_lo = tl.multiple_of(pid_s * (I // SPLIT_K), BLOCK_K)
    acc = _row_stream(
        h_rows, xm, k_lo, I // SPLIT_K, w_base, s_base, n, nm, I, active,
        FMT, BLOCK_M, BLOCK_N, BLOCK_K, USE_F32, DECODE, SWAP, FP4_JOIN, TILED, ONE_LOAD, INTERP,
    )  # fmt: skip
    if SWAP:
        acc = tl.trans(acc)
    mask = xm & nm[None, :]
    if SPLIT_K == 1:
        y = acc * tl.load(gs_ptr + e * 3 + 2)
        y = rne_bf16_if_interpreted(y, y_ty, INTERP)
        tl.store(y_ptr + slot[:, None].to(tl.int64) * D + n[None, :], y.to(y_ty), mask=mask)
    else:
        # unscaled fp32 partials (SPLIT_K, ROWS_OUT, D) at the row's slot; the reduce kernel
        # sums them in split order, applies the down scale and rounds
        rows = (pid_s * ROWS_OUT + slot[:, None]).to(tl.int64) * D
        tl.store(y_ptr + rows + n[None, :], acc, mask=mask)


@triton.jit
def moe_reduce_kernel(
    ws_ptr,
    ids_ptr,
    map_ptr,
    gs_ptr,
    shared_ptr,
    out_ptr,
    T,
    D,
    E_GLOBAL,
    E_LOCAL,
    TOPK: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    SPLIT: tl.constexpr,
    SHARED_SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
):
    """out[t] = sum over the valid slots k in slot order (+ the shared row), fp32, one rounding.
    SPLIT > 0: each slot's row is first formed from its SPLIT fp32 down partials (split order,
    down scale, rounding to the output dtype, as the unsplit down kernel stores it); likewise
    the shared row with SHARED_SPLIT > 0.  0: the rows as the down kernel stored them."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    o_ty = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        g = tl.load(ids_ptr + t * TOPK + k).to(tl.int32)
        valid = (g >= 0) & (g < E_GLOBAL)
        loc = tl.load(map_ptr + tl.where(valid, g, 0)).to(tl.int32) if HAS_MAP else g
        valid = valid & (loc >= 0) & (loc < E_LOCAL)
        if SPLIT == 0:
            y = tl.load(ws_ptr + (t * TOPK + k) * D + d, mask=dm & valid, other=0.0)
            acc += y.to(tl.float32)
        else:
            ys = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                ys += tl.load(ws_ptr + ((s * T + t) * TOPK + k) * D + d, mask=dm & valid, other=0.0)
            ys = ys * tl.load(gs_ptr + tl.where(valid, loc, 0).to(tl.int64) * 3 + 2)
            acc += rne_bf16_if_interpreted(ys, o_ty, INTERP).to(o_ty).to(tl.float32)
    if HAS_SHARED:
        if SHARED_SPLIT == 0:
            acc += tl.load(shared_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
        else:
            ys = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for s in tl.static_range(SHARED_SPLIT):
                ys += tl.load(shared_ptr + (s * T + t) * D + d, mask=dm, other=0.0)
            acc += rne_bf16_if_interpreted(ys, o_ty, INTERP).to(o_ty).to(tl.float32)
    acc = rne_bf16_if_interpreted(acc, o_ty, INTERP)
    tl.store(out_ptr + t * D + d, acc.to(o_ty), mask=dm)


@triton.jit
def act_quant_kernel(x_ptr, out_ptr, R, K, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """Round each 1 x BLOCK block of x through e4m3 with a power-of-two scale (amax floored at
    1e-4; dsv4mtp/quant.py) and write q * scale in x's dtype (exact: e4m3 fits bf16)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < K
    o_ty = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * K + c, mask=cm, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
    # 2**ceil(log2(amax / 448)) from the exponent bits (exact; log2 of an fp32 can round)
    r = amax / 448.0
    rb = r.to(tl.int32, bitcast=True)
    ex = ((rb >> 23) & 0xFF) - 127
    ex = tl.where((rb & 0x7FFFFF) != 0, ex + 1, ex)
    scale = ((ex + 127) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    vb = v.to(tl.int32, bitcast=True)
    ve = tl.maximum(((vb >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals share 2**-6's step
    ulp = ((ve - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = v / ulp  # exact (power of two); |y| < 16
    y = (y + 12582912.0) - 12582912.0  # round half to even at integer precision
    q = y * ulp * scale
    q = rne_bf16_if_interpreted(q, o_ty, INTERP)
    tl.store(out_ptr + row * K + c, q.to(o_ty), mask=cm)


# ----------------------------------------------------------------------------- launchers
def _use_f32(x: torch.Tensor) -> bool:
    # fp32 activations need an fp32 dot; the interpreter's bf16 dot is wrong, so it upcasts
    return INTERPRET or x.dtype == torch.float32


def _grid(num_m: int, n: int, tile: GemmTile) -> tuple[int, ...]:
    nt = triton.cdiv(n, tile.block_n)
    if tile.group_m:
        return (num_m * nt, tile.split_k)
    return (num_m, nt, tile.split_k)


def _fit_split(tile: GemmTile, K: int) -> GemmTile:
    """The tile with its K split halved until every split covers whole BLOCK_K steps (the
    kernels place split s at s * (K / SPLIT_K), asserted a multiple of BLOCK_K): V4's K (4096,
    7168, 2048, 3072) take the default 4-way split; small test shapes (K 256 or 128) fall
    back to fewer splits rather than misaligned slices."""
    split = tile.split_k
    while split > 1 and K % (split * tile.block_k):
        split //= 2
    return tile if split == tile.split_k else dataclasses.replace(tile, split_k=split)


def _decode_for(
    decode: str, fmt: int, act: torch.dtype, scales: torch.Tensor, block_k: int, tiled: bool
) -> str:
    """``"gluon"`` (kernels/moe_gemm_gluon.py) needs the tiles layout, a compiled launch (Gluon
    has no interpreter) and what ``"mxstep"`` needs, else runs as ``"mxstep"``.  ``"mxdot"``
    and ``"mxstep"`` need MXFP4 codes and bf16 activations (``dot_scaled``'s operand types),
    128-column K steps and 4-byte aligned scale rows (one int32 word of four e8m0 bytes per row
    and step); other GEMMs of the same schedule (the FP8 shared expert, fp32 activations) take
    ``"asm"``, whose dot operands are the same values."""
    if decode == "gluon" and (INTERPRET or not tiled):
        decode = "mxstep"
    if decode in ("mxdot", "mxstep", "gluon") and (
        fmt != FMT_MXFP4
        or act != torch.bfloat16
        or block_k != 128
        or scales.data_ptr() % 4
        or scales.shape[-1] % 4
    ):
        return "asm"
    return decode


def _tile_meta(tile: GemmTile, decode: str, fp4_join: bool, tiled: bool) -> dict[str, object]:
    return dict(
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLIT_K=tile.split_k, GROUP_M=tile.group_m,
        SWAP=tile.swap_ab, DECODE=DECODES.index(decode), FP4_JOIN=fp4_join, TILED=tiled,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def _check_tiled(tiled: bool, fmt: int, tile: GemmTile) -> None:
    """The ``"tiles"`` layout holds MXFP4 codes in 128-column K blocks: a K step stays in one."""
    if tiled and (fmt != FMT_MXFP4 or tile.block_k > 128):
        raise ConfigError(
            f"the tiles layout takes MXFP4 codes and block_k <= 128, got format {fmt} and "
            f"block_k {tile.block_k}"
        )


def _gluon_or_mxstep(
    decode: str,
    x: torch.Tensor,
    codes: torch.Tensor,
    sorted_slot: torch.Tensor | None,
    tile: GemmTile,
    block_m: int,
    fold: bool,
) -> str:
    """A routed GEMM whose decode resolved to ``"gluon"`` (:func:`_decode_for`) runs the Gluon
    kernel where it applies to these operands, this (split-fitted) tile and the pack's scales
    (``gluon_applies``), else ``"mxstep"``; other decodes, and the shared expert (no sort),
    pass through."""
    if decode != "gluon" or (
        sorted_slot is not None and gluon_applies(x, codes, tile, block_m, fold)
    ):
        return decode
    return "mxstep"


# The wgmma gate/up GEMM with one K split applies the SwiGLU in its epilogue and writes h
# (kernels/moe_gemm_gluon.py, ``_store_swiglu``): the same values as its fp32 partials finished
# by ``moe_swiglu_kernel`` (the same operations in the same order), without the partials
# (4 bytes per gate and up value written and read again: 0.67 GB at T 4096) or the second
# launch.  False: the partials and the separate pass (the benchmark's A/B switch).
WGMMA_SWIGLU_EPILOGUE = True
# The mma_v2 gate/up GEMM (decode sizes) finishes the SwiGLU in the same launch: each tile's
# last K split (a ticket per tile) reads the tile's partials back from L2 and writes its h
# columns (kernels/moe_gemm_gluon.py, ``_swiglu_after_splits``): the same values as
# ``moe_swiglu_kernel`` without its launch on the step's dependent chain.  False: the separate
# pass (the benchmark's A/B switch).
GLUON_SWIGLU_TAIL = True


def _gate_up_gluon(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    gscale: torch.Tensor,
    sorted_slot: torch.Tensor,
    block_expert: torch.Tensor,
    topk_weights: torch.Tensor | None,
    h: torch.Tensor,
    *,
    inter: int,
    top_k: int,
    limit: float,
    tile: GemmTile,
    block_m: int,
    fold: bool,
) -> None:
    """``decode="gluon"``: on the mma_v2 kernel (decode sizes, :data:`GLUON_SWIGLU_TAIL`) the
    GEMM's fp32 [gate ; up] partials finished in the same launch by each tile's last K split
    (its tickets on the stream's zeroed counters, kernels/_sync.py); on the wgmma kernel with
    one K split (:data:`WGMMA_SWIGLU_EPILOGUE`) the GEMM writes h from its accumulator;
    otherwise the partials, then the split-K path's SwiGLU pass (``moe_swiglu_kernel``, 128
    columns per program)."""
    # the routed GEMMs always have their sort and routing weights (the shared expert, which
    # has neither, never takes the Gluon kernels)
    assert topk_weights is not None, "the Gluon gate/up: routed rows only"
    num_m = block_expert.numel()
    if WGMMA_SWIGLU_EPILOGUE and tile.split_k == 1 and uses_wgmma(tile, block_m, fold):
        moe_mx_gluon(
            x, w13, s13, sorted_slot, block_expert, h, gather=True, top_k=top_k, tile=tile,
            block_m=block_m, fold=fold, swiglu=(gscale, topk_weights, h, float(limit)),
        )  # fmt: skip
        return
    rows = num_m * block_m
    part = torch.empty((tile.split_k, rows, 2 * inter), dtype=torch.float32, device=x.device)
    if GLUON_SWIGLU_TAIL and not uses_wgmma(tile, block_m, fold):
        moe_mx_gluon(
            x, w13, s13, sorted_slot, block_expert, part, gather=True, top_k=top_k, tile=tile,
            block_m=block_m, fold=fold, swiglu=(gscale, topk_weights, h, float(limit)),
        )  # fmt: skip
        return
    moe_mx_gluon(
        x, w13, s13, sorted_slot, block_expert, part, gather=True, top_k=top_k, tile=tile,
        block_m=block_m, fold=fold,
    )  # fmt: skip
    triton_launch(
        moe_swiglu_kernel, IDENTITY=False, BLOCK_M=block_m, BLOCK_N=128, SPLIT_K=tile.split_k,
        INTERP=INTERPRET, num_warps=4,
    )(
        (num_m, triton.cdiv(inter, 128)), part, gscale, sorted_slot, block_expert,
        topk_weights, h, x.shape[0], inter, float(limit), num_m,
    )  # fmt: skip


def moe_gate_up_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    gscale: torch.Tensor,
    sorted_slot: torch.Tensor | None,
    block_expert: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    h: torch.Tensor,
    *,
    fmt: int,
    inter: int,
    top_k: int,
    limit: float,
    num_m_blocks: int,
    block_m: int,
    tile: GemmTile,
    decode: str = "f16",
    fp4_join: bool = False,
    tiled: bool = False,
    fold: bool = False,
) -> None:
    """h (num_m_blocks*block_m, I) = clamped SwiGLU of x's rows (see the module doc).  With
    ``tile.split_k`` > 1: fp32 partials, then ``moe_swiglu_kernel``.  ``tiled``: w13 and s13
    in the ``"tiles"`` layout (gate and up rows interleaved; ``tile.block_n`` counts both).
    ``fold``: every scale byte <= 128, so ``decode="gluon"`` may fold the scales into its bf16
    decode (kernels/moe_gemm_gluon.py)."""
    T, D = x.shape
    identity = sorted_slot is None
    dummy = gscale
    _check_tiled(tiled, fmt, tile)
    decode = _decode_for(decode, fmt, x.dtype, s13, tile.block_k, tiled)
    tile = _fit_split(tile, D)
    split = tile.split_k
    rows = num_m_blocks * block_m
    decode = _gluon_or_mxstep(decode, x, w13, sorted_slot, tile, block_m, fold)
    if decode == "gluon":
        assert sorted_slot is not None and block_expert is not None
        _gate_up_gluon(x, w13, s13, gscale, sorted_slot, block_expert, topk_weights, h,
                       inter=inter, top_k=top_k, limit=limit, tile=tile, block_m=block_m,
                       fold=fold)  # fmt: skip
        return
    part = (
        torch.empty((split, rows, 2 * inter), dtype=torch.float32, device=x.device)
        if split > 1
        else dummy
    )
    srt = dummy if identity else sorted_slot
    blk = dummy if identity else block_expert
    topw = dummy if topk_weights is None else topk_weights
    triton_launch(
        moe_gate_up_kernel, IDENTITY=identity, FMT=fmt, BLOCK_M=block_m,
        USE_F32=_use_f32(x) or w13.dtype == torch.float32, INTERP=INTERPRET,
        **_tile_meta(tile, decode, fp4_join, tiled),
    )(
        _grid(num_m_blocks, 2 * inter if tiled else inter, tile),
        x, w13, s13, gscale, srt, blk, topw, h, part,
        T, D, inter, top_k, float(limit), w13[0].numel(), s13[0].numel() if s13.numel() else 0,
        num_m_blocks,
    )  # fmt: skip
    if split > 1:
        triton_launch(
            moe_swiglu_kernel, IDENTITY=identity, BLOCK_M=block_m, BLOCK_N=tile.block_n,
            SPLIT_K=split, INTERP=INTERPRET, num_warps=4,
        )(
            (num_m_blocks, triton.cdiv(inter, tile.block_n)),
            part, gscale, srt, blk, topw, h, T, inter, float(limit), num_m_blocks,
        )  # fmt: skip


def moe_down_triton(
    h: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    gscale: torch.Tensor,
    sorted_slot: torch.Tensor | None,
    block_expert: torch.Tensor | None,
    *,
    fmt: int,
    T: int,
    D: int,
    inter: int,
    rows_out: int,
    num_m_blocks: int,
    block_m: int,
    tile: GemmTile,
    decode: str = "f16",
    fp4_join: bool = False,
    tiled: bool = False,
    fold: bool = False,
) -> torch.Tensor:
    """y[slot] = h[row] @ w2^T (rows of each M block; see the module doc).  Returns y
    (rows_out, D) in h's dtype, or with ``tile.split_k`` > 1, or where the Gluon kernel takes
    ``decode="gluon"``, the fp32 partials (split_k, rows_out, D), unscaled, for
    :func:`moe_reduce_triton`.  ``tiled`` and ``fold``: as :func:`moe_gate_up_triton`'s."""
    identity = sorted_slot is None
    dummy = gscale
    _check_tiled(tiled, fmt, tile)
    decode = _decode_for(decode, fmt, h.dtype, s2, tile.block_k, tiled)
    tile = _fit_split(tile, inter)
    split = tile.split_k
    decode = _gluon_or_mxstep(decode, h, w2, sorted_slot, tile, block_m, fold)
    if decode == "gluon":
        assert sorted_slot is not None and block_expert is not None
        # unscaled fp32 partials at the slots, for the reduce (also with one split)
        y = torch.empty((split, rows_out, D), dtype=torch.float32, device=h.device)
        moe_mx_gluon(
            h, w2, s2, sorted_slot, block_expert, y, gather=False, top_k=1, tile=tile,
            block_m=block_m, fold=fold,
        )  # fmt: skip
        return y
    if split > 1:
        y = torch.empty((split, rows_out, D), dtype=torch.float32, device=h.device)
    else:
        y = torch.empty((rows_out, D), dtype=h.dtype, device=h.device)
    triton_launch(
        moe_down_kernel, IDENTITY=identity, FMT=fmt, BLOCK_M=block_m,
        USE_F32=_use_f32(h) or w2.dtype == torch.float32, INTERP=INTERPRET,
        **_tile_meta(tile, decode, fp4_join, tiled),
    )(
        _grid(num_m_blocks, D, tile), h, w2, s2, gscale,
        dummy if identity else sorted_slot, dummy if identity else block_expert, y,
        T, D, inter, w2[0].numel(), s2[0].numel() if s2.numel() else 0, num_m_blocks, rows_out,
    )  # fmt: skip
    return y


def moe_reduce_triton(
    ws: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    shared: torch.Tensor | None,
    out: torch.Tensor,
    e_local: int,
    gscale: torch.Tensor | None = None,
) -> None:
    """out (T, D) = sum over valid slots of ws (T*K, D) (+ shared (T, D)).  A 3-D ``ws`` or
    ``shared`` holds fp32 down partials (split, rows, D) (``gscale`` then gives the routed
    down scales)."""
    T, D = out.shape
    K = topk_ids.shape[1]
    if T == 0:
        return
    # 3-D: fp32 partials (split, rows, D), also with one split (the Gluon down GEMM's output)
    split = ws.shape[0] if ws.dim() == 3 else 0
    shared_split = shared.shape[0] if shared is not None and shared.dim() == 3 else 0
    if split and gscale is None:
        raise ValueError("moe_reduce_triton: split-K partials need the routed gscale")
    block = min(1024, triton.next_power_of_2(D))
    e_global = expert_map.numel() if expert_map is not None else e_local
    triton_launch(
        moe_reduce_kernel, TOPK=K, HAS_MAP=expert_map is not None, HAS_SHARED=shared is not None,
        SPLIT=split, SHARED_SPLIT=shared_split, BLOCK_D=block, INTERP=INTERPRET, num_warps=4,
    )(
        (T, triton.cdiv(D, block)), ws, topk_ids, topk_ids if expert_map is None else expert_map,
        ws if gscale is None else gscale, out if shared is None else shared, out,
        T, D, e_global, e_local,
    )  # fmt: skip


def act_quant_triton(x: torch.Tensor, out: torch.Tensor) -> None:
    """out (R, K) = e4m3 round trip of x (R, K) per 1x128 block (power-of-two scales)."""
    R, K = x.shape
    if R == 0:
        return
    triton_launch(act_quant_kernel, BLOCK=128, INTERP=INTERPRET)(
        (R, triton.cdiv(K, 128)), x, out, R, K
    )


# ----------------------------------------------------------------------------- shared expert
def shared_mm_selected(
    rows: int, exact_bf16: bool, x_dtype: torch.dtype, batch_invariant: bool
) -> bool:
    """Whether the shared expert of a ``rows``-token call runs on cuBLAS
    (:func:`shared_expert_mm`): the dense linears' rule (kernels/linear.py,
    ``dequant_mm_selected``), ``exact_bf16`` for bf16 weights or FP8 codes whose block scales
    are powers of two (the bf16 weight is then the weight)."""
    return dequant_mm_selected(rows, exact_bf16, x_dtype, batch_invariant)


def _dense_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x (R, K) bf16 @ W^T -> (R, N) bf16, W the one expert's (1, N, K) bf16 weight, or FP8
    codes with fp32 128x128 block scales through the dense linears' prefill path (dequantized
    exactly into their bf16 workspace of this shape: kernels/linear.py, ``linear_dequant_mm``);
    fp32 accumulation and fp32 reductions, one rounding."""
    y = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
    if w.dtype == torch.uint8:
        linear_dequant_mm(x[:, None], w, s, y[:, None])
        return y
    with fp32_reduction(x.device):
        torch.mm(x, w[0].T, out=y)
    return y


def shared_expert_mm(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    gscale: torch.Tensor,
    *,
    limit: float,
    act_quant: bool,
) -> torch.Tensor:
    """The shared expert of a prefill-sized call on cuBLAS: (T, D) rows in x's dtype.

    x (T, D) bf16 (already e4m3-rounded under ``act_quant``); w13 (1, 2I, D) rows [gate ; up]
    and w2 (1, D, I): bf16 weights, or FP8 codes with power-of-two block scales s13 / s2
    (``shared_mm_selected``).  Three steps, the rounding points of the Triton kernels (and of
    the reference: the gate and up linears return bf16, the down linear too):

    * the FP8 weight dequantized to bf16 (exact) and one cuBLAS GEMM x @ w13^T, fp32
      accumulation, rounded to bf16 [gate ; up] (T, 2I);
    * ``moe_swiglu_kernel`` (one expert, no routing weight): clamp, silu(gate) * up, rounded
      to h (T, I) (then e4m3-rounded per 128 columns under ``act_quant``);
    * h @ w2^T on cuBLAS, rounded to (T, D).

    Why: the Triton GEMMs of the routed path decode the e4m3 weight in registers and reach
    about 300 TFLOP/s at prefill sizes, cuBLAS 700-830 on the bf16 weight (the dense linears'
    measurement, kernels/linear.py); at T 4096 the shared expert's 0.2 TFLOP took 0.84 ms in
    the Triton kernels (bench/results/mtp-h200.md).  Bytes: the codes (25 MB at V4-Flash
    shapes) read and their bf16 copy written and read once, x, 2I + I bf16 per token for the
    gate/up and h rows, the output.  The bf16 weights go to the dense linears' workspaces of
    their shapes: w13's (1, 2I, D) is e_proj's and h_proj's, w2's (1, D, I) 16 MiB more."""
    T = x.shape[0]
    inter = w13.shape[1] // 2
    gu = _dense_mm(x, w13, s13)  # (T, 2I) [gate ; up]
    h = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    block_m = 32
    triton_launch(
        moe_swiglu_kernel, IDENTITY=True, BLOCK_M=block_m, BLOCK_N=128, SPLIT_K=1,
        INTERP=INTERPRET, num_warps=4,
    )(
        (triton.cdiv(T, block_m), triton.cdiv(inter, 128)), gu, gscale, gscale, gscale, gscale, h,
        T, inter, float(limit), triton.cdiv(T, block_m),
    )  # fmt: skip
    if act_quant:
        act_quant_triton(h, h)  # in place: each program reads its 128 values before writing
    return _dense_mm(h, w2, s2)
