"""The MTP layer's attention core on the H200: sliding-window MQA with per-head sinks.

Same signatures as :func:`dsv4mtp.reference.sink_attention`,
:func:`dsv4mtp.reference.sink_attention_varlen`, :func:`dsv4mtp.reference.sink_attention_cache`
(decode over a :class:`~dsv4mtp.optimized.kv_cache.DeviceKVCache` ring) and
:func:`dsv4mtp.reference.sink_attention_paged` (over a
:class:`~dsv4mtp.optimized.kv_cache.PagedKVCache` block pool) plus keyword-only ``backend`` and
``schedule``.
The math: docs/semantics.md, "Visibility and the sink softmax"; the kernel, its grid, tiles and
bytes: optimized/kernels/sink_attention.py.  One launch per call, for one sequence or for B
concatenated ones (decode: one query per sequence against its cached keys plus its own; prefill:
Tq = Tk rows under the causal window), no host sync inside, so a call at fixed shapes is
CUDA-graph capturable (the offsets and positions are read on the device).

Validation.  Shapes, dtypes and devices are checked once per call signature (the plan cache of
optimized/_dispatch.py).  Positions are data: an eager call also checks, on the device with one
host read, that ``k_pos`` increases strictly within each sequence and that ``cu_q`` / ``cu_k``
are prefix offsets from 0 to Tq / Tk, and raises the reference's InputError otherwise (a wrong
order would silently attend to the wrong keys).  While a CUDA graph is captured, or torch.compile
traces, that read is impossible and the op trusts its positions: check them before capturing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from dsv4mtp.checkpoint.weights import MTPLayerWeights, QuantizedWeight
from dsv4mtp.checks import (
    check_device_arg,
    check_instance,
    check_int,
    check_number,
    check_positions,
    check_shape,
)
from dsv4mtp.config import DSV4Config
from dsv4mtp.errors import InputError
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.params import AttentionParams
from dsv4mtp.rope import rope_frequencies
from dsv4mtp.semantics import NormOrder, RopeMode

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from ._dispatch import Facts, planned, select, signature
from ._ops import side_stream
from ._packs import packed_once
from .kernels._launch import (
    check_device,
    check_kernel_dtype,
    check_out,
    device_ints,
    triton_kernel,
)
from .kv_cache import DeviceKVCache, PagedKVCache, check_block_table
from .linear import LinearPack, grouped_linear, linear, pack_linear
from .norm import rms_norm
from .rope import apply_rope, kv_norm_rope, q_head_norm_rope

__all__ = [
    "AttentionPack",
    "attention",
    "pack_attention",
    "pack_attention_weights",
    "sink_attention",
    "sink_attention_cache",
    "sink_attention_paged",
    "sink_attention_varlen",
]

AttentionBackend = Literal["auto", "triton"]

_ops_attn = torch.ops.dsv4mtp.sink_attention.default
_ops_attn_out = torch.ops.dsv4mtp.sink_attention_out.default
_ops_varlen = torch.ops.dsv4mtp.sink_attention_varlen.default
_ops_varlen_out = torch.ops.dsv4mtp.sink_attention_varlen_out.default


def _schedule_fields(
    schedule: object, H: int, Dh: int, window: int, dtype: torch.dtype, batch_invariant: bool
) -> list[int]:
    """The fields the op gets: ``schedule``'s, checked; for the default, none (the op picks by
    its row count) or under ``batch_invariant`` the T-independent default's."""
    if schedule is None and not batch_invariant:
        return []
    from .kernels.sink_attention import AttentionSchedule, attention_schedule

    if schedule is None:
        return attention_schedule(H, Dh, window, dtype == torch.float32).fields()

    check_instance("schedule", schedule, AttentionSchedule)
    assert isinstance(schedule, AttentionSchedule)
    fields = schedule.fields()
    tiles = fields[:4]
    search = schedule.search
    if any(v < 16 or v & (v - 1) for v in tiles) or search < 2 or search & (search - 1):
        raise InputError(
            "schedule: expected tiles that are powers of two >= 16 and a search width that is "
            f"a power of two >= 2, got {schedule}"
        )
    if Dh % schedule.block_d or Dh % schedule.block_dv:
        raise InputError(f"schedule: block_d and block_dv must divide Dh={Dh}, got {schedule}")
    return fields


def _plan(
    op: str,
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    offsets: tuple[torch.Tensor, torch.Tensor] | None,
    window: int,
    scale: float,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
    schedule: object,
) -> tuple[str, list[int]]:
    """Every metadata check of a call, then the backend choice and the schedule fields."""
    check_kernel_dtype("q", q)
    if q.dim() != 3:
        raise InputError(f"q: expected shape (Tq, H, Dh), got {tuple(q.shape)}")
    Tq, H, Dh = q.shape
    if Dh % 16:
        raise InputError(f"q: expected a head dim that is a multiple of 16, got Dh={Dh}")
    check_positions("q_pos", q_pos, Tq)
    check_kernel_dtype("kv", kv)
    if kv.dtype != q.dtype:
        raise InputError(f"kv: expected dtype {q.dtype} (as q), got {kv.dtype}")
    check_shape("kv", kv, (None, Dh))
    check_positions("k_pos", k_pos, kv.shape[0])
    check_kernel_dtype("attn_sink", attn_sink)
    check_shape("attn_sink", attn_sink, (H,))
    named = [("q", q), ("q_pos", q_pos), ("kv", kv), ("k_pos", k_pos), ("attn_sink", attn_sink)]
    if offsets is not None:
        cu_q, cu_k = offsets
        check_positions("cu_q", cu_q)
        if cu_q.shape[0] < 1:
            raise InputError("cu_q: expected shape (B+1,) with B >= 0, got (0,)")
        check_positions("cu_k", cu_k, cu_q.shape[0])
        named += [("cu_q", cu_q), ("cu_k", cu_k)]
    check_int("window", window, 1)
    check_number("scale", scale)
    check_instance("batch_invariant", batch_invariant, bool)
    dev = check_device(named)
    choice = select(op, backend, Facts(dev, (q.dtype, attn_sink.dtype)))
    if out is not None:
        check_out("out", out, (Tq, H, Dh), q.dtype, dev)
    return choice, _schedule_fields(schedule, H, Dh, window, q.dtype, batch_invariant)


def _check_values(
    q: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    offsets: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """The positions and offsets, on the device with one host read (eager calls only)."""
    if torch.compiler.is_compiling():
        return
    if k_pos.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    Tq, Tk = q.shape[0], kv.shape[0]
    rising = k_pos[1:] > k_pos[:-1]  # (Tk-1,): where a sequence starts it need not rise
    ok = [rising]
    if offsets is not None:
        cu_q, cu_k = offsets
        starts = cu_k[1:-1].long() - 1  # index before each later sequence's first key
        starts = starts[(starts >= 0) & (starts < Tk - 1)]
        rising = rising.index_fill(0, starts, True) if Tk > 1 else rising
        ok = [rising]
        for cu, total in ((cu_q, Tq), (cu_k, Tk)):
            ok += [cu[:1] == 0, cu[-1:] == total, cu[1:] >= cu[:-1]]
    if bool(torch.cat([o.reshape(-1) for o in ok]).all()):
        return
    if offsets is not None:
        for name, cu, total in (("cu_q", offsets[0], Tq), ("cu_k", offsets[1], Tk)):
            bounds = [int(v) for v in cu.tolist()]
            if (
                bounds[0] != 0
                or bounds[-1] != total
                or any(a > b for a, b in itertools.pairwise(bounds))
            ):
                raise InputError(
                    f"{name}: expected non-decreasing prefix offsets from 0 to {total}, "
                    f"got {bounds}"
                )
        cuts = [int(v) for v in offsets[1].tolist()]
    else:
        cuts = [0, Tk]
    for b in range(len(cuts) - 1):
        pos = k_pos[cuts[b] : cuts[b + 1]]
        if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
            where = f" within sequence {b}" if offsets is not None else ""
            raise InputError(
                f"k_pos: expected strictly increasing positions{where}, got {pos.tolist()}"
            )


def _call(
    op: str,
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    offsets: tuple[torch.Tensor, torch.Tensor] | None,
    window: int,
    scale: float,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
    schedule: object,
    *,
    check_values: bool = True,
) -> torch.Tensor:
    # The plan of this call signature (optimized/_dispatch.py, "plans"): the metadata checks run
    # once per signature.  While torch.compile traces, they run every time and become its guards.
    offs = (None, None) if offsets is None else offsets
    plan = planned(
        signature(
            op, q, q_pos, kv, k_pos, attn_sink, *offs, window, scale, batch_invariant, backend,
            schedule, out=out,
        ),
        lambda: _plan(
            op, q, q_pos, kv, k_pos, attn_sink, offsets, window, scale, batch_invariant, out,
            backend, schedule,
        ),
    )  # fmt: skip
    choice, fields = plan
    if check_values:
        _check_values(q, kv, k_pos, offsets)
    tail = (int(window), float(scale), choice, fields)
    if offsets is None:
        if out is None:
            return _ops_attn(q, q_pos, kv, k_pos, attn_sink, *tail)  # type: ignore[no-any-return]
        _ops_attn_out(q, q_pos, kv, k_pos, attn_sink, *tail, out=out)
        return out
    cu_q, cu_k = offsets
    if out is None:
        return _ops_varlen(q, q_pos, kv, k_pos, attn_sink, cu_q, cu_k, *tail)  # type: ignore[no-any-return]
    _ops_varlen_out(q, q_pos, kv, k_pos, attn_sink, cu_q, cu_k, *tail, out=out)
    return out


def sink_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    *,
    window: int,
    scale: float,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: AttentionBackend = "auto",
    schedule: Any = None,
) -> torch.Tensor:
    """Sliding-window attention of one sequence with per-head sinks: o (Tq, H, Dh) in q.dtype.

    q (Tq, H, Dh) bf16 / fp32, Dh a multiple of 16; q_pos (Tq,) int32 / int64 (any order: each
    query is computed on its own); kv (Tk, Dh) in q's dtype, the key and the value of every head;
    k_pos (Tk,) int, strictly increasing; attn_sink (H,) bf16 / fp32, a logit joining the softmax
    denominator only.  Query t sees key j iff ``0 <= q_pos[t] - k_pos[j] < window``; one that
    sees no key returns 0.  Scores ``scale * <q, k>`` and the softmax in fp32.
    ``out`` (Tq, H, Dh) in q's dtype, contiguous, is written in place and returned.

    Fuses the score dots, the window mask, the softmax with the sink and the PV dot in one launch
    (kernels/sink_attention.py); moves q and out once and each query's visible keys (at most
    ``window`` rows of Dh) once for all heads.  ``schedule``: an
    :class:`~dsv4mtp.optimized.kernels.sink_attention.AttentionSchedule` (tile sweeps), default
    by H, Dh, the window and the row count (``attention_schedule``: 256-wide output slices from
    64 rows, at Dh 512 the whole row per program from 128; bitwise the narrow tiles on the GPU,
    where a dot's Dh reduction is one chain of MMA steps whatever the chunk; under the
    interpreter the whole row can differ in the last bit).  Every schedule is batch invariant
    (a row's reduction order depends on its own keys only); ``batch_invariant=True`` also pins
    the default to the one that does not read the row count.
    """
    return _call(
        "sink_attention", q, q_pos, kv, k_pos, attn_sink, None, window, scale, batch_invariant,
        out, backend, schedule,
    )  # fmt: skip


