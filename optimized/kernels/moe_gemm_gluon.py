"""The routed MXFP4 expert GEMMs in Gluon: ``decode="gluon"`` (mma_v2 at decode sizes, wgmma at
prefill sizes).

What it computes: for every M block of the align kernel's sorted slots (``block_m`` 8, 16 or
32 rows for the mma_v2 kernel, 32, 64 or 128 for the wgmma kernel: expert e, rows r = block_m *
block .. + block_m - 1),
the fp32 product of the block's activation rows and e's MXFP4 weight rows n over the
program's K slice, into split-K partials
that the Triton epilogues finish:

* gate/up (``gather``): x row = token of slot ``sorted[r]`` (slot // top_k); w13 in the
  ``"tiles"`` layout with gate and up rows interleaved (packed row 2c gate column c, 2c + 1 up
  column c); partial ``part[split, r, (n % 2) * I + n // 2]``, i.e. the [gate ; up] rows
  ``moe_swiglu_kernel`` reads (kernels/moe_gemm.py).  With ``swiglu`` the mma_v2 kernel
  finishes them itself: each tile's last K split (a ticket per tile on int32 counters) reads
  the tile's partials back from L2 and writes its h columns as ``moe_swiglu_kernel`` would
  (:func:`_swiglu_after_splits`): one launch fewer on the decode step's chain.
* down: x row = h row r; partial ``part[split, sorted[r], n]`` (unscaled), which
  ``moe_reduce_kernel`` scales, rounds and sums in slot order.

Shapes and dtypes: x (rows, K) bf16, contiguous, K a multiple of 128 * split; codes (E, N, K/2)
uint8 and scales (E, N, K/32) e8m0 bytes in the tiles layout (optimized/moe.py, ``mx_tiles``;
N a multiple of the program's rows); partials (split, rows_part, N) fp32.  Bytes it must move:
each active block's expert codes and scales (9/16 byte per weight), x from L2, the partials
(4 * split * rows * N bytes, about 1 % of the weights at top-6 decode).  Fuses the MXFP4
decode, the e8m0 scales and the gather of the routed rows into the GEMM.

Why Gluon.  Triton's ``dot_scaled`` version (kernels/moe_gemm.py, ``"mxstep"``) streams the
tiles at about 2.1-2.3 TB/s: its loop converts each group's e8m0 scales through shared memory
(barriers every group) and issues 4.3 instructions per weight.  Here the register layout is
ours, 3.0 instructions per weight with the fold, 3.6 without; the whole moe on the H200 at
T 1 / 8 / 64 / 512: 80.2 / 219.5 / 724.5 / 1902 us against 90.6 / 305.2 / 1043.9 / 2625 us
for ``"mxstep"``, the experts streaming at about 3.5 TB/s at T 64 (bench/results/moe-h200.md,
"Gluon GEMMs on the tiles"):

* ``mma_v2`` (m16n8k16, bf16 -> fp32) with the weights as operand A (M = 128 weight rows per
  program: 4 warps x 2 tiles of 16) and the block's activation rows as B (N = 8, 16 or 32).  One
  MMA per 32-column scale group (K = 32, ``DotOperandLayout(k_width=4)``).
* K permuted inside each group (for the weights and x alike, so the dot is unchanged): thread
  ``lane % 4`` then needs exactly code word ``lane % 4`` (bytes 4w .. 4w + 3) of each row and
  group, one 32-bit load from the tiles layout's 64-byte row of the (128-row, 128-column)
  block, and its A registers are the decode's outputs renamed, no shuffles, no shared memory.
  x arrives as 16-byte loads of 8 consecutive columns; four ``prmt`` per group re-pair them.
* Decode (inline PTX per code word -> 8 bf16): mask a nibble pair, one integer multiply
  placing its magnitude and sign bits, mask again: the bf16 pattern of e2m1 * 2**-126 (codes
  +-0.5 are bf16 subnormals), then one ``mul.rn.bf16x2`` by 2**126 (exact).  The e8m0 scale
  multiplies each group's fp32 MMA result (byte 0 is 2**-127, built from bits): exact for every
  scale byte, the rule of ``"mxdot"``; the order of the fp32 sums differs from it (the values
  stay within the pairs' tolerance, not bitwise).  With ``fold`` (a pack whose scale bytes are
  all <= 128: ``MoEPack.mx_fold``, which real checkpoints' scales far below 1 meet) the
  multiplier is 2**(s - 1) instead, applying the scale exactly in bf16, and the step's four
  groups chain in one MMA accumulator: the whole moe 5-12 % faster (T 64: 724.5 against
  796.1 us).
* Loads: the next 128-column step's code words, scale word and x are loaded into registers
  before the current step computes (one step of register prefetch; two steps measured slower:
  the registers doubled).  76-88 registers at 8 rows, 128-136 at 16, 239-255 at 32 (two
  programs per SM), no shared memory.

wgmma (``moe_mx_wgmma_kernel``, 32-, 64- or 128-row M blocks, the scales folded: prefill
sizes from T 768, where an expert holds ~T * 6 / 256 rows, 24 at T 1024, 96 at T 4096):

* ``warpgroup_mma`` with the decoded weights as the register A operand (M = 64 weight rows per
  warpgroup, 128 on 8 warps) and the block's activation rows as B from shared memory (N = 32,
  64 or 128): the weights are decoded once per M block, not per 16 rows as in the mma_v2
  kernel, and the decoded weights stay in registers (the PTX-decode Triton kernels that ran
  these sizes store them to shared memory for their MMA).
* The A fragment puts columns 2w, 2w + 1 (+ 8, + 16, + 24) of a group in lane w of a quad:
  byte w of each of the group's four code words.  Every lane of the quad reads the row's 16
  bytes (a broadcast shared-memory load) and three ``prmt`` gather its four bytes into one
  word, which the decode above turns into its eight A values in the natural column order, so
  x needs no permutation.
* x rows (gathered by token for gate/up), the code words and the scale words go global ->
  shared by ``cp.async``: x of step i with the codes of step i + 1 in one group, ``STAGES - 2``
  steps ahead; the codes of step i + 1 are decoded after the MMA of step i is issued, but
  the compiled loop waits for that MMA first (ptxas puts ``WARPGROUP.DEPBAR`` right after the
  step's last ``HGMMA``: every step packs its A operand into the same registers), so within a
  warpgroup the decode and the MMA alternate and the overlap comes from the SM's other
  warpgroups (at the 64-row default, two programs of two warpgroups).  A second MMA in flight
  needs a second register set: in one loop body the same instructions pack every step's A
  operand, so the next step overwrites the registers the running MMA reads (wrong results on
  the H200); unrolled by two it is exact and overlaps, but at 64-row blocks it takes 171
  registers, one program per SM, and ran slower (bench/results/moe-h200.md, "The MMA in
  flight"; ``python3 bench/diag/wgmma_sass.py`` shows the compiled loop).  N tiles are the
  fastest grid dimension, so the programs of one M block share its x rows in L2.
* Every MMA of the K slice chains into one fp32 accumulator (the k16 steps in order); the
  values equal the PTX-decode Triton kernels' at these shapes (the same chain), and differ from
  the mma_v2 kernel's per-step partials by fp32 summation order only.
* The gate/up GEMM with one K split applies the SwiGLU in its epilogue and writes h (the
  rows of ``moe_swiglu_kernel``, bit for bit): its copies load the interleaved gate and up rows
  into the A operand 8 rows apart (:func:`_a_rows`), so every thread's accumulator holds both
  halves of its columns (:func:`_store_swiglu`).
* 8 warps, 64-row blocks, 4 stages: 124 registers and 98 KB of shared memory, two programs
  per SM; the T 768-1024 default, 32-row blocks, gate/up on 8 warps and down on 4: 96 / 94
  registers, 66 / 49 KB.  Whole moe on the H200: bench/results/moe-h200.md, "wgmma GEMMs at
  prefill sizes", "wgmma on 32-row blocks" and "The SwiGLU in the wgmma epilogue".

Batch invariance: a row's value depends on its expert, the split, ``block_m``'s MMA shape and
the mode only, never on the other rows or on T.  No interpreter: Gluon has none, so on the CPU
``"gluon"`` runs as ``"mxstep"`` (kernels/moe_gemm.py, ``_decode_for``); the GPU tier tests
these kernels (conformance/test_moe_schedule.py, ``test_gluon_*`` and ``test_wgmma_*``).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsv4mtp.errors import InputError

from ._launch import triton_launch
from ._sync import counters as zeroed_counters
from .moe_schedule import GemmTile

# the wgmma kernel's shared memory per stage: x (block_m rows x 128 bf16 columns), the code
# words (64 bytes per weight row) and the scale words (4 bytes per row); what one block may hold
_WG_STAGE_BYTES_PER_T = 256
_WG_STAGE_BYTES_PER_N = 68
_SM90_SMEM = 232448

__all__ = ["gluon_applies", "gluon_tile_ok", "moe_mx_gluon", "uses_wgmma"]


# ----------------------------------------------------------------------------- decode PTX
def _pair_ptx(src: str, hi_nibbles: bool, out_lo: str, out_hi: str) -> str:
    """One bf16x2 from the two nibbles of ``src`` at bits 0..3 and 16..19 (4..7 and 20..23 with
    ``hi_nibbles``): mask, one multiply placing a copy of each nibble's magnitude at bits 6..8
    and of its sign at 15 (no carries: the copies do not overlap), mask to the bf16 pattern of
    e2m1 * 2**-126, exact multiply by ``k``, split into two bf16 outputs."""
    mask, mult = (0x00F000F0, 4 + 256) if hi_nibbles else (0x000F000F, 64 + 4096)
    return "\n".join(
        [
            f"and.b32 t, {src}, {mask:#010x};",
            f"mul.lo.u32 t, t, {mult};",
            "and.b32 t, t, 0x81C081C0;",
            "mul.rn.bf16x2 t, t, k;",
            f"mov.b32 {{{out_lo}, {out_hi}}}, t;",
        ]
    )


def _decode_ptx(fold_half: int | None) -> str:
    """Code word $8 -> eight bf16 $0..$7 (output 2i + h = nibble i + 4h).  ``fold_half`` None:
    times 2**126 (0x7E80); 0 / 1: times the low / high bf16 of $9, the multipliers 2**(s - 1)
    of two groups (:data:`_FOLD_MULT`)."""
    head = ["{", ".reg .b32 w8, t, k;", ".reg .b16 k0, k1;"]
    if fold_half is None:
        head.append("mov.b32 k, 0x7E807E80;")
    else:
        # this group's half broadcast: ptxas makes it an .H0_H0 / .H1_H1 operand, no instruction
        half = "k0, k0" if fold_half == 0 else "k1, k1"
        head += ["mov.b32 {k0, k1}, $9;", f"mov.b32 k, {{{half}}};"]
    body = [
        "shr.b32 w8, $8, 8;",
        _pair_ptx("$8", False, "$0", "$1"),
        _pair_ptx("$8", True, "$2", "$3"),
        _pair_ptx("w8", False, "$4", "$5"),
        _pair_ptx("w8", True, "$6", "$7"),
    ]
    return "\n".join([*head, *body, "}"])


_DECODE = gl.constexpr(_decode_ptx(None))
_DECODE_FOLD_LO = gl.constexpr(_decode_ptx(0))
_DECODE_FOLD_HI = gl.constexpr(_decode_ptx(1))
# scale word (bytes = groups 0..3) -> bf16x2 multipliers 2**(s - 1) of groups (0, 1) and (2, 3):
# prmt two bytes into the halves' low bytes, then (s + 126) << 7 per half
_FOLD_MULT = gl.constexpr(
    "{\n.reg .b32 v;\n"
    "prmt.b32 v, $2, 0, 0x4140;\nmad.lo.u32 $0, v, 128, 0x3F003F00;\n"
    "prmt.b32 v, $2, 0, 0x4342;\nmad.lo.u32 $1, v, 128, 0x3F003F00;\n}"
)
_OUT8 = gl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h")


# ----------------------------------------------------------------------------- layouts
@gluon.constexpr_function
def _mma_layout(num_warps):
    return gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8]
    )


@gluon.constexpr_function
def _word_layout(m_tiles, num_warps):
    """(rows, 4 code words of a group): lane % 4 = word, lane // 4 = row; registers: row + 8
    and the M tiles; warps: 16-row slabs (the rows of the A operand's fragments)."""
    rows = 16 * m_tiles * num_warps
    reg = [[8, 0]] + [[16 * num_warps << j, 0] for j in range(m_tiles.bit_length() - 1)]
    warp = [[16 << j, 0] for j in range(num_warps.bit_length() - 1)]
    lane = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[], shape=[rows, 4]
    )


