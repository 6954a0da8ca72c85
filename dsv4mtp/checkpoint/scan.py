"""Value checks on a checkpoint's stored codes: the one rule set of the loader and ``inspect``.

A tensor that decodes to NaN or infinity poisons every draft token, and the float64 reference
would not even see an overflow that the bfloat16/float32 kernels hit.  The checks run on the
stored bytes, never on decoded weights, so they cost one pass over the bytes they look at
(FP4 weights are skipped: every e2m1 code is finite, so their scales carry the check):

=====================  ======================================================================
rule                   a finding when
=====================  ======================================================================
``finite``             a float tensor (norms, mixing, router, embedding, head, bf16 weights)
                       holds NaN or +-inf
``e4m3_weight``        an FP8 weight byte is an e4m3 NaN code (0x7F, 0xFF)
``fp8_scale``          an FP8 128x128 block scale is e8m0 NaN (0xFF), or float32 non-finite or
                       <= 0; or 448 (e4m3 max) x scale overflows bfloat16/float32
``mxfp4_scale``        an MXFP4 e8m0 scale is NaN (0xFF), or 6 (e2m1 max) x 2^(byte-127)
                       overflows bfloat16/float32 (bytes >= 253)
``nvfp4_block_scale``  an NVFP4 e4m3 block scale is a NaN code or negative (sign bit set,
                       not -0)
``nvfp4_global_scale`` ``weight_scale_2`` is non-finite or <= 0, or 2688 (448 x 6) x it
                       overflows bfloat16/float32
``nvfp4_input_scale``  ``input_scale`` is non-finite or <= 0
=====================  ======================================================================

"Overflows" compares with the largest finite bfloat16 (3.39e38, a little below float32's
3.40e38), the narrowest dtype the kernels decode to.

:func:`scan_checkpoint` streams: one shard open at a time, each tensor read through the shard's
memory map in row chunks of at most ``chunk_bytes``, so memory stays at one chunk whatever the
checkpoint's size.  Findings name the tensor, what was expected, how many codes are bad and the
first bad index and code.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from safetensors import safe_open

from dsv4mtp import formats
from dsv4mtp.checkpoint.io import SAFETENSORS_DTYPES, ShardedCheckpoint
from dsv4mtp.errors import CheckpointError

__all__ = [
    "OVERFLOW_LIMIT",
    "SCAN_RULES",
    "ScanFinding",
    "layer_scan_rules",
    "scan_checkpoint",
    "scan_rule",
    "scan_tensor",
]

Rule = Literal[
    "finite",
    "e4m3_weight",
    "fp8_scale",
    "mxfp4_scale",
    "nvfp4_block_scale",
    "nvfp4_global_scale",
    "nvfp4_input_scale",
]
SCAN_RULES: tuple[Rule, ...] = get_args(Rule)
OVERFLOW_LIMIT = float(torch.finfo(torch.bfloat16).max)  # below float32's max: covers both
# Small enough that a chunk and its temporaries stay in the CPU caches (measured: 4 MiB chunks
# scan about ten times faster than 64 MiB ones on a 2-core machine).
_CHUNK_BYTES = 4 << 20
# Largest |element| a scale multiplies: e4m3 for FP8 blocks, e2m1 for MXFP4, e4m3 x e2m1 for the
# NVFP4 global scale (its block scales are e4m3).
_ELEMENT_MAX = {
    "fp8_scale": ("e4m3", formats.E4M3_MAX),
    "mxfp4_scale": ("e2m1", formats.E2M1_MAX),
    "nvfp4_global_scale": ("e4m3 x e2m1", formats.E4M3_MAX * formats.E2M1_MAX),
}
_E8M0 = (torch.float8_e8m0fnu, torch.uint8)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ITEMSIZE = {k: torch.empty((), dtype=d).element_size() for k, d in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class ScanFinding:
    """One bad tensor: ``code`` as in ``inspect``'s findings, ``message`` for a person."""

    name: str
    code: str
    message: str


