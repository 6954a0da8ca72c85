"""Rotary position embedding of the MTP layer (``docs/semantics.md``, "Attention with sinks").

GPT-J / interleaved layout: pairs ``(x[2i], x[2i+1])`` of the last ``qk_rope_head_dim`` dims are
rotated by ``pos * f_i``.  The MTP layer has compress ratio 0, so the official code uses plain
RoPE with ``base = rope_theta``; vLLM keeps DeepSeek-YaRN frequency interpolation (the
``rope_mode`` switch, ``docs/semantics.md``, "Presets and switches").  Both are offered
(``mode="plain" | "yarn"``); the cos/sin magnitude factor is 1 in both.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_device_arg,
    check_dtype,
    check_dtype_arg,
    check_instance,
    check_int,
    check_number,
    check_positions,
    check_shape,
    compute_dtype,
)
from dsv4mtp.errors import ConfigError, InputError
from dsv4mtp.semantics import RopeMode

__all__ = ["RopeMode", "apply_rope", "rope_frequencies"]


def _yarn_ramp(
    rope_dim: int, base: float, scaling: dict[str, Any], dtype: torch.dtype
) -> torch.Tensor:
    """ramp_i in [0, 1] per pair i: 0 keeps f_i, 1 divides it by ``factor``."""
    original = float(scaling.get("original_max_position_embeddings", 65536))
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        # the pair index whose wavelength fits `rotations` times into the original context
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = float(max(math.floor(correction_dim(beta_fast)), 0))
    high = float(min(math.ceil(correction_dim(beta_slow)), rope_dim - 1))
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pair = torch.arange(rope_dim // 2, dtype=dtype)
    return ((pair - low) / (high - low)).clamp(0, 1)


def rope_frequencies(
    rope_dim: int,
    base: float,
    *,
    mode: RopeMode = "plain",
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Angular frequency per pair, ``f_i = base**(-2i/rope_dim)`` (YaRN-interpolated in "yarn").

    Returns ``(rope_dim // 2,)`` in ``dtype`` (fp32 as the official table; float64 for the oracle).
    """
    if mode not in ("plain", "yarn"):
        raise ConfigError(f"rope_mode: expected 'plain' or 'yarn', got {mode!r}")
    check_int("rope_dim", rope_dim, 2)
    check_number("base", base, positive=True)
    check_dtype_arg("dtype", dtype, FLOAT_DTYPES)
    if device is not None:
        device = check_device_arg("device", device)
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ConfigError(
            f"rope_scaling: expected a dict or None, got {type(rope_scaling).__name__}"
        )
    if rope_dim % 2:
        raise ConfigError(f"qk_rope_head_dim: expected an even number, got {rope_dim}")
    pair_dims = torch.arange(0, rope_dim, 2, dtype=dtype, device=device)
    freqs = 1.0 / (base ** (pair_dims / rope_dim))  # (Dr/2,)
    if mode == "plain":
        return freqs
    if not rope_scaling or float(rope_scaling.get("factor", 1.0)) <= 1.0:
        raise ConfigError(
            f"rope_scaling: rope_mode='yarn' needs a YaRN factor > 1, got {rope_scaling!r}"
        )
    factor = float(rope_scaling["factor"])
    ramp = _yarn_ramp(rope_dim, base, rope_scaling, dtype).to(freqs.device)
    return freqs / factor * ramp + freqs * (1 - ramp)


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
