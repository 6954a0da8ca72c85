"""mHC (``hc_pre``, ``hc_post``) and ``hc_head`` on the H200.

Same signatures as :mod:`dsv4mtp.reference.mhc` plus keyword-only ``out``, ``backend`` and
(hc_pre / hc_head) ``schedule``.

Kernels.  The Triton collapse (kernels/mhc_collapse.py) serves hc_pre and, at large T,
hc_head: each program streams its piece of the residual once from HBM into a split-K mix on
bf16 tensor cores (fn split into two bf16 terms), the programs of each token block meet at a
barrier and each turns its share of the partials into gates, and after a second barrier every
program re-reads its piece (from L2, where it still is) to write the weighted sum.
hc_pre can instead feed FlashInfer's consumer from a split-K mix producer (kernels/mhc_mix.py).
hc_head has a latency-first kernel for the small T at which MTP calls it (kernels/mhc_head.py).
Backends (``backend="auto"`` picks the first that applies; every choice depends on dtype, n and
D only, never on T, so a token's result does not depend on its batch):

* ``hc_pre``  - n = 4, bf16, CUDA: ``PRE_AUTO_BACKEND`` (picked by measurement on the H200,
  bench/results/): the Triton collapse, or the mix producer feeding FlashInfer's
  ``mhc_pre_big_fuse`` (Sinkhorn + pre-weighted sum).  Otherwise the Triton collapse.
* ``hc_post`` - n = 4, bf16 f and residual, CUDA: FlashInfer ``mhc_post``; otherwise Triton.
* ``hc_head`` - ``HEAD_AUTO_BACKEND``: the small-batch one-pass FMA kernel (kernels/mhc_head.py)
  or the Triton collapse (no FlashInfer kernel exists for it on sm_90).

FlashInfer conventions handled here: its pre kernel returns ``(post (..., 4, 1), comb,
layer_input)`` and defaults ``mhc_post_mult_value`` to 1.0 (V4 uses 2.0); we call its kernels
with our own ``out`` buffers and V4's multiplier, and return ``(layer_input, post, comb)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch

from dsv4mtp.checks import check_eps, check_instance, check_ndim, check_shape
from dsv4mtp.errors import InputError

from ._dispatch import TABLES, Facts, select
from .kernels._launch import (
    check_device,
    check_kernel_dtype,
    check_out,
    flashinfer_mhc,
    triton_kernel,
)

if TYPE_CHECKING:
    from .kernels.mhc_collapse import CollapseConfig, mhc_collapse
    from .kernels.mhc_head import mhc_head_fma
    from .kernels.mhc_mix import MixConfig, mhc_mix_splitk, mix_config
    from .kernels.mhc_post import mhc_post_triton
else:
    # Imported on first use: triton is optional (the `gpu` extra), `import dsv4mtp.optimized`
    # works without it, and a call that needs it says what to install.
    mhc_collapse = triton_kernel("mhc_collapse", "mhc_collapse")
    mhc_head_fma = triton_kernel("mhc_head", "mhc_head_fma")
    mhc_mix_splitk = triton_kernel("mhc_mix", "mhc_mix_splitk")
    mix_config = triton_kernel("mhc_mix", "mix_config")
    mhc_post_triton = triton_kernel("mhc_post", "mhc_post_triton")

__all__ = [
    "HEAD_AUTO_BACKEND",
    "PRE_AUTO_BACKEND",
    "CollapseSchedule",
    "hc_head",
    "hc_post",
    "hc_pre",
]

PreBackend = Literal["auto", "triton", "flashinfer", "flashinfer_prenorm"]
PostBackend = Literal["auto", "flashinfer", "triton"]
HeadBackend = Literal["auto", "triton_fma", "triton_mma"]

# What "auto" runs; the measurements behind each order are with the tables in _dispatch.py.
PRE_AUTO_BACKEND: PreBackend = TABLES["hc_pre"].auto[0]  # type: ignore[assignment]
HEAD_AUTO_BACKEND: HeadBackend = TABLES["hc_head"].auto[0]  # type: ignore[assignment]


@dataclass(frozen=True)
class CollapseSchedule:
    """Override of the kernel schedule of hc_pre / hc_head (for tile sweeps and tests).

    ``collapse`` drives the Triton path (kernels/mhc_collapse.py), ``mix`` the producer in
    front of FlashInfer's consumers (kernels/mhc_mix.py); ``None`` takes the measured
    defaults.  Every schedule computes the same function; bits may differ between schedules
    whose K splits differ, never between batches under one schedule.
    """

    collapse: CollapseConfig | None = None
    mix: MixConfig | None = None


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


def _collapse(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale32: torch.Tensor,
    base32: torch.Tensor,
    out: torch.Tensor,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    *,
    rms_norm_eps: float,
    hc_eps: float,
    post_mult: float,
    sinkhorn_iters: int,
    consumer: str,
    schedule: CollapseSchedule | None,
) -> None:
    """Run one backend on validated, contiguous inputs (T > 0).

    "triton": the one-pass collapse kernel.  "flashinfer" / "flashinfer_prenorm": the split-K
    mix producer, then FlashInfer's ``mhc_pre_big_fuse`` (S partials and square sums) or
    ``mhc_pre_big_fuse_with_prenorm`` (one K split; it computes the square sum itself).
    """
    sched = schedule or CollapseSchedule()
    if consumer == "triton":
        mhc_collapse(
            x, fn, scale32, base32, out,
            rms_norm_eps=rms_norm_eps, hc_eps=hc_eps, post=post, comb=comb,
            post_mult=post_mult, sinkhorn_iters=sinkhorn_iters, cfg=sched.collapse,
        )  # fmt: skip
        return
    assert post is not None and comb is not None
    T = x.shape[0]
    M, K = fn.shape
    mcfg = sched.mix or mix_config(M, K)
    if consumer == "flashinfer_prenorm":
        mcfg = replace(mcfg, num_splits=1)
    S = mcfg.num_splits
    mix, sq = mhc_mix_splitk(x.view(T, K), fn, mcfg)
    fi = flashinfer_mhc()
    assert fi is not None
    module = fi.get_mhc_module()
    scalars = (float(rms_norm_eps), float(hc_eps), float(hc_eps), float(post_mult))
    if consumer == "flashinfer":
        module.mhc_pre_big_fuse(
            post, comb, out, mix[0] if S == 1 else mix, sq[0] if S == 1 else sq, x,
            scale32, base32, K, *scalars, int(sinkhorn_iters), S, 0,
        )  # fmt: skip
    else:
        module.mhc_pre_big_fuse_with_prenorm(
            post, comb, out, mix[0], x, scale32, base32, *scalars, int(sinkhorn_iters), 0
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
    batch_invariant: bool = False,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    backend: PreBackend = "auto",
    schedule: CollapseSchedule | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse n streams into the sublayer input; returns ``(layer_input, post, comb)``.

    x: (T, n, D) bf16 / fp32; fn: (M, n*D), M = (2+n)*n; scale: (3,); base: (M,).
    layer_input (T, D) in x.dtype; post (T, n) and comb (T, n, n) in fp32.  ``out`` is a
    3-tuple of contiguous tensors of exactly those shapes and dtypes, written in place.
    backend: "triton" (the one-pass collapse kernel), "flashinfer" (split-K mix producer +
    FlashInfer ``mhc_pre_big_fuse``), "flashinfer_prenorm" (producer with one split +
    ``mhc_pre_big_fuse_with_prenorm``), or "auto" (``PRE_AUTO_BACKEND`` where FlashInfer
    applies, else "triton").
    ``batch_invariant=True`` pins a schedule that does not depend on T; "auto" picks by dtype,
    n and D only, so the default is batch invariant too.
    """
    check_instance("batch_invariant", batch_invariant, bool)
    T, n, D = _check_streams(x)
    M = (2 + n) * n
    _check_params(fn, scale, base, M, n * D, 3)
    if (
        isinstance(sinkhorn_iters, bool)
        or not isinstance(sinkhorn_iters, int)
        or sinkhorn_iters < 1
    ):
        raise InputError(f"sinkhorn_iters: expected an int >= 1, got {sinkhorn_iters!r}")
    check_eps("rms_norm_eps", rms_norm_eps)
    check_eps("hc_eps", hc_eps)
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
    facts = Facts(dev, (x.dtype,), n=n, D=D, eps=(rms_norm_eps, hc_eps))
    choice = select("hc_pre", backend, facts)
    if T == 0:
        return li, post, comb
    _collapse(
        x.contiguous(), fn.contiguous(), scale.to(torch.float32).contiguous(),
        base.to(torch.float32).contiguous(), li, post, comb,
        rms_norm_eps=rms_norm_eps, hc_eps=hc_eps, post_mult=post_mult,
        sinkhorn_iters=sinkhorn_iters, consumer=choice, schedule=schedule,
    )  # fmt: skip
    return li, post, comb


