"""Argument validation shared by the reference and the optimized entry points.

Kept tiny and explicit: each helper raises :class:`InputError` naming the argument, the expected
and the actual value.  ``optimized`` imports these rather than keeping its own copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, TypeGuard

import torch

from dsv4mtp.errors import DSV4Error, InputError

__all__ = [
    "check_device_arg",
    "check_dtype",
    "check_dtype_arg",
    "check_embed_norms_args",
    "check_eps",
    "check_finite",
    "check_finite_at",
    "check_finite_codes",
    "check_instance",
    "check_int",
    "check_ndim",
    "check_number",
    "check_positions",
    "check_shape",
    "check_step",
    "compute_dtype",
]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """promote(dtype, float32): float64 stays float64, every narrower float computes in fp32."""
    return torch.promote_types(dtype, torch.float32)


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise InputError(
            f"{name}: expected dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}"
        )


def check_ndim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """``None`` in ``shape`` matches any size on that axis."""
    ok = t.dim() == len(shape) and all(
        s is None or s == a for s, a in zip(shape, t.shape, strict=True)
    )
    if not ok:
        dims = ["*" if s is None else str(s) for s in shape]
        want = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
        raise InputError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Host-syncing check; use only on parameters at load time, never on a hot path."""
    if t.numel() and not bool(torch.isfinite(t.float()).all()):
        bad = int((~torch.isfinite(t.float())).sum())
        raise InputError(f"{name}: expected finite values, found {bad} non-finite of {t.numel()}")


def check_finite_at(name: str, t: torch.Tensor) -> None:
    """Like :func:`check_finite`, but the message names the first bad element's row (and column,
    for a 2-D tensor), so a user can find it in their data.  Host-syncing: reference paths and
    tool boundaries only."""
    bad = ~torch.isfinite(t)
    if t.numel() and bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        value = float(t[tuple(first)])
        where = f"row {first[0]}" if t.dim() else "the scalar"
        if t.dim() == 2:
            where += f", column {first[1]}"
        elif t.dim() > 2:
            where = f"index {tuple(first)}"
        raise InputError(
            f"{name}: expected finite values, found {value} at {where} "
            f"({int(bad.sum())} non-finite of {t.numel()})"
        )


CodeRule = Literal[
    "e4m3_weight", "fp8_scale", "mxfp4_scale", "nvfp4_block_scale", "nvfp4_global_scale"
]
# Row chunks of the code check: on the CPU the loader scan's measured size (4 MiB chunks stay in
# the caches); on a GPU each chunk costs a few host syncs, so larger ones (the temporaries are
# uint8 / bool masks of one chunk).
_CODE_CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 256 << 20}


def check_finite_codes(name: str, t: torch.Tensor, rule: CodeRule, *, index: str = "") -> None:
    """Refuse quantized codes or block scales, as stored, that decode to NaN or infinity: e4m3
    NaN bytes (0x7F, 0xFF) for ``e4m3_weight`` / ``nvfp4_block_scale``, e8m0 byte 0xFF or a
    non-finite float for ``fp8_scale`` / ``mxfp4_scale`` / ``nvfp4_global_scale``.  The
    checkpoint loader's rules (dsv4mtp/checkpoint/scan.py, its ``nan`` findings only, same
    messages: count, first index and code), for weights handed to a packer directly.  ``t``:
    uint8 bytes are read as the rule's encoding.  ``index``: what the index's axes are, added
    to the message.  Host-syncing (a few syncs per row chunk of at most a few MiB on the CPU,
    256 MiB on a GPU): pack time only, never a hot path."""
    from dsv4mtp.checkpoint.scan import scan_tensor  # scan imports formats, which imports us

    if rule in ("e4m3_weight", "nvfp4_block_scale") and t.dtype == torch.uint8:
        t = t.view(torch.float8_e4m3fn)
    for finding in scan_tensor(name, rule, _row_chunks(t)):
        if finding.code in ("non_finite_weight", "non_finite_scale"):
            raise InputError(finding.message + (f"; index = {index}" if index else ""))


