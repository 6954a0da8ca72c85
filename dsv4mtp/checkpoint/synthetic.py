"""Tiny but complete DeepSeek-V4-shaped checkpoints with random weights.

A directory with config.json (real field names), sharded safetensors + index, ``mtp.{i}.*`` names
exactly as the official checkpoint (one per row of :data:`~.schema.MTP_LAYER_PARAMS`; layout in
``docs/semantics.md``, section "Checkpoint names and layout"), the target's shared
``embed.weight`` / ``head.weight`` and a few other target tensors the MTP loader must ignore.

Formats: dense linears FP8 with e8m0 block scales (float32 scales for ``expert_format="fp8"``,
like V4-Flash-Base); routed experts per ``expert_format``:

* ``mxfp4``: int8-packed e2m1 + e8m0 per 32 (``expert_dtype: fp4``, like V4-Flash);
* ``fp8``: e4m3 + float32 128x128 scales (``expert_dtype: fp8``, like V4-Flash-Base);
* ``nvfp4``: uint8-packed e2m1 + e4m3 per 16 + ``weight_scale_2`` + ``input_scale`` with ModelOpt
  metadata (``moe_quant_algo: NVFP4``, hf_quant_config.json); gate and up ``weight_scale_2``
  differ by a factor 2 (foldable), or by 3 with ``nvfp4_unfoldable=True``;
* ``bf16``: unquantized (tests only).

Every routed expert is first drawn and quantized to MXFP4, then written in the requested format
*losslessly* (NVIDIA's closed-form MXFP4 -> NVFP4 cast; power-of-two FP8 scales), so the decoded
expert weights are identical across ``mxfp4``, ``fp8``, ``nvfp4`` and ``bf16`` for one seed
(except the up halves of an unfoldable NVFP4 checkpoint, whose block scales are rounded).

Initialisation: each row's :class:`~.schema.Init` (linear weights N(0, 1/fan_in); norms
1 + N(0, 0.1^2); ``hc_*_fn`` N(0, 0.02^2), ``hc_*_base`` 0, ``hc_*_scale`` 1; ``attn_sink``
N(0, 1); router bias N(0, 0.1^2); embedding N(0, 1); head N(0, 1/D)), chosen so activations stay
O(1), routing covers the experts and the sink matters.  Tensors are drawn in table order from one
generator: the bits of a checkpoint depend on that order.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dsv4mtp import formats
from dsv4mtp.checkpoint.io import write_sharded_checkpoint
from dsv4mtp.checkpoint.schema import (
    EMBED,
    EXPERT_WEIGHTS,
    MTP_LAYER_PARAMS,
    ParamSpec,
    expert_shape,
    param_spec,
    shared_params,
)
from dsv4mtp.checkpoint.weights import FP8_BLOCK
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import ConfigError

__all__ = ["EXPERT_FORMATS", "make_synthetic_checkpoint", "synthetic_checkpoint_tensors"]

EXPERT_FORMATS = ("mxfp4", "nvfp4", "fp8", "bf16")
_FLASH_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
}
_BASE_FP8 = {  # V4-Flash-Base: float32 scales everywhere
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "activation_scheme": "dynamic",
}
_MODELOPT_PRODUCER = {"name": "modelopt", "version": "dsv4-nvfp4-experts"}


def _nvfp4_manifest(config: DSV4Config) -> dict[str, Any]:
    """ModelOpt's current-schema manifest, MTP experts included (``--include_mtp_experts``)."""
    layers = [f"layers.{i}.ffn.experts" for i in range(config.num_hidden_layers)]
    layers += [f"mtp.{i}.ffn.experts" for i in range(config.num_nextn_predict_layers)]
    return {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "quantized_layers": {k: {"quant_algo": "NVFP4", "group_size": 16} for k in layers},
        "exclude_modules": ["*.attn.*", "*.ffn.shared_experts.*", "head"],
    }


