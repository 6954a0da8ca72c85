"""The dense parameter containers of one MTP layer and their builder from a loaded checkpoint.

What an implementation needs to build a layer without importing another implementation:
:class:`AttentionParams`, :class:`MoEParams` with its routed :class:`ExpertSource`
(:class:`PackedExperts` over a checkpoint's packed experts, :class:`DenseExperts` over dense
stacks), :class:`MTPLayerParams`, and :func:`build_layer_params`, which dequantizes a loaded
:class:`~dsv4mtp.checkpoint.weights.MTPLayerWeights` once (linears in the activation dtype;
norms, hc_*, sink and router in the compute dtype, as the official code keeps them in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dsv4mtp.checkpoint.schema import MTP_LAYER_PARAMS
from dsv4mtp.checkpoint.weights import MTPLayerWeights, QuantizedWeight, RoutedExperts
from dsv4mtp.checks import compute_dtype
from dsv4mtp.errors import ConfigError, InputError

__all__ = [
    "AttentionParams",
    "DenseExperts",
    "ExpertSource",
    "MTPLayerParams",
    "MoEParams",
    "PackedExperts",
    "build_layer_params",
]


@dataclass
class AttentionParams:
    """Dense attention weights (already dequantized), checkpoint names under ``mtp.{i}.attn.``.

    wq_a (Rq, D); q_norm (Rq,); wq_b (H*Dh, Rq), each head [nope | rope]; wkv (Dh, D);
    kv_norm (Dh,); wo_a (G*Ro, (H/G)*Dh); wo_b (D, G*Ro); attn_sink (H,).
    """

    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    wo_b: torch.Tensor
    attn_sink: torch.Tensor


class ExpertSource(Protocol):
    """Dequantizes routed experts one at a time.

    ``num_experts``: E.  ``quantized``: True when the checkpoint stores FP8/FP4 experts, i.e. the
    official code would quantize the activations entering them (``act_quant``).
    ``__call__(e, dtype)`` -> ``(w1 (I, D) gate, w3 (I, D) up, w2 (D, I) down)`` in ``dtype``.
    """

    num_experts: int
    quantized: bool

    def __call__(
        self, expert: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass
class DenseExperts:
    """An :class:`ExpertSource` over already-dense stacked weights (tests, bf16 checkpoints).

    w1, w3 (E, I, D); w2 (E, D, I).
    """

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    quantized: bool = False

    @property
    def num_experts(self) -> int:
        return int(self.w1.shape[0])

    def __call__(
        self, expert: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w1[expert].to(dtype), self.w3[expert].to(dtype), self.w2[expert].to(dtype)


@dataclass
class MoEParams:
    """gate_weight (E, D); gate_bias (E,) = e_score_correction_bias (selection only);
    shared_w1, shared_w3 (I, D); shared_w2 (D, I); shared_quantized: FP8 shared expert
    (act_quant applies); experts: the routed :class:`ExpertSource`.
    ``shared_fp8``: the shared expert's (w1, w3, w2) as stored when the checkpoint keeps them in
    FP8 128x128 blocks (None otherwise), so an implementation can stream the FP8 codes instead of
    the dense copies (which stay the reference's input)."""

    gate_weight: torch.Tensor
    gate_bias: torch.Tensor
    shared_w1: torch.Tensor
    shared_w3: torch.Tensor
    shared_w2: torch.Tensor
    experts: ExpertSource
    shared_quantized: bool = True
    shared_fp8: tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight] | None = None


