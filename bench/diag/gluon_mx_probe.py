"""MXFP4 expert GEMM at decode sizes written in Gluon: fewer SASS instructions per weight.

Computes y (T, N) fp32 = x (T, K) bf16 @ W^T for MXFP4 weights in the checkpoint's layout:
codes (N, K/2) uint8 (byte j of row n: column 2j in the low nibble, 2j+1 in the high nibble;
e2m1 = sign bit 3, exponent bits 2-1, mantissa bit 0), scales (N, K/32) e8m0 bytes
(2**(byte - 127)), T <= 16 tokens.  The Triton kernel it is measured against
(optimized/kernels/moe_gemm.py, ``decode="mxdot"``) issues about 4.2-4.5 SASS instructions
per weight and thread in its main loop; here the register layout is ours.

The production kernel derived from this probe, optimized/kernels/moe_gemm_gluon.py
(``decode="gluon"``: tiles layout, x re-paired in the kernel, fold chained or f32), holds the
code the two share, imported here: the decode PTX (``_decode_ptx``) and the fold multipliers
(``_FOLD_MULT``), the layouts (``_mma_layout``, ``_word_layout``, ``_x_layout``), the group
decode (``_decode_group``) and the in-kernel x re-pairing (``_x_group``).  This script adds
the variants production does not run: the rows and tiles16 weight layouts, x stored permuted,
fold without chain, two steps of register prefetch.

Design (one program: ``16 * M_TILES * num_warps`` weight rows, all T tokens, one K slice):

* ``mma_v2`` m16n8k16 bf16 -> fp32, the weights as operand A (M = weight rows), x^T as B
  (N = tokens, 8 per MMA tile, two tiles for T <= 16).  One ``mma_v2`` per 32-column scale
  group (K = 32, ``DotOperandLayout(k_width=4)``): thread ``tig = lane % 4`` holds logical k
  ``{4 tig .. 4 tig + 3} U {16 + 4 tig .. 16 + 4 tig + 3}`` of rows ``lane // 4`` (+ 8, and
  one such pair of rows per M tile).
* K is permuted inside each group (x the same way, so the dot is unchanged): logical
  ``k = 16 c + 4 w + 2 a + h`` is original column ``8 w + (2 c + a) + 4 h``.  Thread ``tig``
  then needs exactly code word ``w = tig`` of the group (bytes 4 tig .. 4 tig + 3: one 32-bit
  load per row and group), and its four bf16x2 A registers pair nibble i with nibble i + 4
  (bits 4i.. and 4i+16.. of the word), which one mask + one multiply + one mask decode
  for both halves at once.  x's side: one 16-byte load of columns 8 tig .. 8 tig + 7 of the
  thread's token; ``x_perm`` (default): the host stored x in the permuted order
  (:func:`k_permutation`; in the MoE the kernel producing x or h could write it so), and the
  loaded registers are the B operand as they are; else four ``prmt`` re-pair (x0, x4), (x1,
  x5), (x2, x6), (x3, x7).  x travels through the loop as 32-bit words (as bf16 halves ptxas
  shuffled them with extra prmt / mov).  x has BLOCK_T rows (zeros past T: no load masks).
  The code words are a ``DistributedLinearLayout`` tensor (rows x 4 words) whose decoded
  halves are joined / permuted / reshaped into the A operand; the conversion to the
  ``DotOperandLayout`` is register renaming only (no shared memory, no shuffles: ``--sass``
  counts LDS/STS/SHFL in the loop).
* Decode (PTX via ``gl.inline_asm_elementwise``, per code word -> 8 bf16): for the nibble pair
  at bits 0..3 / 16..19, ``t = w & 0x000F000F``; ``t * (2**6 + 2**12)`` puts a copy of each
  nibble at bits 6..9 and one at 12..15 (no carries: the copies do not overlap), and
  ``& 0x81C081C0`` keeps magnitude bits 6..8 (bf16 exponent LSBs + mantissa MSB) and the sign
  at 15 (31 for the high half): the bf16 whose value is ``e2m1 * 2**-126`` (codes +-0.5 land on
  a bf16 subnormal).  Nibbles at 4..7 use ``2**2 + 2**8``; nibbles 2, 3, 6, 7 the word
  shifted right by 8.  One ``mul.rn.bf16x2`` restores the value: by ``2**126`` (mode f32), or
  by ``2**(s - 1)`` = ``2**126 * scale`` (mode fold), which applies the group's e8m0 scale
  exactly in bf16 (a power of two times an e2m1 value; bf16 keeps fp32's exponent range; for
  scale bytes 0 and 1 the product is a bf16 subnormal, which sm_90's bf16 multiply keeps).
  ``--bits`` checks the trick on all 256 bytes in numpy, and the fold products' exactness.
* Scales: one 32-bit load per row per 128 columns (four e8m0 bytes).  ``fold``: a ``prmt`` of
  two groups' bytes + one ``mad`` build the bf16x2 multipliers of two groups; the decode's
  ``mul.rn.bf16x2`` takes its group's half broadcast (``.H0_H0`` / ``.H1_H1``: an operand
  modifier, no instruction); the MMAs accumulate in fp32 with no per-group fp32 work (chain:
  the step's four MMAs into one partial, added to the accumulator once per step).  Limit: the
  bf16 multiplier ``2**(s - 1)`` needs s <= 128 (scale <= 2; MXFP4 weight scales sit far
  below; a larger byte would need a per-expert rebias into the global scale).  ``f32`` (the
  rule of the current kernel): each group's MMA starts from zero and its fp32 partial is
  multiplied by the fp32 scale (byte 0 -> the subnormal 2**-127, built from bits) and added:
  exact for every byte, one FFMA per accumulator element and group more.
* Loads: the next 128-column step's code words, scale words and x are loaded into registers
  before the current step's decode and MMAs (one step of register prefetch; a two-buffer
  loop of two steps per iteration measured more instructions); K split over a grid axis
  (fp32 partials summed on the host); a grid axis over E experts.

Measured (sm_90 SASS offline; one H200 session, --check and --bench of this version):

* ``--sass``, T <= 8, 128 rows (4 warps x 2 M tiles), per weight and thread in the main loop:
  fold (+ chain, the default) 2.92 (84 registers, no spills, no shared memory; per 128
  weights: LOP3 128, IMAD 96 (64 of them the decode multiply), HMUL2 64, LDG 24, SHF 16,
  HMMA 16, LEA 10, PRMT 8, FADD 8); fold without chain 3.24; f32 3.56 (+ FFMA 32, SEL /
  ISETP building the fp32 scales); in-kernel x re-pairing (x_prmt) +0.03; T <= 16: 3.27 /
  3.75 / 4.27.  The Triton ``mxdot`` kernel at its T 1 / 8 schedules: 4.53 (72 registers,
  21 KB shared memory; PRMT 162, IMAD 115, LOP3 66, SHF 55, FFMA 32, LDS 15, LDSM 4, STS 4,
  BAR 8 in the loop).  No LDS / STS / SHFL / BAR in any Gluon loop.  Left: ~30 IMAD.MOV /
  IMAD.WIDE (loop-carried copies, per-step pointers).
* ``--check``: PASS, every mode, T 1..16, K splits 1-4: |err| / (|x| @ |W|^T) <= 1.8e-7,
  max |err| / max |ref| <= 3.2e-7; rows with scale byte 0 / 1 <= 2.6e-8 (the bf16 subnormal
  weights survive HMUL2 and HMMA).
* ``--bench --peer`` (copy read + write 2.76 TB/s that run): one matrix per launch, fold,
  K split 8, vs the Triton kernel's default schedule: gate/up T 1 9.4 vs 9.6 us, T 8 9.6 vs
  16.3 us; down T 1 6.2 vs 6.0 us, T 8 6.4 vs 9.4 us.  Eight matrices per launch (split 2):
  4.3 us per gate/up matrix, 2.3 us per down matrix: 1.95-2.1 TB/s of weight bytes, the
  f32 mode within 3 % of fold: at these grids the time is not set by instruction issue.

Commands:

    python bench/diag/gluon_mx_probe.py --sass     # no GPU: sm_90 SASS counts, ours vs Triton
    python bench/diag/gluon_mx_probe.py --bits     # no GPU: the decode bit trick, all bytes
    python3 bench/diag/gluon_mx_probe.py --check   # GPU: vs a float64 reference
    python3 bench/diag/gluon_mx_probe.py --bench --peer  # GPU: us, GB/s vs copy, Triton peer

``--sass`` prints, per kernel: registers, spill stack, shared memory, the main loop's SASS
instruction count (``bench/sm90_resources.py``'s rule: the longest backward branch) per weight
and thread, and the loop's opcodes.  ``--check`` compares both modes at T 1, 5, 8, 16 with
random codes (all 256 bytes), scale bytes 100..128 plus 0 and 1, random bf16 x, against a
float64 reference: |y - ref| / (|x| @ |W|^T) (the scale of fp32 accumulation error; a plain
relative error blows up where a dot product cancels), separately for rows with scale byte
0 / 1, and max |y - ref| / max |ref|.
``--bench`` times V4-Flash expert shapes (gate/up N 4096 K 4096, down N 4096 K 2048) at T 1
and 8 with 16 distinct weight matrices rotated (past the 60 MB L2), CUDA graphs, and prints
the weight bytes' (codes + scales) GB/s next to the same run's device copy bandwidth (1 GB);
with ``--peer``, also the current Triton kernel (``moe_down_triton``, identity rows, its
default schedule) on the same matrices.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from dsv4mtp.optimized.kernels.moe_gemm_gluon import (
    _FOLD_MULT,
    _decode_group,
    _mma_layout,
    _word_layout,
    _x_layout,
)
from dsv4mtp.optimized.kernels.moe_gemm_gluon import _x_group as _x_group_prmt

ROOT = Path(__file__).resolve().parents[2]
TARGET = GPUTarget("cuda", 90, 32)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------- layouts
# (_mma_layout, _word_layout and _x_layout: moe_gemm_gluon's, imported above)
@gluon.constexpr_function
def _word16_layout(m_tiles, num_warps):
    """(rows, 4 words, 4 groups) for ``tiles16``: a thread's four group words in registers
    (one 16-byte load), otherwise :func:`_word_layout` (group bases first)."""
    wl = _word_layout(m_tiles, num_warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2]] + [[*b, 0] for b in wl.reg_bases],
        lane_bases=[[*b, 0] for b in wl.lane_bases],
        warp_bases=[[*b, 0] for b in wl.warp_bases],
        block_bases=[],
        shape=[*wl.shape, 4],
    )


# ----------------------------------------------------------------------------- kernel
@gluon.jit
def _x_group(x_words, BLOCK_T: gl.constexpr, X_PERM: gl.constexpr):
    """x words (16, BLOCK_T) int32 (bf16 pairs, as stored) -> (32, BLOCK_T) bf16 in the
    permuted-K order of the A tile.  moe_gemm_gluon's ``_x_group`` reads x stored in original
    order (position 8 w + 4 h + 2 c + a; four prmt per thread re-pair the registers).  With
    X_PERM the host stored x permuted (:func:`k_permutation`: position 8 w + 4 c + 2 a + h), so
    that helper's output dims (c, w, a, h) hold (a, w, h, c); permuting them back leaves every
    bf16 in the register it was loaded into: register renaming only, no prmt."""
    xt = _x_group_prmt(x_words, BLOCK_T)
    if X_PERM:
        xv = gl.permute(gl.reshape(xt, [2, 4, 2, 2, BLOCK_T]), (3, 1, 0, 2, 4))  # (c, w, a, h, t)
        xt = gl.reshape(xv, [32, BLOCK_T])
    return xt


@gluon.jit
def _compute_step(
    acc, buf, BLOCK_N: gl.constexpr, BLOCK_T: gl.constexpr, FOLD: gl.constexpr,
    CHAIN: gl.constexpr, X_PERM: gl.constexpr, MMA: gl.constexpr,
):  # fmt: skip
    """acc += the step's four groups (``buf`` = :func:`_load_step`'s code words 0..3, scale
    word 4, x words 5..8): decode, MMA (fold: chained from zero over the step, then one fp32
    add; f32: each group from zero, then its fp32 partial times its scale).  moe_gemm_gluon's
    ``_compute_step`` is this with CHAIN = FOLD and x re-paired in the kernel."""
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    sw = buf[4]
    # fold + CHAIN (default): the step's four MMAs chain from zero into one partial, added to
    # acc in fp32 (one FADD per accumulator element and step); fold without CHAIN: each
    # group's MMA from zero and its own FADD (24 FADD more per step, same error).  Chaining
    # every MMA of the K loop into acc (the first version) measured 1.4e-6 of |x| @ |W|^T at
    # K 2048 against 1-2e-7 for both of these: the tensor core's fp32 accumulation loses low
    # bits over long chains.
    part = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=MMA)
    if FOLD:
        # bf16x2 multipliers 2**(s - 1) of groups (0, 1) and (2, 3)
        k01, k23 = gl.inline_asm_elementwise(
            _FOLD_MULT, "=r,=r,r", [sw], dtype=(gl.int32, gl.int32), is_pure=True, pack=1
        )
    for g in gl.static_range(4):
        ks = (k01 if g < 2 else k23) if FOLD else sw
        a = gl.convert_layout(_decode_group(buf[g], ks, FOLD, g % 2 == 1, BLOCK_N), AL)
        b = gl.convert_layout(_x_group(buf[5 + g], BLOCK_T, X_PERM), BL)
        if FOLD and CHAIN:
            part = mma_v2(a, b, part)
        elif FOLD:
            acc = acc + mma_v2(a, b, gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=MMA))
        else:
            pg = mma_v2(a, b, gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=MMA))
            sb = (sw >> (8 * g)) & 0xFF
            # 2**(sb - 127); byte 0 is the fp32 subnormal 2**-127
            sf = gl.where(sb == 0, 0x400000, sb << 23).to(gl.float32, bitcast=True)
            acc = acc + pg * gl.expand_dims(sf, 1)
    if FOLD and CHAIN:
        acc = acc + part
    return acc


@gluon.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, step, W_STEP: gl.constexpr, S_STEP: gl.constexpr,
               LAYOUT: gl.constexpr, WL: gl.constexpr):  # fmt: skip
    """Registers of one 128-column step: 4 code words and the scale word per row, x words.
    W_STEP / S_STEP: words between consecutive steps of one row (rows: 16 / 1; tiles: one
    8 KiB code block = 2048 words / one 512-byte scale block = 128 words).  LAYOUT 2
    (``tiles16``): a thread's four group words of a row are one 16-byte run (one load)."""
    if LAYOUT == 2:
        c = gl.load(w_ptrs + step * W_STEP)  # (rows, 4 words, 4 groups)
        c = gl.reshape(c, [c.shape[0], 4, 2, 2])  # (rows, word, g // 2, g % 2)
        ce, co = gl.split(c)
        c0, c2 = gl.split(ce)
        c1, c3 = gl.split(co)
        c0 = gl.convert_layout(c0, WL)
        c1 = gl.convert_layout(c1, WL)
        c2 = gl.convert_layout(c2, WL)
        c3 = gl.convert_layout(c3, WL)
    else:
        c0 = gl.load(w_ptrs + step * W_STEP)
        c1 = gl.load(w_ptrs + (step * W_STEP + 4))
        c2 = gl.load(w_ptrs + (step * W_STEP + 8))
        c3 = gl.load(w_ptrs + (step * W_STEP + 12))
    sw = gl.load(s_ptrs + step * S_STEP)
    x0 = gl.load(x_ptrs + step * 64)
    x1 = gl.load(x_ptrs + (step * 64 + 16))
    x2 = gl.load(x_ptrs + (step * 64 + 32))
    x3 = gl.load(x_ptrs + (step * 64 + 48))
    return c0, c1, c2, c3, sw, x0, x1, x2, x3


