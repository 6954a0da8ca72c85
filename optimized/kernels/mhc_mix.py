"""mHC mix producer: split-K ``x_flat @ fn^T`` and the per-token square sum (Triton).

The producer in front of FlashInfer's ``mhc_pre_big_fuse`` (Sinkhorn + pre-weighted sum), whose
``dot_mix`` / ``sqrsum`` inputs it writes (FlashInfer's own producer is sm_100-only).  Its K
step, :func:`mix_step`, is also the mix phase of the one-pass collapse (mhc_collapse.py).

Shapes (K = n*D, M = rows of fn: n for hc_head, (2+n)*n for hc_pre, S = K splits):
    x     (T, K)      bf16 or fp32, contiguous (the n streams of a token, stream-major)
    fn    (M, K)      fp32 (or bf16), contiguous
    mix   (S, T, M)   fp32 out: raw, un-normalized partial projections, one slab per K split
    sqsum (S, T)      fp32 out: partial sums of x**2 over the same K split

Arithmetic.  fn is split in registers into two bf16 terms, ``fn = hi + lo + O(2^-17 |fn|)``,
and the mix is ``x @ hi^T + x @ lo^T`` on bf16 tensor cores with fp32 accumulation: products of
bf16 values are exact, so the mix carries ~16 mantissa bits of fn (TF32 would keep 10) at the
cost of two bf16 MMAs (one TF32 MMA costs the same).  fp32 x is split too (``x_hi @ hi +
x_hi @ lo + x_lo @ hi``, the dropped ``x_lo @ lo`` term is ~2^-16 relative).  The square sum is
fp32 FMAs on the loaded tile.  Tile sizes and S are functions of (M, K, dtype), never of T, so
a token's partials do not depend on the batch it sits in.

Bytes: x once (T*K*itemsize, from HBM), fn once per BLOCK_T tokens (M*K*4 / BLOCK_T per token,
from L2 after the first block), S*T*(M+1)*4 written (the second kernel reads them from L2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, TritonLaunch, cdiv, next_pow2, triton_launch

__all__ = ["MixConfig", "mhc_mix_splitk", "mix_config", "mix_step"]


@triton.jit
def _bf16_hi_lo(v):
    """fp32 ``v`` as ``hi + lo``, both bf16: ``hi = bf16(v)``, ``lo = bf16(v - hi)`` (exact
    subtraction in fp32), so ``|v - hi - lo| <= 2^-17 |v|`` (2^-16 under the interpreter,
    whose fp32 -> bf16 conversion truncates)."""
    hi = v.to(tl.bfloat16)
    lo = (v - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` for bf16 ``a`` (BT, BK) and ``b`` (BK, MP) on tensor cores.

    Under TRITON_INTERPRET=1 (``UPCAST``) Triton 3.6 returns garbage for bf16 dots, and its
    fp32 dot goes to numpy's BLAS, whose result for one row depends on the other rows of the
    tile; so the interpreter forms the exact fp32 products and sums them over K explicitly:
    the same products as the GPU's MMA, a row-independent sum (CPU-tier batch invariance).
    """
    if UPCAST:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # (BT, BK, MP)
        return acc + tl.sum(prod, axis=1)
    return tl.dot(a, b, acc)


