"""The dense linears of the MTP layer: ``y = x @ W^T`` over FP8 128x128-block or bf16 / fp32
weights, one kernel for the plain and the grouped product (docs/semantics.md, "Linear layers",
"Block formats").

Layout (what ``optimized/linear.py``'s ``pack_linear`` builds): ``w`` (G, N, K) e4m3 codes as
uint8 (FMT 1) with fp32 block scales ``s`` (G, ceil(N/128), ceil(K/128)), or a dense bf16 / fp32
weight (FMT 0, ``s`` unused); G = 1 for a plain linear.  ``x`` is (R, G, K) contiguous (R rows,
G groups), ``y`` (R, G, N).

``linear_kernel``: grid (M blocks, N tiles, G * SPLIT_K); program (m, n, g*SPLIT_K + s) computes
rows [m*BLOCK_M, +BLOCK_M) x columns [n*BLOCK_N, +BLOCK_N) of group g over the K blocks of split
s (each split a contiguous run of ceil(KB / SPLIT_K) of the KB = ceil(K/128) blocks).  Per
128-wide K block: the x tile (BLOCK_M, 128) and the codes (BLOCK_N, 128) are loaded, the codes
decoded to bf16 in registers (kernels/decode.py, ``_e4m3_bf16``: PTX, two instructions per
weight), one tensor-core dot with a fresh fp32 accumulator, and that fp32 partial multiplied
by the block's fp32 scale before it is added to the running sum (an fp32 scale is not exact in
bf16, so it never touches the dot's operands; BLOCK_N divides 128, so one scale per tile and K
block; folding a power-of-two scale into the decode instead, one dot chain over all K blocks,
measured 26 % slower at 1-8 rows and 4 % faster at 64: bench/results/linear-h200.md, "Three
ways to speed the decode linears").  SPLIT_K == 1 rounds the sum once to y's dtype.  SPLIT_K >
1, in the same launch: each program stores its fp32 partial at ``part[s]`` and takes a ticket
from its output tile's int32 counter (one atomic add per program, acquire-release at gpu
scope); the program that draws ticket SPLIT_K - 1, the tile's last split to finish, loads
``part[0..SPLIT_K-1]`` from L2, adds them to fp32 zeros in the order 0, 1, ..., SPLIT_K - 1,
rounds once to y's dtype, writes y and sets the counter back to zero.  Which program reduces
depends on timing, the arithmetic does not: the sum is always taken in split order, so the
result is deterministic and a row's bits depend only on the schedule (BLOCK_M, BLOCK_N,
SPLIT_K, warps), never on the other rows.  No program waits for another, so nothing depends on
how many programs are resident.  The counters (one per M block, N tile and group) are zero
before every launch and left zero after it: a
pack's own (optimized/linear.py, ``LinearPack.counters``, zeroed once when packed: no memset
per call, in a CUDA graph neither), or for a call without a pack's the stream's
(kernels/_sync.py, ``counters``; while capturing a piece of the capture's arena, or fresh
zeros).  Under the interpreter the
programs run one after another and the tile's last program in grid order reduces.

The epilogue's add (``ADD_ROWS`` > 0, the layer's ``h_proj(h) + e_proj(e)``: ``eh_proj`` in
optimized/linear.py): whoever stores a tile, the program without a split or the tile's last
split, rounds its sums to y's dtype, adds row ``r // ADD_ROWS`` of ``add`` in fp32 and rounds
again, which is bitwise the product followed by a separate add in y's dtype (torch's bf16 add
sums in fp32 and rounds once), without the add's launch and y's second round trip.  On the
prefill path ``add_rows_kernel`` does the same after the GEMM, in place.

``eh_linear_kernel`` (decode sizes, :func:`eh_one_launch`): both of ``eh_proj``'s products in
one launch, e's programs and h's side by side in the grid over h's output tiles, every program
storing its fp32 partial and the tile's last of its 2 * SPLIT_K programs (one ticket counter per
tile) rounding each product's split-ordered sum and then their sum: bitwise the two launches
above (e's product, then h's with ``ADD_ROWS``).  A decode call is mostly its start (launch,
first loads, split tail), so one launch over both 16 MiB weights pays one start: the greedy
draft step 5.3 us shorter at T 1 and 2.0 at T 8 (bench/results/linear-h200.md, "eh_proj in one
launch").

``dequant_kernel`` + ``linear_dequant_mm`` (the prefill path, FP8 packs whose every code x
scale product is exact in bf16, bf16 x, ``DEQUANT_MM_MIN_ROWS`` rows or more, not
batch-invariant: :func:`dequant_mm_selected`): the Triton kernel above reaches about 300 TFLOP/s
at prefill sizes whatever its tiles, cuBLAS bf16 on the same weight 700-830.  So the weight is
dequantized once per call into a bf16 workspace (grid (K tiles, N tiles, G), one 64 x 128 tile of
one 128x128 scale block per program: decode, times the block's fp32 scale, one bf16 store) and
one cuBLAS GEMM (``torch.mm``, ``torch.bmm`` over the groups of wo_a) multiplies x by it with
fp32 accumulation, rounding once to bf16.  With a power-of-two scale the product of an e4m3 code
(4 significant bits) and the scale only moves the exponent, so the bf16 weight is the exact
weight and the GEMM computes the math of the kernel above (fp32 sums of exact products, in
another order).  The dequant moves N*K bytes of codes in and 2*N*K of bf16 out, and the GEMM
reads those 2*N*K back: the dequant alone is 3*N*K bytes (4096 x 4096: 48 MiB, ~12 us at
4 TB/s), which the GEMM's ~2.7x speed repays from a few hundred rows on (e_proj at 512 rows:
59 us in the kernel, 24 us in cuBLAS).

Bytes per call: the codes once per M block (N*K per group: wq_b 32 MiB, e_proj 16 MiB) plus
scales (N*K/16384 * 4), x once per N tile (from L2 after the first), y once, and with a split
2 * SPLIT_K * R * G * N * 4 bytes of fp32 partials (written by the splits, read back from L2 by
the tile's last split) and one 4-byte atomic per program.  Decode sizes (R <= 64, one
M block) read the weight exactly once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4mtp.errors import InputError

from ._launch import (
    INTERPRET,
    cdiv,
    next_pow2,
    rne_bf16_if_interpreted,
    triton_launch,
    workspace,
)
from ._sync import counters as stream_counters
from .decode import _e4m3_bf16
from .moe_common import jit_loop_bounds

__all__ = [
    "DECODE_MAX_ROWS",
    "DEQUANT_MM_MIN_ROWS",
    "EH_ONE_LAUNCH",
    "FMT_DENSE",
    "FMT_FP8",
    "LinearSchedule",
    "add_rows_triton",
    "chunk_best",
    "dequant_bf16_triton",
    "dequant_mm_selected",
    "eh_linear_triton",
    "eh_one_launch",
    "fp32_reduction",
    "linear_dequant_mm",
    "linear_schedule",
    "linear_triton",
]

FMT_DENSE, FMT_FP8 = 0, 1
BLOCK_K = 128  # one FP8 scale block along K
SMS = 132  # H200 streaming multiprocessors
DECODE_MAX_ROWS = 64  # up to here one M block holds every row: the split-K decode schedule
# From here on an exact-bf16 FP8 pack with bf16 x takes the dequantize + cuBLAS path (module
# doc).  Measured on the H200 (V4-Flash linears, bench/diag/linear_sweep.py): the Triton kernel
# runs at 260-310 TFLOP/s at prefill sizes, cuBLAS bf16 on the dequantized weight at 710-830
# (e_proj at 512 rows: 59 us against 24 us; wo_b at 4096 rows: 928 against 332).  The dequant
# costs about N*K*(1 + 2) bytes and the GEMM reads the 2*N*K bf16 weight back, ~12 us for a
# 4096 x 4096 weight at 4 TB/s, which the GEMM's saving covers from a few hundred rows.  Decode
# buckets (<= 64 rows, captured in CUDA graphs) never reach it.
DEQUANT_MM_MIN_ROWS = 256
# bf16 dequant tiles: one 64 x 128 slice of a 128x128 scale block per program (one scale each).
_DEQ_BLOCK_N, _DEQ_BLOCK_K = 64, 128


@dataclass(frozen=True)
class LinearSchedule:
    """Tiles of one call: BLOCK_M rows x BLOCK_N columns per program, K in SPLIT_K splits."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def _split(n_tiles: int, kb: int, target: int) -> int:
    """The smallest power-of-two K split that brings the programs of one M block to ``target``
    (each split keeping at least two K blocks): N tiles alone cannot fill 132 SMs for the narrow
    linears (wkv: 512 columns = 8 tiles of 64)."""
    split = 1
    while n_tiles * split < target and kb >= 4 * split:
        split *= 2
    return split


