"""Readable, CPU-runnable PyTorch reference of the DeepSeek-V4 MTP draft layer: the oracle.

Runs in bfloat16, float32 or float64.  The modules here hold only the math (``norm``, ``mhc``,
``rope``, ``linear``, ``quant_sim``, ``attention``, ``moe``, ``mtp``); config, formats, parameter
containers, checkpoint loading and the tools live in the shared core (``dsv4mtp.*``) and are
re-exported below, grouped by concept, so ``dsv4mtp.reference`` stays one import.  Nothing here
imports ``dsv4mtp.optimized``.  The math every module implements, with its precisions and
reasons, is written out in ``docs/semantics.md``.
"""

# ruff: noqa: I001  (grouped by concept, not alphabetically)

# --- errors and config (core)
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import CheckpointError, ConfigError, DSV4Error, FoldError, InputError

# --- number formats: E4M3 / E2M1 / E8M0, FP8 block, MXFP4, NVFP4 (core)
from dsv4mtp import formats
from dsv4mtp.formats import (
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

# --- the ops of the oracle
from .norm import embed_norms, rms_norm
from .mhc import hc_head, hc_post, hc_post_head, hc_post_pre, hc_pre, sinkhorn
from .rope import apply_rope, rope_frequencies
from .linear import eh_proj, grouped_linear, linear
from .quant_sim import fp8_block_roundtrip
from .attention import (
    attention,
    kv_norm_rope,
    q_head_norm_rope,
    sink_attention,
    sink_attention_cache,
    sink_attention_varlen,
)
from .moe import fused_experts, moe, route, swiglu_expert

# --- the layer: parameters, KV cache, semantics switches (core) and the reference MTPLayer
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.params import AttentionParams, DenseExperts, MoEParams, MTPLayerParams, PackedExperts
from dsv4mtp.semantics import PRESETS, Semantics, resolve_semantics
from .mtp import MTPLayer

# --- checkpoints: names, loading, the loaded objects, the NVFP4 fold, synthetic ones (core)
from dsv4mtp.checkpoint.io import write_sharded_checkpoint
from dsv4mtp.checkpoint.load import ExpertFormatWarning, load_mtp_checkpoint
from dsv4mtp.checkpoint.names import MTPWeightName, remap_mtp_weight_name
from dsv4mtp.checkpoint.nvfp4 import (
    MoEWeightPackSpec,
    apply_routing_padding_mask,
    fold_nvfp4_experts,
    fold_nvfp4_gate_up_scales,
)
from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint
from dsv4mtp.checkpoint.weights import (
    MTPCheckpoint,
    MTPLayerWeights,
    QuantizedWeight,
    RoutedExperts,
)

# --- tools: checkpoint inspection (dsv4-mtp inspect) and draft drift (dsv4-mtp compare)
from dsv4mtp.checkpoint.report import CheckpointReport, Finding, inspect_checkpoint
from dsv4mtp.tools.drift import DriftReport, compare_checkpoints

__all__ = [
    "E2M1_VALUES",
    "PRESETS",
    "AttentionParams",
    "CheckpointError",
    "CheckpointReport",
    "ConfigError",
    "DSV4Config",
    "DSV4Error",
    "DenseExperts",
    "DriftReport",
    "ExpertFormatWarning",
    "Finding",
    "FoldError",
    "InputError",
    "KVCache",
    "MTPCheckpoint",
    "MTPLayer",
    "MTPLayerParams",
    "MTPLayerWeights",
    "MTPWeightName",
    "MoEParams",
    "MoEWeightPackSpec",
    "PackedExperts",
    "QuantizedWeight",
    "RoutedExperts",
    "Semantics",
    "apply_rope",
    "apply_routing_padding_mask",
    "attention",
    "compare_checkpoints",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e8m0",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "eh_proj",
    "embed_norms",
    "encode_e2m1",
    "encode_e4m3",
    "encode_e8m0",
    "fold_nvfp4_experts",
    "fold_nvfp4_gate_up_scales",
    "formats",
    "fp8_block_roundtrip",
    "fused_experts",
    "grouped_linear",
    "hc_head",
    "hc_post",
    "hc_post_head",
    "hc_post_pre",
    "hc_pre",
    "inspect_checkpoint",
    "kv_norm_rope",
    "linear",
    "load_mtp_checkpoint",
    "make_synthetic_checkpoint",
    "moe",
    "pack_e2m1",
    "q_head_norm_rope",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "remap_mtp_weight_name",
    "resolve_semantics",
    "rms_norm",
    "rope_frequencies",
    "route",
    "sink_attention",
    "sink_attention_cache",
    "sink_attention_varlen",
    "sinkhorn",
    "swiglu_expert",
    "unpack_e2m1",
    "write_sharded_checkpoint",
]

# --- the shared LM head: logits and greedy ids
from .lm_head import lm_head_argmax, lm_head_logits

__all__ += ["lm_head_argmax", "lm_head_logits"]

# --- decode attention over a paged KV cache (an engine's block table)
from .attention import sink_attention_paged  # noqa: E402

__all__ += ["sink_attention_paged"]

# --- the decode step's input guard (the checks a captured step runs on the device)
from .step_guard import step_guard  # noqa: E402

__all__ += ["step_guard"]