@gluon.constexpr_function
def _x_layout(block_t, num_warps):
    """(16 bf16x2 words = 32 columns of a group, rows): lane % 4 holds words 4w .. 4w + 3 (one
    16-byte load) of row lane // 4 (rows + 8, + 16 in registers); every warp the same."""
    reg = [[1, 0], [2, 0]] + [[0, 8 << j] for j in range((block_t // 8).bit_length() - 1)]
    lane = [[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]]
    warp = [[0, 0]] * (num_warps.bit_length() - 1)
    return gl.DistributedLinearLayout(
        reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[], shape=[16, block_t]
    )


# ----------------------------------------------------------------------------- pieces
@gluon.jit
def _decode_word(wd, ks, FOLD: gl.constexpr, HI: gl.constexpr):
    """Code words wd (rows, 4) -> their eight bf16 values (:func:`_decode_ptx`, times the
    folded scales ks with ``FOLD``) as dims (rows, 4, 2, 2, 2): output 4 b2 + 2 b1 + b0 at
    [..., b0, b1, b2] (registers only; the callers permute them into their A tiles)."""
    if FOLD:
        o = gl.inline_asm_elementwise(
            _DECODE_FOLD_HI if HI else _DECODE_FOLD_LO, _OUT8 + ",r,r", [wd, ks],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        o = gl.inline_asm_elementwise(
            _DECODE, _OUT8 + ",r", [wd], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1
        )
    q0 = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))
    q1 = gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7]))
    return gl.join(q0, q1)


