"""The sqrtsoftplus router (docs/semantics.md, "MoE: router, clamped SwiGLU, shared expert").

Two kernels, no host sync:

* ``route_logits_kernel``: grid (cdiv(T, BLOCK_T), E / BLOCK_E, SPLIT).  Each program computes
  fp32 partial logits of BLOCK_T tokens x BLOCK_E experts over one D / SPLIT slice of the hidden
  dim (fp32 FMA, broadcast-and-sum: every row is reduced in the same order whatever T is, so the
  router is batch invariant).  SPLIT spreads the gate's bytes (E*D*itemsize, 2 MiB in bf16 at
  V4-Flash shapes) over many SMs when T is 1.  Writes partials (SPLIT, T, E) fp32.
* ``route_topk_kernel``: one program per token.  Sums the SPLIT partials in split order,
  scores = sqrt(softplus(logits)), biased = scores + bias, K passes of an arg-max (tie: the
  lowest expert id wins on an equal biased score), weights = unbiased scores of the selected,
  renormalised, times ``routed_scaling_factor``.  Writes weights (T, K) fp32, ids (T, K) int32.

softplus follows torch (threshold 20: the identity above it) and uses log1p's Kahan form
``log(u) * e / (u - 1)``, u = 1 + e, which stays accurate where ``exp(l)`` is far below one ulp
of 1 (plain ``log(1 + exp(l))`` loses all digits there).
Bytes: gate E*D*itemsize once (SPLIT programs each read their slice), x T*D*itemsize per
E / BLOCK_E program column (L2), partials 2*SPLIT*T*E*4.

Schedule at V4-Flash (E 256, D 4096; BLOCK_T 4, BLOCK_E 32, SPLIT 8): the logits grid is
cdiv(T, 4) x 8 x 8 programs, 64 at T 1 and 65536 at T 4096; each reads a 32 KB slice of the
gate, so the gate is re-read from L2 once per 4 tokens (2 GB of L2 reads at T 4096) and the
T*E*D = 4.3 G fp32 FMAs run on CUDA cores (no tensor cores: the fixed order keeps it batch
invariant).  Not a schedule knob yet; bench/diag/moe_sweep.py times it alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, next_pow2
from .moe_common import jit_loop_bounds

__all__ = ["route_triton"]


@jit_loop_bounds("D_SPLIT")
def route_logits_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    T,
    E,
    D,
    D_SPLIT,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    k_lo = pid_s * D_SPLIT
    for kd in range(0, D_SPLIT, BLOCK_K):
        k = k_lo + kd + kk
        km = k < D
        x = tl.load(
            x_ptr + t[:, None].to(tl.int64) * D + k[None, :],
            mask=(t[:, None] < T) & km[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            w_ptr + e[:, None].to(tl.int64) * D + k[None, :],
            mask=(e[:, None] < E) & km[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = part_ptr + (pid_s * T + t[:, None]).to(tl.int64) * E + e[None, :]
    tl.store(out, acc, mask=(t[:, None] < T) & (e[None, :] < E))


@triton.jit
def route_topk_kernel(
    part_ptr,
    bias_ptr,
    w_out_ptr,
    id_out_ptr,
    T,
    E,
    scaling,
    SPLIT: tl.constexpr,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    logits = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s in range(SPLIT):
        logits += tl.load(part_ptr + (s * T + row) * E + e, mask=em, other=0.0)
    ex = tl.exp(logits)
    u = 1.0 + ex
    log1p = tl.where(u == 1.0, ex, tl.log(u) * ex / (u - 1.0))
    softplus = tl.where(logits > 20.0, logits, log1p)
    scores = tl.sqrt(softplus)
    biased = scores + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
    biased = tl.where(em, biased, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    sel_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    sel_id = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k in range(K):
        best = tl.max(biased, axis=0)
        idx = tl.min(tl.where(biased == best, e, BLOCK_E), axis=0)  # lowest id on a tie
        w = tl.sum(tl.where(e == idx, scores, 0.0), axis=0)
        sel_w = tl.where(slots == k, w, sel_w)
        sel_id = tl.where(slots == k, idx, sel_id)
        biased = tl.where(e == idx, float("-inf"), biased)
    total = tl.sum(tl.where(slots < K, sel_w, 0.0), axis=0)
    sel_w = sel_w / total * scaling
    tl.store(w_out_ptr + row * K + slots, sel_w, mask=slots < K)
    tl.store(id_out_ptr + row * K + slots, sel_id, mask=slots < K)


def route_triton(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    top_k: int,
    scaling: float,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
) -> None:
    """x (T, D) contiguous, gate_weight (E, D) contiguous, gate_bias (E,) -> weights_out (T, K)
    fp32, ids_out (T, K) int32 (both contiguous, written in place)."""
    T, D = x.shape
    E = gate_weight.shape[0]
    if T == 0:
        return
    block_e = 16 if INTERPRET else 32
    block_k = 64
    block_t = 4
    # Split D so that one token still spreads the gate over ~64 programs (fixed for a given D,
    # never by T: batch invariant).
    split = 1 if INTERPRET else max(1, min(16, D // 512))
    d_split = triton.cdiv(triton.cdiv(D, split), block_k) * block_k
    split = triton.cdiv(D, d_split)
    part = torch.empty((split, T, E), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, block_t), triton.cdiv(E, block_e), split)
    route_logits_kernel[grid](
        x, gate_weight, part, T, E, D, d_split,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    route_topk_kernel[(T,)](
        part, gate_bias, weights_out, ids_out, T, E, float(scaling),
        SPLIT=split, K=top_k, BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(top_k), num_warps=4,
    )  # fmt: skip
