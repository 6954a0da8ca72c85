"""mHC (``hc_pre``, ``hc_post``) and ``hc_head`` on the H200.

Same signatures as :mod:`dsv4mtp.reference.mhc` plus keyword-only ``out``, ``backend`` and
(hc_pre / hc_head) ``schedule``.

Kernels.  The Triton collapse (kernels/mhc_collapse.py) serves hc_pre and, at large T,
hc_head: each piece of the residual is streamed once from HBM into a split-K mix on bf16
tensor cores (fn split into two bf16 terms); once a token block's partials are all written,
programs turn shares of them into gates, and once the gates are written, pieces are re-read
(from L2, where they still are) to write the weighted sum.  All in one launch, whose programs
only ever wait on programs that have already started (kernels/_sync.py), so no wait depends on
how much of the GPU other work leaves free.
hc_pre can instead feed FlashInfer's consumer from a split-K mix producer (kernels/mhc_mix.py).
hc_pre and hc_head each have a latency-first kernel for the small T at which MTP calls them
(kernels/mhc_pre_small.py, kernels/mhc_head.py).
Each public function validates its arguments, chooses the backend (optimized/_dispatch.py) and
calls the operator ``torch.ops.dsv4mtp.<op>`` (or ``<op>_out`` when given ``out``;
optimized/_ops.py), which runs it.  Backends (``backend="auto"`` picks the first that applies
by dtype, n and D; hc_pre's and hc_head's defaults may also pick by T, see
``_dispatch.PRE_FMA_MAX_T`` and ``_dispatch.HEAD_MMA_MIN_T``, and ``batch_invariant=True`` keeps
every choice independent of T, so a token's result does not depend on its batch):

* ``hc_pre``  - ``PRE_AUTO_BACKEND``: the small-batch FMA kernel (kernels/mhc_pre_small.py) up
  to ``PRE_FMA_MAX_T`` tokens and under ``batch_invariant=True``; the Triton collapse above it.
  The mix producer feeding FlashInfer's ``mhc_pre_big_fuse`` (Sinkhorn + pre-weighted sum) is
  an explicit choice (n = 4, bf16, CUDA): the collapse beat it at every measured T.
* ``hc_post`` - n = 4, bf16 f and residual, CUDA: FlashInfer ``mhc_post``; otherwise Triton.
* ``hc_head`` - ``HEAD_AUTO_BACKEND``: the small-batch FMA kernel (kernels/mhc_head.py)
  or the Triton collapse (no FlashInfer kernel exists for it on sm_90).
* ``hc_post_pre`` / ``hc_post_head`` - hc_post followed by hc_pre / hc_head, fused where it
  pays: "triton_fma" folds hc_post into the mix launch of the small-batch kernel wherever
  hc_pre's / hc_head's "auto" would run that kernel; "composed" (the two operators) elsewhere.

The trailing norm.  hc_pre, hc_head and the fused pairs take the next RMSNorm's weight:
``norm_weight`` (D,) bf16 / fp32, or None; their first collapsed output (layer_input /
head_input) is then ``rms_norm(rows, norm_weight, rms_norm_eps, order=norm_order)`` instead of
the rows (V4 uses one eps for both; the MTP layer passes attn_norm, ffn_norm and the head's
norm).  Where the small-batch FMA kernels run ("triton_fma") the norm is part of their second
launch: one program per token writes its whole collapsed row and normalizes it in place,
bitwise the collapse followed by the Triton ``rms_norm`` kernel at 4 warps (``rms_norm``'s own
default at D 4096 / 7168 is 8 / 16 warps, whose reduction tree can differ by an ulp); one launch
and one read of the rows fewer (``_ops.FUSE_NORM`` runs it as two launches, the A/B setting).
Other backends run ``rms_norm``'s kernel after theirs.

FlashInfer conventions handled here: its pre kernel returns ``(post (..., 4, 1), comb,
layer_input)`` and defaults ``mhc_post_mult_value`` to 1.0 (V4 uses 2.0); we call its kernels
with our own ``out`` buffers and V4's multiplier, and return ``(layer_input, post, comb)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from dsv4mtp.checks import check_eps, check_instance, check_ndim, check_shape
from dsv4mtp.errors import InputError
from dsv4mtp.semantics import NormOrder

from . import _ops
from ._dispatch import TABLES, Facts, planned, select, signature
from .kernels._launch import check_device, check_kernel_dtype, check_out

if TYPE_CHECKING:
    from .kernels.mhc_collapse import CollapseConfig
    from .kernels.mhc_mix import MixConfig

__all__ = [
    "HEAD_AUTO_BACKEND",
    "PRE_AUTO_BACKEND",
    "CollapseSchedule",
    "hc_head",
    "hc_post",
    "hc_post_head",
    "hc_post_pre",
    "hc_pre",
]

PreBackend = Literal["auto", "triton", "triton_fma", "flashinfer", "flashinfer_prenorm"]
PostBackend = Literal["auto", "flashinfer", "triton"]
HeadBackend = Literal["auto", "triton_fma", "triton_mma"]
PostPreBackend = Literal["auto", "triton_fma", "composed"]
PostHeadBackend = Literal["auto", "triton_fma", "composed"]

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


def _schedule(schedule: CollapseSchedule | None) -> tuple[Sequence[int], Sequence[int]]:
    if schedule is None:
        return _ops.NO_SCHEDULE, _ops.NO_SCHEDULE
    check_instance("schedule", schedule, CollapseSchedule)
    return _ops.schedule_fields(schedule.collapse, schedule.mix)


# The operators (optimized/_ops.py), looked up once: the public functions validate and choose the
# backend, the operators run it.
_ops_hc_pre = torch.ops.dsv4mtp.hc_pre.default
_ops_hc_pre_out = torch.ops.dsv4mtp.hc_pre_out.default
_ops_hc_post = torch.ops.dsv4mtp.hc_post.default
_ops_hc_post_out = torch.ops.dsv4mtp.hc_post_out.default
_ops_hc_head = torch.ops.dsv4mtp.hc_head.default
_ops_hc_head_out = torch.ops.dsv4mtp.hc_head_out.default
_ops_hc_post_pre = torch.ops.dsv4mtp.hc_post_pre.default
_ops_hc_post_pre_out = torch.ops.dsv4mtp.hc_post_pre_out.default
_ops_hc_post_head = torch.ops.dsv4mtp.hc_post_head.default
_ops_hc_post_head_out = torch.ops.dsv4mtp.hc_post_head_out.default


def _check_streams(x: torch.Tensor) -> tuple[int, int, int]:
    check_kernel_dtype("x", x)
    check_ndim("x", x, 3)
    T, n, D = x.shape
    return T, n, D


def _check_params(
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rows: int,
    nD: int,
    n_scales: int,
    prefix: str = "",
) -> None:
    """fn (rows, nD), scale (n_scales,), base (rows,), named ``prefix + name``."""
    for name, t in (("fn", fn), ("scale", scale), ("base", base)):
        check_kernel_dtype(prefix + name, t)
    check_shape(prefix + "fn", fn, (rows, nD))
    check_shape(prefix + "scale", scale, (n_scales,))
    check_shape(prefix + "base", base, (rows,))


def _check_norm(norm_weight: torch.Tensor | None, norm_order: str, x: torch.Tensor) -> None:
    """The trailing RMSNorm's weight (D,) in a kernel dtype on x's device, or None; its
    order."""
    if norm_order not in ("official", "vllm"):
        raise InputError(f"norm_order: expected 'official' or 'vllm', got {norm_order!r}")
    if norm_weight is None:
        return
    check_kernel_dtype("norm_weight", norm_weight)
    check_shape("norm_weight", norm_weight, (x.shape[-1],))
    check_device([("x", x), ("norm_weight", norm_weight)])


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
    norm_weight: torch.Tensor | None = None,
    norm_order: NormOrder = "official",
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    backend: PreBackend = "auto",
    schedule: CollapseSchedule | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse n streams into the sublayer input; returns ``(layer_input, post, comb)``.

    x: (T, n, D) bf16 / fp32; fn: (M, n*D), M = (2+n)*n; scale: (3,); base: (M,).
    layer_input (T, D) in x.dtype; post (T, n) and comb (T, n, n) in fp32.  ``out`` is a
    3-tuple of contiguous tensors of exactly those shapes and dtypes, written in place.
    backend: "triton" (the one-pass collapse kernel), "triton_fma" (kernels/mhc_pre_small.py:
    fp32 FMA mix spread over a few hundred programs, then the Sinkhorn and the weighted sum in a
    second launch; built for the T <= 64 of MTP's draft step), "flashinfer" (split-K mix
    producer + FlashInfer ``mhc_pre_big_fuse``), "flashinfer_prenorm" (producer with one split +
    ``mhc_pre_big_fuse_with_prenorm``), or "auto".
    ``schedule`` tunes "triton" and the FlashInfer backends; "triton_fma" refuses one.  With
    ``batch_invariant=False`` (the default) "auto" runs "triton_fma" up to
    ``_dispatch.PRE_FMA_MAX_T`` (64) tokens and "triton" above, and "triton_fma" mixes a call of
    fewer than 16 tokens on a token block that fits it (kernels/mhc_pre_small.py,
    ``pre_fma_config``); ``batch_invariant=True`` keeps "auto" on "triton_fma" at every T, on
    its T-independent 16-token block.  ``norm_weight``, ``norm_order``: the trailing norm
    (module docstring); layer_input is then the normalized rows.
    """
    # The plan of this call signature (optimized/_dispatch.py, "plans"): the checks run once
    # per signature.  While torch.compile traces, they run every time and become its guards.
    plan = planned(
        signature(
            "hc_pre", x, fn, scale, base, rms_norm_eps, hc_eps, sinkhorn_iters, post_mult,
            batch_invariant, norm_weight, norm_order, backend, schedule, out=out,
        ),
        lambda: _hc_pre_plan(
            x, fn, scale, base, rms_norm_eps, hc_eps, sinkhorn_iters, batch_invariant, out,
            backend, schedule, norm_weight, norm_order,
        ),
    )  # fmt: skip
    choice, collapse, mix = plan
    args = (
        x, fn, scale, base, float(rms_norm_eps), float(hc_eps), sinkhorn_iters, float(post_mult),
        choice, collapse, mix, batch_invariant, norm_weight, norm_order,
    )  # fmt: skip
    if out is None:
        return _ops_hc_pre(*args)  # type: ignore[no-any-return]
    li, post, comb = out
    _ops_hc_pre_out(*args, layer_input=li, post=post, comb=comb)
    return li, post, comb