@gluon.jit
def _decode_group(wd, ks, FOLD: gl.constexpr, HI: gl.constexpr, BLOCK_N: gl.constexpr):
    """Code words (BLOCK_N, 4) of one group -> its A tile (BLOCK_N, 32) bf16 in permuted-K
    order: k = 16 c + 4 w + 2 a + h holds column 8 w + 2 c + a + 4 h of the group."""
    # output 4c + 2a + h -> dims (w, h, a, c) -> (c, w, a, h)
    r = gl.permute(_decode_word(wd, ks, FOLD, HI), (0, 4, 1, 3, 2))
    return gl.reshape(r, [BLOCK_N, 32])


@gluon.jit
def _x_group(x_words, BLOCK_T: gl.constexpr):
    """x words (16, BLOCK_T) int32 (bf16 pairs as stored: column 8 w + 4 h + 2 c + a) -> the B
    tile (32, BLOCK_T) bf16 in the A tile's permuted-K order (four prmt re-pair the thread's
    registers).  x travels as 32-bit words: as bf16 halves ptxas added moves."""
    lo, hi = gl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;", "=h,=h,r", [x_words], dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True, pack=1,
    )  # fmt: skip
    xt = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [32, BLOCK_T])
    xv = gl.permute(gl.reshape(xt, [4, 2, 2, 2, BLOCK_T]), (2, 0, 3, 1, 4))  # (c, w, a, h, t)
    return gl.reshape(xv, [32, BLOCK_T])


@gluon.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, step):
    """Registers of one 128-column step: the four groups' code words and the scale word of
    each row (tiles layout: one (128-row, 128-column) block is 2048 words of codes and 128
    words of scales), x's words of the step."""
    c0 = gl.load(w_ptrs + step * 2048)
    c1 = gl.load(w_ptrs + (step * 2048 + 4))
    c2 = gl.load(w_ptrs + (step * 2048 + 8))
    c3 = gl.load(w_ptrs + (step * 2048 + 12))
    sw = gl.load(s_ptrs + step * 128)
    x0 = gl.load(x_ptrs + step * 64, mask=x_mask, other=0)
    x1 = gl.load(x_ptrs + (step * 64 + 16), mask=x_mask, other=0)
    x2 = gl.load(x_ptrs + (step * 64 + 32), mask=x_mask, other=0)
    x3 = gl.load(x_ptrs + (step * 64 + 48), mask=x_mask, other=0)
    return c0, c1, c2, c3, sw, x0, x1, x2, x3


@gluon.jit
def _compute_step(
    acc, buf, BLOCK_N: gl.constexpr, BLOCK_T: gl.constexpr, FOLD: gl.constexpr,
    MMA: gl.constexpr, AL: gl.constexpr, BL: gl.constexpr,
):  # fmt: skip
    """acc += the step's four groups.  f32: each group's MMA from zero, its fp32 result times
    the group's e8m0 scale added to acc.  FOLD: the scale applied in the decode, the four MMAs
    chained from zero into one partial, added to acc once (chaining every MMA of the K loop
    into acc lost low bits over long chains: 1.4e-6 of |x| @ |W|^T at K 2048, 1-2e-7 this way)."""
    c0, c1, c2, c3, sw, x0, x1, x2, x3 = buf
    if FOLD:
        part = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=MMA)
        k01, k23 = gl.inline_asm_elementwise(
            _FOLD_MULT, "=r,=r,r", [sw], dtype=(gl.int32, gl.int32), is_pure=True, pack=1
        )
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
        ks = (k01 if g < 2 else k23) if FOLD else sw
        a = gl.convert_layout(_decode_group(cw, ks, FOLD, g % 2 == 1, BLOCK_N), AL)
        b = gl.convert_layout(_x_group(xg, BLOCK_T), BL)
        if FOLD:
            part = mma_v2(a, b, part)
        else:
            pg = mma_v2(a, b, gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=MMA))
            sb = (sw >> (8 * g)) & 0xFF
            # 2**(sb - 127); byte 0 is the fp32 subnormal 2**-127
            sf = gl.where(sb == 0, 0x400000, sb << 23).to(gl.float32, bitcast=True)
            acc = acc + pg * gl.expand_dims(sf, 1)
    if FOLD:
        acc = acc + part
    return acc


@gluon.jit
def _k_slice(K, pid_s, SPLIT_K: gl.constexpr):
    """(first column, 128-column steps) of the program's K slice, and the steps of all of K
    (the tiles layout's stride between 128-row blocks)."""
    kslice = K // SPLIT_K
    return pid_s * kslice, kslice // 128, K // 128


@gluon.jit
def _block_rows(
    sorted_ptr, pid_m, TOPK, GATHER: gl.constexpr, BLOCK_T: gl.constexpr, layout: gl.constexpr
):  # fmt: skip
    """The M block's rows in ``layout``: each row's slot (-1 = padding) and the x row it reads,
    the slot's token for gate/up (``GATHER``; padding reads row 0, whose results are never
    stored), the block row itself for down."""
    t = gl.arange(0, BLOCK_T, layout=layout)
    slot = gl.load(sorted_ptr + pid_m * BLOCK_T + t)
    row = gl.maximum(slot, 0) // TOPK if GATHER else pid_m * BLOCK_T + t
    return slot, row


