"""RMSNorm on the H200: the Triton kernel; FlashInfer's ``rmsnorm`` on request.

Same signature as :func:`dsv4mtp.reference.rms_norm` plus keyword-only ``out`` and ``backend``.
``backend="auto"`` is the Triton kernel: on the H200 it beat FlashInfer's ``rmsnorm`` at every
measured shape (T 1..4096, D 4096 / 7168; 83-89 % vs 60-63 % of copy bandwidth at T 4096,
bench/results/norm-h200.md).
"""

from __future__ import annotations

from typing import Literal

import torch

from dsv4mtp.checks import check_eps, check_instance, check_shape
from dsv4mtp.errors import InputError
from dsv4mtp.semantics import NormOrder

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from ._dispatch import Facts, planned, select, signature
from .kernels._launch import check_device, check_kernel_dtype, check_out

# The operators (optimized/_ops.py), looked up once: rms_norm validates and chooses the backend,
# the operator runs it.
_ops_rms_norm = torch.ops.dsv4mtp.rms_norm.default
_ops_rms_norm_out = torch.ops.dsv4mtp.rms_norm_out.default

__all__ = ["rms_norm"]

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

    x: (..., D) bf16 / fp32; weight: (D,) bf16 / fp32 or None.  ``out`` (same shape and dtype as
    x, contiguous) is written in place and returned.  ``backend="flashinfer"`` (bf16 x and weight,
    official order, CUDA) calls FlashInfer's ``rmsnorm``; "auto" and "triton" the Triton kernel.
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
