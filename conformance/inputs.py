"""The one input builder of the public ops: the registry's strategies, the GPU tests and bench/.

``op_inputs(op, T, D, seed, ...)`` returns ``(args, kwargs)`` for one call of ``op`` in either
implementation.  Distributions (spec 12.3 magnitudes): activations ~ N(0, magnitude^2) in
``dtype``; mHC ``fn`` ~ N(0, 0.02^2), ``scale`` ~ N(1, 0.3^2), ``base`` ~ N(0, 0.5^2), fp32;
hc_post ``post`` = 2 U(0, 1) (what 2 sigmoid(.) spans) and ``comb`` a column softmax of N(0, 1)
logits, fp32; the RMSNorm weight ~ N(1, 0.5^2) in ``dtype``.

The draw order is fixed (bench/results/ record errors of these very tensors, so it stays): one
generator on ``device`` (drawing 8192 x 4 x 7168 on the host would dominate a GPU test) seeded
with ``seed``, activations first, then parameters in argument order (hc_post: residual, post,
comb, f).  ``zero_rows`` then zeroes each activation row with that probability, from the same
generator after every other draw, so it leaves the other values unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EPS", "MHC_OPS", "OPS", "mhc_inputs", "norm_inputs", "op_inputs", "token_rows"]

EPS = 1e-6
MHC_OPS = ("hc_pre", "hc_post", "hc_head")
OPS = ("rms_norm", *MHC_OPS)

Inputs = tuple[tuple[torch.Tensor, ...], dict[str, Any]]


class _Draw:
    def __init__(self, device: str | torch.device, seed: int) -> None:
        self.device = torch.device(device)
        self.g = torch.Generator(device=self.device).manual_seed(seed)

    def normal(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, device=self.device) * std + mean

    def uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, device=self.device)

    def zero_rows(self, t: torch.Tensor, p: float) -> torch.Tensor:
        if p > 0 and t.shape[0] > 0:
            t[self.uniform(t.shape[0]) < p] = 0
        return t


def norm_inputs(
    T: int,
    D: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    *,
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> Inputs:
    """``rms_norm(x, weight, eps=EPS)``: x (T, D) and weight (D,) in ``dtype``."""
    r = _Draw(device, seed)
    x = r.normal(T, D) * magnitude
    w = r.normal(D, std=0.5, mean=1.0).to(dtype)
    return (r.zero_rows(x, zero_rows).to(dtype), w), dict(eps=EPS)


def mhc_inputs(
    op: str,
    T: int,
    n: int,
    D: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    *,
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> Inputs:
    """hc_pre / hc_head ``(x, fn, scale, base)``, hc_post ``(f, residual, post, comb)``;
    streams (T, n, D) and f (T, D) in ``dtype``, parameters fp32; kwargs as V4 calls them."""
    r = _Draw(device, seed)
    x = r.normal(T, n, D) * magnitude
    if op == "hc_pre":
        M = (2 + n) * n
        fn, scale = r.normal(M, n * D, std=0.02), r.normal(3, std=0.3, mean=1.0)
        base = r.normal(M, std=0.5)
        kw: dict[str, Any] = dict(rms_norm_eps=EPS, hc_eps=EPS, sinkhorn_iters=20, post_mult=2.0)
        return (r.zero_rows(x, zero_rows).to(dtype), fn, scale, base), kw
    if op == "hc_head":
        fn, scale = r.normal(n, n * D, std=0.02), r.normal(1, std=0.3, mean=1.0)
        base = r.normal(n, std=0.5)
        return (r.zero_rows(x, zero_rows).to(dtype), fn, scale, base), dict(
            rms_norm_eps=EPS, hc_eps=EPS
        )
    if op != "hc_post":
        raise ValueError(f"not an mHC op: {op!r}")
    post = 2 * r.uniform(T, n)
    comb = torch.softmax(r.normal(T, n, n), dim=-2)  # columns (over sources) sum to 1
    f = r.normal(T, D) * magnitude
    residual = r.zero_rows(x, zero_rows)
    return (r.zero_rows(f, zero_rows).to(dtype), residual.to(dtype), post, comb), {}


def op_inputs(
    op: str,
    T: int,
    D: int,
    seed: int,
    *,
    n: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> Inputs:
    """``(args, kwargs)`` of one call of any op in :data:`OPS` (defaults: V4's n = 4, bf16)."""
    if op == "rms_norm":
        return norm_inputs(T, D, dtype, device, seed, magnitude=magnitude, zero_rows=zero_rows)
    return mhc_inputs(op, T, n, D, dtype, device, seed, magnitude=magnitude, zero_rows=zero_rows)


def token_rows(op: str, args: tuple[torch.Tensor, ...], index: Any) -> tuple[torch.Tensor, ...]:
    """The same call restricted to tokens ``index`` (a slice or index tensor); per-token
    arguments are indexed along dim 0, parameters are shared and left alone."""
    if op == "hc_post":
        return tuple(a[index] for a in args)
    return (args[0][index], *args[1:])
