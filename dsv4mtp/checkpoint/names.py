"""Checkpoint name -> vLLM parameter name for the MTP layers: a pure function of names and config.

Reproduces vLLM's ``DeepSeekV4MTP.load_weights`` (``deepseek_v4_mtp.py``) step by step, with
its replace-all substring semantics, but without tensors, so that every branch can be tested on
names alone (layout: ``docs/semantics.md``, section "Checkpoint names and layout").  The loader
(:mod:`.load`) uses the ``kind`` and ``skip_reason`` this module reports;
:func:`remap_mtp_weight_name` is the public view, and ``MTPLayerWeights.state_dict`` takes its
names from it.

Steps for a checkpoint name (first matching rule wins inside a table):

1. MTP index ``i`` = the first dotted field that parses as an int (0 if none).
2. ``mtp.{i}.`` -> ``model.layers.{N+i}.`` (N = num_hidden_layers), every occurrence.
3. Not ``model.layers.{N..N+M-1}.*`` -> not an MTP weight (None).
4. ``RENAMES`` substring table (in order).
5. ``LAYER_LEVEL`` names stay on the layer; ``embed_tokens`` moves to the top (``model.``);
   anything else goes under ``.mtp_block.``.
6. Shared (top-level) weights are taken from the first MTP layer only.
7. ``.scale`` -> ``.weight_scale`` for routed-expert scales when ``expert_dtype == "fp4"``,
   otherwise ``.weight_scale_inv``.
8. ``STACKED`` table (never for routed experts): fused param + shard id.
9. Routed experts: ``expert_params_mapping`` table -> ``experts.w13_*`` / ``experts.w2_*`` +
   expert id + shard "w1"/"w2"/"w3".
10. ``attn_sink`` (the loader narrows it by TP rank).
11. ``DIRECT_RENAMES``: ``.shared_experts.w2`` -> ``.down_proj``; trailing ``.ffn.gate.bias`` ->
    ``.ffn.gate.e_score_correction_bias``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from dsv4mtp.config import DSV4Config

__all__ = [
    "DIRECT_RENAMES",
    "LAYER_LEVEL",
    "RENAMES",
    "STACKED",
    "MTPWeightName",
    "classify_mtp_weight_name",
    "expert_params_mapping",
    "mtp_index_of",
    "remap_mtp_weight_name",
]

# Step 4: (checkpoint substring, parameter substring), applied in order, replace-all.
RENAMES: tuple[tuple[str, str], ...] = (
    (".emb.tok_emb.weight", ".embed_tokens.weight"),
    (".head.weight", ".shared_head.head.weight"),
    (".norm.weight", ".shared_head.norm.weight"),
)
# Step 5: names containing one of these stay on the MTP layer (first hit wins); the ones in
# SHARED additionally move to the top level.
LAYER_LEVEL: tuple[str, ...] = (
    "embed_tokens",
    "enorm",
    "hnorm",
    "h_proj",
    "e_proj",
    "shared_head",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
)
SHARED: tuple[str, ...] = ("embed_tokens",)
# Step 8: (fused parameter substring, checkpoint substring, shard id).
STACKED: tuple[tuple[str, str, int], ...] = (
    ("gate_up_proj", "w1", 0),
    ("gate_up_proj", "w3", 1),
    ("attn.fused_wqa_wkv", "attn.wq_a", 0),
    ("attn.fused_wqa_wkv", "attn.wkv", 1),
)
# Step 11: replace-all renames of the plain branch; and the suffix rename of the router bias.
DIRECT_RENAMES: tuple[tuple[str, str], ...] = ((".shared_experts.w2", ".shared_experts.down_proj"),)
GATE_BIAS = (".ffn.gate.bias", ".bias", ".e_score_correction_bias")

_EXPERT_SCALE_RE = re.compile(r"\.experts\.\d+\.w[123]\.scale$")
_EXPERT_KEY_RE = re.compile(r"experts\.(\d+)\.(w[123])\.")


@functools.lru_cache(maxsize=8)
def expert_params_mapping(num_experts: int) -> tuple[tuple[str, str, int, str], ...]:
    """vLLM's mega-MoE expert table: ``(param prefix, checkpoint substring, expert, shard)``.

    Three rows per expert in the order w1, w2, w3; the checkpoint substring has a leading
    ``experts.`` and a trailing dot so ``experts.7.w1.`` never matches ``experts.17.w1.``.
    """
    rows = []
    for e in range(num_experts):
        for shard in ("w1", "w2", "w3"):
            prefix = "experts.w2_" if shard == "w2" else "experts.w13_"
            rows.append((prefix, f"experts.{e}.{shard}.", e, shard))
    return tuple(rows)


@functools.lru_cache(maxsize=8)
def _expert_lookup(num_experts: int) -> dict[str, tuple[str, int, str]]:
    return {sub: (prefix, e, shard) for prefix, sub, e, shard in expert_params_mapping(num_experts)}


@dataclass(frozen=True)
class MTPWeightName:
    """Where one checkpoint tensor goes.

    param_name: vLLM's parameter name (``model.layers.{L}....`` or ``model.embed_tokens.weight``)
    shard_id: None; 0/1 for stacked params; "w1"/"w2"/"w3" for routed experts
    expert_id: global routed-expert id, else None
    mtp_index: i of ``mtp.{i}``; layer_id: N + i
    kind: "layer" (on the MTP layer), "shared" (top level), "stacked", "expert", "sink", "direct"
    """

    param_name: str
    shard_id: int | str | None
    expert_id: int | None
    mtp_index: int
    layer_id: int
    kind: str


@dataclass(frozen=True)
class _Skip:
    reason: str


def mtp_index_of(name: str) -> int:
    """Step 1: the first dotted field that parses as an int, else 0 (vLLM's rule)."""
    for part in name.split("."):
        try:
            return int(part)
        except ValueError:
            continue
    return 0


def _spec_layer(name: str, config: DSV4Config) -> int | None:
    """Step 3 (``get_spec_layer_idx_from_weight_name``)."""
    for layer_id in config.mtp_layer_ids:
        if name.startswith(f"model.layers.{layer_id}."):
            return layer_id
    return None


def classify_mtp_weight_name(name: str, config: DSV4Config) -> MTPWeightName | _Skip:
    """The full decision for one name: a mapping, or a skip with the reason (for the loader)."""
    n_main = config.num_hidden_layers
    i = mtp_index_of(name)
    n = name.replace(f"mtp.{i}.", f"model.layers.{n_main + i}.")
    layer_id = _spec_layer(n, config)
    if layer_id is None:
        if name.startswith("mtp."):
            return _Skip(
                f"MTP index {i} outside the configured num_nextn_predict_layers="
                f"{config.num_nextn_predict_layers}"
            )
        return _Skip("not an MTP weight")
    for old, new in RENAMES:
        n = n.replace(old, new)

    prefix = f"model.layers.{layer_id}."
    hit = next((w for w in LAYER_LEVEL if w in n), None)
    if hit is None:
        n = n.replace(prefix, prefix + "mtp_block.")
    elif hit in SHARED:
        n = n.replace(prefix, "model.")
    if layer_id != n_main and ".layers" not in n:
        return _Skip("shared weight of a later MTP layer (taken from the first one)")

    if n.endswith(".scale"):
        if _EXPERT_SCALE_RE.search(n):
            suffix = ".weight_scale" if config.expert_dtype == "fp4" else ".weight_scale_inv"
        else:
            suffix = ".weight_scale_inv"
        n = n.removesuffix(".scale") + suffix

    def result(param: str, kind: str, shard: int | str | None = None, expert: int | None = None):
        return MTPWeightName(param, shard, expert, layer_id - n_main, layer_id, kind)

    if ".experts." not in n:
        for param, sub, shard_id in STACKED:
            if sub in n:
                return result(n.replace(sub, param), "stacked", shard_id)
    else:
        lookup = _expert_lookup(config.n_routed_experts)
        for m in _EXPERT_KEY_RE.finditer(n):
            entry = lookup.get(m.group(0))
            if entry is not None:
                pprefix, e, shard = entry
                return result(n.replace(m.group(0), pprefix), "expert", shard, e)
        return _Skip("routed-expert name matches no expert of the mapping table")
    if "attn_sink" in n:
        return result(n, "sink")
    for old, new in DIRECT_RENAMES:
        n = n.replace(old, new)
    suffix, old, new = GATE_BIAS
    if n.endswith(suffix):
        n = n.replace(old, new)
    kind = "direct" if hit is None else "shared" if hit in SHARED else "layer"
    return result(n, kind)


def remap_mtp_weight_name(name: str, config: DSV4Config) -> MTPWeightName | None:
    """Checkpoint tensor name -> vLLM's parameter name, or None when vLLM skips it.

    Examples (N = num_hidden_layers = 43):

    - ``mtp.0.attn.wq_a.scale`` -> ``model.layers.43.mtp_block.attn.fused_wqa_wkv.weight_scale_inv``,
      shard 0
    - ``mtp.0.ffn.experts.17.w3.weight`` -> ``model.layers.43.mtp_block.ffn.experts.w13_weight``,
      shard "w3", expert 17
    - ``mtp.0.norm.weight`` -> ``model.layers.43.shared_head.norm.weight``
    - ``embed.weight``, ``layers.5.attn.wq_a.weight``, ``mtp.1.*`` (one MTP layer) -> None
    """
    out = classify_mtp_weight_name(name, config)
    return out if isinstance(out, MTPWeightName) else None
