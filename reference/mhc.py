"""Manifold-constrained hyper-connections (mHC) and ``hc_head``.

The math: ``docs/semantics.md``, "mHC: hc_pre, Sinkhorn, hc_post" and "hc_head".

The residual is ``n = hc_mult`` streams of width D, ``x: (T, n, D)``.  ``hc_pre`` collapses the
streams into the sublayer input and produces the ``post`` gates and the doubly-stochastic ``comb``
mixing matrix; ``hc_post`` writes the sublayer output back into the streams; ``hc_head`` collapses
the streams once more before the LM head.  All math is in promote(x.dtype, float32).

The collapsing functions take the next RMSNorm's weight too (``norm_weight``, ``norm_order``):
their collapsed output is then that norm of it, :func:`~.norm.rms_norm` with eps
``rms_norm_eps``, as the layer applies attn_norm, ffn_norm and the head's norm next.  Here that
is the two functions one after the other; the optimized kernels fold the norm into their last
launch.
"""

from __future__ import annotations

import torch

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_eps,
    check_instance,
    check_int,
    check_ndim,
    check_shape,
    compute_dtype,
)
from dsv4mtp.errors import InputError
from dsv4mtp.semantics import NormOrder

from .linear import rowwise_matmul
from .norm import rms_norm

__all__ = ["hc_head", "hc_post", "hc_post_head", "hc_post_pre", "hc_pre", "sinkhorn"]


def _rms_factor(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x**2) + eps) over the flattened n*D streams; (T, n*D) -> (T, 1)."""
    return torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def _check_streams(x: torch.Tensor) -> tuple[int, int, int]:
    check_dtype("x", x, FLOAT_DTYPES)
    check_ndim("x", x, 3)
    T, n, D = x.shape
    return T, n, D


def _check_params(
    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rows: int, nD: int, n_scales: int
) -> None:
    for name, t in (("fn", fn), ("scale", scale), ("base", base)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_shape("fn", fn, (rows, nD))
    check_shape("scale", scale, (n_scales,))
    check_shape("base", base, (rows,))


def sinkhorn(logits: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on comb logits (already scaled and biased): (..., n, n) -> (..., n, n).

    Schedule: row softmax, + eps, one column normalization, then ``iters - 1`` rounds
    of (row, column) normalization.  It ends on a column normalization, so every destination
    column sums to 1 (up to eps); rows only approximately.
    """
    check_dtype("logits", logits, FLOAT_DTYPES)
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise InputError(f"logits: expected shape (..., n, n), got {tuple(logits.shape)}")
    check_int("iters", iters, 1)
    check_eps("eps", eps)
    p = torch.softmax(logits.to(compute_dtype(logits.dtype)), dim=-1) + eps
    p = p / (p.sum(dim=-2, keepdim=True) + eps)  # columns
    for _ in range(iters - 1):
        p = p / (p.sum(dim=-1, keepdim=True) + eps)  # rows
        p = p / (p.sum(dim=-2, keepdim=True) + eps)  # columns
    return p


def _check_norm(norm_weight: torch.Tensor | None, order: NormOrder, D: int) -> None:
    """The trailing norm's arguments: its order, and its weight (D,) where one is given."""
    if order not in ("official", "vllm"):
        raise InputError(f"norm_order: expected 'official' or 'vllm', got {order!r}")
    if norm_weight is not None:
        check_dtype("norm_weight", norm_weight, FLOAT_DTYPES)
        check_shape("norm_weight", norm_weight, (D,))


