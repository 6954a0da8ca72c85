"""Load the MTP layers of a DeepSeek-V4 checkpoint directory into an :class:`MTPCheckpoint`.

Reads only ``mtp.*`` tensors and the target's shared ``embed.weight`` / ``head.weight`` from a
sharded safetensors directory (memory-mapped; never unpickles).  Every in-range ``mtp.*`` tensor
is either consumed or deliberately skipped (expert parallelism); anything else is an error.

Order of checks (all from headers before any tensor is read, so a bad checkpoint fails fast):

1. config.json present (unless a config is passed), every indexed shard present and whole;
2. every MTP layer has at least one tensor (vLLM's "quantized without MTP layers" error);
3. per layer, formats are detected from the tensors present (dense linears: a ``.scale`` sibling
   and its dtype; routed experts: ``weight_scale_2`` => NVFP4, packed bytes + e8m0 per 32 =>
   MXFP4, e4m3 + block scale => FP8 with e8m0 or float32 scales, no scale => bf16) and the
   routed-expert format is compared with what the config claims (:class:`ExpertFormatWarning`);
4. unknown names, missing names, then dtype and shape of every tensor against the config (rows
   of :data:`~.schema.MTP_LAYER_PARAMS`; layout in ``docs/semantics.md``, section "Checkpoint
   names and layout");
5. the stored codes of every tensor to be loaded are scanned (:mod:`.scan`, shard by shard):
   NaN/inf values, e4m3 NaN codes, non-positive or NaN scales, scales that overflow
   bfloat16/float32 once multiplied by the largest element; skipped with ``scan=False``;
6. tensors are read, row by row of the table.

Tensor parallelism: only ``attn_sink`` is narrowed to the rank's heads, as vLLM does; the
other attention weights stay replicated for the multi-GPU code to slice.  Expert parallelism:
rank r of s owns routed experts [r E/s, (r+1) E/s); the others are skipped (``skipped``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dsv4mtp.checkpoint.io import ShardedCheckpoint, TensorInfo, check_checkpoint_dir
from dsv4mtp.checkpoint.names import classify_mtp_weight_name
from dsv4mtp.checkpoint.scan import Rule, layer_scan_rules, scan_checkpoint
from dsv4mtp.checkpoint.schema import (
    EMBED,
    EXPERT_WEIGHTS,
    MTP_LAYER_PARAMS,
    ParamSpec,
    expert_shape,
    shared_params,
)
from dsv4mtp.checkpoint.weights import (
    FP8_BLOCK,
    MTPCheckpoint,
    MTPLayerWeights,
    QuantizedWeight,
    RoutedExperts,
)
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import CheckpointError, ConfigError

__all__ = [
    "ExpertFormatWarning",
    "MTPTensorPlan",
    "check_tensor_info",
    "claimed_expert_format",
    "detect_expert_format",
    "detect_linear_format",
    "expected_layer_tensors",
    "expected_linear_shapes",
    "expected_plain_shapes",
    "expert_format_mismatch_message",
    "format_agrees_with_claim",
    "load_mtp_checkpoint",
    "optional_layer_tensors",
    "plan_mtp_tensors",
    "read_hf_quant_config",
]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_E4M3 = (torch.float8_e4m3fn,)
_E8M0 = (torch.float8_e8m0fnu, torch.uint8)  # uint8: raw e8m0 bytes, as some exporters write
_F32 = (torch.float32,)
_PACKED = (torch.int8, torch.uint8)  # two e2m1 codes per byte (Flash writes I8, NVIDIA U8)
_SCALAR = "scalar"  # shape () or (1,)
_MAX_LISTED = 8

_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(\w+)$")
# What a config claims -> acceptable detected formats.
_CLAIM_OK = {
    "mxfp4": ("mxfp4",),
    "nvfp4": ("nvfp4",),
    "fp8": ("fp8_e8m0", "fp8_f32"),
    "bf16": ("bf16",),
}


class ExpertFormatWarning(UserWarning):
    """The routed-expert format found in a layer differs from what the config claims."""


def expert_format_mismatch_message(
    config: DSV4Config, mtp_index: int, detected: str, claim: str
) -> str:
    """What :class:`ExpertFormatWarning` says (shared with ``dsv4-mtp inspect``)."""
    return (
        f"mtp.{mtp_index}: routed experts are {detected} in the checkpoint but the config claims "
        f"{claim} (expert_dtype={config.expert_dtype!r}, moe_quant_algo="
        f"{config.moe_quant_algo!r})"
    )


def format_agrees_with_claim(detected: str, claim: str) -> bool:
    """True when a detected format tag is what a config claim ("fp8", "nvfp4", ...) allows."""
    return detected in _CLAIM_OK.get(claim, (claim,))


# ----------------------------------------------------------------------------- expected shapes
def expected_plain_shapes(config: DSV4Config) -> dict[str, tuple[int, ...]]:
    """Unquantized tensors of one MTP layer (``plain`` and ``mhc`` rows of the schema), names
    relative to ``mtp.{i}.`` -> checkpoint shape."""
    return {s.name: s.shape(config) for s in MTP_LAYER_PARAMS if s.kind in ("plain", "mhc")}


def expected_linear_shapes(config: DSV4Config) -> dict[str, tuple[int, ...]]:
    """Logical (out, in) of the dense linears of one MTP layer, relative to ``mtp.{i}.``."""
    return {s.name: s.shape(config) for s in MTP_LAYER_PARAMS if s.kind == "linear"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layout(fmt: str, n: int, k: int) -> dict[str, tuple[tuple[torch.dtype, ...], Any]]:
    """suffix -> (allowed dtypes, stored shape) of one linear weight (N, K) in format ``fmt``."""
    blocks = (_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))
    layouts: dict[str, dict[str, tuple[tuple[torch.dtype, ...], Any]]] = {
        "bf16": {"weight": (_FLOAT, (n, k))},
        "fp8_e8m0": {"weight": (_E4M3, (n, k)), "scale": (_E8M0, blocks)},
        "fp8_f32": {"weight": (_E4M3, (n, k)), "scale": (_F32, blocks)},
        "mxfp4": {"weight": (_PACKED, (n, k // 2)), "scale": (_E8M0, (n, k // 32))},
        "nvfp4": {
            "weight": (_PACKED, (n, k // 2)),
            "weight_scale": (_E4M3, (n, k // 16)),
            "weight_scale_2": (_F32, _SCALAR),
            "input_scale": (_F32, _SCALAR),
        },
    }
    return layouts[fmt]


# ----------------------------------------------------------------------------- small helpers
def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    more = f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return shown + more


def _dtype_name(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor_info(
    info: TensorInfo, dtypes: tuple[torch.dtype, ...], shape: Any, why: str = ""
) -> None:
    """Raise :class:`CheckpointError` naming the tensor when its header dtype or shape is wrong."""
    if info.dtype not in dtypes:
        raise CheckpointError(
            f"{info.name}: expected dtype {_dtype_name(dtypes)}{why}, got "
            f"{str(info.dtype).removeprefix('torch.')}"
        )
    ok = info.shape in ((), (1,)) if shape == _SCALAR else info.shape == tuple(shape)
    if not ok:
        want = "() or (1,)" if shape == _SCALAR else str(tuple(shape))
        raise CheckpointError(f"{info.name}: expected shape {want}, got {info.shape}")


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    """e8m0 scales and packed fp4 as raw uint8 bytes (a view: bits kept, never a numeric cast)."""
    if t.dtype in (torch.float8_e8m0fnu, torch.int8):
        return t.view(torch.uint8)
    return t


# ----------------------------------------------------------------------------- config
def _read_config(path: str) -> DSV4Config:
    check_checkpoint_dir(path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(
            f"config.json: not found in {path}; a checkpoint directory needs its config.json "
            f"(or pass config=)"
        )
    return DSV4Config.from_dir(path)


def read_hf_quant_config(path: str) -> dict[str, Any]:
    """The ``quantization`` part of ``hf_quant_config.json`` (ModelOpt), or {} when absent."""
    p = os.path.join(path, "hf_quant_config.json")
    if not os.path.exists(p):
        return {}
    try:
        with open(p, encoding="utf-8") as f:
            q = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"hf_quant_config.json: not valid JSON ({e})") from e
    q = q.get("quantization", q) if isinstance(q, dict) else {}
    return q if isinstance(q, dict) else {}


def claimed_expert_format(config: DSV4Config, hf_quant: dict[str, Any], mtp_index: int) -> str:
    """What the config (+ ModelOpt manifest) claims for MTP layer ``mtp_index``'s routed experts.

    NVFP4 exports may exclude the MTP layer (``exclude_modules: ["mtp.*"]``, or no
    ``mtp.{i}.ffn.experts`` key in ``quantized_layers``): those experts stay MXFP4.
    """
    claim = config.expected_expert_format
    if claim != "nvfp4":
        return claim
    qc = {**(config.quantization_config or {}), **hf_quant}
    probe = f"mtp.{mtp_index}.ffn.experts.0.w1"
    excluded = any(
        fnmatch.fnmatch(probe, pat) or fnmatch.fnmatch(probe + ".weight", pat)
        for pat in qc.get("exclude_modules") or qc.get("ignore") or []
    )
    layers = qc.get("quantized_layers")
    listed = layers is None or any(k.startswith(f"mtp.{mtp_index}.ffn.experts") for k in layers)
    return "mxfp4" if excluded or not listed else "nvfp4"


# ----------------------------------------------------------------------------- planning
@dataclass
class MTPTensorPlan:
    """The ``mtp.*`` names of a checkpoint sorted by vLLM's name rules (never raises).

    layers: per MTP layer, names relative to ``mtp.{i}.`` -> full names; skipped: name -> why
    vLLM skips it; unknown: names no rule maps; remapped: name -> vLLM parameter name.
    """

    layers: list[dict[str, str]]
    skipped: dict[str, str]
    unknown: list[str]
    remapped: dict[str, str]


def plan_mtp_tensors(names: Iterable[str], config: DSV4Config) -> MTPTensorPlan:
    """Sort checkpoint tensor ``names`` into MTP layers, skips and unknown names."""
    plan = MTPTensorPlan([{} for _ in config.mtp_layer_ids], {}, [], {})
    for name in names:
        out = classify_mtp_weight_name(name, config)
        if not hasattr(out, "param_name"):
            reason = out.reason  # type: ignore[union-attr]
            if reason == "not an MTP weight":
                continue  # the target model's tensors
            if "matches no expert" in reason:
                plan.unknown.append(name)
            else:
                plan.skipped[name] = reason
            continue
        prefix = f"mtp.{out.mtp_index}."  # type: ignore[union-attr]
        if not name.startswith(prefix):
            plan.unknown.append(name)
            continue
        plan.layers[out.mtp_index][name[len(prefix) :]] = name  # type: ignore[union-attr]
        plan.remapped[name] = out.param_name  # type: ignore[union-attr]
    return plan


def _plan(ck: ShardedCheckpoint, config: DSV4Config) -> MTPTensorPlan:
    plan = plan_mtp_tensors(ck.names, config)
    if plan.unknown:
        raise CheckpointError(f"unknown mtp.* tensor name(s): {_listing(plan.unknown)}")
    return plan


def detect_linear_format(ck: ShardedCheckpoint, full: str) -> str:
    """Dense linear ``full`` (no suffix): "bf16", "fp8_e8m0" or "fp8_f32" from its ``.scale``."""
    scale = ck.infos.get(f"{full}.scale")
    if scale is None:
        weight = ck.infos.get(f"{full}.weight")
        if weight is not None and weight.dtype in _E4M3:
            raise CheckpointError(
                f"{full}.scale: missing; {full}.weight is float8_e4m3fn (an FP8 weight), which "
                f"needs its {FP8_BLOCK}x{FP8_BLOCK} block scales"
            )
        return "bf16"
    if scale.dtype in _F32:
        return "fp8_f32"
    if scale.dtype in _E8M0:
        return "fp8_e8m0"
    raise CheckpointError(
        f"{scale.name}: expected dtype {_dtype_name(_E8M0 + _F32)} for an FP8 block scale, got "
        f"{str(scale.dtype).removeprefix('torch.')}"
    )


def detect_expert_format(ck: ShardedCheckpoint, rel_names: dict[str, str], layer: str) -> str:
    """From what is present, never from a global flag (exports disagree with their configs)."""
    suffixes: dict[str, str] = {}
    for rel, full in rel_names.items():
        m = _EXPERT_RE.match(rel)
        if m:
            suffixes.setdefault(m.group(3), full)
    if "weight_scale_2" in suffixes:
        return "nvfp4"
    if "scale" in suffixes:
        scale = ck.info(suffixes["scale"])
        weight = ck.infos.get(suffixes["scale"].removesuffix(".scale") + ".weight")
        if weight is not None and weight.dtype in _PACKED:
            return "mxfp4"
        if weight is not None and weight.dtype in _E4M3:
            return "fp8_f32" if scale.dtype in _F32 else "fp8_e8m0"
        got = "missing" if weight is None else str(weight.dtype).removeprefix("torch.")
        raise CheckpointError(
            f"{layer}: routed experts have .scale tensors but {suffixes['scale']}'s weight is "
            f"{got}; expected packed int8/uint8 (MXFP4) or float8_e4m3fn (FP8)"
        )
    if "weight" in suffixes:
        # A quantized weight without any scale would otherwise be detected as bf16 and reported
        # as a wrong dtype; say which scale is missing instead.
        stem = suffixes["weight"].removesuffix(".weight")
        weight = ck.info(suffixes["weight"])
        if "weight_scale" in suffixes:
            raise CheckpointError(
                f"{stem}.weight_scale_2: missing, as for every routed expert of {layer}: the "
                f"experts have NVFP4 .weight_scale block scales, which need their global scale"
            )
        if weight.dtype in _PACKED + _E4M3:
            raise CheckpointError(
                f"{stem}.scale: missing, as for every routed expert of {layer}: {stem}.weight is "
                f"{str(weight.dtype).removeprefix('torch.')} (quantized), which needs its block "
                f"scales"
            )
        return "bf16"
    raise CheckpointError(f"{layer}: no routed-expert tensors (ffn.experts.*) found")


# ----------------------------------------------------------------------------- one layer
TensorSpec = tuple[tuple[torch.dtype, ...], Any]  # (allowed dtypes, shape or "scalar")


def expected_layer_tensors(
    config: DSV4Config,
    linear_formats: dict[str, str],
    expert_format: str,
    *,
    has_input_scale: bool,
) -> dict[str, TensorSpec]:
    """Every required tensor of one MTP layer (names relative to ``mtp.{i}.``) -> (allowed
    dtypes, shape), given the detected format of each dense linear and of the routed experts."""
    expected: dict[str, TensorSpec] = {
        rel: (_FLOAT, shape) for rel, shape in expected_plain_shapes(config).items()
    }
    for base, (n, k) in expected_linear_shapes(config).items():
        for suffix, spec in _layout(linear_formats[base], n, k).items():
            expected[f"{base}.{suffix}"] = spec
    for e in range(config.n_routed_experts):
        for w in EXPERT_WEIGHTS:
            n, k = expert_shape(config, w)
            for suffix, spec in _layout(expert_format, n, k).items():
                if suffix == "input_scale" and not has_input_scale:
                    continue
                expected[f"ffn.experts.{e}.{w}.{suffix}"] = spec
    return expected


def optional_layer_tensors(config: DSV4Config) -> dict[str, TensorSpec]:
    """Tensors an MTP layer may carry itself (a re-export); else the target's are shared."""
    return {s.name: (_FLOAT, s.shape(config)) for s in shared_params()}


