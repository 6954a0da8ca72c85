"""hc_pre for small batches: fp32 FMA mix spread over many programs, then gates and output.

Computes what :mod:`.mhc_collapse` computes for hc_pre (``layer_input``, ``post``, ``comb``;
docs/semantics.md, "mHC: hc_pre, Sinkhorn, hc_post") with a schedule built for latency.  The
MTP draft step calls hc_pre twice per step at T = batch (1..64), where the one-pass collapse
has one token block and 16 / 28 programs: each streams 96 KB of fn and then one of them runs
the Sinkhorn, serially, on the block's 64 tokens.  Here the bytes that set the floor at small T
(fn: M*n*D*4 = 1.5 MiB at D 4096) are spread over a few hundred programs, and no program holds
more than TPP tokens' Sinkhorn.

Shapes (K = n*D, M = (2+n)*n, S = cdiv(D, BLOCK_D) slices, G = cdiv(M, ROWS) row groups):
    x     (T, n, D)   bf16 / fp32, contiguous      fn    (M, K) fp32 (or bf16), contiguous
    scale (3,) fp32,  base (M,) fp32               part  (S, T, M) fp32 workspace
    sq    (S, T) fp32 workspace                    gate  (T, NP) fp32 workspace (scratch)
    layer_input (T, D) x.dtype;  post (T, n) fp32;  comb (T, n, n) fp32

Schedule: two launches, no program waits on another.
 1. Mix (:func:`mhc_pre_mix_kernel`, grid blocks x S x G): program (q, s, r) loads the
    (BLOCK_T, BLOCK_D) tile of each of the n streams of token block q, slice s, and the
    matching (ROWS, BLOCK_D) columns of fn rows [r*ROWS, (r+1)*ROWS), all in one memory round
    trip (no K loop), forms its partial mix with fp32 FMAs (exact fp32 products, per column
    lane, streams 0..n-1 in order, then one tree sum over the lanes) and its partial square sum,
    and stores them to slot s.  At T <= BLOCK_T that is S*G = 192 / 336 programs (D 4096 /
    7168, n = 4) for the 132 SMs, each with 8 KB of fn.
 2. Gates and output (:func:`mhc_pre_apply_kernel`): the first cdiv(T, TPP) programs each take
    TPP tokens through the collapse's own reduce (``mhc_collapse._reduce_gates``: the slot sums
    in order 0..S-1, the RMS factor, the sigmoid gates, post and the Sinkhorn, in exactly its op
    order) and write post and comb; they come first in the grid because the Sinkhorn's 2*iters
    dependent normalizations are the longest chain of the launch.  Every other program takes a
    (BLOCK_TA tokens, BLOCK_DA columns) piece of layer_input: it sums the pre rows and square
    sums of its tokens in the same slot order, forms the pre gates with the same expression and
    writes the weighted sum of the n streams (streams in order 0..n-1, as the collapse's apply).
    The gates the reducers also write go to a scratch buffer nobody reads.

Arithmetic: fp32 throughout, exact fp32 products in the mix (the collapse's tensor-core mix keeps
~16 bits of fn; this one all 24).  Tile sizes depend on n and D only, and every sum runs in an
order fixed by them: a token's result does not depend on its batch.

Bytes: fn once per BLOCK_T tokens (from HBM for the first block, L2 after), x G times in the mix
(once from HBM) and once more in the apply (mostly L2), layer_input / post / comb once; the
workspace S*T*(M+1)*4 + T*NP*4 stays in L2 (the apply reads the pre rows once per column piece).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import (
    INTERPRET,
    TritonLaunch,
    cdiv,
    next_pow2,
    plan,
    rne_bf16_if_interpreted,
    sigmoid,
    triton_launch,
    workspaces,
)
from .mhc_collapse import _reduce_gates

__all__ = ["mhc_pre_fma", "pre_small_schedule"]


@triton.jit(do_not_specialize=["T"])
def mhc_pre_mix_kernel(
    x_ptr, fn_ptr, part_ptr, sq_ptr, T,
    D: tl.constexpr, N: tl.constexpr, M: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (blocks * S * G,): program (q * S + s) * G + r = token block q, slice s, rows r."""
    pid = tl.program_id(0)
    r = pid % G
    s = (pid // G) % S
    q = pid // (G * S)
    K = N * D
    t = q * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    t_ok = t < T
    t64 = t.to(tl.int64)
    d = s * BLOCK_D + tl.arange(0, BLOCK_D)  # (BD,) column of this slice, in each stream
    m = r * ROWS + tl.arange(0, ROWS)  # (R,) fn row
    m_ok = m < M
    x_ptrs = x_ptr + t64[:, None] * K + d[None, :]  # (BT, BD), stream 0
    x_ok = t_ok[:, None] & (d[None, :] < D)
    w_ptrs = fn_ptr + m[:, None] * K + d[None, :]  # (R, BD), stream 0
    w_ok = m_ok[:, None] & (d[None, :] < D)
    acc = tl.zeros((BLOCK_T, ROWS, BLOCK_D), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    # Unrolled over the streams, nothing depends on the loads: all 2n tiles are in flight at once.
    for j in tl.static_range(N):
        xj = tl.load(x_ptrs + j * D, mask=x_ok, other=0.0).to(tl.float32)  # (BT, BD)
        wj = tl.load(w_ptrs + j * D, mask=w_ok, other=0.0).to(tl.float32)  # (R, BD)
        xb, wb = tl.broadcast(xj[:, None, :], wj[None, :, :])  # (BT, R, BD)
        acc = tl.fma(xb, wb, acc)
        sq = tl.fma(xj, xj, sq)
    part = tl.sum(acc, axis=2)  # (BT, R): one tree over the column lanes
    slab = s.to(tl.int64) * T
    tl.store(
        part_ptr + (slab + t64)[:, None] * M + m[None, :],
        part,
        mask=t_ok[:, None] & m_ok[None, :],
    )
    if r == 0:
        tl.store(sq_ptr + slab + t64, tl.sum(sq, axis=1), mask=t_ok)


@triton.jit(do_not_specialize=["T"])
def mhc_pre_apply_kernel(
    x_ptr, scale_ptr, base_ptr, part_ptr, sq_ptr, gate_ptr, out_ptr, post_ptr, comb_ptr,
    T, rms_eps, hc_eps, post_mult,
    D: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, S: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr, TPP: tl.constexpr, SA: tl.constexpr,
    BLOCK_TA: tl.constexpr, BLOCK_DA: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, TPP) + cdiv(T, BLOCK_TA) * SA,): reducers first (post, comb), then the
    pieces of layer_input, program cdiv(T, TPP) + q * SA + s = token block q, column piece s."""
    pid = tl.program_id(0)
    K = N * D
    reducers = tl.cdiv(T, TPP)
    if pid < reducers:
        local = tl.arange(0, TPP)
        tr = pid * TPP + local
        _reduce_gates(
            part_ptr, sq_ptr, scale_ptr, base_ptr, gate_ptr, post_ptr, comb_ptr,
            tr, tr < T, T, K, rms_eps, hc_eps, post_mult,
            S, SINKHORN_ITERS, N, NP, M, TPP, True,
        )  # fmt: skip
    else:
        a = pid - reducers
        q = a // SA
        s = a % SA
        t = q * BLOCK_TA + tl.arange(0, BLOCK_TA)  # (BT,)
        t_ok = t < T
        t64 = t.to(tl.int64)
        j2 = tl.arange(0, NP)[None, :]
        # The pre rows and square sums in slot order 0..S-1, as _reduce_gates sums them: the
        # unrolled loop puts all S loads in flight before the first add.
        sq_tot = tl.zeros((BLOCK_TA,), dtype=tl.float32)
        pre_l = tl.zeros((BLOCK_TA, NP), dtype=tl.float32)
        row = part_ptr + t64[:, None] * M
        for ss in tl.static_range(S):
            slab = ss * T.to(tl.int64)
            sq_tot += tl.load(sq_ptr + slab + t64, mask=t_ok, other=0.0, cache_modifier=".cg")
            pre_l += tl.load(
                row + slab * M + j2, mask=t_ok[:, None] & (j2 < N), other=0.0,
                cache_modifier=".cg",
            )  # fmt: skip
        rstd = tl.math.rsqrt(sq_tot / K + rms_eps)[:, None]  # (BT, 1)
        s_pre = tl.load(scale_ptr).to(tl.float32)
        b_pre = tl.load(base_ptr + j2, mask=j2 < N, other=0.0).to(tl.float32)
        gate = sigmoid(pre_l * rstd * s_pre + b_pre) + hc_eps  # (BT, NP)
        d = s * BLOCK_DA + tl.arange(0, BLOCK_DA)  # (BD,)
        ok = t_ok[:, None] & (d[None, :] < D)
        x_ptrs = x_ptr + t64[:, None] * K + d[None, :]  # (BT, BD), stream 0
        y = tl.zeros((BLOCK_TA, BLOCK_DA), dtype=tl.float32)
        for j in tl.static_range(N):
            g = tl.sum(tl.where(j2 == j, gate, 0.0), axis=1)  # (BT,): gate j, exact
            xj = tl.load(x_ptrs + j * D, mask=ok, other=0.0).to(tl.float32)
            y += g[:, None] * xj
        out_ty = out_ptr.dtype.element_ty
        y = rne_bf16_if_interpreted(y, out_ty, INTERP)
        tl.store(out_ptr + t64[:, None] * D + d[None, :], y.to(out_ty), mask=ok)


@functools.cache
def pre_small_schedule(n: int, D: int) -> tuple[int, int, int, int, int, int, int]:
    """The schedule for (n, D); never a function of T (batch invariance).

    Mix: 8 fn rows x 16 tokens x 64 columns per program (M = 24 rows in 3 groups at n = 4):
    192 / 336 programs at T <= 16 for D 4096 / 7168, enough for the 132 SMs, while the
    (16, 8, 64) accumulator stays at 64 registers per thread with 4 warps; 16 tokens per block
    read fn from L2 4 times at T 64.  64-column slices keep the slot count S (what every
    program of phase 2 sums per token) at 64 / 112.  Reducers take 2 tokens each, the apply
    4 tokens x 256 columns (hc_head's FMA tile).  Provisional: not yet measured on the H200.
    Under the interpreter: narrower slices, so that the CPU tier's small D has several.
    """
    rows = 8
    block_t = 16
    block_d = 16 if INTERPRET else 64
    block_d = min(block_d, max(16, next_pow2(D)))
    block_da = 32 if INTERPRET else 256
    block_da = min(block_da, max(16, next_pow2(D)))
    return rows, block_t, block_d, 2, 4, block_da, 4


@functools.cache
def _launches(
    n: int, D: int, sinkhorn_iters: int
) -> tuple[tuple[int, int, int, int, int, int], TritonLaunch, TritonLaunch]:
    """((S, G, SA, mix block_t, tokens per reducer, apply block_t), mix launch, apply launch)."""
    rows, block_t, block_d, tpp, block_ta, block_da, warps = pre_small_schedule(n, D)
    M = (2 + n) * n
    S, G, SA = cdiv(D, block_d), cdiv(M, rows), cdiv(D, block_da)
    mix = triton_launch(
        mhc_pre_mix_kernel, D=D, N=n, M=M, S=S, G=G, ROWS=rows, BLOCK_T=block_t,
        BLOCK_D=block_d, num_warps=warps,
    )  # fmt: skip
    apply = triton_launch(
        mhc_pre_apply_kernel, D=D, N=n, NP=next_pow2(n), M=M, S=S,
        SINKHORN_ITERS=sinkhorn_iters, TPP=tpp, SA=SA, BLOCK_TA=block_ta, BLOCK_DA=block_da,
        INTERP=INTERPRET, num_warps=warps,
    )  # fmt: skip
    return (S, G, SA, block_t, tpp, block_ta), mix, apply


# A call's plan: (mix grid, apply grid, mix launch, apply launch, part, sq, gate).
_Plan = tuple[
    tuple[int], tuple[int], TritonLaunch, TritonLaunch, torch.Tensor, torch.Tensor, torch.Tensor
]


def _plan(device: torch.device, T: int, n: int, D: int, sinkhorn_iters: int) -> _Plan:
    """Everything of a call but its tensors and scalars; kept per (shapes, stream) by
    :func:`~._launch.plan`."""
    (S, G, SA, block_t, tpp, block_ta), mix, apply = _launches(n, D, sinkhorn_iters)
    M = (2 + n) * n
    # (S, T, M), (S, T), (T, NP): written by the mix / the reducers before they are read.
    part, sq, gate = workspaces("mhc_pre_fma", device, S * T * M, S * T, T * next_pow2(n))
    mix_grid = (cdiv(T, block_t) * S * G,)
    apply_grid = (cdiv(T, tpp) + cdiv(T, block_ta) * SA,)
    return mix_grid, apply_grid, mix, apply, part, sq, gate


def mhc_pre_fma(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    post_mult: float,
    sinkhorn_iters: int,
) -> None:
    """hc_pre of x (T, n, D) into ``out`` (T, D), ``post`` (T, n) and ``comb`` (T, n, n).

    Contiguous inputs and outputs on one device, scale / base in fp32 (validated by the
    caller).  Two launches: the mix, then the reducers and the weighted sum (module docstring).
    """
    T, n, D = x.shape
    if T == 0:
        return
    mix_grid, apply_grid, mix, apply, part, sq, gate = plan(
        _plan, x.device, T, n, D, int(sinkhorn_iters)
    )
    mix(mix_grid, x, fn, part, sq, T)
    apply(
        apply_grid, x, scale, base, part, sq, gate, out, post, comb, T, float(rms_norm_eps),
        float(hc_eps), float(post_mult),
    )  # fmt: skip
