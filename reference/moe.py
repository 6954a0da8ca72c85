"""MoE feed-forward of the MTP layer: sqrtsoftplus router, routed SwiGLU experts, shared expert.

The math: ``docs/semantics.md``, "MoE: router, clamped SwiGLU, shared expert".

Routed experts are never materialised all at once: the caller passes an :class:`ExpertSource`,
which dequantizes ONE expert on request (a real V4-Flash MTP layer keeps its 256 experts packed
in FP4, about 3.2 GiB, and would need 26 GiB in bf16).  Only the experts that the router selects
for some token in the batch are dequantized, one at a time.

Three public steps: :func:`route` (router), :func:`fused_experts` (the routed experts given the
routing, what serving engines call) and :func:`moe` (router + routed experts + shared expert).
``moe`` and ``fused_experts`` share one routed-expert loop (:func:`_routed_sum`).  Every op takes
``batch_invariant`` (no effect here: the reference has one schedule, and each row is computed
alone, see ``reference/linear.py``) and ``out=`` (the result is written into the given buffer(s),
checked for shape, dtype and device, and returned).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4mtp.checks import (
    FLOAT_DTYPES,
    INT_DTYPES,
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
    "fused_experts",
    "moe",
    "route",
    "swiglu_expert",
]


def _written(
    name: str, out: torch.Tensor | None, result: torch.Tensor, dtypes=None
) -> torch.Tensor:
    """``result`` itself, or copied into the caller's buffer ``out`` after checking it."""
    if out is None:
        return result
    check_dtype(name, out, dtypes or (result.dtype,))
    check_shape(name, out, tuple(result.shape))
    if out.device != result.device:
        raise InputError(f"{name}: expected device {result.device}, got {out.device}")
    return out.copy_(result)


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InputError(f"{name}: expected a bool, got {value!r}")


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    config: DSV4Config,
    *,
    batch_invariant: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrtsoftplus routing: x (T, D) -> (weights (T, K) compute dtype, ids (T, K) int64).

    The bias shifts scores for the top-k selection only; the weights are the unbiased scores
    renormalised over the K selected and multiplied by ``routed_scaling_factor``.  The ids of a
    row come in descending order of biased score (``torch.topk``); other implementations may
    order them otherwise, so comparisons treat them as a set.
    ``out=(weights_buf, ids_buf)``: ids_buf may be int64 or int32.
    """
    check_instance("config", config, DSV4Config)
    for name, t in (("x", x), ("gate_weight", gate_weight), ("gate_bias", gate_bias)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_shape("x", x, (None, config.hidden_size))
    check_shape("gate_weight", gate_weight, (config.n_routed_experts, config.hidden_size))
    check_shape("gate_bias", gate_bias, (config.n_routed_experts,))
    _check_flag("batch_invariant", batch_invariant)
    cd = compute_dtype(x.dtype)
    logits = rowwise_matmul(x.to(cd), gate_weight.to(cd).T)  # (T, E), no bias in the matmul
    scores = torch.sqrt(F.softplus(logits))  # (T, E)
    ids = torch.topk(scores + gate_bias.to(cd), config.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)  # (T, K) unbiased
    weights = weights / weights.sum(-1, keepdim=True)  # norm_topk_prob
    weights = weights * config.routed_scaling_factor
    if out is None:
        return weights, ids
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InputError(
            f"out: expected a (weights, ids) pair of tensors, got {type(out).__name__}"
        )
    return _written("out[0]", out[0], weights), _written("out[1]", out[1], ids, INT_DTYPES)


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


def _routed_sum(
    x: torch.Tensor,
    experts: ExpertSource,
    local_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    limit: float,
    act_quant: bool,
) -> torch.Tensor:
    """The routed experts' sum in the compute dtype: x (T, D), local_ids (T, K) (-1: no expert),
    topk_weights (T, K) -> (T, D).  Experts in increasing local id, each decoded once."""
    cd = compute_dtype(x.dtype)
    acc = torch.zeros(x.shape, dtype=cd, device=x.device)  # (T, D)
    for e in torch.unique(local_ids[local_ids >= 0]).tolist():  # sorted: expert-id order
        rows, slot = torch.nonzero(local_ids == e, as_tuple=True)  # (r,), (r,)
        w1, w3, w2 = experts(e, cd)  # (I, D), (I, D), (D, I)
        y = swiglu_expert(
            x[rows],
            w1,
            w3,
            w2,
            limit=limit,
            route_weight=topk_weights[rows, slot],
            act_quant=act_quant and experts.quantized,
        )  # (r, D) in x.dtype
        acc.index_add_(0, rows, y.to(cd))
    return acc


def _check_ids(name: str, ids: torch.Tensor, bound: int, what: str) -> None:
    """Host-syncing range check: every id in [-1, bound)."""
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= bound):
        raise InputError(
            f"{name}: expected ids in [-1, {bound}) ({what}), got values in "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )


def fused_experts(
    x: torch.Tensor,
    experts: ExpertSource,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    limit: float,
    expert_map: torch.Tensor | None = None,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts with caller-supplied routing: x (T, D) -> (T, D) in x.dtype.

    ``topk_ids (T, K)`` int32 / int64 expert ids, -1 for a slot that touches no expert (padding);
    ``topk_weights (T, K)`` float, each slot's routing weight, applied to the expert's hidden
    activation before ``w2``.  ``expert_map (E_global,)`` int (expert parallelism): global id ->
    index into ``experts`` (which then holds this rank's local experts), -1 for experts on other
    ranks, whose slots contribute nothing; without it the ids index ``experts`` directly.
    ``limit``: the SwiGLU clamp (``config.swiglu_limit``; <= 0 disables it).  ``act_quant``:
    round the expert inputs through e4m3 (1x128 blocks) when ``experts.quantized``.  The sum runs
    in the compute dtype over experts in increasing (local) id order, one cast at the end; no
    shared expert.  ``docs/semantics.md``, "Routed expert (SwiGLU with clamp)".
    """
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    if not callable(experts) or not isinstance(getattr(experts, "num_experts", None), int):
        raise InputError(f"experts: expected an ExpertSource, got {type(experts).__name__}")
    T = x.shape[0]
    check_dtype("topk_ids", topk_ids, INT_DTYPES)
    check_shape("topk_ids", topk_ids, (T, None))
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    check_shape("topk_weights", topk_weights, (T, topk_ids.shape[1]))
    check_number("limit", limit)
    _check_flag("act_quant", act_quant)
    _check_flag("batch_invariant", batch_invariant)
    E = experts.num_experts
    local = topk_ids  # (T, K)
    if expert_map is not None:
        check_dtype("expert_map", expert_map, INT_DTYPES)
        check_shape("expert_map", expert_map, (None,))
        _check_ids("expert_map", expert_map, E, f"local ids of the {E} experts on this rank")
        _check_ids("topk_ids", topk_ids, expert_map.shape[0], "global ids or -1")
        mapped = expert_map.to(topk_ids.device)[topk_ids.clamp(min=0).long()]  # (T, K)
        local = torch.where(topk_ids >= 0, mapped.to(topk_ids.dtype), -1)
    else:
        _check_ids("topk_ids", topk_ids, E, "expert ids or -1")
    acc = _routed_sum(x, experts, local, topk_weights, limit=float(limit), act_quant=act_quant)
    return _written("out", out, acc.to(x.dtype))