# ----------------------------------------------------------------------------- which rule
def scan_rule(suffix: str, fmt: str) -> Rule | None:
    """The rule of a tensor with name suffix ``suffix`` ("weight", "scale", "weight_scale", ...)
    in a group of format ``fmt`` (a format tag of the loader, or "float" for unquantized
    parameters).  None: nothing to check (packed FP4 weights)."""
    if fmt in ("float", "bf16"):
        return "finite"
    if fmt.startswith("fp8"):
        return "e4m3_weight" if suffix == "weight" else "fp8_scale"
    if fmt == "mxfp4":
        return None if suffix == "weight" else "mxfp4_scale"
    if fmt == "nvfp4":
        return {
            "weight_scale": "nvfp4_block_scale",
            "weight_scale_2": "nvfp4_global_scale",
            "input_scale": "nvfp4_input_scale",
        }.get(suffix)  # type: ignore[return-value]
    return None  # an undetected format: its header errors are reported instead


def layer_scan_rules(
    prefix: str,
    rel_names: Iterable[str],
    linear_formats: Mapping[str, str],
    expert_format: str,
) -> dict[str, Rule]:
    """Full name -> rule for the tensors ``rel_names`` (relative to ``prefix`` = ``mtp.{i}.``)
    of one MTP layer, given the detected format of each dense linear and of the experts."""
    rules: dict[str, Rule] = {}
    for rel in rel_names:
        base, _, suffix = rel.rpartition(".")
        if rel.startswith("ffn.experts."):
            fmt = expert_format
        elif base in linear_formats:
            fmt = linear_formats[base]
        else:
            fmt = "float"
        rule = scan_rule(suffix, fmt)
        if rule is not None:
            rules[prefix + rel] = rule
    return rules


# ----------------------------------------------------------------------------- one tensor
class _Tally:
    """Bad codes of one kind across the chunks of one tensor: count, first index and code."""

    def __init__(self) -> None:
        self.count = 0
        self.first: tuple[int, ...] | None = None
        self.code: Any = None

    def add(self, mask: torch.Tensor, chunk: torch.Tensor, row0: int) -> None:
        if not bool(mask.any()):
            return
        self.count += int(mask.sum())
        if self.first is None:
            flat = int(mask.reshape(-1).nonzero()[0, 0])
            idx = _unravel(flat, tuple(chunk.shape))
            self.first = (idx[0] + row0, *idx[1:]) if idx else ()
            self.code = chunk.reshape(-1)[flat]


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(flat % d)
        flat //= d
    return tuple(reversed(out))


def _at(t: _Tally) -> str:
    idx = t.first or ()
    where = "index " + (str(idx[0]) if len(idx) == 1 else str(idx)) if idx else "the scalar"
    return where


def _describe(code: torch.Tensor, dtype: torch.dtype) -> str:
    """A stored code as bits and value (``e8m0 byte 0xFF (NaN)``, ``e4m3 byte 0x7F (nan)``), or
    a float's repr."""
    if dtype in _E8M0:
        b = int(code.view(torch.uint8)) if code.dtype != torch.uint8 else int(code)
        value = "NaN" if b == formats.E8M0_NAN else f"2^{b - formats.E8M0_BIAS}"
        return f"e8m0 byte 0x{b:02X} ({value})"
    if dtype == torch.float8_e4m3fn:
        b = int(code.view(torch.uint8))
        decoded = float(formats.decode_e4m3(code.view(torch.uint8).reshape(1))[0])
        return f"e4m3 byte 0x{b:02X} ({decoded:g})"
    return _shortest(code)


def _shortest(code: torch.Tensor) -> str:
    """The shortest decimal that reads back as the same value in the code's own dtype."""
    v = float(code)
    if not math.isfinite(v):
        return repr(v)
    for digits in range(1, 18):
        text = f"{v:.{digits}g}"
        if float(torch.tensor(float(text), dtype=code.dtype)) == v:
            return text if any(c in text for c in ".en") else text + ".0"
    return repr(v)


