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
    gate  (T, NP)     fp32 workspace               count (2 + cdiv(T, BLOCK_T),) int32 zeros
    out   (T, D) x.dtype;  post (T, n) fp32, comb (T, n, n) fp32 (hc_pre only)

Schedule.  Piece (token block b, slice s) is BLOCK_T tokens x all n streams x the D-slice
[s*D_SLICE, (s+1)*D_SLICE): a BLOCK_T x n*D_SLICE part of the flattened rows.
 1. Mix: one program streams the piece from HBM in BLOCK_K steps (``mix_step``: bf16 tensor cores with
    fn split into two bf16 terms, fp32 square sums) and stores its partial mix and square sum
    to slot s of the workspace.
 2. Reduce: once the block's S partials are all written, each of S programs sums the S
    partials of BLOCK_T / S of the block's tokens in the fixed slot order 0..S-1, forms their
    gates (and post / comb with the Sinkhorn) and publishes them.
 3. Apply: once the block's gates are all written, each of S programs re-reads one piece,
    streamed some 25 us earlier, from L2 when it is still there, and writes its D-slice of the
    output.
One launch (``fused``): a program's role comes from a ticket taken when it starts (:mod:`._sync`),
not from its program id, so that it only ever waits on programs that have already started and
no wait depends on how many programs the GPU can hold at once.  Ticket q*S + s mixes piece
(q, s), reduces for block q-1 and applies piece (q-2, s); the grid has two extra blocks of
programs at the end.  ``fused=False`` runs the three phases as three launches (no in-kernel
waiting; the re-read then comes from HBM).  The phases do the same arithmetic in both forms
(tested bitwise): the weighted sum adds the streams in the order 0..n-1 whatever the tile
layout, and the slot sums run in slot order.

