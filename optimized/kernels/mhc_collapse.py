"""mHC stream collapse (``hc_head``, and ``hc_pre`` with its Sinkhorn) in one pass (Triton).

Both ops compute, per token t, ``rstd = rsqrt(mean(x_flat**2) + eps)``, gate logits
``z = (x_flat @ fn^T) * rstd`` and the gated sum of the n streams
``y[t] = sum_j (sigmoid(z[t, j] * scale[0] + base[j]) + hc_eps) * x[t, j]``.
``hc_pre`` (``WITH_POST_COMB``) also writes ``post = 2 sigmoid(...)`` and the Sinkhorn-normalized
``comb``.  The gates need the whole row of n*D values before the first output can be written.

Shapes (K = n*D; M = n for hc_head, (2+n)*n for hc_pre; S = cdiv(D, BLOCK_D) splits):
    x     (T, n, D)   bf16 / fp32, contiguous       fn   (M, K) fp32 (or bf16), contiguous
    scale (1,) or (3,) fp32                         base (M,) fp32
    part  (S, T, MP)  fp32 workspace: partial mixes  sq   (S, T) fp32 workspace
    count (cdiv(T, BLOCK_T),) int32 zeros           out  (T, D) x.dtype
    post  (T, n) fp32, comb (T, n, n) fp32          (hc_pre only)

Schedule.  Program (token block b, split s) owns BLOCK_T tokens x all n streams x one D-slice
of BLOCK_D columns: a (BLOCK_T, n, BLOCK_D) tile of the residual.
 1. Mix: it loads its tile once, forms its partial mix against the matching fn columns and its
    partial square sum, and stores them to slot s of the workspace.
 2. Single pass (``DO_MIX and DO_APPLY``): it announces itself on the block's arrival counter
    (release) and spins (acquire) until all S slices of its token block have arrived.  The S
    programs of a block have consecutive ids, so they are resident together (blocks are
    dispatched in id order); no program waits on one that cannot start.
 3. Apply: it sums the S partials in a fixed order s = 0..S-1, forms the gates and writes its
    D-slice of the output from the tile still in registers.  Split 0 also writes post / comb.
So the residual is read from HBM exactly once.  Two-pass mode (one launch with ``DO_MIX``
only, one with ``DO_APPLY`` only) re-reads the tile instead of waiting; it runs the same
arithmetic, so both modes agree bitwise; the interpreter uses it (it runs programs one by one).

Arithmetic: fp32 throughout.  The mix is either exact fp32 FMAs (``USE_DOT=False``, used for
hc_head's M = n rows) or ``tl.dot`` in TF32 (hc_pre's 24 rows; ~3e-4 relative on the mix).  No
tile size or reduction order depends on T: a token's result does not depend on its batch.

Bytes: x once (T*n*D*itemsize), fn once per token block (L2), out once (T*D*itemsize), post and
comb (T*(n+n*n)*4); the workspace adds S*T*(MP+1)*4 written and read (L2 resident).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, next_pow2, rne_bf16_if_interpreted

__all__ = ["CollapseConfig", "mhc_collapse"]


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit(do_not_specialize=["T"])
def mhc_collapse_kernel(
    x_ptr,
    fn_ptr,
    scale_ptr,
    base_ptr,
    part_ptr,
    sq_ptr,
    count_ptr,
    out_ptr,
    post_ptr,
    comb_ptr,
    T,
    D,
    rms_eps,
    hc_eps,
    post_mult,
    S: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    DO_MIX: tl.constexpr,
    DO_APPLY: tl.constexpr,
    WITH_POST_COMB: tl.constexpr,
    INTERP: tl.constexpr,
):
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
    part_row = part_ptr + t.to(tl.int64)[:, None] * MP  # (BT, 1) within one split's slab

    # ------------------------------------------------------------------ 1. partial mix
    if DO_MIX:
        x = tl.load(x_tile, mask=tile_ok, other=0.0)  # (BT, NP, BD), storage dtype
        xf = x.to(tl.float32)
        sq = tl.sum(tl.sum(xf * xf, axis=2), axis=1)  # (BT,)
        if USE_DOT:
            # fn columns of this slice as a (NP*BD, MP) K-major tile: row r = jj*BD + dd.
            r = tl.arange(0, NP * BLOCK_D)
            jj = r // BLOCK_D
            dd = s * BLOCK_D + r % BLOCK_D
            w = tl.load(
                fn_ptr + mm[None, :] * K + (jj * D + dd)[:, None],
                mask=(mm[None, :] < M) & (jj[:, None] < N) & (dd[:, None] < D),
                other=0.0,
            ).to(tl.float32)
            part = tl.dot(tl.reshape(xf, (BLOCK_T, NP * BLOCK_D)), w, input_precision="tf32")
        else:
            part = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
            for m in tl.static_range(M):
                w = tl.load(fn_ptr + m * K + j3 * D + d3, mask=(j3 < N) & (d3 < D), other=0.0).to(
                    tl.float32
                )  # (1, NP, BD)
                z = tl.sum(tl.sum(xf * w, axis=2), axis=1)  # (BT,)
                part = tl.where(mm[None, :] == m, z[:, None], part)
        slab = s.to(tl.int64) * T
        tl.store(part_row + slab * MP + mm[None, :], part, mask=t_ok[:, None] & (mm[None, :] < M))
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
        gate = _sigmoid(pre_l * rstd * s_pre + b_pre) + hc_eps  # (BT, NP)
        y = tl.sum(gate[:, :, None] * x.to(tl.float32), axis=1)  # (BT, BD)
        out_ok = t_ok[:, None] & (d[None, :] < D)
        out_ptrs = out_ptr + t.to(tl.int64)[:, None] * D + d[None, :]
        out_ty = out_ptr.dtype.element_ty
        y = rne_bf16_if_interpreted(y, out_ty, INTERP)
        tl.store(out_ptrs, y.to(out_ty), mask=out_ok)

        if WITH_POST_COMB:  # noqa: SIM102  (constexpr test, then a runtime one)
            if s == 0:
                # post gates: rows [N, 2N) of the mix.
                post_l = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
                # comb logits: rows 2N + jr*N + kc, jr = source stream, kc = destination.
                jr = j[None, :, None]
                kc = j[None, None, :]
                ok3 = (jr < N) & (kc < N)  # (1, NP, NP)
                crow = 2 * N + jr * N + kc
                comb_l = tl.zeros((BLOCK_T, NP, NP), dtype=tl.float32)
                part3 = part_ptr + t3 * MP
                for ss in range(0, S):
                    slab_ss = (ss * T).to(tl.int64)
                    post_l += tl.load(
                        part_row + slab_ss * MP + N + j2,
                        mask=t_ok[:, None] & (j2 < N),
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    comb_l += tl.load(
                        part3 + slab_ss * MP + crow,
                        mask=(t3 < T) & ok3,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                s_post = tl.load(scale_ptr + 1).to(tl.float32)
                s_comb = tl.load(scale_ptr + 2).to(tl.float32)
                b_post = tl.load(base_ptr + N + j2, mask=j2 < N, other=0.0).to(tl.float32)
                post = _sigmoid(post_l * rstd * s_post + b_post) * post_mult
                tl.store(
                    post_ptr + t.to(tl.int64)[:, None] * N + j2,
                    post,
                    mask=t_ok[:, None] & (j2 < N),
                )
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


class CollapseConfig:
    """Tile sizes (functions of n, D and the op only; never of T)."""

    def __init__(self, n: int, D: int, with_post_comb: bool, single_pass: bool) -> None:
        self.NP = next_pow2(n)
        M = (2 + n) * n if with_post_comb else n
        self.M = M
        self.MP = max(16, next_pow2(M))
        self.use_dot = with_post_comb  # 24 rows: tensor cores; hc_head's n rows: FMAs
        self.BLOCK_T = 16
        if with_post_comb:  # noqa: SIM108
            # The (NP*BLOCK_D, MP) fp32 fn tile of the dot stays <= 64 KB of shared memory:
            # 128 columns for n = 4 (24 rows padded to 32).
            block_d = 16384 // (self.NP * self.MP)
        else:
            # The (BLOCK_T, NP, BLOCK_D) residual tile stays in registers: 16K elements.
            block_d = 1024 // self.NP
        block_d = max(16, min(256, block_d))
        # hc_head (FMA mix): 4 tokens x 256 columns x 4 warps was the fastest of six tiles in
        # the H200 sweep (bench/h200_sweep.py; bench/results/mhc-h200-sweep.log).
        if INTERPRET:
            # Small slices so the CPU tier exercises several splits (two-pass mode there).
            block_d = min(block_d, 64)
        self.BLOCK_D = min(block_d, max(16, next_pow2(D)))
        self.num_warps = 8
        if not with_post_comb:
            self.BLOCK_T, self.num_warps = 4, 4
        self.single_pass = single_pass and not INTERPRET


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
    single_pass: bool = True,
    block_t: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Launch the collapse for x (T, n, D) into ``out`` (and ``post`` / ``comb`` when given).

    All tensors must be contiguous and on one device; validation is the caller's job.
    """
    T, n, D = x.shape
    with_pc = post is not None
    cfg = CollapseConfig(n, D, with_pc, single_pass)
    # Overrides for tile sweeps (bench/h200_sweep.py); the defaults come from CollapseConfig.
    if block_t is not None:
        cfg.BLOCK_T = block_t
    if block_d is not None:
        cfg.BLOCK_D = block_d
    if num_warps is not None:
        cfg.num_warps = num_warps
    if T == 0:
        return
    S = triton.cdiv(D, cfg.BLOCK_D)
    blocks = triton.cdiv(T, cfg.BLOCK_T)
    dev = x.device
    part = torch.empty((S, T, cfg.MP), dtype=torch.float32, device=dev)
    sq = torch.empty((S, T), dtype=torch.float32, device=dev)
    count = torch.zeros((blocks,), dtype=torch.int32, device=dev) if cfg.single_pass else sq
    post_arg = post if with_pc else out
    comb_arg = comb if with_pc else out
    common = dict(
        N=n,
        NP=cfg.NP,
        M=cfg.M,
        MP=cfg.MP,
        BLOCK_T=cfg.BLOCK_T,
        BLOCK_D=cfg.BLOCK_D,
        USE_DOT=cfg.use_dot,
        WITH_POST_COMB=with_pc,
        num_warps=cfg.num_warps,
        INTERP=INTERPRET,
    )
    args = (x, fn, scale, base, part, sq, count, out, post_arg, comb_arg, T, D)
    scalars = (float(rms_norm_eps), float(hc_eps), float(post_mult))
    common["S"] = S
    common["SINKHORN_ITERS"] = int(sinkhorn_iters)
    grid = (blocks * S,)
    if cfg.single_pass:
        mhc_collapse_kernel[grid](*args, *scalars, DO_MIX=True, DO_APPLY=True, **common)
    else:
        mhc_collapse_kernel[grid](*args, *scalars, DO_MIX=True, DO_APPLY=False, **common)
        mhc_collapse_kernel[grid](*args, *scalars, DO_MIX=False, DO_APPLY=True, **common)
