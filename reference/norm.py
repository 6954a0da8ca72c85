"""RMSNorm and its two weight orders (``docs/semantics.md``, "RMSNorm"), and the MTP layer's
entry: the embedding through ``enorm`` and the previous hidden streams through ``hnorm``."""

from __future__ import annotations

import torch

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_embed_norms_args,
    check_eps,
    check_instance,
    check_shape,
    compute_dtype,
)
from dsv4mtp.errors import InputError
from dsv4mtp.semantics import NormOrder

__all__ = ["embed_norms", "rms_norm"]


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


def embed_norms(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    prev_hidden: torch.Tensor,
    enorm: torch.Tensor,
    hnorm: torch.Tensor,
    eps: float,
    *,
    order: NormOrder = "official",
    mask_pos0: bool = False,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer's two entry norms -> ``(e (T, D) in embed.dtype, h (T, n, D) in
    prev_hidden.dtype)`` (docs/semantics.md, "The MTP layer end to end").

    input_ids, positions: (T,) int64, ids in [0, V); embed: (V, D); prev_hidden: (T, n, D);
    enorm, hnorm: (D,).  ``e = rms_norm(embed[input_ids], enorm)``, the gathered row zeroed
    first where ``mask_pos0`` and its position is 0; ``h = rms_norm(prev_hidden, hnorm)``.
    ``order`` and ``batch_invariant`` as :func:`rms_norm`'s.
    """
    T, _ = check_embed_norms_args(
        input_ids, positions, embed, prev_hidden, enorm, hnorm,
        lambda name, t: check_dtype(name, t, FLOAT_DTYPES),
    )  # fmt: skip
    V = embed.shape[0]
    check_instance("mask_pos0", mask_pos0, bool)
    if T and not (int(input_ids.min()) >= 0 and int(input_ids.max()) < V):
        bad = input_ids[(input_ids < 0) | (input_ids >= V)][0]
        raise InputError(f"input_ids: expected ids in [0, {V}), got {int(bad)}")
    e = embed[input_ids]  # (T, D)
    if mask_pos0:
        e = torch.where(positions[:, None] == 0, torch.zeros_like(e), e)
    e = rms_norm(e, enorm, eps, order=order, batch_invariant=batch_invariant)
    h = rms_norm(prev_hidden, hnorm, eps, order=order, batch_invariant=batch_invariant)
    return e, h  # (T, D), (T, n, D)