@dataclass
class _LayerSpec:
    """Header-level facts about one MTP layer, fixed before any tensor is read."""

    index: int
    names: dict[str, str]  # rel -> full
    linear_formats: dict[str, str]
    expert_format: str
    has_input_scale: bool
    expected: dict[str, tuple[tuple[torch.dtype, ...], Any]]  # rel -> (dtypes, shape)


def _layer_spec(
    ck: ShardedCheckpoint, config: DSV4Config, index: int, names: dict[str, str]
) -> _LayerSpec:
    prefix = f"mtp.{index}."
    if not names:
        raise CheckpointError(
            f"MTP layer mtp.{index} (model layer {config.num_hidden_layers + index}): no "
            f"weights in the checkpoint (no mtp.{index}.* tensors). The checkpoint may have been quantized without the MTP layers; use "
            f"one that includes them, or disable speculative decoding"
        )
    linear_formats = {
        base: detect_linear_format(ck, prefix + base) for base in expected_linear_shapes(config)
    }
    expert_format = detect_expert_format(ck, names, f"mtp.{index}")
    has_input_scale = any(rel.endswith(".input_scale") for rel in names)
    expected = expected_layer_tensors(
        config, linear_formats, expert_format, has_input_scale=has_input_scale
    )
    optional = optional_layer_tensors(config)
    unknown = [prefix + rel for rel in names if rel not in expected and rel not in optional]
    if unknown:
        raise CheckpointError(
            f"unknown mtp.* tensor name(s) for layer mtp.{index} (experts detected as "
            f"{expert_format}): {_listing(unknown)}"
        )
    missing = [prefix + rel + ck.why_missing(prefix + rel) for rel in expected if rel not in names]
    if missing:
        raise CheckpointError(
            f"missing tensor(s) for MTP layer mtp.{index} (experts detected as {expert_format}): "
            f"{_listing(missing)}"
        )
    expected.update({rel: spec for rel, spec in optional.items() if rel in names})
    for rel, (dtypes, shape) in expected.items():
        why = ""
        if rel.endswith(".weight") and dtypes == _E4M3:
            why = " (FP8 weight: it has a .scale)"
        check_tensor_info(ck.info(names[rel]), dtypes, shape, why)
    return _LayerSpec(index, names, linear_formats, expert_format, has_input_scale, expected)


