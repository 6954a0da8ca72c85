"""hc_head for small batches: fp32 FMA mix, 4-token tiles (Triton).

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
    count (2 + cdiv(T, BLOCK_T),) int32 zeros (``_sync.counters``; left zeroed)

Schedule.  The program holding ticket q*S + s (:mod:`._sync`: roles by start order, so that a
program only ever waits on programs that have already started) loads the (BLOCK_T, n, BLOCK_D)
residual tile of token block q, slice s, in one memory round trip (no K loop), forms its partial
mix with fp32 FMAs against the matching fn columns (n rows only: tensor cores would be idle)
and its partial square sum, stores them to slot s and counts itself on block q's counter.  Then
it takes block q-1, slice s: waits until the S mixes of that block (all lower tickets) are
counted, sums their partials in the fixed order 0..S-1, forms the gates and writes the output
slice from the block's tile, re-read from L2.  The grid has one extra block of programs (apply
only), so every block is applied.

The default is the same two phases as two launches (``DO_MIX`` only, then ``DO_APPLY`` only):
on the H200 it is faster than the one-launch form at every T it serves (D 4096: 6.6 / 7.1 / 9.2 /
25.9 us at T 1 / 8 / 64 / 512 against 9.0 / 8.9 / 11.5 / 39.5 us; bench/results/mhc-h200.md),
whose ticket, reset and L2 re-read sit on a critical path of a few microseconds.  The program
that waited for its own block's partials with the tile in registers (6.0 / 6.1 / 8.3 / 28.2 us)
assumed all S programs of a block resident at once, which another stream's work can break.
``one_launch=True`` keeps the ticketed form (tested, and hang-tested, like the collapse).

hc_post_head (:func:`mhc_post_head_fma`): the two-launch form with the layer's last hc_post folded
into the mix (``FUSE_POST``): each mix program forms its (BLOCK_T, n, BLOCK_D) tile of the new
streams from the MoE output, the old streams and their post / comb gates, stores it and mixes it
from registers; the apply reads the stored streams.  One launch and one read of the new streams
fewer than hc_post followed by hc_head.

With the head's RMSNorm (``norm_weight``, two-launch form only) the apply launch is
:func:`mhc_head_norm_apply_kernel` instead: one program per token forms its gates (the slot sums
are elementwise: the block programs' bits), writes its whole collapsed row and normalizes it in
place after a CTA barrier with ``rms_norm_kernel``'s row body (mhc_pre_small's
``weighted_row_norm``): bitwise the collapse followed by ``rms_norm_triton`` at NUM_WARPS, one
launch and one read of the collapsed rows fewer (the weight read once per token).  Both apply
forms add the streams one by one in order 0..n-1.

Arithmetic: fp32 throughout, exact fp32 products in the mix.  Tile sizes depend on n and D
only: a token's result does not depend on its batch.

Bytes: x twice (T*n*D*itemsize; the second read, moments after the first, mostly from L2), fn once per 4-token block (from L2: 2x the x bytes, which is
why this schedule loses at large T), out once (T*D*itemsize), workspace S*T*(MP+1)*4 (L2).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv4mtp.errors import ConfigError

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
from .mhc_pre_small import ROW_CHUNK, gate_of, norm_order, stream_sum, weighted_row_norm
from .rms_norm import row_meta

__all__ = ["mhc_head_fma", "mhc_post_head_fma"]


@triton.jit
def _head_gates(
    part_ptr, sq_ptr, scale_ptr, base_ptr, t, t_ok, T, K, rms_eps, hc_eps, S: tl.constexpr,
    N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
):  # fmt: skip
    """The gates (BT, NP) of the tokens ``t`` (BT,): the S slots' partials summed in the fixed
    order 0..S-1 (elementwise: the bits do not depend on BT, on T or on timing)."""
    j2 = tl.arange(0, NP)[None, :]
    part_row = part_ptr + t.to(tl.int64)[:, None] * MP
    sq_tot = tl.zeros(t.shape, dtype=tl.float32)
    pre_l = tl.zeros((t.shape[0], NP), dtype=tl.float32)
    for ss in range(0, S):
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
    return sigmoid(pre_l * rstd * s_pre + b_pre) + hc_eps  # (BT, NP)


@triton.jit(do_not_specialize=["T"])
def mhc_head_fma_kernel(
    x_ptr, fn_ptr, scale_ptr, base_ptr, part_ptr, sq_ptr, count_ptr, out_ptr,
    f_ptr, post_in_ptr, comb_in_ptr, xnew_ptr,
    T, D, rms_eps, hc_eps,
    S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    DO_MIX: tl.constexpr, DO_APPLY: tl.constexpr, FUSE_POST: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Grid ((blocks + 1) * S,) for the one-launch form (DO_MIX and DO_APPLY; roles by ticket,
    see _sync.py), else (blocks * S,) with one phase per launch; ``q * S + s`` = (block q,
    slice s).

    ``FUSE_POST`` (mix-only launch): the tile is first formed by hc_post from the sublayer
    output f (T, D), the residual x (T, n, D) and ``post`` (T, n) / ``comb`` (T, n, n) fp32,
    in mhc_post_kernel's op order (kernels/mhc_post.py), rounded to x's dtype and stored to
    xnew_ptr (T, n, D); the mix reads the rounded tile from registers and the apply launch is
    given xnew_ptr as its x.  Otherwise the extra pointers are not read."""
    blocks = tl.cdiv(T, BLOCK_T)
    if DO_MIX and DO_APPLY:
        # Ticket q*S + s mixes block q, then applies block q-1, mixed by lower tickets.
        ticket = take_ticket(count_ptr)
        q = ticket // S
        s = ticket % S
        app_blk = q - 1
    else:
        q = tl.program_id(0) // S
        s = tl.program_id(0) % S
        app_blk = q
    K = N * D
    j = tl.arange(0, NP)  # (NP,) stream
    d = s * BLOCK_D + tl.arange(0, BLOCK_D)  # (BD,) column of this slice
    mm = tl.arange(0, MP)  # (MP,) mix row
    j3 = j[None, :, None]
    d3 = d[None, None, :]

    # ------------------------------------------------------------------ 1. partial mix
    if DO_MIX and q < blocks:
        t = q * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
        t_ok = t < T
        t3 = t.to(tl.int64)[:, None, None]
        x_ok = (t3 < T) & (j3 < N) & (d3 < D)
        if FUSE_POST:
            # hc_post per element: post[k] * f, then one FMA per source j = 0..n-1 (all loads
            # first: see mhc_pre_small's mix kernel), one rounding to x's dtype.
            f = tl.load(f_ptr + t3 * D + d3, mask=(t3 < T) & (d3 < D), other=0.0)  # (BT, 1, BD)
            pk = tl.load(post_in_ptr + t3 * N + j3, mask=(t3 < T) & (j3 < N), other=0.0)
            rs = ()  # type: tuple[tl.tensor, ...]
            cs = ()  # type: tuple[tl.tensor, ...]
            for jsrc in tl.static_range(N):
                rs = rs + (  # noqa: RUF005  (BT, 1, BD): source stream jsrc
                    tl.load(x_ptr + t3 * K + jsrc * D + d3, mask=(t3 < T) & (d3 < D), other=0.0),
                )
                cs = cs + (  # noqa: RUF005  (BT, NP, 1): comb[t, jsrc, k]
                    tl.load(comb_in_ptr + t3 * (N * N) + jsrc * N + j3, mask=(t3 < T) & (j3 < N),
                            other=0.0),
                )  # fmt: skip
            acc = pk.to(tl.float32) * f.to(tl.float32)  # (BT, NP, BD)
            for jsrc in tl.static_range(N):
                acc = tl.fma(cs[jsrc].to(tl.float32), rs[jsrc].to(tl.float32), acc)
            x_ty = xnew_ptr.dtype.element_ty
            x = rne_bf16_if_interpreted(acc, x_ty, INTERP).to(x_ty)
            tl.store(xnew_ptr + t3 * K + j3 * D + d3, x, mask=x_ok)
        else:
            x = tl.load(x_ptr + t3 * K + j3 * D + d3, mask=x_ok, other=0.0)
        xf = x.to(tl.float32)  # (BT, NP, BD)
        sq = tl.sum(tl.sum(xf * xf, axis=2), axis=1)  # (BT,)
        part = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
        for m in tl.static_range(N):
            w = tl.load(fn_ptr + m * K + j3 * D + d3, mask=(j3 < N) & (d3 < D), other=0.0).to(
                tl.float32
            )  # (1, NP, BD)
            z = tl.sum(tl.sum(xf * w, axis=2), axis=1)  # (BT,)
            part = tl.where(mm[None, :] == m, z[:, None], part)
        slab = s.to(tl.int64) * T
        part_row = part_ptr + t.to(tl.int64)[:, None] * MP  # (BT, 1) within one slice's slab
        tl.store(part_row + slab * MP + mm[None, :], part, mask=t_ok[:, None] & (mm[None, :] < N))
        tl.store(sq_ptr + slab + t, sq, mask=t_ok)
        if DO_APPLY:
            signal(block_count(count_ptr, q))  # count reaches S: the block's slots written

    # ------------------------------------------------------------------ 2. gates and output
    if DO_APPLY and app_blk >= 0 and app_blk < blocks:
        if DO_MIX:
            wait_until(block_count(count_ptr, app_blk), S)
        t = app_blk * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
        t_ok = t < T
        t3 = t.to(tl.int64)[:, None, None]
        # The block's tile again, from L2 (its mix streamed it moments ago).
        x = tl.load(x_ptr + t3 * K + j3 * D + d3, mask=(t3 < T) & (j3 < N) & (d3 < D), other=0.0)
        gate = _head_gates(
            part_ptr, sq_ptr, scale_ptr, base_ptr, t, t_ok, T, K, rms_eps, hc_eps, S, N, NP, MP
        )  # (BT, NP)
        # streams added in the order 0..n-1: elementwise, as the whole-row programs add them
        y = stream_sum(gate, x.to(tl.float32), N)  # (BT, BD)
        out_ok = t_ok[:, None] & (d[None, :] < D)
        out_ptrs = out_ptr + t.to(tl.int64)[:, None] * D + d[None, :]
        out_ty = out_ptr.dtype.element_ty
        y = rne_bf16_if_interpreted(y, out_ty, INTERP)
        tl.store(out_ptrs, y.to(out_ty), mask=out_ok)
    if DO_MIX and DO_APPLY:
        # After the last counter access of this program; the last one zeroes the counters.
        finish(count_ptr, (blocks + 1) * S, blocks, 256)


