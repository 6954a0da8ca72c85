"""Random dense MTP weights for module tests that do not need a checkpoint.

Scales keep activations O(1): linear weights ~ N(0, 1/fan_in); ``hc_*_fn`` ~ N(0, 0.02**2),
bases 0, scales 1, ``attn_sink`` ~ N(0, 1); as the synthetic checkpoint's rows
(``dsv4mtp/checkpoint/schema.py``) except router bias ~ N(0, 1e-2**2) and head ~ N(0, 1), in
float64.  Parameters are drawn in their own fixed order (the containers' field order), which the
module tests' numbers depend on.
"""

from __future__ import annotations

import torch

from dsv4mtp.config import DSV4Config
from dsv4mtp.reference.attention import AttentionParams
from dsv4mtp.reference.moe import DenseExperts, MoEParams
from dsv4mtp.reference.mtp import MTPLayer, MTPLayerParams, resolve_semantics


def _lin(g: torch.Generator, out: int, inp: int) -> torch.Tensor:
    return torch.randn(out, inp, generator=g, dtype=torch.float64) / inp**0.5


def _norm(g: torch.Generator, d: int) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)


def random_attention_params(cfg: DSV4Config, g: torch.Generator) -> AttentionParams:
    H, Dh, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    return AttentionParams(
        wq_a=_lin(g, cfg.q_lora_rank, cfg.hidden_size),
        q_norm=_norm(g, cfg.q_lora_rank),
        wq_b=_lin(g, H * Dh, cfg.q_lora_rank),
        wkv=_lin(g, Dh, cfg.hidden_size),
        kv_norm=_norm(g, Dh),
        wo_a=_lin(g, G * cfg.o_lora_rank, H // G * Dh),
        wo_b=_lin(g, cfg.hidden_size, G * cfg.o_lora_rank),
        attn_sink=torch.randn(H, generator=g, dtype=torch.float64),
    )


def random_moe_params(cfg: DSV4Config, g: torch.Generator, *, up_gain: float = 1.0) -> MoEParams:
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    experts = DenseExperts(
        w1=torch.stack([_lin(g, I, D) for _ in range(E)]) * up_gain,
        w3=torch.stack([_lin(g, I, D) for _ in range(E)]) * up_gain,
        w2=torch.stack([_lin(g, D, I) for _ in range(E)]),
        quantized=True,  # act_quant applies, as to FP8/FP4 checkpoint experts
    )
    return MoEParams(
        gate_weight=_lin(g, E, D),
        gate_bias=1e-2 * torch.randn(E, generator=g, dtype=torch.float64),
        shared_w1=_lin(g, I, D) * up_gain,
        shared_w3=_lin(g, I, D) * up_gain,
        shared_w2=_lin(g, D, I),
        experts=experts,
        shared_quantized=True,
    )


def random_layer_params(cfg: DSV4Config, g: torch.Generator) -> MTPLayerParams:
    n, D, M = cfg.hc_mult, cfg.hidden_size, cfg.hc_mix
    z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
    o = lambda *s: torch.ones(*s, dtype=torch.float64)  # noqa: E731
    fn = lambda r: 0.02 * torch.randn(r, n * D, generator=g, dtype=torch.float64)  # noqa: E731
    return MTPLayerParams(
        enorm=_norm(g, D),
        hnorm=_norm(g, D),
        e_proj=_lin(g, D, D),
        h_proj=_lin(g, D, D),
        norm=_norm(g, D),
        head=torch.randn(cfg.vocab_size, D, generator=g, dtype=torch.float64),
        hc_head_fn=fn(n),
        hc_head_base=z(n),
        hc_head_scale=o(1),
        hc_attn_fn=fn(M),
        hc_attn_base=z(M),
        hc_attn_scale=o(3),
        hc_ffn_fn=fn(M),
        hc_ffn_base=z(M),
        hc_ffn_scale=o(3),
        attn_norm=_norm(g, D),
        ffn_norm=_norm(g, D),
        attn=random_attention_params(cfg, g),
        ffn=random_moe_params(cfg, g),
        dense_quantized=True,
    )


def random_mtp_layer(
    cfg: DSV4Config,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    preset: str = "math",
    **switches,
) -> MTPLayer:
    """An :class:`MTPLayer` with random weights, rounded to ``dtype`` where the layer keeps them."""
    g = torch.Generator().manual_seed(seed)
    layers = [random_layer_params(cfg, g) for _ in range(cfg.num_nextn_predict_layers)]
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    return MTPLayer(
        cfg, layers, embed.to(dtype), semantics=resolve_semantics(preset, **switches), dtype=dtype
    )