class _Reader:
    """Reads tensors by checkpoint name, recording what was consumed."""

    def __init__(self, ck: ShardedCheckpoint, remapped: dict[str, str]) -> None:
        self.ck = ck
        self.remapped = remapped
        self.loaded: dict[str, str] = {}

    def read(self, name: str, param: str | None = None) -> torch.Tensor:
        self.loaded[name] = param or self.remapped.get(name, name)
        return _as_stored(self.ck.get(name))


def _read_linear(
    r: _Reader, spec: _LayerSpec, base: str, shape: tuple[int, ...]
) -> QuantizedWeight:
    full = f"mtp.{spec.index}.{base}"
    n, k = shape
    fmt = spec.linear_formats[base]
    data = r.read(f"{full}.weight")
    scale = None
    if fmt != "bf16":
        scale = r.read(f"{full}.scale")
    return QuantizedWeight(fmt, data, scale, (n, k), name=full)


def _load_experts(
    r: _Reader,
    config: DSV4Config,
    spec: _LayerSpec,
    ep_rank: int,
    ep_size: int,
    skipped: dict[str, str],
) -> RoutedExperts:
    E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    fmt = spec.expert_format
    n_local = E // ep_size
    start = ep_rank * n_local
    prefix = f"mtp.{spec.index}.ffn.experts"
    for e in [*range(start), *range(start + n_local, E)]:
        for rel in spec.expected:
            if rel.startswith(f"ffn.experts.{e}."):
                skipped[f"mtp.{spec.index}.{rel}"] = (
                    f"expert {e} not on EP rank {ep_rank} of {ep_size} (owns [{start}, "
                    f"{start + n_local}))"
                )
    if fmt.startswith("fp8") and I % FP8_BLOCK:
        raise CheckpointError(
            f"{prefix}: cannot stack FP8 w1/w3 block scales: moe_intermediate_size {I} is not a "
            f"multiple of {FP8_BLOCK}"
        )

    def stacked(w: str, suffix: str) -> torch.Tensor:
        """(E_loc, rows, cols); w13 = rows [w1; w3] per expert.  Filled in place: one copy."""
        shards = ("w1", "w3") if w == "w13" else ("w2",)
        out: torch.Tensor | None = None
        for j, e in enumerate(range(start, start + n_local)):
            row = 0
            for s in shards:
                name = f"{prefix}.{e}.{s}.{suffix}"
                t = r.read(name)  # (rows, cols), shape checked from the header
                if out is None:
                    out = torch.empty(
                        (n_local, t.shape[0] * len(shards), t.shape[1]), dtype=t.dtype
                    )
                out[j, row : row + t.shape[0]] = t
                row += t.shape[0]
        assert out is not None  # E_loc >= 1
        return out

    def scalars(w: str, suffix: str) -> torch.Tensor:
        """NVFP4 per-tensor scalars: w13 -> (E_loc, 2) [gate, up]; w2 -> (E_loc,)."""
        shards = ("w1", "w3") if w == "w13" else ("w2",)
        out = torch.empty(n_local, len(shards), dtype=torch.float32)
        for j, e in enumerate(range(start, start + n_local)):
            for c, s in enumerate(shards):
                name = f"{prefix}.{e}.{s}.{suffix}"
                t = r.read(name)
                out[j, c] = t.reshape(()).float()
        return out if w == "w13" else out[:, 0].contiguous()

    scale_suffix = {"bf16": None, "nvfp4": "weight_scale"}.get(fmt, "scale")
    kwargs: dict[str, Any] = {}
    if fmt == "nvfp4":
        kwargs["w13_weight_scale_2"] = scalars("w13", "weight_scale_2")
        kwargs["w2_weight_scale_2"] = scalars("w2", "weight_scale_2")
        if spec.has_input_scale:
            kwargs["w13_input_scale"] = scalars("w13", "input_scale")
            kwargs["w2_input_scale"] = scalars("w2", "input_scale")
    return RoutedExperts(
        format=fmt,
        w13_weight=stacked("w13", "weight"),
        w13_weight_scale=None if scale_suffix is None else stacked("w13", scale_suffix),
        w2_weight=stacked("w2", "weight"),
        w2_weight_scale=None if scale_suffix is None else stacked("w2", scale_suffix),
        num_experts=E,
        expert_start=start,
        num_local_experts=n_local,
        hidden_size=H,
        intermediate_size=I,
        name=prefix,
        **kwargs,
    )