def _hc_pre_plan(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    backend: str,
    schedule: CollapseSchedule | None,
    norm_weight: torch.Tensor | None = None,
    norm_order: str = "official",
) -> tuple[str, Sequence[int], Sequence[int]]:
    """Every check of hc_pre's arguments, then the backend choice (which may read T): (backend,
    schedule fields)."""
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
    _check_norm(norm_weight, norm_order, x)
    shapes = (((T, D), x.dtype), ((T, n), torch.float32), ((T, n, n), torch.float32))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise InputError("out: expected a 3-tuple (layer_input, post, comb)")
        for i, (o, (s, dt)) in enumerate(zip(out, shapes, strict=True)):
            check_out(f"out[{i}]", o, s, dt, dev)
    facts = Facts(
        dev, (x.dtype,), n=n, D=D, eps=(rms_norm_eps, hc_eps), T=None if batch_invariant else T
    )
    choice = select("hc_pre", backend, facts)
    if schedule is not None and choice == "triton_fma":
        raise InputError("schedule: the 'triton_fma' backend takes none; pass backend='triton'")
    collapse, mix = _schedule(schedule)
    return choice, collapse, mix


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
    # The plan of this call signature (optimized/_dispatch.py, "plans"): the checks run once
    # per signature.  While torch.compile traces, they run every time and become its guards.
    plan = planned(
        signature("hc_post", f, residual, post, comb, batch_invariant, backend, out=out),
        lambda: _hc_post_plan(f, residual, post, comb, batch_invariant, out, backend),
    )
    (choice,) = plan
    if out is None:
        return _ops_hc_post(f, residual, post, comb, choice)  # type: ignore[no-any-return]
    _ops_hc_post_out(f, residual, post, comb, choice, out=out)
    return out