@gluon.jit
def mx_gemm_kernel(
    w_ptr,  # *i32 code words (E, N, K/8)
    s_ptr,  # *i32 scale words (E, N, K/128)
    x_ptr,  # *i32: x (BLOCK_T, K) bf16 as words: T token rows, zero rows up to BLOCK_T (X_PERM:
    # columns permuted, see k_permutation)
    y_ptr,  # *fp32 partials (E, SPLIT_K, T, N)
    T,
    N,
    K,
    W_STRIDE_E,
    S_STRIDE_E,
    BLOCK_T: gl.constexpr,
    M_TILES: gl.constexpr,
    SPLIT_K: gl.constexpr,
    FOLD: gl.constexpr,
    CHAIN: gl.constexpr,
    X_PERM: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    LAYOUT: gl.constexpr = 0,
    PREFETCH: gl.constexpr = 1,
):
    BLOCK_N: gl.constexpr = 16 * M_TILES * NUM_WARPS
    MMA: gl.constexpr = _mma_layout(NUM_WARPS)
    WL: gl.constexpr = _word_layout(M_TILES, NUM_WARPS)
    XL: gl.constexpr = _x_layout(BLOCK_T, NUM_WARPS)
    SL: gl.constexpr = gl.SliceLayout(1, MMA)

    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    e = gl.program_id(2).to(gl.int64)
    kslice = K // SPLIT_K
    k_lo = pid_s * kslice
    n_steps = kslice // 128

    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WL))
    words = gl.arange(0, 4, layout=gl.SliceLayout(0, WL))
    KS = K // 128
    if LAYOUT == 0:
        # checkpoint rows: word (n, k / 8)
        W_STEP: gl.constexpr = 16
        S_STEP: gl.constexpr = 1
        w_base = w_ptr + e * W_STRIDE_E + k_lo // 8
        w_ptrs = w_base + gl.expand_dims(rows * (K // 8), 1) + gl.expand_dims(words, 0)
        s_base = s_ptr + e * S_STRIDE_E + k_lo // 128
        s_row = rows * KS
        s_srow = (pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=SL)) * KS
    else:
        # tiles: ((n // 128) * KS + step) * 2048 + (n % 128) * 16 + 4 g + word
        W_STEP: gl.constexpr = 2048
        S_STEP: gl.constexpr = 128
        w_base = w_ptr + e * W_STRIDE_E + (k_lo // 128) * 2048
        wrow = (rows // 128) * (KS * 2048) + (rows % 128) * 16
        if LAYOUT == 1:
            w_ptrs = w_base + gl.expand_dims(wrow, 1) + gl.expand_dims(words, 0)
        else:
            # tiles16: ... + (n % 128) * 16 + 4 word + g
            W3: gl.constexpr = _word16_layout(M_TILES, NUM_WARPS)
            r3 = pid_n * BLOCK_N + gl.arange(
                0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, W3))
            )
            w3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, W3)))
            g3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, W3)))
            off = gl.expand_dims((r3 // 128) * (KS * 2048) + (r3 % 128) * 16, 1) + gl.expand_dims(
                w3 * 4, 0
            )
            w_ptrs = w_base + gl.expand_dims(off, 2) + gl.expand_dims(gl.expand_dims(g3, 0), 1)
        s_base = s_ptr + e * S_STRIDE_E + (k_lo // 128) * 128
        s_row = (rows // 128) * (KS * 128) + rows % 128
        srows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=SL)
        s_srow = (srows // 128) * (KS * 128) + srows % 128
    if FOLD:
        s_ptrs = s_base + gl.expand_dims(s_row, 1) + gl.expand_dims(words * 0, 0)
    else:
        s_ptrs = s_base + s_srow
    xc = gl.arange(0, 16, layout=gl.SliceLayout(1, XL))
    xt = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, XL))
    x_ptrs = x_ptr + k_lo // 2 + gl.expand_dims(xt * (K // 2), 0) + gl.expand_dims(xc, 1)

    # one step of register prefetch: step i + 1 is loaded before step i is computed (a
    # two-buffer loop over two steps per iteration measured more instructions: ptxas then
    # re-loaded and copied more, not less)
    acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=MMA)
    if PREFETCH == 1:
        buf = _load_step(w_ptrs, s_ptrs, x_ptrs, 0, W_STEP, S_STEP, LAYOUT, WL)
        for i in range(n_steps):
            nxt = _load_step(
                w_ptrs, s_ptrs, x_ptrs, gl.minimum(i + 1, n_steps - 1), W_STEP, S_STEP, LAYOUT, WL
            )
            acc = _compute_step(acc, buf, BLOCK_N, BLOCK_T, FOLD, CHAIN, X_PERM, MMA)
            buf = nxt
    else:
        # two steps of register prefetch
        b0 = _load_step(w_ptrs, s_ptrs, x_ptrs, 0, W_STEP, S_STEP, LAYOUT, WL)
        b1 = _load_step(w_ptrs, s_ptrs, x_ptrs, gl.minimum(1, n_steps - 1), W_STEP, S_STEP,
                        LAYOUT, WL)  # fmt: skip
        for i in range(n_steps):
            nxt = _load_step(
                w_ptrs, s_ptrs, x_ptrs, gl.minimum(i + 2, n_steps - 1), W_STEP, S_STEP, LAYOUT, WL
            )
            acc = _compute_step(acc, b0, BLOCK_N, BLOCK_T, FOLD, CHAIN, X_PERM, MMA)
            b0 = b1
            b1 = nxt

    yn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=SL)
    yt = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, MMA))
    y_base = y_ptr + (e * SPLIT_K + pid_s) * T * N
    y_ptrs = y_base + gl.expand_dims(yt * N, 0) + gl.expand_dims(yn, 1)
    gl.store(y_ptrs, acc, mask=gl.expand_dims(yt < T, 0))


