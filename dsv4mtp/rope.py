"""RoPE frequency table of the MTP layer (docs/semantics.md, "Attention with sinks", "RoPE").

Shared core so that both implementations build the same table: plain ``f_i = base**(-2i/Dr)`` (the
official code's, the MTP layer having compress ratio 0) or DeepSeek-YaRN interpolated (vLLM's; the
``rope_mode`` switch, docs/semantics.md "Presets and switches").
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dsv4mtp.checks import FLOAT_DTYPES, check_device_arg, check_dtype_arg, check_int, check_number
from dsv4mtp.errors import ConfigError
from dsv4mtp.semantics import RopeMode

__all__ = ["rope_frequencies"]


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