def _shared(
    r: _Reader, ck: ShardedCheckpoint, config: DSV4Config, spec: ParamSpec, layer: _LayerSpec
) -> tuple[torch.Tensor, str]:
    """A ``shared`` row: the layer's own ``mtp.{i}.<name>`` if present (already checked), else the
    target's tensor (checked here).  Returns the tensor and the checkpoint name it came from."""
    own = f"mtp.{layer.index}.{spec.name}"
    name = own if spec.name in layer.names else spec.target
    if name not in ck:
        raise CheckpointError(
            f"{spec.target}: missing{ck.why_missing(spec.target)}; MTP layer mtp.{layer.index} has "
            f"no {own} either (it is shared with the target)"
        )
    if name == spec.target:
        check_tensor_info(ck.info(name), _FLOAT, spec.shape(config))
    param = classify_mtp_weight_name(own, config).param_name  # type: ignore[union-attr]
    return r.read(name, param), name


def _load_layer(
    r: _Reader,
    ck: ShardedCheckpoint,
    config: DSV4Config,
    spec: _LayerSpec,
    tp: tuple[int, int],
    ep: tuple[int, int],
    skipped: dict[str, str],
) -> MTPLayerWeights:
    """Read every row of the schema for one layer, sliced for this TP / EP rank."""
    p = f"mtp.{spec.index}."
    layer_id = config.num_hidden_layers + spec.index
    fields: dict[str, Any] = {}
    for row in MTP_LAYER_PARAMS:
        if row.kind == "linear":
            fields[row.field] = _read_linear(r, spec, row.name, row.shape(config))
        elif row.kind == "experts":
            fields[row.field] = _load_experts(r, config, spec, ep[0], ep[1], skipped)
        elif row.kind == "shared":
            fields[row.field], fields["head_source"] = _shared(r, ck, config, row, spec)
        else:
            t = r.read(p + row.name)
            fields[row.field] = _tp_slice(t, tp) if row.tp == "heads" else t
    layer = MTPLayerWeights(index=spec.index, layer_id=layer_id, **fields)
    layer.state_dict()  # vLLM's stacked parameters must exist: raises if shards cannot stack
    return layer