class PackedExperts:
    """An :class:`ExpertSource` over a loaded checkpoint's packed :class:`RoutedExperts`:
    each call decodes one expert (MXFP4, NVFP4 folded or not, FP8, bf16) on the fly."""

    def __init__(self, experts: RoutedExperts) -> None:
        self.packed = experts
        self.num_experts = experts.num_experts
        self.quantized = experts.format != "bf16"
        self.format = experts.format

    def __call__(
        self, expert: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        local = self.packed.local_id(expert)
        if local < 0:
            raise InputError(f"expert: global expert {expert} is not on this expert-parallel rank")
        w13, w2 = self.packed.dequantize_expert(local, dtype)  # (2I, D), (D, I)
        inter = self.packed.intermediate_size
        return w13[:inter], w13[inter:], w2


@dataclass
class MTPLayerParams:
    """One MTP layer with dense weights (routed experts stay packed in ``ffn.experts``).

    Names follow the checkpoint (``mtp.{i}.*``).  enorm, hnorm, norm, attn_norm, ffn_norm (D,);
    e_proj, h_proj (D, D); hc_head_fn (n, nD), hc_head_base (n,), hc_head_scale (1,);
    hc_{attn,ffn}_fn (M, nD), _base (M,), _scale (3,); head (V, D) the shared LM head.
    ``dense_quantized``: the dense linears are FP8 in the checkpoint (``act_quant`` applies).
    """

    enorm: torch.Tensor
    hnorm: torch.Tensor
    e_proj: torch.Tensor
    h_proj: torch.Tensor
    norm: torch.Tensor
    head: torch.Tensor
    hc_head_fn: torch.Tensor
    hc_head_base: torch.Tensor
    hc_head_scale: torch.Tensor
    hc_attn_fn: torch.Tensor
    hc_attn_base: torch.Tensor
    hc_attn_scale: torch.Tensor
    hc_ffn_fn: torch.Tensor
    hc_ffn_base: torch.Tensor
    hc_ffn_scale: torch.Tensor
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attn: AttentionParams
    ffn: MoEParams
    dense_quantized: bool = True


def _shared_fp8(
    w: MTPLayerWeights, device: torch.device
) -> tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight] | None:
    """The shared expert's FP8 (w1, w3, w2) on ``device`` when all three are FP8 blocks."""
    parts = (w.shared_w1, w.shared_w3, w.shared_w2)
    if not all(p.format in ("fp8_e8m0", "fp8_f32") for p in parts):
        return None
    return parts[0].to(device), parts[1].to(device), parts[2].to(device)


def build_layer_params(
    w: MTPLayerWeights,
    dtype: torch.dtype,
    device: torch.device,
    cache: dict[tuple[int, torch.dtype], torch.Tensor] | None = None,
) -> MTPLayerParams:
    """Dequantize the dense part of one loaded layer once (linears in ``dtype``; norms, hc_*,
    sink and router in the compute dtype, as the official code keeps them in fp32).

    ``cache`` is shared across the layers of one model so the LM head, one tensor shared by
    every MTP layer, is converted once.  Routed experts stay packed (:class:`PackedExperts`).
    """
    if cache is None:
        cache = {}
    cd = compute_dtype(dtype)

    def plain(t: torch.Tensor, to: torch.dtype = cd) -> torch.Tensor:
        key = (id(t), to)  # the LM head is one tensor shared by every layer: convert it once
        if key not in cache:
            cache[key] = t.to(device=device, dtype=to)
        return cache[key]

    if w.experts.num_local_experts != w.experts.num_experts:
        raise ConfigError(
            f"ep_size: the reference runs all {w.experts.num_experts} routed experts on one "
            f"device; got a checkpoint loaded with {w.experts.num_local_experts} local experts"
        )
    values: dict[str, dict[str, Any]] = {"": {}, "attn": {}, "ffn": {}}  # container -> fields
    for spec in MTP_LAYER_PARAMS:
        v = getattr(w, spec.field)
        if spec.kind == "linear":
            v = v.to(device).dequantize(dtype)
        elif spec.kind == "experts":
            v = PackedExperts(v.to(device))
        else:  # the head in the activation dtype; norms, hc_*, sink and router in compute dtype
            v = plain(v, dtype if spec.kind == "shared" else cd)
        container, _, name = spec.param.rpartition(".")
        values[container][name] = v
    return MTPLayerParams(
        **values[""],
        attn=AttentionParams(**values["attn"]),
        ffn=MoEParams(
            **values["ffn"],
            shared_quantized=w.shared_w2.format != "bf16",
            shared_fp8=_shared_fp8(w, device),
        ),
        dense_quantized=w.e_proj.format != "bf16",
    )