@triton.jit
def mix_step(x, w, acc, sq, X_IS_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """One K step of the mix: ``acc += x @ w^T`` (bf16 hi/lo split) and ``sq += x*x``.

    x: (BT, BK) bf16 / fp32 residual tile; w: (MP, BK) fn tile as stored (fp32 or bf16);
    acc: (BT, MP) fp32; sq: (BT, BK) fp32.  Shared by this file's producer and the fused
    collapse kernel (mhc_collapse.py), so both compute the same bits for the same K order.
    """
    w_hi, w_lo = _bf16_hi_lo(w.to(tl.float32))
    w_hi = tl.trans(w_hi)  # (BK, MP)
    w_lo = tl.trans(w_lo)
    xf = x.to(tl.float32)
    if X_IS_BF16:
        acc = _mma(x, w_hi, acc, UPCAST)
        acc = _mma(x, w_lo, acc, UPCAST)
    else:
        x_hi, x_lo = _bf16_hi_lo(xf)
        acc = _mma(x_hi, w_hi, acc, UPCAST)
        acc = _mma(x_hi, w_lo, acc, UPCAST)
        acc = _mma(x_lo, w_hi, acc, UPCAST)
    return acc, sq + xf * xf


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
    X_IS_BF16: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T), S).  Program (i, s): tokens [i*BT, (i+1)*BT), K split s."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    m = tl.arange(0, MP)  # (MP,) mix row, padded to the MMA's minimum width
    row_ok = rows < T
    m_ok = m < M
    k_begin = pid_s * K_PER_SPLIT
    x_row = x_ptr + rows.to(tl.int64)[:, None] * K  # (BT, 1)
    acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)  # reduced once, after the loop
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # constexpr bounds: pipelined, interpretable
        ks = k_begin + k0 + tl.arange(0, BLOCK_K)  # (BK,)
        k_ok = ks < K
        x = tl.load(x_row + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # fn rows are contiguous along K: load (MP, BK) coalesced; mix_step transposes.
        w = tl.load(
            fn_ptr + m[:, None] * K + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        acc, sq = mix_step(x, w, acc, sq, X_IS_BF16, UPCAST)
    out = mix_ptr + (pid_s * T + rows.to(tl.int64))[:, None] * M + m[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & m_ok[None, :])
    tl.store(sq_ptr + pid_s * T + rows, tl.sum(sq, axis=1), mask=row_ok)


@dataclass(frozen=True)
class MixConfig:
    """Producer schedule: tokens per program, K step, K splits, warps, pipeline stages.
    :func:`mix_config` holds the measured values."""

    block_t: int
    block_k: int
    num_splits: int
    num_warps: int
    num_stages: int


# FlashInfer's mhc_pre_big_fuse accepts these split counts for its mix / sqrsum inputs.
FLASHINFER_SPLITS = (1, 2, 4, 8, 16)


@functools.cache
def mix_config(M: int, K: int) -> MixConfig:
    """The producer schedule in front of FlashInfer's ``mhc_pre_big_fuse``; never a function
    of T (batch invariance).  S keeps each split >= 1024 columns, within FlashInfer's accepted
    values.  Tiles from the H200 sweep (bench/results/mhc-h200.md, "How the schedules were
    picked"): 128 tokens x 64 columns, 8 warps, 4 stages moved 75-79 % of copy bandwidth at
    T 4096 for M = 24, the best of the tiles tried.
    """
    s = 1
    while s < FLASHINFER_SPLITS[-1] and K // (2 * s) >= 1024:
        s *= 2
    if INTERPRET:  # small CPU shapes: short K steps so several splits and steps are exercised
        return MixConfig(block_t=16, block_k=32, num_splits=min(s, 4), num_warps=4, num_stages=1)
    return MixConfig(block_t=128, block_k=64, num_splits=s, num_warps=8, num_stages=4)


# The launch and K columns per split for (schedule, M, K, x is bf16): nothing else decides them.
_LAUNCHES: dict[tuple[MixConfig, int, int, bool], tuple[TritonLaunch, int]] = {}


def _launch(cfg: MixConfig, M: int, K: int, x_is_bf16: bool) -> tuple[TritonLaunch, int]:
    k_per_split = cdiv(cdiv(K, cfg.num_splits), cfg.block_k) * cfg.block_k
    launch = triton_launch(
        mhc_mix_kernel,
        K_PER_SPLIT=k_per_split,
        M=M,
        MP=max(16, next_pow2(M)),
        BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_k,
        X_IS_BF16=x_is_bf16,
        UPCAST=INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return launch, k_per_split


def mhc_mix_splitk(
    x_flat: torch.Tensor,
    fn: torch.Tensor,
    cfg: MixConfig,
    mix: torch.Tensor | None = None,
    sqsum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`mhc_mix_kernel`; returns ``(mix (S, T, M), sqsum (S, T))`` in fp32.

    ``x_flat`` (T, K) and ``fn`` (M, K) contiguous on one device (validated by the caller);
    ``mix`` / ``sqsum`` may be preallocated of exactly those shapes (hc_pre passes
    :func:`~._launch.workspace` buffers: the kernel writes every element its consumer reads).
    """
    T, K = x_flat.shape
    M = fn.shape[0]
    S = cfg.num_splits
    dev = x_flat.device
    if mix is None:
        mix = torch.empty((S, T, M), dtype=torch.float32, device=dev)
    if sqsum is None:
        sqsum = torch.empty((S, T), dtype=torch.float32, device=dev)
    if T == 0:
        return mix, sqsum
    key = (cfg, M, K, x_flat.dtype == torch.bfloat16)
    entry = _LAUNCHES.get(key)
    if entry is None:
        entry = _LAUNCHES[key] = _launch(*key)
    launch, _ = entry
    launch((cdiv(T, cfg.block_t), S), x_flat, fn, mix, sqsum, T, K)
    return mix, sqsum
