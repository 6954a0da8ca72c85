"""The MTP layer's parameters, once: checkpoint name, field, shape, kind, parallel rule, init.

Every consumer loops over :data:`MTP_LAYER_PARAMS` instead of listing the parameters itself:
the loader (expected names, dtypes and shapes, reading, TP/EP slicing), ``dsv4-mtp inspect``,
the synthetic writer, the drift groups of ``dsv4-mtp compare``, the fields of
:class:`~dsv4mtp.checkpoint.weights.MTPLayerWeights` (checked against the table by the tests) and
:func:`~dsv4mtp.params.build_layer_params`.  Names and layout: ``docs/semantics.md``, section
"Checkpoint names and layout".

One row per parameter of MTP layer ``mtp.{i}``:

=========  =========================================================================================
column     meaning
=========  =========================================================================================
name       checkpoint name relative to ``mtp.{i}.``; a linear adds ``.weight`` / ``.scale``, the
           routed experts are ``ffn.experts.{e}.{w}.<suffix>`` (:data:`EXPERT_WEIGHTS`)
field      attribute of :class:`~dsv4mtp.checkpoint.weights.MTPLayerWeights`
kind       ``linear``: dense (out, in) weight, FP8 128x128 block-quantized or unquantized (the
           format is detected per tensor); ``plain``: norms, router weight and bias, attention
           sink, any float dtype; ``mhc``: the ``hc_*`` mixing parameters, float32 in real
           checkpoints, checked like ``plain``; ``experts``: the routed experts (format detected
           per layer); ``shared``: the LM head, which the layer may carry itself or share with
           the target (``target``)
shape      logical shape as a function of the config (a linear's (out, in); the checkpoint's
           global shape, before TP slicing)
tp         ``replicated``, or ``heads``: dim 0 narrowed to the TP rank's heads on loading
ep         ``replicated``, or ``experts``: EP rank r of s loads experts [r E/s, (r+1) E/s)
group      drift group of ``dsv4-mtp compare`` (parameters of one group are compared together)
param      where :func:`~dsv4mtp.params.build_layer_params` puts the dense value
           (``attn.x`` / ``ffn.x``: a field of AttentionParams / MoEParams)
init       how the synthetic writer draws it (:class:`Init`)
=========  =========================================================================================

Order: the synthetic writer draws in table order, so reordering the rows changes every synthetic
checkpoint of a given seed (and the numbers measured on them).  That is why the rows follow the
writer rather than the math.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from dsv4mtp.config import DSV4Config

__all__ = [
    "EMBED",
    "EXPERT_WEIGHTS",
    "MTP_LAYER_PARAMS",
    "Init",
    "ParamSpec",
    "expert_shape",
    "param_spec",
    "shared_params",
]

Kind = Literal["linear", "plain", "mhc", "experts", "shared"]
Shape = Callable[[DSV4Config], tuple[int, ...]]


@dataclass(frozen=True)
class Init:
    """The synthetic writer's rule: N(mean, std^2) drawn in float32, then cast to ``dtype``.

    ``std=None``: 1/sqrt(fan_in) (the last dim), so a linear keeps activations O(1).  ``std=0``:
    the constant ``mean``, drawing nothing from the generator.
    """

    std: float | None
    mean: float = 0.0
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class ParamSpec:
    """One row of :data:`MTP_LAYER_PARAMS` (columns in the module docstring)."""

    name: str
    field: str
    kind: Kind
    shape: Shape
    group: str
    param: str
    init: Init
    tp: Literal["replicated", "heads"] = "replicated"
    ep: Literal["replicated", "experts"] = "replicated"
    target: str = ""  # shared kind: the target model's tensor used when mtp.{i} has none


FAN_IN = Init(None)
NORM = Init(0.1, mean=1.0, dtype=torch.bfloat16)  # RMSNorm weight near 1
HC_FN = Init(0.02)  # small mixing logits: hc_pre / hc_post start near uniform
ZEROS = Init(0.0)
ONES = Init(0.0, mean=1.0)


# Shapes, as functions of the config: D hidden, n hc_mult, M = (2 + n) n mixing rows, H heads,
# Dh head_dim (one KV head), Rq q_lora_rank, G o_groups, Ro o_lora_rank, E experts,
# I moe_intermediate_size, V vocab.
def _d(c: DSV4Config) -> tuple[int, ...]:
    return (c.hidden_size,)


def _dd(c: DSV4Config) -> tuple[int, ...]:
    return (c.hidden_size, c.hidden_size)


def _vd(c: DSV4Config) -> tuple[int, ...]:
    return (c.vocab_size, c.hidden_size)


def _rq(c: DSV4Config) -> tuple[int, ...]:
    return (c.q_lora_rank,)


def _dh(c: DSV4Config) -> tuple[int, ...]:
    return (c.head_dim,)


def _wq_a(c: DSV4Config) -> tuple[int, ...]:
    return (c.q_lora_rank, c.hidden_size)


def _wkv(c: DSV4Config) -> tuple[int, ...]:
    return (c.head_dim, c.hidden_size)


def _wq_b(c: DSV4Config) -> tuple[int, ...]:
    return (c.num_attention_heads * c.head_dim, c.q_lora_rank)


def _wo_a(c: DSV4Config) -> tuple[int, ...]:
    """Grouped output LoRA: each of G groups maps its H/G heads (H Dh / G) to Ro."""
    return (c.o_groups * c.o_lora_rank, c.num_attention_heads * c.head_dim // c.o_groups)


def _wo_b(c: DSV4Config) -> tuple[int, ...]:
    return (c.hidden_size, c.o_groups * c.o_lora_rank)


def _gate_up(c: DSV4Config) -> tuple[int, ...]:
    return expert_shape(c, "w1")


def _down(c: DSV4Config) -> tuple[int, ...]:
    return expert_shape(c, "w2")


def _heads(c: DSV4Config) -> tuple[int, ...]:
    return (c.num_attention_heads,)


def _e(c: DSV4Config) -> tuple[int, ...]:
    return (c.n_routed_experts,)


def _ed(c: DSV4Config) -> tuple[int, ...]:
    return (c.n_routed_experts, c.hidden_size)


def _norm(name: str, field: str, param: str, shape: Shape = _d) -> ParamSpec:
    return ParamSpec(name, field, "plain", shape, name.removesuffix(".weight"), param, NORM)


def _mhc(site: str, part: str) -> ParamSpec:
    """``hc_{site}_{part}``: rows n for hc_head (one weight per residual copy), M for the attn and
    ffn sites (pre, post and residual mixes); fn (rows, n D), base (rows,), scale (1,) for
    hc_head, else (3,) one per mix."""
    name = f"hc_{site}_{part}"

    def shape(c: DSV4Config) -> tuple[int, ...]:
        rows = c.hc_mult if site == "head" else c.hc_mix
        sizes = {"fn": (rows, c.hc_dim), "base": (rows,), "scale": (1 if site == "head" else 3,)}
        return sizes[part]

    init = {"fn": HC_FN, "base": ZEROS, "scale": ONES}[part]
    return ParamSpec(name, name, "mhc", shape, f"hc_{site}", name, init)


def _linear(name: str, field: str, param: str, shape: Shape) -> ParamSpec:
    return ParamSpec(name, field, "linear", shape, name, param, FAN_IN)


# Routed-expert projections in the checkpoint's (and vLLM's mapping table's) order, logical
# (out, in): w1 gate and w3 up (I, D), w2 down (D, I).  Stacked per expert as w13 = [w1; w3].
EXPERT_WEIGHTS: tuple[str, ...] = ("w1", "w2", "w3")


def expert_shape(config: DSV4Config, w: str) -> tuple[int, int]:
    """Logical (out, in) of routed-expert projection ``w`` ("w1", "w2" or "w3")."""
    D, I = config.hidden_size, config.moe_intermediate_size
    return (D, I) if w == "w2" else (I, D)


# fmt: off
MTP_LAYER_PARAMS: tuple[ParamSpec, ...] = (
    #       name                      field         param            shape
    _norm("enorm.weight",             "enorm",      "enorm"),  # the embedding's norm
    _norm("hnorm.weight",             "hnorm",      "hnorm"),  # the target residual's norm
    _norm("norm.weight",              "norm",       "norm"),   # before hc_head's output, the head
    _mhc("head", "fn"), _mhc("head", "base"), _mhc("head", "scale"),
    _mhc("attn", "fn"), _mhc("attn", "base"), _mhc("attn", "scale"),
    _mhc("ffn", "fn"), _mhc("ffn", "base"), _mhc("ffn", "scale"),
    _norm("attn_norm.weight",         "attn_norm",  "attn_norm"),
    _norm("ffn_norm.weight",          "ffn_norm",   "ffn_norm"),
    _linear("e_proj",                 "e_proj",     "e_proj",        _dd),
    _linear("h_proj",                 "h_proj",     "h_proj",        _dd),
    _linear("attn.wq_a",              "wq_a",       "attn.wq_a",     _wq_a),
    _linear("attn.wkv",               "wkv",        "attn.wkv",      _wkv),
    _linear("attn.wq_b",              "wq_b",       "attn.wq_b",     _wq_b),  # per head [nope|rope]
    _linear("attn.wo_a",              "wo_a",       "attn.wo_a",     _wo_a),
    _linear("attn.wo_b",              "wo_b",       "attn.wo_b",     _wo_b),
    _linear("ffn.shared_experts.w1",  "shared_w1",  "ffn.shared_w1", _gate_up),
    _linear("ffn.shared_experts.w3",  "shared_w3",  "ffn.shared_w3", _gate_up),
    _linear("ffn.shared_experts.w2",  "shared_w2",  "ffn.shared_w2", _down),
    _norm("attn.q_norm.weight",       "q_norm",     "attn.q_norm",   _rq),
    _norm("attn.kv_norm.weight",      "kv_norm",    "attn.kv_norm",  _dh),
    # One learned logit per head: the only TP-sliced parameter, as vLLM loads it.
    ParamSpec("attn.attn_sink", "attn_sink", "plain", _heads, "attn.attn_sink", "attn.attn_sink",
              Init(1.0), tp="heads"),
    ParamSpec("ffn.gate.weight", "gate_weight", "plain", _ed, "ffn.gate", "ffn.gate_weight",
              Init(None, dtype=torch.bfloat16)),
    # vLLM's e_score_correction_bias: shifts which experts are selected, not their weights.
    ParamSpec("ffn.gate.bias", "e_score_correction_bias", "plain", _e, "ffn.gate",
              "ffn.gate_bias", Init(0.1)),
    # Shape (E,): E experts of EXPERT_WEIGHTS each, named ffn.experts.{e}.{w}.<suffix>.
    ParamSpec("ffn.experts", "experts", "experts", _e, "ffn.experts", "ffn.experts", FAN_IN,
              ep="experts"),
    # The LM head: the layer's own mtp.{i}.head.weight if present, else the target's.
    ParamSpec("head.weight", "head", "shared", _vd, "head", "head",
              Init(None, dtype=torch.bfloat16), target="head.weight"),
)
# fmt: on

# The token embedding: one per checkpoint (MTPCheckpoint.embed_tokens), taken from mtp.0 when it
# carries a copy, else the target's.
EMBED = ParamSpec(
    "emb.tok_emb.weight",
    "embed_tokens",
    "shared",
    _vd,
    "embed",
    "embed",
    Init(1.0, dtype=torch.bfloat16),
    target="embed.weight",
)

_BY_NAME = {spec.name: spec for spec in MTP_LAYER_PARAMS}


def param_spec(name: str) -> ParamSpec:
    """The row of checkpoint name ``name`` (relative to ``mtp.{i}.``, no ``.weight``/``.scale``
    suffix for a linear)."""
    return _BY_NAME[name]


def shared_params() -> tuple[ParamSpec, ...]:
    """Tensors an MTP layer may carry itself or share with the target: embedding, then head."""
    return (EMBED, *(s for s in MTP_LAYER_PARAMS if s.kind == "shared"))
