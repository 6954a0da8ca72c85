"""mHC (``hc_pre``, ``hc_post``) and ``hc_head`` on the H200.

Same signatures as :mod:`dsv4mtp.reference.mhc` plus keyword-only ``out`` and ``backend``.

Backends (``backend="auto"`` picks the first that applies; every choice depends on dtype, n and
D only, never on T, so a token's result does not depend on its batch):

* ``hc_pre``  - n = 4, bf16, CUDA: ``PRE_AUTO_BACKEND`` (picked by measurement on the H200,
  bench/results/): either the one-pass Triton collapse, or the Triton mix producer feeding
  FlashInfer's ``mhc_pre_big_fuse`` (Sinkhorn + pre-weighted sum).  Otherwise the Triton
  collapse (single pass on GPU, two launches under the interpreter).
* ``hc_post`` - n = 4, bf16 f and residual, CUDA: FlashInfer ``mhc_post``; otherwise Triton.
* ``hc_head`` - the Triton collapse (no FlashInfer kernel exists for it on sm_90).

FlashInfer conventions handled here: its pre kernel returns ``(post (..., 4, 1), comb,
layer_input)`` and defaults ``mhc_post_mult_value`` to 1.0 (V4 uses 2.0); we call its kernels
with our own ``out`` buffers and V4's multiplier, and return ``(layer_input, post, comb)``.
"""

from __future__ import annotations

from typing import Literal

import torch

from dsv4mtp.reference.checks import check_ndim, check_shape
from dsv4mtp.reference.errors import InputError

from .kernels._launch import (
    check_device,
    check_kernel_dtype,
    check_out,
    flashinfer_mhc,
)
from .kernels.mhc_collapse import mhc_collapse
from .kernels.mhc_mix import mhc_mix_splitk, mix_num_splits
from .kernels.mhc_post import mhc_post_triton

__all__ = ["PRE_AUTO_BACKEND", "hc_head", "hc_post", "hc_pre"]

PreBackend = Literal["auto", "triton", "triton_two_pass", "flashinfer", "flashinfer_prenorm"]
PostBackend = Literal["auto", "flashinfer", "triton"]
HeadBackend = Literal["auto", "triton", "triton_two_pass"]

# What "auto" runs for n = 4 bf16 on CUDA (see bench/results/mhc-h200.md for the measurement).
PRE_AUTO_BACKEND: PreBackend = "flashinfer"

_FI_HC = 4  # FlashInfer's mHC kernels are compiled for 4 streams only


def _check_streams(x: torch.Tensor) -> tuple[int, int, int]:
    check_kernel_dtype("x", x)
    check_ndim("x", x, 3)
    T, n, D = x.shape
    return T, n, D


def _check_params(
    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rows: int, nD: int, n_scales: int
) -> None:
    for name, t in (("fn", fn), ("scale", scale), ("base", base)):
        check_kernel_dtype(name, t)
    check_shape("fn", fn, (rows, nD))
    check_shape("scale", scale, (n_scales,))
    check_shape("base", base, (rows,))


def _fi_mhc_ok(x: torch.Tensor, n: int, D: int, *eps: float) -> bool:
    # FlashInfer: bf16 residual, 4 streams, H % 8 == 0, strictly positive eps.
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and n == _FI_HC
        and D % 8 == 0
        and all(e > 0 for e in eps)
        and flashinfer_mhc() is not None
    )


