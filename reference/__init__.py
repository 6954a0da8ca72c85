"""Readable, CPU-runnable PyTorch reference of the DeepSeek-V4 MTP draft layer.

Runs in bfloat16, float32 or float64.  Nothing here imports ``dsv4mtp.optimized``.
"""

from .config import DSV4Config
from .errors import CheckpointError, ConfigError, DSV4Error, FoldError, InputError
from .mhc import hc_head, hc_post, hc_pre, sinkhorn
from .norm import rms_norm

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DSV4Config",
    "DSV4Error",
    "FoldError",
    "InputError",
    "hc_head",
    "hc_post",
    "hc_pre",
    "rms_norm",
    "sinkhorn",
]

# --- checkpoint layer (names, loaded object) ---
from .checkpoint_names import MTPWeightName, remap_mtp_weight_name  # noqa: E402
from .checkpoint_weights import (  # noqa: E402
    MTPCheckpoint,
    MTPLayerWeights,
    QuantizedWeight,
    RoutedExperts,
)

__all__ += [
    "MTPCheckpoint",
    "MTPLayerWeights",
    "MTPWeightName",
    "QuantizedWeight",
    "RoutedExperts",
    "remap_mtp_weight_name",
]