def sink_attention_varlen(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    k_pos: torch.Tensor,
    attn_sink: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    window: int,
    scale: float,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: AttentionBackend = "auto",
    schedule: Any = None,
) -> torch.Tensor:
    """:func:`sink_attention` over B concatenated sequences, in one launch.

    cu_q, cu_k (B+1,) int32 / int64 prefix offsets on q's device: sequence b has the queries
    ``q[cu_q[b]:cu_q[b+1]]`` and the keys ``kv[cu_k[b]:cu_k[b+1]]`` (``k_pos`` strictly
    increasing within it); a query sees only its own sequence's keys.  Decode is Tq = 1 per
    sequence against its cache and its own key (at V4-Flash 128 * 512 * 2 B = 128 KiB of keys
    per sequence, read once for all 64 heads); prefill Tq = Tk rows per sequence.  Other
    arguments and the result as :func:`sink_attention`; the offsets are read on the device, so
    the launch does not depend on how the rows split into sequences (one graph serves every
    split of the same Tq and Tk).
    """
    return _call(
        "sink_attention_varlen", q, q_pos, kv, k_pos, attn_sink, (cu_q, cu_k), window, scale,
        batch_invariant, out, backend, schedule,
    )  # fmt: skip


_ops_cache = torch.ops.dsv4mtp.sink_attention_cache.default
_ops_cache_out = torch.ops.dsv4mtp.sink_attention_cache_out.default


def _check_query_and_pool(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    units: tuple[str, str, str, str],
) -> tuple[int, int, int]:
    """The checks a decode over stored rows shares: q (B, H, Dh), its positions, the row store
    ``cache_kv`` (A, R, Dh) in q's dtype and ``cache_pos`` (A, R) int.  ``units`` names A and R
    in messages (("S", "rings", "C", "rows") or ("N", "blocks", "bs", "rows")).  -> (B, H, Dh)."""
    check_kernel_dtype("q", q)
    if q.dim() != 3:
        raise InputError(f"q: expected shape (B, H, Dh), got {tuple(q.shape)}")
    B, H, Dh = q.shape
    if Dh % 16:
        raise InputError(f"q: expected a head dim that is a multiple of 16, got Dh={Dh}")
    check_positions("q_pos", q_pos, B)
    check_kernel_dtype("cache_kv", cache_kv)
    if cache_kv.dtype != q.dtype:
        raise InputError(f"cache_kv: expected dtype {q.dtype} (as q), got {cache_kv.dtype}")
    check_shape("cache_kv", cache_kv, (None, None, Dh))
    A, R = cache_kv.shape[:2]
    a, outer, r, inner = units
    if A < 1 or R < 1:
        raise InputError(
            f"cache_kv: expected {a} >= 1 {outer} of {r} >= 1 {inner}, got {(A, R, Dh)}"
        )
    if not isinstance(cache_pos, torch.Tensor) or cache_pos.dtype not in (torch.int32, torch.int64):
        got = cache_pos.dtype if isinstance(cache_pos, torch.Tensor) else type(cache_pos).__name__
        raise InputError(f"cache_pos: expected an int32 / int64 tensor, got {got}")
    check_shape("cache_pos", cache_pos, (A, R))
    return B, H, Dh


def _finish_pool_plan(
    op: str,
    q: torch.Tensor,
    named: list[tuple[str, torch.Tensor]],
    attn_sink: torch.Tensor,
    window: int,
    scale: float,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
    schedule: object,
) -> tuple[str, list[int]]:
    """The rest of such a plan: sinks, window, scale, flag, devices, backend, ``out``."""
    B, H, Dh = q.shape
    check_kernel_dtype("attn_sink", attn_sink)
    check_shape("attn_sink", attn_sink, (H,))
    check_int("window", window, 1)
    check_number("scale", scale)
    check_instance("batch_invariant", batch_invariant, bool)
    dev = check_device([*named, ("attn_sink", attn_sink)])
    choice = select(op, backend, Facts(dev, (q.dtype, attn_sink.dtype)))
    if out is not None:
        check_out("out", out, (B, H, Dh), q.dtype, dev)
    return choice, _schedule_fields(schedule, H, Dh, window, q.dtype, batch_invariant)


def _cache_plan(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    slots: torch.Tensor,
    attn_sink: torch.Tensor,
    window: int,
    scale: float,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
    schedule: object,
) -> tuple[str, list[int]]:
    """Every metadata check of a sink_attention_cache call, then the backend and schedule."""
    B, _, _ = _check_query_and_pool(q, q_pos, cache_kv, cache_pos, ("S", "rings", "C", "rows"))
    check_positions("slots", slots, B)
    named = [("q", q), ("q_pos", q_pos), ("cache_kv", cache_kv), ("cache_pos", cache_pos),
             ("slots", slots)]  # fmt: skip
    return _finish_pool_plan(
        "sink_attention_cache", q, named, attn_sink, window, scale, batch_invariant, out,
        backend, schedule,
    )  # fmt: skip


def _bad_pool_rows(cache_pos: torch.Tensor) -> torch.Tensor:
    """(S, C) bool: rows of a ring (or of a paged block of C rows) that hold neither -1 (empty)
    nor a position p >= 0 at its own row p % C."""
    rows = torch.arange(cache_pos.shape[1], device=cache_pos.device)
    return (cache_pos < -1) | ((cache_pos >= 0) & (cache_pos % cache_pos.shape[1] != rows))


def _check_cache_values(cache_pos: torch.Tensor, slots: torch.Tensor) -> None:
    """The slot indices and the ring layout, on the device with one host read (eager only)."""
    if torch.compiler.is_compiling():
        return
    if cache_pos.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    S, C = cache_pos.shape
    bad_row = _bad_pool_rows(cache_pos)  # (S, C)
    ok = torch.stack([~bad_row.any(), (slots < S).all()])
    if bool(ok.all()):
        return
    if slots.numel() and int(slots.max()) >= S:
        raise InputError(
            f"slots: expected ring indices < S={S} (negative: padding), got "
            f"{[int(v) for v in slots.tolist()]}"
        )
    s, r = (int(v) for v in bad_row.nonzero()[0].tolist())
    raise InputError(
        f"cache_pos: expected -1 (empty) or the position p held at row p % C (C={C}), got "
        f"{int(cache_pos[s, r])} at slot {s}, row {r}"
    )


