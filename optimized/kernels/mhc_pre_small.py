"""hc_pre for small batches: fp32 FMA mix spread over many programs, then gates and output.

Computes what :mod:`.mhc_collapse` computes for hc_pre (``layer_input``, ``post``, ``comb``;
docs/semantics.md, "mHC: hc_pre, Sinkhorn, hc_post") with a schedule built for latency.  The
MTP draft step calls hc_pre twice per step at T = batch (1..64), where the one-pass collapse
runs one token block on 16 / 28 programs (D 4096 / 7168): each streams 96 KB of fn in K steps
before its share of the block's Sinkhorn can start.  Here the bytes that set the floor at small
T (fn: M*n*D*4 = 1.5 MiB at D 4096) are spread over a few hundred programs, each loading its
share in one round trip, and no program holds more than TPP tokens' Sinkhorn.

Shapes (K = n*D, M = (2+n)*n, S = cdiv(D, BLOCK_D) slices, G = cdiv(M, ROWS) row groups):
    x     (T, n, D)   bf16 / fp32, contiguous      fn    (M, K) fp32 (or bf16), contiguous
    scale (3,) fp32,  base (M,) fp32               part  (S, T, M) fp32 workspace
    sq    (S, T) fp32 workspace
    layer_input (T, D) x.dtype;  post (T, n) fp32;  comb (T, n, n) fp32

Schedule: two launches, no program waits on another.
 1. Mix (:func:`mhc_pre_mix_kernel`, grid blocks x S x G): program (q, s, r) loads the
    (BLOCK_T, BLOCK_D) tile of each of the n streams of token block q, slice s, and the
    matching (ROWS, BLOCK_D) columns of fn rows [r*ROWS, (r+1)*ROWS), all in one memory round
    trip (no K loop), forms its partial mix with fp32 FMAs (exact fp32 products, per column
    lane, streams 0..n-1 in order, then one tree sum over the lanes) and its partial square sum,
    and stores them to slot s.  At T <= BLOCK_T that is S*G = 192 / 336 programs (D 4096 /
    7168, n = 4) for the 132 SMs, each with 8 KB of fn.
 2. Gates and output (:func:`mhc_pre_apply_kernel`): the first cdiv(T, TPP) programs each
    form post and comb of TPP tokens; they come first in the grid because the Sinkhorn's
    2*iters - 1 dependent normalizations are the longest chain of the launch.  Every other
    program takes a (BLOCK_TA tokens, BLOCK_DA columns) piece of layer_input: it forms the pre
    gates of its tokens and writes the weighted sum of the n streams (streams in order 0..n-1,
    as the collapse's apply).  Both load the S slot partials they need as one tile (one L2
    round trip; the collapse's reducer loads slot after slot) and sum each value by one tree
    over the slots; the gates and the Sinkhorn then follow the op order of the collapse's
    ``_reduce_gates``.

With the next RMSNorm's weight (``norm_weight``; ``NORM`` in the apply kernel) the pieces give
way to one program per token after the reducers: it forms its gates from its BLOCK_TA-token
block's tile as the pieces do (the same bits), writes its whole row of layer_input in
ROW_CHUNK-column chunks, and after a CTA barrier normalizes the row in place with
``rms_norm_kernel``'s row body (:func:`weighted_row_norm`): bitwise layer_input followed by
``rms_norm_triton`` at this launch's warps.  It runs beside the Sinkhorn programs, which it
does not wait for; the norm's own launch and its read of layer_input are what it saves (the row
is re-read from L1 / L2, the weight read once per token).

hc_post_pre (:func:`mhc_post_pre_fma`): the same two launches with the previous sublayer's
hc_post folded into the mix (``FUSE_POST``): each mix program forms its (BLOCK_T, BLOCK_D) tiles
of the new streams from the sublayer output, the old streams and their post / comb gates, the
programs of row group 0 store them, and all mix them from registers; the apply reads the stored
streams.  One launch and one read of the new streams fewer than hc_post followed by hc_pre, at
the cost of the sublayer output tile and n + n*n gate values per mix program (130 registers
against 125 at the default tile: 3 programs per SM instead of 4, no spills;
bench/sm90_resources.py --pre-fma).

Latency: in every phase all independent loads are issued before the first layout conversion or
reduction, whose barrier would otherwise make each later load wait for the ones before it (one
memory round trip per stream or per tile instead of one per phase; checked in the sm_90 SASS).

Arithmetic: fp32 throughout, exact fp32 products in the mix (the collapse's tensor-core mix keeps
~16 bits of fn; this one all 24).  The T-independent schedule's tiles depend on n and D only,
and every sum runs in an order fixed by them: a token's result does not depend on its batch
(``batch_invariant=True``).  Without batch invariance a call of fewer than 16 tokens shrinks the
mix's token block to fit them (``by_tokens``, :func:`pre_fma_config`).

Bytes: fn once per BLOCK_T tokens (from HBM for the first block, L2 after), x G times in the mix
(once from HBM) and once more in the apply (mostly L2), layer_input / post / comb once; the
workspace S*T*(M+1)*4 stays in L2 (each piece of layer_input reads its tokens' pre rows).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4mtp.errors import ConfigError

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
from .rms_norm import norm_row, row_meta

__all__ = [
    "PreFmaConfig",
    "gate_of",
    "mhc_post_pre_fma",
    "mhc_pre_fma",
    "norm_order",
    "pre_fma_config",
    "stream_sum",
    "weighted_row_norm",
]


@triton.jit
def _post_tiles(
    xs, a_ptr, post_ptr, comb_ptr, xnew_ptr, t64, t_ok, d, x_ok, store, D: tl.constexpr,
    N: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """hc_post of the (BT, BD) tiles ``xs`` (one per source stream) -> the n destination tiles
    of x_new, rounded to x's dtype (the tuple the mix reads), stored to ``xnew_ptr`` when
    ``store``.  Per element, fp32, mhc_post_kernel's order: ``post[k] * a``, then one FMA per
    source j = 0..n-1, one rounding.  All loads first (see the mix kernel)."""
    K = N * D
    a = tl.load(a_ptr + t64[:, None] * D + d[None, :], mask=x_ok, other=0.0).to(tl.float32)
    ps = ()  # type: tuple[tl.tensor, ...]
    cs = ()  # type: tuple[tl.tensor, ...]
    for k in tl.static_range(N):
        ps = ps + (tl.load(post_ptr + t64 * N + k, mask=t_ok, other=0.0),)  # noqa: RUF005  (BT,)
        for j in tl.static_range(N):
            cs = cs + (  # noqa: RUF005  (BT,): comb[t, j, k], source j, destination k
                tl.load(comb_ptr + t64 * (N * N) + j * N + k, mask=t_ok, other=0.0),
            )
    x_ty = xnew_ptr.dtype.element_ty
    out = ()  # type: tuple[tl.tensor, ...]
    for k in tl.static_range(N):
        acc = ps[k][:, None] * a  # (BT, BD)
        for j in tl.static_range(N):
            acc = tl.fma(cs[k * N + j][:, None], xs[j].to(tl.float32), acc)
        y = rne_bf16_if_interpreted(acc, x_ty, INTERP).to(x_ty)
        if store:
            tl.store(xnew_ptr + t64[:, None] * K + k * D + d[None, :], y, mask=x_ok)
        out = out + (y,)  # noqa: RUF005
    return out


@triton.jit(do_not_specialize=["T"])
def mhc_pre_mix_kernel(
    x_ptr, fn_ptr, part_ptr, sq_ptr, a_ptr, post_in_ptr, comb_in_ptr, xnew_ptr, T,
    D: tl.constexpr, N: tl.constexpr, M: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, FUSE_POST: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """Grid (blocks * S * G,): program (q * S + s) * G + r = token block q, slice s, rows r.

    ``FUSE_POST``: the streams are first formed by hc_post from the previous sublayer's output
    ``a`` (T, D), the residual x (T, n, D) and its ``post`` (T, n) / ``comb`` (T, n, n) (fp32):
    ``x_new[:, k] = post[:, k] * a + sum_j comb[:, j, k] * x[:, j]`` in mhc_post_kernel's op
    order (kernels/mhc_post.py), rounded to x's dtype; the programs of rows r = 0 store their
    tile of x_new (xnew_ptr) and every program mixes the rounded tile from its registers, so
    its bits are those of hc_post followed by this kernel on x_new.  Otherwise the extra
    pointers are not read."""
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
    # All 2n tiles are loaded before the first is used: the products need them in another
    # layout (a shared-memory round trip behind a barrier), and a load issued after that
    # barrier would wait for the one before it, n dependent memory round trips instead of one.
    # Tuples grow by concatenation: Triton's frontend has no starred tuple display.
    xs = ()  # type: tuple[tl.tensor, ...]
    ws = ()  # type: tuple[tl.tensor, ...]
    for j in tl.static_range(N):
        xs = xs + (tl.load(x_ptrs + j * D, mask=x_ok, other=0.0),)  # noqa: RUF005  (BT, BD)
        ws = ws + (tl.load(w_ptrs + j * D, mask=w_ok, other=0.0),)  # noqa: RUF005  (R, BD)
    if FUSE_POST:
        xs = _post_tiles(
            xs, a_ptr, post_in_ptr, comb_in_ptr, xnew_ptr, t64, t_ok, d, x_ok, r == 0, D, N,
            INTERP,
        )  # fmt: skip
    for j in tl.static_range(N):
        xj = xs[j].to(tl.float32)
        wj = ws[j].to(tl.float32)
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


@triton.jit
def _post_comb(
    part_ptr, sq_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, t, t_ok, T, K, rms_eps, hc_eps,
    post_mult, S: tl.constexpr, SP: tl.constexpr, SINKHORN_ITERS: tl.constexpr, N: tl.constexpr,
    NP: tl.constexpr, M: tl.constexpr,
):  # fmt: skip
    """post and comb of the tokens ``t`` (TPP,): their S slot partials loaded as one tile (one L2
    round trip) and summed by one tree per value, then the gates and the Sinkhorn in the op order
    of ``mhc_collapse._reduce_gates`` (docs/semantics.md, "Sinkhorn")."""
    t64 = t.to(tl.int64)
    sl = tl.arange(0, SP)
    j = tl.arange(0, NP)
    j2 = j[None, :]
    jr = j[None, :, None]
    kc = j[None, None, :]
    crow = 2 * N + jr * N + kc  # (1, NP, NP): comb row jr*N + kc (source jr, destination kc)
    jk_ok = (jr < N) & (kc < N)
    # Every load before the first sum (see the mix kernel: a load behind a reduction's barrier
    # would wait for the loads before it).  (SP, TPP) square sums, (SP, TPP, NP) post rows and
    # (SP, TPP, NP, NP) comb rows of each slot; padded slots load zeros.
    s2 = sl[:, None]
    sq_all = tl.load(sq_ptr + s2 * T + t64[None, :], mask=(s2 < S) & t_ok[None, :], other=0.0,
                     cache_modifier=".cg")  # fmt: skip
    s3 = sl[:, None, None]
    row3 = part_ptr + (s3 * T + t64[None, :, None]) * M  # (SP, TPP, 1)
    ok3 = (s3 < S) & t_ok[None, :, None]
    post_all = tl.load(row3 + N + j[None, None, :], mask=ok3 & (j[None, None, :] < N), other=0.0,
                       cache_modifier=".cg")  # fmt: skip
    comb_all = tl.load(row3[:, :, :, None] + crow[None, :, :, :],
                       mask=ok3[:, :, :, None] & jk_ok[None, :, :, :], other=0.0,
                       cache_modifier=".cg")  # fmt: skip
    s_post = tl.load(scale_ptr + 1).to(tl.float32)
    s_comb = tl.load(scale_ptr + 2).to(tl.float32)
    b_post = tl.load(base_ptr + N + j2, mask=j2 < N, other=0.0).to(tl.float32)
    b_comb = tl.load(base_ptr + crow, mask=jk_ok, other=0.0).to(tl.float32)
    sq_tot = tl.sum(sq_all, axis=0)  # (TPP,)
    post_l = tl.sum(post_all, axis=0)  # (TPP, NP)
    comb_l = tl.sum(comb_all, axis=0)  # (TPP, NP, NP)
    rstd = tl.math.rsqrt(sq_tot / K + rms_eps)[:, None]  # (TPP, 1)
    post = sigmoid(post_l * rstd * s_post + b_post) * post_mult
    tl.store(post_ptr + t64[:, None] * N + j2, post, mask=t_ok[:, None] & (j2 < N))
    c = comb_l * rstd[:, :, None] * s_comb + b_comb
    c = tl.where(jk_ok, c, float("-inf"))
    row_max = tl.max(c, axis=2)  # (TPP, NP)
    row_max = tl.where(j2 < N, row_max, 0.0)
    e = tl.exp(c - row_max[:, :, None])  # padded entries: exp(-inf) = 0
    # Row softmax + eps, a column normalization, then (iters - 1) x (rows, columns); padded
    # entries stay 0.
    row_sum = tl.where(j2 < N, tl.sum(e, axis=2), 1.0)  # padded rows: no 0/0
    p = tl.where(jk_ok, e / row_sum[:, :, None] + hc_eps, 0.0)
    p = p / (tl.sum(p, axis=1)[:, None, :] + hc_eps)
    for _ in range(1, SINKHORN_ITERS):
        p = p / (tl.sum(p, axis=2)[:, :, None] + hc_eps)
        p = p / (tl.sum(p, axis=1)[:, None, :] + hc_eps)
    t3 = t64[:, None, None]
    tl.store(comb_ptr + t3 * (N * N) + jr * N + kc, p, mask=t_ok[:, None, None] & jk_ok)


@triton.jit
def _pre_gates(
    part_ptr, sq_ptr, scale_ptr, base_ptr, t, t_ok, T, K, rms_eps, hc_eps, S: tl.constexpr,
    SP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr,
):  # fmt: skip
    """The pre gates (BT, NP) of the tokens ``t`` (BT,): the pre rows and square sums of all S
    slots as one tile each and the parameters, all loaded before the first sum (see the mix
    kernel), each value summed by one tree over the slots.  The tree follows the tile's layout,
    so every caller passes the same BT (the apply's BLOCK_TA) for the same bits."""
    t64 = t.to(tl.int64)
    j = tl.arange(0, NP)
    j2 = j[None, :]
    sl = tl.arange(0, SP)
    s2 = sl[:, None]
    sq_all = tl.load(sq_ptr + s2 * T + t64[None, :], mask=(s2 < S) & t_ok[None, :],
                     other=0.0, cache_modifier=".cg")  # fmt: skip
    s3 = sl[:, None, None]
    row3 = part_ptr + (s3 * T + t64[None, :, None]) * M  # (SP, BT, 1)
    pre_all = tl.load(row3 + j[None, None, :],
                      mask=(s3 < S) & t_ok[None, :, None] & (j[None, None, :] < N),
                      other=0.0, cache_modifier=".cg")  # fmt: skip
    s_pre = tl.load(scale_ptr).to(tl.float32)
    b_pre = tl.load(base_ptr + j2, mask=j2 < N, other=0.0).to(tl.float32)
    sq_tot = tl.sum(sq_all, axis=0)  # (BT,)
    pre_l = tl.sum(pre_all, axis=0)  # (BT, NP)
    rstd = tl.math.rsqrt(sq_tot / K + rms_eps)[:, None]  # (BT, 1)
    return sigmoid(pre_l * rstd * s_pre + b_pre) + hc_eps  # (BT, NP)


@triton.jit
def stream_sum(gate, xf, N: tl.constexpr):
    """``sum_j gate[:, j] * x_j`` of a (BT, NP, BD) fp32 tile of streams -> (BT, BD) fp32: the
    streams added in the order 0..n-1, each stream and gate picked out of its tile exactly (a
    sum of zeros and one value).  Elementwise, so its bits do not depend on the tile: the
    whole-row programs (:func:`weighted_row_norm`) add a row the same way."""
    j = tl.arange(0, gate.shape[1])
    j2 = j[None, :]
    j3 = j[None, :, None]
    y = tl.zeros((xf.shape[0], xf.shape[2]), dtype=tl.float32)
    for jj in tl.static_range(N):
        g = tl.sum(tl.where(j2 == jj, gate, 0.0), axis=1)  # (BT,): gate jj, exact
        xj = tl.sum(tl.where(j3 == jj, xf, 0.0), axis=1)  # (BT, BD), exact
        y += g[:, None] * xj
    return y


@triton.jit
def gate_of(gate, row, jj):
    """Entry (row, jj) of a (BT, NP) gate tile as a scalar, exactly (a sum of zeros and one
    value; the gates are > 0, so no signed zero is lost)."""
    bt = tl.arange(0, gate.shape[0])[:, None]
    j2 = tl.arange(0, gate.shape[1])[None, :]
    return tl.sum(tl.sum(tl.where((bt == row) & (j2 == jj), gate, 0.0), axis=1), axis=0)


@triton.jit
def weighted_row_norm(
    x_row, gates, o_row, w_ptr, D_RT, eps, D: tl.constexpr, N: tl.constexpr,
    CHUNK: tl.constexpr, VLLM_ORDER: tl.constexpr, NORM_BLOCK: tl.constexpr,
    NORM_CHUNKS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """One token's whole row, for the apply launches that end in the sublayer's RMSNorm:
    ``y = sum_j gates[j] * x_j`` over its n streams (D apart from ``x_row``; ``gates`` a tuple of
    n fp32 scalars), the streams added in the order 0..n-1 as the column-piece programs add them
    (the same elementwise ops: the same bits), rounded to o_row's dtype and stored to ``o_row``;
    then, after a CTA barrier that makes those stores visible to every thread of the program,
    :func:`~.rms_norm.norm_row` over ``o_row`` in place (its second walk reads and writes each
    element in the same thread), with ``D_RT`` (= D, a runtime int as in rms_norm_kernel) and
    rms_norm_kernel's chunk: bitwise ``rms_norm_triton`` of the stored row at this launch's
    warp count.  The row's n loads per chunk are all issued, in program order, before the first
    product; how many stay in flight at once is ptxas's choice (at D 4096 half of them before
    the first FMA in the sm_90 SASS: the two waves of a round trip each)."""
    out_ty = o_row.dtype.element_ty
    NCH: tl.constexpr = (D + CHUNK - 1) // CHUNK
    xs = ()  # type: tuple[tl.tensor, ...]
    for c in tl.static_range(NCH):
        d = c * CHUNK + tl.arange(0, CHUNK)
        for jj in tl.static_range(N):
            xs = xs + (tl.load(x_row + jj * D + d, mask=d < D, other=0.0),)  # noqa: RUF005
    for c in tl.static_range(NCH):
        d = c * CHUNK + tl.arange(0, CHUNK)
        y = tl.zeros((CHUNK,), dtype=tl.float32)
        for jj in tl.static_range(N):
            y += gates[jj] * xs[c * N + jj].to(tl.float32)
        y = rne_bf16_if_interpreted(y, out_ty, INTERP)
        tl.store(o_row + d, y.to(out_ty), mask=d < D)
    tl.debug_barrier()
    norm_row(
        o_row, w_ptr, o_row, D_RT, eps, True, False, True, VLLM_ORDER, NORM_BLOCK, NORM_CHUNKS,
        INTERP,
    )  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def mhc_pre_apply_kernel(
    x_ptr, scale_ptr, base_ptr, part_ptr, sq_ptr, out_ptr, post_ptr, comb_ptr, w_ptr,
    T, D_RT, rms_eps, hc_eps, post_mult,
    D: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, S: tl.constexpr,
    SP: tl.constexpr, SINKHORN_ITERS: tl.constexpr, TPP: tl.constexpr, SA: tl.constexpr,
    BLOCK_TA: tl.constexpr, BLOCK_DA: tl.constexpr, NORM: tl.constexpr,
    VLLM_ORDER: tl.constexpr, ROW_CHUNK: tl.constexpr, NORM_BLOCK: tl.constexpr,
    NORM_CHUNKS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, TPP) + cdiv(T, BLOCK_TA) * SA,): reducers first (post, comb), then the
    pieces of layer_input, program cdiv(T, TPP) + q * SA + s = token block q, column piece s.

    ``NORM``: grid (cdiv(T, TPP) + T,): after the reducers one program per token writes its
    whole row and normalizes it in place with the weight ``w_ptr`` (D,) (:func:`weighted_row_
    norm`; VLLM_ORDER as rms_norm_kernel's); its gates come from its BLOCK_TA-token block's tile,
    as the pieces form them.  Without NORM, ``w_ptr`` and D_RT are not read."""
    pid = tl.program_id(0)
    K = N * D
    reducers = tl.cdiv(T, TPP)
    if pid < reducers:
        tr = pid * TPP + tl.arange(0, TPP)
        _post_comb(
            part_ptr, sq_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, tr, tr < T, T, K,
            rms_eps, hc_eps, post_mult, S, SP, SINKHORN_ITERS, N, NP, M,
        )  # fmt: skip
    elif NORM:
        row = pid - reducers  # the token
        q = row // BLOCK_TA
        t = q * BLOCK_TA + tl.arange(0, BLOCK_TA)  # (BT,): the block whose gate tile it forms
        gate = _pre_gates(
            part_ptr, sq_ptr, scale_ptr, base_ptr, t, t < T, T, K, rms_eps, hc_eps, S, SP, N,
            NP, M,
        )  # fmt: skip
        gates = ()  # type: tuple[tl.tensor, ...]
        for jj in tl.static_range(N):
            gates = gates + (gate_of(gate, row - q * BLOCK_TA, jj),)  # noqa: RUF005
        r64 = row.to(tl.int64)
        weighted_row_norm(
            x_ptr + r64 * K, gates, out_ptr + r64 * D, w_ptr, D_RT, rms_eps, D, N, ROW_CHUNK,
            VLLM_ORDER, NORM_BLOCK, NORM_CHUNKS, INTERP,
        )  # fmt: skip
    else:
        a = pid - reducers
        q = a // SA
        s = a % SA
        t = q * BLOCK_TA + tl.arange(0, BLOCK_TA)  # (BT,)
        t_ok = t < T
        t64 = t.to(tl.int64)
        j = tl.arange(0, NP)
        d = s * BLOCK_DA + tl.arange(0, BLOCK_DA)  # (BD,)
        ok = t_ok[:, None] & (d[None, :] < D)
        # The gates first; the x tile after them: loaded first too, ptxas (12.9) capped the
        # kernel at 32 registers with kilobytes of spills; it was read moments ago by the mix,
        # so the second round trip is an L2 hit.
        gate = _pre_gates(
            part_ptr, sq_ptr, scale_ptr, base_ptr, t, t_ok, T, K, rms_eps, hc_eps, S, SP, N,
            NP, M,
        )  # fmt: skip
        # streams added in the order 0..n-1, as the collapse's apply does
        j3 = j[None, :, None]
        x3 = tl.load(x_ptr + t64[:, None, None] * K + j3 * D + d[None, None, :],
                     mask=ok[:, None, :] & (j3 < N), other=0.0)  # fmt: skip
        y = stream_sum(gate, x3.to(tl.float32), N)  # (BT, BD)
        out_ty = out_ptr.dtype.element_ty
        y = rne_bf16_if_interpreted(y, out_ty, INTERP)
        tl.store(out_ptr + t64[:, None] * D + d[None, :], y.to(out_ty), mask=ok)


@dataclass(frozen=True)
class PreFmaConfig:
    """Schedule of the small-batch hc_pre: fn rows, tokens and columns per mix program; tokens
    per reducer; tokens and columns per apply program; warps (both launches).  Every field but
    ``num_warps`` a power of two.  :func:`pre_fma_config` holds the default."""

    rows: int
    block_t: int
    block_d: int
    tpp: int
    block_ta: int
    block_da: int
    num_warps: int

    def __post_init__(self) -> None:
        for name, v in dataclasses.asdict(self).items():
            if name != "num_warps" and (v < 1 or v & (v - 1)):
                raise ConfigError(f"PreFmaConfig.{name}: expected a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ConfigError(f"PreFmaConfig.num_warps: expected 1..16, got {self.num_warps}")


#: The mix's token block of the T-independent schedule (``batch_invariant=True``) and of calls of
#: more tokens; below it a call by T takes the next power of two >= T (:func:`pre_fma_config`).
BLOCK_T = 16


@functools.cache
def pre_fma_config(n: int, D: int, tokens: int | None = None) -> PreFmaConfig:
    """The default schedule for (n, D), and with ``tokens`` for a call of that many tokens.

    ``tokens=None`` (what ``batch_invariant=True`` takes) gives the T-independent schedule; with
    ``tokens`` below :data:`BLOCK_T` the mix's token block shrinks to the next power of two >=
    T, so one block still holds the call and each program's (tokens x rows x columns) tile,
    its layout conversions and its registers shrink with it: on the H200 at D 4096, hc_pre
    7.2 / 7.6 / 7.9 / 8.7 us at T 1 / 2 / 4 / 8 against 9.7 / 9.9 / 9.8 / 10.3 us with 16-token
    blocks, and the whole draft step 4.6 / 4.1 us shorter at T 1 / 8 (bench/results/
    mhc-h200.md, "hc_pre's token block by T").  Bits can differ between token blocks (the fp32
    tree over a program's columns follows the tile's layout: at T 16 an 8-token block changed
    post and comb by an ulp), hence the T-independent schedule under batch invariance.

    Mix: 8 fn rows x 16 tokens (fewer below T 16 with ``tokens``) x 64 columns per program
    (M = 24 rows in 3 groups at n = 4):
    192 / 336 programs at T <= 16 for D 4096 / 7168, enough for the 132 SMs, while the
    (16, 8, 64) accumulator takes 64 of the 128 registers per thread (4 warps, no spills:
    bench/sm90_resources.py); 16 tokens per block read fn from L2 4 times at T 64.
    64-column slices keep the slot count S (what phase 2 sums per token) at 64 / 112.
    Reducers take 2 tokens each, the apply 4 tokens x 256 columns (hc_head's FMA tile).
    Timed on the H200 (bench/results/mhc-h200.md, "hc_pre at small T": 9.7 us at T 1, D 4096
    on 16-token blocks; "hc_pre's token block by T": 7.2 us on the 1-token block, and the other
    tiles swept with ``bench/diag/hc_pre_small_t.py --fma-tiles``, none faster).  Under the
    interpreter the apply's slices are narrower, 128 columns, so that the CPU tier's D 256 still
    has two of them (the mix has four of 64); every program is interpreted op by op, so the CPU
    tier's time goes with the program count, not the tile size (narrower tiles:
    ``test_optimized_hc_pre_fma_schedules_compute_one_function``).
    """
    block_d = min(64, max(16, next_pow2(D)))
    block_da = min(128 if INTERPRET else 256, max(16, next_pow2(D)))
    block_t = BLOCK_T if tokens is None else min(BLOCK_T, next_pow2(max(1, tokens)))
    return PreFmaConfig(rows=8, block_t=block_t, block_d=block_d, tpp=2, block_ta=4,
                        block_da=block_da, num_warps=4)  # fmt: skip


#: Columns per chunk of the whole-row programs (``NORM``): 4 streams x 1024 bf16 columns are
#: 32 values (16 registers) per thread at 4 warps, the whole row's loads (4 chunks at D 4096,
#: 7 at 7168) 64 / 112 registers were they all in flight; under the interpreter a smaller
#: chunk, so that the CPU tier's rows have several.
ROW_CHUNK = 64 if INTERPRET else 1024


@functools.cache
def _launches(
    cfg: PreFmaConfig, n: int, D: int, sinkhorn_iters: int, fuse_post: bool = False,
    norm: str | None = None,
) -> tuple[tuple[int, int, int], TritonLaunch, TritonLaunch]:  # fmt: skip
    """((S, G, SA), mix launch, apply launch) of one schedule and shape; ``norm`` None, or the
    norm order ("official" / "vllm") the apply's whole-row programs end in."""
    M = (2 + n) * n
    S, G, SA = cdiv(D, cfg.block_d), cdiv(M, cfg.rows), cdiv(D, cfg.block_da)
    mix = triton_launch(
        mhc_pre_mix_kernel, D=D, N=n, M=M, S=S, G=G, ROWS=cfg.rows, BLOCK_T=cfg.block_t,
        BLOCK_D=cfg.block_d, FUSE_POST=fuse_post, INTERP=INTERPRET, num_warps=cfg.num_warps,
    )  # fmt: skip
    nm = row_meta(D, cfg.num_warps)  # rms_norm_kernel's chunk for rows of D
    apply = triton_launch(
        mhc_pre_apply_kernel, D=D, N=n, NP=next_pow2(n), M=M, S=S, SP=next_pow2(S),
        SINKHORN_ITERS=sinkhorn_iters, TPP=cfg.tpp, SA=SA, BLOCK_TA=cfg.block_ta,
        BLOCK_DA=cfg.block_da, NORM=norm is not None, VLLM_ORDER=norm == "vllm",
        ROW_CHUNK=min(ROW_CHUNK, next_pow2(D)), NORM_BLOCK=nm["BLOCK_D"],
        NORM_CHUNKS=nm["NUM_CHUNKS"], INTERP=INTERPRET, num_warps=cfg.num_warps,
    )  # fmt: skip
    return (S, G, SA), mix, apply


# A call's plan: (mix grid, apply grid, mix launch, apply launch, part, sq).
_Plan = tuple[tuple[int], tuple[int], TritonLaunch, TritonLaunch, torch.Tensor, torch.Tensor]


def _plan(
    device: torch.device,
    T: int,
    n: int,
    D: int,
    sinkhorn_iters: int,
    cfg: PreFmaConfig | None,
    fuse_post: bool = False,
    by_tokens: bool = False,
    norm: str | None = None,
) -> _Plan:
    """Everything of a call but its tensors and scalars; kept per (shapes, stream) by
    :func:`~._launch.plan`.  ``cfg`` None: the default schedule, of T tokens with
    ``by_tokens``."""
    cfg = cfg or pre_fma_config(n, D, T if by_tokens else None)
    (S, G, SA), mix, apply = _launches(cfg, n, D, sinkhorn_iters, fuse_post, norm)
    M = (2 + n) * n
    # (S, T, M), (S, T): written by the mix before the second launch reads them.
    part, sq = workspaces("mhc_pre_fma", device, S * T * M, S * T)
    mix_grid = (cdiv(T, cfg.block_t) * S * G,)
    pieces = T if norm is not None else cdiv(T, cfg.block_ta) * SA
    apply_grid = (cdiv(T, cfg.tpp) + pieces,)
    return mix_grid, apply_grid, mix, apply, part, sq


def norm_order(norm_weight: torch.Tensor | None, vllm_order: bool) -> str | None:
    """The whole-row apply's norm order, None without a weight (the launchers' cache key)."""
    return None if norm_weight is None else "vllm" if vllm_order else "official"


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
    cfg: PreFmaConfig | None = None,
    by_tokens: bool = False,
    norm_weight: torch.Tensor | None = None,
    vllm_order: bool = False,
) -> None:
    """hc_pre of x (T, n, D) into ``out`` (T, D), ``post`` (T, n) and ``comb`` (T, n, n).

    Contiguous inputs and outputs on one device, scale / base in fp32 (validated by the
    caller).  Two launches: the mix, then the reducers and the weighted sum (module docstring).
    ``cfg``: a schedule other than :func:`pre_fma_config`'s (tile sweeps and tests);
    ``by_tokens``: the default schedule of T tokens (``batch_invariant=False``) instead of the
    T-independent one.  ``norm_weight`` (D,) contiguous: ``out`` is the sublayer's RMSNorm of
    layer_input instead (eps ``rms_norm_eps``; ``vllm_order`` as rms_norm's), formed in the
    apply launch by one whole-row program per token (``NORM``): bitwise layer_input followed by
    ``rms_norm_triton(..., num_warps=cfg.num_warps)``, one launch and one read of layer_input
    fewer.
    """
    T, n, D = x.shape
    if T == 0:
        return
    norm = norm_order(norm_weight, vllm_order)
    mix_grid, apply_grid, mix, apply, part, sq = plan(
        _plan, x.device, T, n, D, int(sinkhorn_iters), cfg, False, by_tokens, norm
    )
    mix(mix_grid, x, fn, part, sq, x, x, x, x, T)  # no hc_post: its pointers are not read
    apply(
        apply_grid, x, scale, base, part, sq, out, post, comb,
        x if norm_weight is None else norm_weight, T, D, float(rms_norm_eps), float(hc_eps),
        float(post_mult),
    )  # fmt: skip


def mhc_post_pre_fma(
    a: torch.Tensor,
    x: torch.Tensor,
    post_in: torch.Tensor,
    comb_in: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    x_out: torch.Tensor,
    out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    post_mult: float,
    sinkhorn_iters: int,
    by_tokens: bool = False,
    norm_weight: torch.Tensor | None = None,
    vllm_order: bool = False,
) -> None:
    """hc_post (a, x, post_in, comb_in) into ``x_out`` (T, n, D), then hc_pre of it into
    ``out`` (T, D), ``post`` (T, n), ``comb`` (T, n, n): the same two launches as
    :func:`mhc_pre_fma`, the mix forming x_out from a (T, D), x (T, n, D), post_in (T, n) and
    comb_in (T, n, n) fp32 (``FUSE_POST`` in :func:`mhc_pre_mix_kernel`), the apply reading
    x_out.  Bitwise hc_post's Triton kernel followed by :func:`mhc_pre_fma` (default
    schedule).  x_out must not overlap x (programs of other row groups still read x while the
    first stores x_out).  Extra bytes over mhc_pre_fma: a (T*D) and post / comb read, x_out
    (T*n*D) written once; the separate hc_post launch and its x_out re-read are what it saves.
    ``by_tokens``: as :func:`mhc_pre_fma`'s (then bitwise hc_post followed by :func:`mhc_pre_fma`
    with ``by_tokens`` too); ``norm_weight``, ``vllm_order``: as :func:`mhc_pre_fma`'s.
    """
    T, n, D = x.shape
    if T == 0:
        return
    norm = norm_order(norm_weight, vllm_order)
    mix_grid, apply_grid, mix, apply, part, sq = plan(
        _plan, x.device, T, n, D, int(sinkhorn_iters), None, True, by_tokens, norm
    )
    mix(mix_grid, x, fn, part, sq, a, post_in, comb_in, x_out, T)
    apply(
        apply_grid, x_out, scale, base, part, sq, out, post, comb,
        x_out if norm_weight is None else norm_weight, T, D, float(rms_norm_eps),
        float(hc_eps), float(post_mult),
    )  # fmt: skip
