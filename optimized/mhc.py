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

from . import _ops
from ._dispatch import PLANS, TABLES, Facts, remember, select
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
    "hc_pre",
]

PreBackend = Literal["auto", "triton", "triton_fma", "flashinfer", "flashinfer_prenorm"]
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
    backend: "triton" (the one-pass collapse kernel), "triton_fma" (kernels/mhc_pre_small.py:
    fp32 FMA mix spread over a few hundred programs, then the Sinkhorn and the weighted sum in a
    second launch; built for the T <= 64 of MTP's draft step), "flashinfer" (split-K mix
    producer + FlashInfer ``mhc_pre_big_fuse``), "flashinfer_prenorm" (producer with one split +
    ``mhc_pre_big_fuse_with_prenorm``), or "auto".
    ``schedule`` tunes "triton" and the FlashInfer backends; "triton_fma" refuses one.  With
    ``batch_invariant=False`` (the default) "auto" runs "triton_fma" up to
    ``_dispatch.PRE_FMA_MAX_T`` (64) tokens and "triton" above; ``batch_invariant=True`` keeps
    "auto" on "triton_fma" at every T.
    """
    # The plan of this call signature (optimized/_dispatch.py, "plans"): the checks run once
    # per signature.  While torch.compile traces, they run every time and become its guards.
    key: tuple[object, ...] | None = None
    plan: tuple[Any, ...] | None = None
    if not torch.compiler.is_compiling():
        try:
            key = (
                "hc_pre",
                x.__class__, x.dtype, x.shape, x.device,
                fn.__class__, fn.dtype, fn.shape, fn.device,
                scale.__class__, scale.dtype, scale.shape, scale.device,
                base.__class__, base.dtype, base.shape, base.device,
                rms_norm_eps.__class__, rms_norm_eps, hc_eps.__class__, hc_eps,
                sinkhorn_iters.__class__, sinkhorn_iters, post_mult.__class__, post_mult,
                batch_invariant.__class__, batch_invariant, backend, schedule,
                None if out is None else _outs_key(out),
            )  # fmt: skip
            plan = PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
            key = None
    if plan is None:
        plan = _hc_pre_plan(
            x, fn, scale, base, rms_norm_eps, hc_eps, sinkhorn_iters, batch_invariant, out,
            backend, schedule,
        )  # fmt: skip
        if key is not None:
            remember(key, plan)
    choice, collapse, mix = plan
    args = (
        x, fn, scale, base, float(rms_norm_eps), float(hc_eps), sinkhorn_iters, float(post_mult),
        choice, collapse, mix,
    )  # fmt: skip
    if out is None:
        return _ops_hc_pre(*args)  # type: ignore[no-any-return]
    li, post, comb = out
    _ops_hc_pre_out(*args, layer_input=li, post=post, comb=comb)
    return li, post, comb


def _outs_key(out: Any) -> tuple[object, ...]:
    """What check_out reads from each tensor of an ``out`` tuple (or list)."""
    return (out.__class__, *[(o.__class__, o.shape, o.dtype, o.device, o.is_contiguous())
                             for o in out])  # fmt: skip


def _out_key(o: torch.Tensor | None) -> tuple[object, ...] | None:
    """What check_out reads from one ``out`` tensor."""
    if o is None:
        return None
    return (o.__class__, o.shape, o.dtype, o.device, o.is_contiguous())


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
    key: tuple[object, ...] | None = None
    plan: tuple[Any, ...] | None = None
    if not torch.compiler.is_compiling():
        try:
            key = (
                "hc_post",
                f.__class__, f.dtype, f.shape, f.device,
                residual.__class__, residual.dtype, residual.shape, residual.device,
                post.__class__, post.dtype, post.shape, post.device,
                comb.__class__, comb.dtype, comb.shape, comb.device,
                batch_invariant.__class__, batch_invariant, backend, _out_key(out),
            )  # fmt: skip
            plan = PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
            key = None
    if plan is None:
        plan = _hc_post_plan(f, residual, post, comb, batch_invariant, out, backend)
        if key is not None:
            remember(key, plan)
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
    ``batch_invariant=True`` keeps "auto" on "triton_fma" at every T.
    """
    # The plan of this call signature (optimized/_dispatch.py, "plans"): the checks run once
    # per signature.  While torch.compile traces, they run every time and become its guards.
    key: tuple[object, ...] | None = None
    plan: tuple[Any, ...] | None = None
    if not torch.compiler.is_compiling():
        try:
            key = (
                "hc_head",
                x.__class__, x.dtype, x.shape, x.device,
                fn.__class__, fn.dtype, fn.shape, fn.device,
                scale.__class__, scale.dtype, scale.shape, scale.device,
                base.__class__, base.dtype, base.shape, base.device,
                rms_norm_eps.__class__, rms_norm_eps, hc_eps.__class__, hc_eps,
                batch_invariant.__class__, batch_invariant, backend, schedule, _out_key(out),
            )  # fmt: skip
            plan = PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
            key = None
    if plan is None:
        plan = _hc_head_plan(
            x, fn, scale, base, rms_norm_eps, hc_eps, batch_invariant, out, backend, schedule
        )
        if key is not None:
            remember(key, plan)
    choice, collapse = plan
    args = (x, fn, scale, base, float(rms_norm_eps), float(hc_eps), choice, collapse)
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
) -> tuple[str, Sequence[int]]:
    """Every check of hc_head's arguments, then the backend choice (which may read T)."""
    check_instance("batch_invariant", batch_invariant, bool)
    T, n, D = _check_streams(x)
    _check_params(fn, scale, base, n, n * D, 1)
    check_eps("rms_norm_eps", rms_norm_eps)
    check_eps("hc_eps", hc_eps)
    dev = check_device([("x", x), ("fn", fn), ("scale", scale), ("base", base)])
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
