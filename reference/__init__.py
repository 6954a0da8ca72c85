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
from .checkpoint_names import MTPWeightName, remap_mtp_weight_name
from .checkpoint_weights import (
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

# --- MTP layer: attention, MoE, RoPE, presets (issue 4) ---
from .attention import AttentionParams, KVCache, attention, sink_attention  # noqa: E402
from .moe import DenseExperts, MoEParams, PackedExperts, moe, route, swiglu_expert  # noqa: E402
from .mtp import PRESETS, MTPLayer, MTPLayerParams, Semantics, resolve_semantics  # noqa: E402
from .quant_sim import fp8_block_roundtrip  # noqa: E402
from .rope import apply_rope, rope_frequencies  # noqa: E402

__all__ += [
    "PRESETS",
    "AttentionParams",
    "DenseExperts",
    "KVCache",
    "MTPLayer",
    "MTPLayerParams",
    "MoEParams",
    "PackedExperts",
    "Semantics",
    "apply_rope",
    "attention",
    "fp8_block_roundtrip",
    "moe",
    "resolve_semantics",
    "rope_frequencies",
    "route",
    "sink_attention",
    "swiglu_expert",
]

# --- checkpoint layer (loader, NVFP4 fold, synthetic checkpoints) ---
from .checkpoint import ExpertFormatWarning, load_mtp_checkpoint  # noqa: E402
from .checkpoint_io import write_sharded_checkpoint  # noqa: E402
from .nvfp4 import (  # noqa: E402
    MoEWeightPackSpec,
    apply_routing_padding_mask,
    fold_nvfp4_experts,
    fold_nvfp4_gate_up_scales,
)
from .synthetic import make_synthetic_checkpoint  # noqa: E402

__all__ += [
    "ExpertFormatWarning",
    "MoEWeightPackSpec",
    "apply_routing_padding_mask",
    "fold_nvfp4_experts",
    "fold_nvfp4_gate_up_scales",
    "load_mtp_checkpoint",
    "make_synthetic_checkpoint",
    "write_sharded_checkpoint",
]

# --- checkpoint number formats: E4M3 / E2M1 / E8M0, FP8 block, MXFP4, NVFP4 ---
from .formats import (  # noqa: E402
    E2M1_VALUES,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
    pack_e2m1,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_e2m1,
)

__all__ += [
    "E2M1_VALUES",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e8m0",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "encode_e2m1",
    "encode_e4m3",
    "encode_e8m0",
    "pack_e2m1",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "unpack_e2m1",
]

# --- checkpoint inspection (dsv4-mtp inspect) and draft drift (dsv4-mtp compare) ---
from .checkpoint_report import CheckpointReport, Finding, inspect_checkpoint  # noqa: E402
from .drift import DriftReport, compare_checkpoints  # noqa: E402

__all__ += [
    "CheckpointReport",
    "DriftReport",
    "Finding",
    "compare_checkpoints",
    "inspect_checkpoint",
]