# ----------------------------------------------------------------------------------- hc_post
def hc_post(
    f: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: PostBackend = "auto",
) -> torch.Tensor:
    """``out[:, k] = post[:, k] * f + sum_j comb[:, j, k] * residual[:, j]`` in residual.dtype.

    f: (T, D); residual: (T, n, D); post: (T, n); comb: (T, n, n) [source j, destination k].
    ``batch_invariant=True`` pins a schedule that does not depend on T; both backends compute
    each token on its own, so the default is batch invariant too.
    """
    check_instance("batch_invariant", batch_invariant, bool)
    check_kernel_dtype("residual", residual)
    check_ndim("residual", residual, 3)
    T, n, D = residual.shape
    for name, t in (("f", f), ("post", post), ("comb", comb)):
        check_kernel_dtype(name, t)
    check_shape("f", f, (T, D))
    check_shape("post", post, (T, n))
    check_shape("comb", comb, (T, n, n))
    dev = check_device([("residual", residual), ("f", f), ("post", post), ("comb", comb)])
    choice = select("hc_post", backend, Facts(dev, (f.dtype, residual.dtype), n=n, D=D))
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
    if choice == "flashinfer":
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
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: HeadBackend = "auto",
    schedule: CollapseSchedule | None = None,
) -> torch.Tensor:
    """Collapse the n streams before the LM head: (T, n, D) -> (T, D) in x.dtype.

    fn: (n, n*D); scale: (1,); base: (n,).  No FlashInfer kernel exists for it on sm_90.
    backend: "triton_fma" (kernels/mhc_head.py: one memory round trip per 4-token tile, fp32
    FMA mix; the fastest at T <= 64, where MTP calls it), "triton_mma" (the tensor-core
    collapse, kernels/mhc_collapse.py: faster at T >= 512), or "auto" = "triton_fma".
    ``schedule`` tunes "triton_mma" only.  ``batch_invariant=True`` pins a schedule that does
    not depend on T (the default may pick the backend by T, see ``_dispatch``).
    """
    check_instance("batch_invariant", batch_invariant, bool)
    T, n, D = _check_streams(x)
    _check_params(fn, scale, base, n, n * D, 1)
    check_eps("rms_norm_eps", rms_norm_eps)
    check_eps("hc_eps", hc_eps)
    dev = check_device([("x", x), ("fn", fn), ("scale", scale), ("base", base)])
    choice = select(
        "hc_head", backend, Facts(dev, (x.dtype,), n=n, D=D, eps=(rms_norm_eps, hc_eps))
    )
    if schedule is not None and choice != "triton_mma":
        raise InputError(f"schedule: only the 'triton_mma' backend takes one, not {choice!r}")
    if out is None:
        out = torch.empty((T, D), dtype=x.dtype, device=dev)
    else:
        check_out("out", out, (T, D), x.dtype, dev)
    if T == 0:
        return out
    args = (
        x.contiguous(), fn.contiguous(), scale.to(torch.float32).contiguous(),
        base.to(torch.float32).contiguous(), out,
    )  # fmt: skip
    if choice == "triton_fma":
        mhc_head_fma(*args, rms_norm_eps=rms_norm_eps, hc_eps=hc_eps)
        return out
    _collapse(
        *args, None, None,
        rms_norm_eps=rms_norm_eps, hc_eps=hc_eps, post_mult=1.0, sinkhorn_iters=1,
        consumer="triton", schedule=schedule,
    )  # fmt: skip
    return out
