"""Greedy ids of the shared LM head without the (T, V) logits: ``argmax_v (y @ W^T)[t, v]``
(docs/semantics.md, "The MTP layer end to end": ``compute_logits``, then ``draft``'s argmax).

Layout (what ``optimized/lm_head.py``'s ``pack_head`` builds): ``w`` (V, D) bf16 / fp32 (FMT 0)
or e4m3 codes as uint8 (FMT 1) with fp32 block scales ``s`` (ceil(V/128), ceil(D/128)); ``y``
(T, D) bf16 / fp32 contiguous.

Phase 1, ``lm_head_argmax_kernel``: grid (V chunks, T tiles).  Program (c, j) owns head rows
[c*BLOCK_V, +BLOCK_V) and token rows [j*BLOCK_T, +BLOCK_T).  It streams its head rows once
over D in BLOCK_K steps and computes the chunk's logits for its token rows in fp32 on the
tensor cores, then writes per (token row, chunk) the chunk's maximum and the first index of it
(``pval``, ``pidx``, both (T, chunks)).  Swap-AB: at decode sizes (T <= 64) the token rows are
the small dimension, so they are the dot's N (16..64 wide; tl.dot needs 16 at least) and the
head rows its M (64..256): ``acc (BLOCK_V, BLOCK_T) += W_tile (BLOCK_V, BLOCK_K) @
y_tile^T (BLOCK_K, BLOCK_T)``.  Tensor cores rather than FMA: at T = 64 the head's 2*T*V*D =
68 GFLOP must finish in the ~220 us the 1.06 GB head takes to stream at 4.8 TB/s, i.e.
~310 TFLOP/s, far past the H200's ~67 TFLOP/s of fp32 FMA; at T = 1 the dot pads N to 16 and
wastes 15/16 of a tensor-core issue that is still idle most of the time (memory bound).  The
FP8 head decodes its codes in registers (kernels/decode.py, exact in bf16) and applies each
row's fp32 block scale to the fp32 partial of each 128-wide K block, as kernels/linear.py does.
Under the interpreter the dot is kernels/linear.py's ``_dot``: an fp32 broadcast sum (the
interpreter's bf16 ``tl.dot`` is wrong), never on the GPU path.

Phase 2, ``lm_head_argmax_reduce_kernel``: one program per token row combines the row's
chunk partials in chunk order into the id (int64).  Both phases are deterministic (no
atomics); a row's id depends only on the schedule, never on the other rows.

Tie and NaN rules (torch.argmax's): among equal maxima the lowest index wins (each chunk keeps
its first maximum; chunks are combined in index order, a later chunk only replacing the best
with a strictly larger value); a NaN logit counts as the maximum, so a row with any NaN gets
the index of its first NaN (each chunk records its first NaN, the reduction takes the first
chunk that has one).

Bytes per call: the head once per T tile (V*D*itemsize: 1.06 GB bf16, 0.53 GB FP8 codes + 0.13
MB scales at V4-Flash, one T tile up to 64 rows), y re-read by every program from L2
(chunks * T * D * itemsize: 505 chunks x 512 KiB = 253 MiB at T 64 with 256-row chunks,
1010 x 8 KiB = 8 MiB at T 1 with 128-row chunks), and 8 bytes per (row, chunk) of partials
plus the ids.  The head does not fit the 60 MB L2, so every call streams it from HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, cdiv, next_pow2, triton_launch, workspace
from .decode import _e4m3_bf16
from .linear import LinearSchedule, _dot, chunk_best, linear_triton
from .moe_common import jit_loop_bounds

__all__ = [
    "FMT_DENSE",
    "FMT_FP8",
    "LmHeadSchedule",
    "lm_head_argmax_linear",
    "lm_head_argmax_triton",
    "lm_head_schedule",
    "logits_argmax_triton",
]

FMT_DENSE, FMT_FP8 = 0, 1
SCALE_BLOCK = tl.constexpr(128)  # the FP8 head's 128x128 scale blocks
MAX_BLOCK_T = 64  # token rows per program; more rows take more T tiles (the head re-read)
_REDUCE_BLOCK = 1024  # chunk partials combined per step of the reduction


@dataclass(frozen=True)
class LmHeadSchedule:
    """Tiles of one call: BLOCK_V head rows x BLOCK_T token rows per program, D in BLOCK_K
    steps.  BLOCK_K divides 128 (one FP8 scale per step); BLOCK_V and BLOCK_T are powers of
    two, BLOCK_T >= 16 (tl.dot's smallest N)."""

    block_v: int
    block_t: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    def fields(self) -> list[int]:
        return [self.block_v, self.block_t, self.block_k, self.num_warps, self.num_stages]


def lm_head_schedule(T: int, batch_invariant: bool, fp32: bool = False) -> LmHeadSchedule:
    """The default schedule.  Token tile: the next power of two of T between 16 and 64 (one T
    tile up to 64 rows).  Up to 32 rows: 128 head rows per program (1010 programs at V4-Flash's
    V 129280, ~7.7 per SM: the grid spreads over all 132 SMs with a short tail), 128-wide K
    steps, 4 warps, 4 stages ((128 + 32) x 128 x 2 B = 40 KiB per stage).  64 rows: 256 head
    rows (505 programs) so that y, re-read from L2 by every program, costs half as much
    (253 MiB at T 64), 64-wide K steps and 8 warps (a 256 x 64 fp32 accumulator is 64 registers
    per thread), 4 stages of 40 KiB.  ``fp32`` (y or the head in fp32: an fp32 FMA dot, twice
    the bytes per element): 128 head rows, 64-wide K steps, 8 warps (4 warps spill at T 64 on sm_90),
    3 stages ((128 + 64) x 64 x 4 B = 48 KiB per stage).  ``batch_invariant``: the 64-row schedule for every T (a row's bits then
    never depend on T).  Under the interpreter: small tiles (CPU-tier V)."""
    bt = MAX_BLOCK_T if batch_invariant else min(MAX_BLOCK_T, max(16, next_pow2(T)))
    if INTERPRET:
        return LmHeadSchedule(64, bt, 64, 4, 1)
    if fp32:
        return LmHeadSchedule(128, bt, 64, num_warps=8, num_stages=3)
    if bt <= 32:
        return LmHeadSchedule(128, bt, 128, num_warps=4, num_stages=4)
    return LmHeadSchedule(256, bt, 64, num_warps=8, num_stages=4)


@jit_loop_bounds("D")
def lm_head_argmax_kernel(
    y_ptr,
    w_ptr,
    s_ptr,
    pval_ptr,
    pidx_ptr,
    T,
    V,
    D,
    CHUNKS,
    FMT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_F32: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_t = tl.program_id(1)
    vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    ts = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    vm = vs < V
    tm = ts < T
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + vs[:, None].to(tl.int64) * D  # (BLOCK_V, 1)
    y_rows = y_ptr + ts[:, None].to(tl.int64) * D  # (BLOCK_T, 1)
    KB = tl.cdiv(D, SCALE_BLOCK)
    s_rows = s_ptr + (vs // SCALE_BLOCK).to(tl.int64) * KB  # (BLOCK_V,)
    acc = tl.zeros((BLOCK_V, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + kk
        km = k < D
        y = tl.load(y_rows + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        if FMT == 1:
            codes = tl.load(w_rows + k[None, :], mask=vm[:, None] & km[None, :], other=0)
            w = _e4m3_bf16(codes, INTERP)  # (BLOCK_V, BLOCK_K), exact
            part = _dot(w, tl.trans(y), USE_F32, INTERP)  # (BLOCK_V, BLOCK_T)
            scale = tl.load(s_rows + k0 // SCALE_BLOCK, mask=vm, other=0.0)  # (BLOCK_V,)
            acc += part * scale[:, None]
        else:
            w = tl.load(w_rows + k[None, :], mask=vm[:, None] & km[None, :], other=0.0)
            acc += _dot(w, tl.trans(y), USE_F32, INTERP)
    # acc[:, t]: this chunk's logits of token row t.  The chunk's first NaN, else its maximum
    # (NaN left out) and the first index holding it.
    vidx = vs[:, None] + tl.zeros((BLOCK_V, BLOCK_T), dtype=tl.int32)
    val, idx = chunk_best(acc, vidx, V, 0)  # (BLOCK_T,)
    off = ts.to(tl.int64) * CHUNKS + pid_v
    tl.store(pval_ptr + off, val, mask=tm)
    tl.store(pidx_ptr + off, idx, mask=tm)


@jit_loop_bounds("CHUNKS")
def lm_head_argmax_reduce_kernel(
    pval_ptr, pidx_ptr, mask_ptr, out_ptr, V, CHUNKS, BLOCK_C: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """out[t] = the id of row t from its CHUNKS partials, combined in chunk order (module doc);
    -1 where the row mask (HAS_MASK, bools as bytes) is false."""
    t = tl.program_id(0).to(tl.int64)
    big = V
    best_v = float("-inf")
    best_i = big
    nan_i = big
    for c0 in range(0, CHUNKS, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        cm = cc < CHUNKS
        v = tl.load(pval_ptr + t * CHUNKS + cc, mask=cm, other=float("-inf"))
        i = tl.load(pidx_ptr + t * CHUNKS + cc, mask=cm, other=big)
        isnan = (v != v) & cm
        nan_i = tl.minimum(nan_i, tl.min(tl.where(isnan, i, big), axis=0))
        key = tl.where(isnan, float("-inf"), v)
        m = tl.max(key, axis=0)
        im = tl.min(tl.where(cm & (key == m), i, big), axis=0)
        # a strictly larger maximum replaces the best; an equal one keeps the lower index
        best_i = tl.where(m > best_v, im, tl.where(m == best_v, tl.minimum(best_i, im), best_i))
        best_v = tl.maximum(best_v, m)
    ident = tl.where(nan_i < big, nan_i, best_i).to(tl.int64)
    if HAS_MASK:
        ident = tl.where(tl.load(mask_ptr + t) != 0, ident, -1)
    tl.store(out_ptr + t, ident)


@triton.jit
def logits_chunk_kernel(
    logits_ptr, pval_ptr, pidx_ptr, V, ROW_STRIDE, CHUNKS, BLOCK_V: tl.constexpr
):  # fmt: skip
    """Program (c, t): the greedy candidate of logits row t over columns [c*BLOCK_V, +BLOCK_V)
    (:func:`~.linear.chunk_best`) into the (T, CHUNKS) partials of
    :func:`lm_head_argmax_reduce_kernel`."""
    c = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    vs = c * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(logits_ptr + t * ROW_STRIDE + vs, mask=vs < V, other=0.0)
    val, idx = chunk_best(x[None, :], vs[None, :], V, 1)  # (1,)
    off = t * CHUNKS + c + tl.arange(0, 1)
    tl.store(pval_ptr + off, val)
    tl.store(pidx_ptr + off, idx)


# logits columns per program of logits_chunk_kernel: 16 KiB of fp32 (V4's 129280 columns in 32
# chunks), so the reduce combines few partials per row
_LOGITS_BLOCK = 4096


def logits_argmax_triton(
    logits: torch.Tensor, out: torch.Tensor, row_mask: torch.Tensor | None = None
) -> None:
    """out (T,) int64 = torch.argmax(logits, -1) of fp32 logits (T, V) with unit column stride,
    -1 where ``row_mask`` is false: :func:`logits_chunk_kernel` over (V / 4096 chunks, T), then
    the argmax's reduce launch (torch.argmax's tie and NaN rules, bit for bit).  Bytes: the
    logits once (T * V * 4) and 8 per (row, chunk)."""
    T, V = logits.shape
    if T == 0:
        return
    block = min(_LOGITS_BLOCK, max(16, next_pow2(V)))
    chunks = cdiv(V, block)
    pval, pidx = _partials("lm_head.logits", T * chunks, logits.device)
    launch = triton_launch(logits_chunk_kernel, BLOCK_V=block, num_warps=4)
    launch((chunks, T), logits, pval, pidx, V, logits.stride(0), chunks)
    _reduce(pval, pidx, row_mask, out, V, chunks)


def lm_head_argmax_triton(
    y: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    *,
    fmt: int,
    sched: LmHeadSchedule,
    row_mask: torch.Tensor | None = None,
) -> None:
    """out (T,) int64 = argmax over V of y (T, D) @ w (V, D)^T (module doc); all contiguous;
    -1 in rows where ``row_mask`` (T,) bool is false (written by the reduce, no launch more).
    Two launches through :func:`triton_launch` (a repeated call skips Triton's argument binding)
    and partials in a per-stream workspace, so the call is CUDA-graph capturable."""
    T, D = y.shape
    V = w.shape[0]
    if T == 0:
        return
    chunks = cdiv(V, sched.block_v)
    pval, pidx = _partials("lm_head", T * chunks, y.device)
    use_f32 = INTERPRET or y.dtype == torch.float32 or w.dtype == torch.float32
    main = triton_launch(
        lm_head_argmax_kernel, FMT=fmt, BLOCK_V=sched.block_v, BLOCK_T=sched.block_t,
        BLOCK_K=sched.block_k, USE_F32=use_f32, INTERP=INTERPRET, num_warps=sched.num_warps,
        num_stages=sched.num_stages,
    )  # fmt: skip
    main((chunks, cdiv(T, sched.block_t)), y, w, s if s.numel() else w, pval, pidx, T, V, D, chunks)
    _reduce(pval, pidx, row_mask, out, V, chunks)


def lm_head_argmax_linear(
    y: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    *,
    fmt: int,
    sched: LinearSchedule,
    row_mask: torch.Tensor | None = None,
) -> None:
    """:func:`lm_head_argmax_triton`'s result through the dense-linear kernel: its logits tiles
    (kernels/linear.py, ``linear_kernel`` under ``sched``, one K split) end in
    :func:`~.linear.chunk_best` instead of a store, one partial per (row, BLOCK_N head rows),
    and the same reduce launch combines them.  The ids are torch.argmax over the logits that
    ``lm_head_logits`` writes under ``sched``, bit for bit, without writing them (T * V * 4
    bytes) or torch.argmax's pass over them.  For the FP8 head, whose codes that kernel's
    orientation (the head rows as the dot's N side) streams faster than the argmax kernel's
    (module doc; bench/results/head-fp8.md)."""
    T, D = y.shape
    V = w.shape[0]
    if T == 0:
        return
    chunks = cdiv(V, sched.block_n)
    pval, pidx = _partials("lm_head", T * chunks, y.device)
    # y (the kernel's output argument) is not written under argmax: only its dtype is read
    linear_triton(
        y.view(T, 1, D), w.view(1, V, D), s.view(1, *s.shape) if s.numel() else s,
        y.view(T, 1, D), fmt=fmt, sched=sched, argmax=(pval, pidx),
    )  # fmt: skip
    _reduce(pval, pidx, row_mask, out, V, chunks)


def _partials(name: str, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (T * chunks) partials of the argmax's reduce, fp32 values and int32 indices, from
    the per-stream workspace ``name``."""
    return (
        workspace(f"{name}.pval", (n,), torch.float32, device),
        workspace(f"{name}.pidx", (n,), torch.int32, device),
    )


def _reduce(
    pval: torch.Tensor,
    pidx: torch.Tensor,
    row_mask: torch.Tensor | None,
    out: torch.Tensor,
    V: int,
    chunks: int,
) -> None:
    """The ids from the (T, chunks) partials: ``lm_head_argmax_reduce_kernel``, one program
    per row; -1 where ``row_mask`` is false."""
    T = out.shape[0]
    block_c = min(_REDUCE_BLOCK, max(16, next_pow2(chunks)))
    has_mask = row_mask is not None
    reduce = triton_launch(
        lm_head_argmax_reduce_kernel, BLOCK_C=block_c, HAS_MASK=has_mask, num_warps=4
    )
    mask = row_mask.view(torch.uint8) if row_mask is not None else out
    reduce((T,), pval, pidx, mask, out, V, chunks)