def linear_schedule(
    rows: int, N: int, K: int, groups: int, batch_invariant: bool
) -> LinearSchedule:
    """The default schedule.  Decode sizes (rows <= 64): one M block (16, 32 or 64 rows), 3
    stages, and either 128-wide N tiles without a K split where those alone give a program per
    SM (wq_b: 256 tiles), or 64-wide tiles with the K split doubled until there is a program per
    SM (each split keeping two K blocks or more): e_proj and h_proj 64 tiles x 4 splits, fused
    wq_a + wkv 24 x 8, grouped wo_a 8 groups x 16 tiles x 2, wo_b 64 x 4.
    Measured with cold weights (bench/diag/linear_decode_sweep.py, bench/results/linear-h200.md,
    "Decode schedules"): splitting further, to two programs per SM, was 5-11 % slower at 1-8
    rows and 28-39 % slower at 32-64 (more fp32 partials through L2, more tile reductions),
    and wq_b's 128-wide tiles were 5-25 % faster than 64-wide ones.
    More rows: 64 x 128 tiles, no split.  ``batch_invariant``: 64 x 64 tiles with the split
    reaching two programs per SM for (N, K, G), whatever the row count, so each row is
    computed the same way."""
    kb = cdiv(K, BLOCK_K)
    if batch_invariant:
        nt = cdiv(N, 64) * groups
        return LinearSchedule(64, 64, _split(nt, kb, 2 * SMS), num_warps=4, num_stages=3)
    if rows <= DECODE_MAX_ROWS:
        bm = max(16, next_pow2(rows))
        if cdiv(N, 128) * groups >= SMS:
            return LinearSchedule(bm, 128, 1, num_warps=4, num_stages=3)
        nt = cdiv(N, 64) * groups
        return LinearSchedule(bm, 64, _split(nt, kb, SMS), num_warps=4, num_stages=3)
    return LinearSchedule(64, 128, 1, num_warps=4, num_stages=3)


