"""RMSNorm on the H200: the Triton kernel; FlashInfer's ``rmsnorm`` on request.  The MTP
layer's entry norms (:func:`embed_norms`) in one launch of the same kernel body.

Same signature as :func:`dsv4mtp.reference.rms_norm` plus keyword-only ``out`` and ``backend``.
``backend="auto"`` is the Triton kernel: on the H200 it beat FlashInfer's ``rmsnorm`` at every
measured shape (T 1..4096, D 4096 / 7168; 83-89 % vs 60-63 % of copy bandwidth at T 4096,
bench/results/norm-h200.md).
"""

from __future__ import annotations

from typing import Literal

import torch

from dsv4mtp.checks import check_embed_norms_args, check_eps, check_instance, check_shape
from dsv4mtp.errors import InputError
from dsv4mtp.semantics import NormOrder

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from ._dispatch import Facts, planned, select, signature
from .kernels._launch import check_device, check_kernel_dtype, check_out

# The operators (optimized/_ops.py), looked up once: rms_norm validates and chooses the backend,
# the operator runs it.
_ops_rms_norm = torch.ops.dsv4mtp.rms_norm.default
_ops_rms_norm_out = torch.ops.dsv4mtp.rms_norm_out.default
_ops_embed_norms = torch.ops.dsv4mtp.embed_norms.default
_ops_embed_norms_out = torch.ops.dsv4mtp.embed_norms_out.default

__all__ = ["embed_norms", "rms_norm"]

NormBackend = Literal["auto", "flashinfer", "triton"]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    order: NormOrder = "official",
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: NormBackend = "auto",
) -> torch.Tensor:
    """``y = w * x * rsqrt(mean(x**2, -1) + eps)`` over the last dim, in x.dtype.

    x: (..., D) bf16 / fp32 (the Triton kernel reads a 2-D x with unit column stride through its
    row stride, without a copy); weight: (D,) bf16 / fp32 or None.  ``out`` (same shape and
    dtype as x, contiguous) is written in place and returned.  ``backend="flashinfer"`` (bf16 x
    and weight, official order, CUDA) calls FlashInfer's ``rmsnorm``; "auto" and "triton" the
    Triton kernel.
    ``batch_invariant=True`` pins a schedule that does not depend on the number of rows; every
    rms_norm backend already reduces each row in one program, so the default is batch invariant
    too.
    """
    # The plan of this call signature (optimized/_dispatch.py, "plans"): the checks run once
    # per signature.  While torch.compile traces, they run every time and become its guards.
    plan = planned(
        signature("rms_norm", x, weight, eps, order, batch_invariant, backend, out=out),
        lambda: _rms_norm_plan(x, weight, eps, order, batch_invariant, out, backend),
    )
    (choice,) = plan
    if out is None:
        return _ops_rms_norm(x, weight, float(eps), order, choice)  # type: ignore[no-any-return]
    _ops_rms_norm_out(x, weight, float(eps), order, choice, out=out)
    return out