def _checkpoint_config(config: DSV4Config, expert_format: str) -> tuple[DSV4Config, dict | None]:
    """The config (expert_dtype, quantization_config) matching ``expert_format``, + hf_quant json."""
    if expert_format == "mxfp4":
        return config.replace(expert_dtype="fp4", quantization_config=dict(_FLASH_FP8)), None
    if expert_format == "fp8":
        return config.replace(expert_dtype="fp8", quantization_config=dict(_BASE_FP8)), None
    if expert_format == "bf16":
        return config.replace(expert_dtype="bf16", quantization_config=dict(_FLASH_FP8)), None
    manifest = _nvfp4_manifest(config)
    qc = {
        **_FLASH_FP8,
        "moe_quant_algo": "NVFP4",
        "producer": _MODELOPT_PRODUCER,
        **manifest,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False},
                "input_activations": {
                    "num_bits": 4,
                    "type": "float",
                    "group_size": 16,
                    "dynamic": False,
                },
            }
        },
        "ignore": manifest["exclude_modules"],
    }
    hf_quant = {"producer": _MODELOPT_PRODUCER, "quantization": manifest}
    return config.replace(expert_dtype="fp4", quantization_config=qc), hf_quant


class _Rng:
    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, dtype=torch.float32) * std + mean

    def draw(self, spec: ParamSpec, config: DSV4Config) -> torch.Tensor:
        """A tensor of ``spec``'s shape by its :class:`~.schema.Init` rule."""
        shape, init = spec.shape(config), spec.init
        if init.std == 0.0:
            return torch.full(shape, init.mean, dtype=init.dtype)
        std = shape[-1] ** -0.5 if init.std is None else init.std
        return self.normal(shape, std, init.mean).to(init.dtype)


def _fp8_linear(
    out: dict[str, torch.Tensor], name: str, w: torch.Tensor, *, float32_scales: bool
) -> None:
    """``name.weight`` e4m3 + ``name.scale`` 128x128 block scales (e8m0, or their float32 value)."""
    q, scale = formats.quantize_fp8_block(w, scale_fmt="e8m0")
    out[f"{name}.weight"] = q
    out[f"{name}.scale"] = formats.decode_e8m0(scale) if float32_scales else scale


def _experts(
    out: dict[str, torch.Tensor],
    prefix: str,
    config: DSV4Config,
    rng: _Rng,
    expert_format: str,
    nvfp4_unfoldable: bool,
) -> None:
    for e in range(config.n_routed_experts):
        mx = {}  # w -> (packed (N, K/2) uint8, e8m0 bytes (N, K/32))
        for w in EXPERT_WEIGHTS:
            n, k = expert_shape(config, w)
            mx[w] = formats.quantize_mxfp4(rng.normal((n, k), k**-0.5))
        # NVIDIA's closed-form cast: global 2^m, m = (max block exponent of the w1/w3 pair) - 8.
        k_max = {w: int(s.max()) - formats.E8M0_BIAS for w, (_, s) in mx.items()}
        m_gate = max(k_max["w1"], k_max["w3"]) - 8
        m = {"w1": m_gate, "w3": m_gate + 1, "w2": k_max["w2"] - 8}  # up/gate ratio 2: folds
        for w, (packed, e8m0) in mx.items():
            name = f"{prefix}.{e}.{w}"
            if expert_format == "mxfp4":
                out[f"{name}.weight"] = packed.view(torch.int8)  # the official checkpoint's I8
                out[f"{name}.scale"] = e8m0.view(torch.float8_e8m0fnu)
                continue
            logical = formats.dequantize_mxfp4(packed, e8m0)  # (N, K) float32, exact
            if expert_format == "bf16":
                out[f"{name}.weight"] = logical.to(torch.bfloat16)  # exact: e2m1 * 2^k
            elif expert_format == "fp8":
                _fp8_linear(out, name, logical, float32_scales=True)
            else:  # nvfp4
                exps = e8m0.to(torch.int32) - formats.E8M0_BIAS  # (N, K/32)
                scale_2 = torch.tensor(2.0 ** m[w], dtype=torch.float32)
                block = torch.exp2((exps - m[w]).float()).repeat_interleave(2, dim=1)  # (N, K/16)
                if nvfp4_unfoldable and w == "w3":
                    scale_2 = scale_2 * 1.5  # up/gate = 3: its block scales round, fold refused
                    block = block / 1.5
                out[f"{name}.weight"] = packed  # bytes unchanged by the cast
                out[f"{name}.weight_scale"] = formats.encode_e4m3(block)
                out[f"{name}.weight_scale_2"] = scale_2
                out[f"{name}.input_scale"] = torch.tensor(1.0 / 2688, dtype=torch.float32)


