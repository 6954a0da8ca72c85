"""Keyword adapter over the FlashInfer kernels the optimized ops call (no kernels here).

FlashInfer's compiled mHC functions (``flashinfer.mhc.get_mhc_module()``) take their arguments
by position only: a reordered or inserted argument in a new release would be read as a different
tensor or scalar without any error.  Every call therefore goes through the functions below, whose
keyword names are FlashInfer's own (its ``csrc/mhc/*.cu`` exports and ``flashinfer.mhc``), and
which refuse a FlashInfer whose release differs from :data:`FLASHINFER_RELEASE`, the release the
argument orders were read from.  :func:`flashinfer_mismatch` lets the backend tables treat such a
FlashInfer as absent, so ``backend="auto"`` falls through to the Triton kernels.

Nothing here imports flashinfer or triton at import time.
"""

from __future__ import annotations

import functools
import re
from types import ModuleType
from typing import Any

import torch

from dsv4mtp.errors import InputError

from ._launch import INTERPRET, flashinfer_mhc, flashinfer_norm

__all__ = [
    "FLASHINFER_RELEASE",
    "flashinfer_mismatch",
    "mhc_post",
    "mhc_pre_big_fuse",
    "mhc_pre_big_fuse_with_prenorm",
    "rmsnorm",
]

# The release whose argument orders are written below (read from flashinfer-python
# 0.7.2.post1).  Post releases and local builds of it (0.7.2.post1, 0.7.2+cu128) share its
# kernels' signatures; any other release must be re-read before it is allowed.
FLASHINFER_RELEASE: tuple[int, int, int] = (0, 7, 2)
_EXPECTED = ".".join(map(str, FLASHINFER_RELEASE))


def _release(version: str) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(g) for g in m.groups()) if m else None


@functools.cache
def _mismatch(module: str) -> str | None:
    if INTERPRET:
        return "needs a compiled run (FlashInfer has no TRITON_INTERPRET=1 path)"
    if flashinfer_mhc() is None:
        return "needs an importable flashinfer (the gpu extra)"
    if module == "norm" and flashinfer_norm() is None:
        return "needs an importable flashinfer.norm"
    import flashinfer

    found = str(getattr(flashinfer, "__version__", "unknown"))
    if _release(found) != FLASHINFER_RELEASE:
        return (
            f"needs flashinfer {_EXPECTED} (any post release or local build of it: the argument "
            f"order of its kernels was written for that release), found {found}"
        )
    return None


@torch.compiler.assume_constant_result
def flashinfer_mismatch(module: str = "mhc") -> str | None:
    """Why FlashInfer's ``module`` ("mhc" or "norm") cannot be called here (absent, or another
    release), or None.  torch.compile evaluates it once while tracing and keeps the answer as a
    constant: the imports behind it would otherwise break the graph."""
    return _mismatch(module)


def _checked(module: str) -> None:
    reason = _mismatch(module)
    if reason is not None:
        raise InputError(f"flashinfer: the adapter {reason}")


@functools.cache
def _mhc_module() -> Any:
    _checked("mhc")
    fi = flashinfer_mhc()
    assert fi is not None
    return fi.get_mhc_module()  # JIT-built (or loaded from its cache) on first use


@functools.cache
def _norm_module() -> ModuleType:
    _checked("norm")
    fi = flashinfer_norm()
    assert fi is not None
    return fi


def mhc_pre_big_fuse(
    *,
    post_mix: torch.Tensor,
    comb_mix: torch.Tensor,
    layer_input: torch.Tensor,
    dot_mix: torch.Tensor,
    sqrsum: torch.Tensor,
    residual: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    k: int,
    rms_eps: float,
    mhc_pre_eps: float,
    mhc_sinkhorn_eps: float,
    mhc_post_mult_value: float,
    sinkhorn_repeat: int,
    num_splits: int,
    block_size: int,
) -> None:
    """Sinkhorn and the pre-weighted sum from split-K mix partials (``dot_mix`` (S, T, 24) and
    ``sqrsum`` (S, T), or (T, 24) and (T,) when ``num_splits`` is 1), into ``post_mix``
    (T, 4, 1), ``comb_mix`` (T, 4, 4) and ``layer_input`` (T, D); ``block_size`` 0 lets the
    kernel choose."""
    _mhc_module().mhc_pre_big_fuse(
        post_mix, comb_mix, layer_input, dot_mix, sqrsum, residual, mhc_scale, mhc_base,
        int(k), float(rms_eps), float(mhc_pre_eps), float(mhc_sinkhorn_eps),
        float(mhc_post_mult_value), int(sinkhorn_repeat), int(num_splits), int(block_size),
    )  # fmt: skip


def mhc_pre_big_fuse_with_prenorm(
    *,
    post_mix: torch.Tensor,
    comb_mix: torch.Tensor,
    layer_input: torch.Tensor,
    dot_mix: torch.Tensor,
    residual: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    rms_eps: float,
    mhc_pre_eps: float,
    mhc_sinkhorn_eps: float,
    mhc_post_mult_value: float,
    sinkhorn_repeat: int,
    block_size: int,
) -> None:
    """As :func:`mhc_pre_big_fuse` from one unsplit mix ``dot_mix`` (T, 24); the kernel computes
    the square sum from ``residual`` itself."""
    _mhc_module().mhc_pre_big_fuse_with_prenorm(
        post_mix, comb_mix, layer_input, dot_mix, residual, mhc_scale, mhc_base,
        float(rms_eps), float(mhc_pre_eps), float(mhc_sinkhorn_eps), float(mhc_post_mult_value),
        int(sinkhorn_repeat), int(block_size),
    )  # fmt: skip


def mhc_post(
    *,
    out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
) -> None:
    """``out (T, 4, D) = post_layer_mix * x + comb_res_mix^T residual`` (bf16 tensors, fp32 mixes)."""
    _mhc_module().mhc_post(out, x, residual, post_layer_mix, comb_res_mix)


def rmsnorm(
    *,
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    enable_pdl: bool,
) -> None:
    """FlashInfer's ``flashinfer.norm.rmsnorm`` over the rows of a 2-D ``input``, into ``out``
    (a Python function: passed by keyword, so a renamed argument fails loudly)."""
    _norm_module().rmsnorm(
        input=input, weight=weight, eps=float(eps), out=out, enable_pdl=enable_pdl
    )