@gluon.jit
def _store_partials(
    part_ptr, acc, sorted_ptr, pid_m, pid_n, pid_s, N, ROWS_PART, GATHER: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_T: gl.constexpr, MMA: gl.constexpr,
):  # fmt: skip
    """The program's fp32 tile acc (BLOCK_N weight rows, BLOCK_T block rows) into the split's
    partials: gate/up (``GATHER``) at the block's rows, columns [gate ; up]; down at the rows'
    slots.  Padding rows (slot -1) are not written."""
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    t = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, MMA))
    slot = gl.load(sorted_ptr + pid_m * BLOCK_T + t)
    if GATHER:
        # packed row 2c is gate column c, 2c + 1 up column c: [gate ; up] partial rows
        out_row = pid_m * BLOCK_T + t
        col = (n % 2) * (N // 2) + n // 2
    else:
        out_row = gl.maximum(slot, 0)
        col = n
    ptrs = (
        part_ptr
        + gl.expand_dims((pid_s * ROWS_PART + out_row).to(gl.int64) * N, 0)
        + gl.expand_dims(col, 1)
    )
    mask = gl.expand_dims(n >= 0, 1) & gl.expand_dims(slot >= 0, 0)
    gl.store(ptrs, acc, mask=mask)


# ----------------------------------------------------------------------------- kernel
@gluon.jit
def moe_mx_gluon_kernel(
    x_ptr,  # *i32: activations (rows, K) bf16 as word pairs
    w_ptr,  # *i32: codes, tiles layout, (E, N, K/8) words
    s_ptr,  # *i32: e8m0 scales, tiles layout, (E, N, K/128) words
    sorted_ptr,  # *i32 (num_blocks * BLOCK_T,): slot of each M-block row, -1 = padding
    block_expert_ptr,  # *i32 (num_blocks,): expert of each M block, -1 = unused
    part_ptr,  # *fp32 (SPLIT_K, ROWS_PART, N)
    gs_ptr,  # *fp32 (E, 3): global scales (SWIGLU)
    topw_ptr,  # *fp32 (T * TOPK,): routing weight of each slot (SWIGLU)
    h_ptr,  # *bf16 (num_blocks * BLOCK_T, N / 2): the SwiGLU rows (SWIGLU)
    count_ptr,  # *i32 (num_blocks * N / BLOCK_N,) zeros: split tickets per tile (SWIGLU)
    K,
    N,
    TOPK,
    W_STRIDE_E,
    S_STRIDE_E,
    ROWS_PART,
    limit,
    GATHER: gl.constexpr,
    BLOCK_T: gl.constexpr,
    M_TILES: gl.constexpr,
    SPLIT_K: gl.constexpr,
    FOLD: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    SWIGLU: gl.constexpr,
):
    BLOCK_N: gl.constexpr = 16 * M_TILES * NUM_WARPS
    MMA: gl.constexpr = _mma_layout(NUM_WARPS)
    WL: gl.constexpr = _word_layout(M_TILES, NUM_WARPS)
    XL: gl.constexpr = _x_layout(BLOCK_T, NUM_WARPS)
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    SL: gl.constexpr = gl.SliceLayout(1, MMA)

    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_s = gl.program_id(2)
    e = gl.load(block_expert_ptr + pid_m)
    if e >= 0:  # unused M blocks stream no weights
        e64 = e.to(gl.int64)
        k_lo, n_steps, KS = _k_slice(K, pid_s, SPLIT_K)
        x_slot, x_row = _block_rows(
            sorted_ptr, pid_m, TOPK, GATHER, BLOCK_T, gl.SliceLayout(0, XL)
        )  # fmt: skip
        xc = gl.arange(0, 16, layout=gl.SliceLayout(1, XL))
        x_ptrs = x_ptr + k_lo // 2 + gl.expand_dims(x_row * (K // 2), 0) + gl.expand_dims(xc, 1)
        x_mask = gl.expand_dims(xc >= 0, 1) & gl.expand_dims(x_slot >= 0, 0)
        # code words: ((n // 128) * KS + step) * 2048 + (n % 128) * 16 + 4 g + lane % 4
        rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WL))
        words = gl.arange(0, 4, layout=gl.SliceLayout(0, WL))
        w_base = w_ptr + e64 * W_STRIDE_E + (k_lo // 128) * 2048
        w_ptrs = (
            w_base
            + gl.expand_dims((rows // 128) * (KS * 2048) + (rows % 128) * 16, 1)
            + gl.expand_dims(words, 0)
        )
        # scale words: ((n // 128) * KS + step) * 128 + n % 128; FOLD decodes in the word
        # layout, f32 scales the MMA result (rows of the accumulator's layout)
        s_base = s_ptr + e64 * S_STRIDE_E + (k_lo // 128) * 128
        if FOLD:
            s_ptrs = s_base + gl.expand_dims((rows // 128) * (KS * 128) + rows % 128, 1)
            s_ptrs = s_ptrs + gl.expand_dims(words * 0, 0)
        else:
            srows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=SL)
            s_ptrs = s_base + (srows // 128) * (KS * 128) + srows % 128

        acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=MMA)
        buf = _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, 0)
        for i in range(n_steps):
            nxt = _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, gl.minimum(i + 1, n_steps - 1))
            acc = _compute_step(acc, buf, BLOCK_N, BLOCK_T, FOLD, MMA, AL, BL)
            buf = nxt

        _store_partials(
            part_ptr, acc, sorted_ptr, pid_m, pid_n, pid_s, N, ROWS_PART, GATHER, BLOCK_N,
            BLOCK_T, MMA,
        )  # fmt: skip
        if SWIGLU:
            _swiglu_after_splits(
                part_ptr, count_ptr, gs_ptr, e, topw_ptr, h_ptr, sorted_ptr, pid_m, pid_n, N,
                ROWS_PART, limit, SPLIT_K, BLOCK_N, BLOCK_T, NUM_WARPS,
            )  # fmt: skip


# ----------------------------------------------------------------------------- wgmma
# The prefill-size GEMMs: 64- or 128-row M blocks (an expert holds ~T * 6 / 256 rows: 48 at
# T 2048, 96 at T 4096), where the mma_v2 kernel above re-decodes each expert's weights once per
# 16-row block.  Here one program decodes its 128 weight rows once per 128-column step into the
# registers of a wgmma A operand and multiplies them with all 64 or 128 rows of the block at
# once (module doc, "wgmma").
_GATHER_BYTES = gl.constexpr(
    "{\n.reg .b32 lo, hi;\n"
    "prmt.b32 lo, $1, $2, $5;\nprmt.b32 hi, $3, $4, $5;\nprmt.b32 $0, lo, hi, 0x5410;\n}"
)


@gluon.constexpr_function
def _wg_mma_layout(num_warps, block_t):
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_t, 16]
    )


@gluon.constexpr_function
def _wg_code_layout(num_warps):
    """(rows, 4 lanes, 4 words of a group): every lane of a quad holds the row's four words of
    the group (one 16-byte load), lane // 4 = row, row + 8 in registers, warps: 16-row slabs
    (the rows of the wgmma A operand's fragments)."""
    warp = [[16 << j, 0, 0] for j in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=warp, block_bases=[], shape=[16 * num_warps, 4, 4],
    )  # fmt: skip


@gluon.jit
def _wg_decode_group(raw, ks, HI: gl.constexpr, BLOCK_N: gl.constexpr):
    """A group's code words (BLOCK_N, 4 lanes, 4 words) and folded scales ks -> its A tile
    (BLOCK_N, 32) bf16 in the natural column order.  Lane w of a quad holds columns 2w,
    2w + 1 (+ 8, + 16, + 24) of each of its rows in the wgmma fragment: byte w of each of the
    group's four words, which three ``prmt`` gather into one word (byte b = word b's byte w);
    its nibbles then decode as in :func:`_decode_group` (output 2i + h = nibble i + 4h = byte
    i // 2 + 2h, half i % 2, i.e. column 16h + 8(i // 2) + 2w + i % 2)."""
    even, odd = gl.split(gl.reshape(raw, [BLOCK_N, 4, 2, 2]))  # word j = 2 j1 + j0
    v0, v2 = gl.split(even)
    v1, v3 = gl.split(odd)
    lane = gl.arange(0, 4, layout=gl.SliceLayout(0, v0.type.layout))
    # prmt selector: bytes 0, 1 of the result = byte w of the first, of the second operand
    sel = gl.expand_dims(lane + (lane + 4) * 16, 0) + gl.zeros_like(v0)
    ks = gl.convert_layout(ks, v0.type.layout)
    wd = gl.inline_asm_elementwise(
        _GATHER_BYTES, "=r,r,r,r,r,r", [v0, v1, v2, v3, sel], dtype=gl.int32, is_pure=True,
        pack=1,
    )  # fmt: skip
    # output 4 i1 + 2 i0 + h: column 16 h + 8 i1 + 2 w + i0; dims (n, w, h, i0, i1)
    r = gl.permute(_decode_word(wd, ks, True, HI), (0, 2, 4, 1, 3))  # (n, h, i1, w, i0)
    return gl.reshape(r, [BLOCK_N, 32])


@gluon.jit
def _wg_decode_step(buf, BLOCK_N: gl.constexpr, AL: gl.constexpr):
    """A step's A operand (BLOCK_N, 128) bf16, the scales folded into the decode."""
    c0, c1, c2, c3, sw = buf
    k01, k23 = gl.inline_asm_elementwise(
        _FOLD_MULT, "=r,=r,r", [sw], dtype=(gl.int32, gl.int32), is_pure=True, pack=1
    )
    a0 = _wg_decode_group(c0, k01, False, BLOCK_N)
    a1 = _wg_decode_group(c1, k01, True, BLOCK_N)
    a2 = _wg_decode_group(c2, k23, False, BLOCK_N)
    a3 = _wg_decode_group(c3, k23, True, BLOCK_N)
    a = gl.permute(gl.join(gl.join(a0, a1), gl.join(a2, a3)), (0, 3, 2, 1))  # (n, g1, g0, k)
    return gl.convert_layout(gl.reshape(a, [BLOCK_N, 128]), AL)


@gluon.jit
def _wg_copy_step(xs, cs, ss, x_ptrs, c_ptrs, s_ptrs, step, n_steps, STAGES: gl.constexpr):
    """One cp.async group: x of step ``step`` (rows, 128 columns) into stage ``step % STAGES``,
    and the code words (BLOCK_N, 16) and scale words (BLOCK_N,) of step ``step + 1`` into stage
    ``(step + 1) % STAGES`` (the codes run a step ahead: they are decoded once the previous
    step's MMA, issued just before, retired: module doc); past the last step the group is
    empty, so that the wait counts stay uniform.  ``step`` -1 copies the first step's codes
    only."""
    if step < n_steps:
        if step >= 0:
            async_copy.async_copy_global_to_shared(xs.index(step % STAGES), x_ptrs + step * 128)
        if step + 1 < n_steps:
            cst = (step + 1) % STAGES
            async_copy.async_copy_global_to_shared(cs.index(cst), c_ptrs + (step + 1) * 2048)
            async_copy.async_copy_global_to_shared(ss.index(cst), s_ptrs + (step + 1) * 128)
    async_copy.commit_group()


@gluon.jit
def _wg_smem_codes(cs, ss, st, CL: gl.constexpr):
    """Stage ``st``'s code words as four (BLOCK_N, 4 lanes, 4 words) tensors (every lane of a
    quad reads its row's 16 bytes of the group: one broadcast 16-byte shared load) and the
    scale words (BLOCK_N, 4 lanes)."""
    RL: gl.constexpr = gl.SliceLayout(1, CL)
    quad = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
    zq = gl.expand_dims(gl.expand_dims(quad * 0, 0), 2)
    c = cs.index(st)
    c0 = gl.expand_dims(c.slice(0, 4, dim=1).load(RL), 1) + zq
    c1 = gl.expand_dims(c.slice(4, 4, dim=1).load(RL), 1) + zq
    c2 = gl.expand_dims(c.slice(8, 4, dim=1).load(RL), 1) + zq
    c3 = gl.expand_dims(c.slice(12, 4, dim=1).load(RL), 1) + zq
    SR: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, CL))
    sw = gl.expand_dims(ss.index(st).load(SR), 1) + gl.expand_dims(quad * 0, 0)
    return c0, c1, c2, c3, sw