def _row_chunks(t: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) pieces of ``t`` along dim 0, each at most the device's chunk size."""
    if t.dim() == 0 or t.shape[0] == 0:
        yield 0, t
        return
    row_bytes = max(1, t[0].numel() * t.element_size())
    rows = max(1, _CODE_CHUNK_BYTES.get(t.device.type, 4 << 20) // row_bytes)
    for r in range(0, t.shape[0], rows):
        yield r, t[r : r + rows]


def _is_number(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_eps(name: str, eps: object) -> None:
    """A stabilizing epsilon: a finite number >= 0 (a Python scalar, so no host sync)."""
    if not _is_number(eps) or not math.isfinite(eps) or eps < 0:
        raise InputError(f"{name}: expected a finite number >= 0, got {eps!r}")


def check_step(name: str, step: object) -> int:
    """A non-negative int (not a bool): the speculative step index."""
    return check_int(name, step, 0)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def check_dtype_arg(
    name: str,
    dtype: object,
    allowed: Sequence[torch.dtype],
    error: type[DSV4Error] = InputError,
) -> torch.dtype:
    """A ``torch.dtype`` argument (not a tensor's dtype) in ``allowed``."""
    names = ", ".join(_dtype_name(d) for d in allowed)
    if not isinstance(dtype, torch.dtype):
        spelled = [_dtype_name(d) for d in allowed]
        hint = f"; pass torch.{dtype}" if isinstance(dtype, str) and dtype in spelled else ""
        raise error(
            f"{name}: expected a torch.dtype in ({names}), got {type(dtype).__name__} "
            f"{dtype!r}{hint}"
        )
    if dtype not in allowed:
        raise error(f"{name}: expected a torch.dtype in ({names}), got {_dtype_name(dtype)}")
    return dtype


def check_device_arg(
    name: str, device: object, error: type[DSV4Error] = InputError
) -> torch.device:
    """A device argument: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a :class:`torch.device` of those,
    and CUDA only when this machine has it.  torch's own parser decides what is a device string."""
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise error(f"{name}: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    else:
        raise error(
            f"{name}: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got "
            f"{type(device).__name__} {device!r}"
        )
    if dev.type not in ("cpu", "cuda"):
        raise error(f"{name}: expected a cpu or cuda device, got {str(dev)!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise error(
                f"{name}: {str(dev)!r} requested but CUDA is not available on this machine "
                "(torch.cuda.is_available() is False); use 'cpu'"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise error(
                f"{name}: {str(dev)!r} requested but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def check_int(name: str, v: object, minimum: int) -> int:
    """An int (not a bool) >= ``minimum``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InputError(f"{name}: expected an int >= {minimum}, got {v!r}")
    return v


def check_number(name: str, v: object, *, positive: bool = False) -> float:
    """A finite Python number (not a bool), > 0 with ``positive``."""
    if not _is_number(v) or not math.isfinite(v) or (positive and v <= 0):
        want = "a finite number > 0" if positive else "a finite number"
        raise InputError(f"{name}: expected {want}, got {v!r}")
    return float(v)


def check_instance(name: str, v: object, cls: type) -> None:
    if not isinstance(v, cls):
        raise InputError(f"{name}: expected a {cls.__name__}, got {type(v).__name__}")


INT_DTYPES = (torch.int64, torch.int32)


def check_positions(name: str, t: object, length: int | None = None) -> None:
    """A 1-D integer tensor (of ``length`` rows when given)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in INT_DTYPES or t.dim() != 1:
        got = (
            f"{t.dtype} shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        )
        raise InputError(f"{name}: expected a 1-D int64 / int32 tensor, got {got}")
    if length is not None and t.shape[0] != length:
        raise InputError(f"{name}: expected shape ({length},), got {tuple(t.shape)}")


def check_embed_norms_args(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    prev_hidden: torch.Tensor,
    enorm: torch.Tensor,
    hnorm: torch.Tensor,
    float_check: Callable[[str, torch.Tensor], None],
) -> tuple[int, int]:
    """embed_norms' tensors (metadata only): ids and positions (T,) int64, embed (V, D),
    prev_hidden (T, n, D), enorm / hnorm (D,), each float checked by ``float_check(name, t)``
    (the reference's dtypes or the kernels').  -> (T, D)."""
    check_dtype("input_ids", input_ids, (torch.int64,))
    check_shape("input_ids", input_ids, (None,))
    T = input_ids.shape[0]
    check_dtype("positions", positions, (torch.int64,))
    check_shape("positions", positions, (T,))
    float_check("embed", embed)
    check_shape("embed", embed, (None, None))
    D = embed.shape[1]
    float_check("prev_hidden", prev_hidden)
    check_shape("prev_hidden", prev_hidden, (T, None, D))
    for name, w in (("enorm", enorm), ("hnorm", hnorm)):
        float_check(name, w)
        check_shape(name, w, (D,))
    return T, D
