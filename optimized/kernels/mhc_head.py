"""hc_head for small batches: one pass, fp32 FMA mix, 4-token tiles (Triton).

Computes what :mod:`.mhc_collapse` computes for hc_head (M = n gate rows, no post / comb), with
a schedule built for latency rather than bandwidth.  MTP calls hc_head from ``compute_logits``
on the sampled positions only, so its T is the number of drafted tokens (usually <= 64): there
it takes 7.4-11.3 us on the H200 against 15.7-18.5 us for the tensor-core collapse, while from
T 512 on it is slower, 2-3x at T 4096 (bench/results/mhc-h200.md).  ``hc_head(backend="auto")``
uses it.

Shapes (K = n*D; S = cdiv(D, BLOCK_D) slices):
    x     (T, n, D)   bf16 / fp32, contiguous      fn    (n, K) fp32 (or bf16), contiguous
    scale (1,) fp32,  base (n,) fp32               out   (T, D) x.dtype
    part  (S, T, MP)  fp32 workspace               sq    (S, T) fp32 workspace
    count (cdiv(T, BLOCK_T),) int32 zeros

Schedule.  Program (token block b, slice s) loads its (BLOCK_T, n, BLOCK_D) residual tile once
(a single memory round trip: no K loop), forms its partial mix with fp32 FMAs against the
matching fn columns (n rows only: tensor cores would be idle) and its partial square sum, and
stores them to slot s.  It then arrives on the block's counter (release) and spins (acquire)
until all S slices of its block have arrived - the S programs of a block have consecutive ids
and are resident together - sums the S partials in the fixed order 0..S-1, forms the gates and
writes its output slice from the tile still in registers.  The interpreter (programs run one by
one) uses the two-pass form: one launch with ``DO_MIX`` only, one with ``DO_APPLY`` only.

Arithmetic: fp32 throughout, exact fp32 products in the mix.  Tile sizes depend on n and D
only: a token's result does not depend on its batch.

Bytes: x once (T*n*D*itemsize), fn once per 4-token block (from L2: 2x the x bytes, which is
why this schedule loses at large T), out once (T*D*itemsize), workspace S*T*(MP+1)*4 (L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, next_pow2, rne_bf16_if_interpreted, sigmoid

__all__ = ["mhc_head_fma"]


@triton.jit(do_not_specialize=["T"])
def mhc_head_fma_kernel(
    x_ptr, fn_ptr, scale_ptr, base_ptr, part_ptr, sq_ptr, count_ptr, out_ptr,
    T, D, rms_eps, hc_eps,
    S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    DO_MIX: tl.constexpr, DO_APPLY: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_T) * S,); program id = block * S + slice."""
    pid = tl.program_id(0)
    blk = pid // S
    s = pid % S
    K = N * D
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    j = tl.arange(0, NP)  # (NP,) stream
    d = s * BLOCK_D + tl.arange(0, BLOCK_D)  # (BD,) column of this slice
    mm = tl.arange(0, MP)  # (MP,) mix row
    t_ok = t < T
    t3 = t.to(tl.int64)[:, None, None]
    j3 = j[None, :, None]
    d3 = d[None, None, :]
    tile_ok = (t3 < T) & (j3 < N) & (d3 < D)
    x_tile = x_ptr + t3 * K + j3 * D + d3  # (BT, NP, BD) pointers
    part_row = part_ptr + t.to(tl.int64)[:, None] * MP  # (BT, 1) within one slice's slab

    # ------------------------------------------------------------------ 1. partial mix
    if DO_MIX:
        x = tl.load(x_tile, mask=tile_ok, other=0.0)  # (BT, NP, BD), storage dtype
        xf = x.to(tl.float32)
        sq = tl.sum(tl.sum(xf * xf, axis=2), axis=1)  # (BT,)
        part = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
        for m in tl.static_range(N):
            w = tl.load(fn_ptr + m * K + j3 * D + d3, mask=(j3 < N) & (d3 < D), other=0.0).to(
                tl.float32
            )  # (1, NP, BD)
            z = tl.sum(tl.sum(xf * w, axis=2), axis=1)  # (BT,)
            part = tl.where(mm[None, :] == m, z[:, None], part)
        slab = s.to(tl.int64) * T
        tl.store(part_row + slab * MP + mm[None, :], part, mask=t_ok[:, None] & (mm[None, :] < N))
        tl.store(sq_ptr + slab + t, sq, mask=t_ok)

    # ------------------------------------------------------------------ 2. wait for the block
    if DO_MIX and DO_APPLY:
        tl.debug_barrier()  # every thread's partial stores precede the release below
        arrived = tl.atomic_add(count_ptr + blk, 1, sem="release", scope="gpu") + 1
        while arrived < S:
            arrived = tl.atomic_add(count_ptr + blk, 0, sem="acquire", scope="gpu")

    # ------------------------------------------------------------------ 3. gates and output
    if DO_APPLY:
        if not DO_MIX:
            x = tl.load(x_tile, mask=tile_ok, other=0.0)
        sq_tot = tl.zeros((BLOCK_T,), dtype=tl.float32)
        pre_l = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
        j2 = j[None, :]
        for ss in range(0, S):  # fixed order: the sum does not depend on T or on timing
            slab_ss = (ss * T).to(tl.int64)
            sq_tot += tl.load(sq_ptr + slab_ss + t, mask=t_ok, other=0.0, cache_modifier=".cg")
            pre_l += tl.load(
                part_row + slab_ss * MP + j2,
                mask=t_ok[:, None] & (j2 < N),
                other=0.0,
                cache_modifier=".cg",
            )
        rstd = tl.math.rsqrt(sq_tot / K + rms_eps)[:, None]  # (BT, 1)
        s_pre = tl.load(scale_ptr).to(tl.float32)
        b_pre = tl.load(base_ptr + j2, mask=j2 < N, other=0.0).to(tl.float32)
        gate = sigmoid(pre_l * rstd * s_pre + b_pre) + hc_eps  # (BT, NP)
        y = tl.sum(gate[:, :, None] * x.to(tl.float32), axis=1)  # (BT, BD)
        out_ok = t_ok[:, None] & (d[None, :] < D)
        out_ptrs = out_ptr + t.to(tl.int64)[:, None] * D + d[None, :]
        out_ty = out_ptr.dtype.element_ty
        y = rne_bf16_if_interpreted(y, out_ty, INTERP)
        tl.store(out_ptrs, y.to(out_ty), mask=out_ok)


