"""The MTP layer's attention core on the H200: sliding-window MQA with per-head sinks.

Same signatures as :func:`dsv4mtp.reference.sink_attention` and
:func:`dsv4mtp.reference.sink_attention_varlen` plus keyword-only ``backend`` and ``schedule``.
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
from typing import Any, Literal

import torch

from dsv4mtp.checks import (
    check_instance,
    check_int,
    check_number,
    check_positions,
    check_shape,
)
from dsv4mtp.errors import InputError

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from ._dispatch import PLANS, Facts, remember, select
from .kernels._launch import check_device, check_kernel_dtype, check_out

__all__ = ["sink_attention", "sink_attention_varlen"]

AttentionBackend = Literal["auto", "triton"]

_ops_attn = torch.ops.dsv4mtp.sink_attention.default
_ops_attn_out = torch.ops.dsv4mtp.sink_attention_out.default
_ops_varlen = torch.ops.dsv4mtp.sink_attention_varlen.default
_ops_varlen_out = torch.ops.dsv4mtp.sink_attention_varlen_out.default


def _tensor_key(t: Any) -> tuple[object, ...]:
    return (t.__class__, t.dtype, t.shape, t.device)


def _schedule_fields(schedule: object, H: int, Dh: int) -> list[int]:
    if schedule is None:
        return []
    from .kernels.sink_attention import AttentionSchedule

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
    return choice, _schedule_fields(schedule, H, Dh)


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
) -> torch.Tensor:
    # The plan of this call signature (optimized/_dispatch.py, "plans"): the metadata checks run
    # once per signature.  While torch.compile traces, they run every time and become its guards.
    key: tuple[object, ...] | None = None
    plan: tuple[Any, ...] | None = None
    if not torch.compiler.is_compiling():
        try:
            key = (
                op, _tensor_key(q), _tensor_key(q_pos), _tensor_key(kv), _tensor_key(k_pos),
                _tensor_key(attn_sink),
                None if offsets is None else (_tensor_key(offsets[0]), _tensor_key(offsets[1])),
                window.__class__, window, scale.__class__, scale,
                batch_invariant.__class__, batch_invariant, backend, schedule,
                None if out is None
                else (out.__class__, out.shape, out.dtype, out.device, out.is_contiguous()),
            )  # fmt: skip
            plan = PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
            key = None
    if plan is None:
        plan = _plan(
            op, q, q_pos, kv, k_pos, attn_sink, offsets, window, scale, batch_invariant, out,
            backend, schedule,
        )  # fmt: skip
        if key is not None:
            remember(key, plan)
    choice, fields = plan
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
    by H, Dh and the window.  Every schedule is batch invariant (a row's reduction order depends
    on its own keys only), so ``batch_invariant=True`` changes nothing.
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
