"""Sliding-window MQA with per-head sinks (Triton): what ``sink_attention``,
``sink_attention_varlen``, ``sink_attention_cache`` and ``sink_attention_paged`` run, and the
ring write of ``kv_cache_write``.  The math: docs/semantics.md, "Visibility and the sink
softmax", "The device ring cache" and "The paged cache".

Shapes: q (Tq, H, Dh) and out (Tq, H, Dh) contiguous, kv (Tk, Dh) contiguous (one latent per
token, the key and the value of every head), q_pos (Tq,) / k_pos (Tk,) int32 or int64,
attn_sink (H,) bf16 / fp32; varlen: cu_q, cu_k (B+1,) int prefix offsets.  q and kv bf16 or
fp32 (the same), out in q's dtype.

Schedule.  One program per (query row t, block of BLOCK_H heads, BLOCK_DV-wide slice of the
output), flattened on grid axis 0 with the output slice fastest, so the programs of one row run
side by side and share its q and keys in L2.  MQA makes the heads the M dimension of both dots:
``S = Q_t (BLOCK_H, Dh) @ K^T (Dh, BLOCK_N)`` (Dh reduced in BLOCK_D chunks), then
``O += P (BLOCK_H, BLOCK_N) @ V (BLOCK_N, BLOCK_DV)``.  A program

1. finds its sequence (varlen: the last b with ``cu_q[b] <= t``) and the keys it sees: positions
   increase strictly within a sequence, so the visible keys are one index range ``[lo, hi)``
   with ``hi`` the first key past ``pos_t`` and ``lo`` the first past ``pos_t - window``, and
   ``hi - lo <= window``.  Both come from a vectorized search (:func:`_upper_bound`: each step
   loads SEARCH evenly spaced positions and narrows the range SEARCH-fold, so a decode search is
   one or two loads and a 4096-key prefill search two; the ``lo`` search starts from
   ``hi - window``);
2. walks ``[lo, hi)`` in BLOCK_N-key blocks with an online softmax (fp32 running max, sum and
   accumulator; scores pre-multiplied by ``scale * log2(e)`` and exponentiated with exp2);
   a block past ``hi`` is masked, and keys outside ``[lo, hi)`` are never loaded, so a
   non-finite key a query does not see cannot reach it;
3. merges the sink as one more logit (``m = max(m, sink)``; its value is zero, so it enlarges
   the denominator only) and writes ``O / Z`` in q's dtype.

The blocks start at the row's own ``lo``, so a row's reduction order depends on its own keys and
positions only: every schedule is batch invariant (a row's bits do not depend on the other rows
or sequences in the call), and a decode row gives the bits of the same row inside a prefill.

Numerics: QK^T and PV on tensor cores with fp32 accumulation; for bf16 inputs P is rounded to
bf16 before the PV dot (as flash attention does), for fp32 inputs both dots are IEEE fp32 (no
TF32).  Under the interpreter every dot runs in fp32 on upcast operands (Triton's interpreted
bf16 dot is wrong) after the same bf16 rounding of P, so the CPU tier checks the GPU's rounding.

Ring cache (:func:`sink_attention_cache_kernel`).  The same grid, tiles and online-softmax step
(:func:`_rows_block`), over ring ``slots[b]`` of a cache kv (S, C, Dh), positions (S, C) whose
row ``p % C`` holds position p (-1: empty).  Positions in a ring are not sorted, so step 1 scans
the ring's C positions (SCAN at a time) for the first visible one, ``lo``; step 2 walks the
positions ``lo .. q_pos`` in BLOCK_N blocks, lane i of a block loading row ``p % C`` only where
it holds p.  With no gap in the visible positions this puts every key in the lane and block
the contiguous kernel gives it, so both round alike.  A padding row (slot < 0) loads nothing and
stores zeros.  The write (:func:`ring_write_kernel`): one program per new row, Dh values and one
position stored, nothing for a negative slot or position.

Paged cache (:func:`sink_attention_paged_kernel`).  The ring kernel with vLLM's slot in place
of ``p % C``: query t's position p lives at row ``table[t, p // BS] * BS + p % BS`` of a pool
of blocks of BS rows, kv (N, BS, Dh) and positions (N, BS), through the query's block-table row
(-1: no block).  Step 1 loads the slots of the window's positions ``[q_pos - window + 1, q_pos]``
(SCAN at a time) for the first one that holds its position; step 2 walks ``lo .. q_pos`` in the
ring kernel's blocks and lanes, so the same stored keys give the ring kernel's bits, whatever
blocks hold them.  Work is O(window), not O(table width): only the window's table entries are
read.  A query whose table row is all -1 (padding) sees nothing and stores zeros.

Bytes per call: q read once and out written once (2 * Tq * H * Dh * itemsize), plus each
sequence's visible keys: decode at V4-Flash (Tq = 1, H 64, Dh 512, window 128) reads
128 * 512 * 2 B = 128 KiB of keys per sequence from HBM, once for all 64 heads (the Dh / BLOCK_DV
programs of a row re-read them from L2), and q / out 64 KiB each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, TritonLaunch, next_pow2, rne_bf16_if_interpreted, triton_launch

__all__ = [
    "AttentionSchedule",
    "attention_schedule",
    "ring_write_triton",
    "sink_attention_cache_triton",
    "sink_attention_paged_triton",
    "sink_attention_triton",
]

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class AttentionSchedule:
    """Tiles of :func:`sink_attention_kernel` (powers of two: >= 16, search >= 2).

    block_h: heads per program (the dots' M; padded and masked past H); block_n: keys per step;
    block_d: Dh chunk of the QK^T reduction; block_dv: output columns per program (Dh / block_dv
    programs per row recompute the scores); search: positions loaded per search step.
    Every schedule computes the same function; bits may differ between schedules, never between
    batches under one schedule.
    """

    block_h: int
    block_n: int
    block_d: int
    block_dv: int
    search: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def fields(self) -> list[int]:
        return [
            self.block_h, self.block_n, self.block_d, self.block_dv, self.search,
            self.num_warps, self.num_stages,
        ]  # fmt: skip


#: From this many query rows in one call the bf16 default takes 256-wide output slices over 8
#: warps (two programs per row instead of four: the scores are recomputed half as often); below
#: it the narrow tiles' four programs per row spread the few rows over more SMs (on the H200 at
#: V4-Flash shapes, the ring-cache kernel: 11.6 against 16.9 us at B 1, 23.6 against 18.2 us at
#: B 64; bench/results/attention-h200.md).
WIDE_ROWS = 64

#: From this many rows, at V4's Dh 512, the whole row per program (:func:`attention_schedule`):
#: one program per row then fills the GPU's SMs.  On the H200 at V4-Flash shapes, against the
#: 256-wide slices: prefill 4096 502 against 930 us, 512 66 against 116 us, 128 17 against 25
#: us; the ring-cache kernel at 128 rows 20.3 against 34.7 us, but at 64 rows 19.3 against
#: 18.3 us (bench/results/attention-h200.md, "The whole row per program").
WHOLE_ROWS = 128

# Shared memory per block of the 256-wide slices with three stages at Dh 512 (compiled for
# sm_90: 212992 B; two stages 163840 B) and of the whole row with three (163840 B; two
# 131072 B: q's 64 KiB plus 32 KiB per stage for a 32-key block): bench/sm90_resources.py
WIDE_3_STAGE_SMEM = 212992
WHOLE_3_STAGE_SMEM = 163840


def attention_schedule(
    H: int,
    Dh: int,
    window: int,
    fp32: bool = False,
    rows: int | None = None,
    max_smem: int | None = None,
    cached: bool = False,
) -> AttentionSchedule:
    """The default tiles of a call with ``rows`` query rows; ``rows=None`` (what
    ``batch_invariant=True`` takes) gives the T-independent one.  ``cached``: for the
    ring-cache and paged kernels (their pipeline depth differs, below).

    bf16, the narrow tiles: up to 64 heads per program (the MQA key block is loaded once for all
    of them), key blocks of 32, Dh reduced in 64-wide chunks, 128-wide output slices, 4 warps.
    ptxas fits them in registers for sm_90 at V4-Flash / V4-Pro shapes (201 registers, no
    spills; the 64-key, 128-chunk tiles spill) and Triton's shared memory stays under the
    H200's 227 KiB (bench/sm90_resources.py).

    From :data:`WIDE_ROWS` rows where Dh has a 256-wide slice: 256-wide output slices, 8 warps
    and 3 stages (2 where the device's shared memory per block, ``max_smem``, is under
    :data:`WIDE_3_STAGE_SMEM`).

    From :data:`WHOLE_ROWS` rows at Dh 512, the whole row: Dh in one chunk and the whole
    512-wide output per program, 8 warps, 3 stages for the contiguous kernel (2 under
    :data:`WHOLE_3_STAGE_SMEM`) and 2 for the cached ones, whose key rows are gathered through
    their positions (on the H200 at 128 rows, 2 stages against 3: ring 20.3 against 21.2 us,
    paged 25.0 against 28.5; prefill 4096 515 against 502 us).  One program per (row, head
    block) instead of two: q is loaded once (the compiler hoists its loop-invariant load),
    each key block once, serving as the key of the QK^T dot and the value of the PV dot (the
    two loads have the same addresses and mask, and the compiler keeps one), and the scores
    are computed once per row.  The fp32 accumulator (64 x 512) takes 128 of the 255
    registers of each of the 256 threads.  Measured at Dh 512 only.

    The three give the same bits on the GPU: the heads and key blocks (the dots' M and the
    reduction order over keys) are the same, a dot's Dh reduction is a chain of 16-wide MMA
    steps in Dh order whatever the chunk a dot covers, and output slices and warps only choose
    which columns a program holds (checked bitwise on the H200, bench/diag/attention_sweep.py,
    and the GPU tier's ``test_the_wide_and_narrow_schedules_give_the_same_bits``), so a decode
    row keeps the bits of the same row inside a prefill.  Under the interpreter a chunk is one
    fp32 matmul, so there the whole row can differ from the others in the last bit; the CPU
    tier's bitwise tests run Dh 128, which never takes it.

    fp32 (IEEE dots on FMA units, a test dtype): 32 heads, 16 keys, 32 / 64."""
    pow2 = Dh & -Dh  # the largest power of two dividing Dh
    if fp32:
        return AttentionSchedule(
            min(32, max(16, next_pow2(H))), 16, min(32, pow2), min(64, pow2), 64, 4, 1
        )
    block_h = min(64, max(16, next_pow2(H)))
    block_n = min(32, max(16, next_pow2(window)))
    fits = lambda smem: max_smem is None or max_smem >= smem  # noqa: E731
    if rows is not None and rows >= WHOLE_ROWS and Dh == 512:
        stages = 3 if not cached and fits(WHOLE_3_STAGE_SMEM) else 2
        return AttentionSchedule(block_h, block_n, Dh, Dh, 64, 8, stages)
    if rows is not None and rows >= WIDE_ROWS and pow2 >= 256:
        stages = 3 if fits(WIDE_3_STAGE_SMEM) else 2
        return AttentionSchedule(block_h, block_n, min(64, pow2), 256, 64, 8, stages)
    return AttentionSchedule(block_h, block_n, min(64, pow2), min(128, pow2), 64, 4, 2)


@triton.jit
def _upper_bound(ptr, lo, hi, target, S: tl.constexpr):
    """The first index in [lo, hi) whose value exceeds ``target`` (hi when none does), for
    ``ptr[lo:hi]`` non-decreasing: each step loads S evenly spaced values and keeps the gap
    between the last one <= target and the next."""
    offs = tl.arange(0, S).to(tl.int64)
    while hi > lo:
        step = (hi - lo + S - 1) // S
        idx = lo + offs * step
        ok = idx < hi
        v = tl.load(ptr + idx, mask=ok, other=0).to(tl.int64)
        k = tl.sum((ok & (v <= target)).to(tl.int64), axis=0)
        new_lo = tl.where(k > 0, lo + (k - 1) * step + 1, lo)
        hi = tl.minimum(hi, lo + k * step)
        lo = new_lo
    return lo


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _key_block(
    q_rows,
    kv_ptr,
    start,
    hi,
    h_ok,
    offs_d,
    offs_dv,
    offs_n,
    m_i,
    l_i,
    acc,
    qk_scale,
    DH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One online-softmax step over the keys [start, min(start + BLOCK_N, hi))."""
    j = start + offs_n
    j_ok = j < hi
    k_rows = kv_ptr + j[:, None] * DH  # (BLOCK_N, 1)
    return _rows_block(
        q_rows, k_rows, j_ok, h_ok, offs_d, offs_dv, m_i, l_i, acc, qk_scale, DH, BLOCK_D, IEEE,
        INTERP,
    )  # fmt: skip


@triton.jit
def _rows_block(
    q_rows,
    k_rows,
    j_ok,
    h_ok,
    offs_d,
    offs_dv,
    m_i,
    l_i,
    acc,
    qk_scale,
    DH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One online-softmax step over the key rows ``k_rows`` (BLOCK_N, 1) pointers, of which the
    lanes ``j_ok`` are keys (the others are neither loaded nor weighted): shared by the
    contiguous-key kernel and the ring-cache kernel, so both round alike lane for lane."""
    s = tl.zeros([m_i.shape[0], j_ok.shape[0]], dtype=tl.float32)
    for d0 in tl.static_range(0, DH, BLOCK_D):
        qc = tl.load(q_rows + d0 + offs_d[None, :], mask=h_ok[:, None], other=0.0)
        kc = tl.load(k_rows + d0 + offs_d[None, :], mask=j_ok[:, None], other=0.0)
        s = _dot(qc, tl.trans(kc), s, IEEE, INTERP)  # (BLOCK_H, BLOCK_N)
    s = tl.where(j_ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(k_rows + offs_dv[None, :], mask=j_ok[:, None], other=0.0)  # (BLOCK_N, BLOCK_DV)
    pv = rne_bf16_if_interpreted(p, v.dtype, INTERP).to(v.dtype)
    acc = _dot(pv, v, acc * alpha[:, None], IEEE, INTERP)
    return m_new, l_i, acc


@triton.jit
def sink_attention_kernel(
    q_ptr,
    qpos_ptr,
    kv_ptr,
    kpos_ptr,
    sink_ptr,
    cuq_ptr,
    cuk_ptr,
    out_ptr,
    Tk,
    B,
    window,
    qk_scale,
    H: tl.constexpr,
    DH: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SEARCH: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    N_DV: tl.constexpr = DH // BLOCK_DV
    N_HB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    dv = pid % N_DV
    hb = (pid // N_DV) % N_HB
    t = (pid // (N_DV * N_HB)).to(tl.int64)

    # 1. the sequence's keys, then the visible range [lo, hi)
    zero = tl.zeros([], dtype=tl.int64)
    if VARLEN:
        b = _upper_bound(cuq_ptr, zero, zero + B + 1, t, SEARCH) - 1
        k_start = tl.load(cuk_ptr + b).to(tl.int64)
        k_end = tl.load(cuk_ptr + b + 1).to(tl.int64)
    else:
        k_start = zero
        k_end = zero + Tk
    pos_t = tl.load(qpos_ptr + t).to(tl.int64)
    hi = _upper_bound(kpos_ptr, k_start, k_end, pos_t, SEARCH)
    lo = _upper_bound(kpos_ptr, tl.maximum(k_start, hi - window), hi, pos_t - window, SEARCH)

    # 2. online softmax over the visible keys, BLOCK_N at a time
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + t * (H * DH) + offs_h[:, None] * DH  # (BLOCK_H, 1)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    if INTERP:
        # The interpreter's scalars are 1-element arrays, which range() cannot take.
        start = lo
        while start < hi:
            m_i, l_i, acc = _key_block(
                q_rows, kv_ptr, start, hi, h_ok, offs_d, offs_dv, offs_n, m_i, l_i, acc,
                qk_scale, DH, BLOCK_D, IEEE, INTERP,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _key_block(
                q_rows, kv_ptr, start, hi, h_ok, offs_d, offs_dv, offs_n, m_i, l_i, acc,
                qk_scale, DH, BLOCK_D, IEEE, INTERP,
            )  # fmt: skip

    # 3. the sink: one more logit with a zero value
    o = _with_sink(sink_ptr, offs_h, h_ok, m_i, l_i, acc)
    _store_rows(out_ptr, t, o, offs_h, h_ok, offs_dv, H, DH, INTERP)


@triton.jit
def _with_sink(sink_ptr, offs_h, h_ok, m_i, l_i, acc):
    """O / Z with the sink merged as one more logit whose value is zero (it enlarges Z only)."""
    sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_f)
    z = l_i * alpha + tl.exp2(sink - m_f)
    return acc * (alpha / z)[:, None]


@triton.jit
def _store_rows(out_ptr, t, o, offs_h, h_ok, offs_dv, H: tl.constexpr, DH: tl.constexpr,
                INTERP: tl.constexpr):  # fmt: skip
    out_ty = out_ptr.dtype.element_ty
    o = rne_bf16_if_interpreted(o, out_ty, INTERP)
    o_ptrs = out_ptr + t * (H * DH) + offs_h[:, None] * DH + offs_dv[None, :]
    tl.store(o_ptrs, o.to(out_ty), mask=h_ok[:, None])


@triton.jit
def sink_attention_cache_kernel(
    q_ptr,
    qpos_ptr,
    kv_ptr,
    kpos_ptr,
    slots_ptr,
    sink_ptr,
    out_ptr,
    window,
    qk_scale,
    H: tl.constexpr,
    DH: tl.constexpr,
    C: tl.constexpr,
    SCAN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Decode rows against a ring cache: row b's query attends to the rows of ring
    ``slots[b]`` (kv (S, C, DH), positions (S, C), -1 empty; the row of position p at
    ``p % C``) whose position k satisfies ``q_pos - window < k <= q_pos``."""
    N_DV: tl.constexpr = DH // BLOCK_DV
    N_HB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    dv = pid % N_DV
    hb = (pid // N_DV) % N_HB
    t = (pid // (N_DV * N_HB)).to(tl.int64)

    # 1. the ring of the row's slot, and the first visible position in it (a padding row,
    #    slot < 0, reads nothing: every load below is masked off and no block runs)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    ring_pos = kpos_ptr + slot * C
    ring_kv = kv_ptr + slot * (C * DH)
    pos_t = tl.load(qpos_ptr + t).to(tl.int64)
    hi = pos_t + 1
    lo = hi
    for c0 in tl.static_range(0, C, SCAN):
        offs_c = c0 + tl.arange(0, SCAN)
        p = tl.load(ring_pos + offs_c, mask=(offs_c < C) & valid, other=-1).to(tl.int64)
        seen = (p >= 0) & (p < hi) & (p > pos_t - window)
        lo = tl.minimum(lo, tl.min(tl.where(seen, p, hi), axis=0))

    # 2. online softmax over the positions [lo, hi), BLOCK_N at a time: position p is the row
    #    p % C when that row holds p (else absent: masked, never loaded).  Blocks start at the
    #    first visible position, so with no gap in the positions lane i of block k holds the
    #    same key as in sink_attention_kernel over the same keys: the same bits.
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + t * (H * DH) + offs_h[:, None] * DH  # (BLOCK_H, 1)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    if INTERP:
        # The interpreter's scalars are 1-element arrays, which range() cannot take.
        start = lo
        while start < hi:
            m_i, l_i, acc = _ring_block(
                q_rows, ring_kv, ring_pos, start, hi, h_ok, offs_d, offs_dv, offs_n, m_i, l_i,
                acc, qk_scale, C, DH, BLOCK_D, IEEE, INTERP,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _ring_block(
                q_rows, ring_kv, ring_pos, start, hi, h_ok, offs_d, offs_dv, offs_n, m_i, l_i,
                acc, qk_scale, C, DH, BLOCK_D, IEEE, INTERP,
            )  # fmt: skip

    # 3. the sink; a padding row stores zeros whatever its sink
    o = _with_sink(sink_ptr, offs_h, h_ok, m_i, l_i, acc)
    o = tl.where(valid, o, 0.0)
    _store_rows(out_ptr, t, o, offs_h, h_ok, offs_dv, H, DH, INTERP)


@triton.jit
def _ring_block(
    q_rows,
    ring_kv,
    ring_pos,
    start,
    hi,
    h_ok,
    offs_d,
    offs_dv,
    offs_n,
    m_i,
    l_i,
    acc,
    qk_scale,
    C: tl.constexpr,
    DH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One online-softmax step over the positions [start, min(start + BLOCK_N, hi))."""
    p = start + offs_n  # (BLOCK_N,) >= 0: start >= the first visible position
    in_window = p < hi
    row = p % C
    held = tl.load(ring_pos + row, mask=in_window, other=-1).to(tl.int64)
    k_rows = ring_kv + row[:, None] * DH  # (BLOCK_N, 1)
    return _rows_block(
        q_rows, k_rows, in_window & (held == p), h_ok, offs_d, offs_dv, m_i, l_i, acc,
        qk_scale, DH, BLOCK_D, IEEE, INTERP,
    )  # fmt: skip


@triton.jit
def _paged_rows(p, ok, table, max_blocks, kpos_ptr, BS: tl.constexpr):
    """The pool row of each position p (vLLM's slot: ``table[p // BS] * BS + p % BS``) and
    whether that row holds p; lanes with ``ok`` False, a position past the table or a -1 entry
    hold nothing and load nothing.  Rows are clamped to 0 where not held (masked pointers)."""
    j = p // BS
    listed = ok & (j < max_blocks)
    block = tl.load(table + j, mask=listed, other=-1).to(tl.int64)
    listed = listed & (block >= 0)
    row = tl.where(listed, block * BS + p % BS, 0)
    held = tl.load(kpos_ptr + row, mask=listed, other=-1).to(tl.int64)
    return row, listed & (held == p)


@triton.jit
def sink_attention_paged_kernel(
    q_ptr,
    qpos_ptr,
    kv_ptr,
    kpos_ptr,
    table_ptr,
    sink_ptr,
    out_ptr,
    max_blocks,
    window,
    qk_scale,
    H: tl.constexpr,
    DH: tl.constexpr,
    BS: tl.constexpr,
    SCAN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Query rows against a paged cache: row t attends, through its block-table row
    ``table[t]`` (max_blocks entries, -1: none), to the positions k with
    ``q_pos - window < k <= q_pos`` whose slot ``table[t, k // BS] * BS + k % BS`` of the pool
    (kv (N * BS, DH), positions (N * BS,), -1 empty) holds k."""
    N_DV: tl.constexpr = DH // BLOCK_DV
    N_HB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    dv = pid % N_DV
    hb = (pid // N_DV) % N_HB
    t = (pid // (N_DV * N_HB)).to(tl.int64)

    # 1. the first held position of the window [first, hi), SCAN positions per load (a padding
    #    row, its table row all -1, finds none: lo = hi and no block runs)
    table = table_ptr + t * max_blocks
    pos_t = tl.load(qpos_ptr + t).to(tl.int64)
    hi = pos_t + 1
    first = tl.maximum(hi - window, 0)
    lo = hi
    offs_s = tl.arange(0, SCAN).to(tl.int64)
    if INTERP:
        c0 = first
        while c0 < hi:
            p = c0 + offs_s
            _, here = _paged_rows(p, p < hi, table, max_blocks, kpos_ptr, BS)
            lo = tl.minimum(lo, tl.min(tl.where(here, p, hi), axis=0))
            c0 += SCAN
    else:
        for c0 in range(first, hi, SCAN):
            p = c0 + offs_s
            _, here = _paged_rows(p, p < hi, table, max_blocks, kpos_ptr, BS)
            lo = tl.minimum(lo, tl.min(tl.where(here, p, hi), axis=0))

    # 2. online softmax over the positions [lo, hi), BLOCK_N at a time, lane i of a block at
    #    position start + i: the ring kernel's blocks and lanes, so the same stored keys give
    #    the same bits
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + t * (H * DH) + offs_h[:, None] * DH  # (BLOCK_H, 1)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    if INTERP:
        start = lo
        while start < hi:
            m_i, l_i, acc = _paged_block(
                q_rows, kv_ptr, kpos_ptr, table, max_blocks, start, hi, h_ok, offs_d, offs_dv,
                offs_n, m_i, l_i, acc, qk_scale, BS, DH, BLOCK_D, IEEE, INTERP,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _paged_block(
                q_rows, kv_ptr, kpos_ptr, table, max_blocks, start, hi, h_ok, offs_d, offs_dv,
                offs_n, m_i, l_i, acc, qk_scale, BS, DH, BLOCK_D, IEEE, INTERP,
            )  # fmt: skip

    # 3. the sink (a row that saw nothing: acc = 0, so its output is 0 whatever its sink)
    o = _with_sink(sink_ptr, offs_h, h_ok, m_i, l_i, acc)
    _store_rows(out_ptr, t, o, offs_h, h_ok, offs_dv, H, DH, INTERP)


@triton.jit
def _paged_block(
    q_rows,
    kv_ptr,
    kpos_ptr,
    table,
    max_blocks,
    start,
    hi,
    h_ok,
    offs_d,
    offs_dv,
    offs_n,
    m_i,
    l_i,
    acc,
    qk_scale,
    BS: tl.constexpr,
    DH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One online-softmax step over the positions [start, min(start + BLOCK_N, hi))."""
    p = start + offs_n.to(tl.int64)  # (BLOCK_N,) >= 0: start >= the first visible position
    row, held = _paged_rows(p, p < hi, table, max_blocks, kpos_ptr, BS)
    k_rows = kv_ptr + row[:, None] * DH  # (BLOCK_N, 1)
    return _rows_block(
        q_rows, k_rows, held, h_ok, offs_d, offs_dv, m_i, l_i, acc, qk_scale, DH, BLOCK_D, IEEE,
        INTERP,
    )  # fmt: skip


@triton.jit
def ring_write_kernel(
    new_ptr, pos_ptr, slots_ptr, kv_ptr, kpos_ptr, C, DH: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Row t of ``new`` (T, DH) at position p into ring ``slots[t]``: kv[slot, p % C] and
    pos[slot, p % C] = p; nothing for slot < 0 or p < 0."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (p >= 0)
    row = tl.maximum(slot, 0) * C + tl.maximum(p, 0) % C
    for d0 in tl.static_range(0, DH, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        v = tl.load(new_ptr + t * DH + offs, mask=ok & (offs < DH))
        tl.store(kv_ptr + row * DH + offs, v, mask=ok & (offs < DH))
    tl.store(kpos_ptr + row, p.to(kpos_ptr.dtype.element_ty), mask=ok)


# One built launcher per (kernel, shape constants, dtype rule, schedule): the three attention
# kernels share the head-block / output-slice grid and the schedule's tile constants.
_LAUNCHES: dict[tuple[object, ...], tuple[TritonLaunch, int]] = {}


def _launch_for(
    kernel: Any, H: int, Dh: int, ieee: bool, sched: AttentionSchedule, **consts: Any
) -> tuple[TritonLaunch, int]:
    """(the launcher, programs per query row) of ``kernel`` with the schedule's tiles and
    ``consts`` (the kernel's own constexprs)."""
    key = (kernel, H, Dh, ieee, sched, tuple(sorted(consts.items())))
    entry = _LAUNCHES.get(key)
    if entry is None:
        launch = triton_launch(
            kernel,
            H=H,
            DH=Dh,
            BLOCK_H=sched.block_h,
            BLOCK_N=sched.block_n,
            BLOCK_D=sched.block_d,
            BLOCK_DV=sched.block_dv,
            IEEE=ieee,
            INTERP=INTERPRET,
            num_warps=sched.num_warps,
            num_stages=sched.num_stages,
            **consts,
        )
        per_row = (Dh // sched.block_dv) * triton.cdiv(H, sched.block_h)
        entry = _LAUNCHES[key] = (launch, per_row)
    return entry


def sink_attention_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    out: torch.Tensor,
    window: int,
    scale: float,
    sched: AttentionSchedule,
) -> torch.Tensor:
    """Launch :func:`sink_attention_kernel` (one sequence when ``cu_q`` is None)."""
    Tq, H, Dh = q.shape
    if Tq == 0:
        return out
    varlen = cu_q is not None
    launch, per_row = _launch_for(
        sink_attention_kernel, H, Dh, q.dtype == torch.float32, sched, VARLEN=varlen,
        SEARCH=sched.search,
    )  # fmt: skip
    cq = cu_q if cu_q is not None else q_pos
    ck = cu_k if cu_k is not None else k_pos
    B = cu_q.shape[0] - 1 if cu_q is not None else 1
    launch(
        (Tq * per_row,), q, q_pos, kv, k_pos, attn_sink, cq, ck, out,
        kv.shape[0], B, window, scale * _LOG2E,
    )  # fmt: skip
    return out


def sink_attention_cache_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    slots: torch.Tensor,
    attn_sink: torch.Tensor,
    out: torch.Tensor,
    window: int,
    scale: float,
    sched: AttentionSchedule,
) -> torch.Tensor:
    """Launch :func:`sink_attention_cache_kernel`: one program per (row, head block, output
    slice), as :func:`sink_attention_triton`'s grid."""
    B, H, Dh = q.shape
    if B == 0:
        return out
    C = cache_kv.shape[1]
    launch, per_row = _launch_for(
        sink_attention_cache_kernel, H, Dh, q.dtype == torch.float32, sched, C=C,
        SCAN=min(256, next_pow2(C)),
    )  # fmt: skip
    launch(
        (B * per_row,), q, q_pos, cache_kv, cache_pos, slots, attn_sink, out, window,
        scale * _LOG2E,
    )  # fmt: skip
    return out


def sink_attention_paged_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    block_table: torch.Tensor,
    attn_sink: torch.Tensor,
    out: torch.Tensor,
    window: int,
    scale: float,
    sched: AttentionSchedule,
) -> torch.Tensor:
    """Launch :func:`sink_attention_paged_kernel`: one program per (row, head block, output
    slice), as :func:`sink_attention_triton`'s grid."""
    B, H, Dh = q.shape
    if B == 0:
        return out
    launch, per_row = _launch_for(
        sink_attention_paged_kernel, H, Dh, q.dtype == torch.float32, sched,
        BS=cache_kv.shape[1], SCAN=min(256, next_pow2(window)),
    )  # fmt: skip
    launch(
        (B * per_row,), q, q_pos, cache_kv, cache_pos, block_table, attn_sink, out,
        block_table.shape[1], window, scale * _LOG2E,
    )  # fmt: skip
    return out


def ring_write_triton(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
) -> None:
    """Launch :func:`ring_write_kernel`: one program per row of ``kv`` (T, Dh)."""
    T, Dh = kv.shape
    if T == 0:
        return
    launch = triton_launch(
        ring_write_kernel, DH=Dh, BLOCK_D=min(512, next_pow2(Dh)), num_warps=4, num_stages=1
    )
    launch((T,), kv, positions, slots, cache_kv, cache_pos, cache_kv.shape[1])
