"""RoPE and the elementwise q / kv paths of attention on the H200 (Triton).

Same signatures as :func:`dsv4mtp.reference.apply_rope`, :func:`~dsv4mtp.reference.q_head_norm_rope`
and :func:`~dsv4mtp.reference.kv_norm_rope` plus keyword-only ``backend``.  The math:
docs/semantics.md, "Attention with sinks" ("Query", "Key/value latent", "RoPE", "Output") and
"Activation and KV quantization"; the kernel, its tile and its numerics:
optimized/kernels/rope.py.  Each call is one launch with no host sync (CUDA-graph capturable);
the checks read metadata only and run once per call signature (the plan cache of
optimized/_dispatch.py).  Every schedule is batch invariant (rows are independent), so
``batch_invariant=True`` changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from dsv4mtp.checks import check_eps, check_instance, check_int, check_positions, check_shape
from dsv4mtp.errors import InputError
from dsv4mtp.semantics import NormOrder

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from ._dispatch import Facts, planned, select, signature
from .kernels._launch import check_device, check_kernel_dtype, check_out

__all__ = ["apply_rope", "kv_norm_rope", "q_head_norm_rope"]

RopeBackend = Literal["auto", "triton"]

_ops_rope = torch.ops.dsv4mtp.apply_rope.default
_ops_rope_out = torch.ops.dsv4mtp.apply_rope_out.default
_ops_q = torch.ops.dsv4mtp.q_head_norm_rope.default
_ops_q_out = torch.ops.dsv4mtp.q_head_norm_rope_out.default
_ops_kv = torch.ops.dsv4mtp.kv_norm_rope.default
_ops_kv_out = torch.ops.dsv4mtp.kv_norm_rope_out.default


def _planned(key: tuple[object, ...] | None, build: Callable[[], str]) -> str:
    """The chosen backend of a call, through the plan cache (optimized/_dispatch.py, "plans")."""
    return str(planned(key, lambda: (build(),))[0])


def _check_rope_args(
    x: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    rope_dim: int,
) -> None:
    """positions (T,) and freqs (rope_dim/2,) of a call whose rows are ``x``."""
    check_positions("positions", positions, x.shape[0])
    check_kernel_dtype("freqs", freqs)
    check_shape("freqs", freqs, (rope_dim // 2,))


def _choose(op: str, named: list[tuple[str, torch.Tensor]], backend: str) -> torch.device:
    dev = check_device(named)
    select(op, backend, Facts(dev, tuple(t.dtype for _, t in named if t.is_floating_point())))
    return dev


# ------------------------------------------------------------------------------ apply_rope
def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    inverse: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: RopeBackend = "auto",
) -> torch.Tensor:
    """Rotate interleaved pairs of ``x (T, ..., Dr)`` by ``positions (T,) * freqs (Dr/2,)``.

    x bf16 / fp32 with unit stride along Dr (a strided view such as ``o[..., Dn:]`` is read in
    place when its middle dims flatten into one stride); positions (T,) int32 / int64; freqs
    (Dr/2,) bf16 / fp32 (``rope_frequencies``, any mode).  ``inverse=True`` rotates by the
    negative angle.  Returns x's shape and dtype; ``out`` (the same shape and dtype) is written
    in place and returned: contiguous, or a 3-D (T, H, Dr) view with unit stride along Dr and
    rows that do not overlap.  ``out`` is x itself (each stored pair is computed from the
    values loaded at its own addresses) or shares no memory with x.
    Angle and rotation in fp32 (kernels/rope.py, "Numerics").

    One launch, one pass: reads x and writes out once, 2 * T * (...) * Dr * itemsize bytes (the
    output's rope dims at V4-Flash: 8 KiB each way per token).  The attention output's inverse
    rotation is this op on ``o[..., Dn:]`` in place (``out=`` the same view), which saves the
    copy back into ``o`` a separate output would need; the attention kernel's epilogue could
    fuse it.
    """

    def build() -> str:
        check_instance("inverse", inverse, bool)
        check_instance("batch_invariant", batch_invariant, bool)
        check_kernel_dtype("x", x)
        if x.dim() < 2 or x.shape[-1] % 2:
            raise InputError(
                f"x: expected shape (T, ..., rope_dim) with an even rope_dim, got {tuple(x.shape)}"
            )
        _check_rope_args(x, positions, freqs, x.shape[-1])
        named = [("x", x), ("positions", positions), ("freqs", freqs)]
        dev = _choose("apply_rope", named, backend)
        if out is not None:
            _check_rope_out(out, x, dev)
        return "triton"

    # out's strides are in the key: a strided out passes only as a 3-D view with unit stride
    # and rows that do not overlap
    out_strides = out.stride() if isinstance(out, torch.Tensor) else None
    key = signature(
        "apply_rope", x, positions, freqs, inverse, batch_invariant, backend, out_strides,
        out=out,
    )  # fmt: skip
    choice = _planned(key, build)
    if out is None:
        return _ops_rope(x, positions, freqs, inverse, choice)  # type: ignore[no-any-return]
    _ops_rope_out(x, positions, freqs, inverse, choice, out=out)
    return out


def _check_rope_out(out: torch.Tensor, x: torch.Tensor, dev: torch.device) -> None:
    """apply_rope's ``out``: x's shape and dtype on x's device, contiguous, or a 3-D view with
    unit stride along the rotated dim whose rows do not overlap (x itself, for an in-place
    rotation)."""
    strided = isinstance(out, torch.Tensor) and out.dim() == 3 and out.stride(-1) == 1
    check_out("out", out, tuple(x.shape), x.dtype, dev, contiguous=not strided)
    if not strided:
        return
    T, H, Dr = out.shape
    head_ok = H == 1 or out.stride(1) >= Dr
    token_ok = T == 1 or out.stride(0) >= (H - 1) * out.stride(1) + Dr
    if not (head_ok and token_ok):
        raise InputError(
            f"out: expected rows that do not overlap, got shape {tuple(out.shape)} and strides "
            f"{out.stride()}"
        )


# ------------------------------------------------------------------------------ q path
def q_head_norm_rope(
    q: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    eps: float,
    rope_dim: int,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: RopeBackend = "auto",
) -> torch.Tensor:
    """The query after ``wq_b``: per-head RMS norm (no weight), then RoPE on the last rope_dim.

    q (T, H, Dh) bf16 / fp32 with unit stride along Dh; positions (T,) int32 / int64; freqs
    (rope_dim/2,) bf16 / fp32.  Returns (T, H, Dh) in q's dtype; ``out`` (the same, contiguous)
    is written in place and returned.  The norm rounds to q's dtype after each op as the
    reference does (square, mean, rsqrt, product), the rotation in fp32.

    Fuses the square, the mean, the rsqrt, the scaling, the split at Dh - rope_dim, the rotation
    and the concatenation (six passes over q in the reference) into one launch, one program per
    (token block, head block): reads q and writes out once, 2 * T * H * Dh * itemsize bytes
    (V4-Flash, H 64, Dh 512, bf16: 64 KiB each way per token, 512 MiB in all at T 4096).
    """

    def build() -> str:
        check_kernel_dtype("q", q)
        if q.dim() != 3:
            raise InputError(f"q: expected shape (T, H, Dh), got {tuple(q.shape)}")
        _check_rope_dim(rope_dim, q.shape[-1])
        _check_rope_args(q, positions, freqs, rope_dim)
        check_eps("eps", eps)
        check_instance("batch_invariant", batch_invariant, bool)
        named = [("q", q), ("positions", positions), ("freqs", freqs)]
        dev = _choose("q_head_norm_rope", named, backend)
        if out is not None:
            check_out("out", out, tuple(q.shape), q.dtype, dev)
        return "triton"

    key = signature("q_head_norm_rope", q, positions, freqs, eps, rope_dim, batch_invariant,
                    backend, out=out)  # fmt: skip
    choice = _planned(key, build)
    if out is None:
        return _ops_q(q, positions, freqs, float(eps), choice)  # type: ignore[no-any-return]
    _ops_q_out(q, positions, freqs, float(eps), choice, out=out)
    return out


# ------------------------------------------------------------------------------ kv path
def kv_norm_rope(
    kv: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    eps: float,
    rope_dim: int,
    fp8_kv: bool = False,
    norm_order: NormOrder = "official",
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: RopeBackend = "auto",
) -> torch.Tensor:
    """The key/value latent after ``wkv``: kv_norm, RoPE on the last rope_dim, optional FP8.

    kv (T, Dh) bf16 / fp32 with unit stride along Dh; kv_norm_weight (Dh,) bf16 / fp32;
    positions (T,) int32 / int64; freqs (rope_dim/2,) bf16 / fp32.  ``norm_order`` as
    rms_norm's ``order``; ``fp8_kv`` rounds the non-rope dims through e4m3 with one power-of-two
    scale per 64 values (a ragged last block its own).  Returns (T, Dh) in kv's dtype, the rows
    attention reads and the cache keeps; ``out`` (the same, contiguous) is written in place and
    returned.

    Fuses the RMSNorm, the split, the rotation, the e4m3 block round trip and the concatenation
    into one launch: reads kv and writes out once, 2 * T * Dh * itemsize bytes plus the weight
    (V4-Flash, Dh 512, bf16: 1 KiB each way per token).
    """

    def build() -> str:
        check_kernel_dtype("kv", kv)
        if kv.dim() != 2:
            raise InputError(f"kv: expected shape (T, Dh), got {tuple(kv.shape)}")
        check_kernel_dtype("kv_norm_weight", kv_norm_weight)
        check_shape("kv_norm_weight", kv_norm_weight, (kv.shape[1],))
        _check_rope_dim(rope_dim, kv.shape[1])
        _check_rope_args(kv, positions, freqs, rope_dim)
        check_eps("eps", eps)
        check_instance("fp8_kv", fp8_kv, bool)
        if norm_order not in ("official", "vllm"):
            raise InputError(f"norm_order: expected 'official' or 'vllm', got {norm_order!r}")
        check_instance("batch_invariant", batch_invariant, bool)
        named = [
            ("kv", kv), ("kv_norm_weight", kv_norm_weight), ("positions", positions),
            ("freqs", freqs),
        ]  # fmt: skip
        dev = _choose("kv_norm_rope", named, backend)
        if out is not None:
            check_out("out", out, tuple(kv.shape), kv.dtype, dev)
        return "triton"

    key = signature("kv_norm_rope", kv, kv_norm_weight, positions, freqs, eps, rope_dim, fp8_kv,
                    norm_order, batch_invariant, backend, out=out)  # fmt: skip
    choice = _planned(key, build)
    args = (kv, kv_norm_weight, positions, freqs, float(eps), fp8_kv, norm_order, choice)
    if out is None:
        return _ops_kv(*args)  # type: ignore[no-any-return]
    _ops_kv_out(*args, out=out)
    return out


def _check_rope_dim(rope_dim: int, D: int) -> None:
    check_int("rope_dim", rope_dim, 2)
    if rope_dim % 2 or rope_dim > D:
        raise InputError(f"rope_dim: expected an even number <= {D}, got {rope_dim}")
