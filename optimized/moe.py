"""The MoE sublayer on the H200: router, routed experts over packed weights, shared expert.

Same math as :mod:`dsv4mtp.reference.moe` (docs/semantics.md, "MoE: router, clamped SwiGLU,
shared expert").  Public functions: :func:`route`, :func:`fused_experts`, :func:`moe`, and the
helper :func:`pack_moe` that builds a :class:`MoEPack` (the kernels' layout) from core
:class:`~dsv4mtp.params.MoEParams`.

Kernels (optimized/kernels/moe_*.py), per call, all on the device with no host sync (so a call at
fixed T is CUDA-graph capturable):

1. router (``moe_route``): tensor-core logits over D slices (fp32 partials), then a per-token
   top-k (ties: lowest expert id);
2. align (``moe_align``): the slots (token, k) sorted by local expert, padded to BLOCK_M blocks;
3. gate/up (``moe_gemm``): per (M block, N tile), weights decoded in registers (MXFP4, NVFP4,
   FP8 128x128, bf16), bf16 tensor-core dots with fp32 accumulation, global scales on the
   accumulator, clamped SwiGLU times the routing weight, hidden in the activation dtype (MXFP4
   up to 768 tokens by default: one ``dot_scaled`` per 32-column group on the e2m1 values,
   the e8m0 scale on the fp32 partial);
4. down: per (M block, N tile), each slot's output written to a (T*K, D) workspace;
5. the shared expert: steps 3-4 on every token with one expert (its FP8 codes when the params
   carry them, else its dense weights);
6. reduce: each token's K slots summed in slot order in fp32, plus the shared row, one rounding.

``act_quant`` (the ``official`` preset) rounds x and the hidden activations through e4m3 per
1x128 block with power-of-two scales (dsv4mtp/quant.py) in a small pass before each GEMM and feeds
the dequantized values (exact in bf16) to the same dots: the reference's quantize-dequantize-
then-matmul, computed without FP8 x FP8 tensor cores.

Schedules: every tile, split, launch-order and decode choice is one :class:`MoESchedule`
(kernels/moe_schedule.py), passed as ``schedule=`` to :func:`fused_experts` and :func:`moe`
(for sweeps and tests; bench/diag/moe_sweep.py); ``None`` takes :func:`moe_config`'s default
for the call's T.  ``batch_invariant=True`` takes the default that does not depend on T
(BLOCK_M 64 for every T; the T-dependent default uses 8 (MXFP4) or 16 rows per block up to 64
tokens, where a 64-row tile would be mostly padding, and for MXFP4 8 or 16 up to 768).  Any fixed schedule is batch invariant: a row's result
does not depend on the other rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from dsv4mtp import formats
from dsv4mtp.checkpoint.weights import RoutedExperts
from dsv4mtp.checks import CodeRule, check_finite_codes, check_instance, check_ndim, check_shape
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import InputError
from dsv4mtp.params import DenseExperts, MoEParams, PackedExperts

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from ._dispatch import Facts, select
from ._packs import packed_once
from .kernels._launch import check_device, check_kernel_dtype, check_out, check_row_mask
from .kernels.moe_schedule import (
    GemmTile,
    MoESchedule,
    check_schedule_shapes,
    moe_config,
    schedule_to_fields,
)
from .linear import exact_in_bf16

__all__ = [
    "GemmTile",
    "MoEPack",
    "MoESchedule",
    "fused_experts",
    "moe",
    "moe_config",
    "mx_rows",
    "mx_tiles",
    "pack_moe",
    "route",
]

MoEBackend = Literal["auto", "triton"]

_ops_route = torch.ops.dsv4mtp.moe_route.default
_ops_route_out = torch.ops.dsv4mtp.moe_route_out.default
_ops_experts = torch.ops.dsv4mtp.fused_experts.default
_ops_experts_out = torch.ops.dsv4mtp.fused_experts_out.default
_ops_moe = torch.ops.dsv4mtp.moe.default
_ops_moe_out = torch.ops.dsv4mtp.moe_out.default

# The kernels stream weights in 128-wide K blocks (one FP8 scale block; 4 MXFP4 / 8 NVFP4 groups).
_K_ALIGN = 128
_FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class MoEPack:
    """One MoE sublayer in the kernels' layout (optimized/kernels/moe_gemm.py, module doc).

    Routed experts (E_loc local ones): ``w13`` (E_loc, 2I, D or D/2) and ``w2`` (E_loc, D, I or
    I/2) codes as the checkpoint stores them (rows [gate ; up]); ``s13`` / ``s2`` their block
    scales (FP8: fp32 (E_loc, N/128, K/128); MXFP4: e8m0 bytes; NVFP4: e4m3 bytes; bf16: empty).
    ``layout``: "rows" (the checkpoint's byte order) or, MXFP4 only, "tiles": the same shapes
    with the bytes reordered for the kernels' loads (:func:`mx_tiles`; ``decode_expert`` and
    :func:`mx_rows` give the rows back).  ``gscale`` (E_loc, 3) fp32 global scales of gate, up, down (NVFP4, folded or not; else ones).
    ``expert_map`` (E,) int32 global -> local id (-1 off this rank).  Router: ``gate_weight``
    (E, D) (bf16 when that is exact, else fp32), ``gate_bias`` (E,) fp32.  Shared expert: the
    same fields with one expert (``shared_fmt`` "fp8" or "bf16"; ``shared_exact_bf16``: FP8 with
    every block scale a power of two, set and checked like ``mx_fold``).  ``max_tokens``: the
    largest T a call may pass (the workspace bound).  ``mx_fold`` (tiles only): every routed e8m0
    scale byte is <= 128, so the Gluon GEMMs may apply the scales in their bf16 decode
    (kernels/moe_gemm_gluon.py; a larger byte would overflow the bf16 multiplier); ``pack_moe`` sets
    it, and a pack claiming it is checked against its scales.
    """

    fmt: str
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    gscale: torch.Tensor
    expert_map: torch.Tensor
    num_experts: int
    hidden_size: int
    intermediate_size: int
    quantized: bool
    gate_weight: torch.Tensor
    gate_bias: torch.Tensor
    shared_fmt: str
    shared_w13: torch.Tensor
    shared_s13: torch.Tensor
    shared_w2: torch.Tensor
    shared_s2: torch.Tensor
    shared_quantized: bool
    max_tokens: int
    layout: str = "rows"
    mx_fold: bool = False
    shared_exact_bf16: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("rows", "tiles") or (self.layout == "tiles" and self.fmt != "mxfp4"):
            raise InputError(
                f"layout: expected 'rows', or 'tiles' for MXFP4 experts, got {self.layout!r} "
                f"for {self.fmt!r}"
            )
        if not isinstance(self.mx_fold, bool) or (self.mx_fold and self.layout != "tiles"):
            raise InputError(
                f"mx_fold: expected a bool, True only for the tiles layout, got {self.mx_fold!r} "
                f"for layout {self.layout!r}"
            )
        if self.mx_fold and _max_scale_byte(self.s13, self.s2) > 128:
            raise InputError(
                "mx_fold: the routed e8m0 scales hold a byte above 128 (a scale above 2), which "
                "the folded decode cannot apply; expected mx_fold=False for these scales"
            )
        if not isinstance(self.shared_exact_bf16, bool) or (
            self.shared_exact_bf16
            and not (
                self.shared_fmt == "fp8" and _shared_scales_exact(self.shared_s13, self.shared_s2)
            )
        ):
            raise InputError(
                f"shared_exact_bf16: expected a bool, True only for an FP8 shared expert whose "
                f"block scales are all powers of two in [2^-100, 2^100], got "
                f"{self.shared_exact_bf16!r} for shared_fmt {self.shared_fmt!r}"
            )

    @property
    def kernel_fmt(self) -> str:
        """The routed format as the operators take it: ``fmt``, or for tiles "mxfp4_tiles"
        ("mxfp4_tiles_fold" with ``mx_fold``)."""
        if self.layout != "tiles":
            return self.fmt
        return "mxfp4_tiles_fold" if self.mx_fold else "mxfp4_tiles"

    @property
    def shared_op_fmt(self) -> str:
        """The shared expert's format as the operators take it: ``shared_fmt``, or "fp8_exact"
        with ``shared_exact_bf16`` (prefill-sized calls then run it on cuBLAS over the
        bf16-dequantized weight, exact: optimized/_ops.py, ``_shared_expert``)."""
        return "fp8_exact" if self.shared_exact_bf16 else self.shared_fmt

    @property
    def num_local_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def decode_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 (2I, D), w2 (D, I)) bf16 of local expert ``e``: codes times block scales, before
        the NVFP4 global scales (the core decode, rounded once to bf16)."""
        if not 0 <= e < self.num_local_experts:
            raise InputError(
                f"e: expected a local expert id in [0, {self.num_local_experts}), got {e}"
            )
        w13, s13, w2, s2 = self.w13[e : e + 1], self.s13, self.w2[e : e + 1], self.s2
        if s13.numel():
            s13, s2 = s13[e : e + 1], s2[e : e + 1]
        if self.layout == "tiles":
            w13, s13 = mx_rows(w13, s13, interleaved=True)
            w2, s2 = mx_rows(w2, s2, interleaved=False)
        return (
            _decode(self.fmt, w13[0], s13[0] if s13.numel() else None),
            _decode(self.fmt, w2[0], s2[0] if s2.numel() else None),
        )