def mhc_head_fma(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
) -> None:
    """Collapse x (T, n, D) into ``out`` (T, D); contiguous inputs on one device, scale / base
    in fp32 (validated by the caller)."""
    T, n, D = x.shape
    if T == 0:
        return
    NP = next_pow2(n)
    # 4 tokens x 256 columns x 4 warps: the fastest of six tiles tried on the H200 at T 1 and
    # T 4096, both D (bench/results/mhc-h200.md, "How the schedules were picked").  The
    # (BLOCK_T, NP, BLOCK_D) tile stays in registers.
    block_t = 4
    block_d = max(16, min(256, 1024 // NP))
    if INTERPRET:
        block_d = min(block_d, 64)  # several slices on the CPU tier's small shapes
    block_d = min(block_d, max(16, next_pow2(D)))
    S = triton.cdiv(D, block_d)
    blocks = triton.cdiv(T, block_t)
    MP = max(16, next_pow2(n))
    dev = x.device
    part = torch.empty((S, T, MP), dtype=torch.float32, device=dev)
    sq = torch.empty((S, T), dtype=torch.float32, device=dev)
    single_pass = not INTERPRET  # the interpreter runs programs in order: no waiting there
    count = torch.zeros((blocks,), dtype=torch.int32, device=dev) if single_pass else sq
    args = (x, fn, scale, base, part, sq, count, out, T, D, float(rms_norm_eps), float(hc_eps))
    meta = dict(S=S, N=n, NP=NP, MP=MP, BLOCK_T=block_t, BLOCK_D=block_d, INTERP=INTERPRET)
    grid = (blocks * S,)
    if single_pass:
        mhc_head_fma_kernel[grid](*args, DO_MIX=True, DO_APPLY=True, **meta, num_warps=4)
    else:
        mhc_head_fma_kernel[grid](*args, DO_MIX=True, DO_APPLY=False, **meta, num_warps=4)
        mhc_head_fma_kernel[grid](*args, DO_MIX=False, DO_APPLY=True, **meta, num_warps=4)
