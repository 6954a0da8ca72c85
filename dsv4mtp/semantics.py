"""The semantics switches of the MTP layer and the presets that bundle them.

Every documented divergence between DeepSeek's release and vLLM is a switch; a preset bundles
them.  The table and the math behind each switch are in ``docs/semantics.md`` ("Presets and
switches").  Both implementations read the same :class:`Semantics`; ``math`` is the exact math on
dequantized weights, the float64 oracle the others are compared against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from dsv4mtp.errors import ConfigError

__all__ = ["PRESETS", "NormOrder", "RopeMode", "Semantics", "resolve_semantics"]

NormOrder = Literal["official", "vllm"]
RopeMode = Literal["plain", "yarn"]


@dataclass(frozen=True)
class Semantics:
    """The switches of ``docs/semantics.md`` ("Presets and switches")."""

    mask_pos0: bool = False
    rope_mode: RopeMode = "plain"
    norm_order: NormOrder = "official"
    shared_clamp: bool = True
    fp8_kv: bool = False
    act_quant: bool = False


PRESETS: dict[str, Semantics] = {
    "math": Semantics(),
    "official": Semantics(fp8_kv=True, act_quant=True),
    "vllm": Semantics(
        mask_pos0=True, rope_mode="yarn", norm_order="vllm", fp8_kv=True, act_quant=True
    ),
}

_CHOICES: dict[str, tuple[Any, ...]] = {
    "mask_pos0": (False, True),
    "rope_mode": ("plain", "yarn"),
    "norm_order": ("official", "vllm"),
    "shared_clamp": (False, True),
    "fp8_kv": (False, True),
    "act_quant": (False, True),
}


def resolve_semantics(preset: str = "math", **switches: Any) -> Semantics:
    """A preset from :data:`PRESETS` with individual switches overridden."""
    if not isinstance(preset, str) or preset not in PRESETS:  # a list would not even hash
        raise ConfigError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    for name, value in switches.items():
        if name not in _CHOICES:
            raise ConfigError(f"{name}: not a semantics switch; expected one of {sorted(_CHOICES)}")
        if not any(value == c and type(value) is type(c) for c in _CHOICES[name]):
            raise ConfigError(f"{name}: expected one of {list(_CHOICES[name])}, got {value!r}")
    return dataclasses.replace(PRESETS[preset], **switches)