def _scan_rules(
    ck: ShardedCheckpoint, config: DSV4Config, specs: list[_LayerSpec], ep: tuple[int, int]
) -> dict[str, Rule]:
    """Name -> scan rule of every tensor the loader will read (this EP rank's experts only)."""
    n_local = config.n_routed_experts // ep[1]
    local = range(ep[0] * n_local, (ep[0] + 1) * n_local)
    rules: dict[str, Rule] = {}
    for spec in specs:
        rels = [
            rel
            for rel in spec.expected
            if not (m := _EXPERT_RE.match(rel)) or int(m.group(1)) in local
        ]
        rules.update(
            layer_scan_rules(f"mtp.{spec.index}.", rels, spec.linear_formats, spec.expert_format)
        )
        for row in shared_params():
            if (
                row.name not in spec.names
                and row.target in ck
                and (row is not EMBED or spec is specs[0])
            ):
                rules[row.target] = "finite"
    return rules


def _tp_slice(t: torch.Tensor, tp: tuple[int, int]) -> torch.Tensor:
    """Rows of TP rank ``tp[0]`` of ``tp[1]`` (an even split of dim 0, the heads)."""
    rank, size = tp
    n = t.shape[0] // size
    return t[n * rank : n * (rank + 1)].contiguous()


def _check_parallel(
    config: DSV4Config, tp_rank: int, tp_size: int, ep_rank: int, ep_size: int
) -> None:
    if tp_size < 1 or config.num_attention_heads % tp_size:
        raise ConfigError(
            f"tp_size: expected a divisor of num_attention_heads ({config.num_attention_heads}), "
            f"got {tp_size}"
        )
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank: expected 0 <= tp_rank < {tp_size}, got {tp_rank}")
    if ep_size < 1 or config.n_routed_experts % ep_size:
        raise ConfigError(
            f"ep_size: expected a divisor of n_routed_experts ({config.n_routed_experts}), "
            f"got {ep_size}"
        )
    if not 0 <= ep_rank < ep_size:
        raise ConfigError(f"ep_rank: expected 0 <= ep_rank < {ep_size}, got {ep_rank}")