@gluon.jit
def _a_rows(BLOCK_N: gl.constexpr, layout: gl.constexpr, SWIGLU: gl.constexpr):
    """The program's packed weight row (0 .. BLOCK_N - 1) behind each A row.  In order, or with
    SWIGLU so that the gate and up rows of a column sit 8 rows apart in each 16-row slab (A row
    16 s + i <- packed row 16 s + 2 i, gate column 8 s + i; A row 16 s + 8 + i <- 16 s + 2 i
    + 1, its up row): the wgmma accumulator gives a thread rows r and r + 8, so each thread
    then holds both halves of its SwiGLU columns (:func:`_store_swiglu`)."""
    r = gl.arange(0, BLOCK_N, layout=layout)
    if SWIGLU:
        r = (r // 16) * 16 + (r % 8) * 2 + (r % 16) // 8
    return r


@gluon.jit
def _store_swiglu(
    acc, gs_ptr, e, topw_ptr, h_ptr, sorted_ptr, pid_m, pid_n, I, limit,
    BLOCK_N: gl.constexpr, BLOCK_T: gl.constexpr,
):  # fmt: skip
    """The gate/up epilogue in the GEMM (one K split): acc (BLOCK_N A rows in the
    :func:`_a_rows` SwiGLU order, BLOCK_T block rows) -> h rows of the block, columns
    pid_n * BLOCK_N / 2 + (0 .. BLOCK_N / 2 - 1), as ``moe_swiglu_kernel`` computes them
    (kernels/moe_gemm.py, ``_swiglu_store``: the global scales, gate and up rounded to bf16,
    the clamp, silu(gate) * up * the slot's routing weight, one rounding).  Padding rows (slot
    -1) are not written."""
    # (slab, half, i, t) -> gate and up (slab, i, t): the half is a register bit of acc
    gate, up = gl.split(gl.permute(gl.reshape(acc, [BLOCK_N // 16, 2, 8, BLOCK_T]), (0, 2, 3, 1)))
    g = gl.reshape(gate, [BLOCK_N // 2, BLOCK_T])
    u = gl.reshape(up, [BLOCK_N // 2, BLOCK_T])
    L: gl.constexpr = g.type.layout
    c = pid_n * (BLOCK_N // 2) + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, L))
    t = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, L))
    slot = gl.load(sorted_ptr + pid_m * BLOCK_T + t)
    _swiglu_rows(g, u, gs_ptr, e, topw_ptr, h_ptr, slot, pid_m * BLOCK_T + t, c, I, limit)


@gluon.jit
def _swiglu_rows(g, u, gs_ptr, e, topw_ptr, h_ptr, slot, row, c, I, limit):
    """h[row, c] from the summed gate and up values g, u (columns c along dim 0, block rows
    along dim 1, any layout): ``moe_swiglu_kernel``'s epilogue (kernels/moe_gemm.py,
    ``_swiglu_store``) in its order, so the same bits: the global scales, gate and up rounded
    to bf16, the clamp, silu(gate) * up * the slot's routing weight, one rounding.  Padding
    rows (slot -1) are not written."""
    ok = slot >= 0
    g = (g * gl.load(gs_ptr + e * 3)).to(gl.bfloat16).to(gl.float32)
    u = (u * gl.load(gs_ptr + e * 3 + 1)).to(gl.bfloat16).to(gl.float32)
    if limit > 0:
        u = gl.minimum(gl.maximum(u, -limit), limit)
        g = gl.minimum(g, limit)
    h = g / (1.0 + gl.exp(-g)) * u
    w = gl.load(topw_ptr + gl.maximum(slot, 0), mask=ok, other=0.0)
    h = h * gl.expand_dims(w, 0)
    ptrs = h_ptr + gl.expand_dims(row.to(gl.int64) * I, 0) + gl.expand_dims(c, 1)
    mask = gl.expand_dims(c >= 0, 1) & gl.expand_dims(ok, 0)
    gl.store(ptrs, h.to(gl.bfloat16), mask=mask)


@gluon.jit
def _swiglu_after_splits(
    part_ptr, count_ptr, gs_ptr, e, topw_ptr, h_ptr, sorted_ptr, pid_m, pid_n, N, ROWS_PART,
    limit, SPLIT_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_T: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):  # fmt: skip
    """The mma_v2 gate/up's SwiGLU in the same launch: the last of the tile's SPLIT_K programs
    to store its partials (a ticket on the tile's counter; with one split the program itself)
    reads the tile's [gate ; up] partials back from L2, sums them in split order 0..SPLIT_K-1
    from zero (``moe_swiglu_kernel``'s sum) and writes the tile's h columns
    pid_n * BLOCK_N / 2 + (0 .. BLOCK_N / 2 - 1) of the block's rows (:func:`_swiglu_rows`).

    Memory model: as kernels/linear.py's split-K reduction.  The barrier orders every thread's
    partial stores before the ticket's acq_rel atomic (one thread, gpu scope, its release
    cumulative); the program drawing SPLIT_K - 1 has synchronized with all earlier releases, a
    barrier orders its threads' loads after the atomic, and the loads are ``.cg`` (L2, the
    coherence point).  It then sets the counter back to zero: no program of the launch touches
    it again, and the next launch starts after this one ends."""
    I = N // 2
    gl.thread_barrier()
    last = True
    if SPLIT_K > 1:
        tile = pid_m * (N // BLOCK_N) + pid_n
        last = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    if last:
        gl.thread_barrier()
        HC: gl.constexpr = BLOCK_N // 2
        L: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, NUM_WARPS], [0, 1])
        c = pid_n * HC + gl.arange(0, HC, layout=gl.SliceLayout(1, L))
        t = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, L))
        row = pid_m * BLOCK_T + t
        slot = gl.load(sorted_ptr + row)
        mask = gl.expand_dims(c >= 0, 1) & gl.expand_dims(slot >= 0, 0)
        g = gl.zeros([HC, BLOCK_T], gl.float32, layout=L)
        u = gl.zeros([HC, BLOCK_T], gl.float32, layout=L)
        for s in gl.static_range(SPLIT_K):
            ptrs = (
                part_ptr
                + gl.expand_dims((s * ROWS_PART + row).to(gl.int64) * N, 0)
                + gl.expand_dims(c, 1)
            )
            g += gl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            u += gl.load(ptrs + I, mask=mask, other=0.0, cache_modifier=".cg")
        _swiglu_rows(g, u, gs_ptr, e, topw_ptr, h_ptr, slot, row, c, I, limit)
        if SPLIT_K > 1:
            gl.store(count_ptr + pid_m * (N // BLOCK_N) + pid_n, 0)


@gluon.jit
def moe_mx_wgmma_kernel(
    x_ptr,  # *bf16: activations (rows, K)
    w_ptr,  # *i32: codes, tiles layout, (E, N, K/8) words
    s_ptr,  # *i32: e8m0 scales, tiles layout, (E, N, K/128) words
    sorted_ptr,  # *i32 (num_blocks * BLOCK_T,): slot of each M-block row, -1 = padding
    block_expert_ptr,  # *i32 (num_blocks,): expert of each M block, -1 = unused
    part_ptr,  # *fp32 (SPLIT_K, ROWS_PART, N); with SWIGLU unused
    gs_ptr,  # *fp32 (E, 3): global scales (SWIGLU)
    topw_ptr,  # *fp32 (T * TOPK,): routing weight of each slot (SWIGLU)
    h_ptr,  # *bf16 (num_blocks * BLOCK_T, N / 2): the SwiGLU rows (SWIGLU)
    K,
    N,
    TOPK,
    W_STRIDE_E,
    S_STRIDE_E,
    ROWS_PART,
    limit,
    GATHER: gl.constexpr,
    BLOCK_T: gl.constexpr,
    SPLIT_K: gl.constexpr,
    STAGES: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    SWIGLU: gl.constexpr,
):
    BLOCK_N: gl.constexpr = 16 * NUM_WARPS
    MMA: gl.constexpr = _wg_mma_layout(NUM_WARPS, BLOCK_T)
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    CL: gl.constexpr = _wg_code_layout(NUM_WARPS)
    # x: 16-byte pieces, a warp covers 2 rows x 128 columns
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    # N tiles fastest: the programs of one M block run together and share its x rows in L2
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    e = gl.load(block_expert_ptr + pid_m)
    if e >= 0:  # unused M blocks stream no weights
        e64 = e.to(gl.int64)
        k_lo, n_steps, KS = _k_slice(K, pid_s, SPLIT_K)
        _, x_row = _block_rows(sorted_ptr, pid_m, TOPK, GATHER, BLOCK_T, gl.SliceLayout(1, XL))
        xc = gl.arange(0, 128, layout=gl.SliceLayout(0, XL))
        x_ptrs = x_ptr + k_lo + gl.expand_dims(x_row.to(gl.int64) * K, 1) + gl.expand_dims(xc, 0)
        w_base = w_ptr + e64 * W_STRIDE_E + (k_lo // 128) * 2048
        s_base = s_ptr + e64 * S_STRIDE_E + (k_lo // 128) * 128
        xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, 128], XS)
        acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=MMA)
        # code words ((n // 128) * KS + step) * 2048 + (n % 128) * 16 + word, 16 per row;
        # scale words ((n // 128) * KS + step) * 128 + n % 128
        CPL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [NUM_WARPS, 1], [1, 0])
        crow = pid_n * BLOCK_N + _a_rows(BLOCK_N, gl.SliceLayout(1, CPL), SWIGLU)
        cword = gl.arange(0, 16, layout=gl.SliceLayout(0, CPL))
        c_ptrs = (
            w_base
            + gl.expand_dims((crow // 128) * (KS * 2048) + (crow % 128) * 16, 1)
            + gl.expand_dims(cword, 0)
        )
        SPL: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        srow = pid_n * BLOCK_N + _a_rows(BLOCK_N, SPL, SWIGLU)
        sc_ptrs = s_base + (srow // 128) * (KS * 128) + srow % 128
        # 16-byte chunks XOR-swizzled by row pair: a warp's eight rows of one group hit
        # distinct banks
        CS: gl.constexpr = gl.SwizzledSharedLayout(4, 2, 4, order=[1, 0])
        cs = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16], CS)
        ss = gl.allocate_shared_memory(
            gl.int32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        # x runs STAGES - 2 steps ahead, the codes one more: iteration i refills the x stage of
        # step i - 2 and the code stage of step i - 1 (with every MMA waited for within its
        # step, STAGES - 1 ahead would do: one stage of each ring is idle, not measured yet)
        for i in gl.static_range(-1, STAGES - 2):
            _wg_copy_step(xs, cs, ss, x_ptrs, c_ptrs, sc_ptrs, i, n_steps, STAGES)
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        a = _wg_decode_step(_wg_smem_codes(cs, ss, 0, CL), BLOCK_N, AL)
        for i in range(n_steps):
            # step i's x and step i + 1's codes have landed for every thread, visible to
            # the async proxy; every warpgroup retired the MMA of step i - 1
            async_copy.wait_group(STAGES - 3)
            fence_async_shared()
            gl.thread_barrier()
            _wg_copy_step(xs, cs, ss, x_ptrs, c_ptrs, sc_ptrs, i + STAGES - 2, n_steps, STAGES)
            acc = warpgroup_mma(a, xs.index(i % STAGES).permute((1, 0)), acc, is_async=True)
            # decode step i + 1 (ptxas waits for step i's MMA first: the decode writes the
            # registers that MMA reads; module doc)
            a_next = _wg_decode_step(_wg_smem_codes(cs, ss, (i + 1) % STAGES, CL), BLOCK_N, AL)
            # all of step i's MMA retired before the barrier
            acc, a = warpgroup_mma_wait(0, deps=(acc, a_next))
        async_copy.wait_group(0)

        if SWIGLU:
            _store_swiglu(
                acc, gs_ptr, e64, topw_ptr, h_ptr, sorted_ptr, pid_m, pid_n, N // 2, limit,
                BLOCK_N, BLOCK_T,
            )  # fmt: skip
        else:
            _store_partials(
                part_ptr, acc, sorted_ptr, pid_m, pid_n, pid_s, N, ROWS_PART, GATHER, BLOCK_N,
                BLOCK_T, MMA,
            )  # fmt: skip


# ----------------------------------------------------------------------------- launcher
def uses_wgmma(tile: GemmTile, block_m: int, fold: bool) -> bool:
    """Which Gluon kernel :func:`moe_mx_gluon` runs: the wgmma kernel on 64- and 128-row M
    blocks, and on 32-row blocks when the scales fold and the tile is a wgmma tile (16 weight
    rows per warp on 4 or 8 warps, three or more stages); the mma_v2 kernel otherwise.  On the
    H200 the wgmma kernel on 32-row blocks beats mma_v2 on 16- and 32-row blocks from about
    ~24 rows per expert (T 1024: gate/up 1218 against 1744 us, down 660 against 918), not at
    ~12 (T 512: 1160 against 1017; bench/results/moe-h200.md, "wgmma on 32-row blocks")."""
    if block_m >= 64:
        return True
    return (
        block_m == 32
        and fold
        and tile.num_warps in (4, 8)
        and tile.block_n == 16 * tile.num_warps
        and tile.num_stages >= 3
    )


def gluon_tile_ok(tile: GemmTile, block_m: int, K: int, N: int, fold: bool = True) -> bool:
    """Whether these kernels run ``tile`` at this shape: 128-column K steps, K a multiple of
    128 x ``split_k``, and ``block_n`` weight rows dividing N.  The mma_v2 kernel (8-, 16- or
    32-row M blocks, its N): ``block_n`` = 16 x (1, 2 or 4) x ``num_warps``.  The wgmma kernel
    (:func:`uses_wgmma`: 64- or 128-row blocks, or 32-row blocks with a wgmma tile and folded
    scales; the blocks are its N): ``block_n`` = 16 x ``num_warps`` (4 or 8 warps: one or two
    warpgroups of 64 rows), at least 3 stages (a step's copies run ``num_stages - 2`` steps
    ahead) and no more than fit the 227 KiB of shared memory a block may have on sm_90 (5 at
    128-row blocks), and the scales folded into the decode (``fold``)."""
    if tile.block_k != 128 or K % (128 * tile.split_k) or N % tile.block_n:
        return False
    if uses_wgmma(tile, block_m, fold):
        stage = block_m * _WG_STAGE_BYTES_PER_T + tile.block_n * _WG_STAGE_BYTES_PER_N
        return (
            fold
            and block_m in (32, 64, 128)
            and tile.num_warps in (4, 8)
            and tile.block_n == 16 * tile.num_warps
            and tile.num_stages >= 3
            and tile.num_stages * stage <= _SM90_SMEM
        )
    m_tiles, rem = divmod(tile.block_n, 16 * tile.num_warps)
    return block_m in (8, 16, 32) and rem == 0 and m_tiles in (1, 2, 4)


def gluon_applies(
    x: torch.Tensor, codes: torch.Tensor, tile: GemmTile, block_m: int, fold: bool = True
) -> bool:
    """Whether :func:`moe_mx_gluon` takes this call: :func:`gluon_tile_ok` at x's K and the
    codes' N, and x and the codes contiguous at 4-byte aligned addresses (the kernels read
    the codes as int32 words, and the mma_v2 kernel x too; a view at an odd bf16 offset, valid
    for the Triton kernels, is not); for the wgmma kernel 16-byte aligned x (its copies) and,
    on CUDA, an sm_90 device (wgmma is Hopper's)."""
    wg = uses_wgmma(tile, block_m, fold)
    return (
        gluon_tile_ok(tile, block_m, x.shape[1], codes.shape[1], fold)
        and x.is_contiguous()
        and codes.is_contiguous()
        and x.data_ptr() % (16 if wg else 4) == 0
        and codes.data_ptr() % 4 == 0
        and not (wg and x.is_cuda and _capability(x.device.index) != (9, 0))
    )


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def moe_mx_gluon(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    sorted_slot: torch.Tensor,
    block_expert: torch.Tensor,
    part: torch.Tensor,
    *,
    gather: bool,
    top_k: int,
    tile: GemmTile,
    block_m: int,
    fold: bool = False,
    swiglu: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Write the split-K partials ``part`` (split, rows_part, N) fp32 of x's rows times the
    MXFP4 experts (module doc): gate/up with ``gather`` (x (T, K) read at the slots' tokens,
    rows of ``part`` = M-block rows, columns [gate ; up]), down without (x = h (blocks *
    block_m, K), rows of ``part`` = slots).  The caller checks :func:`gluon_applies`, the tiles
    layout and x bf16 contiguous; ``fold`` only for scale bytes <= 128.  The kernel:
    :func:`uses_wgmma` (wgmma on 64- and 128-row blocks and on 32-row blocks with a wgmma
    tile and folded scales, mma_v2 otherwise).  ``swiglu`` = (gscale (E, 3), topk weights
    (T * top_k,), h (blocks * block_m, N / 2) bf16, limit): the wgmma kernel's gate/up with one
    K split writes the SwiGLU rows h itself (``moe_swiglu_kernel``'s function, fused: no
    partials; ``part`` is then unused); the mma_v2 kernel writes its partials, then each tile's
    last split writes the tile's h (:func:`_swiglu_after_splits`), counting splits on
    ``counters`` (int32 zeros, at least ``num_blocks * N / tile.block_n``, left zeroed; None:
    the stream's zeroed counters, kernels/_sync.py; unused with one split)."""
    num_m = block_expert.numel()
    K = x.shape[1]
    N = codes.shape[1]
    split = tile.split_k
    w32 = codes.view(torch.int32)
    s32 = scales.view(torch.int32)
    if uses_wgmma(tile, block_m, fold):
        if swiglu is not None:
            assert gather and split == 1, "the SwiGLU epilogue: gate/up, one K split"
            gs, topw, h, limit = swiglu
        else:
            gs = topw = h = part
            limit = 0.0
        triton_launch(
            moe_mx_wgmma_kernel, GATHER=gather, BLOCK_T=block_m, SPLIT_K=split,
            STAGES=tile.num_stages, NUM_WARPS=tile.num_warps, SWIGLU=swiglu is not None,
            num_warps=tile.num_warps,
        )(
            (N // tile.block_n, num_m, split), x, w32, s32, sorted_slot, block_expert, part,
            gs, topw, h, K, N, top_k, w32[0].numel(), s32[0].numel(), part.shape[1],
            float(limit),
        )  # fmt: skip
        return
    if swiglu is not None:
        assert gather, "the SwiGLU tail: gate/up"
        gs, topw, h, limit = swiglu
        cnt = block_expert  # unused with one split (no tickets)
        if split > 1:
            tiles = num_m * (N // tile.block_n)
            if counters is None:
                counters = zeroed_counters(x.device, tiles)
            if counters.dtype != torch.int32 or counters.numel() < tiles:
                raise InputError(
                    f"counters: the SwiGLU tail of a {split}-way K split needs int32 zeros, one "
                    f"per tile ({tiles}), got {counters.dtype} of {counters.numel()}"
                )
            cnt = counters
    else:
        gs = topw = h = part
        cnt, limit = block_expert, 0.0
    triton_launch(
        moe_mx_gluon_kernel, GATHER=gather, BLOCK_T=block_m,
        M_TILES=tile.block_n // (16 * tile.num_warps), SPLIT_K=split, FOLD=fold,
        NUM_WARPS=tile.num_warps, SWIGLU=swiglu is not None, num_warps=tile.num_warps,
    )(
        (num_m, N // tile.block_n, split), x.view(torch.int32), w32, s32, sorted_slot,
        block_expert, part, gs, topw, h, cnt, K, N, top_k, w32[0].numel(), s32[0].numel(),
        part.shape[1], float(limit),
    )  # fmt: skip