def _hc_post_plan(
    f: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
) -> tuple[str]:
    """Every check of hc_post's arguments, then the backend choice."""
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
    if out is not None:
        check_out("out", out, (T, n, D), residual.dtype, dev)
    return (choice,)


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
    norm_weight: torch.Tensor | None = None,
    norm_order: NormOrder = "official",
    out: torch.Tensor | None = None,
    backend: HeadBackend = "auto",
    schedule: CollapseSchedule | None = None,
) -> torch.Tensor:
    """Collapse the n streams before the LM head: (T, n, D) -> (T, D) in x.dtype.

    fn: (n, n*D); scale: (1,); base: (n,).  No FlashInfer kernel exists for it on sm_90.
    backend: "triton_fma" (kernels/mhc_head.py: one memory round trip per 4-token tile, fp32
    FMA mix; the fastest at T <= 64, where MTP calls it), "triton_mma" (the tensor-core
    collapse, kernels/mhc_collapse.py: faster at T >= 512), or "auto".
    ``schedule`` tunes "triton_mma" only.  With ``batch_invariant=False`` (the default) "auto"
    runs "triton_mma" from ``_dispatch.HEAD_MMA_MIN_T`` (512) tokens on;
    ``batch_invariant=True`` keeps "auto" on "triton_fma" at every T.  ``norm_weight``,
    ``norm_order``: the trailing norm (module docstring).
    """
    # The plan of this call signature (optimized/_dispatch.py, "plans"): the checks run once
    # per signature.  While torch.compile traces, they run every time and become its guards.
    plan = planned(
        signature(
            "hc_head", x, fn, scale, base, rms_norm_eps, hc_eps, batch_invariant, norm_weight,
            norm_order, backend, schedule, out=out,
        ),
        lambda: _hc_head_plan(
            x, fn, scale, base, rms_norm_eps, hc_eps, batch_invariant, out, backend, schedule,
            norm_weight, norm_order,
        ),
    )  # fmt: skip
    choice, collapse = plan
    args = (
        x, fn, scale, base, float(rms_norm_eps), float(hc_eps), choice, collapse, norm_weight,
        norm_order,
    )  # fmt: skip
    if out is None:
        return _ops_hc_head(*args)  # type: ignore[no-any-return]
    _ops_hc_head_out(*args, out=out)
    return out


