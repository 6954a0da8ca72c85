"""MoE feed-forward of the MTP layer: sqrtsoftplus router, routed SwiGLU experts, shared expert.

The math: ``docs/semantics.md``, "MoE: router, clamped SwiGLU, shared expert".

Routed experts are never materialised all at once: the caller passes an :class:`ExpertSource`,
which dequantizes ONE expert on request (a real V4-Flash MTP layer keeps its 256 experts packed
in FP4, about 3.2 GiB, and would need 26 GiB in bf16).  Only the experts that the router selects
for some token in the batch are dequantized, one at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_instance,
    check_number,
    check_shape,
    compute_dtype,
)
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import InputError
from dsv4mtp.params import DenseExperts, ExpertSource, MoEParams, PackedExperts

from .linear import linear, rowwise_matmul

__all__ = [
    "DenseExperts",
    "ExpertSource",
    "MoEParams",
    "PackedExperts",
    "moe",
    "route",
    "swiglu_expert",
]


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor, config: DSV4Config
) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrtsoftplus routing: x (T, D) -> (weights (T, K) compute dtype, ids (T, K)).

    The bias shifts scores for the top-k selection only; the weights are the unbiased scores
    renormalised over the K selected and multiplied by ``routed_scaling_factor``.
    """
    check_instance("config", config, DSV4Config)
    for name, t in (("x", x), ("gate_weight", gate_weight), ("gate_bias", gate_bias)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_shape("x", x, (None, config.hidden_size))
    check_shape("gate_weight", gate_weight, (config.n_routed_experts, config.hidden_size))
    check_shape("gate_bias", gate_bias, (config.n_routed_experts,))
    cd = compute_dtype(x.dtype)
    logits = rowwise_matmul(x.to(cd), gate_weight.to(cd).T)  # (T, E), no bias in the matmul
    scores = torch.sqrt(F.softplus(logits))  # (T, E)
    ids = torch.topk(scores + gate_bias.to(cd), config.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)  # (T, K) unbiased
    weights = weights / weights.sum(-1, keepdim=True)  # norm_topk_prob
    return weights * config.routed_scaling_factor, ids


def swiglu_expert(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    limit: float,
    route_weight: torch.Tensor | None = None,
    act_quant: bool = False,
) -> torch.Tensor:
    """One SwiGLU expert: x (t, D) -> (t, D) in x.dtype.

    With ``limit > 0`` the up projection is clamped to [-limit, limit] and the gate from above
    only, in the physical (dequantized) space.  ``route_weight (t,)`` multiplies the hidden
    activation before ``w2`` (official order).
    """
    for name, t in (("x", x), ("w1", w1), ("w3", w3), ("w2", w2)):
        check_dtype(name, t, FLOAT_DTYPES)
    if x.dim() != 2 or w1.dim() != 2:
        raise InputError(f"x, w1: expected 2-D tensors, got {tuple(x.shape)} and {tuple(w1.shape)}")
    I, D = w1.shape
    check_shape("x", x, (None, D))
    check_shape("w3", w3, (I, D))
    check_shape("w2", w2, (D, I))
    check_number("limit", limit)
    if route_weight is not None:
        check_dtype("route_weight", route_weight, FLOAT_DTYPES)
        check_shape("route_weight", route_weight, (x.shape[0],))
    cd = compute_dtype(x.dtype)
    gate = linear(x, w1, act_quant=act_quant).to(cd)  # (t, I)
    up = linear(x, w3, act_quant=act_quant).to(cd)  # (t, I)
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    hidden = F.silu(gate) * up
    if route_weight is not None:
        hidden = route_weight.to(cd)[:, None] * hidden
    return linear(hidden.to(x.dtype), w2, act_quant=act_quant)


def moe(
    x: torch.Tensor,
    params: MoEParams,
    config: DSV4Config,
    *,
    shared_clamp: bool = True,
    act_quant: bool = False,
) -> torch.Tensor:
    """MoE sublayer: x (T, D) (already ``ffn_norm``-ed) -> (T, D) in x.dtype.

    Routed outputs are accumulated in the compute dtype in expert-id order, then the shared
    expert (not scaled by ``routed_scaling_factor``) is added; one cast at the end.
    ``shared_clamp``: apply ``swiglu_limit`` to the shared expert too (current official, vLLM).
    """
    check_instance("config", config, DSV4Config)
    check_instance("params", params, MoEParams)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (None, config.hidden_size))
    if params.experts.num_experts != config.n_routed_experts:
        raise InputError(
            f"experts: expected {config.n_routed_experts} routed experts, got {params.experts.num_experts}"
        )
    cd = compute_dtype(x.dtype)
    limit = config.swiglu_limit
    weights, ids = route(x, params.gate_weight, params.gate_bias, config)  # (T, K)
    out = torch.zeros(x.shape, dtype=cd, device=x.device)  # (T, D)
    for e in torch.unique(ids).tolist():  # only the selected experts are dequantized
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        w1, w3, w2 = params.experts(e, cd)
        y = swiglu_expert(
            x[rows],
            w1,
            w3,
            w2,
            limit=limit,
            route_weight=weights[rows, slot],
            act_quant=act_quant and params.experts.quantized,
        )
        out.index_add_(0, rows, y.to(cd))
    shared = swiglu_expert(
        x,
        params.shared_w1,
        params.shared_w3,
        params.shared_w2,
        limit=limit if shared_clamp else 0.0,
        act_quant=act_quant and params.shared_quantized,
    )
    return (out + shared.to(cd)).to(x.dtype)
