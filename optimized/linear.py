"""The dense linears of the MTP layer on the H200: e_proj, h_proj, wq_a, wkv (or the fused
wq_a + wkv), wq_b, wo_b and the grouped wo_a, over FP8 128x128-block or bf16 weights.

Same math as :mod:`dsv4mtp.reference.linear` (docs/semantics.md, "Linear layers", "Block
formats", "Activation and KV quantization"): ``y = x @ W^T`` with fp32 accumulation, rounded
once to x's dtype.  One difference in rounding, declared in conformance/pairs.py: the reference
layer multiplies by the weight dequantized once into the activation dtype, while the kernel
multiplies by the e4m3 codes (exact in bf16) and applies the fp32 128x128 block scale to the
fp32 partial of each 128-wide K block.  With power-of-two (e8m0) scales, V4-Flash's, both are the
same weight; with fp32 scales the kernel skips the weight's bf16 rounding (2^-9 per element).
At prefill sizes (bf16 x, ``DEQUANT_MM_MIN_ROWS`` rows or more, not batch-invariant) a pack whose
scales are powers of two (``LinearPack.exact_bf16``) is instead dequantized to the exact bf16
weight and multiplied by cuBLAS: the same math, fp32 sums in another order.

Public functions: :func:`pack_linear` (a helper, once per weight) builds a :class:`LinearPack`;
:func:`linear`, :func:`grouped_linear` and :func:`eh_proj` (the layer's input projection, the
two linears and their broadcast sum) are the ops, each a ``torch.ops.dsv4mtp`` operator
(optimized/_ops.py) over the packs' flat tensors.  Kernels and schedules:
optimized/kernels/linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dsv4mtp import formats
from dsv4mtp.checkpoint.weights import FP8_BLOCK, QuantizedWeight
from dsv4mtp.checks import (
    check_device_arg,
    check_finite_codes,
    check_instance,
    check_int,
    check_ndim,
    check_shape,
)
from dsv4mtp.errors import InputError

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from ._dispatch import Facts, select
from .kernels._launch import check_device, check_kernel_dtype, check_out

__all__ = ["LinearPack", "eh_proj", "grouped_linear", "linear", "pack_linear"]

LinearBackend = Literal["auto", "triton"]

_ops_linear = torch.ops.dsv4mtp.linear.default
_ops_linear_out = torch.ops.dsv4mtp.linear_out.default
_ops_grouped = torch.ops.dsv4mtp.grouped_linear.default
_ops_grouped_out = torch.ops.dsv4mtp.grouped_linear_out.default
_ops_eh = torch.ops.dsv4mtp.eh_proj.default
_ops_eh_out = torch.ops.dsv4mtp.eh_proj_out.default

_FP8_FORMATS = ("fp8_e8m0", "fp8_f32")
# A pack's split-K tile counters (LinearPack.counters): the split schedules' output tiles are
# 64 columns wide (kernels/linear.py, linear_schedule), decode calls have one M block and
# batch-invariant calls one per 64 rows; counters for 16 M blocks cost 64 B per 64 columns.
_COUNTER_TILE_N = 64
_COUNTER_M_BLOCKS = 16
# An FP8 pack is exact in bf16 when every block scale is 2^e with |e| <= 100: a nonzero e4m3
# value has at most 4 significant bits and a magnitude from 2^-9 to 448, so a nonzero
# code x scale lies in [2^-109, 448 * 2^100], inside bf16's normal range (2^-126 to ~2^128):
# the product keeps its 4 bits, never subnormal, never overflowing.
_EXACT_SCALE_LOG2 = 100


@dataclass(frozen=True)
class LinearPack:
    """One linear weight in the kernels' layout (optimized/kernels/linear.py, module doc).

    ``fmt`` "fp8": ``weight`` (G, N, K) uint8 e4m3 codes and ``scale`` (G, ceil(N/128),
    ceil(K/128)) fp32 block scales (e8m0 widened exactly); "bf16": ``weight`` (G, N, K) bf16 (or
    fp32, kept for fp32 weights) and an empty ``scale``.  G = 1 for a plain linear;
    ``grouped``: built for :func:`grouped_linear` (G groups of N rows each).  ``row_splits``:
    the shards of a fused weight (``fused_wqa_wkv``: (Rq, Dh)), for slicing the output.

    ``counters``: int32 zeros, one per 64-column output tile of each group for 16 M blocks
    (``G * ceil(N/64) * 16``; empty for a dense weight viewed as a pack per call).  A split-K
    call counts the arrivals of each tile's K splits there, and the last split of a tile sums
    the partials and zeroes its count (kernels/linear.py): every call leaves them zero, so no
    memset runs per call and a CUDA graph replays on them as they are.  Hence the one rule a
    pack adds: calls on one pack are ordered (one stream, or streams synchronized between
    them); two calls on one pack running at the same time on two streams would mix their
    counts.  A call of more rows than 16 M blocks (``batch_invariant`` past 1024 rows) runs
    in launches of 16 M blocks.

    ``exact_bf16``: an "fp8" pack whose every block scale is a power of two between 2^-100 and
    2^100 (checked once by :func:`pack_linear`), so each code x scale is exact in bf16: the
    bf16 weight is the weight, and prefill-sized calls take the dequantize + cuBLAS path
    (optimized/kernels/linear.py, module doc; ``op_fmt`` names the format to the operators).
    """

    fmt: str
    weight: torch.Tensor
    scale: torch.Tensor
    counters: torch.Tensor
    grouped: bool = False
    row_splits: tuple[int, ...] | None = None
    name: str = ""
    exact_bf16: bool = False

    @property
    def groups(self) -> int:
        return int(self.weight.shape[0])

    @property
    def out_features(self) -> int:
        """N: output columns per group."""
        return int(self.weight.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[2])

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def op_fmt(self) -> str:
        """The format as the operators take it (optimized/_ops.py): ``fmt``, or "fp8_exact" for
        an FP8 pack whose products are exact in bf16 (``exact_bf16``)."""
        return "fp8_exact" if self.exact_bf16 else self.fmt

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense weight in ``dtype``: (N, K), or (G, N, K) for a grouped pack; the core's
        decode (codes times scales in fp32, one rounding), bit for bit
        ``QuantizedWeight.dequantize(dtype)`` for bf16 and fp32."""
        if self.fmt == "fp8":
            w = formats.dequantize_fp8_block(
                self.weight, self.scale, dtype=torch.promote_types(dtype, torch.float32)
            ).to(dtype)
        else:
            w = self.weight.to(dtype)
        return w if self.grouped else w[0]