def _hc_head_plan(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
    schedule: CollapseSchedule | None,
    norm_weight: torch.Tensor | None = None,
    norm_order: str = "official",
) -> tuple[str, Sequence[int]]:
    """Every check of hc_head's arguments, then the backend choice (which may read T)."""
    check_instance("batch_invariant", batch_invariant, bool)
    T, n, D = _check_streams(x)
    _check_params(fn, scale, base, n, n * D, 1)
    check_eps("rms_norm_eps", rms_norm_eps)
    check_eps("hc_eps", hc_eps)
    dev = check_device([("x", x), ("fn", fn), ("scale", scale), ("base", base)])
    _check_norm(norm_weight, norm_order, x)
    facts = Facts(
        dev, (x.dtype,), n=n, D=D, eps=(rms_norm_eps, hc_eps), T=None if batch_invariant else T
    )
    choice = select("hc_head", backend, facts)
    if schedule is not None and choice != "triton_mma":
        raise InputError(f"schedule: only the 'triton_mma' backend takes one, not {choice!r}")
    collapse, _ = _schedule(schedule)
    if out is not None:
        check_out("out", out, (T, D), x.dtype, dev)
    return choice, collapse


# ---------------------------------------------------------------------- fused: hc_post_pre
def _check_post_args(
    f_name: str, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[int, int, int]:
    """The hc_post half of a fused pair: x (T, n, D) the streams, ``f_name`` (T, D) the
    sublayer output, post (T, n), comb (T, n, n), kernel dtypes -> (T, n, D)."""
    T, n, D = _check_streams(x)
    for name, t in ((f_name, f), ("post", post), ("comb", comb)):
        check_kernel_dtype(name, t)
    check_shape(f_name, f, (T, D))
    check_shape("post", post, (T, n))
    check_shape("comb", comb, (T, n, n))
    return T, n, D


def _check_outs(out: Any, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]], what: str,
                dev: torch.device) -> None:  # fmt: skip
    if not isinstance(out, (tuple, list)) or len(out) != len(shapes):
        raise InputError(f"out: expected a {len(shapes)}-tuple ({what})")
    for i, (o, (s, dt)) in enumerate(zip(out, shapes, strict=True)):
        check_out(f"out[{i}]", o, s, dt, dev)


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
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    backend: PostPreBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_post of one sublayer, then hc_pre of the next: ``(x_new, layer_input, post_new,
    comb_new)`` with ``x_new = hc_post(a, x, post, comb)`` and ``(layer_input, post_new,
    comb_new) = hc_pre(x_new, fn, scale, base, ...)``.

    a: (T, D) the sublayer output; x: (T, n, D) the streams that entered its hc_pre; post (T, n),
    comb (T, n, n) its gates; fn (M, n*D), M = (2+n)*n; scale (3,); base (M,).  x_new (T, n, D)
    in x.dtype, layer_input (T, D) in x.dtype, post_new (T, n) and comb_new (T, n, n) fp32.
    ``out``: a 4-tuple of contiguous tensors of exactly those shapes and dtypes (out[0] must not
    overlap x).
    Fused where it pays: backend "triton_fma" runs hc_post inside the mix launch of hc_pre's
    small-batch kernel (kernels/mhc_pre_small.py, ``mhc_post_pre_fma``): each mix program forms
    its tile of x_new from a, x, post and comb, the first row group stores it, and the mix reads
    it from registers; two launches instead of three, and x_new is not read back for the mix.
    Its bits are hc_post's Triton kernel (the op order of FlashInfer's ``mhc_post`` too)
    followed by hc_pre's "triton_fma".  "composed" calls the hc_post and hc_pre operators, each
    with its own "auto" choice.  "auto": "triton_fma" where hc_pre's "auto" would run
    "triton_fma" (T <= ``_dispatch.PRE_FMA_MAX_T``, and at every T under
    ``batch_invariant=True``), "composed" above.
    Bytes (fused): a (T*D) and x (T*n*D) read once from HBM, x_new (T*n*D) written once and
    re-read from L2 by the weighted sum, fn (M*n*D*4) once per 16-token block, layer_input /
    post_new / comb_new written once (with ``norm_weight``, layer_input re-read and rewritten
    in place from L1 / L2, the weight read once per token).  ``norm_weight``, ``norm_order``:
    the trailing norm (module docstring).
    """
    plan = planned(
        signature(
            "hc_post_pre", a, x, post, comb, fn, scale, base, rms_norm_eps, hc_eps,
            sinkhorn_iters, post_mult, batch_invariant, norm_weight, norm_order, backend, out=out,
        ),
        lambda: _hc_post_pre_plan(
            a, x, post, comb, fn, scale, base, rms_norm_eps, hc_eps, sinkhorn_iters,
            batch_invariant, out, backend, norm_weight, norm_order,
        ),
    )  # fmt: skip
    choice, post_choice, pre_choice = plan
    args = (
        a, x, post, comb, fn, scale, base, float(rms_norm_eps), float(hc_eps), sinkhorn_iters,
        float(post_mult), choice, post_choice, pre_choice, batch_invariant, norm_weight,
        norm_order,
    )  # fmt: skip
    if out is None:
        return _ops_hc_post_pre(*args)  # type: ignore[no-any-return]
    xo, li, po, co = out
    _ops_hc_post_pre_out(*args, x_out=xo, layer_input=li, post_out=po, comb_out=co)
    return xo, li, po, co


def _hc_post_pre_plan(
    a: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool,
    out: Any,
    backend: str,
    norm_weight: torch.Tensor | None = None,
    norm_order: str = "official",
) -> tuple[str, str, str]:
    """Every check of hc_post_pre's arguments, then (its backend, hc_post's, hc_pre's)."""
    check_instance("batch_invariant", batch_invariant, bool)
    T, n, D = _check_post_args("a", a, x, post, comb)
    dev = check_device([("x", x), ("a", a), ("post", post), ("comb", comb)])
    post_choice = select("hc_post", "auto", Facts(dev, (a.dtype, x.dtype), n=n, D=D))
    # hc_pre's checks and choice, on x's shape and dtype (x_new's)
    pre_choice, _, _ = _hc_pre_plan(
        x, fn, scale, base, rms_norm_eps, hc_eps, sinkhorn_iters, batch_invariant, None, "auto",
        None, norm_weight, norm_order,
    )  # fmt: skip
    facts = Facts(
        dev, (a.dtype, x.dtype), n=n, D=D, eps=(rms_norm_eps, hc_eps),
        T=None if batch_invariant else T,
    )  # fmt: skip
    choice = select("hc_post_pre", backend, facts)
    if out is not None:
        f32 = torch.float32
        shapes = (((T, n, D), x.dtype), ((T, D), x.dtype), ((T, n), f32), ((T, n, n), f32))
        _check_outs(out, shapes, "x_new, layer_input, post, comb", dev)
    return choice, post_choice, pre_choice


