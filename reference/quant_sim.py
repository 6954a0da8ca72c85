"""Simulated FP8 rounding of activations and of the KV latent: quantize then dequantize.

Rules and reasons: ``docs/semantics.md``, "Activation and KV quantization".

The official kernels quantize every activation that enters an FP8/FP4 GEMM per row in blocks of
128 along K, with a power-of-two (ue8m0) scale ``s = 2**ceil(log2(amax / 448))``, and round the
non-rope dims of the KV latent the same way in blocks of 64.  Because the GEMM then accumulates
``q * s * w`` in fp32, multiplying the rounded values back by ``s`` before an ordinary GEMM gives
the same math.  ``amax`` is floored at 1e-4 as in the official ``act_quant``.  ``x / s`` is
exact (s is a power of two), so the only rounding is e4m3 (correctly rounded for float64 too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4mtp.checks import FLOAT_DTYPES, check_dtype, check_int, compute_dtype
from dsv4mtp.formats import decode_e4m3, encode_e4m3
from dsv4mtp.quant import pow2_scale

__all__ = ["fp8_block_roundtrip"]


def fp8_block_roundtrip(x: torch.Tensor, block: int) -> torch.Tensor:
    """Round ``x (..., K)`` through e4m3 with one power-of-two scale per ``block`` values of K.

    A ragged last block (K not a multiple of ``block``) gets its own scale.  Returns x.dtype.
    """
    check_dtype("x", x, FLOAT_DTYPES)
    check_int("block", block, 1)
    if x.numel() == 0:
        return x.clone()
    cd = compute_dtype(x.dtype)
    K = x.shape[-1]
    pad = (-K) % block
    xf = F.pad(x.to(cd), (0, pad))  # (..., Kp); zero padding never raises a block's amax
    blocks = xf.unflatten(-1, (-1, block))  # (..., Kp/block, block)
    scale = pow2_scale(blocks.abs().amax(-1, keepdim=True))  # ue8m0: a power of two
    q = decode_e4m3(encode_e4m3(blocks / scale), dtype=cd)  # saturates at +-448
    return (q * scale).flatten(-2)[..., :K].to(x.dtype)
