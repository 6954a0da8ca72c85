"""RMSNorm over the last dimension (Triton; what ``rms_norm(backend="auto")`` runs everywhere).

``y = w * x * rsqrt(mean(x**2) + eps)`` per row, fp32 statistics (docs/semantics.md,
"RMSNorm").

Shapes: x (R, D) contiguous rows in bf16 / fp32; weight (D,) in bf16 / fp32, or absent;
out (R, D) in x.dtype.  ``VLLM_ORDER`` rounds the normalized row to x.dtype before multiplying
by the weight in x.dtype (vLLM's ``forward_native``); otherwise the weight multiplies in fp32 and
the result is rounded once (DeepSeek's official ``RMSNorm``).

One program per row; the row is walked in BLOCK_D chunks twice (square sum, then scale), the
second walk from L1/L2.  The chunk size depends on D only, so rows are batch invariant.
Bytes: x read once from HBM, out written once, weight once per row (L2): 2*R*D*itemsize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, TritonLaunch, next_pow2, rne_bf16_if_interpreted, triton_launch

__all__ = ["rms_norm_triton"]


@triton.jit
def rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    D,
    eps,
    HAS_WEIGHT: tl.constexpr,
    VLLM_ORDER: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    INTERP: tl.constexpr,
):
    out_ty = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * D
    o_row = out_ptr + row * D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c in range(NUM_CHUNKS):
        d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        x = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
        acc += x * x
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for c in range(NUM_CHUNKS):
        d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = d < D
        x = tl.load(x_row + d, mask=ok, other=0.0).to(tl.float32)
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


def default_num_warps(block: int) -> int:
    """Warps per row program: 4 / 8 / 16 for chunks of <= 1024 / <= 4096 / 8192 columns
    (H200 sweep, bench/results/norm-h200.md: 16 warps were the fastest at D 7168 at every T,
    8 at D 4096, T 4096)."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _launch(D: int, has_weight: bool, vllm_order: bool, num_warps: int | None) -> TritonLaunch:
    block = min(8192, next_pow2(D))
    return triton_launch(
        rms_norm_kernel,
        HAS_WEIGHT=has_weight,
        VLLM_ORDER=vllm_order,
        BLOCK_D=block,
        NUM_CHUNKS=triton.cdiv(D, block),
        INTERP=INTERPRET,
        num_warps=num_warps or default_num_warps(block),
    )


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
    """Launch :func:`rms_norm_kernel` over the rows of a contiguous (R, D) tensor."""
    R, D = x2d.shape
    if R == 0 or D == 0:
        return out2d
    key = (D, weight is not None, vllm_order, num_warps)
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = _launch(*key)
    launch((R,), x2d, weight if weight is not None else x2d, out2d, D, float(eps))
    return out2d