def _fp8_scale(scale: torch.Tensor) -> torch.Tensor:
    """FP8 block scales as fp32: e8m0 bytes widened exactly, fp32 as they are."""
    if scale.dtype == torch.float32:
        return scale
    return formats.decode_e8m0(scale, dtype=torch.float32)


def exact_in_bf16(scale: torch.Tensor) -> bool:
    """Every fp32 block scale 2^e with |e| <= _EXACT_SCALE_LOG2 (frexp: 2^e = 0.5 * 2^(e+1));
    one host sync, at pack time."""
    mantissa, exponent = torch.frexp(scale)
    ok = (mantissa == 0.5) & ((exponent - 1).abs() <= _EXACT_SCALE_LOG2)
    return bool(ok.all())


def _dense_weight(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        raise InputError(f"{name}: expected a floating-point weight, got {t.dtype}")
    return t if t.dtype in (torch.bfloat16, torch.float32) else t.to(torch.float32)


def pack_linear(
    weight: QuantizedWeight | torch.Tensor,
    device: torch.device | str | None = None,
    *,
    groups: int | None = None,
) -> LinearPack:
    """Pack a linear weight for :func:`linear` / :func:`grouped_linear` (a helper, not an op;
    once per weight, refused during CUDA-graph capture: it allocates).

    ``weight``: a core :class:`QuantizedWeight` of format ``fp8_e8m0`` / ``fp8_f32`` (codes
    (N, K), block scales (ceil(N/128), ceil(K/128))) or ``bf16``, or a dense (N, K) tensor, or a
    dense (G, N, K) tensor (a grouped pack).  bf16 and fp32 dense weights are kept in their dtype,
    other floats widened to fp32.  ``groups``: split a 2-D weight's rows into that many groups
    (``wo_a``: G = o_groups; FP8 groups must be whole 128-row blocks).  ``device``: default the
    weight's own.  e4m3 NaN codes and non-finite block scales are an :class:`InputError`
    (``check_finite_codes``: the kernels' decode has no NaN).  The pack also owns its split-K
    tile counters (:class:`LinearPack`, ``counters``: int32 zeros, 64 B per 64 output columns
    per group).  ``exact_bf16`` is decided here, once: True for FP8 with every block scale a
    power of two in [2^-100, 2^100] (V4-Flash's e8m0 scales; an ``fp8_f32`` weight too when its
    scales happen to be such powers), which lets prefill-sized calls run on the
    bf16-dequantized weight (:func:`linear`).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise InputError("weight: pack_linear cannot run during CUDA-graph capture; pack before")
    if groups is not None:
        check_int("groups", groups, 1)
    name, row_splits = "", None
    if isinstance(weight, QuantizedWeight):
        name, row_splits = weight.name, weight.row_splits
        N, K = weight.shape
        if weight.format in _FP8_FORMATS:
            if weight.scale is None:
                raise InputError(f"weight: {weight.name or 'FP8 weight'} has no block scales")
            codes = weight.data
            if codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise InputError(
                    f"weight.data: expected dtype float8_e4m3fn or uint8 codes, got {codes.dtype}"
                )
            check_shape("weight.data", codes, (N, K))
            scale = weight.scale
            if scale.dtype not in (torch.float32, torch.uint8, torch.float8_e8m0fnu):
                raise InputError(
                    f"weight.scale: expected dtype float32 or e8m0 bytes (uint8), got {scale.dtype}"
                )
            check_shape("weight.scale", scale, (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK)))
            # The kernels' e4m3 decode has no NaN (kernels/decode.py): a NaN code would compute
            # as +-480 where the reference gives NaN, so NaN codes and scales are refused here.
            named = f" ({weight.name})" if weight.name else ""
            check_finite_codes(f"weight.data{named}", codes, "e4m3_weight")
            check_finite_codes(f"weight.scale{named}", scale, "fp8_scale")
            fmt, w, s = "fp8", codes.view(torch.uint8), _fp8_scale(scale)
        elif weight.format == "bf16":
            check_shape("weight.data", weight.data, (N, K))
            fmt, w, s = "bf16", _dense_weight("weight.data", weight.data), None
        else:
            raise InputError(
                f"weight: format {weight.format!r} is not a dense linear's; expected one of "
                f"{(*_FP8_FORMATS, 'bf16')}"
            )
    elif isinstance(weight, torch.Tensor):
        if weight.dim() == 3:
            if groups is not None and groups != weight.shape[0]:
                raise InputError(
                    f"groups: expected {weight.shape[0]} (the weight's dim 0), got {groups}"
                )
            groups = int(weight.shape[0])
            weight = weight.reshape(-1, weight.shape[2])
        elif weight.dim() != 2:
            raise InputError(
                f"weight: expected shape (N, K) or (G, N, K), got {tuple(weight.shape)}"
            )
        fmt, w, s = "bf16", _dense_weight("weight", weight), None
        N, K = weight.shape
    else:
        raise InputError(
            f"weight: expected a QuantizedWeight or a torch.Tensor, got {type(weight).__name__}"
        )
    if N < 1 or K < 1:
        raise InputError(f"weight: expected a non-empty (N, K) weight, got ({N}, {K})")
    dev = check_device_arg("device", device if device is not None else w.device)
    G = 1 if groups is None else groups
    if N % G:
        raise InputError(f"groups: {G} groups do not divide the weight's {N} rows")
    n = N // G
    if fmt == "fp8" and G > 1 and n % FP8_BLOCK:
        raise InputError(
            f"groups: FP8 groups must be whole {FP8_BLOCK}-row blocks, got {n} rows per group"
        )
    w3 = w.to(dev).reshape(G, n, K).contiguous()
    if s is None:
        s3 = torch.empty((0,), dtype=torch.float32, device=dev)
    else:
        s3 = s.to(dev).reshape(G, -(-n // FP8_BLOCK), s.shape[1]).contiguous()
    counters = torch.zeros(
        (G * -(-n // _COUNTER_TILE_N) * _COUNTER_M_BLOCKS,), dtype=torch.int32, device=dev
    )
    exact = fmt == "fp8" and exact_in_bf16(s3)
    return LinearPack(
        fmt, w3, s3, counters, grouped=groups is not None, row_splits=row_splits, name=name,
        exact_bf16=exact,
    )  # fmt: skip


def _as_pack(weight: object, grouped: bool, name: str = "weight") -> LinearPack:
    """A LinearPack as given (of the right kind), or a dense tensor viewed as one (no copy when
    it is contiguous bf16 / fp32); errors name the argument ``name``."""
    if isinstance(weight, LinearPack):
        if weight.grouped != grouped:
            want = "a grouped pack (pack_linear(w, groups=G))" if grouped else "a plain pack"
            raise InputError(f"{name}: expected {want}, got grouped={weight.grouped}")
        return weight
    if isinstance(weight, torch.Tensor):
        check_kernel_dtype(name, weight)
        check_ndim(name, weight, 3 if grouped else 2)
        w = weight.contiguous()
        w3 = w if grouped else w[None]
        # No counters of its own: a split call takes the stream's zeroed ones (kernels/_sync.py).
        scale = torch.empty((0,), dtype=torch.float32, device=w.device)
        no_counters = torch.empty((0,), dtype=torch.int32, device=w.device)
        return LinearPack("bf16", w3, scale, no_counters, grouped)
    if isinstance(weight, QuantizedWeight):
        raise InputError(
            f"{name}: a QuantizedWeight is packed once with dsv4mtp.optimized.pack_linear(weight)"
            " before the call"
        )
    raise InputError(
        f"{name}: expected a LinearPack or a torch.Tensor, got {type(weight).__name__}"
    )


def _check_call(
    x: torch.Tensor,
    weight: object,
    grouped: bool,
    act_quant: object,
    batch_invariant: object,
    names: tuple[str, str] = ("x", "weight"),
) -> tuple[LinearPack, torch.device]:
    """The checks of one product's arguments; ``names``: how errors call x and the weight."""
    xn, wn = names
    check_instance("act_quant", act_quant, bool)
    check_instance("batch_invariant", batch_invariant, bool)
    check_kernel_dtype(xn, x)
    pack = _as_pack(weight, grouped, wn)
    G, K = pack.groups, pack.in_features
    if grouped:
        check_shape(xn, x, (None, G, K))
    elif x.dim() < 1 or x.shape[-1] != K:
        raise InputError(f"{xn}: expected shape (..., {K}) (the weight's K), got {tuple(x.shape)}")
    dev = check_device([(xn, x)])
    if pack.device != dev:
        raise InputError(f"{wn}: packed on {pack.device}, {xn} is on {dev}")
    return pack, dev


def linear(
    x: torch.Tensor,
    weight: LinearPack | torch.Tensor,
    *,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: LinearBackend = "auto",
) -> torch.Tensor:
    """``x (..., K) @ W^T -> (..., N)`` in x.dtype (bf16 or fp32), fp32 accumulation.

    ``weight``: a plain :class:`LinearPack` (FP8 codes + fp32 128x128 scales, or bf16 / fp32),
    or a dense (N, K) bf16 / fp32 tensor.  ``act_quant``: x is first rounded through e4m3 per
    1x128 block with power-of-two scales (dsv4mtp/quant.py) by a first launch
    (``act_quant_triton``, into a scratch copy), then the same kernel runs on the rounded x
    (exact in bf16): the reference's quantize-dequantize-then-matmul.  Fuses the code decode and
    the block scales into the GEMM, and at decode sizes, where the schedule splits K S ways, the
    split-K reduction too: one launch, whose last split per output tile adds the S fp32
    partials in split order and rounds once (optimized/kernels/linear.py, module docstring),
    counting splits on the pack's ``counters`` (zeros before and after the call; calls on one
    pack must be stream-ordered, :class:`LinearPack`).  Moves the codes once per 64-row block
    (N*K bytes: e_proj 16 MiB, wq_b 32 MiB, wo_b 32 MiB; one read at decode sizes) plus
    N*K/4096 bytes of scales, x (R*K*itemsize, from L2 per N tile), y, and with a K split
    2*S*R*N*4 bytes of fp32 partials (written once, read back from L2 once).  Schedule:
    ``linear_schedule`` in optimized/kernels/linear.py, by row count; ``batch_invariant=True``
    takes one schedule for every row count, so each row's bits do not depend on its batch.
    ``out``: a contiguous (..., N) tensor of x.dtype, written in place.

    Prefill path (optimized/kernels/linear.py, ``dequant_mm_selected``): with a pack whose
    block scales are powers of two (``LinearPack.exact_bf16``), bf16 x, at least
    ``DEQUANT_MM_MIN_ROWS`` (256) rows and ``batch_invariant=False``, a Triton pass first
    dequantizes the weight into a bf16 workspace (N*K code bytes in, 2*N*K out: exact, as an
    e4m3 code times a power of two only moves its exponent), then one cuBLAS GEMM
    (``torch.mm``; fp32 accumulation, fp32 split-K reductions, one rounding to bf16) reads it
    (2*N*K) with x (after the ``act_quant`` rounding, itself exact in bf16) and writes y.  Why:
    the fused kernel reaches ~300 TFLOP/s at prefill sizes, cuBLAS 700-830 on the H200, which
    repays the ~3*N*K bytes of the dequant (~12 us for 4096 x 4096) from a few hundred rows.
    Same math as the kernel, fp32 sums of exact products in another order.  fp32 x, other
    scales, batch-invariant calls and fewer rows keep the kernel.
    """
    pack, dev = _check_call(x, weight, False, act_quant, batch_invariant)
    select("linear", backend, Facts(dev, (x.dtype, pack.weight.dtype)))
    args = (x, pack.weight, pack.scale, pack.op_fmt, act_quant, batch_invariant)
    if out is None:
        return _ops_linear(*args, counters=pack.counters)
    check_out("out", out, (*x.shape[:-1], pack.out_features), x.dtype, dev)
    _ops_linear_out(*args, out=out, counters=pack.counters)
    return out


def grouped_linear(
    x: torch.Tensor,
    weight: LinearPack | torch.Tensor,
    *,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: LinearBackend = "auto",
) -> torch.Tensor:
    """``x (T, G, K)`` -> ``(T, G, N)``, group g ``x[:, g] @ W_g^T``, in x.dtype: the grouped
    ``wo_a`` (G 8, K 4096, N 1024 on V4-Flash).

    ``weight``: a grouped :class:`LinearPack` (``pack_linear(w, groups=G)``) or a dense
    (G, N, K) bf16 / fp32 tensor.  One launch for every group (the group is a grid axis), the
    schedule of :func:`linear` with G x the N tiles; ``act_quant`` as :func:`linear` (the
    official ``wo_a`` takes none: docs/semantics.md).  Moves the G*N*K codes once at decode
    sizes (wo_a: 32 MiB), x, y and the split-K partials as :func:`linear` (the reduction in the
    same launch, on the pack's counters).  ``out``: a contiguous (T, G, N) tensor of x.dtype.

    Prefill path as :func:`linear` (same conditions, T >= 256): the G*N*K weight dequantized
    to bf16 (wo_a: 32 MiB of codes in, 64 MiB out), then one ``torch.bmm`` batched over the
    groups on strided views of x and y (x[:, g] rows G*K apart, y[:, g] G*N apart: cuBLAS
    takes the leading dimensions as they are, nothing is copied).
    """
    pack, dev = _check_call(x, weight, True, act_quant, batch_invariant)
    select("grouped_linear", backend, Facts(dev, (x.dtype, pack.weight.dtype)))
    args = (x, pack.weight, pack.scale, pack.op_fmt, act_quant, batch_invariant)
    if out is None:
        return _ops_grouped(*args, counters=pack.counters)
    check_out("out", out, (x.shape[0], pack.groups, pack.out_features), x.dtype, dev)
    _ops_grouped_out(*args, out=out, counters=pack.counters)
    return out


def eh_proj(
    e: torch.Tensor,
    h: torch.Tensor,
    e_proj: LinearPack | torch.Tensor,
    h_proj: LinearPack | torch.Tensor,
    *,
    act_quant: bool = False,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: LinearBackend = "auto",
) -> torch.Tensor:
    """The MTP layer's input projection: ``x = linear(h, h_proj) + linear(e, e_proj)[:, None]``,
    e (T, K) the normed embedding rows, h (T, n, K) the normed hidden streams, x (T, n, N) in
    their dtype (bf16 or fp32), as :func:`dsv4mtp.reference.eh_proj`: each product rounded to
    x's dtype, then their sum rounded once more (docs/semantics.md, "The MTP layer end to end").

    ``e_proj``, ``h_proj``: plain :class:`LinearPack` s or dense (N, K) tensors, with the same
    N; ``act_quant``, ``batch_invariant`` as :func:`linear` (both products take them).  At
    decode sizes (h's T*n rows <= 64, both weights alike, e's and h's default schedules on one
    BLOCK_N and K split) one launch computes both (kernels/linear.py, ``eh_linear_kernel``):
    each output tile's last program rounds h's product, e's row t of its token and their sum.
    Otherwise two launches of :func:`linear`'s kernel: e's (T rows) into a scratch (T, N), then
    h's (T*n rows) adding e's row t to the n rows of token t after its own rounding, in the
    epilogue of the program (or split) that stores each tile; both forms give the same bits.
    At prefill sizes, where :func:`linear` takes the dequantize + cuBLAS path, the sum is one
    more Triton pass over x instead (in place: x read and written once, e's rows once; 256 +
    32 MiB at 4096 tokens of V4-Flash).  Against the two linears and a broadcast add in torch:
    the same bits, with one launch instead of three at decode sizes and no second round trip
    of x (torch's broadcast add does not take its vectorized path: 0.19 ms at 4096 tokens).  Bytes: :func:`linear`'s for each weight (e_proj and h_proj 16 MiB of codes
    each at V4-Flash), e's projection written and read once (in one launch: both products'
    fp32 partials, 2 * splits * T*n * N * 4 bytes through L2).  ``out``: a contiguous
    (T, n, N) tensor of the inputs' dtype.
    """
    pe, dev = _check_call(e, e_proj, False, act_quant, batch_invariant, ("e", "e_proj"))
    pack_h, _ = _check_call(h, h_proj, False, act_quant, batch_invariant, ("h", "h_proj"))
    check_ndim("e", e, 2)
    check_shape("h", h, (e.shape[0], None, pack_h.in_features))
    if h.dtype != e.dtype:
        raise InputError(f"h: expected dtype {e.dtype} (e's), got {h.dtype}")
    check_device([("e", e), ("h", h)])
    if pe is pack_h:  # one pack's split-K counters would serve both launches of a call
        raise InputError("h_proj: expected its own pack, got e_proj's (pack the weight twice)")
    if pe.out_features != pack_h.out_features:
        raise InputError(
            f"h_proj: expected {pe.out_features} output features (e_proj's), got "
            f"{pack_h.out_features}"
        )
    facts = Facts(dev, (e.dtype, pe.weight.dtype, pack_h.weight.dtype))
    select("eh_proj", backend, facts)
    args = (
        e, h, pe.weight, pe.scale, pe.op_fmt, pack_h.weight, pack_h.scale, pack_h.op_fmt,
        act_quant, batch_invariant,
    )  # fmt: skip
    counters = dict(e_counters=pe.counters, h_counters=pack_h.counters)
    if out is None:
        return _ops_eh(*args, **counters)  # type: ignore[no-any-return]
    check_out("out", out, (*h.shape[:2], pack_h.out_features), e.dtype, dev)
    for name, t in (("e", e), ("h", h)):
        if out.numel() and t.numel() and _overlaps(out, t):
            raise InputError(f"out: expected memory apart from {name}'s (the kernel reads {name})")
    _ops_eh_out(*args, out=out, **counters)
    return out


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of two tensors' storage spans intersect (a conservative test:
    strided views that interleave count as overlapping)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + _span(a) * a.element_size()
    b1 = b0 + _span(b) * b.element_size()
    return a0 < b1 and b0 < a1


def _span(t: torch.Tensor) -> int:
    """Elements from a tensor's first to one past its last (its strides' reach)."""
    return 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True)
    )
