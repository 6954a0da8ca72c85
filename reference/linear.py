"""The one matmul every projection of the layer goes through (the LM head in ``compute_logits``
apart: a chunked fp32 product).

``y = x @ W^T`` in promote(x.dtype, float32) (the official GEMMs accumulate in fp32 and write the
activation dtype), optionally after simulated FP8 activation quantization (``docs/semantics.md``,
"Activation and KV quantization").

Rows are computed independently (a batched product of one row each): BLAS picks different
kernels, hence different rounding, for 1 row and for many, and we want a token's output to be
bit-for-bit the same whether it is decoded alone (incremental decoding with a KV cache) or inside
a longer prefill.
"""

from __future__ import annotations

import torch

from dsv4mtp.checks import compute_dtype
from dsv4mtp.errors import InputError
from dsv4mtp.quant import ACT_QUANT_BLOCK

from .quant_sim import fp8_block_roundtrip

__all__ = ["linear", "rowwise_matmul"]


def rowwise_matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``x (R, K) @ weight_t (K, N)`` with each row's result independent of the other rows."""
    R = x.shape[0]
    return torch.bmm(x[:, None, :], weight_t.expand(R, -1, -1))[:, 0, :]  # (R, N)


def linear(x: torch.Tensor, weight: torch.Tensor, *, act_quant: bool = False) -> torch.Tensor:
    """``x (..., K) @ weight (N, K)^T -> (..., N)`` in x.dtype.

    ``act_quant``: round x through e4m3 in 1x128 blocks first, as before an FP8/FP4 GEMM.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise InputError(
            f"x: expected last dim {weight.shape[-1]} to match weight {tuple(weight.shape)}, "
            f"got shape {tuple(x.shape)}"
        )
    cd = compute_dtype(x.dtype)
    if act_quant:
        x = fp8_block_roundtrip(x, ACT_QUANT_BLOCK)
    rows = x.reshape(-1, x.shape[-1]).to(cd)  # (R, K)
    out = rowwise_matmul(rows, weight.to(cd).T)  # (R, N)
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