# ----------------------------------------------------------------------------------- layout
# The "tiles" layout of MXFP4 routed experts.  The decode-size GEMMs stream each expert's codes
# in 128-row tiles, 128 K columns (64 bytes per row) per step.  In the checkpoint's rows a step
# reads 128 pieces of 64 bytes lying K/2 bytes apart, which capped the weight stream at
# 2.2-2.4 TB/s on the H200 with no compute at all, against 4.0 TB/s for the same bytes read as
# contiguous blocks (bench/results/moe-h200.md, "The weight stream and the layout").  So:
#
# * codes (N, K/2) per expert -> (N/128, K/128, 128, 64): each (128-row, 64-byte) block, 8 KiB,
#   contiguous; scales (N, K/32) -> (N/128, K/128, 128, 4): a step's 128 words, 512 B;
# * w13's rows interleaved first: packed row 2c is gate column c, 2c+1 up column c, so one
#   stream of rows feeds both halves of the SwiGLU (one accumulator, split in the epilogue).
#
# Shapes are unchanged ((E, N, K/2) and (E, N, K/32) bytes); only the byte order differs.
_TILE_ROWS, _TILE_BYTES = 128, 64
_TILE_CHUNK = 16  # experts reordered per copy: bounds the packing's transient memory


def _tile_one(t: torch.Tensor, width: int, interleave: bool) -> torch.Tensor:
    """(e, N, W) bytes in rows -> the same shape in tiles of (128 rows, ``width`` bytes)."""
    e, N, W = t.shape
    if interleave:  # [gate ; up] -> gate 0, up 0, gate 1, up 1, ...
        t = t.view(e, 2, N // 2, W).transpose(1, 2)
    t = t.reshape(e, N // _TILE_ROWS, _TILE_ROWS, W // width, width).transpose(2, 3)
    return t.reshape(e, N, W)


def _untile_one(t: torch.Tensor, width: int, interleaved: bool) -> torch.Tensor:
    e, N, W = t.shape
    t = t.reshape(e, N // _TILE_ROWS, W // width, _TILE_ROWS, width).transpose(2, 3)
    t = t.reshape(e, N, W)
    if interleaved:
        t = t.view(e, N // 2, 2, W).transpose(1, 2)
    return t.reshape(e, N, W)


def _chunked(
    t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], in_place: bool = False
) -> torch.Tensor:
    """fn over ``_TILE_CHUNK`` experts at a time, into a new tensor or back into ``t``."""
    out = t if in_place else torch.empty_like(t)
    for e0 in range(0, t.shape[0], _TILE_CHUNK):
        out[e0 : e0 + _TILE_CHUNK] = fn(t[e0 : e0 + _TILE_CHUNK].clone() if in_place else
                                        t[e0 : e0 + _TILE_CHUNK])  # fmt: skip
    return out


def _check_mx(codes: torch.Tensor, scales: torch.Tensor) -> None:
    """(E, N, K/2) and (E, N, K/32) contiguous uint8 with N and K multiples of 128."""
    for name, t in (("codes", codes), ("scales", scales)):
        check_instance(name, t, torch.Tensor)
        check_ndim(name, t, 3)
        if t.dtype != torch.uint8 or not t.is_contiguous():
            raise InputError(
                f"{name}: expected contiguous uint8, got {t.dtype} {tuple(t.stride())}"
            )
    E, N, Kh = codes.shape
    if N % _TILE_ROWS or Kh % _TILE_BYTES:
        raise InputError(
            f"codes: expected N and K multiples of 128, got (E, N, K/2) {tuple(codes.shape)}"
        )
    check_shape("scales", scales, (E, N, Kh // 16))


def mx_tiles(
    codes: torch.Tensor, scales: torch.Tensor, *, interleaved: bool, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes (E, N, K/2) and e8m0 scales (E, N, K/32), uint8, checkpoint rows -> the
    ``"tiles"`` layout (same shapes): new tensors, or with ``in_place`` the inputs themselves
    reordered (contiguous inputs; one chunk of experts is copied at a time, so no second copy
    of the experts is ever held).  ``interleaved``: w13's [gate ; up] rows interleaved first.
    N and K must be multiples of 128."""
    _check_mx(codes, scales)
    return (
        _chunked(codes, lambda t: _tile_one(t, _TILE_BYTES, interleaved), in_place),
        _chunked(scales, lambda t: _tile_one(t, 4, interleaved), in_place),
    )


def mx_rows(
    codes: torch.Tensor, scales: torch.Tensor, *, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`mx_tiles`: the checkpoint's rows back (new tensors)."""
    _check_mx(codes, scales)
    return (
        _chunked(codes, lambda t: _untile_one(t, _TILE_BYTES, interleaved)),
        _chunked(scales, lambda t: _untile_one(t, 4, interleaved)),
    )


def _decode(fmt: str, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    f32 = torch.float32
    if fmt == "bf16":
        return codes.to(torch.bfloat16)
    assert scale is not None
    if fmt == "fp8":
        return formats.dequantize_fp8_block(codes, scale, dtype=f32).to(torch.bfloat16)
    if fmt == "mxfp4":
        return formats.dequantize_mxfp4(codes, scale, dtype=f32).to(torch.bfloat16)
    one = torch.ones((), dtype=f32, device=codes.device)
    sf = scale.view(torch.float8_e4m3fn)
    return formats.dequantize_nvfp4(codes, sf, one, dtype=f32).to(torch.bfloat16)


# ----------------------------------------------------------------------------------- packing
def _fp8_scale(scale: torch.Tensor) -> torch.Tensor:
    """FP8 block scales as fp32 (e8m0 bytes widened exactly)."""
    if scale.dtype == torch.float32:
        return scale
    return formats.decode_e8m0(scale, dtype=torch.float32)


# The stored scales' rules of dsv4mtp/checkpoint/scan.py (e2m1 weights are always finite).
_SCALE_RULES: dict[str, CodeRule] = {
    "fp8_e8m0": "fp8_scale", "fp8_f32": "fp8_scale", "mxfp4": "mxfp4_scale",
    "nvfp4": "nvfp4_block_scale",
}  # fmt: skip


def _check_routed_codes(ex: RoutedExperts) -> None:
    """Refuse NaN codes and non-finite scales, as the checkpoint loader does: the kernels' e4m3
    decode (kernels/decode.py) of FP8 weights and NVFP4 block scales has no NaN and would
    compute a NaN code as +-480, and an MXFP4 e8m0 NaN byte (0xFF) decodes as +inf, where the
    reference gives NaN.  One host-syncing pass over the stored bytes, once per pack."""
    named = f" ({ex.name})" if ex.name else ""
    where = "(local expert, ...)"
    for w in ("w13", "w2"):
        if ex.format in ("fp8_e8m0", "fp8_f32"):
            codes = getattr(ex, f"{w}_weight")
            check_finite_codes(f"experts.{w}_weight{named}", codes, "e4m3_weight", index=where)
        scale = getattr(ex, f"{w}_weight_scale")
        if ex.format in _SCALE_RULES and scale is not None:
            rule = _SCALE_RULES[ex.format]
            check_finite_codes(f"experts.{w}_weight_scale{named}", scale, rule, index=where)
        scale_2 = getattr(ex, f"{w}_weight_scale_2")
        if ex.format == "nvfp4" and scale_2 is not None:
            check_finite_codes(f"experts.{w}_weight_scale_2{named}", scale_2, "nvfp4_global_scale")


def _pack_routed(
    ex: RoutedExperts, device: torch.device
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ex = ex.to(device)
    _check_routed_codes(ex)
    E = ex.num_local_experts
    f32 = torch.float32
    ones = torch.ones((E, 3), dtype=f32, device=device)
    empty = torch.empty((0,), dtype=torch.uint8, device=device)
    if ex.format == "bf16":
        w13, w2 = ex.w13_weight.contiguous(), ex.w2_weight.contiguous()
        if w13.dtype not in (torch.bfloat16, torch.float32):
            w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
        return "bf16", w13, empty, w2, empty, ones
    assert ex.w13_weight_scale is not None and ex.w2_weight_scale is not None
    if ex.format in ("fp8_e8m0", "fp8_f32"):
        return (
            "fp8",
            ex.w13_weight.contiguous().view(torch.uint8),
            _fp8_scale(ex.w13_weight_scale).contiguous(),
            ex.w2_weight.contiguous().view(torch.uint8),
            _fp8_scale(ex.w2_weight_scale).contiguous(),
            ones,
        )
    s13 = ex.w13_weight_scale.contiguous().view(torch.uint8)
    s2 = ex.w2_weight_scale.contiguous().view(torch.uint8)
    w13 = ex.w13_weight.contiguous().view(torch.uint8)
    w2 = ex.w2_weight.contiguous().view(torch.uint8)
    if ex.format == "mxfp4":
        return "mxfp4", w13, s13, w2, s2, ones
    if ex.format != "nvfp4" or ex.w13_weight_scale_2 is None or ex.w2_weight_scale_2 is None:
        raise InputError(f"experts: cannot pack routed experts of format {ex.format!r}")
    gs = torch.cat(
        [ex.w13_weight_scale_2.to(f32).reshape(E, 2), ex.w2_weight_scale_2.to(f32).reshape(E, 1)],
        1,
    ).contiguous()
    return "nvfp4", w13, s13, w2, s2, gs


def _pack_shared(
    params: MoEParams, device: torch.device
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    raw = params.shared_fp8
    empty = torch.empty((0,), dtype=torch.uint8, device=device)
    if raw is not None:
        q1, q3, q2 = (q.to(device) for q in raw)
        assert q1.scale is not None and q3.scale is not None and q2.scale is not None
        for i, q in enumerate((q1, q3, q2)):  # no NaN in the kernels' e4m3 decode, as above
            assert q.scale is not None
            named = f" ({q.name})" if q.name else ""
            check_finite_codes(f"params.shared_fp8[{i}].data{named}", q.data, "e4m3_weight")
            check_finite_codes(f"params.shared_fp8[{i}].scale{named}", q.scale, "fp8_scale")
        codes13 = torch.cat([q1.data, q3.data], 0).view(torch.uint8)[None].contiguous()
        s13 = torch.cat([_fp8_scale(q1.scale), _fp8_scale(q3.scale)], 0)[None].contiguous()
        codes2 = q2.data.view(torch.uint8)[None].contiguous()
        return "fp8", codes13, s13, codes2, _fp8_scale(q2.scale)[None].contiguous()
    w13 = torch.cat([params.shared_w1, params.shared_w3], 0).to(device)[None]
    w2 = params.shared_w2.to(device)[None]
    if w13.dtype not in (torch.bfloat16, torch.float32):
        w13, w2 = w13.float(), w2.float()
    return "bf16", w13.contiguous(), empty, w2.contiguous(), empty


def pack_moe(
    params: MoEParams,
    device: torch.device | str,
    *,
    max_tokens: int = 8192,
    mxfp4_layout: str = "tiles",
    reuse_expert_memory: bool = False,
) -> MoEPack:
    """Pack a core :class:`MoEParams` for the kernels (a helper, not an op; runs once per layer).

    Routed experts from ``params.experts`` (:class:`PackedExperts` over a checkpoint's
    :class:`RoutedExperts` in any format, a :class:`RoutedExperts`, or :class:`DenseExperts`);
    the shared expert from ``params.shared_fp8`` (raw FP8 codes and scales) when present, else
    its dense weights.  Refused during CUDA-graph capture (it allocates and syncs).  NaN codes
    (FP8 weights, NVFP4 block scales) and non-finite scales are an :class:`InputError`
    (``check_finite_codes``: the kernels' decode has no NaN).

    ``mxfp4_layout`` (MXFP4 routed experts): "tiles" (default) reorders the codes and scales
    into the kernels' (128-row, 128-column) blocks with w13's gate and up rows interleaved
    (:func:`mx_tiles`); "rows" keeps the checkpoint's tensors as they are (no copy).  Other
    formats always keep their rows.  The tiles are a copy of the experts (both held while
    packing) unless the pack owns the stored tensors: moved here from another device, or
    ``reuse_expert_memory=True``, which reorders the params' MXFP4 expert tensors in place
    (they then hold the tiles and the params must not be used again: for a caller that drops
    them, as ``MTPLayer.from_checkpoint`` does with the checkpoint it loaded).
    """
    check_instance("params", params, MoEParams)
    check_instance("reuse_expert_memory", reuse_expert_memory, bool)
    if mxfp4_layout not in ("rows", "tiles"):
        raise InputError(f"mxfp4_layout: expected 'rows' or 'tiles', got {mxfp4_layout!r}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise InputError("params: pack_moe cannot run during CUDA-graph capture; pack before")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InputError(f"max_tokens: expected an int >= 1, got {max_tokens!r}")
    device = torch.device(device)
    src: object = params.experts
    if isinstance(src, PackedExperts):
        src = src.packed
    if isinstance(src, RoutedExperts):
        fmt, w13, s13, w2, s2, gs = _pack_routed(src, device)
        E, start, E_loc = src.num_experts, src.expert_start, src.num_local_experts
        D, inter, quantized = src.hidden_size, src.intermediate_size, src.format != "bf16"
    elif isinstance(src, DenseExperts):
        w13 = torch.cat([src.w1, src.w3], 1).to(device)
        w2 = src.w2.to(device)
        if w13.dtype not in (torch.bfloat16, torch.float32):
            w13, w2 = w13.float(), w2.float()
        w13, w2 = w13.contiguous(), w2.contiguous()
        E = E_loc = src.num_experts
        start, inter, D = 0, int(src.w1.shape[1]), int(src.w1.shape[2])
        fmt, quantized = "bf16", bool(src.quantized)
        s13 = s2 = torch.empty((0,), dtype=torch.uint8, device=device)
        gs = torch.ones((E, 3), dtype=torch.float32, device=device)
    else:
        raise InputError(
            f"params.experts: expected PackedExperts, RoutedExperts or DenseExperts, got "
            f"{type(src).__name__}"
        )
    if D % _K_ALIGN or inter % _K_ALIGN:
        raise InputError(
            f"experts: the kernels need hidden and intermediate sizes that are multiples of "
            f"{_K_ALIGN}, got D = {D}, I = {inter}"
        )
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[start : start + E_loc] = torch.arange(E_loc, dtype=torch.int32)
    gate = params.gate_weight.to(device)
    if gate.dtype != torch.bfloat16 and torch.equal(gate.to(torch.bfloat16).to(gate.dtype), gate):
        gate = gate.to(torch.bfloat16)  # exact: half the router's bytes
    sfmt, sw13, ss13, sw2, ss2 = _pack_shared(params, device)
    layout = "tiles" if fmt == "mxfp4" and mxfp4_layout == "tiles" else "rows"
    if layout == "tiles":
        assert isinstance(src, RoutedExperts)
        stored = (src.w13_weight, src.w13_weight_scale, src.w2_weight, src.w2_weight_scale)
        owned = not any(
            _same_storage(a, b) for a, b in zip((w13, s13, w2, s2), stored, strict=True)
        )
        in_place = owned or reuse_expert_memory
        w13, s13 = mx_tiles(w13, s13, interleaved=True, in_place=in_place)
        w2, s2 = mx_tiles(w2, s2, interleaved=False, in_place=in_place)
    # every e8m0 scale byte <= 128 (scales <= 2, as in real checkpoints): the Gluon GEMMs may
    # apply the scales in their bf16 decode (exact there: 2**(s - 1) is a normal bf16)
    fold = layout == "tiles" and _max_scale_byte(s13, s2) <= 128
    return MoEPack(
        fmt=fmt, w13=w13, s13=s13, w2=w2, s2=s2, gscale=gs, expert_map=emap.to(device),
        num_experts=E, hidden_size=D, intermediate_size=inter, quantized=quantized,
        gate_weight=gate.contiguous(), gate_bias=params.gate_bias.to(device, torch.float32),
        shared_fmt=sfmt, shared_w13=sw13, shared_s13=ss13, shared_w2=sw2, shared_s2=ss2,
        shared_quantized=bool(params.shared_quantized), max_tokens=max_tokens, layout=layout,
        mx_fold=fold, shared_exact_bf16=sfmt == "fp8" and _shared_scales_exact(ss13, ss2),
    )  # fmt: skip


def _shared_scales_exact(s13: torch.Tensor, s2: torch.Tensor) -> bool:
    """Every FP8 block scale of the shared expert a power of two in range (the dense linears'
    rule, optimized/linear.py): each code x scale is then exact in bf16."""
    return exact_in_bf16(s13) and exact_in_bf16(s2)


def _max_scale_byte(s13: torch.Tensor, s2: torch.Tensor) -> int:
    """The largest e8m0 byte of the routed scales (one host read: packs are built outside
    CUDA-graph capture)."""
    return max(int(s13.max()), int(s2.max()))


def _same_storage(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------------- route
def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    config: DSV4Config,
    *,
    batch_invariant: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: MoEBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrtsoftplus routing: x (T, D) -> (weights (T, K) fp32, ids (T, K) int32).

    gate_weight (E, D), gate_bias (E,) bf16 / fp32.  Logits in fp32, scores sqrt(softplus),
    top-K of scores + bias (ties: the lowest expert id), weights = the unbiased scores of the
    selected renormalised, times ``routed_scaling_factor``.  Fuses the gate GEMV, the scoring and
    the selection (kernels/moe_route.py); moves the gate once (E*D*itemsize) plus x, and fp32
    split-D partials (2*split*T*E*4 bytes).
    ``out=(weights, ids)``: contiguous buffers of those shapes and dtypes, written in place.
    The default schedule depends on T (``route_config``: wide D splits at decode sizes, larger
    tiles and fewer splits for many tokens); ``batch_invariant=True`` takes one schedule for
    every T, so each row's bits do not depend on the batch.
    """
    check_instance("config", config, DSV4Config)
    check_instance("batch_invariant", batch_invariant, bool)
    for name, t in (("x", x), ("gate_weight", gate_weight), ("gate_bias", gate_bias)):
        check_kernel_dtype(name, t)
    E, D, K = config.n_routed_experts, config.hidden_size, config.num_experts_per_tok
    check_shape("x", x, (None, D))
    check_shape("gate_weight", gate_weight, (E, D))
    check_shape("gate_bias", gate_bias, (E,))
    dev = check_device([("x", x), ("gate_weight", gate_weight), ("gate_bias", gate_bias)])
    select("route", backend, Facts(dev, (x.dtype, gate_weight.dtype)))
    args = (x, gate_weight, gate_bias, K, float(config.routed_scaling_factor), batch_invariant)
    if out is None:
        w, ids = _ops_route(*args)
        return w, ids
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InputError("out: expected a 2-tuple (weights, ids)")
    T = x.shape[0]
    w = check_out("out[0]", out[0], (T, K), torch.float32, dev)
    ids = check_out("out[1]", out[1], (T, K), torch.int32, dev)
    _ops_route_out(*args, weights=w, ids=ids)
    return w, ids


# ----------------------------------------------------------------------------------- experts
def _check_pack(experts: object) -> MoEPack:
    if not isinstance(experts, MoEPack):
        raise InputError(
            f"experts: expected a MoEPack (dsv4mtp.optimized.pack_moe), got {type(experts).__name__}"
        )
    return experts


def _check_tokens(x: torch.Tensor, pack: MoEPack) -> None:
    check_kernel_dtype("x", x)
    check_ndim("x", x, 2)
    check_shape("x", x, (None, pack.hidden_size))
    if x.shape[0] > pack.max_tokens:
        raise InputError(
            f"x: {x.shape[0]} tokens exceed the pack's max_tokens {pack.max_tokens} "
            "(pack_moe(..., max_tokens=...))"
        )


def _routed_args(pack: MoEPack) -> tuple[object, ...]:
    return (pack.w13, pack.s13, pack.w2, pack.s2, pack.gscale, pack.kernel_fmt)


def _schedule_fields(schedule: MoESchedule | None, pack: MoEPack) -> list[int]:
    """The operators' int list of ``schedule`` (empty: the default), checked against the
    pack's shapes."""
    if schedule is None:
        return []
    check_instance("schedule", schedule, MoESchedule)
    check_schedule_shapes(
        schedule, pack.kernel_fmt, pack.shared_fmt, pack.hidden_size, pack.intermediate_size
    )
    return schedule_to_fields(schedule)


def _shared_args(pack: MoEPack, limit: float, act_quant: bool) -> tuple[object, ...]:
    return (
        pack.shared_w13, pack.shared_s13, pack.shared_w2, pack.shared_s2, pack.shared_op_fmt,
        float(limit), bool(act_quant and pack.shared_quantized),
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    experts: MoEPack,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    limit: float,
    expert_map: torch.Tensor | None = None,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: MoEBackend = "auto",
    schedule: MoESchedule | None = None,
) -> torch.Tensor:
    """Routed experts with caller-supplied routing: x (T, D) -> (T, D) in x.dtype.

    topk_ids (T, K) int (-1: padding, the slot touches no expert), topk_weights (T, K) float;
    ``expert_map`` (E,) int32 global -> local id (-1: not on this rank, contributes nothing;
    default: the pack's own map).  ``out = sum_k w_k * expert_k(x)`` (the routing weight
    multiplies the hidden before w2), clamped SwiGLU with ``limit``, fp32 accumulation, no shared
    expert.  ``act_quant``: e4m3 activation rounding before both GEMMs (quantized experts only,
    as the reference).  Moves the codes and scales of every expert with a routed row once (at
    T <= 64), x, and a (T*K, D) workspace twice.  ``schedule``: a :class:`MoESchedule`
    (tiles, K splits, decode; its shared-expert fields are unused here), default
    :func:`moe_config`.
    """
    pack = _check_pack(experts)
    check_instance("batch_invariant", batch_invariant, bool)
    check_instance("act_quant", act_quant, bool)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise InputError(f"limit: expected a float, got {limit!r}")
    _check_tokens(x, pack)
    T = x.shape[0]
    check_ndim("topk_ids", topk_ids, 2)
    K = topk_ids.shape[1]
    check_shape("topk_ids", topk_ids, (T, K))
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise InputError(f"topk_ids: expected int32 or int64, got {topk_ids.dtype}")
    check_kernel_dtype("topk_weights", topk_weights)
    check_shape("topk_weights", topk_weights, (T, K))
    named = [("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)]
    if expert_map is not None:
        if not isinstance(expert_map, torch.Tensor) or expert_map.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise InputError("expert_map: expected an int32 tensor of global -> local ids")
        check_shape("expert_map", expert_map, (pack.num_experts,))
        named.append(("expert_map", expert_map))
    dev = check_device(named)
    if pack.device != dev:
        raise InputError(f"experts: packed on {pack.device}, x is on {dev}")
    select("fused_experts", backend, Facts(dev, (x.dtype,)))
    emap = pack.expert_map if expert_map is None else expert_map
    args = (
        x, topk_ids, topk_weights, emap, *_routed_args(pack), float(limit),
        bool(act_quant and pack.quantized), batch_invariant, _schedule_fields(schedule, pack),
    )  # fmt: skip
    if out is None:
        return _ops_experts(*args)
    check_out("out", out, (T, pack.hidden_size), x.dtype, dev)
    _ops_experts_out(*args, out=out)
    return out


# ----------------------------------------------------------------------------------- moe
# A MoEParams passed to ``moe`` is packed once per object and device (optimized/_packs.py: weak,
# so the cache never keeps a layer alive; not re-packed after an in-place change).
def _pack_for(params: object, device: torch.device) -> MoEPack:
    if isinstance(params, MoEPack):
        return params
    check_instance("params", params, MoEParams)
    assert isinstance(params, MoEParams)
    return packed_once(
        params, device, pack_moe,
        "call moe once before capturing, or pass pack_moe(params, device)",
    )  # fmt: skip


def moe(
    x: torch.Tensor,
    params: MoEPack | MoEParams,
    config: DSV4Config,
    *,
    shared_clamp: bool = True,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: MoEBackend = "auto",
    schedule: MoESchedule | None = None,
    row_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE sublayer: x (T, D) (already ffn_norm-ed) -> (T, D) in x.dtype.

    ``params``: a :class:`MoEPack`, or a core :class:`MoEParams` (packed on first use and cached
    for that object; refused during CUDA-graph capture).  Router, routed experts, shared expert
    (added unscaled; ``swiglu_limit`` on it only with ``shared_clamp``), one rounding at the end.
    Moves the router, the routed experts with a routed row, the shared expert (FP8 when the params
    carry its codes) and x once at decode sizes.  ``schedule``: a :class:`MoESchedule`, default
    :func:`moe_config`.  ``row_mask`` (T,) bool on x's device (optimized only): rows where it is
    False are padding, e.g. a CUDA-graph bucket's filler rows; the router's picks for them are
    dropped (ids -1), so they read no routed expert's weights, and their output is the shared
    expert's alone.  Real rows are unaffected (bitwise under ``batch_invariant=True``).
    """
    check_instance("config", config, DSV4Config)
    check_instance("shared_clamp", shared_clamp, bool)
    check_instance("act_quant", act_quant, bool)
    check_instance("batch_invariant", batch_invariant, bool)
    check_kernel_dtype("x", x)
    dev = check_device([("x", x)])
    pack = _pack_for(params, dev)
    _check_tokens(x, pack)
    check_shape("x", x, (None, config.hidden_size))
    if pack.num_experts != config.n_routed_experts:
        raise InputError(
            f"params: expected {config.n_routed_experts} routed experts, got {pack.num_experts}"
        )
    check_row_mask(row_mask, x.shape[0], "x", x)
    select("moe", backend, Facts(dev, (x.dtype,)))
    limit = float(config.swiglu_limit)
    args = (
        x, pack.gate_weight, pack.gate_bias, config.num_experts_per_tok,
        float(config.routed_scaling_factor), pack.expert_map, *_routed_args(pack), limit,
        bool(act_quant and pack.quantized), batch_invariant, _schedule_fields(schedule, pack),
        *_shared_args(pack, limit if shared_clamp else 0.0, act_quant), row_mask,
    )  # fmt: skip
    if out is None:
        return _ops_moe(*args)
    check_out("out", out, tuple(x.shape), x.dtype, dev)
    _ops_moe_out(*args, out=out)
    return out
