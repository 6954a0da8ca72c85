"""mHC stream collapse (``hc_head``, and ``hc_pre`` with its Sinkhorn) in one pass (Triton).

Both ops compute, per token t, ``rstd = rsqrt(mean(x_flat**2) + eps)``, gate logits
``z = (x_flat @ fn^T) * rstd`` and the gated sum of the n streams
``y[t] = sum_j (sigmoid(z[t, j] * scale[0] + base[j]) + hc_eps) * x[t, j]``.
``hc_pre`` (``WITH_POST_COMB``) also writes ``post = post_mult * sigmoid(...)`` and the
Sinkhorn-normalized ``comb``.  The gates need the whole row of n*D values before the first
output can be written.

Shapes (K = n*D; M = n for hc_head, (2+n)*n for hc_pre; S = cdiv(D, D_SLICE)):
    x     (T, n, D)   bf16 / fp32, contiguous      fn    (M, K) fp32 (or bf16), contiguous
    scale (1,) or (3,) fp32                        base  (M,) fp32
    part  (S, T, M)   fp32 workspace               sq    (S, T) fp32 workspace
    gate  (T, NP)     fp32 workspace               count (cdiv(T, BLOCK_T),) int32 zeros
    out   (T, D) x.dtype;  post (T, n) fp32, comb (T, n, n) fp32 (hc_pre only)

Schedule.  Program (token block b, slice s) owns BLOCK_T tokens x all n streams x the D-slice
[s*D_SLICE, (s+1)*D_SLICE): a BLOCK_T x n*D_SLICE piece of the flattened rows.
 1. Mix: it streams its piece from HBM in BLOCK_K steps (``mix_step``: bf16 tensor cores with
    fn split into two bf16 terms, fp32 square sums) and stores its partial mix and square sum
    to slot s of the workspace.
 2. Reduce: it arrives on the block's counter; the last of the S programs to arrive sums the S
    partials in the fixed order 0..S-1, forms the gates (and post / comb with the Sinkhorn)
    and publishes them; the others wait for that.  The S programs of a block have
    consecutive ids and so are resident together (blocks are dispatched in id order, and at
    least S programs fit on the GPU), so no program waits on one that cannot start.
 3. Apply: it re-reads its piece, which it streamed microseconds ago and so finds in L2, and
    writes its D-slice of the output.
So HBM sees each residual byte once.  ``fused=False`` runs the three phases as three launches
(no in-kernel waiting; the re-read then comes from HBM): the CPU interpreter runs programs one
at a time and needs it, hc_pre uses it by default (see :func:`collapse_config`), and it is a
fallback if co-residency cannot be assumed.  The phases do the same arithmetic in both modes
(tested bitwise on the GPU).

Arithmetic: fp32 throughout; the mix as in :mod:`.mhc_mix` (~16 mantissa bits of fn).  No tile
size or reduction order depends on T: a token's result does not depend on its batch.

Bytes: x once from HBM (T*n*D*itemsize) plus once from L2, fn once per token block (L2),
out once (T*D*itemsize), post / comb (T*(n+n*n)*4); the workspace S*T*(M+1)*4 + T*NP*4 stays in
L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, next_pow2, rne_bf16_if_interpreted, sigmoid
from .mhc_mix import mix_step

__all__ = ["CollapseConfig", "collapse_config", "mhc_collapse"]


@triton.jit
def _reduce_gates(
    part_ptr, sq_ptr, scale_ptr, base_ptr, gate_ptr, post_ptr, comb_ptr,
    t, T, K, rms_eps, hc_eps, post_mult,
    S: tl.constexpr, SINKHORN_ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
    M: tl.constexpr, BLOCK_T: tl.constexpr, WITH_POST_COMB: tl.constexpr,
):  # fmt: skip
    """Sum the S partials of tokens ``t`` (BT,) in slot order 0..S-1 (independent of T and of
    timing), write gates (and post / comb).  Reading G slots per step as one tile measured
    slower on the H200 (the wider tiles cost registers), so it is one slot per step."""
    t_ok = t < T
    t64 = t.to(tl.int64)
    j = tl.arange(0, NP)
    j2 = j[None, :]
    row = part_ptr + t64[:, None] * M  # (BT, 1) within one slot's slab
    row_ok = t_ok[:, None] & (j2 < N)
    sq_tot = tl.zeros((BLOCK_T,), dtype=tl.float32)
    pre_l = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    if WITH_POST_COMB:
        # comb logits: rows 2N + jr*N + kc of the mix, jr = source stream, kc = destination.
        t3 = t64[:, None, None]
        jr = j[None, :, None]
        kc = j[None, None, :]
        crow = 2 * N + jr * N + kc
        comb_ok = (t3 < T) & (jr < N) & (kc < N)
        post_l = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
        comb_l = tl.zeros((BLOCK_T, NP, NP), dtype=tl.float32)
    for ss in range(0, S):  # constexpr bounds
        slab = ss * T.to(tl.int64)
        sq_tot += tl.load(sq_ptr + slab + t64, mask=t_ok, other=0.0, cache_modifier=".cg")
        pre_l += tl.load(row + slab * M + j2, mask=row_ok, other=0.0, cache_modifier=".cg")
        if WITH_POST_COMB:
            post_l += tl.load(row + slab * M + N + j2, mask=row_ok, other=0.0, cache_modifier=".cg")
            comb_l += tl.load(
                part_ptr + (slab + t3) * M + crow, mask=comb_ok, other=0.0, cache_modifier=".cg"
            )
    rstd = tl.math.rsqrt(sq_tot / K + rms_eps)[:, None]  # (BT, 1)
    s_pre = tl.load(scale_ptr).to(tl.float32)
    b_pre = tl.load(base_ptr + j2, mask=j2 < N, other=0.0).to(tl.float32)
    gate = sigmoid(pre_l * rstd * s_pre + b_pre) + hc_eps  # (BT, NP)
    tl.store(gate_ptr + t64[:, None] * NP + j2, gate, mask=t_ok[:, None])

    if WITH_POST_COMB:
        # post gates: rows [N, 2N) of the mix.
        ok3 = (jr < N) & (kc < N)  # (1, NP, NP)
        s_post = tl.load(scale_ptr + 1).to(tl.float32)
        s_comb = tl.load(scale_ptr + 2).to(tl.float32)
        b_post = tl.load(base_ptr + N + j2, mask=j2 < N, other=0.0).to(tl.float32)
        post = sigmoid(post_l * rstd * s_post + b_post) * post_mult
        tl.store(post_ptr + t64[:, None] * N + j2, post, mask=t_ok[:, None] & (j2 < N))
        b_comb = tl.load(base_ptr + crow, mask=ok3, other=0.0).to(tl.float32)
        c = comb_l * rstd[:, :, None] * s_comb + b_comb
        c = tl.where(ok3, c, float("-inf"))
        row_max = tl.max(c, axis=2)  # (BT, NP)
        row_max = tl.where(j2 < N, row_max, 0.0)
        e = tl.exp(c - row_max[:, :, None])  # padded entries: exp(-inf) = 0
        # Sinkhorn (spec 5.3): row softmax + eps, a column normalization, then
        # (iters - 1) x (rows, columns).  Padded entries stay exactly 0.
        row_sum = tl.where(j2 < N, tl.sum(e, axis=2), 1.0)  # padded rows: no 0/0
        p = tl.where(ok3, e / row_sum[:, :, None] + hc_eps, 0.0)
        p = p / (tl.sum(p, axis=1)[:, None, :] + hc_eps)
        for _ in range(1, SINKHORN_ITERS):
            p = p / (tl.sum(p, axis=2)[:, :, None] + hc_eps)
            p = p / (tl.sum(p, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + t3 * (N * N) + jr * N + kc, p, mask=(t3 < T) & ok3)


@triton.jit(do_not_specialize=["T"])
def mhc_collapse_kernel(
    x_ptr, fn_ptr, scale_ptr, base_ptr, part_ptr, sq_ptr, gate_ptr, count_ptr,
    out_ptr, post_ptr, comb_ptr,
    T, D, rms_eps, hc_eps, post_mult,
    S: tl.constexpr, D_SLICE: tl.constexpr, SINKHORN_ITERS: tl.constexpr,
    N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, APPLY_D: tl.constexpr,
    DO_MIX: tl.constexpr, DO_REDUCE: tl.constexpr, DO_APPLY: tl.constexpr, FUSED: tl.constexpr,
    WITH_POST_COMB: tl.constexpr, X_IS_BF16: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_T) * S,); program id = block * S + slice."""
    pid = tl.program_id(0)
    blk = pid // S
    s = pid % S
    K = N * D
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    t_ok = t < T
    t64 = t.to(tl.int64)
    x_row = x_ptr + t64[:, None] * K  # (BT, 1)

    # ------------------------------------------------------------------ 1. partial mix
    if DO_MIX:
        m = tl.arange(0, MP)
        acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
        sq = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        # One inner loop per stream.  (A single loop over all n * D_SLICE / BLOCK_K steps, with
        # the stream index computed from the step, ran 2x slower on the H200 and changed the
        # fused kernel's bits relative to the three-launch form: bench/results/
        # mhc-h200-flattened-loop-experiment.log.)
        for j in tl.static_range(N):
            for c in range(0, D_SLICE, BLOCK_K):  # constexpr bounds: pipelined
                d = s * D_SLICE + c + tl.arange(0, BLOCK_K)
                d_ok = d < D
                x = tl.load(
                    x_row + j * D + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0
                )
                w = tl.load(
                    fn_ptr + m[:, None] * K + j * D + d[None, :],
                    mask=(m[:, None] < M) & d_ok[None, :],
                    other=0.0,
                )
                acc, sq = mix_step(x, w, acc, sq, X_IS_BF16, INTERP)
        slab = s * T.to(tl.int64)
        tl.store(
            part_ptr + (slab + t64)[:, None] * M + m[None, :],
            acc,
            mask=t_ok[:, None] & (m[None, :] < M),
        )
        tl.store(sq_ptr + slab + t64, tl.sum(sq, axis=1), mask=t_ok)

    # ------------------------------------------------------------------ 2. gates
    if DO_REDUCE:
        if FUSED:
            tl.debug_barrier()  # every thread's partial stores precede the release below
            arrived = tl.atomic_add(count_ptr + blk, 1, sem="acq_rel", scope="gpu")
            is_reducer = arrived == S - 1  # the last of the block's S programs to arrive
        else:
            is_reducer = s == 0
        if is_reducer:
            _reduce_gates(
                part_ptr, sq_ptr, scale_ptr, base_ptr, gate_ptr, post_ptr, comb_ptr,
                t, T, K, rms_eps, hc_eps, post_mult,
                S, SINKHORN_ITERS, N, NP, M, BLOCK_T, WITH_POST_COMB,
            )  # fmt: skip
            if FUSED:
                tl.debug_barrier()  # the gate stores precede the release below
                tl.atomic_add(count_ptr + blk, S, sem="release", scope="gpu")
        if FUSED:
            ready = tl.atomic_add(count_ptr + blk, 0, sem="acquire", scope="gpu")
            while ready < 2 * S:
                ready = tl.atomic_add(count_ptr + blk, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()  # every thread's gate loads come after the acquire

    # ------------------------------------------------------------------ 3. weighted sum
    if DO_APPLY:
        out_ty = out_ptr.dtype.element_ty
        for c in range(0, D_SLICE, APPLY_D):
            d = s * D_SLICE + c + tl.arange(0, APPLY_D)
            ok = t_ok[:, None] & (d[None, :] < D)
            y = tl.zeros((BLOCK_T, APPLY_D), dtype=tl.float32)
            for j in tl.static_range(N):
                g = tl.load(gate_ptr + t64 * NP + j, mask=t_ok, other=0.0, cache_modifier=".cg")
                xj = tl.load(x_row + j * D + d[None, :], mask=ok, other=0.0)
                y += g[:, None] * xj.to(tl.float32)
            y = rne_bf16_if_interpreted(y, out_ty, INTERP)
            tl.store(out_ptr + t64[:, None] * D + d[None, :], y.to(out_ty), mask=ok)


@dataclass(frozen=True)
class CollapseConfig:
    """Schedule of the collapse: tokens per block, columns per slice, K step of the mix,
    columns per apply step, warps, pipeline stages, and one launch (``fused``) or three.
    :func:`collapse_config` holds the measured values."""

    block_t: int
    d_slice: int
    block_k: int
    apply_d: int
    num_warps: int
    num_stages: int
    fused: bool


def collapse_config(n: int, D: int, with_post_comb: bool = False) -> CollapseConfig:
    """The schedule for (n, D, op); never a function of T (batch invariance).

    From the H200 sweep (bench/h200_sweep.py; bench/results/mhc-h200-sweep-2-collapse.log):
    64 tokens x 256-column slices x 64-column K steps, 4 warps, 3 stages.  hc_head runs
    fused.  hc_pre runs as three launches: a kernel's registers are sized for its heaviest
    phase, and the fused kernel carrying the Sinkhorn streamed the residual with fewer
    programs per SM (T 4096, D 7168: 250 us fused vs 223 us in three launches).  Narrower
    slices cut T = 1 from 17.5 to 13 us but cost 1.3-4x at T >= 512 (sweep-4-small-t.log).
    """
    if INTERPRET:
        # CPU tier: small shapes; several slices and K steps; three launches (the interpreter
        # runs programs one after another, so in-kernel waiting would never end).
        d_slice = min(32, max(16, next_pow2(D)))
        return CollapseConfig(16, d_slice, 16, 16, num_warps=4, num_stages=1, fused=False)
    d_slice = min(256, max(64, next_pow2(D)))
    return CollapseConfig(block_t=64, d_slice=d_slice, block_k=64, apply_d=64, num_warps=4,
                          num_stages=3, fused=not with_post_comb)  # fmt: skip


def mhc_collapse(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    post: torch.Tensor | None = None,
    comb: torch.Tensor | None = None,
    post_mult: float = 2.0,
    sinkhorn_iters: int = 1,
    cfg: CollapseConfig | None = None,
) -> None:
    """Collapse x (T, n, D) into ``out`` (and ``post`` / ``comb`` for hc_pre).

    All tensors contiguous on one device, scale / base in fp32 (validated by the caller).
    """
    T, n, D = x.shape
    if T == 0:
        return
    M = fn.shape[0]
    NP = next_pow2(n)
    cfg = cfg or collapse_config(n, D, with_post_comb=post is not None)
    if INTERPRET and cfg.fused:
        raise ValueError("the fused collapse waits in-kernel; the interpreter needs fused=False")
    S = triton.cdiv(D, cfg.d_slice)
    blocks = triton.cdiv(T, cfg.block_t)
    dev = x.device
    part = torch.empty((S, T, M), dtype=torch.float32, device=dev)
    sq = torch.empty((S, T), dtype=torch.float32, device=dev)
    gate = torch.empty((T, NP), dtype=torch.float32, device=dev)
    count = torch.zeros((blocks,), dtype=torch.int32, device=dev) if cfg.fused else sq
    with_pc = post is not None
    args = (
        x, fn, scale, base, part, sq, gate, count, out,
        post if with_pc else out, comb if with_pc else out,
        T, D, float(rms_norm_eps), float(hc_eps), float(post_mult),
    )  # fmt: skip
    meta = dict(
        S=S,
        D_SLICE=cfg.d_slice,
        SINKHORN_ITERS=int(sinkhorn_iters),
        N=n,
        NP=NP,
        M=M,
        MP=max(16, next_pow2(M)),
        BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_k,
        APPLY_D=cfg.apply_d,
        WITH_POST_COMB=with_pc,
        X_IS_BF16=(x.dtype == torch.bfloat16),
        INTERP=INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    grid = (blocks * S,)
    if cfg.fused:
        mhc_collapse_kernel[grid](
            *args, DO_MIX=True, DO_REDUCE=True, DO_APPLY=True, FUSED=True, **meta
        )
        return
    for phase in ("DO_MIX", "DO_REDUCE", "DO_APPLY"):
        flags = dict(DO_MIX=False, DO_REDUCE=False, DO_APPLY=False, FUSED=False)
        flags[phase] = True
        mhc_collapse_kernel[grid](*args, **flags, **meta)