def _suspect(rule: Rule, chunk: torch.Tensor) -> bool:
    """A cheap screen (reductions only, no full-size masks): False when ``chunk`` certainly has
    no bad code, True when :func:`_checks` must count them.  NaN propagates through min/max."""
    dtype = chunk.dtype
    if chunk.numel() == 0:
        return False
    if dtype in _FLOATS:
        lo, hi = (float(v) for v in torch.aminmax(chunk))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return True
        if rule == "finite":
            return False
        return lo <= 0 or (rule in _ELEMENT_MAX and hi * _ELEMENT_MAX[rule][1] > OVERFLOW_LIMIT)
    if dtype not in (torch.float8_e4m3fn, *_E8M0):
        return False
    b = chunk.view(torch.uint8)
    if rule in ("e4m3_weight", "nvfp4_block_scale") and dtype == torch.float8_e4m3fn:
        nan = int((b & 0x7F).max()) == 0x7F
        return nan or (rule == "nvfp4_block_scale" and int(b.max()) > 0x80)
    if rule in ("fp8_scale", "mxfp4_scale") and dtype in _E8M0:
        return int(b.max()) >= _first_overflow_byte(_ELEMENT_MAX[rule][1])
    return False


def _first_overflow_byte(emax: float) -> int:
    """Smallest e8m0 byte whose ``emax x 2^(byte-127)`` exceeds the limit."""
    return formats.E8M0_BIAS + math.floor(math.log2(OVERFLOW_LIMIT / emax)) + 1


