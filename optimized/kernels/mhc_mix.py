"""mHC mix producer: split-K ``x_flat @ fn^T`` and the per-token square sum (Triton).

This is the GEMM in front of FlashInfer's ``mhc_pre_big_fuse`` (which does the Sinkhorn and the
pre-weighted sum but has no sm_90 producer for its ``dot_mix`` / ``sqrsum`` inputs).

Shapes (K = n*D, M = rows of fn, S = number of K splits):
    x     (T, K)      bf16 or fp32, contiguous (the residual streams flattened stream-major)
    fn    (M, K)      fp32 (or bf16), contiguous
    mix   (S, T, M)   fp32 out: raw, un-normalized partial projections, one slab per K split
    sqsum (S, T)      fp32 out: partial sums of x**2 over the same K split

Arithmetic: each program owns BLOCK_T tokens and one K split and walks it in BLOCK_K steps;
``tl.dot`` in TF32 (x in bf16 is exact in TF32; fn is rounded to a 10-bit mantissa, ~3e-4
relative on the mix) with fp32 accumulation; the square sum in fp32 FMAs.  The tile sizes and S
depend only on K, never on T, so a token's partials do not depend on the batch it sits in.

Bytes: reads x once (T*K*itemsize) and fn once per BLOCK_T tokens (from L2 after the first
pass); writes S*T*(M+1)*4 bytes of partials (< 3% of x at the V4 widths).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, next_pow2

__all__ = ["MIX_BLOCK_K", "MIX_BLOCK_T", "mhc_mix_splitk", "mix_num_splits"]

MIX_BLOCK_T = 64  # one Hopper warpgroup MMA tile of tokens
MIX_BLOCK_K = 128


@triton.jit(do_not_specialize=["T"])
def mhc_mix_kernel(
    x_ptr,
    fn_ptr,
    mix_ptr,
    sq_ptr,
    T,
    K,
    K_PER_SPLIT: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T), S).  Program (i, s): tokens [i*BT, (i+1)*BT), K split s."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    cols = tl.arange(0, MP)  # (MP,)
    row_ok = rows < T
    col_ok = cols < M
    k_begin = pid_s * K_PER_SPLIT
    x_row = x_ptr + rows.to(tl.int64)[:, None] * K  # (BT, 1)
    acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)  # reduced once, after the loop
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # constexpr bounds: pipelined, interpretable
        ks = k_begin + k0 + tl.arange(0, BLOCK_K)  # (BK,)
        k_ok = ks < K
        x = tl.load(x_row + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)  # (BT, BK)
        # fn is (M, K) row-major: the (BK, MP) tile below is K-major, as the MMA wants it.
        w = tl.load(
            fn_ptr + cols[None, :] * K + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        ).to(tl.float32)  # (BK, MP)
        acc = tl.dot(x, w, acc, input_precision="tf32")
        sq += x * x
    out = mix_ptr + (pid_s * T + rows.to(tl.int64))[:, None] * M + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(sq_ptr + pid_s * T + rows, tl.sum(sq, axis=1), mask=row_ok)


def mix_num_splits(K: int) -> int:
    """K splits: the largest of {1, 2, 4, 8, 16} (FlashInfer's accepted values) leaving each split
    >= 1024 columns.  A function of K only, so results never depend on T."""
    s = 1
    while s < 16 and K // (2 * s) >= 1024:
        s *= 2
    return s


def mhc_mix_splitk(
    x_flat: torch.Tensor,
    fn: torch.Tensor,
    num_splits: int,
    mix: torch.Tensor | None = None,
    sqsum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`mhc_mix_kernel`; returns ``(mix (S, T, M), sqsum (S, T))`` in fp32."""
    T, K = x_flat.shape
    M = fn.shape[0]
    dev = x_flat.device
    if mix is None:
        mix = torch.empty((num_splits, T, M), dtype=torch.float32, device=dev)
    if sqsum is None:
        sqsum = torch.empty((num_splits, T), dtype=torch.float32, device=dev)
    if T == 0:
        return mix, sqsum
    k_per_split = triton.cdiv(triton.cdiv(K, num_splits), MIX_BLOCK_K) * MIX_BLOCK_K
    grid = (triton.cdiv(T, MIX_BLOCK_T), num_splits)
    mhc_mix_kernel[grid](
        x_flat,
        fn,
        mix,
        sqsum,
        T,
        K,
        K_PER_SPLIT=k_per_split,
        M=M,
        MP=max(16, next_pow2(M)),
        BLOCK_T=MIX_BLOCK_T,
        BLOCK_K=MIX_BLOCK_K,
        num_warps=8,
        num_stages=1 if INTERPRET else 3,
    )
    return mix, sqsum