def sink_attention_cache(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    slots: torch.Tensor,
    attn_sink: torch.Tensor,
    *,
    window: int,
    scale: float,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: AttentionBackend = "auto",
    schedule: Any = None,
) -> torch.Tensor:
    """Decode attention over a ring KV cache (:class:`~dsv4mtp.optimized.kv_cache.DeviceKVCache`
    layout): o (B, H, Dh) in q.dtype.

    q (B, H, Dh) bf16 / fp32, Dh a multiple of 16, one query per row; q_pos (B,) int32 / int64;
    cache_kv (S, C, Dh) in q's dtype and cache_pos (S, C) int32 / int64: ring s holds the row of
    position p at index ``p % C`` with ``cache_pos[s, p % C] == p``, -1 for an empty row;
    slots (B,) int32 / int64: the ring of each row, negative for a padding row (its output is
    zero and it reads nothing); attn_sink (H,) bf16 / fp32.  Row b attends to the rows of ring
    ``slots[b]`` with position k, ``q_pos[b] - window < k <= q_pos[b]`` (k >= 0), plus the sink
    (docs/semantics.md, "Visibility and the sink softmax"); the math, precisions and tiles are
    :func:`sink_attention`'s.  Rows never visible (empty, out of the window, stale) are never
    loaded, so a NaN there cannot reach an output.  With no gap between the visible positions a
    row's bits equal :func:`sink_attention_varlen`'s over the same keys in position order
    (kernels/sink_attention.py, ``sink_attention_cache_kernel``).

    Bytes: q and out once (2 * B * H * Dh * itemsize), each row's ring positions (C * 4 B) and
    its visible rows once for all heads (at V4-Flash, window 128 and Dh 512 in bf16: 128 KiB of
    keys and 576 B of positions at C = 144 per row).  One launch, no host sync: capturable at
    fixed B.  An eager call also checks, with one host read, that every slot is < S and that
    every ring row holds -1 or a position p at index p % C (InputError otherwise); during
    capture or tracing the op trusts them.  ``out`` (B, H, Dh) in q's dtype, contiguous, is
    written in place and returned.  ``batch_invariant``: every row is computed on its own, in the
    same order under every schedule; the flag pins the default schedule to the one that does
    not read the row count (``attention_schedule``).
    """
    return _cache_call(
        q, q_pos, cache_kv, cache_pos, slots, attn_sink, window, scale, batch_invariant, out,
        backend, schedule, check_values=True,
    )  # fmt: skip


def _cache_call(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    slots: torch.Tensor,
    attn_sink: torch.Tensor,
    window: int,
    scale: float,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
    schedule: object,
    *,
    check_values: bool,
) -> torch.Tensor:
    """sink_attention_cache through the plan cache; ``check_values`` False for a caller that
    keeps the ring layout itself (the sublayer: its rows are written by kv_cache_write)."""
    plan = planned(
        signature(
            "sink_attention_cache", q, q_pos, cache_kv, cache_pos, slots, attn_sink, window, scale,
            batch_invariant, backend, schedule, out=out,
        ),
        lambda: _cache_plan(
            q, q_pos, cache_kv, cache_pos, slots, attn_sink, window, scale, batch_invariant,
            out, backend, schedule,
        ),
    )  # fmt: skip
    choice, fields = plan
    if check_values:
        _check_cache_values(cache_pos, slots)
    tail = (int(window), float(scale), choice, fields)
    if out is None:
        o = _ops_cache(q, q_pos, cache_kv, cache_pos, slots, attn_sink, *tail)
        return o  # type: ignore[no-any-return]
    _ops_cache_out(q, q_pos, cache_kv, cache_pos, slots, attn_sink, *tail, out=out)
    return out


_ops_paged = torch.ops.dsv4mtp.sink_attention_paged.default
_ops_paged_out = torch.ops.dsv4mtp.sink_attention_paged_out.default


def _paged_plan(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    block_table: torch.Tensor,
    attn_sink: torch.Tensor,
    window: int,
    scale: float,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
    schedule: object,
) -> tuple[str, list[int]]:
    """Every metadata check of a sink_attention_paged call, then the backend and schedule."""
    B, _, _ = _check_query_and_pool(q, q_pos, cache_kv, cache_pos, ("N", "blocks", "bs", "rows"))
    check_block_table("block_table", block_table, B)
    named = [("q", q), ("q_pos", q_pos), ("cache_kv", cache_kv), ("cache_pos", cache_pos),
             ("block_table", block_table)]  # fmt: skip
    return _finish_pool_plan(
        "sink_attention_paged", q, named, attn_sink, window, scale, batch_invariant, out,
        backend, schedule,
    )  # fmt: skip


def _check_paged_values(cache_pos: torch.Tensor, block_table: torch.Tensor) -> None:
    """The block indices and the pool layout, on the device with one host read (eager only)."""
    if torch.compiler.is_compiling():
        return
    if cache_pos.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    N, bs = cache_pos.shape
    bad_row = _bad_pool_rows(cache_pos)  # (N, bs)
    bad_entry = (block_table < -1) | (block_table >= N)
    ok = torch.stack([~bad_entry.any(), ~bad_row.any()])
    if bool(ok.all()):
        return
    if bool(bad_entry.any()):
        raise InputError(
            f"block_table: expected block indices in [-1, N={N}) (-1: no block), got "
            f"{block_table.tolist()}"
        )
    n, o = (int(v) for v in bad_row.nonzero()[0].tolist())
    raise InputError(
        f"cache_pos: expected -1 (empty) or a position p held at offset p % block_size "
        f"(block_size={bs}), got {int(cache_pos[n, o])} at block {n}, offset {o}"
    )


def sink_attention_paged(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    block_table: torch.Tensor,
    attn_sink: torch.Tensor,
    *,
    window: int,
    scale: float,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    backend: AttentionBackend = "auto",
    schedule: Any = None,
) -> torch.Tensor:
    """Attention over a paged KV cache (:class:`~dsv4mtp.optimized.kv_cache.PagedKVCache`
    layout, vLLM's block table): o (B, H, Dh) in q.dtype.

    q (B, H, Dh) bf16 / fp32, Dh a multiple of 16, one query per row; q_pos (B,) int32 / int64;
    cache_kv (N, bs, Dh) in q's dtype and cache_pos (N, bs) int32 / int64: a pool of N blocks of
    bs rows, -1 for an empty row, a row at offset o holding a position p with ``p % bs == o``;
    block_table (B, M) int32 / int64: query b's blocks, entry j the block of positions
    ``[j * bs, (j + 1) * bs)``, -1 for none (a padding query: all -1, output 0); attn_sink (H,)
    bf16 / fp32.  Query b sees position k, ``q_pos[b] - window < k <= q_pos[b]`` (k >= 0), when
    the row of its slot ``block_table[b, k // bs] * bs + k % bs`` holds k, plus the sink
    (docs/semantics.md, "The paged cache"); the math, precisions and tiles are
    :func:`sink_attention`'s.  Rows never visible (empty, out of the window, another position's)
    are never loaded, so a NaN there cannot reach an output.  The kernel walks the window's
    positions in the ring kernel's blocks and lanes, so the same stored keys give
    :func:`sink_attention_cache`'s bits (kernels/sink_attention.py,
    ``sink_attention_paged_kernel``).  A prefill passes one table row per query (its sequence's).

    Bytes: q and out once (2 * B * H * Dh * itemsize), per row the window's table entries and
    positions (at most window + SCAN of each: 1 KiB at window 128, int32) and its visible rows
    once for all heads (at V4-Flash in bf16: 128 KiB of keys).  One launch, no host sync:
    capturable at fixed B and M.  An eager call also checks, with one host read, that every
    table entry is in [-1, N) and that every pool row holds -1 or a position at its offset
    (InputError otherwise); during capture or tracing the op trusts them.  ``out`` (B, H, Dh) in
    q's dtype, contiguous, is written in place and returned.  ``batch_invariant``: every row is
    computed on its own, in the same order under every schedule; the flag pins the default
    schedule to the one that does not read the row count (``attention_schedule``).
    """
    return _paged_call(
        q, q_pos, cache_kv, cache_pos, block_table, attn_sink, window, scale, batch_invariant,
        out, backend, schedule, check_values=True,
    )  # fmt: skip


def _paged_call(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache_kv: torch.Tensor,
    cache_pos: torch.Tensor,
    block_table: torch.Tensor,
    attn_sink: torch.Tensor,
    window: int,
    scale: float,
    batch_invariant: bool,
    out: torch.Tensor | None,
    backend: str,
    schedule: object,
    *,
    check_values: bool,
) -> torch.Tensor:
    """sink_attention_paged through the plan cache; ``check_values`` False for a caller that
    checked the table and pool itself (the sublayer)."""
    plan = planned(
        signature(
            "sink_attention_paged", q, q_pos, cache_kv, cache_pos, block_table, attn_sink, window, scale,
            batch_invariant, backend, schedule, out=out,
        ),
        lambda: _paged_plan(
            q, q_pos, cache_kv, cache_pos, block_table, attn_sink, window, scale, batch_invariant,
            out, backend, schedule,
        ),
    )  # fmt: skip
    choice, fields = plan
    if check_values:
        _check_paged_values(cache_pos, block_table)
    tail = (int(window), float(scale), choice, fields)
    if out is None:
        o = _ops_paged(q, q_pos, cache_kv, cache_pos, block_table, attn_sink, *tail)
        return o  # type: ignore[no-any-return]
    _ops_paged_out(q, q_pos, cache_kv, cache_pos, block_table, attn_sink, *tail, out=out)
    return out


# ----------------------------------------------------------------------------- the sublayer
# A composition in Python of the registered operators (linear, grouped_linear, rms_norm,
# q_head_norm_rope, kv_norm_rope, sink_attention_varlen, apply_rope): no operator of its own.