def synthetic_checkpoint_tensors(
    config: DSV4Config,
    *,
    expert_format: str = "mxfp4",
    seed: int = 0,
    nvfp4_unfoldable: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any] | None]:
    """``(tensors, config.json dict, hf_quant_config.json dict or None)`` of a synthetic checkpoint.

    For tests that edit a checkpoint before writing it with
    :func:`~.io.write_sharded_checkpoint`.
    """
    if expert_format not in EXPERT_FORMATS:
        raise ConfigError(f"expert_format: expected one of {EXPERT_FORMATS}, got {expert_format!r}")
    if nvfp4_unfoldable and expert_format != "nvfp4":
        raise ConfigError(
            f"nvfp4_unfoldable: only for expert_format 'nvfp4', got {expert_format!r}"
        )
    c, hf_quant = _checkpoint_config(config, expert_format)
    rng = _Rng(seed)
    # The target model's tensors: the shared embedding first, then a few the loader must ignore,
    # each drawn like its MTP namesake.
    out: dict[str, torch.Tensor] = {EMBED.target: rng.draw(EMBED, c)}
    for name, like in (
        ("layers.0.attn_norm.weight", "attn_norm.weight"),
        ("layers.0.ffn.gate.bias", "ffn.gate.bias"),
        (f"layers.{c.num_hidden_layers - 1}.ffn_norm.weight", "ffn_norm.weight"),
        ("hc_head_fn", "hc_head_fn"),
        ("norm.weight", "norm.weight"),
    ):
        out[name] = rng.draw(param_spec(like), c)
    for i in range(c.num_nextn_predict_layers):
        p = f"mtp.{i}."
        for spec in MTP_LAYER_PARAMS:
            if spec.kind == "linear":  # FP8 as in the official checkpoint
                w = rng.draw(spec, c)
                _fp8_linear(out, p + spec.name, w, float32_scales=expert_format == "fp8")
            elif spec.kind == "experts":
                _experts(out, p + spec.name, c, rng, expert_format, nvfp4_unfoldable)
            elif spec.kind != "shared":  # the layer shares the target's head: no copy
                out[p + spec.name] = rng.draw(spec, c)
    for spec in shared_params():
        if spec is not EMBED:
            out[spec.target] = rng.draw(spec, c)
    return out, c.to_hf_config(), hf_quant


def make_synthetic_checkpoint(
    path: str | os.PathLike[str],
    config: DSV4Config | None = None,
    *,
    expert_format: str = "mxfp4",
    seed: int = 0,
    nvfp4_unfoldable: bool = False,
    num_shards: int = 2,
) -> str:
    """Write a synthetic checkpoint directory (module docstring) and return its path.

    ``config`` defaults to :meth:`DSV4Config.tiny`; its ``expert_dtype`` and
    ``quantization_config`` are replaced to match ``expert_format``.  Deterministic in ``seed``.
    """
    tensors, config_dict, hf_quant = synthetic_checkpoint_tensors(
        config or DSV4Config.tiny(),
        expert_format=expert_format,
        seed=seed,
        nvfp4_unfoldable=nvfp4_unfoldable,
    )
    return write_sharded_checkpoint(
        path, tensors, config_dict, num_shards=num_shards, hf_quant_config=hf_quant
    )