@triton.jit
def _dot(a, b, USE_F32: tl.constexpr, INTERP: tl.constexpr):
    """a (M, K) @ b (K, N) in fp32: bf16 tensor cores, or an fp32 dot for fp32 operands.

    Under the interpreter: a broadcast product summed over K in fp32.  Its ``tl.dot`` is numpy's
    matmul (BLAS), whose rounding of a row depends on where the row sits in the tile, which
    would make the CPU tier's batch-invariance check fail for reasons the GPU does not have (and
    its bf16 dot is wrong)."""
    if INTERP:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif USE_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _add_rows(acc, add_ptr, rows, cols, mask, N, y_ty: tl.constexpr, ADD_ROWS: tl.constexpr,
              INTERP: tl.constexpr):  # fmt: skip
    """The fp32 sums ``acc`` (BLOCK_M, BLOCK_N) as y's dtype; with ``ADD_ROWS`` > 0, plus row
    ``rows // ADD_ROWS`` of ``add`` (N columns, y's dtype) after that rounding, then rounded
    again: bitwise the rounded product followed by a separate add in y's dtype (torch's add
    of two bf16 tensors sums them in fp32 and rounds once)."""
    y = rne_bf16_if_interpreted(acc, y_ty, INTERP).to(y_ty)
    if ADD_ROWS > 0:
        a_off = (rows // ADD_ROWS).to(tl.int64)[:, None] * N + cols[None, :]
        a = tl.load(add_ptr + a_off, mask=mask, other=0.0)
        y = rne_bf16_if_interpreted(y.to(tl.float32) + a.to(tl.float32), y_ty, INTERP).to(y_ty)
    return y


@triton.jit
def _split_sum(x_rows, w_rows, s_row, rm, cm, kb0, K, KB_PER_SPLIT, FMT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_F32: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """One program's fp32 sum over the K blocks [kb0, kb0 + KB_PER_SPLIT) of its tile: x rows
    ``x_rows`` (BLOCK_M, 1) against weight rows ``w_rows`` (BLOCK_N, 1), per 128-wide K block
    one dot with a fresh accumulator times the block's scale at ``s_row + kb`` (FP8), added to
    the running sum in K order (module docstring)."""
    kk = tl.arange(0, BLOCK_K)
    KB = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, KB_PER_SPLIT):
        kb = kb0 + i
        k = kb * BLOCK_K + kk
        km = (k < K) & (kb < KB)
        x = tl.load(x_rows + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        if FMT == 1:
            codes = tl.load(w_rows + k[None, :], mask=cm[:, None] & km[None, :], other=0)
            w = _e4m3_bf16(codes, INTERP)  # (BLOCK_N, BLOCK_K) bf16, exact
            part = _dot(x, tl.trans(w), USE_F32, INTERP)
            scale = tl.load(s_row + kb, mask=kb < KB, other=0.0)
            acc += part * scale
        else:
            w = tl.load(w_rows + k[None, :], mask=cm[:, None] & km[None, :], other=0.0)
            acc += _dot(x, tl.trans(w), USE_F32, INTERP)
    return acc


@triton.jit
def _last_of_tile(count_ptr, tile, PROGRAMS: tl.constexpr):
    """Take the program's ticket on the tile's int32 counter: whether it is the last of the
    tile's PROGRAMS programs to have stored its partials (then every thread may read them).

    Memory model (PTX, gpu scope).  Triton runs an atomic on a scalar pointer in one thread of
    the program (thread 0) and broadcasts its result through shared memory.  Release: the
    barrier orders every thread's partial stores before that atomic, whose release is
    cumulative, so the stores are visible at gpu scope to any program that acquires a later
    value of the counter.  Each increment of a counter reads the one before it (one
    modification order of read-modify-writes), so the acq_rel increment that reads PROGRAMS - 1
    synchronizes with all PROGRAMS - 1 earlier releases.  Acquire: that same atomic, then a
    barrier ordering every thread's loads after it, and ``.cg`` loads (:func:`_plane_sum`: from
    L2, the coherence point: an L1 line of the partials can be stale, e.g. one shared with a
    neighbouring tile and read by that tile's reducer on the same SM).  One atomic per program
    and no waiting: no program depends on another being resident.  The last program sets the
    counter back to zero after its reads (the caller's store)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == PROGRAMS - 1
    if last:
        tl.debug_barrier()
    return last


@triton.jit
def _plane_sum(tile_part, first, plane, mask, COUNT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """The tile's fp32 partials in planes first .. first + COUNT - 1 (``plane`` elements apart)
    summed in plane order from zero, read from L2 (``.cg``; :func:`_last_of_tile`)."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(COUNT):
        total += tl.load(tile_part + (first + j) * plane, mask=mask, other=0.0,
                         cache_modifier=".cg")  # fmt: skip
    return total


@triton.jit
def chunk_best(logits, vidx, V, AXIS: tl.constexpr):
    """One chunk's greedy candidate per token row: ``logits`` fp32 and their head indices
    ``vidx`` (int32, same shape; ``V`` and beyond are padding) reduced along ``AXIS`` (the
    chunk's head rows) -> (value, index) per token.  torch.argmax's rules within the chunk: the
    chunk's first NaN if it has one (value NaN), else its maximum and the first index holding
    it; a chunk of padding only gives (-inf, V).  Max and min are exact, so the result does not
    depend on the layout.  Used by the argmax kernel (kernels/lm_head.py) and by
    :func:`linear_kernel`'s ARGMAX epilogue; ``lm_head_argmax_reduce_kernel`` combines the
    chunks in order."""
    big = V  # larger than any index: "none"
    valid = vidx < V
    isnan = (logits != logits) & valid
    key = tl.where(isnan | ~valid, float("-inf"), logits)
    best = tl.max(key, axis=AXIS)
    at_best = key == tl.expand_dims(best, AXIS)
    first = tl.min(tl.where(valid & at_best, vidx, big), axis=AXIS)
    first_nan = tl.min(tl.where(isnan, vidx, big), axis=AXIS)
    has_nan = first_nan < big
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first)


@jit_loop_bounds("KB_PER_SPLIT")
def linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    add_ptr,
    R,
    G,
    N,
    K,
    KB_PER_SPLIT,
    add_row0,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ADD_ROWS: tl.constexpr,
    USE_F32: tl.constexpr,
    INTERP: tl.constexpr,
    ARGMAX: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_gs = tl.program_id(2)
    g = pid_gs // SPLIT_K
    s = pid_gs % SPLIT_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < R
    cm = cols < N
    x_rows = x_ptr + (rows[:, None].to(tl.int64) * G + g) * K  # (BLOCK_M, 1)
    w_rows = w_ptr + (g.to(tl.int64) * N + cols[:, None]) * K  # (BLOCK_N, 1)
    KB = tl.cdiv(K, BLOCK_K)
    s_row = s_ptr + (g.to(tl.int64) * tl.cdiv(N, 128) + (pid_n * BLOCK_N) // 128) * KB
    acc = _split_sum(x_rows, w_rows, s_row, rm, cm, s * KB_PER_SPLIT, K, KB_PER_SPLIT, FMT,
                     BLOCK_M, BLOCK_N, BLOCK_K, USE_F32, INTERP)  # fmt: skip
    out_off = (rows[:, None].to(tl.int64) * G + g) * N + cols[None, :]
    mask = rm[:, None] & cm[None, :]
    y_ty = y_ptr.dtype.element_ty
    if ARGMAX:
        # the head's greedy epilogue (one group, no split): y is not written; the tile's best
        # logit and its index per row go to (rows, N tiles) partials, fp32 values in part_ptr
        # and int32 indices in count_ptr (neither is otherwise used without a split)
        vidx = cols[None, :] + tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        val, idx = chunk_best(acc, vidx, N, 1)
        p_off = rows.to(tl.int64) * tl.num_programs(1) + pid_n
        tl.store(part_ptr + p_off, val, mask=rm)
        tl.store(count_ptr + p_off, idx, mask=rm)
    elif SPLIT_K == 1:
        y = _add_rows(acc, add_ptr, add_row0 + rows, cols, mask, N, y_ty, ADD_ROWS, INTERP)
        tl.store(y_ptr + out_off, y, mask=mask)
    else:
        # Split s's fp32 partial goes to part[s] (SPLIT_K planes of R*G*N); the last of the tile's
        # SPLIT_K programs to arrive sums the planes in split order (module docstring).
        plane = tl.cast(R, tl.int64) * G * N
        tile_part = part_ptr + out_off  # (BLOCK_M, BLOCK_N) in plane 0
        tl.store(tile_part + s * plane, acc, mask=mask)
        tile = (pid_m * tl.num_programs(1) + pid_n) * G + g
        if _last_of_tile(count_ptr, tile, SPLIT_K):
            total = _plane_sum(tile_part, 0, plane, mask, SPLIT_K, BLOCK_M, BLOCK_N)
            y = _add_rows(total, add_ptr, add_row0 + rows, cols, mask, N, y_ty, ADD_ROWS, INTERP)
            tl.store(y_ptr + out_off, y, mask=mask)
            # Every program of the tile has incremented (ticket SPLIT_K - 1) and none touches
            # the counter again in this launch; the next launch starts after this one ends.
            tl.store(count_ptr + tile, 0)


@jit_loop_bounds("KB_PER_SPLIT")
def eh_linear_kernel(
    e_ptr,
    h_ptr,
    we_ptr,
    se_ptr,
    wh_ptr,
    sh_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    R,
    N,
    K,
    KB_PER_SPLIT,
    FMT: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_F32: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``y = h @ wh^T + (e @ we^T)[r // STREAMS]`` in one launch (:func:`eh_linear_triton`).

    Grid (M blocks, N tiles, 2 * SPLIT_K): program (m, n, p) runs split p % SPLIT_K of e's
    product (p < SPLIT_K) or h's over the output tile (m, n) of h's R rows; e's programs read
    row r // STREAMS of e for output row r (the STREAMS rows of a token share it: the tile's
    rows cost nothing extra at decode sizes, where the weight stream is the time).  Every
    program stores its fp32 partial at ``part[p]`` and takes a ticket on the tile's counter;
    the last of the tile's 2 * SPLIT_K programs sums h's planes in split order and rounds, sums
    e's likewise and rounds, adds the two in fp32 and rounds once more: bitwise
    :func:`linear_kernel` on e, then on h with e's rows added (``ADD_ROWS``), under the same
    BLOCK_N and SPLIT_K (the per-element sums do not depend on BLOCK_M)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_gs = tl.program_id(2)
    g = pid_gs // SPLIT_K  # 0: e's product, 1: h's
    s = pid_gs % SPLIT_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < R
    cm = cols < N
    r64 = rows[:, None].to(tl.int64)
    x_rows = tl.where(g == 0, e_ptr + (r64 // STREAMS) * K, h_ptr + r64 * K)  # (BLOCK_M, 1)
    c64 = cols[:, None].to(tl.int64)
    w_rows = tl.where(g == 0, we_ptr + c64 * K, wh_ptr + c64 * K)  # (BLOCK_N, 1)
    KB = tl.cdiv(K, BLOCK_K)
    s_off = ((pid_n * BLOCK_N) // 128) * KB
    s_row = tl.where(g == 0, se_ptr + s_off, sh_ptr + s_off)
    acc = _split_sum(x_rows, w_rows, s_row, rm, cm, s * KB_PER_SPLIT, K, KB_PER_SPLIT, FMT,
                     BLOCK_M, BLOCK_N, BLOCK_K, USE_F32, INTERP)  # fmt: skip
    out_off = r64 * N + cols[None, :]
    mask = rm[:, None] & cm[None, :]
    plane = tl.cast(R, tl.int64) * N
    tile_part = part_ptr + out_off
    tl.store(tile_part + pid_gs * plane, acc, mask=mask)
    # the tile's ticket counts the 2 * SPLIT_K programs of both products
    tile = pid_m * tl.num_programs(1) + pid_n
    if _last_of_tile(count_ptr, tile, 2 * SPLIT_K):
        y_ty = y_ptr.dtype.element_ty
        te = _plane_sum(tile_part, 0, plane, mask, SPLIT_K, BLOCK_M, BLOCK_N)
        th = _plane_sum(tile_part, SPLIT_K, plane, mask, SPLIT_K, BLOCK_M, BLOCK_N)
        ye = rne_bf16_if_interpreted(te, y_ty, INTERP).to(y_ty)
        yh = rne_bf16_if_interpreted(th, y_ty, INTERP).to(y_ty)
        y = rne_bf16_if_interpreted(yh.to(tl.float32) + ye.to(tl.float32), y_ty, INTERP)
        tl.store(y_ptr + out_off, y.to(y_ty), mask=mask)
        tl.store(count_ptr + tile, 0)


def linear_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    y: torch.Tensor,
    *,
    fmt: int,
    sched: LinearSchedule,
    counters: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    argmax: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """y (R, G, N) = x (R, G, K) @ w (G, N, K)^T per group (module doc); all contiguous.

    ``counters``: int32 zeros (left zeroed), one per (M block, N tile, group) output tile of a
    split schedule; a pack's own (optimized/linear.py).  When it holds fewer tiles than the
    call has, the rows run in launches of as many M blocks as it holds; None, or fewer than one
    M block's tiles: the stream's zeroed counters (kernels/_sync.py, ``counters``).

    ``add``: (R', N) contiguous in y's dtype, G = 1 and R a multiple of R': row r of y gets row
    ``r // (R / R')`` of ``add`` added after its rounding and is rounded again, in the
    epilogue of the program (or the split) that stores it (``_add_rows``): bitwise the product
    followed by a separate broadcast add (the layer's ``h_proj(h) + e_proj(e)`` per stream),
    with neither the second launch nor y's second round trip.

    ``argmax``: (pval (R * N tiles,) fp32, pidx (R * N tiles,) int32), G = 1, no split and
    no ``add``: y is not written; each program stores its tile's best logit and index per row
    (:func:`chunk_best`, torch.argmax's rules) at ``row * N tiles + tile``, which
    kernels/lm_head.py's reduce combines into the ids (the FP8 head's greedy step)."""
    R, G, K = x.shape
    N = w.shape[1]
    if R == 0:
        return
    if argmax is not None:
        assert G == 1 and sched.split_k == 1 and add is None, "argmax: one group, no split"
    add_rows = _add_ratio(add, R, G, N)
    kb = cdiv(K, BLOCK_K)
    split = sched.split_k
    per_split = cdiv(kb, split)
    use_f32 = INTERPRET or x.dtype == torch.float32 or w.dtype == torch.float32
    n_tiles = cdiv(N, sched.block_n)
    m_blocks = cdiv(R, sched.block_m)
    if argmax is not None:
        chunk, (part, count) = m_blocks, argmax  # the epilogue's partials
    elif split == 1:
        chunk, count, part = m_blocks, y, y  # neither partials nor counters are touched
    else:
        tiles = n_tiles * G  # per M block
        if counters is None or counters.numel() < tiles:
            counters = stream_counters(x.device, m_blocks * tiles)
        chunk, count = min(m_blocks, counters.numel() // tiles), counters
        rows = min(R, chunk * sched.block_m)
        part = workspace("linear_part", (split * rows * G * N,), torch.float32, x.device)
    step = chunk * sched.block_m
    launch = triton_launch(
        linear_kernel, FMT=fmt, BLOCK_M=sched.block_m, BLOCK_N=sched.block_n, BLOCK_K=BLOCK_K,
        SPLIT_K=split, ADD_ROWS=add_rows, USE_F32=use_f32, INTERP=INTERPRET,
        ARGMAX=argmax is not None, num_warps=sched.num_warps, num_stages=sched.num_stages,
    )  # fmt: skip
    for r0 in range(0, R, step):
        xc, yc = (x, y) if step >= R else (x[r0 : r0 + step], y[r0 : r0 + step])
        rc = xc.shape[0]
        grid = (cdiv(rc, sched.block_m), n_tiles, G * split)
        launch(
            grid, xc, w, s if s.numel() else w, yc, part, count, y if add is None else add, rc,
            G, N, K, per_split, r0,
        )  # fmt: skip


#: e's and h's products of ``eh_proj`` in one launch where :func:`eh_one_launch` allows (the
#: benchmark's A/B switch; False: two launches of ``linear_kernel``, h's adding e's rows).
EH_ONE_LAUNCH = True


def eh_one_launch(
    T: int, R: int, N: int, K: int, same_format: bool, batch_invariant: bool, f32: bool = False
) -> LinearSchedule | None:
    """The schedule of ``eh_proj``'s one-launch form (:func:`eh_linear_triton`) for e's T rows
    and h's R, or None where it does not apply: off (:data:`EH_ONE_LAUNCH`), the weights of
    different formats, h beyond decode sizes (more than :data:`DECODE_MAX_ROWS` rows), or
    the two default schedules differing in more than BLOCK_M (in BLOCK_N or SPLIT_K e's
    partial sums would not be :func:`linear_triton`'s; warps and stages are kept alike too).
    ``f32``: fp32 activations or weights, whose fp32 dot is checked bitwise only on equal
    tiles: e's BLOCK_M must then be h's as well (the bf16 tensor-core dot gives a row the same
    bits in a 16- or 64-row tile: the GPU tier's composition test at 64 rows of h).  At decode sizes a call is mostly its start (launch, first
    loads, split tail: bench/results/linear-h200.md, "Decode schedules"); one launch over both
    weights pays one start instead of two."""
    if not EH_ONE_LAUNCH or not same_format or R > DECODE_MAX_ROWS:
        return None
    se = linear_schedule(T, N, K, 1, batch_invariant)
    sh = linear_schedule(R, N, K, 1, batch_invariant)
    if (se if f32 else dataclasses.replace(se, block_m=sh.block_m)) != sh:
        return None
    return sh


def eh_linear_triton(
    e: torch.Tensor,
    h: torch.Tensor,
    we: torch.Tensor,
    se: torch.Tensor,
    wh: torch.Tensor,
    sh: torch.Tensor,
    y: torch.Tensor,
    *,
    fmt: int,
    sched: LinearSchedule,
    counters: torch.Tensor | None = None,
) -> None:
    """y (R, N) = h (R, K) @ wh (N, K)^T + e (T, K) @ we (N, K)^T broadcast over runs of R / T
    rows, in one launch of :func:`eh_linear_kernel` (all contiguous; ``we``, ``wh`` one format
    and shape, their scales likewise).  Bitwise :func:`linear_triton` on e, then on h with
    ``add`` = e's product, when both take ``sched``'s BLOCK_N and SPLIT_K
    (:func:`eh_one_launch`).  ``counters``: int32 zeros, one per (M block, N tile), left
    zeroed (None or too few: the stream's).  Bytes: both weights once, 2 * SPLIT_K * R * N * 4
    of fp32 partials written and read back from L2, y once."""
    R, K = h.shape
    T, N = e.shape[0], we.shape[0]
    if R == 0:
        return
    if T == 0 or R % T or e.shape[1] != K or tuple(wh.shape) != (N, K):
        raise InputError(f"eh_linear_triton: expected e (T, {K}) with T dividing {R} rows and "
                         f"two ({N}, {K}) weights, got e {tuple(e.shape)}, wh "
                         f"{tuple(wh.shape)}")  # fmt: skip
    streams = R // T
    split = sched.split_k
    m_blocks, n_tiles = cdiv(R, sched.block_m), cdiv(N, sched.block_n)
    if counters is None or counters.numel() < m_blocks * n_tiles:
        counters = stream_counters(h.device, m_blocks * n_tiles)
    part = workspace("eh_linear_part", (2 * split * R * N,), torch.float32, h.device)
    use_f32 = INTERPRET or h.dtype == torch.float32 or we.dtype == torch.float32
    launch = triton_launch(
        eh_linear_kernel, FMT=fmt, STREAMS=streams, BLOCK_M=sched.block_m,
        BLOCK_N=sched.block_n, BLOCK_K=BLOCK_K, SPLIT_K=split, USE_F32=use_f32,
        INTERP=INTERPRET, num_warps=sched.num_warps, num_stages=sched.num_stages,
    )  # fmt: skip
    launch(
        (m_blocks, n_tiles, 2 * split), e, h, we, se if se.numel() else we, wh,
        sh if sh.numel() else wh, y, part, counters, R, N, K, cdiv(cdiv(K, BLOCK_K), split),
    )  # fmt: skip


def _add_ratio(add: torch.Tensor | None, R: int, G: int, N: int) -> int:
    """How many rows of y share one row of ``add`` (0 without one); its shape checked."""
    if add is None:
        return 0
    Ra = add.shape[0]
    if G != 1 or add.dim() != 2 or add.shape[1] != N or Ra == 0 or R % Ra:
        raise InputError(f"add: expected (R', {N}) with R' dividing {R} rows, G 1; got "
                         f"{tuple(add.shape)}, G {G}")  # fmt: skip
    return R // Ra


@triton.jit
def add_rows_kernel(y_ptr, add_ptr, R, N, ADD_ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_N: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """y[r, :] = y[r, :] + add[r // ADD_ROWS, :] in place, in y's dtype (summed in fp32,
    rounded once): program (r, n) takes rows [r*BLOCK_R, +BLOCK_R) x columns
    [n*BLOCK_N, +BLOCK_N)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    y = tl.load(y_ptr + off, mask=mask, other=0.0)
    a_off = (rows // ADD_ROWS).to(tl.int64)[:, None] * N + cols[None, :]
    a = tl.load(add_ptr + a_off, mask=mask, other=0.0)
    s = rne_bf16_if_interpreted(y.to(tl.float32) + a.to(tl.float32), y.dtype, INTERP)
    tl.store(y_ptr + off, s.to(y.dtype), mask=mask)


def add_rows_triton(y: torch.Tensor, add: torch.Tensor) -> None:
    """y (R, N) += add (R', N) broadcast over runs of R / R' rows, in place (both contiguous,
    one dtype): the prefill path's form of :func:`linear_triton`'s ``add``.  Moves y twice
    (read, write) and ``add`` once: at 4096 tokens x 4 streams of 4096 bf16, 256 + 32 MiB."""
    R, N = y.shape
    if R == 0:
        return
    ratio = _add_ratio(add, R, 1, N)
    # 8 rows x 512 columns of bf16 per 4-warp program: 16 B per thread per row
    block_r, block_n = 8, min(512, next_pow2(N))
    launch = triton_launch(
        add_rows_kernel, ADD_ROWS=ratio, BLOCK_R=block_r, BLOCK_N=block_n, INTERP=INTERPRET,
        num_warps=4,
    )  # fmt: skip
    launch((cdiv(R, block_r), cdiv(N, block_n)), y, add, R, N)


# ------------------------------------------------------------------------------ prefill path
def dequant_mm_selected(
    rows: int, exact_bf16: bool, x_dtype: torch.dtype, batch_invariant: bool
) -> bool:
    """Whether a call takes the dequantize + cuBLAS path (module doc) instead of ``linear_kernel``:
    ``rows`` (R, per group) at least :data:`DEQUANT_MM_MIN_ROWS`, an FP8 pack whose every
    code x scale is exact in bf16 (``exact_bf16``: power-of-two scales, decided once by
    ``pack_linear``; with any other scale the bf16 weight would be rounded, where the kernel
    applies the fp32 scale to fp32 partials), bf16 x (fp32 x keeps the kernel's fp32 dot), and
    not ``batch_invariant`` (cuBLAS picks its algorithm, and so its summation order, by the row
    count: batch-invariant calls keep the kernel's fixed schedule)."""
    return (
        exact_bf16
        and not batch_invariant
        and x_dtype == torch.bfloat16
        and rows >= DEQUANT_MM_MIN_ROWS
    )


@triton.jit
def dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Program (k, n, g): codes [n*BLOCK_N, +BLOCK_N) x [k*BLOCK_K, +BLOCK_K) of group g, decoded
    to bf16 (exact), times their block's fp32 scale in fp32, rounded once to bf16 (exact when the
    scale is a power of two in range; otherwise the correctly rounded product, as the core's
    dequantization).  BLOCK_N and BLOCK_K divide 128: one scale per program."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    off = (g * N + rows[:, None]) * K + cols[None, :]  # (BLOCK_N, BLOCK_K)
    codes = tl.load(w_ptr + off, mask=mask, other=0)
    KB = tl.cdiv(K, 128)
    scale = tl.load(
        s_ptr + (g * tl.cdiv(N, 128) + (pid_n * BLOCK_N) // 128) * KB + (pid_k * BLOCK_K) // 128
    )
    w = _e4m3_bf16(codes, INTERP).to(tl.float32) * scale
    w = rne_bf16_if_interpreted(w, tl.bfloat16, INTERP)
    tl.store(out_ptr + off, w.to(tl.bfloat16), mask=mask)


def dequant_bf16_triton(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
    """out (G, N, K) bf16 = e4m3 codes w (G, N, K) uint8 times their fp32 128x128 block scales
    s (G, ceil(N/128), ceil(K/128)); all contiguous.  One pass: N*K bytes in, 2*N*K out."""
    G, N, K = w.shape
    if w.numel() == 0:
        return
    launch = triton_launch(
        dequant_kernel, BLOCK_N=_DEQ_BLOCK_N, BLOCK_K=_DEQ_BLOCK_K, INTERP=INTERPRET, num_warps=4
    )
    launch((cdiv(K, _DEQ_BLOCK_K), cdiv(N, _DEQ_BLOCK_N), G), w, s, out, N, K)


@contextlib.contextmanager
def fp32_reduction(device: torch.device) -> Iterator[None]:
    """cuBLAS bf16 GEMMs with every reduction in fp32 for the duration of the block.

    ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` (True by default) lets
    cuBLAS reduce split-K partials in bf16, a second rounding of each partial that the kernel
    never makes.  The flag is process-global and read by torch when it calls cuBLAS, so it is
    cleared here (reduced precision off, split-K as it was) and restored after, whatever it
    was: nothing is set globally past the call.  A cuBLAS call of another host thread that
    falls inside the window gets fp32 reductions too, i.e. only more accurate ones.  The getter
    returns the setting in the form its setter takes (a bool, or (reduced, split_k) in torch
    versions that split the two)."""
    if device.type != "cuda":  # CPU GEMMs (the interpreter tier) accumulate bf16 in fp32
        yield
        return
    prev = torch._C._get_cublas_allow_bf16_reduced_precision_reduction()
    split = isinstance(prev, tuple)
    if not (prev[0] if split else prev):
        yield
        return
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = (False, prev[1]) if split else False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = prev


def linear_dequant_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor) -> None:
    """y (R, G, N) = x (R, G, K) @ W_g^T per group, W the FP8 weight w (G, N, K) uint8 with fp32
    block scales s dequantized to bf16 (module doc, the prefill path); x and y bf16, all
    contiguous.  The weight goes to a workspace of G*N*K bf16 (kept per shape and stream,
    kernels/_launch.py; V4-Flash's five weight shapes keep about 240 MiB: e_proj and h_proj
    share 32 MiB with the MoE's shared w13, wq_b, wo_a and wo_b 64 MiB each, wq_a + wkv 12;
    the shared w2 adds 16), then one cuBLAS GEMM with fp32 accumulation and fp32 reductions
    writes y once: ``torch.mm`` for G = 1; for G > 1 ``torch.bmm`` batched over the groups on
    strided views (x^T (G, R, K) with row stride G*K, y^T (G, R, N) with row stride G*N: cuBLAS
    takes both leading dimensions as they are, so neither is copied)."""
    R, G, K = x.shape
    N = w.shape[1]
    if R == 0:
        return
    wb = workspace("linear_weight_bf16", (G, N, K), torch.bfloat16, x.device)
    dequant_bf16_triton(w, s, wb)
    with fp32_reduction(x.device):
        if G == 1:
            torch.mm(x.view(R, K), wb[0].T, out=y.view(R, N))
        else:
            torch.bmm(x.transpose(0, 1), wb.transpose(1, 2), out=y.transpose(0, 1))