def k_permutation(K: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Column order of x for X_PERM: position 32 G + 8 w + 4 c + 2 a + h holds original column
    32 G + 8 w + 2 c + a + 4 h (the A tile's permuted-K order, stored so that each thread's
    16-byte load is already in register order)."""
    p = torch.arange(K, device=device)
    g, w, c, a, h = p // 32, p // 8 % 4, p // 4 % 2, p // 2 % 2, p % 2
    return 32 * g + 8 * w + 2 * c + a + 4 * h


def prepare_x(x: torch.Tensor, x_perm: bool) -> torch.Tensor:
    """x (T, K) -> the kernel's x: BLOCK_T rows (zero padded), permuted with ``x_perm``."""
    T, K = x.shape
    block_t = 8 if T <= 8 else 16
    out = torch.zeros((block_t, K), dtype=torch.bfloat16, device=x.device)
    out[:T] = x[:, k_permutation(K, x.device)] if x_perm else x
    return out


def mx_gemm(
    xk: torch.Tensor,
    T: int,
    w: torch.Tensor,
    s: torch.Tensor,
    *,
    fold: bool = True,
    chain: bool = True,
    x_perm: bool = True,
    split_k: int = 1,
    m_tiles: int = 2,
    num_warps: int = 4,
    layout: str = "rows",
    prefetch: int = 1,
) -> torch.Tensor:
    """fp32 partials (E, split_k, T, N) of x @ decode(w, s)^T for each expert e: w (E, N, K/2)
    uint8, s (E, N, K/32) uint8 in ``layout`` (:func:`to_layout` of the rows), ``xk`` =
    :func:`prepare_x` of x (T, K) bf16 (every expert)."""
    E, N, KH = w.shape
    K = 2 * KH
    block_t = xk.shape[0]
    block_n = 16 * m_tiles * num_warps
    assert xk.dtype == torch.bfloat16 and xk.shape == (block_t, K) and block_t in (8, 16)
    assert 1 <= T <= block_t and xk.is_contiguous()
    assert N % block_n == 0 and K % (128 * split_k) == 0, (N, K, block_n, split_k)
    assert s.shape == (E, N, K // 32) and w.is_contiguous() and s.is_contiguous()
    w32, s32 = w.view(torch.int32), s.view(torch.int32)
    y = torch.empty((E, split_k, T, N), dtype=torch.float32, device=xk.device)
    mx_gemm_kernel[(N // block_n, split_k, E)](
        w32, s32, xk.view(torch.int32), y, T, N, K, w32.stride(0), s32.stride(0),
        BLOCK_T=block_t, M_TILES=m_tiles, SPLIT_K=split_k, FOLD=fold, CHAIN=chain,
        X_PERM=x_perm, NUM_WARPS=num_warps, LAYOUT=LAYOUTS.index(layout), PREFETCH=prefetch,
        num_warps=num_warps,
    )  # fmt: skip
    return y


LAYOUTS = ("rows", "tiles", "tiles16")


def to_layout(w: torch.Tensor, s: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint rows (E, N, K/2), (E, N, K/32) -> ``layout``: "tiles" is ``pack_moe``'s
    (optimized/moe.py, ``mx_tiles``, not interleaved); "tiles16" also reorders each row's 64
    bytes of a block from (group, word, byte) to (word, group, byte)."""
    if layout == "rows":
        return w, s
    from dsv4mtp.optimized.moe import mx_tiles

    wt, st = mx_tiles(w, s, interleaved=False)
    if layout == "tiles16":
        E = wt.shape[0]
        wt = wt.reshape(E, -1, 4, 4, 4).transpose(2, 3).contiguous().reshape(w.shape)
    return wt, st


# ----------------------------------------------------------------------------- reference
def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float64 values of the 16 e2m1 codes."""
    return torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float64, device=device)


def reference(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 x (T, K) @ W^T for one matrix: w (N, K/2) uint8, s (N, K/32) uint8."""
    lut = e2m1_table(w.device)
    codes = w.long()
    vals = torch.stack([lut[codes & 15], lut[codes >> 4]], dim=-1).reshape(w.shape[0], -1)
    scale = torch.exp2(s.double() - 127.0).repeat_interleave(32, dim=1)
    return x.double() @ (vals * scale).T


# ----------------------------------------------------------------------------- --bits
def _emulate_decode(word: int, mult_bits: int) -> list[int]:
    """The PTX decode on one code word in integers: eight bf16 patterns before the multiply."""
    out = []
    for src in (word, word >> 8):
        for mask, mult in ((0x000F000F, 64 + 4096), (0x00F000F0, 4 + 256)):
            t = ((src & mask) * mult) & 0xFFFFFFFF & 0x81C081C0
            out += [t & 0xFFFF, t >> 16]
    return out


def _bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def bits_check() -> bool:
    """The decode trick on every byte value in every position, and the fold products."""
    lut = np.array([*E2M1, *(-v for v in E2M1)])
    ok = True
    rng = np.random.default_rng(0)
    words = [b * 0x01010101 for b in range(256)] + list(rng.integers(0, 2**32, 4096))
    for word in words:
        word = int(word)
        pats = _emulate_decode(word, 0)
        nib = [(word >> (4 * j)) & 15 for j in range(8)]
        want = [lut[nib[i + 4 * h]] for i in range(4) for h in range(2)]
        got = _bf16_bits_to_f64(np.array(pats)) * 2.0**126
        ok &= bool(np.array_equal(got, np.array(want)))
    print(f"decode: pattern * 2**126 == e2m1 value for all nibbles of {len(words)} words: {ok}")
    # fold: bf16 multiplier 2**(s-1) = (s + 126) << 7; value * 2**(s-127) exact in bf16 (the
    # product of an exact bf16 multiply; subnormal results for s = 0, 1 are representable)
    fold_ok = True
    for sb in range(0, 129):
        mult = _bf16_bits_to_f64(np.array([(sb + 126) << 7]))[0]
        fold_ok &= mult == 2.0 ** (sb - 1)
        vals = torch.tensor(lut * 2.0 ** (sb - 127), dtype=torch.float64)
        fold_ok &= bool(torch.equal(vals.to(torch.bfloat16).double(), vals))
    print(f"fold: bf16 multiplier exact and every scaled e2m1 value exact in bf16, s 0..128: "
          f"{fold_ok}")  # fmt: skip
    sub = _bf16_bits_to_f64(np.array([0x0040]))[0]
    print(f"code 1 pattern 0x0040 = {sub!r} = 2**-127 (bf16 subnormal) -> x 2**126 = 0.5")
    return ok and fold_ok


# ----------------------------------------------------------------------------- --sass
def _cuobjdump() -> str:
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_resources

    return sm90_resources._cuobjdump()


def _loop_sass(cubin: bytes) -> list[str]:
    """Instructions of the longest loop (bench/sm90_resources.py's main_loop_instructions rule:
    from the target of the longest backward branch to the branch)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True)
    ins = [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass.stdout)
    ]
    best: list[str] = []
    for a, text in ins:
        tgt = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(?:0x)?([0-9a-f]+)", text)
        if tgt and int(tgt.group(1), 16) < a:
            body = [t for b, t in ins if int(tgt.group(1), 16) <= b <= a]
            best = body if len(body) > len(best) else best
    return best


def _opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0].split(".")[0] if text else "?"


def _resources(kernel) -> tuple[int, int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", out.stdout)
    assert m, out.stdout
    return int(m.group(1)), int(m.group(2)), kernel.metadata.shared


def _report(name: str, kernel, weights_per_step: float) -> None:
    regs, stack, smem = _resources(kernel)
    body = _loop_sass(kernel.asm["cubin"])
    ops = Counter(_opcode(t) for t in body)
    n = len(body)
    per = n / weights_per_step
    print(f"{name}: regs {regs} stack {stack} B smem {smem} B | main loop {n} instructions, "
          f"{weights_per_step:.0f} weights/thread/iter -> {per:.2f} per weight")  # fmt: skip
    bad = {k: v for k, v in ops.items() if k in ("LDS", "STS", "SHFL", "LDSM", "BAR")}
    print(f"    shared-memory / shuffle ops in loop: {bad or 'none'}")
    print("    " + " ".join(f"{k}:{v}" for k, v in ops.most_common()))


def compile_gluon(
    block_t: int,
    fold: bool,
    chain: bool,
    x_perm: bool,
    m_tiles: int,
    num_warps: int,
    split_k: int = 1,
    layout: int = 0,
    prefetch: int = 1,
):
    sig = dict(
        w_ptr="*i32", s_ptr="*i32", x_ptr="*i32", y_ptr="*fp32", T="i32", N="i32", K="i32",
        W_STRIDE_E="i32", S_STRIDE_E="i32",
    )  # fmt: skip
    consts = dict(
        BLOCK_T=block_t, M_TILES=m_tiles, SPLIT_K=split_k, FOLD=fold, CHAIN=chain,
        X_PERM=x_perm, NUM_WARPS=num_warps, LAYOUT=layout, PREFETCH=prefetch,
    )  # fmt: skip
    names = mx_gemm_kernel.arg_names
    aligned = ("w_ptr", "s_ptr", "x_ptr", "y_ptr", "N", "K", "W_STRIDE_E", "S_STRIDE_E")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(
        mx_gemm_kernel, {**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=attrs
    )
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps))


def compile_triton_mxdot(T: int):
    """The current kernel (moe_down_kernel, decode mxdot) at its default schedule for T."""
    from triton.compiler import ASTSource

    from dsv4mtp.optimized.kernels.moe_gemm import FMT_MXFP4, moe_down_kernel
    from dsv4mtp.optimized.kernels.moe_schedule import DECODES, moe_config

    sc = moe_config(T, batch_invariant=False)
    tile = sc.down
    sig = dict(
        h_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", sorted_ptr="*i32",
        block_expert_ptr="*i32", y_ptr="*bf16", T="i32", D="i32", I="i32", W_STRIDE_E="i32",
        S_STRIDE_E="i32", NUM_M="i32", ROWS_OUT="i32",
    )  # fmt: skip
    consts = dict(
        IDENTITY=False, FMT=FMT_MXFP4, BLOCK_M=sc.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SPLIT_K=tile.split_k, GROUP_M=tile.group_m, SWAP=tile.swap_ab,
        DECODE=DECODES.index(sc.decode), FP4_JOIN=sc.fp4_join, USE_F32=False, INTERP=False,
    )  # fmt: skip
    names = moe_down_kernel.arg_names
    ints = ("D", "I", "W_STRIDE_E", "S_STRIDE_E", "NUM_M")
    attrs = {
        (names.index(a),): [["tt.divisibility", 16]]
        for a, ty in sig.items()
        if ty.startswith("*") or a in ints
    }
    src = ASTSource(
        fn=moe_down_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
        constexprs=consts, attrs=attrs,
    )  # fmt: skip
    k = triton.compile(
        src, target=TARGET, options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    )
    per = tile.block_n * tile.block_k / (32 * tile.num_warps)
    return k, per, (sc.block_m, tile.block_n, tile.block_k, tile.split_k, sc.decode)


def sass_report(args: argparse.Namespace) -> None:
    print("sm_90 SASS, compiled offline (ptxas from the triton wheel); per weight = main-loop "
          "instructions / weights decoded per thread per loop iteration")  # fmt: skip
    for layout in (1, 2):
        for fold in (True, False):
            for prefetch in (1, 2):
                for block_t in (8, 16):
                    k = compile_gluon(block_t, fold, fold, True, 2, args.warps, 1, layout, prefetch)
                    name = (f"gluon {LAYOUTS[layout]} {'fold chain' if fold else 'f32'} "
                            f"prefetch {prefetch} T<={block_t}")  # fmt: skip
                    _report(name, k, 2 * 2 * 32)
    if args.layouts_only:
        return
    for fold, chain, x_perm in (
        (True, True, True), (True, False, True), (True, True, False), (False, False, True)
    ):  # fmt: skip
        for block_t in (8, 16):
            for m_tiles in args.m_tiles:
                k = compile_gluon(block_t, fold, chain, x_perm, m_tiles, args.warps)
                mode = ("fold" if fold else "f32 ") + (" chain" if chain else "")
                mode += " x_perm" if x_perm else " x_prmt"
                if args.dump:
                    stem = f"/tmp/gluon_mx_{mode.replace(' ', '_')}_t{block_t}_m{m_tiles}"
                    for ext in ("ttgir", "ptx"):
                        Path(f"{stem}.{ext}").write_text(k.asm[ext])
                    Path(f"{stem}.cubin").write_bytes(k.asm["cubin"])
                per_step = 2 * m_tiles * 32  # rows per thread x 128 columns / 4 threads
                name = (f"gluon {mode} T<={block_t:2d} m_tiles {m_tiles} "
                        f"({16 * m_tiles * args.warps} rows, {args.warps} warps)")  # fmt: skip
                _report(name, k, per_step)
    if not args.no_triton:
        for T in (1, 8):
            k, per, shape = compile_triton_mxdot(T)
            _report(f"triton moe_down_kernel mxdot T={T} {shape}", k, per)


# ----------------------------------------------------------------------------- GPU parts
def _random_problem(E: int, N: int, K: int, T: int, gen: torch.Generator, dev: str):
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    # realistic MXFP4 weight scales (2**-27 .. 2**1; fold needs bytes <= 128) plus bytes 0, 1
    s = torch.randint(100, 129, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    s[:, :: max(1, N // 16), :] = 0  # scale byte 0 (2**-127) on some rows
    s[:, 1 :: max(1, N // 16), :] = 1
    x = torch.randn((T, K), generator=gen).to(torch.bfloat16)
    return w.to(dev), s.to(dev), x.to(dev)


def check() -> bool:
    """Both modes, both x layouts, K splits, M tiles, T 1..16 against float64.  Error measure:
    |y - ref| / (|x| @ |W|^T), the scale of fp32 accumulation error (a plain relative error
    is unbounded where a dot product cancels); also max |y - ref| / max |ref| per matrix."""
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    ok = True
    for N, K in ((256, 512), (4096, 2048)):
        w, s, x16 = _random_problem(2, N, K, 16, gen, dev)
        small = (s[:, :, 0] <= 1).cpu()  # rows whose first group has scale byte 0 or 1
        absw = [reference(x16.abs(), w[e] & 0x77, s[e]).cpu() for e in range(2)]  # |x| @ |W|^T
        for T in (1, 5, 8, 16):
            x = x16[:T]
            refs = [reference(x, w[e], s[e]).cpu() for e in range(2)]
            for fold, chain, x_perm, split, m_tiles, layout, pf in (
                (True, True, True, 1, 2, "rows", 1), (True, True, False, 2, 2, "rows", 1),
                (False, False, True, 1, 2, "rows", 1), (False, False, False, 2, 1, "rows", 1),
                (True, True, True, 4, 4, "rows", 1), (True, False, True, 1, 2, "rows", 1),
                (True, True, True, 1, 2, "tiles", 1), (False, False, True, 2, 2, "tiles", 2),
                (True, True, True, 2, 2, "tiles16", 1), (False, False, True, 1, 2, "tiles16", 2),
                (True, True, True, 4, 2, "tiles16", 2), (False, False, True, 4, 2, "tiles", 1),
            ):  # fmt: skip
                if N % (64 * m_tiles) or K % (128 * split) or (pf == 2 and T > 8):
                    continue
                xk = prepare_x(x, x_perm)
                wl, sl = to_layout(w, s, layout)
                y = mx_gemm(
                    xk, T, wl, sl, fold=fold, chain=chain, x_perm=x_perm, split_k=split,
                    m_tiles=m_tiles, layout=layout, prefetch=pf,
                )  # fmt: skip
                y = y.sum(1).double().cpu()
                err, tiny, rel = 0.0, 0.0, 0.0
                for e in range(2):
                    d = (y[e] - refs[e]).abs().nan_to_num(nan=float("inf"))  # NaN fails
                    acc_err = (d / absw[e][:T].clamp_min(1e-300)).amax(0)
                    err = max(err, float(acc_err[~small[e]].max()))
                    tiny = max(tiny, float(acc_err[small[e]].max()))
                    rel = max(rel, float(d.max() / refs[e].abs().max()))
                good = err < 1e-6 and tiny < 1e-6 and rel < 1e-5
                ok &= good
                mode = ("fold" if fold else "f32 ") + (" chain" if chain else "")
                mode += " x_perm" if x_perm else " x_prmt"
                mode += f" {layout} pf {pf}"
                print(f"N {N} K {K} T {T:2d} {mode} split {split} m_tiles {m_tiles}: "
                      f"|err| / (|x| @ |W|^T) {err:.1e} (rows with scale byte 0/1: {tiny:.1e}), "
                      f"max|err| / max|ref| {rel:.1e} {'ok' if good else 'FAIL'}")  # fmt: skip
    print("check:", "PASS" if ok else "FAIL")
    return ok


def _graph_us(fns, reps: int = 20) -> float:
    """us per call of the calls ``fns`` captured once into a CUDA graph, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        t0.record()
        for _ in range(reps):
            g.replay()
        t1.record()
        t1.synchronize()
        best = min(best, t0.elapsed_time(t1) * 1e3 / (reps * len(fns)))
    return best


def copy_gbs() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(20):  # clocks up
        b.copy_(a)
    us = _graph_us([lambda: b.copy_(a)], reps=10)
    return 2 * a.numel() / us / 1e3


def _peer_fn(x, w1, s1, T, N, K):
    from dsv4mtp.optimized.kernels.moe_gemm import FMT_MXFP4, moe_down_triton
    from dsv4mtp.optimized.kernels.moe_schedule import moe_config

    sc = moe_config(T, batch_invariant=False, fmt="mxfp4")
    gscale = torch.ones((1, 3), dtype=torch.float32, device="cuda")

    def run() -> None:
        moe_down_triton(
            x, w1, s1, gscale, None, None, fmt=FMT_MXFP4, T=T, D=N, inter=K, rows_out=T,
            num_m_blocks=1, block_m=sc.block_m, tile=sc.down, decode=sc.decode,
            fp4_join=sc.fp4_join,
        )  # fmt: skip

    return run


def _gluon_fn(xk, T, w, s, **kw):
    return lambda: mx_gemm(xk, T, w, s, **kw)


def bench(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(1)
    bw = copy_gbs()
    print(f"device copy (1 GB, read + write): {bw:.0f} GB/s")
    n_mat = 16
    for name, N, K in (("gate/up", 4096, 4096), ("down", 4096, 2048)):
        w, s, x16 = _random_problem(n_mat, N, K, 16, gen, "cuda")
        wbytes = w[0].numel() + s[0].numel()
        for T in (1, 8):
            x = x16[:T].contiguous()
            for fold in (True, False):
                xk = prepare_x(x, True)
                for split in args.splits:
                    for m_tiles in args.m_tiles:
                        kw = dict(fold=fold, split_k=split, m_tiles=m_tiles, num_warps=args.warps)
                        one = [
                            _gluon_fn(xk, T, w[i : i + 1], s[i : i + 1], **kw) for i in range(n_mat)
                        ]
                        us = _graph_us(one)
                        many = [
                            _gluon_fn(xk, T, w[lo : lo + 8], s[lo : lo + 8], **kw) for lo in (0, 8)
                        ]
                        us8 = _graph_us(many) / 8
                        print(f"{name:7s} N {N} K {K} T {T} gluon {'fold' if fold else 'f32 '} "
                              f"split {split} m_tiles {m_tiles}: 1 matrix/launch {us:6.2f} us "
                              f"{wbytes / us / 1e3:5.0f} GB/s | 8 matrices/launch {us8:6.2f} "
                              f"us/matrix {wbytes / us8 / 1e3:5.0f} GB/s")  # fmt: skip
            if args.peer:
                try:
                    fns = [_peer_fn(x, w[i : i + 1], s[i : i + 1], T, N, K) for i in range(n_mat)]
                    us = _graph_us(fns)
                except Exception as exc:  # the peer is optional: report and go on
                    print(f"peer (moe_down_triton) failed: {type(exc).__name__}: {exc}")
                    continue
                print(f"{name:7s} N {N} K {K} T {T} triton mxdot (default schedule): "
                      f"1 matrix/launch {us:6.2f} us {wbytes / us / 1e3:5.0f} GB/s")  # fmt: skip
    print(f"device copy again at the end: {copy_gbs():.0f} GB/s (at the start: {bw:.0f})")


def _peer_tiles_fn(x, w, s, T, N, K, T_sched):
    """The Triton kernel (``moe_down_triton``, tiles layout, ``moe_config(T_sched)``'s down
    tile with ``decode="mxstep"``, the Triton path the Gluon kernels replaced) over every matrix of ``w`` in one launch: one 8-row M block per matrix holding
    x's T rows."""
    from dsv4mtp.optimized.kernels.moe_gemm import FMT_MXFP4, moe_down_triton
    from dsv4mtp.optimized.kernels.moe_schedule import moe_config

    E = w.shape[0]
    sc = moe_config(T_sched, batch_invariant=False, fmt="mxfp4_tiles")
    bm = sc.block_m
    gscale = torch.ones((E, 3), dtype=torch.float32, device="cuda")
    i = torch.arange(E * bm, device="cuda")
    sorted_slot = torch.where(i % bm < T, (i // bm) * T + i % bm, -1).to(torch.int32)
    block_expert = torch.arange(E, dtype=torch.int32, device="cuda")
    h = x[(i % bm).clamp_max(T - 1)].contiguous()

    def run() -> None:
        moe_down_triton(
            h, w, s, gscale, sorted_slot, block_expert, fmt=FMT_MXFP4, T=T, D=N, inter=K,
            rows_out=E * T, num_m_blocks=E, block_m=bm, tile=sc.down, decode="mxstep",
            fp4_join=sc.fp4_join, tiled=True,
        )  # fmt: skip

    return run


def bench_layouts(args: argparse.Namespace) -> None:
    """Weight stream by layout: E matrices per launch, two sets of E rotated (cold L2)."""
    bw = copy_gbs()
    print(f"device copy (1 GB, read + write): {bw:.0f} GB/s")
    rows = []
    for name, N, K in (("gate/up", 4096, 4096), ("down", 4096, 2048)):
        for E in args.experts:
            g = torch.Generator(device="cuda").manual_seed(E)
            w = torch.randint(0, 256, (2 * E, N, K // 2), dtype=torch.uint8, device="cuda",
                              generator=g)  # fmt: skip
            s = torch.randint(100, 129, (2 * E, N, K // 32), dtype=torch.uint8, device="cuda",
                              generator=g)  # fmt: skip
            wbytes = (w[0].numel() + s[0].numel()) * E
            splits = (2, 4) if E <= 8 else (1, 2)
            for T in args.tokens:
                x = torch.randn((T, K), device="cuda", generator=g).to(torch.bfloat16)
                xk = prepare_x(x, True)
                for layout in LAYOUTS:
                    wl, sl = to_layout(w, s, layout)
                    for fold in (True, False):
                        for prefetch in (1, 2):
                            if T > 8 and prefetch == 2:
                                continue
                            for split in splits:
                                kw = dict(fold=fold, chain=fold, split_k=split, layout=layout,
                                          prefetch=prefetch)  # fmt: skip
                                fns = [_gluon_fn(xk, T, wl[lo : lo + E], sl[lo : lo + E], **kw)
                                       for lo in (0, E)]  # fmt: skip
                                us = _graph_us(fns)
                                tag = (f"{name:7s} E {E:3d} T {T:2d} gluon {layout:7s} "
                                       f"{'fold' if fold else 'f32 '} pf {prefetch} "
                                       f"split {split}")  # fmt: skip
                                rows.append((tag, us, wbytes / us / 1e3))
                                print(f"{tag}: {us:8.1f} us  {wbytes / us / 1e3:5.0f} GB/s",
                                      flush=True)  # fmt: skip
                wt, st = to_layout(w, s, "tiles")
                for t_sched in sorted({1 if E <= 8 else 64, 8}):
                    try:
                        fns = [_peer_tiles_fn(x, wt[lo : lo + E], st[lo : lo + E], T, N, K,
                                              t_sched) for lo in (0, E)]  # fmt: skip
                        us = _graph_us(fns)
                    except Exception as exc:  # the peer is optional: report and go on
                        print(f"peer failed: {type(exc).__name__}: {exc}")
                        continue
                    tag = f"{name:7s} E {E:3d} T {T:2d} triton tiles (schedule of T {t_sched})"
                    rows.append((tag, us, wbytes / us / 1e3))
                    print(f"{tag}: {us:8.1f} us  {wbytes / us / 1e3:5.0f} GB/s", flush=True)
            del w, s
    print(f"device copy again at the end: {copy_gbs():.0f} GB/s (at the start: {bw:.0f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sass", action="store_true", help="offline sm_90 SASS counts (no GPU)")
    p.add_argument("--bits", action="store_true", help="decode bit-trick exactness (no GPU)")
    p.add_argument("--check", action="store_true", help="GPU: compare with float64")
    p.add_argument("--bench", action="store_true", help="GPU: time expert shapes")
    p.add_argument("--peer", action="store_true", help="--bench: also the Triton mxdot kernel")
    p.add_argument("--no-triton", action="store_true", help="--sass: skip the Triton kernel")
    p.add_argument("--layouts-only", action="store_true", help="--sass: the tiles layouts only")
    p.add_argument("--dump", action="store_true", help="--sass: write ttgir/ptx/cubin to /tmp")
    p.add_argument("--m-tiles", type=int, nargs="+", default=[2], help="16-row tiles per warp")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--splits", type=int, nargs="+", default=[1, 4], help="--bench K splits")
    p.add_argument("--bench-layouts", action="store_true", help="GPU: stream by layout")
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    p.add_argument("--tokens", type=int, nargs="+", default=[2, 12])
    args = p.parse_args()
    if not (args.sass or args.bits or args.check or args.bench or args.bench_layouts):
        p.error("pick --sass, --bits, --check or --bench")
    ok = True
    if args.bits:
        ok &= bits_check()
    if args.sass:
        sass_report(args)
    if args.check:
        ok &= check()
    if args.bench:
        bench(args)
    if args.bench_layouts:
        bench_layouts(args)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