# ---------------------------------------------------------------------- fused: hc_post_head
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
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: PostHeadBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's last hc_post, then hc_head: ``(x_new, head_input)`` with ``x_new =
    hc_post(f, x, post, comb)`` and ``head_input = hc_head(x_new, head_fn, head_scale,
    head_base, ...)``.

    f: (T, D) the MoE output; x: (T, n, D); post (T, n), comb (T, n, n); head_fn (n, n*D);
    head_scale (1,); head_base (n,).  x_new (T, n, D) and head_input (T, D) in x.dtype.
    ``out``: a 2-tuple of contiguous tensors of those shapes and dtype (out[0] must not overlap
    x).
    Fused where it pays: backend "triton_fma" runs hc_post inside the mix launch of hc_head's
    small-batch kernel (kernels/mhc_head.py, ``mhc_post_head_fma``): each mix program forms its
    (4 tokens, n, 256 columns) tile of x_new, stores it and mixes it from registers; two launches
    instead of three.  Its bits are hc_post's Triton kernel followed by hc_head's "triton_fma".
    "composed" calls the hc_post and hc_head operators, each with its own "auto" choice.
    "auto": "triton_fma" where hc_head's "auto" runs "triton_fma" (T < ``_dispatch.
    HEAD_MMA_MIN_T``, and at every T under ``batch_invariant=True``), "composed" above.
    Bytes (fused): f (T*D) and x (T*n*D) read once, x_new written once and re-read from L2 by
    the weighted sum, head_fn once per 4-token block (L2), head_input written once.
    ``norm_weight``, ``norm_order``: the trailing norm (module docstring), here the head's
    norm before the LM head.
    """
    plan = planned(
        signature(
            "hc_post_head", f, x, post, comb, head_fn, head_scale, head_base, rms_norm_eps,
            hc_eps, batch_invariant, norm_weight, norm_order, backend, out=out,
        ),
        lambda: _hc_post_head_plan(
            f, x, post, comb, head_fn, head_scale, head_base, rms_norm_eps, hc_eps,
            batch_invariant, out, backend, norm_weight, norm_order,
        ),
    )  # fmt: skip
    choice, post_choice, head_choice = plan
    args = (
        f, x, post, comb, head_fn, head_scale, head_base, float(rms_norm_eps), float(hc_eps),
        choice, post_choice, head_choice, norm_weight, norm_order,
    )  # fmt: skip
    if out is None:
        return _ops_hc_post_head(*args)  # type: ignore[no-any-return]
    xo, y = out
    _ops_hc_post_head_out(*args, x_out=xo, head_input=y)
    return xo, y


def _hc_post_head_plan(
    f: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
    batch_invariant: bool,
    out: Any,
    backend: str,
    norm_weight: torch.Tensor | None = None,
    norm_order: str = "official",
) -> tuple[str, str, str]:
    """Every check of hc_post_head's arguments, then (its backend, hc_post's, hc_head's)."""
    check_instance("batch_invariant", batch_invariant, bool)
    T, n, D = _check_post_args("f", f, x, post, comb)
    _check_params(fn, scale, base, n, n * D, 1, prefix="head_")  # named as the arguments
    dev = check_device([("x", x), ("f", f), ("post", post), ("comb", comb)])
    post_choice = select("hc_post", "auto", Facts(dev, (f.dtype, x.dtype), n=n, D=D))
    head_choice, _ = _hc_head_plan(
        x, fn, scale, base, rms_norm_eps, hc_eps, batch_invariant, None, "auto", None,
        norm_weight, norm_order,
    )  # fmt: skip
    facts = Facts(
        dev, (f.dtype, x.dtype), n=n, D=D, eps=(rms_norm_eps, hc_eps),
        T=None if batch_invariant else T,
    )  # fmt: skip
    choice = select("hc_post_head", backend, facts)
    if out is not None:
        _check_outs(out, (((T, n, D), x.dtype), ((T, D), x.dtype)), "x_new, head_input", dev)
    return choice, post_choice, head_choice
