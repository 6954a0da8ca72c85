"""The FP8 dense linears of the T 1 decode step, in Gluon: ``y = x @ W^T`` for a few rows.

What it computes: the math of kernels/linear.py's ``linear_kernel`` (docs/semantics.md, "Linear
layers") for an FP8 pack whose 128x128 block scales are powers of two 2^e with -117 <= e <= 7
(``LinearPack.fold_bf16``; V4-Flash's e8m0 scales lie far inside): x (R, G, K) bf16 times the
e4m3 codes w (G, N, K) of each group, fp32 sums, y (R, G, N) bf16 rounded once.

Why a second kernel.  At one token the Triton kernel reads the decode linears' codes at 0.9-2.1
TB/s (bench/results/linear-h200.md, "Decode schedules"); this one is 10-20 % faster there
(e_proj 9.2 against 10.9 us, wo_b 14.7 against 17.5; :data:`GLUON_MAX_ROWS` has the numbers and
why it stops at 4 rows).  Both spend most of such a call starting and finishing: a linear read
from a warm L2 is only 1-1.7 us faster than from HBM (bench/diag/l2_prefetch_probe.py).  The
structure is the MoE's Gluon GEMM (kernels/moe_gemm_gluon.py) with an e4m3 decode:

* ``mma_v2`` (m16n8k16, bf16 -> fp32) with the weights as operand A (BLOCK_N = 128 rows: 4 warps
  x 2 tiles of 16, one 128-row scale block) and BLOCK_T rows of x as B (N = 8, 16 or 32); more
  rows run as several M blocks, adjacent in the grid so that they read one weight tile from
  the L2 together.
* K permuted inside each 32-column group as in the MoE kernel: thread ``lane % 4`` loads the
  eight codes of columns 8 w .. 8 w + 7 of its rows (one 8-byte load per row and group) and x's
  same eight columns (one 16-byte load per row), so no shuffles and no shared memory.
* Decode (inline PTX, four instructions per pair of codes): one ``prmt`` puts code byte i of
  the low and of the high word in the two halves, each beside a byte of its sign replicated; a
  shift and a mask make each half the bf16 pattern of the e4m3 value times 2^-120 (e4m3
  subnormals become bf16 subnormals), and one ``mul.rn.bf16x2`` by 2^(120 + e) applies the
  2^120 and the block scale at once, exactly (the product is the weight, a bf16 normal number,
  by the range of e above).  So the eight MMAs of a 128-column step chain in one fp32 partial,
  added to the sum once per step: 2.9 instructions per weight in the loop at 8-row blocks.
* One step of register prefetch (the next step's codes, scale and x loaded before the current
  one computes).
* Split-K in the same launch, as ``linear_kernel``: fp32 partials, a ticket per output tile,
  and the tile's last split sums the partials in split order and rounds once: deterministic,
  a row's bits depend on the schedule only.

Bytes it must move: the codes once (N * K per group; the M blocks of one tile share them
through the L2), 4 bytes of scale per 16 KiB of codes, x from the L2 (once per 128 columns of
N), y once, and with a split 2 * SPLIT_K * R * G * N * 4 bytes of partials through the L2.

Not here: fp32 activations or weights, scales outside the fold range, ``batch_invariant``
calls (their T-independent schedule stays the Triton kernel's), more rows than
:data:`GLUON_MAX_ROWS` (the Triton kernel, from 256 rows the dequantize + cuBLAS path).  No interpreter: Gluon has
none, so the CPU tier runs ``linear_kernel``; the GPU tier tests this kernel bit for bit
(conformance/test_linear.py, ``test_gluon_*``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ._launch import cdiv, triton_launch
from .moe_gemm_gluon import _group_tile, _mma_layout, _word_layout, _x_group, _x_layout

__all__ = [
    "GLUON_MAX_ROWS",
    "GluonLinearSchedule",
    "gluon_linear_applies",
    "gluon_linear_schedule",
    "linear_fp8_gluon",
]

# A block scale 2^e folds into the decode's bf16 multiplier 2^(120 + e) when that is a bf16
# normal number (e <= 7) and every nonzero code x scale stays normal (2^-9 * 2^e >= 2^-126):
# optimized/linear.py's FOLD_LOG2_MIN / FOLD_LOG2_MAX, which LinearPack.fold_bf16 checks.
# Calls of up to this many rows take the Gluon kernel (the T 1 decode step: h_proj's 4 rows on
# the mHC streams, 1 row for the others).  Measured on the H200 (bench/diag/linear_gluon_sweep.py,
# bench/results/linear-h200.md, "The Gluon kernel"), cold weights, us per call, Triton / Gluon:
# at 1 row e_proj 10.9 / 9.2, wq_a + wkv 8.1 / 6.9, wo_a 17.6 / 15.4, wo_b 17.5 / 14.7; at 8 rows
# the two tie (11.2 / 11.3 for e_proj) and the whole step at T 8 was 2.5 % slower with them;
# at 32 and 64 rows the Triton kernel, which shares each x tile between its warps through shared
# memory, is 25-50 % faster (e_proj at 64 rows 18.3 / 22.7).
GLUON_MAX_ROWS = 4
BLOCK_N = 128  # weight rows per program: one scale block, 4 warps x 2 MMA tiles of 16
_BLOCK_N = gl.constexpr(BLOCK_N)
SMS = 132
# The K split doubles until a call has this many programs (about two per SM), each split keeping
# two 128-column steps or more: e_proj / h_proj / wo_b 32 tiles x 8, wo_a 64 x 4, the fused
# wq_a + wkv 12 x 16.  Measured: e_proj at 1 row 9.2 us with 8 splits, 11.8 with 4, 10.6 with 16.
_TARGET_PROGRAMS = 2 * SMS - 8


@dataclass(frozen=True)
class GluonLinearSchedule:
    """BLOCK_T rows of x per M block (mma_v2's N: 8, 16 or 32) and the K split."""

    block_t: int
    split_k: int


def gluon_linear_schedule(rows: int, N: int, K: int, groups: int) -> GluonLinearSchedule:
    """The smallest M block holding the rows (32 past 32 rows: several M blocks), and the K
    split (``_TARGET_PROGRAMS``).  The layer's calls (up to :data:`GLUON_MAX_ROWS` rows) use
    8-row blocks; 16 and 32 were measured (module doc) and stay tested."""
    block_t = 8 if rows <= 8 else 16 if rows <= 16 else 32
    programs = cdiv(rows, block_t) * (N // BLOCK_N) * groups
    steps = K // 128
    split = 1
    while programs * split < _TARGET_PROGRAMS and steps % (2 * split) == 0 and steps >= 4 * split:
        split *= 2
    return GluonLinearSchedule(block_t, split)


def gluon_linear_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the layer's default takes this kernel: x (R, G, K) bf16 with 1 <= R <=
    :data:`GLUON_MAX_ROWS`, contiguous and 4-byte aligned (read as bf16 pairs); codes (G, N, K)
    uint8 contiguous and 8-byte aligned (read as 8-byte words); N and K multiples of 128; and
    fewer than 132 128-row tiles (G * N / 128: wider weights, wq_b's 256 tiles, run faster in
    the Triton kernel's 128-wide tiles without a K split: 13.4 against 14.3 us at 1 row)."""
    R, G, K = x.shape
    N = w.shape[1]
    return (
        x.dtype == torch.bfloat16
        and 1 <= R <= GLUON_MAX_ROWS
        and N % BLOCK_N == 0
        and K % 128 == 0
        and G * (N // BLOCK_N) < SMS
        and x.is_contiguous()
        and w.is_contiguous()
        and x.data_ptr() % 4 == 0
        and w.data_ptr() % 8 == 0
    )


# ----------------------------------------------------------------------------- decode PTX
def _e4m3_pair_ptx(i: int) -> str:
    """Byte i of the low word (column 8 w + i) -> $2i, of the high word (8 w + 4 + i) ->
    $2i+1.  ``prmt`` builds each half as (code's sign replicated) << 8 | code; shifted left by 4
    and masked, the half is sign << 15 | (code & 0x7F) << 4: the bf16 pattern of the e4m3 value
    times 2^-120 (the low half's sign byte spills into bits 16..19, which the mask clears); then
    times the bf16x2 multiplier $9."""
    sel = i | ((8 + i) << 4) | ((4 + i) << 8) | ((12 + i) << 12)
    return "\n".join(
        [
            f"prmt.b32 t, lo, hi, {sel:#06x};",
            "shl.b32 t, t, 4;",
            "and.b32 t, t, 0x87F087F0;",
            "mul.rn.bf16x2 t, t, $9;",
            f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, t;",
        ]
    )


_DECODE_E4M3 = gl.constexpr(
    "\n".join(
        ["{", ".reg .b32 lo, hi, t;", "mov.b64 {lo, hi}, $8;"]
        + [_e4m3_pair_ptx(i) for i in range(4)]
        + ["}"]
    )
)
_OUT8 = gl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h")


@gluon.jit
def _decode_e4m3_group(wd, kt, BLOCK_N: gl.constexpr):
    """8-byte code words (BLOCK_N, 4) of one 32-column group -> its A tile (BLOCK_N, 32) bf16 in
    permuted-K order, scaled by the bf16x2 multiplier ``kt`` (same shape, int32)."""
    o = gl.inline_asm_elementwise(
        _DECODE_E4M3, _OUT8 + ",l,r", [wd, kt], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1
    )
    return _group_tile(o, BLOCK_N)


@gluon.jit
def _load_step(w_ptrs, s_ptr, x_ptrs, x_mask, step):
    """Registers of one 128-column step: four groups' code words per row, the step's block
    scale, x's words."""
    c0 = gl.load(w_ptrs + step * 16)
    c1 = gl.load(w_ptrs + (step * 16 + 4))
    c2 = gl.load(w_ptrs + (step * 16 + 8))
    c3 = gl.load(w_ptrs + (step * 16 + 12))
    sc = gl.load(s_ptr + step)
    x0 = gl.load(x_ptrs + step * 64, mask=x_mask, other=0)
    x1 = gl.load(x_ptrs + (step * 64 + 16), mask=x_mask, other=0)
    x2 = gl.load(x_ptrs + (step * 64 + 32), mask=x_mask, other=0)
    x3 = gl.load(x_ptrs + (step * 64 + 48), mask=x_mask, other=0)
    return c0, c1, c2, c3, sc, x0, x1, x2, x3


@gluon.jit
def _compute_step(
    acc, buf, BLOCK_T: gl.constexpr, MMA: gl.constexpr, AL: gl.constexpr, BL: gl.constexpr,
    WL: gl.constexpr,
):  # fmt: skip
    """acc += the step's partial: the four groups' MMAs chained from zero (the scale is in the
    decode), added once."""
    c0, c1, c2, c3, sc, x0, x1, x2, x3 = buf
    # 2^e as fp32 bits (e + 127) << 23 -> the bf16 of 2^(120 + e): (e + 247) << 7, both halves
    k16 = ((sc.to(gl.int32, bitcast=True) >> 23) + 120) << 7
    kt = gl.full([_BLOCK_N, 4], 0, gl.int32, layout=WL) + (k16 | (k16 << 16))
    part = gl.zeros([_BLOCK_N, BLOCK_T], gl.float32, layout=MMA)
    for g in gl.static_range(4):
        if g == 0:
            cw = c0
            xg = x0
        elif g == 1:
            cw = c1
            xg = x1
        elif g == 2:
            cw = c2
            xg = x2
        else:
            cw = c3
            xg = x3
        a = gl.convert_layout(_decode_e4m3_group(cw, kt, _BLOCK_N), AL)
        b = gl.convert_layout(_x_group(xg, BLOCK_T), BL)
        part = mma_v2(a, b, part)
    return acc + part


# ----------------------------------------------------------------------------- kernel
@gluon.jit
def linear_fp8_gluon_kernel(
    x_ptr,  # *i32: x (R, G, K) bf16 as word pairs
    w_ptr,  # *i64: codes (G, N, K) e4m3 as 8-byte words
    s_ptr,  # *fp32: block scales (G, N / 128, K / 128), powers of two in the fold range
    y_ptr,  # *bf16: y (R, G, N)
    part_ptr,  # *fp32: (SPLIT_K, R, G, N) partials (unused without a split)
    count_ptr,  # *i32: one zeroed counter per (M block, N tile, group)
    R,
    G,
    N,
    K,
    BLOCK_T: gl.constexpr,
    SPLIT_K: gl.constexpr,
):
    NUM_WARPS: gl.constexpr = 4
    M_TILES: gl.constexpr = _BLOCK_N // (16 * NUM_WARPS)
    MMA: gl.constexpr = _mma_layout(NUM_WARPS)
    WL: gl.constexpr = _word_layout(M_TILES, NUM_WARPS)
    XL: gl.constexpr = _x_layout(BLOCK_T, NUM_WARPS)
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)

    pid_m = gl.program_id(0)  # fastest: the M blocks of one weight tile run side by side
    pid_n = gl.program_id(1)
    pid_gs = gl.program_id(2)
    g = pid_gs // SPLIT_K
    s = pid_gs % SPLIT_K
    g64 = g.to(gl.int64)
    kslice = K // SPLIT_K
    k_lo = s * kslice
    n_steps = kslice // 128

    # x rows t of the block: words (t * G + g) * K / 2 + k / 2
    xt = pid_m * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, XL))
    xc = gl.arange(0, 16, layout=gl.SliceLayout(1, XL))
    x_row = (xt.to(gl.int64) * G + g) * (K // 2) + k_lo // 2
    x_ptrs = x_ptr + gl.expand_dims(x_row, 0) + gl.expand_dims(xc, 1)
    x_mask = gl.expand_dims(xc >= 0, 1) & gl.expand_dims(xt < R, 0)
    # codes: 8-byte word (g * N + n) * K / 8 + k / 8; thread lane % 4 takes word 4 group + w
    rows = pid_n * _BLOCK_N + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, WL))
    words = gl.arange(0, 4, layout=gl.SliceLayout(0, WL))
    w_row = (g64 * N + rows) * (K // 8) + k_lo // 8
    w_ptrs = w_ptr + gl.expand_dims(w_row, 1) + gl.expand_dims(words, 0)
    KB = K // 128
    s_prog = s_ptr + (g64 * (N // 128) + pid_n) * KB + k_lo // 128

    acc = gl.zeros([_BLOCK_N, BLOCK_T], gl.float32, layout=MMA)
    buf = _load_step(w_ptrs, s_prog, x_ptrs, x_mask, 0)
    for i in range(n_steps):
        nxt = _load_step(w_ptrs, s_prog, x_ptrs, x_mask, gl.minimum(i + 1, n_steps - 1))
        acc = _compute_step(acc, buf, BLOCK_T, MMA, AL, BL, WL)
        buf = nxt

    n = pid_n * _BLOCK_N + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, MMA))
    t = pid_m * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, MMA))
    out_off = gl.expand_dims((t.to(gl.int64) * G + g) * N, 0) + gl.expand_dims(n, 1)
    mask = gl.expand_dims(n >= 0, 1) & gl.expand_dims(t < R, 0)
    if SPLIT_K == 1:
        gl.store(y_ptr + out_off, acc.to(gl.bfloat16), mask=mask)
    else:
        # The tile's last split to arrive sums the partials in split order: the protocol and
        # its memory-model argument are linear_kernel's (kernels/linear.py).
        plane = gl.cast(R, gl.int64) * G * N
        gl.store(part_ptr + s * plane + out_off, acc, mask=mask)
        gl.thread_barrier()
        tile = (pid_m * gl.num_programs(1) + pid_n) * G + g
        ticket = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            gl.thread_barrier()
            total = gl.zeros([_BLOCK_N, BLOCK_T], gl.float32, layout=MMA)
            for j in gl.static_range(SPLIT_K):
                total += gl.load(
                    part_ptr + j * plane + out_off, mask=mask, other=0.0, cache_modifier=".cg"
                )
            gl.store(y_ptr + out_off, total.to(gl.bfloat16), mask=mask)
            gl.store(count_ptr + tile, 0)


# ----------------------------------------------------------------------------- launcher
def linear_fp8_gluon(
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    y: torch.Tensor,
    *,
    sched: GluonLinearSchedule,
    counters: torch.Tensor,
    part: torch.Tensor,
) -> None:
    """y (R, G, N) bf16 = x (R, G, K) @ w (G, N, K)^T per group (module doc).  The caller checks
    :func:`gluon_linear_applies` and the fold range of the fp32 scales ``s`` (G, N/128, K/128);
    ``counters``: int32 zeros (left zeroed), at least one per (M block, 128-column tile, group);
    ``part``: fp32 workspace of ``split_k * R * G * N`` (any tensor without a split)."""
    R, G, K = x.shape
    N = w.shape[1]
    grid = (cdiv(R, sched.block_t), N // BLOCK_N, G * sched.split_k)
    triton_launch(
        linear_fp8_gluon_kernel, BLOCK_T=sched.block_t, SPLIT_K=sched.split_k, num_warps=4
    )(grid, x.view(torch.int32), w.view(torch.int64), s, y, part, counters, R, G, N, K)
