"""Rotary position embedding of the MTP layer (``docs/semantics.md``, "Attention with sinks").

GPT-J / interleaved layout: pairs ``(x[2i], x[2i+1])`` of the last ``qk_rope_head_dim`` dims are
rotated by ``pos * f_i``.  The MTP layer has compress ratio 0, so the official code uses plain
RoPE with ``base = rope_theta``; vLLM keeps DeepSeek-YaRN frequency interpolation (the
``rope_mode`` switch, ``docs/semantics.md``, "Presets and switches").  Both are offered
(``mode="plain" | "yarn"``); the cos/sin magnitude factor is 1 in both.
"""

from __future__ import annotations

import torch

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_instance,
    check_positions,
    check_shape,
    compute_dtype,
)
from dsv4mtp.errors import InputError
from dsv4mtp.rope import rope_frequencies
from dsv4mtp.semantics import RopeMode

__all__ = ["RopeMode", "apply_rope", "rope_frequencies"]


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    inverse: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate interleaved pairs of ``x (T, ..., Dr)`` by ``positions (T,) * freqs (Dr/2,)``.

    ``inverse=True`` rotates by the negative angle (undoes the rotation).  Math in
    promote(x.dtype, float32); returns ``x.dtype``.  ``batch_invariant`` changes nothing here
    (every row is rotated on its own); ``out`` (same shape and dtype as x), when given, receives
    the result.
    """
    check_instance("inverse", inverse, bool)
    check_instance("batch_invariant", batch_invariant, bool)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 2 or x.shape[-1] % 2:
        raise InputError(
            f"x: expected shape (T, ..., rope_dim) with an even rope_dim, got {tuple(x.shape)}"
        )
    check_dtype("freqs", freqs, FLOAT_DTYPES)
    check_shape("freqs", freqs, (x.shape[-1] // 2,))
    check_positions("positions", positions, x.shape[0])
    cd = compute_dtype(x.dtype)
    angle = positions.to(cd)[:, None] * freqs.to(device=x.device, dtype=cd)[None, :]  # (T, Dr/2)
    if inverse:
        angle = -angle
    angle = angle.view(x.shape[0], *([1] * (x.dim() - 2)), freqs.shape[0])  # broadcast over heads
    cos, sin = torch.cos(angle), torch.sin(angle)
    pairs = x.to(cd).unflatten(-1, (-1, 2))  # (T, ..., Dr/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return _written(out, rotated.flatten(-2).to(x.dtype))


def _written(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """``y``, or ``out`` (same shape and dtype) holding a copy of it."""
    if out is None:
        return y
    if not isinstance(out, torch.Tensor) or out.shape != y.shape or out.dtype != y.dtype:
        raise InputError(
            f"out: expected a tensor of shape {tuple(y.shape)} and dtype {y.dtype}, got "
            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
        )
    return out.copy_(y)
