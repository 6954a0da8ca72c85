"""The activation- and KV-quantization rules of DeepSeek-V4's FP8 paths, shared by both
implementations (``docs/semantics.md``, "Activation and KV quantization").

Every activation entering an FP8/FP4 GEMM is quantized per row in blocks of ``ACT_QUANT_BLOCK``
values along K; the non-rope dims of the KV latent in blocks of ``KV_QUANT_BLOCK``.  Each block
gets a power-of-two (ue8m0) scale ``s = 2**ceil(log2(max(amax, AMAX_FLOOR) / 448))``, so
``x / s`` is exact and the only rounding is the e4m3 one.
"""

from __future__ import annotations

import torch

from dsv4mtp.formats import E4M3_MAX

__all__ = ["ACT_QUANT_BLOCK", "AMAX_FLOOR", "KV_QUANT_BLOCK", "pow2_scale"]

ACT_QUANT_BLOCK = 128  # one scale per 1x128 row block of an FP8/FP4 GEMM's input
KV_QUANT_BLOCK = 64  # one scale per 64 non-rope values of the KV latent
AMAX_FLOOR = 1e-4  # the official act_quant floors a block's amax here (all-zero blocks)


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The ue8m0 scale of blocks with absolute maximum ``amax``: a power of two, in amax.dtype.

    ``2**ceil(log2(max(amax, AMAX_FLOOR) / 448))``: the smallest power of two that keeps the
    block's largest value inside e4m3's range.
    """
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(AMAX_FLOOR) / E4M3_MAX)))