def moe(
    x: torch.Tensor,
    params: MoEParams,
    config: DSV4Config,
    *,
    shared_clamp: bool = True,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE sublayer: x (T, D) (already ``ffn_norm``-ed) -> (T, D) in x.dtype.

    :func:`route`, then the routed experts (:func:`fused_experts`' loop) accumulated in the
    compute dtype in expert-id order, then the shared expert (not scaled by
    ``routed_scaling_factor``) is added; one cast at the end.
    ``shared_clamp``: apply ``swiglu_limit`` to the shared expert too (current official, vLLM).
    """
    check_instance("config", config, DSV4Config)
    check_instance("params", params, MoEParams)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (None, config.hidden_size))
    _check_flag("shared_clamp", shared_clamp)
    _check_flag("act_quant", act_quant)
    _check_flag("batch_invariant", batch_invariant)
    if params.experts.num_experts != config.n_routed_experts:
        raise InputError(
            f"experts: expected {config.n_routed_experts} routed experts, got {params.experts.num_experts}"
        )
    cd = compute_dtype(x.dtype)
    limit = config.swiglu_limit
    weights, ids = route(x, params.gate_weight, params.gate_bias, config)  # (T, K)
    routed = _routed_sum(x, params.experts, ids, weights, limit=limit, act_quant=act_quant)
    shared = swiglu_expert(
        x,
        params.shared_w1,
        params.shared_w3,
        params.shared_w2,
        limit=limit if shared_clamp else 0.0,
        act_quant=act_quant and params.shared_quantized,
    )  # (T, D) in x.dtype
    return _written("out", out, (routed + shared.to(cd)).to(x.dtype))
