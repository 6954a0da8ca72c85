"""RMSNorm and its two weight orders (``docs/semantics.md``, "RMSNorm")."""

from __future__ import annotations

import torch

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_eps,
    check_instance,
    check_shape,
    compute_dtype,
)
from dsv4mtp.errors import InputError
from dsv4mtp.semantics import NormOrder

__all__ = ["rms_norm"]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    order: NormOrder = "official",
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``y = w * x * rsqrt(mean(x**2, -1) + eps)`` over the last dim; returns ``x.dtype``.

    x: (..., D) float; weight: (D,) or None (the unweighted q per-head norm).
    Math in promote(x.dtype, float32).  ``order="official"`` multiplies the weight in the compute
    dtype and casts once (DeepSeek's ``RMSNorm``); ``order="vllm"`` casts the normalized value to
    ``x.dtype`` first and multiplies by the weight in ``x.dtype`` (one extra rounding, vLLM's
    ``forward_native``).
    ``batch_invariant`` changes nothing here: every row is computed on its own, so a token's bits
    never depend on its batch (the flag exists so both implementations share one signature).
    """
    check_instance("batch_invariant", batch_invariant, bool)
    check_dtype("x", x, FLOAT_DTYPES)
    if weight is not None:
        check_dtype("weight", weight, FLOAT_DTYPES)
        check_shape("weight", weight, (x.shape[-1],))
    check_eps("eps", eps)
    if order not in ("official", "vllm"):
        raise InputError(f"order: expected 'official' or 'vllm', got {order!r}")
    cd = compute_dtype(x.dtype)
    xf = x.to(cd)
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)  # (..., D)
    if weight is None:
        return normed.to(x.dtype)
    if order == "official":
        return (weight.to(cd) * normed).to(x.dtype)
    return normed.to(x.dtype) * weight.to(x.dtype)