@dataclass(frozen=True)
class AttentionPack:
    """One attention sublayer in the kernels' layout (:func:`pack_attention`).

    ``wq_a`` (Rq, D), ``wkv`` (Dh, D) plain :class:`LinearPack` s, or both None and ``wqa_wkv``
    the fused rows [wq_a; wkv] (row_splits (Rq, Dh), one GEMM over x for both); ``wq_b``
    (H*Dh, Rq); ``wo_a`` grouped (G, Ro, (H/G)*Dh); ``wo_b`` (D, G*Ro).  ``q_norm`` (Rq,),
    ``kv_norm`` (Dh,), ``attn_sink`` (H,) bf16 / fp32 on the pack's device.
    """

    wq_a: LinearPack | None
    wkv: LinearPack | None
    wqa_wkv: LinearPack | None
    wq_b: LinearPack
    wo_a: LinearPack
    wo_b: LinearPack
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    attn_sink: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.wq_b.device


def _vector(name: str, t: object, device: torch.device) -> torch.Tensor:
    """A norm weight or the sinks on ``device``: bf16 / fp32 kept, other floats widened to fp32
    (the compute dtype the reference uses them in)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 1:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{name}: expected a 1-D floating-point tensor, got {got}")
    if t.dtype not in (torch.bfloat16, torch.float32):
        t = t.to(torch.float32)
    return t.to(device).contiguous()


def _refuse_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise InputError(f"params: {what} cannot run during CUDA-graph capture; pack before")


def _o_groups(wq_b: LinearPack, wkv_rows: int, wo_a: object) -> int:
    """G from the shapes: wo_a (G*Ro, (H/G)*Dh), wq_b (H*Dh, Rq), wkv (Dh, D)."""
    shape = tuple(wo_a.shape) if isinstance(wo_a, (torch.Tensor, QuantizedWeight)) else ()
    if len(shape) != 2 or shape[1] < 1 or (wq_b.out_features % shape[1]):
        raise InputError(
            f"wo_a: expected shape (G*Ro, (H/G)*Dh) with (H/G)*Dh dividing wq_b's "
            f"{wq_b.out_features} rows, got {shape}"
        )
    if wq_b.out_features % wkv_rows:
        raise InputError(
            f"wq_b: expected H*Dh rows with Dh={wkv_rows} (wkv's rows), got {wq_b.out_features}"
        )
    return wq_b.out_features // shape[1]


def pack_attention(
    params: AttentionParams, device: torch.device | str | None = None
) -> AttentionPack:
    """Pack a core :class:`~dsv4mtp.params.AttentionParams` for :func:`attention` (a helper,
    not an op; once per layer, refused during CUDA-graph capture: it allocates).

    Each linear goes through :func:`~dsv4mtp.optimized.linear.pack_linear`: dense bf16 / fp32
    weights are kept in their dtype (other floats widened to fp32), a :class:`QuantizedWeight`
    in any field is packed as stored (FP8 codes and block scales).  ``wo_a`` becomes a grouped
    pack of G = H*Dh / wo_a's columns groups.  Norms and sinks: bf16 / fp32 kept, else fp32.
    ``device``: default wq_b's.
    """
    check_instance("params", params, AttentionParams)
    _refuse_capture("pack_attention")
    dev = None if device is None else check_device_arg("device", device)
    if dev is None:
        src = params.wq_b
        dev = src.data.device if isinstance(src, QuantizedWeight) else getattr(src, "device", None)
    wq_b = pack_linear(params.wq_b, dev)
    wkv = pack_linear(params.wkv, dev)
    G = _o_groups(wq_b, wkv.out_features, params.wo_a)
    return AttentionPack(
        wq_a=pack_linear(params.wq_a, dev), wkv=wkv, wqa_wkv=None, wq_b=wq_b,
        wo_a=pack_linear(params.wo_a, dev, groups=G), wo_b=pack_linear(params.wo_b, dev),
        q_norm=_vector("q_norm", params.q_norm, wq_b.device),
        kv_norm=_vector("kv_norm", params.kv_norm, wq_b.device),
        attn_sink=_vector("attn_sink", params.attn_sink, wq_b.device),
    )  # fmt: skip


def pack_attention_weights(
    weights: MTPLayerWeights, device: torch.device | str | None = None
) -> AttentionPack:
    """Pack a loaded checkpoint layer's attention (:class:`MTPLayerWeights`) as stored: wq_a and
    wkv as the one fused FP8 weight ``fused_wqa_wkv`` (row_splits (Rq, Dh): one GEMM reads x
    once for both), wq_b, the grouped wo_a and wo_b as FP8 (or bf16) packs; norms and sinks in
    fp32 (the compute dtype, as :func:`~dsv4mtp.params.build_layer_params` gives them)."""
    check_instance("weights", weights, MTPLayerWeights)
    _refuse_capture("pack_attention_weights")
    dev = check_device_arg("device", device if device is not None else weights.wq_b.data.device)
    wq_b = pack_linear(weights.wq_b, dev)
    fused = pack_linear(weights.fused_wqa_wkv, dev)
    G = _o_groups(wq_b, weights.wkv.shape[0], weights.wo_a)
    f32 = torch.float32
    return AttentionPack(
        wq_a=None, wkv=None, wqa_wkv=fused, wq_b=wq_b,
        wo_a=pack_linear(weights.wo_a, dev, groups=G), wo_b=pack_linear(weights.wo_b, dev),
        q_norm=_vector("q_norm", weights.q_norm.to(f32), dev),
        kv_norm=_vector("kv_norm", weights.kv_norm.to(f32), dev),
        attn_sink=_vector("attn_sink", weights.attn_sink.to(f32), dev),
    )  # fmt: skip


# Packs of the AttentionParams objects passed to ``attention``, per object and device.  Weak: an
# entry is dropped (and its device weights freed) when its params object is collected; a params
# object changed in place after its first call is not re-packed.


def _attention_pack(params: object, device: torch.device) -> AttentionPack:
    if isinstance(params, AttentionPack):
        if params.device != device:
            raise InputError(f"params: packed on {params.device}, x is on {device}")
        return params
    if not isinstance(params, AttentionParams):
        raise InputError(
            f"params: expected an AttentionParams or an AttentionPack, got {type(params).__name__}"
        )
    return packed_once(
        params, device, pack_attention,
        "call attention once before capturing, or pass pack_attention(params, device)",
    )  # fmt: skip


def _rows_of(
    lens: list[int], T: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n (B,), starts (B,), seq (T,)) int64 on ``dev``: each sequence's length and first row,
    each row's sequence; one host-to-device copy, no sync."""
    n = device_ints(lens, dev)
    starts = n.cumsum(0) - n
    seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), n, output_size=T)
    return n, starts, seq


