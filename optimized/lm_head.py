"""The shared LM head of the MTP layer on the H200: greedy ids without the (T, V) logits, the
logits themselves, and an optional FP8 head.

Same math as :mod:`dsv4mtp.reference.lm_head` (docs/semantics.md, "The MTP layer end to end",
``compute_logits``: ``norm(hc_head(h)) @ head^T`` in fp32; ``draft``: greedy takes its argmax).

* :func:`lm_head_argmax` (y (T, D), head) -> (T,) int64: the Triton kernel of
  optimized/kernels/lm_head.py (each program a V chunk, fp32 logits on the tensor cores, a
  (max, first index) partial per row and chunk, a second launch combining them in order).
  torch.argmax's rules: the lowest index among equal maxima; a NaN logit counts as the maximum
  (the row's first NaN wins), so the id is ``logits.argmax(-1)`` of exact fp32 logits.
* :func:`lm_head_logits` (y, head) -> (T, V) fp32: cuBLAS (``torch.mm(..., out_dtype=fp32)``)
  for a dense head on CUDA; the dense-linear Triton kernel (kernels/linear.py, fp32 output) for
  the FP8 head and under ``batch_invariant``.  For sampling and ``return_logits``; the draft's
  probabilities are ``torch.softmax(logits / temperature, -1)`` (one fused torch kernel over the
  fp32 logits: no op of ours would move fewer bytes).
* :func:`pack_head` (a helper, once per head): a :class:`HeadPack`, the dense head as it is
  (``format="bf16"``, the default) or quantized to FP8 (``format="fp8"``, a switch, never the
  default).  Both ops take the pack or a dense (V, D) tensor.

The FP8 head: e4m3 codes with one power-of-two (ue8m0) scale per 128x128 block, the format of
every other FP8 weight of the checkpoint (dsv4mtp/formats.py, ``quantize_fp8_block``), so the
dense-linear kernel computes its logits unchanged and the argmax kernel decodes it the same
way.  Per-row 1x128 scales would fit each row's own range, but with power-of-two scales e4m3's
rounding does not depend on the scale outside the subnormal range: bench/results/head-fp8.md
measures both on a synthetic V4-Flash head, and their logit errors agree to 1e-9 relative, so
128x128 blocks cost nothing there, at 1/128 of the scale bytes (0.13 MB instead of 16.5 MB of
fp32 scales) and with no new kernel.  It halves the bytes the head step streams
(0.53 GB of codes instead of 1.06 GB of bf16) and changes the logits by the codes' rounding
(2^-4 relative per weight at most; 2.7e-2 relative on the synthetic head's logits): the greedy
id changes where the top two logits are close (93.3 % top-1 agreement with the bf16 head on
that random head, whose runner-ups are close); draft acceptance needs the real weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from dsv4mtp import formats
from dsv4mtp.checkpoint.weights import FP8_BLOCK, QuantizedWeight
from dsv4mtp.checks import (
    check_device_arg,
    check_finite,
    check_finite_codes,
    check_instance,
    check_shape,
)
from dsv4mtp.errors import InputError

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from .kernels._launch import check_device, check_kernel_dtype, check_out, check_row_mask

if TYPE_CHECKING:
    from .kernels.lm_head import LmHeadSchedule

__all__ = ["HeadPack", "lm_head_argmax", "lm_head_logits", "logits_argmax", "pack_head"]

HeadFormat = Literal["bf16", "fp8"]

_ops_argmax = torch.ops.dsv4mtp.lm_head_argmax.default
_ops_argmax_out = torch.ops.dsv4mtp.lm_head_argmax_out.default
_ops_logits = torch.ops.dsv4mtp.lm_head_logits.default
_ops_logits_argmax = torch.ops.dsv4mtp.logits_argmax.default
_ops_logits_argmax_out = torch.ops.dsv4mtp.logits_argmax_out.default
_ops_logits_out = torch.ops.dsv4mtp.lm_head_logits_out.default

_FP8_FORMATS = ("fp8_e8m0", "fp8_f32")
# Rows quantized per step of pack_head (a multiple of 128: whole scale blocks), bounding the
# quantizer's fp32 temporaries to ~1 GB at D 4096 instead of ~10 GB for the whole head.
_PACK_ROWS = 16384


@dataclass(frozen=True)
class HeadPack:
    """The LM head in the kernels' layout.

    ``format`` "bf16": ``weight`` (V, D) dense (bf16, or fp32 kept for an fp32 head) and an
    empty ``scale``; "fp8": ``weight`` (V, D) uint8 e4m3 codes and ``scale`` (ceil(V/128),
    ceil(D/128)) fp32 block scales (ue8m0 powers of two, or a checkpoint's fp32 scales).
    """

    format: str
    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense (V, D) head in ``dtype``: the codes times their block scales, exact in
        fp32 (the core's decode), then one rounding to ``dtype``."""
        if self.format == "fp8":
            cd = torch.promote_types(dtype, torch.float32)
            return formats.dequantize_fp8_block(self.weight, self.scale, dtype=cd).to(dtype)
        return self.weight.to(dtype)


def _quantize_rows(head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(V, D) -> e4m3 codes (V, D) uint8 and fp32 ue8m0 scales (ceil(V/128), ceil(D/128)), in
    steps of whole 128-row blocks (each block's scale depends on its own rows only)."""
    codes, scales = [], []
    for v in range(0, head.shape[0], _PACK_ROWS):
        q, s = formats.quantize_fp8_block(head[v : v + _PACK_ROWS], scale_fmt="e8m0")
        codes.append(q.view(torch.uint8))
        scales.append(formats.decode_e8m0(s, dtype=torch.float32))
    return torch.cat(codes), torch.cat(scales)


def pack_head(
    head: torch.Tensor | QuantizedWeight,
    *,
    format: HeadFormat = "bf16",
    device: torch.device | str | None = None,
) -> HeadPack:
    """Pack the LM head for :func:`lm_head_argmax` / :func:`lm_head_logits` (a helper, not an
    op; once per head, refused during CUDA-graph capture: it allocates).

    ``head``: a dense (V, D) bf16 / fp32 tensor (other floats are widened to fp32), or a core
    :class:`QuantizedWeight` (``bf16``, or ``fp8_e8m0`` / ``fp8_f32`` codes with 128x128 block
    scales: packed as stored, whatever ``format`` says).  ``format``: "bf16" keeps a dense head
    as it is; "fp8" quantizes it to e4m3 with ue8m0 128x128 block scales
    (``formats.quantize_fp8_block``; a non-finite head is an InputError: e4m3 has no inf).  ``device``: default
    the head's own.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise InputError("head: pack_head cannot run during CUDA-graph capture; pack before")
    if format not in ("bf16", "fp8"):
        raise InputError(f"format: expected 'bf16' or 'fp8', got {format!r}")
    if isinstance(head, QuantizedWeight):
        if head.format in _FP8_FORMATS:
            return _pack_quantized(head, device)
        if head.format != "bf16":
            raise InputError(
                f"head: format {head.format!r} is not an LM head's; expected one of "
                f"{(*_FP8_FORMATS, 'bf16')}"
            )
        head = head.data
    if not isinstance(head, torch.Tensor):
        raise InputError(
            f"head: expected a torch.Tensor or a QuantizedWeight, got {type(head).__name__}"
        )
    if not head.is_floating_point():
        raise InputError(f"head: expected a floating-point tensor, got {head.dtype}")
    check_shape("head", head, (None, None))
    if head.shape[0] < 1 or head.shape[1] < 1:
        raise InputError(f"head: expected a non-empty (V, D) tensor, got {tuple(head.shape)}")
    dev = check_device_arg("device", device if device is not None else head.device)
    if head.dtype not in (torch.bfloat16, torch.float32):
        head = head.to(torch.float32)
    if format == "fp8":
        check_finite("head", head)  # e4m3 has no inf; host-syncing, once per pack
        codes, scale = _quantize_rows(head.to(dev))
        return HeadPack("fp8", codes.contiguous(), scale.contiguous())
    empty = torch.empty((0,), dtype=torch.float32, device=dev)
    return HeadPack("bf16", head.to(dev).contiguous(), empty)


def _pack_quantized(head: QuantizedWeight, device: torch.device | str | None) -> HeadPack:
    """A checkpoint-format FP8 head, its codes and scales as stored (scales widened to fp32)."""
    V, D = head.shape
    if head.scale is None:
        raise InputError(f"head: {head.name or 'FP8 head'} has no block scales")
    codes = head.data
    if codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise InputError(
            f"head.data: expected dtype float8_e4m3fn or uint8 codes, got {codes.dtype}"
        )
    check_shape("head.data", codes, (V, D))
    scale = head.scale
    if scale.dtype not in (torch.float32, torch.uint8, torch.float8_e8m0fnu):
        raise InputError(
            f"head.scale: expected dtype float32 or e8m0 bytes (uint8), got {scale.dtype}"
        )
    check_shape("head.scale", scale, (-(-V // FP8_BLOCK), -(-D // FP8_BLOCK)))
    # The kernels' e4m3 decode (kernels/decode.py) has no NaN: it would read a NaN code as
    # +-480, so NaN codes and scales are refused once per pack.
    named = f" ({head.name})" if head.name else ""
    check_finite_codes(f"head.data{named}", codes, "e4m3_weight")
    check_finite_codes(f"head.scale{named}", scale, "fp8_scale")
    if scale.dtype != torch.float32:
        scale = formats.decode_e8m0(scale, dtype=torch.float32)
    dev = check_device_arg("device", device if device is not None else codes.device)
    return HeadPack("fp8", codes.view(torch.uint8).to(dev).contiguous(), scale.to(dev).contiguous())


def _check_call(
    y: torch.Tensor, head: object, batch_invariant: object
) -> tuple[HeadPack, torch.device]:
    check_instance("batch_invariant", batch_invariant, bool)
    check_kernel_dtype("y", y)
    if y.dim() != 2:
        raise InputError(f"y: expected shape (T, D), got {tuple(y.shape)}")
    if isinstance(head, HeadPack):
        pack = head
        if pack.hidden_size != y.shape[1]:
            raise InputError(
                f"head: expected a pack of hidden size {y.shape[1]} (y's D), got {pack.hidden_size}"
            )
    elif isinstance(head, torch.Tensor):
        check_kernel_dtype("head", head)
        check_shape("head", head, (None, y.shape[1]))
        if head.shape[0] < 1:
            raise InputError("head: expected at least one vocabulary row, got shape (0, D)")
        empty = torch.empty((0,), dtype=torch.float32, device=head.device)
        pack = HeadPack("bf16", head, empty)
    elif isinstance(head, QuantizedWeight):
        raise InputError(
            "head: a QuantizedWeight is packed once with dsv4mtp.optimized.pack_head(head) "
            "before the call"
        )
    else:
        raise InputError(f"head: expected a HeadPack or a torch.Tensor, got {type(head).__name__}")
    dev = check_device([("y", y), ("head", pack.weight)])
    return pack, dev


def lm_head_argmax(
    y: torch.Tensor,
    head: HeadPack | torch.Tensor,
    *,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    schedule: LmHeadSchedule | None = None,
    row_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy ids ``argmax_v (y @ head^T)[t, v]`` -> (T,) int64, without writing the logits.

    ``y``: (T, D) bf16 / fp32, the normed rows (``norm(hc_head(h))``); ``head``: a
    :class:`HeadPack` (dense, or FP8 codes + 128x128 block scales) or a dense (V, D) bf16 / fp32
    tensor.  The logits are exact products summed in fp32 (bf16 tensor-core dots; fp32 dots
    when y or the head is fp32); the id follows torch.argmax over them: the lowest index among
    equal maxima, and a row with a NaN logit gets its first NaN's index (module doc).  Moves the
    head once per 64-row T tile (V*D*itemsize: 1.06 GB bf16 / 0.53 GB FP8 at V4-Flash), y once
    per V chunk from L2, and 8 bytes per (row, chunk) of partials (kernels/lm_head.py).
    ``batch_invariant=True``: the 64-row schedule whatever T, so each row's id does not depend
    on its batch.  ``schedule``: an explicit :class:`~.kernels.lm_head.LmHeadSchedule`
    (benchmarks; default ``lm_head_schedule(T, batch_invariant)``).  ``out``: a (T,) int64
    tensor, written in place.  ``row_mask`` (T,) bool on y's device (optimized only): rows
    where it is false get id -1 (a CUDA-graph step's padding and bad rows), written by the
    reduce launch, so the caller needs no ``torch.where`` (two launches) after it.
    CUDA-graph capturable (two launches, a per-stream workspace).
    """
    pack, dev = _check_call(y, head, batch_invariant)
    check_row_mask(row_mask, y.shape[0], "y", y)
    fields = schedule.fields() if schedule is not None else []
    args = (y, pack.weight, pack.scale, "fp8" if pack.format == "fp8" else "bf16")
    if out is None:
        return _ops_argmax(*args, batch_invariant, fields, row_mask)  # type: ignore[no-any-return]
    check_out("out", out, (y.shape[0],), torch.int64, dev)
    _ops_argmax_out(*args, batch_invariant, fields, row_mask, out=out)
    return out


def lm_head_logits(
    y: torch.Tensor,
    head: HeadPack | torch.Tensor,
    *,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``y @ head^T`` -> (T, V) fp32: exact products summed in fp32.

    ``y``, ``head`` as :func:`lm_head_argmax`.  A dense head in y's dtype on CUDA: one cuBLAS
    GEMM (``torch.mm(y, head.T, out_dtype=float32)`` for bf16), the head read once (1.06 GB at
    V4-Flash) and the logits written once (T*V*4 bytes: 33 MB at T 64).  An FP8 head, a head in
    another dtype than y, CPU tensors (the interpreter) and ``batch_invariant=True``: the
    dense-linear Triton kernel (kernels/linear.py) with an fp32 output (for the FP8 head it
    reads the 0.53 GB of codes once at T <= 64); its batch-invariant schedule does not depend on
    T.  ``out``: a contiguous (T, V) fp32 tensor, written in place.
    """
    pack, dev = _check_call(y, head, batch_invariant)
    args = (y, pack.weight, pack.scale, "fp8" if pack.format == "fp8" else "bf16")
    if out is None:
        return _ops_logits(*args, batch_invariant)  # type: ignore[no-any-return]
    check_out("out", out, (y.shape[0], pack.vocab_size), torch.float32, dev)
    _ops_logits_out(*args, batch_invariant, out=out)
    return out


def logits_argmax(
    logits: torch.Tensor,
    *,
    row_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.argmax(logits, -1)`` -> (T,) int64 for the layer's fp32 logits (T, V) (unit
    column stride), bit for bit (the lowest index among equal maxima; a row's first NaN wins),
    -1 where ``row_mask`` (T,) bool is false: the greedy ids of a step that also writes its
    logits (sampling, ``return_logits``, the prefill's last rows).  Two launches
    (kernels/lm_head.py: 4096-column chunks, then the argmax's reduce), which on the H200 take
    a few microseconds where torch.argmax over V4's 129280 columns takes about 35 us for 1-64
    rows (bench/results/mtp-h200.md).  Not a layer op of the shared API (the reference's
    layer calls torch.argmax): the optimized layer's own, a registered operator.  ``out``: a
    (T,) int64 tensor, written in place.  CUDA-graph capturable (a per-stream workspace)."""
    check_instance("logits", logits, torch.Tensor)
    if logits.dtype != torch.float32:
        raise InputError(f"logits: expected dtype torch.float32, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[1] < 1 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise InputError(
            f"logits: expected (T, V) with V >= 1 and unit column stride, got shape "
            f"{tuple(logits.shape)} and strides {logits.stride()}"
        )
    check_row_mask(row_mask, logits.shape[0], "logits", logits)
    if out is None:
        return _ops_logits_argmax(logits, row_mask)  # type: ignore[no-any-return]
    check_out("out", out, (logits.shape[0],), torch.int64, logits.device)
    _ops_logits_argmax_out(logits, row_mask, out=out)
    return out
