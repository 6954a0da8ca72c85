"""NVFP4 routed experts for FlashInfer's ``moe_ep`` pack: gate/up alpha folding, the pack contract,
and the padding-row routing preprocess (``docs/semantics.md``, section "The NVFP4 gate/up fold").

Why a fold: the NVFP4 megakernel multiplies each expert's FC1 accumulator by ONE scalar
``fc1_alpha``, but the fused w13 holds gate (w1) and up (w3) rows whose ModelOpt global scales
``weight_scale_2`` may differ (g, u).  Since ``q * sf_up * u = q * (sf_up * u/g) * g``, multiplying
the up half's e4m3 block scales by ``r = u / g`` makes ``g`` right for all 2I rows, provided every
rescaled block scale is exactly representable in e4m3; otherwise the fold is refused (a lossy
rescale would silently change the model).  ``r`` itself is rounded in fp32, so an accepted fold
dequantizes to the unfolded weights within 1 fp32 ulp, and exactly when ``r`` is a power of two.

Unfoldable experts still load and run through the reference MoE with their per-shard scales; the
fold is only for the FlashInfer pack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dsv4mtp import formats
from dsv4mtp.checkpoint.weights import RoutedExperts
from dsv4mtp.checks import check_dtype, check_shape
from dsv4mtp.errors import FoldError, InputError

__all__ = [
    "MoEWeightPackSpec",
    "apply_routing_padding_mask",
    "check_moe_weight_pack",
    "fold_nvfp4_experts",
    "fold_nvfp4_gate_up_scales",
    "nvfp4_moe_weight_pack",
    "to_flashinfer_weight_pack",
]

# Set on the folded block-scale tensor this module returns, so folding it again is refused.
_FOLDED_ATTR = "_dsv4_nvfp4_folded"


def _is_marked_folded(t: torch.Tensor) -> bool:
    return bool(getattr(t, _FOLDED_ATTR, False))


def fold_nvfp4_gate_up_scales(
    w13_weight_scale: torch.Tensor,
    w13_weight_scale_2: torch.Tensor,
    w2_weight_scale_2: torch.Tensor,
    *,
    intermediate_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold the up half's global scale into its block scales (vLLM's acceptance rule).

    w13_weight_scale (E, 2I, H/16) float8_e4m3fn, rows [gate; up]; w13_weight_scale_2 (E, 2)
    float32, column 0 gate (w1), column 1 up (w3); w2_weight_scale_2 (E,) float32.
    Returns ``(w13_weight_scale_folded (E, 2I, H/16) e4m3, fc1_alpha (E,) fp32 = gate scale,
    fc2_alpha (E,) fp32 = w2 scale)``, all new tensors.  When gate and up scales are equal for
    every expert nothing is rescaled; when any differs, every expert's up half is multiplied by
    its own ``r = up / gate`` (fp32) and kept only if exact in e4m3.

    Raises :class:`FoldError` for non-finite or non-positive global scales, an inexact fold,
    or a block-scale tensor this function already folded.
    """
    check_dtype("w13_weight_scale", w13_weight_scale, (torch.float8_e4m3fn,))
    check_dtype("w13_weight_scale_2", w13_weight_scale_2, (torch.float32,))
    check_dtype("w2_weight_scale_2", w2_weight_scale_2, (torch.float32,))
    if w13_weight_scale.dim() != 3:
        raise InputError(
            f"w13_weight_scale: expected shape (E, 2I, H/16), got {tuple(w13_weight_scale.shape)}"
        )
    E = w13_weight_scale.shape[0]
    I = intermediate_size
    check_shape("w13_weight_scale", w13_weight_scale, (E, 2 * I, None))
    check_shape("w13_weight_scale_2", w13_weight_scale_2, (E, 2))
    check_shape("w2_weight_scale_2", w2_weight_scale_2, (E,))
    if _is_marked_folded(w13_weight_scale):
        raise FoldError(
            "w13_weight_scale: already folded (the up half already carries up/gate); folding "
            "twice would apply the ratio twice"
        )

    gate = w13_weight_scale_2[:, 0].float()  # (E,)
    up = w13_weight_scale_2[:, 1].float()  # (E,)
    for name, s in (("gate (w1)", gate), ("up (w3)", up), ("w2", w2_weight_scale_2.float())):
        bad = ~torch.isfinite(s) | (s <= 0)  # NaN fails `> 0` too, but say so explicitly
        if bool(bad.any()):
            e = int(bad.nonzero()[0, 0])
            raise FoldError(
                f"{name} weight_scale_2: expected finite positive values, got {float(s[e])} for "
                f"local expert {e} (checkpoint scale tensors missing or routed wrong?)"
            )

    folded = w13_weight_scale.clone()
    if not torch.equal(gate, up):
        ratio = up / gate  # (E,) fp32, rounded once
        up_scales = formats.decode_e4m3(w13_weight_scale[:, I:, :])  # (E, I, H/16) fp32
        rescaled = up_scales * ratio[:, None, None]  # fp32 multiply, as vLLM does
        q = formats.encode_e4m3(rescaled)
        exact = formats.decode_e4m3(q) == rescaled  # NaN and saturation compare unequal
        if not bool(exact.all()):
            e, row, col = (int(v) for v in (~exact).nonzero()[0])
            raise FoldError(
                f"NVFP4 gate/up weight_scale_2 cannot be merged into one fc1_alpha: for local "
                f"expert {e} the ratio up/gate = {float(ratio[e])!r} times up block scale "
                f"{float(up_scales[e, row, col])!r} (row {I + row}, block {col}) = "
                f"{float(rescaled[e, row, col])!r} is not exactly representable in "
                f"float8_e4m3fn; use a checkpoint quantized with a shared gate/up weight_scale_2"
            )
        folded[:, I:, :] = q
    setattr(folded, _FOLDED_ATTR, True)
    fc1_alpha = gate.clone().contiguous()
    fc2_alpha = w2_weight_scale_2.float().clone().contiguous()
    return folded, fc1_alpha, fc2_alpha