def _then_norm(
    rows: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, order: NormOrder
) -> torch.Tensor:
    """``rows`` (T, D), or their RMSNorm with ``norm_weight`` (D,) where one is given."""
    if norm_weight is None:
        return rows
    return rms_norm(rows, norm_weight, eps, order=order)


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float = 2.0,
    batch_invariant: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_order: NormOrder = "official",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse n streams into one sublayer input.

    x: (T, n, D); fn: (M, n*D) with M = (2+n)*n rows [pre n | post n | comb n*n];
    scale: (3,) = [s_pre, s_post, s_comb]; base: (M,).
    Returns ``layer_input (T, D)`` in x.dtype, ``post (T, n)`` and ``comb (T, n, n)`` in the
    compute dtype, ``comb[t, j, k]`` moving source stream j into destination stream k.
    With ``norm_weight`` (D,) layer_input is ``rms_norm(layer_input, norm_weight,
    rms_norm_eps, order=norm_order)`` (module docstring).
    ``batch_invariant`` changes nothing: the reference is batch invariant by construction.
    """
    check_instance("batch_invariant", batch_invariant, bool)
    T, n, D = _check_streams(x)
    M = (2 + n) * n
    _check_params(fn, scale, base, M, n * D, 3)
    _check_norm(norm_weight, norm_order, D)
    check_eps("rms_norm_eps", rms_norm_eps)
    check_eps("hc_eps", hc_eps)
    check_int("sinkhorn_iters", sinkhorn_iters, 1)
    cd = compute_dtype(x.dtype)
    xf = x.reshape(T, n * D).to(cd)  # (T, nD)
    # Row-independent product: a token's mix must not depend on how many tokens share the call
    # (incremental decoding is then bit-for-bit the full recomputation).
    mix = rowwise_matmul(xf, fn.to(cd).T) * _rms_factor(xf, rms_norm_eps)  # (T, M)
    s, b = scale.to(cd), base.to(cd)
    pre = torch.sigmoid(mix[:, :n] * s[0] + b[:n]) + hc_eps  # (T, n)
    post = torch.sigmoid(mix[:, n : 2 * n] * s[1] + b[n : 2 * n]) * post_mult  # (T, n)
    comb_logits = mix[:, 2 * n :].view(T, n, n) * s[2] + b[2 * n :].view(n, n)  # (T, n, n)
    comb = sinkhorn(comb_logits, iters=sinkhorn_iters, eps=hc_eps)  # (T, n, n)
    layer_input = (pre[:, :, None] * xf.view(T, n, D)).sum(dim=1).to(x.dtype)  # (T, D)
    return _then_norm(layer_input, norm_weight, rms_norm_eps, norm_order), post, comb


def hc_post(
    f: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Write a sublayer output back into the streams.

    f: (T, D) sublayer output; residual: (T, n, D) the streams that entered hc_pre;
    post: (T, n); comb: (T, n, n) indexed [source j, destination k].
    ``out[:, k] = post[:, k] * f + sum_j comb[:, j, k] * residual[:, j]``; returns residual.dtype.
    ``batch_invariant`` changes nothing: the reference is batch invariant by construction.
    """
    check_instance("batch_invariant", batch_invariant, bool)
    check_dtype("residual", residual, FLOAT_DTYPES)
    check_ndim("residual", residual, 3)
    T, n, D = residual.shape
    for name, t in (("f", f), ("post", post), ("comb", comb)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_shape("f", f, (T, D))
    check_shape("post", post, (T, n))
    check_shape("comb", comb, (T, n, n))
    cd = compute_dtype(torch.promote_types(residual.dtype, f.dtype))
    cd = torch.promote_types(cd, torch.promote_types(post.dtype, comb.dtype))
    out = post.to(cd)[:, :, None] * f.to(cd)[:, None, :]  # (T, n, D)
    # sum_j comb[t, j, k] * residual[t, j, :], as an explicit sum over the n sources: a batched
    # GEMM would round differently depending on how many tokens share the call.
    out = out + (comb.to(cd)[:, :, :, None] * residual.to(cd)[:, :, None, :]).sum(dim=1)
    return out.to(residual.dtype)


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    batch_invariant: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_order: NormOrder = "official",
) -> torch.Tensor:
    """Collapse the n streams before the LM head: (T, n, D) -> (T, D) in x.dtype.

    fn: (n, n*D); scale: (1,); base: (n,).  The RMS factor only scales the gate logits; the
    weighted sum uses the un-normalized streams.  No post multiplier, no Sinkhorn.  With
    ``norm_weight`` (D,): the head's RMSNorm of the result (module docstring).
    ``batch_invariant`` changes nothing: the reference is batch invariant by construction.
    """
    check_instance("batch_invariant", batch_invariant, bool)
    T, n, D = _check_streams(x)
    _check_params(fn, scale, base, n, n * D, 1)
    _check_norm(norm_weight, norm_order, D)
    check_eps("rms_norm_eps", rms_norm_eps)
    check_eps("hc_eps", hc_eps)
    cd = compute_dtype(x.dtype)
    xf = x.reshape(T, n * D).to(cd)  # (T, nD)
    mix = rowwise_matmul(xf, fn.to(cd).T) * _rms_factor(xf, rms_norm_eps)  # (T, n)
    gate = torch.sigmoid(mix * scale.to(cd)[0] + base.to(cd)) + hc_eps  # (T, n)
    y = (gate[:, :, None] * xf.view(T, n, D)).sum(dim=1)  # (T, D)
    return _then_norm(y.to(x.dtype), norm_weight, rms_norm_eps, norm_order)


def hc_post_pre(
    a: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float = 2.0,
    batch_invariant: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_order: NormOrder = "official",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_post of one sublayer, then hc_pre of the next (what the layer runs between them).

    a: (T, D) sublayer output; x: (T, n, D) the streams; post (T, n), comb (T, n, n) its gates;
    fn, scale, base: the next sublayer's hc_pre parameters.  Returns ``(x_new (T, n, D),
    layer_input (T, D), post_new (T, n), comb_new (T, n, n))``: the composition of
    :func:`hc_post` and :func:`hc_pre`, nothing more.
    """
    x_new = hc_post(a, x, post, comb, batch_invariant=batch_invariant)  # (T, n, D)
    layer_input, post_new, comb_new = hc_pre(
        x_new, fn, scale, base, rms_norm_eps=rms_norm_eps, hc_eps=hc_eps,
        sinkhorn_iters=sinkhorn_iters, post_mult=post_mult, batch_invariant=batch_invariant,
        norm_weight=norm_weight, norm_order=norm_order,
    )  # fmt: skip
    return x_new, layer_input, post_new, comb_new


def hc_post_head(
    f: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    head_fn: torch.Tensor,
    head_scale: torch.Tensor,
    head_base: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    batch_invariant: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_order: NormOrder = "official",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's last hc_post, then hc_head: ``(x_new (T, n, D), head_input (T, D))``.

    f: (T, D) the MoE output; x: (T, n, D); post (T, n), comb (T, n, n); head_fn (n, n*D),
    head_scale (1,), head_base (n,).  The composition of :func:`hc_post` and :func:`hc_head`.
    """
    x_new = hc_post(f, x, post, comb, batch_invariant=batch_invariant)  # (T, n, D)
    head_input = hc_head(
        x_new, head_fn, head_scale, head_base, rms_norm_eps=rms_norm_eps, hc_eps=hc_eps,
        batch_invariant=batch_invariant, norm_weight=norm_weight, norm_order=norm_order,
    )  # fmt: skip
    return x_new, head_input  # (T, n, D), (T, D)