# ----------------------------------------------------------------------------- entry point
def load_mtp_checkpoint(
    path: str | os.PathLike[str],
    config: DSV4Config | None = None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    scan: bool = True,
) -> MTPCheckpoint:
    """Load every MTP layer of the checkpoint directory ``path`` (see the module docstring).

    ``config``: defaults to the directory's config.json (+ hf_quant_config.json).  ``scan``:
    before reading, check the stored codes of every tensor to be loaded with the rules of
    :mod:`.scan` (the ones ``dsv4-mtp inspect`` applies), one shard at a time; the first bad
    tensor raises :class:`CheckpointError`.  ``scan=False`` skips that pass over the data: only
    for a checkpoint already checked (e.g. by ``dsv4-mtp inspect``), since a NaN code or a zero,
    negative or overflowing scale then loads silently and the draft layer emits NaN or garbage
    logits, i.e. drafts that are never accepted.  Raises
    :class:`CheckpointError` for a bad checkpoint, :class:`ConfigError` for bad TP/EP arguments;
    warns :class:`ExpertFormatWarning` when a layer's routed experts are not in the format the
    config claims.  Returns an :class:`MTPCheckpoint`; quantized tensors stay packed.
    """
    path = os.fspath(path)
    if config is None:
        config = _read_config(path)
    hf_quant = read_hf_quant_config(path)
    _check_parallel(config, tp_rank, tp_size, ep_rank, ep_size)
    ck = ShardedCheckpoint(path)
    try:
        plan = _plan(ck, config)
        specs = [_layer_spec(ck, config, i, names) for i, names in enumerate(plan.layers)]
        messages = []
        for spec in specs:
            claim = claimed_expert_format(config, hf_quant, spec.index)
            if spec.expert_format not in _CLAIM_OK[claim]:
                msg = expert_format_mismatch_message(config, spec.index, spec.expert_format, claim)
                msg += f"; loading them as {spec.expert_format}"
                warnings.warn(ExpertFormatWarning(msg), stacklevel=2)
                messages.append(msg)
        tp, ep = (tp_rank, tp_size), (ep_rank, ep_size)
        if scan:
            for finding in scan_checkpoint(ck, _scan_rules(ck, config, specs, ep)):
                raise CheckpointError(finding.message)
        r = _Reader(ck, plan.remapped)
        skipped = dict(plan.skipped)
        layers = tuple(_load_layer(r, ck, config, spec, tp, ep, skipped) for spec in specs)

        embed, embed_name = _shared(r, ck, config, EMBED, specs[0])

        in_range = {full for spec in specs for full in spec.names.values()}
        unconsumed = in_range - set(r.loaded) - set(skipped)
        if unconsumed:
            raise CheckpointError(f"unconsumed mtp.* tensor(s): {_listing(unconsumed)}")
    finally:
        ck.close()
    return MTPCheckpoint(
        config=config,
        path=path,
        layers=layers,
        embed_tokens=embed,
        embed_source=embed_name,
        tp_rank=tp_rank,
        tp_size=tp_size,
        ep_rank=ep_rank,
        ep_size=ep_size,
        loaded=r.loaded,
        skipped=skipped,
        warnings=tuple(messages),
    )