def _rising_in(pos: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """() bool: some row of ``rows`` (T,) bool is not past the one before it in its sequence."""
    return (rows[1:] & (seq[1:] == seq[:-1]) & (pos[1:] <= pos[:-1])).any()


def _check_sequences(
    positions: torch.Tensor, lens: list[int], kv_cache: Sequence[KVCache] | None
) -> None:
    """The reference's checks, with one host read of a flag: strictly increasing within each
    sequence and past its cache's last position (the flag computed on the device; the message,
    only on failure, from the positions read on the host)."""
    T, dev = positions.shape[0], positions.device
    n, starts, seq = _rows_of(lens, T, dev)
    pos = positions.long()
    bad = _rising_in(pos, seq, torch.ones_like(seq, dtype=torch.bool))
    if kv_cache is not None and T:
        # each cache's last position, a floor below every position for none (one host read
        # per cache, as the reference's check)
        lasts = [c.last_position for c in kv_cache]
        floor = device_ints([-(2**62) if v is None else v for v in lasts], dev)
        bad = bad | ((n > 0) & (pos[starts.clamp(max=T - 1)] <= floor)).any()
    if bool(bad):
        _sequences_error(positions, lens, kv_cache)


def _sequences_error(
    positions: torch.Tensor, lens: list[int], kv_cache: Sequence[KVCache] | None
) -> None:
    """The failure path of :func:`_check_sequences`: the first bad sequence's InputError."""
    pos = [int(p) for p in positions.tolist()]
    start = 0
    for b, n in enumerate(lens):
        pos_b = pos[start : start + n]
        start += n
        if any(a >= c for a, c in itertools.pairwise(pos_b)):
            raise InputError(
                f"positions: expected strictly increasing positions within sequence {b}, "
                f"got {pos_b}"
            )
        cache = kv_cache[b] if kv_cache is not None else None
        last = cache.last_position if cache is not None else None
        if n and last is not None and pos_b[0] <= last:
            raise InputError(
                f"positions: sequence {b} starts at {pos_b[0]} but its kv_cache already "
                f"holds position {last}"
            )


class _RingIndex(NamedTuple):
    """A ring prefill's index on the device, built before its first launch
    (kernels/ring_prefill.py, ``ring_index_kernel``): what its checks read and where its keys
    come from (docs/semantics.md, "The device ring cache").  B sequences, C rows per ring."""

    cu_q: torch.Tensor  # (B+1,) int32 row offsets of the sequences
    slots: torch.Tensor  # (B,) the call's ring of each sequence (negative: padding)
    order: torch.Tensor  # (B, C) int32 the visible ring rows by position (first seen entries)
    key_pos: torch.Tensor  # (B, C) int64 their positions
    stats: torch.Tensor  # (B, 3) int64 seen, key rows, flags (1: a check fails, 2: repeats)

    @property
    def bad(self) -> torch.Tensor:
        """() bool: some slot or position fails the checks."""
        return (self.stats[:, 2] & 1).any()


_ring_index_triton = triton_kernel("ring_prefill", "ring_index_triton")
_ring_keys_triton = triton_kernel("ring_prefill", "ring_keys_triton")


def _ring_index(
    positions: torch.Tensor,
    lens: list[int],
    cache: DeviceKVCache,
    slots: torch.Tensor,
) -> _RingIndex:
    """The facts :func:`_check_ring_sequences` tests, as device tensors (no host read): slots
    < S and distinct among the non-negative ones, and, in each sequence with a ring, positions
    in [0, 2^31), rising, and past the ring's newest row; and each ring's rows visible to its
    sequence's first row (``p >= 0`` and ``p > first - window``) in position order.  One
    launch (and the row offsets' host-to-device copy)."""
    cu_q = device_ints([0, *itertools.accumulate(lens)], positions.device, torch.int32)
    order, key_pos, stats = _ring_index_triton(
        positions, cu_q, slots, cache.pos, cache.window, max(lens, default=0)
    )
    return _RingIndex(cu_q, slots, order, key_pos, stats)


class _RingPlan(NamedTuple):
    """A ring prefill's index with the host ints its launches need (one host read)."""

    rows: _RingIndex
    cu_k: torch.Tensor  # (B+1,) int32 key offsets: each live sequence's seen + new rows
    keys: int  # rows of the varlen launch's keys
    cached: int  # of them from the rings
    trusted: bool  # the visible ring rows hold distinct positions (else the launch checks)
    max_rows: int  # the most key rows or new rows of one sequence (the keys kernel's grid)


def _ring_plan(index: _RingIndex, lens: list[int]) -> tuple[bool, _RingPlan]:
    """(bad, the plan) with one host read of the index's 3 x B ints."""
    stats = index.stats.tolist()
    bad = any(f & 1 for _, _, f in stats)
    dup = any(f & 2 for _, _, f in stats)
    k_lens = [k for _, k, _ in stats]
    cu_k = [0, *itertools.accumulate(k_lens)]
    max_rows = max([*k_lens, *lens], default=0)
    plan = _RingPlan(
        index, device_ints(cu_k, index.cu_q.device, torch.int32), cu_k[-1],
        sum(s for s, _, _ in stats), not dup, max_rows,
    )  # fmt: skip
    return bad, plan


def _check_ring_sequences(
    positions: torch.Tensor,
    lens: list[int],
    cache: DeviceKVCache,
    slots: torch.Tensor,
    prefill: bool = False,
) -> _RingPlan | None:
    """The reference's position checks against a ring cache: slots < S and distinct (negative:
    padding, unchecked), positions in [0, 2^31) increasing within each sequence and past its
    ring's newest row.  A decode (T = B rows) reads its few hundred ints at once and checks on
    the host (three ops); a ``prefill`` checks on the device (``ring_index_kernel``) with one
    host read of 3 x B ints, T-independent, which also sizes its keys (-> its plan), and reads
    the values for the message only on failure."""
    if not prefill:
        _ring_sequences_host(positions, lens, cache, slots)
        return None
    bad, plan = _ring_plan(_ring_index(positions, lens, cache, slots), lens)
    if bad:
        _ring_sequences_host(positions, lens, cache, slots)
    return plan


def _ring_sequences_host(
    positions: torch.Tensor, lens: list[int], cache: DeviceKVCache, slots: torch.Tensor
) -> None:
    """:func:`_check_ring_sequences` on the host, from the positions, the slots and each ring's
    newest position read at once: a decode's check, and a prefill's on failure (its message)."""
    newest = cache.pos.max(dim=1).values.long()  # (S,), -1 for an empty ring
    host = torch.cat([positions.long(), slots.long(), newest]).tolist()
    T, B = positions.shape[0], slots.shape[0]
    pos, slot, last = host[:T], host[T : T + B], host[T + B :]
    S = cache.num_seqs
    used = [s for s in slot if s >= 0]
    if any(s >= S for s in used) or len(set(used)) != len(used):
        raise InputError(
            f"cache_slots: expected distinct ring indices < num_seqs={S} (negative: padding), "
            f"got {slot}"
        )
    start = 0
    for b, n in enumerate(lens):
        pos_b = pos[start : start + n]
        start += n
        if slot[b] < 0:
            continue
        if any(p < 0 or p >= 2**31 for p in pos_b):
            raise InputError(
                f"positions: expected positions in [0, 2^31) with a DeviceKVCache, got {pos_b} "
                f"in sequence {b}"
            )
        if any(a >= c for a, c in itertools.pairwise(pos_b)):
            raise InputError(
                f"positions: expected strictly increasing positions within sequence {b}, "
                f"got {pos_b}"
            )
        if n and last[slot[b]] >= 0 and pos_b[0] <= last[slot[b]]:
            raise InputError(
                f"positions: sequence {b} starts at {pos_b[0]} but its kv_cache already "
                f"holds position {last[slot[b]]}"
            )


def _check_paged_args(
    cache: PagedKVCache,
    block_table: object,
    slot_mapping: object,
    B: int,
    T: int,
    x: torch.Tensor,
    dh_w: tuple[int, int],
    capturing: bool,
    decode: bool,
) -> None:
    """The metadata of a call with a PagedKVCache: the cache's head dim, window, dtype and
    device, block_table (B, M) and slot_mapping (T,) int on x's device."""
    Dh, W = dh_w
    if (cache.head_dim, cache.window, cache.dtype, cache.device) != (Dh, W, x.dtype, x.device):
        raise InputError(
            f"kv_cache: expected a PagedKVCache of Dh={Dh}, window={W} in {x.dtype} on "
            f"{x.device}, got {cache!r}"
        )
    check_block_table("block_table", block_table, B)  # one row per sequence
    assert isinstance(block_table, torch.Tensor)
    check_positions("slot_mapping", slot_mapping, T)
    assert isinstance(slot_mapping, torch.Tensor)
    check_device([("x", x), ("block_table", block_table), ("slot_mapping", slot_mapping)])
    if capturing and not decode:
        raise InputError(
            "kv_cache: a prefill (a sequence of more than one row) with a PagedKVCache is "
            "eager only (not during capture); decode steps are capturable"
        )


def _check_paged_sequences(
    positions: torch.Tensor,
    lens: list[int],
    cache: PagedKVCache,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The reference's position checks and the paged layout, on the device with one host read
    of a flag (the message, only on failure, from the values read on the host): table entries
    in [-1, N)
    and the pool rows at their offsets (as sink_attention_paged checks), positions in
    [0, 2^31) increasing within each sequence (a padding sequence, its table row all -1,
    unchecked), each slot -1 or its position's vLLM slot (a row written elsewhere would be
    seen by no query; a padding sequence's slots are then -1), the written slots distinct."""
    T, dev = positions.shape[0], positions.device
    N, bs = cache.pos.shape
    _, _, seq = _rows_of(lens, T, dev)
    want = cache.slots(block_table[seq], positions.clamp(min=0))  # (T,)
    pos, slot = positions.long(), slot_mapping.long()
    held = cache.pos
    checked = ~(block_table < 0).all(dim=1)[seq]  # (T,): rows of a sequence with blocks
    written = slot >= 0
    distinct = torch.where(written, slot, -1 - torch.arange(T, device=dev)).sort().values
    bad = torch.stack(
        [
            ((block_table < -1) | (block_table >= N)).any(),
            ((held < -1) | ((held >= 0) & (held % bs != torch.arange(bs, device=dev)))).any(),
            (checked & ((pos < 0) | (pos >= 2**31))).any(),
            _rising_in(pos, seq, checked),
            ((slot != -1) & (slot != want)).any(),
            (distinct[1:] == distinct[:-1]).any(),
        ]
    ).any()
    if bool(bad):
        _paged_sequences_error(positions, lens, cache, block_table, slot_mapping)


def _paged_sequences_error(
    positions: torch.Tensor,
    lens: list[int],
    cache: PagedKVCache,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The failure path of :func:`_check_paged_sequences`: its InputError, from the positions,
    the slot mapping and the slots the table gives them read on the host."""
    _check_paged_values(cache.pos, block_table)
    T = positions.shape[0]
    seq = torch.repeat_interleave(
        torch.arange(len(lens), device=positions.device),
        device_ints(lens, positions.device),
        output_size=T,
    )
    want = cache.slots(block_table[seq], positions.clamp(min=0))  # (T,)
    padding = (block_table < 0).all(dim=1).long()  # (B,)
    host = torch.cat([positions.long(), slot_mapping.long(), want, padding]).tolist()
    pos, slot, vllm, pad = host[:T], host[T : 2 * T], host[2 * T : 3 * T], host[3 * T :]
    start = 0
    for b, n in enumerate(lens):
        pos_b = pos[start : start + n]
        start += n
        if pad[b]:  # a padding sequence: attends to nothing, its slots checked below
            continue
        if any(p < 0 or p >= 2**31 for p in pos_b):
            raise InputError(
                f"positions: expected positions in [0, 2^31) with a PagedKVCache, got {pos_b} "
                f"in sequence {b}"
            )
        if any(a >= c for a, c in itertools.pairwise(pos_b)):
            raise InputError(
                f"positions: expected strictly increasing positions within sequence {b}, "
                f"got {pos_b}"
            )
    bad = [t for t in range(T) if slot[t] != -1 and slot[t] != vllm[t]]
    if bad:
        t = bad[0]
        raise InputError(
            f"slot_mapping: expected -1 or the slot block_table[b, p // block_size] * "
            f"block_size + p % block_size of each row's position (-1 where that entry is -1), "
            f"got {slot[t]} for row {t} at position {pos[t]} (its slot: {vllm[t]})"
        )
    used = [s for s in slot if s >= 0]
    if len(set(used)) != len(used):
        raise InputError(f"slot_mapping: expected distinct slots (-1: none), got {slot}")


def _ring_keys(
    kv: torch.Tensor, positions: torch.Tensor, cache: DeviceKVCache, plan: _RingPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys of a ring prefill's varlen launch, in one launch (kernels/ring_prefill.py,
    ``ring_keys_kernel``): each live sequence's visible ring rows in position order, then its
    new rows (a padding sequence has none).  -> keys (Tk, Dh) in kv's dtype, their positions
    (Tk,) int64 and, per row of ``kv``, the ring it is written to (T,) int32: its sequence's
    slot for the last C positions of a live sequence (the earlier ones would be overwritten in
    the same call), -1 otherwise."""
    i = plan.rows
    return _ring_keys_triton(
        kv, positions, i.cu_q, plan.cu_k, i.slots, (i.order, i.key_pos, i.stats), cache.kv,
        plan.keys, plan.max_rows,
    )  # fmt: skip


def _check_device_offsets(
    T: int,
    ring: DeviceKVCache | None,
    seq_lens: object,
    query_start_loc: torch.Tensor | None,
    seq_flags: torch.Tensor | None,
    cache_slots: torch.Tensor | None,
    dev: torch.device,
    capturing: bool,
) -> None:
    """The metadata of a prefill with device offsets; eagerly also the offsets' values, with one
    host read (0 first, T last, never falling: a row outside every sequence, or a sequence past
    T, would make the kernels read and write outside their tensors).  During capture or
    tracing the values cannot be read: the caller guarantees them (``PrefillGraphs`` builds
    them from lengths it checked)."""
    if ring is None:
        raise InputError("query_start_loc: expected a DeviceKVCache kv_cache with it")
    if seq_lens is not None:
        raise InputError("seq_lens: expected None with query_start_loc (the offsets say it)")
    check_positions("cache_slots", cache_slots)
    assert cache_slots is not None
    B = cache_slots.shape[0]
    for name, t, shape, dtype in (
        ("query_start_loc", query_start_loc, (B + 1,), torch.int32),
        ("seq_flags", seq_flags, (B,), torch.int64),
    ):
        if (
            not isinstance(t, torch.Tensor)
            or tuple(t.shape) != shape
            or t.dtype != dtype
            or t.device != dev
            or not t.is_contiguous()
        ):
            raise InputError(
                f"{name}: expected a contiguous {shape} {dtype} tensor on {dev} with "
                f"query_start_loc, got {t!r:.80}"
            )
    assert query_start_loc is not None
    check_device([("query_start_loc", query_start_loc), ("cache_slots", cache_slots)])
    if capturing or torch.compiler.is_compiling():
        return
    cu = [int(v) for v in query_start_loc.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in itertools.pairwise(cu)):
        raise InputError(
            f"query_start_loc: expected row offsets from 0 to T={T}, never falling, got {cu}"
        )


def _device_ring_plan(
    positions: torch.Tensor,
    cu_q: torch.Tensor,
    cache: DeviceKVCache,
    slots: torch.Tensor,
    seq_flags: torch.Tensor,
) -> _RingPlan:
    """The plan of a ring prefill with its row offsets on the device (``query_start_loc``): no
    host read, every size from T, B and the ring's C, so CUDA-graph capturable.

    The index kernel kills a sequence whose checks fail or whose ring repeats a position (it is
    then a padding sequence: no keys, no ring write, output zero) and its flags are copied to
    ``seq_flags`` (B,) int64 for the caller; the visible rows left are distinct, so the plan is
    trusted (the varlen launch checks nothing on the host).  The key offsets are the prefix
    sum of the index's per-sequence key rows, on the device; the keys buffer holds the most any
    call of this T and B can need, T + B * C rows (a live sequence's keys are its visible ring
    rows, at most C, then its new rows), and the varlen launch reads only each sequence's
    ``[cu_k[b], cu_k[b + 1])``.  So each row attends to the same keys, in the same order, as in
    the eager prefill: the same bits."""
    T, B, C = positions.shape[0], slots.shape[0], cache.pos.shape[1]
    # every sequence's rows are checked (its new rows loop to its own length; T bounds it)
    order, key_pos, stats = _ring_index_triton(
        positions, cu_q, slots, cache.pos, cache.window, T, 3
    )
    seq_flags.copy_(stats[:, 2])
    cu_k = torch.zeros(B + 1, dtype=torch.int32, device=positions.device)
    torch.cumsum(stats[:, 1], 0, out=cu_k[1:])  # (B+1,) key offsets
    index = _RingIndex(cu_q, slots, order, key_pos, stats)
    return _RingPlan(index, cu_k, T + B * C, -1, True, T + C)  # cached: not known on the host


def _ring_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    lens: list[int],
    cache: DeviceKVCache,
    slots: torch.Tensor,
    attn_sink: torch.Tensor,
    batch_invariant: bool,
    plan: _RingPlan | None,
) -> torch.Tensor:
    """Prefill against a ring cache: each sequence's visible cached rows in position order,
    then its new rows, as the keys of one varlen launch; then the new rows written.  ``plan``:
    from the call's checks (their one host read also sized the keys), from
    :func:`_device_ring_plan` (no host read: capturable), or None (the checks were skipped) for
    one host read here.  No other host read or sync."""
    if plan is None:
        _, plan = _ring_plan(_ring_index(positions, lens, cache, slots), lens)
    W, Dh = cache.window, q.shape[2]
    keys, key_pos, owners = _ring_keys(kv, positions, cache, plan)
    # the keys rise within each sequence by construction: the launch checks them only where
    # the rings' visible rows repeat a position
    offsets = (plan.rows.cu_q, plan.cu_k)
    tail = (W, Dh**-0.5, batch_invariant, None, "auto", None)
    o = _call(
        "sink_attention_varlen", q, positions, keys, key_pos, attn_sink, offsets, *tail,
        check_values=not plan.trusted,
    )  # fmt: skip
    _write_out(kv, positions, owners, cache_kv=cache.kv, cache_pos=cache.pos)
    return o


_write_out = torch.ops.dsv4mtp.kv_cache_write_out.default
_FREQS: dict[tuple[object, ...], torch.Tensor] = {}

#: The output's inverse rotation written in place (one launch) rather than into a new tensor
#: copied back into o (two launches; the same bits).  The switch exists for
#: bench/diag/fusion_ab.py, which times the whole step both ways.
INVERSE_ROPE_IN_PLACE = True
#: At decode against a device cache, the kv path (norm + RoPE, cache write) on a side stream
#: beside the q path (see :func:`attention`); False runs it in line (bench/diag/fusion_ab.py
#: times the step both ways).
KV_SIDE_STREAM = True


def _kv_side_stream(dev: torch.device) -> torch.cuda.Stream | None:
    """The attention's side stream (:func:`~._ops.side_stream`), or None: on the CPU (the
    interpreter), under torch.compile and with :data:`KV_SIDE_STREAM` off."""
    if not KV_SIDE_STREAM or torch.compiler.is_compiling():
        return None
    return side_stream(dev, "attention.kv")


def _rope_table(config: DSV4Config, rope_mode: RopeMode, dev: torch.device) -> torch.Tensor:
    """The fp32 RoPE frequency table of a config, mode and device, built once: a captured call
    then allocates nothing for it (the yarn table is built on the host and copied)."""
    key = (config.qk_rope_head_dim, config.rope_theta, rope_mode, repr(config.rope_scaling), dev)
    freqs = _FREQS.get(key)
    if freqs is None:
        freqs = rope_frequencies(
            config.qk_rope_head_dim, config.rope_theta, mode=rope_mode,
            rope_scaling=config.rope_scaling, dtype=torch.float32, device=dev,
        )  # fmt: skip
        if len(_FREQS) >= 64:
            _FREQS.clear()
        _FREQS[key] = freqs
    return freqs


def attention(
    x: torch.Tensor,
    positions: torch.Tensor,
    params: AttentionParams | AttentionPack,
    config: DSV4Config,
    *,
    seq_lens: Sequence[int] | None = None,
    kv_cache: Sequence[KVCache] | DeviceKVCache | PagedKVCache | None = None,
    rope_mode: RopeMode = "plain",
    fp8_kv: bool = False,
    act_quant: bool = False,
    norm_order: NormOrder = "official",
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
    cache_slots: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    seq_flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MTP attention sublayer: x (T, D) bf16 / fp32 (already ``attn_norm``-ed) -> (T, D).

    Same signature and math as :func:`dsv4mtp.reference.attention` (docs/semantics.md,
    "Attention with sinks") plus ``batch_invariant``, ``out``, ``cache_slots``, ``block_table``
    and ``slot_mapping``.  positions (T,) int; ``seq_lens``: lengths of consecutive sequences
    (default one, or T of one row each with a :class:`DeviceKVCache` / :class:`PagedKVCache`);
    ``kv_cache``: one :class:`KVCache` per sequence, read and then extended with this call's
    rows (after kv_norm, RoPE and the optional FP8 round trip, as the reference stores them),
    one :class:`DeviceKVCache` with ``cache_slots``, or one :class:`PagedKVCache` with
    ``block_table`` and ``slot_mapping``.
    ``params``: an :class:`AttentionPack`, or a core :class:`AttentionParams` packed on first
    use and cached for that object (refused during CUDA-graph capture).  ``act_quant`` rounds
    the inputs of wq_a, wq_b, wkv and wo_b through e4m3; wo_a (bf16 in the official code) takes
    none.

    Not an operator of its own: a Python composition of the registered ops, in the reference's
    order: ``linear`` wq_a (T, Rq) -> ``rms_norm`` q_norm -> ``linear`` wq_b (T, H, Dh) ->
    ``q_head_norm_rope``; ``linear`` wkv (T, Dh) -> ``kv_norm_rope`` (one fused wq_a+wkv GEMM
    for a :func:`pack_attention_weights` pack); the attention core -> ``apply_rope`` inverse on
    the output's rope dims -> ``grouped_linear`` wo_a (T, G, Ro) -> ``linear`` wo_b (T, D).
    At decode against a device cache (ring or paged) the kv path (``kv_norm_rope``, the cache
    write) runs on a side stream beside the q path and is joined before the attention core:
    the same bits, two launches off the step's dependent chain.
    Bytes per call at V4-Flash (FP8 codes): wq_a 4 MiB, wq_b 32 MiB, wkv 2 MiB, wo_a 32 MiB,
    wo_b 32 MiB, plus each sequence's KV window (at most 128 rows of 512, 128 KiB in bf16) and
    the activations.  Every op's schedule is batch invariant under ``batch_invariant=True``;
    rows and sequences are independent, so the flag is passed on.

    The attention core by cache:

    * none or host :class:`KVCache` s: one ``sink_attention_varlen`` launch over every
      sequence, its cached rows concatenated on the host before its new ones; cu_q / cu_k are
      built from host ints and the caches extended on the host.  Eager only: a call with host
      caches is refused during CUDA-graph capture.
    * :class:`DeviceKVCache` (docs/semantics.md, "The device ring cache"): ``cache_slots`` (B,)
      int32 / int64 on x's device names each sequence's ring, negative for a padding sequence,
      which reads and writes no cache row and whose attention output is zero (its output rows
      are then wo_b(wo_a(0)) = 0: finite, never NaN).  Decode, every sequence one row
      (``seq_lens`` None means T sequences of one row): ``kv_cache_write`` puts the new rows
      in their rings, then one ``sink_attention_cache`` launch; device indices only, no host
      read.  Prefill, some sequence longer than one row: eager, each ring's visible rows
      gathered in position order before the new rows, one ``sink_attention_varlen`` launch,
      then the rows written; refused during capture.  With ``query_start_loc`` (B+1,) int32,
      the sequences' row offsets on the device (vLLM's name; ``seq_lens`` None), the prefill
      reads nothing on the host and is capturable (:func:`_device_ring_plan`): a sequence
      that fails the checks below is not raised but treated as padding (no cache row read or
      written, output zero), and every sequence's check flags go to ``seq_flags`` (B,) int64
      (0: passed; bit 0 a failed check, bit 1 a ring that holds a position twice), which the
      caller must read (``PrefillGraphs.check`` does).

    * :class:`PagedKVCache` (docs/semantics.md, "The paged cache"), an engine's pool in vLLM's
      convention: ``block_table`` (B, M) int32 / int64, sequence b's blocks (entry j: its
      positions ``[j * bs, (j + 1) * bs)``, -1 none; a row of -1 is a padding sequence, output
      zero), ``slot_mapping`` (T,) int64 / int32, the pool row of each new row (-1: not
      written; otherwise vLLM's slot of its position, ``block_table[b, p // bs] * bs +
      p % bs``).  The rows are written (``kv_cache_write``), then one ``sink_attention_paged``
      launch attends every row through its sequence's table row; a row the mapping does not
      write is seen by no query, its own included.  Decode (every sequence one row) is device
      indices only, capturable; a prefill repeats each table row over its sequence's rows
      (eager: it reads ``seq_lens`` on the host).  No rollback is needed after rejected drafts
      (their positions are past the next query's and are overwritten when decoded again).

    CUDA-graph capturable call form: ``attention(x, positions, pack, config,
    kv_cache=device_cache, cache_slots=slots, seq_lens=None, ...)`` with x (T, D),
    positions (T,) and slots (T,) at a fixed T, ``params`` an :class:`AttentionPack` (or
    params packed by an earlier eager call) and the RoPE table built by an earlier eager call
    with the same config and ``rope_mode``; the inputs are then read from their device
    buffers on each replay (with a :class:`PagedKVCache`: ``block_table=`` (T, M) and
    ``slot_mapping=`` (T,) instead of ``cache_slots``).  During capture the host checks below
    are skipped: check positions and slots eagerly first.

    Validation as the reference's, before any cache is touched: the positions rise within each
    sequence (and, with a :class:`DeviceKVCache`, slots < num_seqs and distinct, positions in
    [0, 2^31) and past their ring's newest row; with a :class:`PagedKVCache`, table entries in
    [-1, N), each slot -1 or its position's vLLM slot, distinct).  The checks run on the device
    with one host read of a few scalars, T-independent (for a ring prefill 3 x B ints, the same
    read sizing its keys; a ring decode reads its positions and slots and checks on the host;
    host :class:`KVCache` s add a read of each one's last position); the message, only when a
    check fails, from the values read on the host.  The index and keys of a ring prefill are
    built on the device in two launches (kernels/ring_prefill.py).  ``out`` (T, D) in x.dtype, contiguous, receives the result (the wo_b
    GEMM writes it).
    """
    check_instance("config", config, DSV4Config)
    check_instance("batch_invariant", batch_invariant, bool)
    check_instance("fp8_kv", fp8_kv, bool)
    check_instance("act_quant", act_quant, bool)
    if norm_order not in ("official", "vllm"):
        raise InputError(f"norm_order: expected 'official' or 'vllm', got {norm_order!r}")
    check_kernel_dtype("x", x)
    check_shape("x", x, (None, config.hidden_size))
    T = x.shape[0]
    check_positions("positions", positions, T)
    dev = check_device([("x", x), ("positions", positions)])
    ring = kv_cache if isinstance(kv_cache, DeviceKVCache) else None
    paged = kv_cache if isinstance(kv_cache, PagedKVCache) else None
    host = None if isinstance(kv_cache, (DeviceKVCache, PagedKVCache)) else kv_cache
    if host is not None and not all(isinstance(c, KVCache) for c in host):
        raise InputError("kv_cache: expected a sequence of KVCache (one per sequence)")
    if ring is None and cache_slots is not None:
        raise InputError("cache_slots: expected None without a DeviceKVCache kv_cache")
    for name, v in (("block_table", block_table), ("slot_mapping", slot_mapping)):
        if paged is None and v is not None:
            raise InputError(f"{name}: expected None without a PagedKVCache kv_cache")
    if seq_lens is not None and not all(
        isinstance(n, (int, torch.Tensor)) and not isinstance(n, bool) for n in seq_lens
    ):
        raise InputError(f"seq_lens: expected a sequence of ints, got {seq_lens!r}")
    H, Dh, Dr = config.num_attention_heads, config.head_dim, config.qk_rope_head_dim
    Dn, G, W, eps = Dh - Dr, config.o_groups, config.sliding_window, config.rms_norm_eps
    # (under torch.compile the host checks below are skipped anyway, and dynamo cannot trace
    # the capture query: it returns a host bool)
    capturing = (
        dev.type == "cuda"
        and not torch.compiler.is_compiling()
        and torch.cuda.is_current_stream_capturing()
    )
    device_offsets = query_start_loc is not None or seq_flags is not None
    if device_offsets:
        _check_device_offsets(
            T, ring, seq_lens, query_start_loc, seq_flags, cache_slots, dev, capturing
        )
        lens = []  # on the device only: query_start_loc
    elif seq_lens is not None:
        lens = [int(n) for n in seq_lens]
    else:
        lens = [1] * T if ring is not None or paged is not None else [T]
    if not device_offsets and (any(n < 0 for n in lens) or sum(lens) != T):
        raise InputError(f"seq_lens: expected lengths summing to T={T}, got {lens}")
    if host is not None and len(host) != len(lens):
        raise InputError(
            f"kv_cache: expected one cache per sequence ({len(lens)}), got {len(host)}"
        )
    decode = not device_offsets and all(n == 1 for n in lens)
    if ring is not None:
        if not device_offsets:
            check_positions("cache_slots", cache_slots, len(lens))
        assert cache_slots is not None
        check_device([("x", x), ("cache_slots", cache_slots)])
        if (ring.head_dim, ring.window, ring.dtype, ring.device) != (Dh, W, x.dtype, dev):
            raise InputError(
                f"kv_cache: expected a DeviceKVCache of Dh={Dh}, window={W} in {x.dtype} on "
                f"{dev}, got {ring!r}"
            )
        if capturing and not decode and not device_offsets:
            raise InputError(
                "kv_cache: a prefill (a sequence of more than one row) with a DeviceKVCache and "
                "host seq_lens is eager only (not during capture); decode steps, and a prefill "
                "with its offsets on the device (query_start_loc=), are capturable"
            )
    elif paged is not None:
        _check_paged_args(paged, block_table, slot_mapping, len(lens), T, x, (Dh, W), capturing,
                          decode)  # fmt: skip
    elif host is not None and capturing:
        raise InputError("kv_cache: attention with KV caches is eager only (not during capture)")
    pack = _attention_pack(params, dev)
    if pack.wq_b.out_features != H * Dh or pack.wo_b.out_features != config.hidden_size:
        raise InputError(
            f"params: expected wq_b with H*Dh={H * Dh} rows and wo_b with D="
            f"{config.hidden_size} rows, got {pack.wq_b.out_features} and "
            f"{pack.wo_b.out_features}"
        )
    if pack.wo_a.groups != G or pack.wo_a.out_features != config.o_lora_rank:
        raise InputError(
            f"params: expected wo_a of {G} groups of {config.o_lora_rank} rows, got "
            f"{pack.wo_a.groups} of {pack.wo_a.out_features}"
        )
    ring_plan: _RingPlan | None = None  # a ring prefill's keys, sized by its checks' host read
    if not capturing and not torch.compiler.is_compiling() and not device_offsets:
        if ring is not None:
            assert cache_slots is not None
            ring_plan = _check_ring_sequences(positions, lens, ring, cache_slots, not decode)
        elif paged is not None:
            assert block_table is not None and slot_mapping is not None
            _check_paged_sequences(positions, lens, paged, block_table, slot_mapping)
        else:
            _check_sequences(positions, lens, host)
    if out is not None:
        check_out("out", out, (T, config.hidden_size), x.dtype, dev)
    freqs = _rope_table(config, rope_mode, dev)
    bi = batch_invariant
    if T == 0:  # no rows: nothing to launch; the caches are extended by nothing, as the reference
        if seq_flags is not None:
            seq_flags.zero_()  # no rows: no sequence is checked
        if host is not None:
            for cache in host:
                cache.append(x.new_zeros(0, Dh), positions[:0])
        return out.zero_() if out is not None else x.new_zeros(0, config.hidden_size)

    # query and key/value paths (docs/semantics.md, "Query", "Key/value latent")
    if pack.wqa_wkv is not None:
        qkv = linear(x, pack.wqa_wkv, act_quant=act_quant, batch_invariant=bi)  # (T, Rq + Dh)
        Rq = qkv.shape[1] - Dh
        # column slices read in place: rms_norm and kv_norm_rope take rows with a stride
        qr, kv = qkv[:, :Rq], qkv[:, Rq:]
    else:
        assert pack.wq_a is not None and pack.wkv is not None
        qr = linear(x, pack.wq_a, act_quant=act_quant, batch_invariant=bi)  # (T, Rq)
        kv = linear(x, pack.wkv, act_quant=act_quant, batch_invariant=bi)  # (T, Dh)

    def kv_path(kv: torch.Tensor) -> torch.Tensor:
        """kv's norm + RoPE (T, Dh): the rows attended and cached; at decode also their write
        into the cache (ring or paged), which the attention then reads."""
        kv = kv_norm_rope(
            kv, pack.kv_norm, positions, freqs, eps=eps, rope_dim=Dr, fp8_kv=fp8_kv,
            norm_order=norm_order, batch_invariant=bi,
        )  # fmt: skip
        if ring is not None and decode:
            assert cache_slots is not None
            _write_out(kv, positions, cache_slots, cache_kv=ring.kv, cache_pos=ring.pos)
        elif paged is not None and decode:
            assert slot_mapping is not None
            paged._write(kv, positions, slot_mapping)
        return kv

    # At decode the kv path (its norm + RoPE and the cache write, two small launches) runs on a
    # side stream beside the q path (q_norm, wq_b, q's norm + RoPE): it only needs the kv rows,
    # and only the attention reads what it writes, so the attention waits for it.  Captured,
    # the fork and join are graph edges; the values are the same.  Memory: the kv rows were
    # allocated on this stream, so they are held (kv_in) until the join; freed earlier, the
    # caching allocator would hand their block to the q path's next output while the side
    # stream still reads it.  What the side stream allocates is read there only.
    side = _kv_side_stream(dev) if decode and (ring is not None or paged is not None) else None
    if side is not None:
        cur = torch.cuda.current_stream(dev)
        side.wait_stream(cur)
        kv_in = kv
        with torch.cuda.stream(side):
            kv = kv_path(kv_in)
    qr = rms_norm(qr, pack.q_norm, eps, order=norm_order, batch_invariant=bi)
    q = linear(qr, pack.wq_b, act_quant=act_quant, batch_invariant=bi).view(T, H, Dh)
    q = q_head_norm_rope(q, positions, freqs, eps=eps, rope_dim=Dr, batch_invariant=bi)
    if side is not None:
        cur.wait_stream(side)
        del kv_in  # from here its block's reuse follows the side stream's reads
    else:
        kv = kv_path(kv)

    if ring is not None and decode:
        # decode against the rings: each row written into its ring (kv_path), then attend
        assert cache_slots is not None
        o = _cache_call(
            q,
            positions,
            ring.kv,
            ring.pos,
            cache_slots,
            pack.attn_sink,
            W,
            Dh**-0.5,
            bi,
            None,
            "auto",
            None,
            check_values=False,
        )  # fmt: skip  (T, H, Dh)
    elif ring is not None:
        assert cache_slots is not None
        if device_offsets:  # no host read: the plan from the device offsets
            assert query_start_loc is not None and seq_flags is not None
            ring_plan = _device_ring_plan(positions, query_start_loc, ring, cache_slots, seq_flags)
        o = _ring_prefill(
            q, kv, positions, lens, ring, cache_slots, pack.attn_sink, bi, ring_plan
        )  # fmt: skip
    elif paged is not None:
        # write every new row at its slot, then attend each row through its sequence's table
        assert block_table is not None and slot_mapping is not None
        table = block_table
        if not decode:  # one table row per query row (lens are host ints: eager only)
            table = block_table.repeat_interleave(device_ints(lens, dev), dim=0, output_size=T)
            paged._write(kv, positions, slot_mapping)  # at decode: kv_path wrote them
        o = _paged_call(
            q, positions, paged.kv, paged.pos, table, pack.attn_sink, W, Dh**-0.5, bi, None,
            "auto", None, check_values=False,
        )  # fmt: skip
    else:
        o = _host_cache_core(q, kv, positions, lens, host, pack.attn_sink, W, bi, dev)

    # output path: undo the values' rotation (query position), grouped wo_a, wo_b.  In place
    # (out= the view: no copy back into o, one elementwise launch fewer), except under
    # torch.compile: dynamo refuses a strided out=, so the copy stays there.
    if torch.compiler.is_compiling() or not INVERSE_ROPE_IN_PLACE:
        o[..., Dn:] = apply_rope(o[..., Dn:], positions, freqs, inverse=True, batch_invariant=bi)
    else:
        o_rope = o[..., Dn:]  # (T, H, rope_dim), rows Dh apart
        apply_rope(o_rope, positions, freqs, inverse=True, batch_invariant=bi, out=o_rope)
    z = grouped_linear(o.view(T, G, (H // G) * Dh), pack.wo_a, batch_invariant=bi)  # (T, G, Ro)
    z = z.view(T, G * config.o_lora_rank)
    return linear(z, pack.wo_b, act_quant=act_quant, batch_invariant=bi, out=out)


def _host_cache_core(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    lens: list[int],
    kv_cache: Sequence[KVCache] | None,
    attn_sink: torch.Tensor,
    W: int,
    bi: bool,
    dev: torch.device,
) -> torch.Tensor:
    """Every sequence's window in one varlen launch: its host-cached rows, then its new ones;
    then the host caches extended."""
    Dh = q.shape[2]
    bounds = [0, *itertools.accumulate(lens)]
    if kv_cache is None:
        keys, key_pos, k_lens = kv, positions, lens
    else:
        parts = [
            kv_cache[b].keys(kv[bounds[b] : bounds[b + 1]], positions[bounds[b] : bounds[b + 1]])
            if n
            else (kv[:0], positions[:0])
            for b, n in enumerate(lens)
        ]
        keys = torch.cat([k for k, _ in parts]) if parts else kv
        key_pos = torch.cat([p.to(positions.dtype) for _, p in parts]) if parts else positions
        k_lens = [int(k.shape[0]) for k, _ in parts]
    cu_q = device_ints(bounds, dev, torch.int32)
    cu_k = device_ints([0, *itertools.accumulate(k_lens)], dev, torch.int32)
    # Without caches the keys are the rows whose positions _check_sequences has checked: the
    # launch need not read them again (a host sync); cached rows come from the caller's objects.
    o = _call(
        "sink_attention_varlen", q, positions, keys.contiguous(), key_pos, attn_sink,
        (cu_q, cu_k), W, Dh**-0.5, bi, None, "auto", None, check_values=kv_cache is not None,
    )  # fmt: skip
    if kv_cache is not None:
        for b in range(len(lens)):
            rows = slice(bounds[b], bounds[b + 1])
            kv_cache[b].append(kv[rows], positions[rows])
    return o