def _checks(rule: Rule, chunk: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(kind, bad mask) for one chunk; kinds: nan, nonpos, negative, overflow."""
    dtype = chunk.dtype
    if rule == "finite":
        if dtype not in _FLOATS:
            return []
        return [("nan", ~torch.isfinite(chunk))]
    if rule == "e4m3_weight":
        if dtype != torch.float8_e4m3fn:
            return []
        return [("nan", (chunk.view(torch.uint8) | 0x80) == 0xFF)]
    if rule == "nvfp4_block_scale":
        if dtype != torch.float8_e4m3fn:
            return []
        b = chunk.view(torch.uint8)
        nan = (b | 0x80) == 0xFF
        return [("nan", nan), ("negative", (b > 0x80) & ~nan)]
    if dtype in _E8M0 and rule in ("fp8_scale", "mxfp4_scale"):
        b = chunk.view(torch.uint8)
        first_over = _first_overflow_byte(_ELEMENT_MAX[rule][1])
        return [
            ("nan", b == formats.E8M0_NAN),
            ("overflow", (b >= first_over) & (b != formats.E8M0_NAN)),
        ]
    if dtype not in _FLOATS:
        return []
    checks = [("nan", ~torch.isfinite(chunk)), ("nonpos", chunk <= 0)]
    if rule in _ELEMENT_MAX:
        _, emax = _ELEMENT_MAX[rule]
        over = chunk.double() * emax > OVERFLOW_LIMIT
        checks.append(("overflow", over & torch.isfinite(chunk)))
    return checks


_NOUN = {
    "finite": "values",
    "e4m3_weight": "float8_e4m3fn codes",
    "fp8_scale": "FP8 block scales",
    "mxfp4_scale": "MXFP4 scales",
    "nvfp4_block_scale": "NVFP4 block scales",
    "nvfp4_global_scale": "NVFP4 global scale",
    "nvfp4_input_scale": "NVFP4 input scale",
}


def _message(
    name: str, rule: Rule, kind: str, t: _Tally, numel: int, dtype: torch.dtype
) -> tuple[str, str]:
    """(code, message) of one kind of bad code in one tensor."""
    got = _describe(t.code, dtype)
    at = f"first at {_at(t)}: {got}"
    scalar = numel == 1
    if kind == "nan" and rule == "finite":
        return "non_finite_tensor", (
            f"{name}: expected finite values, found {t.count} non-finite of {numel} ({at})"
        )
    if kind == "nan" and rule == "e4m3_weight":
        return "non_finite_weight", (
            f"{name}: expected finite float8_e4m3fn codes, found {t.count} NaN code(s) "
            f"(0x7F/0xFF) of {numel} ({at})"
        )
    if kind == "nan":
        return "non_finite_scale", (
            f"{name}: expected finite scales, found {t.count} non-finite of {numel} ({at})"
        )
    if kind == "nonpos":
        if scalar:
            return "non_positive_scale", (f"{name}: expected a positive {_NOUN[rule]}, got {got}")
        return "non_positive_scale", (
            f"{name}: expected positive {_NOUN[rule]}, found {t.count} <= 0 of {numel} ({at})"
        )
    if kind == "negative":
        return "non_positive_scale", (
            f"{name}: expected non-negative {_NOUN[rule]}, found {t.count} negative of {numel} "
            f"({at})"
        )
    element, emax = _ELEMENT_MAX[rule]
    return "scale_overflow", (
        f"{name}: expected {_NOUN[rule]} whose product with the largest {element} value "
        f"({emax:g}) stays finite in bfloat16 and float32 (<= {OVERFLOW_LIMIT:.4g}), found "
        f"{t.count} of {numel} that overflow ({at})"
    )


def scan_tensor(
    name: str, rule: Rule, chunks: Iterable[tuple[int, torch.Tensor]]
) -> list[ScanFinding]:
    """Check one tensor given as ``(first row, row chunk)`` pieces (a whole tensor: one piece
    ``(0, t)``).  Returns one finding per kind of bad code, none for a good tensor."""
    tallies: dict[str, _Tally] = {}
    numel = 0
    dtype: torch.dtype | None = None
    for row0, chunk in chunks:
        numel += chunk.numel()
        dtype = chunk.dtype
        if not _suspect(rule, chunk):
            continue
        for kind, mask in _checks(rule, chunk):
            tallies.setdefault(kind, _Tally()).add(mask, chunk, row0)
    out = []
    for kind, t in tallies.items():
        if t.count:
            assert dtype is not None
            code, message = _message(name, rule, kind, t, numel, dtype)
            out.append(ScanFinding(name, code, message))
    return out


# ----------------------------------------------------------------------------- a checkpoint
def _chunks(handle: Any, name: str, chunk_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Row slices of tensor ``name`` of an open shard, each at most ``chunk_bytes`` (one row if
    a row is larger)."""
    sl = handle.get_slice(name)
    shape = sl.get_shape()
    if not shape:
        yield 0, handle.get_tensor(name)
        return
    if shape[0] == 0:
        yield 0, handle.get_tensor(name)
        return
    row_bytes = math.prod(shape[1:]) * _ITEMSIZE[sl.get_dtype()]
    rows = max(1, chunk_bytes // max(1, row_bytes))
    for r in range(0, shape[0], rows):
        yield r, sl[r : r + rows]


def scan_checkpoint(
    ck: ShardedCheckpoint, rules: Mapping[str, Rule], *, chunk_bytes: int = _CHUNK_BYTES
) -> Iterator[ScanFinding]:
    """Check every tensor of ``rules`` (name -> rule), shard by shard in file order.

    One shard is open at a time and each tensor is read in row chunks of at most
    ``chunk_bytes`` through the memory map.  A generator: the loader stops at the first
    finding, ``inspect`` collects them all.  Raises :class:`CheckpointError` when safetensors
    cannot read a tensor the headers described.
    """
    by_shard: dict[str, list[str]] = {}
    for name in rules:
        by_shard.setdefault(ck.info(name).shard, []).append(name)
    for shard in sorted(by_shard):
        try:
            handle = safe_open(os.path.join(ck.path, shard), framework="pt")
        except Exception as e:  # safetensors' own checks beyond our header checks
            raise CheckpointError(f"{shard}: cannot open it ({e})") from e
        for name in by_shard[shard]:
            try:
                found = scan_tensor(name, rules[name], _chunks(handle, name, chunk_bytes))
            except Exception as e:
                raise CheckpointError(f"{shard}: tensor {name}: cannot read it ({e})") from e
            yield from found
        del handle