# ----------------------------------------------------------------------------------- hc_pre
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
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    backend: PreBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse n streams into the sublayer input; returns ``(layer_input, post, comb)``.

    x: (T, n, D) bf16 / fp32; fn: (M, n*D), M = (2+n)*n; scale: (3,); base: (M,).
    layer_input (T, D) in x.dtype; post (T, n) and comb (T, n, n) in fp32.  ``out`` is a
    3-tuple of contiguous tensors of exactly those shapes and dtypes, written in place.
    """
    T, n, D = _check_streams(x)
    M = (2 + n) * n
    _check_params(fn, scale, base, M, n * D, 3)
    if sinkhorn_iters < 1:
        raise InputError(f"sinkhorn_iters: expected >= 1, got {sinkhorn_iters}")
    dev = check_device([("x", x), ("fn", fn), ("scale", scale), ("base", base)])
    shapes = (((T, D), x.dtype), ((T, n), torch.float32), ((T, n, n), torch.float32))
    if out is None:
        li, post, comb = (torch.empty(s, dtype=dt, device=dev) for s, dt in shapes)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise InputError("out: expected a 3-tuple (layer_input, post, comb)")
        li, post, comb = (
            check_out(f"out[{i}]", o, s, dt, dev)
            for i, (o, (s, dt)) in enumerate(zip(out, shapes, strict=True))
        )
    if T == 0:
        return li, post, comb

    fi_ok = _fi_mhc_ok(x, n, D, rms_norm_eps, hc_eps)
    choice = backend
    if backend == "auto":
        choice = PRE_AUTO_BACKEND if fi_ok else "triton"
    if choice in ("flashinfer", "flashinfer_prenorm") and not fi_ok:
        raise InputError(
            f"backend: {choice!r} needs bf16 x with n = 4 on CUDA, positive eps and an "
            "importable flashinfer"
        )
    if choice not in ("triton", "triton_two_pass", "flashinfer", "flashinfer_prenorm"):
        raise InputError(f"backend: unknown hc_pre backend {backend!r}")

    x = x.contiguous()
    fn = fn.contiguous()
    scale32 = scale.to(torch.float32).contiguous()
    base32 = base.to(torch.float32).contiguous()
    if choice.startswith("triton"):
        mhc_collapse(
            x,
            fn,
            scale32,
            base32,
            li,
            rms_norm_eps=rms_norm_eps,
            hc_eps=hc_eps,
            post=post,
            comb=comb,
            post_mult=post_mult,
            sinkhorn_iters=sinkhorn_iters,
            single_pass=(choice == "triton"),
        )
        return li, post, comb

    fi = flashinfer_mhc()
    assert fi is not None
    module = fi.get_mhc_module()
    K = n * D
    if choice == "flashinfer":
        S = mix_num_splits(K)
        mix, sq = mhc_mix_splitk(x.view(T, K), fn, S)
        if S == 1:
            mix, sq = mix[0], sq[0]
        module.mhc_pre_big_fuse(
            post, comb, li, mix, sq, x, scale32, base32, K,
            float(rms_norm_eps), float(hc_eps), float(hc_eps), float(post_mult),
            int(sinkhorn_iters), S, 0,
        )  # fmt: skip
    else:
        mix, _ = mhc_mix_splitk(x.view(T, K), fn, 1)
        module.mhc_pre_big_fuse_with_prenorm(
            post, comb, li, mix[0], x, scale32, base32,
            float(rms_norm_eps), float(hc_eps), float(hc_eps), float(post_mult),
            int(sinkhorn_iters), 0,
        )  # fmt: skip
    return li, post, comb


# ----------------------------------------------------------------------------------- hc_post
def hc_post(
    f: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: PostBackend = "auto",
) -> torch.Tensor:
    """``out[:, k] = post[:, k] * f + sum_j comb[:, j, k] * residual[:, j]`` in residual.dtype.

    f: (T, D); residual: (T, n, D); post: (T, n); comb: (T, n, n) [source j, destination k].
    """
    check_kernel_dtype("residual", residual)
    check_ndim("residual", residual, 3)
    T, n, D = residual.shape
    for name, t in (("f", f), ("post", post), ("comb", comb)):
        check_kernel_dtype(name, t)
    check_shape("f", f, (T, D))
    check_shape("post", post, (T, n))
    check_shape("comb", comb, (T, n, n))
    if backend not in ("auto", "flashinfer", "triton"):
        raise InputError(f"backend: expected 'auto', 'flashinfer' or 'triton', got {backend!r}")
    dev = check_device([("residual", residual), ("f", f), ("post", post), ("comb", comb)])
    if out is None:
        out = torch.empty((T, n, D), dtype=residual.dtype, device=dev)
    else:
        check_out("out", out, (T, n, D), residual.dtype, dev)
    if T == 0:
        return out
    f = f.contiguous()
    residual = residual.contiguous()
    post32 = post.to(torch.float32).contiguous()
    comb32 = comb.to(torch.float32).contiguous()
    fi_ok = _fi_mhc_ok(residual, n, D) and f.dtype == torch.bfloat16
    if backend == "flashinfer" and not fi_ok:
        raise InputError("backend: 'flashinfer' needs bf16 f and residual with n = 4 on CUDA")
    if fi_ok and backend != "triton":
        fi = flashinfer_mhc()
        assert fi is not None
        fi.get_mhc_module().mhc_post(out, f, residual, post32, comb32)
        return out
    return mhc_post_triton(f, residual, post32, comb32, out)


# ----------------------------------------------------------------------------------- hc_head
def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    out: torch.Tensor | None = None,
    backend: HeadBackend = "auto",
) -> torch.Tensor:
    """Collapse the n streams before the LM head: (T, n, D) -> (T, D) in x.dtype.

    fn: (n, n*D); scale: (1,); base: (n,).  One Triton kernel reads each residual byte once.
    """
    T, n, D = _check_streams(x)
    _check_params(fn, scale, base, n, n * D, 1)
    if backend not in ("auto", "triton", "triton_two_pass"):
        raise InputError(
            f"backend: expected 'auto', 'triton' or 'triton_two_pass', got {backend!r}"
        )
    dev = check_device([("x", x), ("fn", fn), ("scale", scale), ("base", base)])
    if out is None:
        out = torch.empty((T, D), dtype=x.dtype, device=dev)
    else:
        check_out("out", out, (T, D), x.dtype, dev)
    if T == 0:
        return out
    mhc_collapse(
        x.contiguous(),
        fn.contiguous(),
        scale.to(torch.float32).contiguous(),
        base.to(torch.float32).contiguous(),
        out,
        rms_norm_eps=rms_norm_eps,
        hc_eps=hc_eps,
        single_pass=(backend != "triton_two_pass"),
    )
    return out
