"""RMSNorm over the last dimension (Triton; what ``rms_norm(backend="auto")`` runs everywhere).

``y = w * x * rsqrt(mean(x**2) + eps)`` per row, fp32 statistics (docs/semantics.md,
"RMSNorm").

Shapes: x (R, D) rows in bf16 / fp32, unit column stride, any row stride (a column slice of a
wider tensor is read in place: the attention's q rows of the fused wq_a + wkv output); weight
(D,) in bf16 / fp32, or absent; out (R, D) contiguous in x.dtype.  ``VLLM_ORDER`` rounds the
normalized row to x.dtype before multiplying by the weight in x.dtype (vLLM's
``forward_native``); otherwise the weight multiplies in fp32 and the result is rounded once
(DeepSeek's official ``RMSNorm``).

One program per row; the row is walked in BLOCK_D chunks twice (square sum, then scale), the
second walk from L1/L2.  The chunk size depends on D only, so rows are batch invariant.
Bytes: x read once from HBM, out written once, weight once per row (L2): 2*R*D*itemsize.

:func:`embed_norms_kernel` runs the MTP layer's two entry norms as one launch: the embedding
rows gathered by token id (and zeroed at position 0 under ``mask_pos0``) through ``enorm``, and
the previous hidden streams through ``hnorm``.  Every row runs :func:`norm_row`, the body of
:func:`rms_norm_kernel`, with the same chunk and warp count, so each output row is bitwise the
one :func:`rms_norm_kernel` writes for that row; the launch replaces the gather and the two
norm launches (and, under ``mask_pos0``, the mask's comparison, fill and ``where``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, TritonLaunch, next_pow2, rne_bf16_if_interpreted, triton_launch

__all__ = ["embed_norms_triton", "norm_row", "rms_norm_triton", "row_meta"]


@triton.jit
def norm_row(
    x_row,
    w_ptr,
    o_row,
    D,
    eps,
    keep,
    MASKED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    VLLM_ORDER: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One row: the square sum over BLOCK_D chunks, then the scaled row.  ``MASKED``: the row
    reads as zeros unless the scalar ``keep`` holds (the embedding rows under mask_pos0)."""
    out_ty = o_row.dtype.element_ty
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c in range(NUM_CHUNKS):
        d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = d < D
        if MASKED:
            ok = ok & keep
        x = tl.load(x_row + d, mask=ok, other=0.0).to(tl.float32)
        acc += x * x
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for c in range(NUM_CHUNKS):
        d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = d < D
        in_row = ok
        if MASKED:
            in_row = ok & keep
        x = tl.load(x_row + d, mask=in_row, other=0.0).to(tl.float32)
        y = x * rstd
        if HAS_WEIGHT:
            w = tl.load(w_ptr + d, mask=ok, other=0.0)
            if VLLM_ORDER:
                # round the normalized value first, then multiply in the input dtype
                yx = rne_bf16_if_interpreted(y, out_ty, INTERP).to(out_ty).to(tl.float32)
                wf = rne_bf16_if_interpreted(w.to(tl.float32), out_ty, INTERP)
                wx = wf.to(out_ty).to(tl.float32)
                y = yx * wx
            else:
                y = y * w.to(tl.float32)
        y = rne_bf16_if_interpreted(y, out_ty, INTERP)
        tl.store(o_row + d, y.to(out_ty), mask=ok)


@triton.jit
def rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    D,
    X_STRIDE,
    eps,
    HAS_WEIGHT: tl.constexpr,
    VLLM_ORDER: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    INTERP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    norm_row(
        x_ptr + row * X_STRIDE, w_ptr, out_ptr + row * D, D, eps, True, False, HAS_WEIGHT,
        VLLM_ORDER, BLOCK_D, NUM_CHUNKS, INTERP,
    )  # fmt: skip