Where the bytes and the time go (H200, T 4096; bench/results/mhc-h200.md).  The pieces of the
~500 resident programs (~65 MB) outgrow the L2, so part of the re-read comes from HBM again:
Nsight Compute counted ~200 MB read for hc_head at D 4096 where 134 MB is the minimum.  Hence
the apply's evict-first loads, the streaming output stores, and the column-major mix with a
backwards apply: each keeps more of the re-read in L2.  A program lives ~45 us (``trace=``,
bench/h200_trace.py): ~25 us streaming its 128 KB piece, ~5 us in the two barriers, ~0.6 us
reducing (~5 us with hc_pre's Sinkhorn), ~13 us re-reading and writing.

Arithmetic: fp32 throughout; the mix as in :mod:`.mhc_mix` (~16 mantissa bits of fn).  No tile
size or reduction order depends on T: a token's result does not depend on its batch.

Bytes: x from HBM once, plus once more from L2 or (where L2 lost it) HBM; fn once per token
block (L2); out once (T*D*itemsize); post / comb (T*(n+n*n)*4); the workspace S*T*(M+1)*4 +
T*NP*4 stays in L2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4mtp.errors import ConfigError, InputError

from ._launch import (
    INTERPRET,
    TritonLaunch,
    cdiv,
    launch_each,
    next_pow2,
    plan,
    rne_bf16_if_interpreted,
    sigmoid,
    triton_launch,
    workspaces,
)
from ._sync import (
    COUNTER_HEADER,
    block_count,
    counters,
    finish,
    signal,
    take_ticket,
    wait_until,
)
from .mhc_mix import mix_step

# Diagnostics layout (``mhc_collapse(..., trace=...)``), int64 per program: TRACE_EVENTS clock64
# stamps (start, mix stored, partials' wait passed, gates stored, gates' wait passed, end), the SM id,
# and the global ns timer at start and at end (the only clock comparable across SMs).
TRACE_WIDTH = 9
TRACE_EVENTS = tl.constexpr(6)
TRACE_FIELDS = tl.constexpr(TRACE_WIDTH)

__all__ = [
    "TRACE_WIDTH",
    "CollapseConfig",
    "collapse_config",
    "collapse_grid",
    "mhc_collapse",
    "tokens_per_reducer",
]


@triton.jit
def _reduce_gates(
    part_ptr, sq_ptr, scale_ptr, base_ptr, gate_ptr, post_ptr, comb_ptr,
    t, t_ok, T, K, rms_eps, hc_eps, post_mult,
    S: tl.constexpr, SINKHORN_ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
    M: tl.constexpr, TPP: tl.constexpr, WITH_POST_COMB: tl.constexpr,
):  # fmt: skip
    """Sum the S partials of the TPP tokens ``t`` in slot order 0..S-1 (independent of T and
    of timing) and write their gates (and post / comb).

    The slot loop is unrolled (static_range), so its S independent loads are all in flight
    before the first add: one L2 round trip, not S of them.  Each program of a block reduces
    its own TPP tokens, so the reduction is spread over the block's S programs (a single
    reducer summing all BLOCK_T tokens serially would leave the other S-1 programs idle)."""
    t64 = t.to(tl.int64)
    j = tl.arange(0, NP)
    j2 = j[None, :]
    row = part_ptr + t64[:, None] * M  # (TPP, 1) within one slot's slab
    row_ok = t_ok[:, None] & (j2 < N)
    sq_tot = tl.zeros((TPP,), dtype=tl.float32)
    pre_l = tl.zeros((TPP, NP), dtype=tl.float32)
    if WITH_POST_COMB:
        # comb logits: rows 2N + jr*N + kc of the mix, jr = source stream, kc = destination.
        t3 = t64[:, None, None]
        jr = j[None, :, None]
        kc = j[None, None, :]
        crow = 2 * N + jr * N + kc
        comb_ok = t_ok[:, None, None] & (jr < N) & (kc < N)
        post_l = tl.zeros((TPP, NP), dtype=tl.float32)
        comb_l = tl.zeros((TPP, NP, NP), dtype=tl.float32)
    for ss in tl.static_range(S):
        slab = ss * T.to(tl.int64)
        sq_tot += tl.load(sq_ptr + slab + t64, mask=t_ok, other=0.0, cache_modifier=".cg")
        pre_l += tl.load(row + slab * M + j2, mask=row_ok, other=0.0, cache_modifier=".cg")
        if WITH_POST_COMB:
            post_l += tl.load(row + slab * M + N + j2, mask=row_ok, other=0.0, cache_modifier=".cg")
            comb_l += tl.load(
                part_ptr + (slab + t3) * M + crow, mask=comb_ok, other=0.0, cache_modifier=".cg"
            )
    rstd = tl.math.rsqrt(sq_tot / K + rms_eps)[:, None]  # (TPP, 1)
    s_pre = tl.load(scale_ptr).to(tl.float32)
    b_pre = tl.load(base_ptr + j2, mask=j2 < N, other=0.0).to(tl.float32)
    gate = sigmoid(pre_l * rstd * s_pre + b_pre) + hc_eps  # (TPP, NP)
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
        row_max = tl.max(c, axis=2)  # (TPP, NP)
        row_max = tl.where(j2 < N, row_max, 0.0)
        e = tl.exp(c - row_max[:, :, None])  # padded entries: exp(-inf) = 0
        # Sinkhorn (docs/semantics.md, "mHC: hc_pre, Sinkhorn, hc_post"): row softmax + eps, a
        # column normalization, then (iters - 1) x (rows, columns).  Padded entries stay 0.
        row_sum = tl.where(j2 < N, tl.sum(e, axis=2), 1.0)  # padded rows: no 0/0
        p = tl.where(ok3, e / row_sum[:, :, None] + hc_eps, 0.0)
        p = p / (tl.sum(p, axis=1)[:, None, :] + hc_eps)
        for _ in range(1, SINKHORN_ITERS):
            p = p / (tl.sum(p, axis=2)[:, :, None] + hc_eps)
            p = p / (tl.sum(p, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + t3 * (N * N) + jr * N + kc, p, mask=comb_ok)


@triton.jit
def _stamp(trace_ptr, k: tl.constexpr, TRACE: tl.constexpr):
    """Diagnostics (``TRACE`` only): record the SM's cycle counter as event ``k`` of this
    program; the first and last events also record the global ns timer (and the SM id)."""
    if TRACE:
        row = trace_ptr + tl.program_id(0).to(tl.int64) * TRACE_FIELDS
        if k == 0 or k == TRACE_EVENTS - 1:
            ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                           dtype=tl.int64, is_pure=False, pack=1)  # fmt: skip
            tl.store(row + TRACE_EVENTS + 1 + (k > 0), ns)
        if k == 0:
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                           is_pure=False, pack=1)  # fmt: skip
            tl.store(row + TRACE_EVENTS, sm.to(tl.int64))
        clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)  # fmt: skip
        tl.store(row + k, clk)