def fold_nvfp4_experts(experts: RoutedExperts) -> RoutedExperts:
    """The folded pack: up block scales rescaled, both ``w13_weight_scale_2`` columns = fc1_alpha.

    Dequantizing its experts gives the unfolded weights within 1 fp32 ulp (exactly for a
    power-of-two ratio).  ``nvfp4_folded`` is set; folding a folded pack raises :class:`FoldError`.
    """
    if experts.format != "nvfp4":
        raise FoldError(f"{experts.name}: only NVFP4 experts are folded, got {experts.format}")
    if experts.nvfp4_folded:
        raise FoldError(f"{experts.name}: experts already folded; a second fold is refused")
    assert experts.w13_weight_scale is not None
    assert experts.w13_weight_scale_2 is not None and experts.w2_weight_scale_2 is not None
    scale, fc1_alpha, _ = fold_nvfp4_gate_up_scales(
        experts.w13_weight_scale,
        experts.w13_weight_scale_2,
        experts.w2_weight_scale_2,
        intermediate_size=experts.intermediate_size,
    )
    return dataclasses.replace(
        experts,
        w13_weight_scale=scale,
        w13_weight_scale_2=torch.stack([fc1_alpha, fc1_alpha], 1),
        nvfp4_folded=True,
    )


# ----------------------------------------------------------------------------- moe_ep pack
@dataclass(frozen=True)
class MoEWeightPackSpec:
    """What vLLM hands FlashInfer for NVFP4 experts (``MoEWeightPack`` fields + alphas).

    =========  =====================  ==========================================================
    field      shape, dtype           meaning
    =========  =====================  ==========================================================
    w13        (E, 2I, H/2) uint8     packed e2m1, rows [gate; up] (FlashInfer interleaves later)
    w2         (E, H, I/2) uint8      packed e2m1
    w13_scale  (E, 2I, H/16) e4m3     block scales, up half folded
    w2_scale   (E, H, I/16) e4m3      block scales
    fc1_alpha  (E,) float32           gate weight_scale_2 (activations are quantized dynamically,
                                      so input_scale drops out)
    fc2_alpha  (E,) float32           w2 weight_scale_2
    =========  =====================  ==========================================================
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    fc1_alpha: torch.Tensor
    fc2_alpha: torch.Tensor


def check_moe_weight_pack(
    pack: MoEWeightPackSpec, *, num_local_experts: int, hidden_size: int, intermediate_size: int
) -> None:
    """Field names, shapes and dtypes FlashInfer's NVFP4 CuTeDSL preprocessing requires."""
    E, H, I = num_local_experts, hidden_size, intermediate_size
    if I % 16 or H % 16:
        raise InputError(
            f"intermediate_size / hidden_size: expected multiples of 16 (NVFP4 blocks, 16-row "
            f"gate/up interleave), got I={I}, H={H}"
        )
    want = {
        "w13": ((torch.uint8,), (E, 2 * I, H // 2)),
        "w2": ((torch.uint8,), (E, H, I // 2)),
        "w13_scale": ((torch.float8_e4m3fn,), (E, 2 * I, H // 16)),
        "w2_scale": ((torch.float8_e4m3fn,), (E, H, I // 16)),
        "fc1_alpha": ((torch.float32,), (E,)),
        "fc2_alpha": ((torch.float32,), (E,)),
    }
    for name, (dtypes, shape) in want.items():
        t = getattr(pack, name)
        check_dtype(f"pack.{name}", t, dtypes)
        check_shape(f"pack.{name}", t, shape)
        if not t.is_contiguous():
            raise InputError(f"pack.{name}: expected a contiguous tensor")


def nvfp4_moe_weight_pack(experts: RoutedExperts) -> MoEWeightPackSpec:
    """vLLM's ``nvfp4_prequant_pack_and_alphas`` on a loaded layer's routed experts."""
    folded = fold_nvfp4_experts(experts)
    assert folded.w13_weight_scale is not None and folded.w2_weight_scale is not None
    assert folded.w13_weight_scale_2 is not None and folded.w2_weight_scale_2 is not None
    pack = MoEWeightPackSpec(
        w13=folded.w13_weight.contiguous(),
        w2=folded.w2_weight.contiguous(),
        w13_scale=folded.w13_weight_scale.contiguous(),
        w2_scale=folded.w2_weight_scale.contiguous(),
        fc1_alpha=folded.w13_weight_scale_2[:, 0].contiguous(),
        fc2_alpha=folded.w2_weight_scale_2.float().contiguous(),
    )
    check_moe_weight_pack(
        pack,
        num_local_experts=experts.num_local_experts,
        hidden_size=experts.hidden_size,
        intermediate_size=experts.intermediate_size,
    )
    return pack


def to_flashinfer_weight_pack(pack: MoEWeightPackSpec) -> Any:
    """The real ``flashinfer.moe_ep.MoEWeightPack`` (a pre-quantized pack); needs flashinfer."""
    from flashinfer.moe_ep import MoEWeightPack  # optional dependency

    return MoEWeightPack(w13=pack.w13, w2=pack.w2, w13_scale=pack.w13_scale, w2_scale=pack.w2_scale)


# ----------------------------------------------------------------------------- padding rows
def apply_routing_padding_mask(
    topk_ids: torch.Tensor, is_padding: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of padding tokens route nowhere: ``topk_ids (T, K)`` -> same with padded rows = -1.

    ``is_padding (T,)`` bool.  Without a mask the very same tensor is returned; the weights are
    never touched.  (-1 means "no expert": the row is not dispatched.)
    """
    if is_padding is None:
        return topk_ids
    check_dtype("is_padding", is_padding, (torch.bool,))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    if topk_ids.dim() != 2:
        raise InputError(f"topk_ids: expected shape (T, K), got {tuple(topk_ids.shape)}")
    check_shape("is_padding", is_padding, (topk_ids.shape[0],))
    return torch.where(is_padding[:, None], torch.full_like(topk_ids, -1), topk_ids)