def _rms_norm_plan(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    order: NormOrder,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
) -> tuple[str]:
    """Every check of rms_norm's arguments, then the backend choice."""
    check_instance("batch_invariant", batch_invariant, bool)
    check_kernel_dtype("x", x)
    if weight is not None:
        check_kernel_dtype("weight", weight)
        check_shape("weight", weight, (x.shape[-1],))
    check_eps("eps", eps)
    if order not in ("official", "vllm"):
        raise InputError(f"order: expected 'official' or 'vllm', got {order!r}")
    named = [("x", x)] + ([("weight", weight)] if weight is not None else [])
    dev = check_device(named)
    dtypes = (x.dtype,) if weight is None else (x.dtype, weight.dtype)
    facts = Facts(dev, dtypes, eps=(eps,), order=order, has_weight=weight is not None)
    choice = select("rms_norm", backend, facts)
    if x.dim() == 0:
        raise InputError("x: expected at least 1 dimension, got a scalar")
    if out is not None:
        check_out("out", out, tuple(x.shape), x.dtype, dev)
    return (choice,)


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
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer's two entry norms -> ``(e, h)``: ``e = rms_norm(embed[input_ids], enorm)``
    (the gathered row zeroed first where ``mask_pos0`` and its position is 0) and ``h =
    rms_norm(prev_hidden, hnorm)``, as :func:`dsv4mtp.reference.embed_norms`.

    input_ids, positions: (T,) int64; embed: (V, D) bf16 / fp32, read in place through its row
    stride (copied only if its columns are not unit-stride); prev_hidden: (T, n, D) bf16 / fp32;
    enorm, hnorm: (D,) bf16 / fp32.  e (T, D) in embed.dtype, h (T, n, D) in
    prev_hidden.dtype.  ``out``: a 2-tuple of contiguous tensors of those shapes and dtypes,
    written in place and returned.

    One launch of kernels/rms_norm.py's ``embed_norms_kernel``, grid T * (n + 1): a program per
    embedding row (it reads the row's id and, under ``mask_pos0``, its position, then gathers
    the row) and per hidden row, each running :func:`rms_norm`'s Triton row body with the same
    chunk and warp count, so e and h are bitwise what the gather, the mask and two
    :func:`rms_norm` calls give.  It fuses those three launches (the gather, two norms; six
    under ``mask_pos0``, whose comparison, zeros and ``where`` are three more) into one.
    Bytes: T*D embedding values and T*n*D hidden values read, the same written, 8 bytes of
    id per token (16 with the position under ``mask_pos0``), the weights from L2.

    The ids are not read on the host (no sync, so the call is CUDA-graph capturable): an id
    outside [0, V) reads nothing and its row of e is NaN, which the next step's guard reports
    (the layer checks ids before it calls this, on the host or with its device guard).  Every
    row is computed by its own program: the default schedule is batch invariant, and
    ``batch_invariant`` is accepted for the ops' common signature.
    """
    plan = planned(
        signature(
            "embed_norms", input_ids, positions, embed, prev_hidden, enorm, hnorm, eps, order,
            mask_pos0, batch_invariant, out=out,
        ),
        lambda: _embed_norms_plan(
            input_ids, positions, embed, prev_hidden, enorm, hnorm, eps, order, mask_pos0,
            batch_invariant, out,
        ),
    )  # fmt: skip
    del plan  # one schedule: the plan is the checks
    args = (input_ids, positions, embed, prev_hidden, enorm, hnorm, float(eps), order, mask_pos0)
    if out is None:
        return _ops_embed_norms(*args)  # type: ignore[no-any-return]
    e, h = out
    _ops_embed_norms_out(*args, e_out=e, h_out=h)
    return e, h


def _embed_norms_plan(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    prev_hidden: torch.Tensor,
    enorm: torch.Tensor,
    hnorm: torch.Tensor,
    eps: float,
    order: NormOrder,
    mask_pos0: bool,
    batch_invariant: bool,
    out: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[()]:
    """Every check of embed_norms' arguments (metadata only: no host sync)."""
    T, D = check_embed_norms_args(
        input_ids, positions, embed, prev_hidden, enorm, hnorm, check_kernel_dtype
    )
    check_eps("eps", eps)
    if order not in ("official", "vllm"):
        raise InputError(f"order: expected 'official' or 'vllm', got {order!r}")
    check_instance("mask_pos0", mask_pos0, bool)
    check_instance("batch_invariant", batch_invariant, bool)
    dev = check_device(
        [("input_ids", input_ids), ("positions", positions), ("embed", embed),
         ("prev_hidden", prev_hidden), ("enorm", enorm), ("hnorm", hnorm)]
    )  # fmt: skip
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise InputError("out: expected a 2-tuple (e, h)")
        check_out("out[0]", out[0], (T, D), embed.dtype, dev)
        check_out("out[1]", out[1], tuple(prev_hidden.shape), prev_hidden.dtype, dev)
    return ()
