"""Argument validation shared by the reference and the optimized entry points.

Kept tiny and explicit: each helper raises :class:`InputError` naming the argument, the expected
and the actual value.  ``optimized`` imports these rather than keeping its own copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4mtp.errors import InputError

__all__ = ["check_dtype", "check_finite", "check_ndim", "check_shape", "compute_dtype"]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """promote(dtype, float32): float64 stays float64, every narrower float computes in fp32."""
    return torch.promote_types(dtype, torch.float32)


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise InputError(
            f"{name}: expected dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}"
        )


def check_ndim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """``None`` in ``shape`` matches any size on that axis."""
    ok = t.dim() == len(shape) and all(
        s is None or s == a for s, a in zip(shape, t.shape, strict=True)
    )
    if not ok:
        dims = ["*" if s is None else str(s) for s in shape]
        want = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
        raise InputError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Host-syncing check; use only on parameters at load time, never on a hot path."""
    if t.numel() and not bool(torch.isfinite(t.float()).all()):
        bad = int((~torch.isfinite(t.float())).sum())
        raise InputError(f"{name}: expected finite values, found {bad} non-finite of {t.numel()}")