@triton.jit(do_not_specialize=["T"])
def mhc_head_norm_apply_kernel(
    x_ptr, scale_ptr, base_ptr, part_ptr, sq_ptr, out_ptr, w_ptr, T, D, rms_eps, hc_eps,
    S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
    VLLM_ORDER: tl.constexpr, D_C: tl.constexpr, ROW_CHUNK: tl.constexpr,
    NORM_BLOCK: tl.constexpr, NORM_CHUNKS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """The apply launch of the two-launch form when the head's RMSNorm follows (grid (T,)):
    program t forms token t's gates (the block programs' elementwise sums, so the same bits)
    and writes its whole row, then normalizes it in place with the weight ``w_ptr`` (D,)
    (mhc_pre_small.weighted_row_norm; VLLM_ORDER as rms_norm_kernel's; D_C = D, the row's
    chunk loop needs it constant)."""
    row = tl.program_id(0)
    t = row + tl.arange(0, 1)  # (1,)
    gate = _head_gates(
        part_ptr, sq_ptr, scale_ptr, base_ptr, t, t < T, T, N * D, rms_eps, hc_eps, S, N, NP, MP
    )  # (1, NP)
    gates = ()  # type: tuple[tl.tensor, ...]
    for jj in tl.static_range(N):
        gates = gates + (gate_of(gate, 0, jj),)  # noqa: RUF005
    r64 = row.to(tl.int64)
    weighted_row_norm(
        x_ptr + r64 * (N * D_C), gates, out_ptr + r64 * D_C, w_ptr, D, rms_eps, D_C, N,
        ROW_CHUNK, VLLM_ORDER, NORM_BLOCK, NORM_CHUNKS, INTERP,
    )  # fmt: skip


@functools.cache
def _launches(
    n: int, D: int, one_launch: bool, fuse_post: bool = False, norm: str | None = None
) -> tuple[int, int, int, tuple[TritonLaunch, ...]]:
    """(block_t, S, MP, the launches) for one (n, D, form); built once.  ``fuse_post``: the
    two-launch form with hc_post in the mix (the apply launch is the plain one); ``norm`` None,
    or the norm order ("official" / "vllm") of the two-launch form's whole-row apply."""
    NP = next_pow2(n)
    # 4 tokens x 256 columns x 4 warps: the fastest of six tiles tried on the H200 at T 1 and
    # T 4096, both D (bench/results/mhc-h200.md, "How the schedules were picked").  The
    # (BLOCK_T, NP, BLOCK_D) tile stays in registers.
    block_t = 4
    block_d = max(16, min(256, 1024 // NP))
    if INTERPRET:
        block_d = min(block_d, 64)  # several slices on the CPU tier's small shapes
    block_d = min(block_d, max(16, next_pow2(D)))
    S = cdiv(D, block_d)
    MP = max(16, next_pow2(n))
    meta = dict(S=S, N=n, NP=NP, MP=MP, BLOCK_T=block_t, BLOCK_D=block_d, INTERP=INTERPRET,
                num_warps=NUM_WARPS)  # fmt: skip
    phases = [(True, True)] if one_launch else [(True, False), (False, True)]
    launches = tuple(
        triton_launch(
            mhc_head_fma_kernel, **meta, DO_MIX=mix, DO_APPLY=apply, FUSE_POST=fuse_post and mix
        )
        for mix, apply in phases
    )
    if norm is not None:
        assert not one_launch
        nm = row_meta(D, NUM_WARPS)  # rms_norm_kernel's chunk for rows of D
        apply = triton_launch(
            mhc_head_norm_apply_kernel, S=S, N=n, NP=NP, MP=MP, VLLM_ORDER=norm == "vllm", D_C=D,
            ROW_CHUNK=min(ROW_CHUNK, next_pow2(D)), NORM_BLOCK=nm["BLOCK_D"],
            NORM_CHUNKS=nm["NUM_CHUNKS"], INTERP=INTERPRET, num_warps=NUM_WARPS,
        )  # fmt: skip
        launches = (launches[0], apply)
    return block_t, S, MP, launches


#: Warps of every launch here; the whole-row apply's norm is rms_norm_triton's at this count.
NUM_WARPS = 4

# A call's plan: (grid, launches, part, sq, counter entries: 0 without counters).
_Plan = tuple[tuple[int], tuple[TritonLaunch, ...], torch.Tensor, torch.Tensor, int]


def _plan(
    device: torch.device, T: int, n: int, D: int, one_launch: bool, fuse_post: bool = False,
    norm: str | None = None,
) -> _Plan:  # fmt: skip
    """Everything of a call but its tensors and scalars; kept per (shapes, stream) by
    :func:`~._launch.plan`."""
    block_t, S, MP, launches = _launches(n, D, one_launch, fuse_post, norm)
    blocks = cdiv(T, block_t)
    part, sq = workspaces("mhc_head_fma", device, S * T * MP, S * T)  # (S, T, MP), (S, T)
    # One launch: one extra block of programs, which only apply (see the kernel).
    grid = ((blocks + 1) * S,) if one_launch else (blocks * S,)
    counts = COUNTER_HEADER + blocks if one_launch else 0
    return grid, launches, part, sq, counts


def _norm_apply(
    launch: TritonLaunch, x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
    part: torch.Tensor, sq: torch.Tensor, out: torch.Tensor, w: torch.Tensor, eps: tuple,
) -> None:  # fmt: skip
    """The whole-row apply launch over x's T rows (grid (T,))."""
    T, _, D = x.shape
    launch((T,), x, scale, base, part, sq, out, w, T, D, *eps)


def mhc_head_fma(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    one_launch: bool = False,
    norm_weight: torch.Tensor | None = None,
    vllm_order: bool = False,
) -> None:
    """Collapse x (T, n, D) into ``out`` (T, D); contiguous inputs on one device, scale / base
    in fp32 (validated by the caller).  Two launches (mix, then gates and output), or with
    ``one_launch`` one ticketed launch: the same arithmetic (module docstring).
    ``norm_weight`` (D,) contiguous (two launches only): ``out`` is the RMSNorm of the
    collapsed rows instead (eps ``rms_norm_eps``; ``vllm_order`` as rms_norm's), formed by one
    whole-row apply program per token (:func:`mhc_head_norm_apply_kernel`): bitwise the
    collapse followed by ``rms_norm_triton(..., num_warps=NUM_WARPS)``, one launch and one read
    of the collapsed rows fewer."""
    T, n, D = x.shape
    if T == 0:
        return
    dev = x.device
    norm = norm_order(norm_weight, vllm_order)
    if norm is not None and one_launch:
        raise ConfigError(
            "norm_weight: mhc_head_fma's norm takes the two-launch form, not one_launch"
        )
    grid, launches, part, sq, counts = plan(_plan, dev, T, n, D, one_launch, False, norm)
    # Asked per call, not kept in the plan: _sync.counters owns the rule (fresh on the CPU, a
    # piece of the capture's arena while capturing, the stream's zeroed buffer otherwise).
    count = counters(dev, counts) if counts else sq
    # no hc_post: its four pointers (after out) are not read
    eps = (float(rms_norm_eps), float(hc_eps))
    args = (x, fn, scale, base, part, sq, count, out, x, x, x, x, T, D, *eps)
    if norm_weight is None:
        launch_each(launches, grid, args)
        return
    launches[0](grid, *args)
    _norm_apply(launches[1], x, scale, base, part, sq, out, norm_weight, eps)


def mhc_post_head_fma(
    f: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    x_out: torch.Tensor,
    out: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    norm_weight: torch.Tensor | None = None,
    vllm_order: bool = False,
) -> None:
    """hc_post (f, x, post, comb) into ``x_out`` (T, n, D), then hc_head of it into ``out``
    (T, D): the two launches of :func:`mhc_head_fma`, the mix forming each tile of x_out from
    f (T, D), x, post (T, n) and comb (T, n, n) fp32 (``FUSE_POST``), the apply reading x_out.
    Bitwise hc_post's Triton kernel followed by :func:`mhc_head_fma`.  x_out must not overlap
    x.  Extra bytes over mhc_head_fma: f (T*D) and post / comb read, x_out (T*n*D) written
    once; the separate hc_post launch and its x_out re-read are what it saves.
    ``norm_weight``, ``vllm_order``: as :func:`mhc_head_fma`'s."""
    T, n, D = x.shape
    if T == 0:
        return
    norm = norm_order(norm_weight, vllm_order)
    grid, (mix, apply), part, sq, _ = plan(_plan, x.device, T, n, D, False, True, norm)
    eps = (float(rms_norm_eps), float(hc_eps))
    mix(grid, x, fn, scale, base, part, sq, sq, out, f, post, comb, x_out, T, D, *eps)
    if norm_weight is not None:
        _norm_apply(apply, x_out, scale, base, part, sq, out, norm_weight, eps)
        return
    apply(grid, x_out, fn, scale, base, part, sq, sq, out, x_out, x_out, x_out, x_out, T, D, *eps)
