"""mHC post: write a sublayer output back into the n residual streams (Triton fallback).

``out[t, k, :] = post[t, k] * f[t, :] + sum_j comb[t, j, k] * residual[t, j, :]``
(docs/semantics.md, "mHC: hc_pre, Sinkhorn, hc_post"; comb is indexed [source j, destination
k]).  FlashInfer's ``mhc_post`` does this on the GPU for n = 4 in bf16; this kernel serves
every other case (n != 4, fp32, the CPU interpreter).

Shapes: f (T, D), residual (T, n, D), out (T, n, D) in any of bf16 / fp32 (each converted on
load; out in its own dtype); post (T, n) and comb (T, n, n) in fp32 (or bf16).  All contiguous.

Arithmetic per element, fp32, in FlashInfer's order: ``acc = f * post[k]``, then one FMA per
source stream j = 0..n-1; one rounding on the store.  Per-token work only, so batch invariant.

Bytes: f and residual read once, out written once, post / comb once per (token, D-block):
(T*D + 2*T*n*D) * itemsize + small.  Grid (T, cdiv(D, BLOCK_D)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, TritonLaunch, next_pow2, rne_bf16_if_interpreted, triton_launch

__all__ = ["mhc_post_triton"]


@triton.jit
def mhc_post_kernel(
    f_ptr,
    res_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    D,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BD,)
    k = tl.arange(0, NP)  # (NP,) destination stream
    d_ok = d < D
    k_ok = k < N
    f = tl.load(f_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + k, mask=k_ok, other=0.0).to(tl.float32)
    acc = post[:, None] * f[None, :]  # (NP, BD)
    for jsrc in tl.static_range(N):
        r = tl.load(res_ptr + (t * N + jsrc) * D + d, mask=d_ok, other=0.0).to(tl.float32)
        c = tl.load(comb_ptr + (t * N + jsrc) * N + k, mask=k_ok, other=0.0).to(tl.float32)
        acc = tl.fma(c[:, None], r[None, :], acc)
    out = out_ptr + (t * N + k[:, None]) * D + d[None, :]
    out_ty = out_ptr.dtype.element_ty
    acc = rne_bf16_if_interpreted(acc, out_ty, INTERP)
    tl.store(out, acc.to(out_ty), mask=k_ok[:, None] & d_ok[None, :])


# The launch and D-blocks per (n, D): the schedule depends on nothing else.
_LAUNCHES: dict[tuple[int, int], tuple[TritonLaunch, int]] = {}


def _launch(n: int, D: int) -> tuple[TritonLaunch, int]:
    block_d = min(1024, next_pow2(D))
    launch = triton_launch(
        mhc_post_kernel, N=n, NP=next_pow2(n), BLOCK_D=block_d, INTERP=INTERPRET, num_warps=4
    )
    return launch, triton.cdiv(D, block_d)


def mhc_post_triton(
    f: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Launch :func:`mhc_post_kernel` (contiguous inputs, validated by the caller)."""
    T, n, D = residual.shape
    if T == 0:
        return out
    entry = _LAUNCHES.get((n, D))
    if entry is None:
        entry = _LAUNCHES[(n, D)] = _launch(n, D)
    launch, d_blocks = entry
    launch((T, d_blocks), f, residual, post, comb, out, D)
    return out