@triton.jit
def embed_norms_kernel(
    ids_ptr,
    pos_ptr,
    embed_ptr,
    h_ptr,
    enorm_ptr,
    hnorm_ptr,
    e_out_ptr,
    h_out_ptr,
    T,
    V,
    D,
    E_STRIDE,
    eps,
    MASK_POS0: tl.constexpr,
    VLLM_ORDER: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Programs [0, T): embedding row ``ids[p]`` through enorm into e_out row p (zeros in, so
    zeros out, where MASK_POS0 and position 0; NaN where the id is outside [0, V): the row
    reads nothing).  Programs [T, T + R): hidden row p - T through hnorm into h_out."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < T:
        tok = tl.load(ids_ptr + pid)
        e_row = e_out_ptr + pid * D
        if (tok >= 0) & (tok < V):
            if MASK_POS0:  # noqa: SIM108  (a constexpr branch: only one side compiles)
                keep = tl.load(pos_ptr + pid) != 0
            else:
                keep = True
            norm_row(
                embed_ptr + tok * E_STRIDE, enorm_ptr, e_row, D, eps, keep, MASK_POS0, True,
                VLLM_ORDER, BLOCK_D, NUM_CHUNKS, INTERP,
            )  # fmt: skip
        else:
            for c in range(NUM_CHUNKS):
                d = c * BLOCK_D + tl.arange(0, BLOCK_D)
                nan = tl.full((BLOCK_D,), float("nan"), tl.float32)
                tl.store(e_row + d, nan.to(e_out_ptr.dtype.element_ty), mask=d < D)
    else:
        row = pid - T
        norm_row(
            h_ptr + row * D, hnorm_ptr, h_out_ptr + row * D, D, eps, True, False, True,
            VLLM_ORDER, BLOCK_D, NUM_CHUNKS, INTERP,
        )  # fmt: skip


def default_num_warps(block: int) -> int:
    """Warps per row program: 4 / 8 / 16 for chunks of <= 1024 / <= 4096 / 8192 columns
    (H200 sweep, bench/results/norm-h200.md: 16 warps were the fastest at D 7168 at every T,
    8 at D 4096, T 4096)."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def row_meta(D: int, num_warps: int | None = None) -> dict[str, Any]:
    """A row program's chunk, chunk count and warps for rows of D (every kernel that runs
    :func:`norm_row`: the same reduction tree for every row of any of them at one warp
    count)."""
    block = min(8192, next_pow2(D))
    return dict(
        BLOCK_D=block,
        NUM_CHUNKS=triton.cdiv(D, block),
        INTERP=INTERPRET,
        num_warps=num_warps or default_num_warps(block),
    )


def _launch(D: int, has_weight: bool, vllm_order: bool, num_warps: int | None) -> TritonLaunch:
    meta = row_meta(D, num_warps)
    return triton_launch(rms_norm_kernel, HAS_WEIGHT=has_weight, VLLM_ORDER=vllm_order, **meta)


# The launch per (D, weight, order, warps): the schedule depends on nothing else.
_LAUNCHES: dict[tuple[int, bool, bool, int | None], TritonLaunch] = {}


def rms_norm_triton(
    x2d: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out2d: torch.Tensor,
    vllm_order: bool,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Launch :func:`rms_norm_kernel` over the rows of an (R, D) tensor with unit column stride
    (rows ``x2d.stride(0)`` apart) into contiguous ``out2d``."""
    R, D = x2d.shape
    if R == 0 or D == 0:
        return out2d
    key = (D, weight is not None, vllm_order, num_warps)
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = _launch(*key)
    launch((R,), x2d, weight if weight is not None else x2d, out2d, D, x2d.stride(0), float(eps))
    return out2d


@functools.cache
def _embed_launch(D: int, vllm_order: bool, mask_pos0: bool) -> TritonLaunch:
    meta = row_meta(D)  # rms_norm_triton's default: each row's reduction tree as there
    return triton_launch(embed_norms_kernel, MASK_POS0=mask_pos0, VLLM_ORDER=vllm_order, **meta)


def embed_norms_triton(
    ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    h2d: torch.Tensor,
    enorm: torch.Tensor,
    hnorm: torch.Tensor,
    eps: float,
    e_out: torch.Tensor,
    h_out2d: torch.Tensor,
    vllm_order: bool,
    mask_pos0: bool,
) -> None:
    """Launch :func:`embed_norms_kernel`: ids / positions (T,) int64, embed (V, D) with unit
    column stride, h2d (R, D) contiguous rows (R = T * n), enorm / hnorm (D,); e_out (T, D),
    h_out2d (R, D) contiguous."""
    T, R = ids.shape[0], h2d.shape[0]
    V, D = embed.shape
    if T + R == 0 or D == 0:
        return
    _embed_launch(D, vllm_order, mask_pos0)(
        (T + R,),
        ids,
        positions,
        embed,
        h2d,
        enorm,
        hnorm,
        e_out,
        h_out2d,
        T,
        V,
        D,
        embed.stride(0),
        float(eps),
    )