@triton.jit
def _apply_tile(x, gate_ptr, out_ptr, t64, t_ok, d, D: tl.constexpr, N: tl.constexpr,
                NP: tl.constexpr, out_ty: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """out[t, d] = sum_j gate[t, j] * x[t, j, d] for an x tile (BT, NP, AD), streams summed
    in the order 0..n-1 whatever the tile's layout: stream j is picked out exactly (a sum of
    zeros and one value), so every schedule and launch form rounds the same way."""
    jj = tl.arange(0, NP)[None, :, None]
    xf = x.to(tl.float32)
    y = tl.zeros((x.shape[0], x.shape[2]), dtype=tl.float32)
    for j in tl.static_range(N):
        g = tl.load(gate_ptr + t64 * NP + j, mask=t_ok, other=0.0, cache_modifier=".cg")
        xj = tl.sum(tl.where(jj == j, xf, 0.0), axis=1)  # (BT, AD), exact
        y += g[:, None] * xj
    y = rne_bf16_if_interpreted(y, out_ty, INTERP)
    ok = t_ok[:, None] & (d[None, :] < D)
    # .cs (streaming): the output is not read again here; it should not displace the pieces
    # that the block's programs are about to re-read from L2.
    out_ptrs = out_ptr + t64[:, None] * D + d[None, :]
    tl.store(out_ptrs, y.to(out_ty), mask=ok, cache_modifier=".cs")


@triton.jit(do_not_specialize=["T"])
def mhc_collapse_kernel(
    x_ptr, fn_ptr, scale_ptr, base_ptr, part_ptr, sq_ptr, gate_ptr, count_ptr,
    out_ptr, post_ptr, comb_ptr, trace_ptr,
    T, rms_eps, hc_eps, post_mult,
    D: tl.constexpr, S: tl.constexpr, D_SLICE: tl.constexpr, SINKHORN_ITERS: tl.constexpr,
    N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, APPLY_D: tl.constexpr, TPP: tl.constexpr,
    DO_MIX: tl.constexpr, DO_REDUCE: tl.constexpr, DO_APPLY: tl.constexpr, FUSED: tl.constexpr,
    WITH_POST_COMB: tl.constexpr, X_IS_BF16: tl.constexpr, INTERP: tl.constexpr,
    TRACE: tl.constexpr,
):  # fmt: skip
    """Grid ((blocks + 2) * S,) when FUSED (roles by ticket, see _sync.py), else (blocks * S,)
    with one phase per launch; ``q * S + s`` = (block q, slice s)."""
    _stamp(trace_ptr, 0, TRACE)
    blocks = tl.cdiv(T, BLOCK_T)
    if FUSED:
        # Pipelined by phase, every wait on lower tickets only: ticket q*S + s mixes block q,
        # reduces block q-1 (mixed by tickets (q-1)*S..), applies block q-2 (reduced by tickets
        # (q-1)*S..).  The piece's re-read in the apply is two blocks behind its mix.
        ticket = take_ticket(count_ptr)
        q = ticket // S
        s = ticket % S
        mix_blk = q
        red_blk = q - 1
        app_blk = q - 2
    else:
        q = tl.program_id(0) // S
        s = tl.program_id(0) % S
        mix_blk = q
        red_blk = q
        app_blk = q
    K = N * D
    slab = s * T.to(tl.int64)

    # ------------------------------------------------------------------ 1. partial mix
    if DO_MIX and mix_blk < blocks:
        t = mix_blk * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
        t_ok = t < T
        t64 = t.to(tl.int64)
        x_row = x_ptr + t64[:, None] * K  # (BT, 1)
        m = tl.arange(0, MP)
        acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
        sq = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        # One software-pipelined loop over the n * D_SLICE / BLOCK_K steps of all streams,
        # column-major: (columns 0.., stream 0), (columns 0.., stream 1), ..., then the next
        # BLOCK_K columns.  A loop per stream would restart the pipeline n times, and its n
        # copies of the loop body need more registers (123 for hc_head against 83 here, 166
        # against 128 for hc_pre): one program per SM fewer.  Column-major, with the apply
        # walking the columns backwards, the last columns streamed are the first re-read, so
        # the distances between a line's two reads spread out (a small effect in the
        # benchmark: bench/results/mhc-h200.md, "How the schedules were picked").
        # c is a multiple of BLOCK_K; saying so keeps the loads vectorized.
        for k in range(0, N * D_SLICE, BLOCK_K):  # constexpr bounds: software-pipelined
            j = (k // BLOCK_K) % N
            c = tl.multiple_of((k // (BLOCK_K * N)) * BLOCK_K, BLOCK_K)
            d = s * D_SLICE + c + tl.arange(0, BLOCK_K)
            d_ok = d < D
            x = tl.load(x_row + j * D + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(
                fn_ptr + m[:, None] * K + j * D + d[None, :],
                mask=(m[:, None] < M) & d_ok[None, :],
                other=0.0,
            )
            acc, sq = mix_step(x, w, acc, sq, X_IS_BF16, INTERP)
        tl.store(
            part_ptr + (slab + t64)[:, None] * M + m[None, :],
            acc,
            mask=t_ok[:, None] & (m[None, :] < M),
        )
        tl.store(sq_ptr + slab + t64, tl.sum(sq, axis=1), mask=t_ok)
        if FUSED:
            signal(block_count(count_ptr, mix_blk))  # count reaches S: all slots written
    _stamp(trace_ptr, 1, TRACE)

    # ------------------------------------------------------------------ 2. gates
    # Programs without a role in a phase stamp its events anyway (diagnostics stay ordered).
    if DO_REDUCE and red_blk >= 0 and red_blk < blocks:
        if FUSED:
            wait_until(block_count(count_ptr, red_blk), S)
        _stamp(trace_ptr, 2, TRACE)
        # Slice s reduces the block's tokens [s*TPP, (s+1)*TPP) (none if s*TPP >= BLOCK_T).
        local = s * TPP + tl.arange(0, TPP)
        tr = red_blk * BLOCK_T + local
        _reduce_gates(
            part_ptr, sq_ptr, scale_ptr, base_ptr, gate_ptr, post_ptr, comb_ptr,
            tr, (local < BLOCK_T) & (tr < T), T, K, rms_eps, hc_eps, post_mult,
            S, SINKHORN_ITERS, N, NP, M, TPP, WITH_POST_COMB,
        )  # fmt: skip
        if FUSED:
            signal(block_count(count_ptr, red_blk))  # count reaches 2S: all gates written
        _stamp(trace_ptr, 3, TRACE)
    else:
        _stamp(trace_ptr, 2, TRACE)
        _stamp(trace_ptr, 3, TRACE)

    # ------------------------------------------------------------------ 3. weighted sum
    if DO_APPLY and app_blk >= 0 and app_blk < blocks:
        if FUSED:
            wait_until(block_count(count_ptr, app_blk), 2 * S)
        _stamp(trace_ptr, 4, TRACE)
        t = app_blk * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
        t_ok = t < T
        t64 = t.to(tl.int64)
        x_row = x_ptr + t64[:, None] * K  # (BT, 1)
        out_ty = out_ptr.dtype.element_ty
        jj = tl.arange(0, NP)
        x_base = x_row[:, :, None] + jj[None, :, None] * D  # (BT, NP, 1): all streams per step
        ok_tj = t_ok[:, None, None] & (jj[None, :, None] < N)
        # Not software-pipelined (num_stages=1), not unrolled: prefetched tiles kept in
        # registers cost more programs per SM than the prefetch gains (measured on the H200).
        for c in tl.range(0, D_SLICE, APPLY_D, num_stages=1, loop_unroll_factor=1):
            # Columns backwards (see the mix).  multiple_of: the offset's alignment is not
            # inferred, and without it the loads are not vectorized (2-byte loads).
            c_rev = tl.multiple_of(D_SLICE - APPLY_D - c, APPLY_D)
            d = s * D_SLICE + c_rev + tl.arange(0, APPLY_D)
            d3 = d[None, None, :]
            # evict_first: these lines are dead after this read; in L2 they would only push
            # out lines that other programs have yet to re-read.
            xa = tl.load(
                x_base + d3, mask=ok_tj & (d3 < D), other=0.0, eviction_policy="evict_first"
            )  # (BT, NP, AD)
            _apply_tile(xa, gate_ptr, out_ptr, t64, t_ok, d, D, N, NP, out_ty, INTERP)
    else:
        _stamp(trace_ptr, 4, TRACE)
    if FUSED:
        # After the last counter access of this program; the last one zeroes the counters.
        finish(count_ptr, (blocks + 2) * S, blocks, 256)
    _stamp(trace_ptr, 5, TRACE)


@dataclass(frozen=True)
class CollapseConfig:
    """Schedule of the collapse: tokens per block, columns per slice, K step of the mix,
    columns per apply step, warps, pipeline stages, one launch (``fused``) or three, and an
    optional register cap per thread (ptxas ``maxnreg``).  :func:`collapse_config` holds the
    measured values."""

    block_t: int
    d_slice: int
    block_k: int
    apply_d: int
    num_warps: int
    num_stages: int
    fused: bool
    max_registers: int | None = None

    def __post_init__(self) -> None:
        tiles = dict(block_t=self.block_t, d_slice=self.d_slice, block_k=self.block_k,
                     apply_d=self.apply_d)  # fmt: skip
        for name, v in tiles.items():
            if v < 1 or v & (v - 1):
                raise ConfigError(f"CollapseConfig.{name}: expected a power of two, got {v}")
        # The mix steps through a slice in BLOCK_K columns (and tells the compiler its column
        # offsets are multiples of BLOCK_K); the apply in APPLY_D columns.
        if self.block_k > self.d_slice or self.apply_d > self.d_slice:
            raise ConfigError(
                f"CollapseConfig: block_k ({self.block_k}) and apply_d ({self.apply_d}) must "
                f"not exceed d_slice ({self.d_slice})"
            )
        # ptxas accepts 24..255 registers per thread (a multiple of 8 is what sm_90 allocates).
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ConfigError(
                f"CollapseConfig.max_registers: expected None or 24..255, got {self.max_registers}"
            )


def collapse_grid(T: int, D: int, cfg: CollapseConfig) -> int:
    """Programs the collapse launches (per launch): token blocks x D-slices, plus two blocks of
    programs in the fused form (the last blocks' reduce and apply)."""
    return (cdiv(T, cfg.block_t) + (2 if cfg.fused else 0)) * cdiv(D, cfg.d_slice)


def tokens_per_reducer(block_t: int, S: int) -> int:
    """Tokens each of a block's S programs reduces: ceil(BLOCK_T / S), a power of two."""
    return next_pow2(cdiv(block_t, S))


@functools.cache
def collapse_config(n: int, D: int, with_post_comb: bool = False) -> CollapseConfig:
    """The schedule for (n, D, op); never a function of T (batch invariance).

    From the H200 sweeps (bench/h200_sweep.py, bench/h200_trace.py; bench/results/
    mhc-h200.md, "How the schedules were picked"): 64 tokens x 256-column slices x 64-column
    K steps, 64-column apply steps, 4 warps, 3 stages, one launch, for hc_head and hc_pre
    alike.  It is within a few per cent of the best tile tried at each (op, D, T 4096) and the
    fastest at T <= 64; 32-token blocks, 128-column slices, 128-column apply steps and 8-warp
    128-token blocks each won or lost by D, so no per-D exception is kept.  Deeper pipelines
    hold more K steps in shared memory and fit fewer programs per SM.  Smaller pieces
    (128-column slices) keep more of the re-read in L2 (ncu: 157 vs 201 MB read, hc_head
    D 4096) but pay it back in barriers and per-program overhead.
    """
    if INTERPRET:
        # CPU tier: small shapes, several slices and K steps, the same one-launch schedule (the
        # interpreter runs programs in launch order, which is ticket order: every wait is on a
        # program that already ran).
        d_slice = min(32, max(16, next_pow2(D)))
        return CollapseConfig(16, d_slice, 16, 16, num_warps=4, num_stages=1, fused=True)
    d_slice = min(256, max(64, next_pow2(D)))
    return CollapseConfig(block_t=64, d_slice=d_slice, block_k=64, apply_d=64, num_warps=4,
                          num_stages=3, fused=True)  # fmt: skip


@functools.cache
def _launches(
    cfg: CollapseConfig, n: int, D: int, M: int, x_is_bf16: bool, with_pc: bool, trace: bool,
    sinkhorn_iters: int,
) -> tuple[int, tuple[TritonLaunch, ...]]:  # fmt: skip
    """(S, the launches: one fused, or the three phases) of one schedule; a function of the
    schedule and shapes only, so it is built once."""
    S = cdiv(D, cfg.d_slice)
    meta: dict = dict(
        D=D,
        S=S,
        D_SLICE=cfg.d_slice,
        SINKHORN_ITERS=sinkhorn_iters,
        N=n,
        NP=next_pow2(n),
        M=M,
        MP=max(16, next_pow2(M)),
        BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_k,
        APPLY_D=cfg.apply_d,
        TPP=tokens_per_reducer(cfg.block_t, S),
        WITH_POST_COMB=with_pc,
        X_IS_BF16=x_is_bf16,
        INTERP=INTERPRET,
        TRACE=trace,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.max_registers is not None and not INTERPRET:
        meta["maxnreg"] = cfg.max_registers
    if cfg.fused:
        phases = [dict(DO_MIX=True, DO_REDUCE=True, DO_APPLY=True, FUSED=True)]
    else:
        phases = [dict(DO_MIX=p == "mix", DO_REDUCE=p == "reduce", DO_APPLY=p == "apply",
                       FUSED=False) for p in ("mix", "reduce", "apply")]  # fmt: skip
    return S, tuple(triton_launch(mhc_collapse_kernel, **meta, **f) for f in phases)


# A call's plan: (grid, launches, part, sq, gate, counter entries: 0 without counters).
_Plan = tuple[tuple[int], tuple[TritonLaunch, ...], torch.Tensor, torch.Tensor, torch.Tensor, int]


def _plan(
    device: torch.device, T: int, n: int, D: int, M: int, x_is_bf16: bool, with_pc: bool,
    traced: bool, sinkhorn_iters: int, cfg: CollapseConfig | None,
) -> _Plan:  # fmt: skip
    """Everything of a call but its tensors and scalars; kept per (shapes, stream) by
    :func:`~._launch.plan`."""
    cfg = cfg or collapse_config(n, D, with_post_comb=with_pc)
    S, launches = _launches(cfg, n, D, M, x_is_bf16, with_pc, traced, sinkhorn_iters)
    grid = (collapse_grid(T, D, cfg),)
    # (S, T, M), (S, T), (T, NP): reused per (T, stream), written before they are read.
    part, sq, gate = workspaces("mhc_collapse", device, S * T * M, S * T, T * next_pow2(n))
    counts = COUNTER_HEADER + cdiv(T, cfg.block_t) if cfg.fused else 0
    return grid, launches, part, sq, gate, counts


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
    trace: torch.Tensor | None = None,
) -> None:
    """Collapse x (T, n, D) into ``out`` (and ``post`` / ``comb`` for hc_pre).

    All tensors contiguous on one device, scale / base in fp32 (validated by the caller).
    ``trace`` (diagnostics, GPU only): an int64 (programs, TRACE_WIDTH) tensor that receives
    per-program phase timestamps (bench/h200_trace.py reads them); fused schedules only.
    """
    T, n, D = x.shape
    if T == 0:
        return
    dev = x.device
    with_pc = post is not None
    grid, launches, part, sq, gate, counts = plan(
        _plan, dev, T, n, D, fn.shape[0], x.dtype == torch.bfloat16, with_pc, trace is not None,
        int(sinkhorn_iters), cfg,
    )  # fmt: skip
    # Asked per call, not kept in the plan: _sync.counters owns the rule (fresh on the CPU, a
    # piece of the capture's arena while capturing, the stream's zeroed buffer otherwise).
    count = counters(dev, counts) if counts else sq
    if trace is not None and (len(launches) != 1 or tuple(trace.shape) != (grid[0], TRACE_WIDTH)):
        raise InputError(
            f"trace: expected a fused schedule and shape ({grid[0]}, {TRACE_WIDTH}), got "
            f"fused={len(launches) == 1} and shape {tuple(trace.shape)}"
        )
    args = (
        x, fn, scale, base, part, sq, gate, count, out,
        post if with_pc else out, comb if with_pc else out, trace if trace is not None else count,
        T, float(rms_norm_eps), float(hc_eps), float(post_mult),
    )  # fmt: skip
    launch_each(launches, grid, args)
