"""The decode step's input guard on the H200: one Triton launch.

Same math as :mod:`dsv4mtp.reference.step_guard` (docs/semantics.md, "The decode step's input
guard").  :class:`~dsv4mtp.optimized.mtp.DecodeGraphs` runs it at the head of its captured step:
it replaces ~20 graph nodes of tiny torch kernels (isfinite, all, the range compares, their
ands, the masked where's, the first-bad-row argmax / gather / cat and the record's copy), each
~1.3 us of launch gap plus ~1-1.5 us of kernel on the H200, with one kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4mtp.checks import check_dtype, check_instance, check_int, check_shape
from dsv4mtp.errors import InputError

from . import _ops  # noqa: F401  (defines the torch.ops.dsv4mtp operators)
from ._dispatch import PLANS, remember
from .kernels._launch import check_device, check_kernel_dtype, check_out

__all__ = ["NO_BAD_ROW", "step_guard"]

_ops_step_guard = torch.ops.dsv4mtp.step_guard.default
_ops_step_guard_out = torch.ops.dsv4mtp.step_guard_out.default

#: The record's value when no row is bad: the identity of min (a later call lowers it).
NO_BAD_ROW = torch.iinfo(torch.int64).max

_Outs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def step_guard(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    vocab_size: int,
    max_positions: int,
    *,
    batch_invariant: bool = False,
    out: _Outs | None = None,
) -> _Outs:
    """Check a decode step's rows on the device -> ``(ok, ids, positions, slots, record)``.

    input_ids, positions, slots: (B,) int64; prev_hidden: (B, H) bf16 / fp32 (H = hc_mult * D,
    unit stride along H); real: (B,) bool (False: a bucket's filler row).

    * ok (B,) bool: ``real & all(isfinite(prev_hidden row)) & 0 <= id < vocab_size &
      0 <= position < max_positions``;
    * ids, positions (B,) int64: the inputs where ok, else 0; slots (B,) int64: the input where
      ok, else -1;
    * record (1,) int64: ``row * 4 + reason`` of the lowest real row that is not ok (reason 1
      non-finite prev_hidden, else 2 id out of range, else 3 position out of range), or
      :data:`NO_BAD_ROW` (int64 max) when there is none.

    ``out``: a 5-tuple of contiguous tensors of those shapes and dtypes.  The first four are
    overwritten; the record is *lowered*: it ends as ``min(record, this call's key)``, so a
    persistent record kept across calls (or graph replays) holds the lowest bad row seen since
    it was last set to :data:`NO_BAD_ROW`.  Min does not depend on the order of the atomic
    updates, so the result is deterministic.  Without ``out`` the record is this call's key.

    One launch of kernels/step_guard.py (grid (B,), one program per row; none for B = 0); it
    fuses the finiteness reduction, the range checks, the masking and the record.  Bytes:
    B * H * itemsize of prev_hidden plus ~50 bytes per row.  No host read: CUDA-graph
    capturable with ``out``.  Every row is computed by its own program, so every schedule is
    batch invariant; ``batch_invariant`` is accepted for the ops' common signature.
    """
    key: tuple[object, ...] | None = None
    plan: tuple[Any, ...] | None = None
    if not torch.compiler.is_compiling():
        try:
            key = (
                "step_guard",
                *[(t.__class__, t.dtype, t.shape, t.device, t.stride())
                  for t in (input_ids, positions, prev_hidden, slots, real)],
                vocab_size.__class__, vocab_size, max_positions.__class__, max_positions,
                batch_invariant.__class__, batch_invariant,
                None if out is None else (out.__class__, *[
                    (o.__class__, o.shape, o.dtype, o.device, o.is_contiguous()) for o in out
                ]),
            )  # fmt: skip
            plan = PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
            key = None
    if plan is None:
        plan = _step_guard_plan(
            input_ids, positions, prev_hidden, slots, real, vocab_size, max_positions,
            batch_invariant, out,
        )  # fmt: skip
        if key is not None:
            remember(key, plan)
    args = (input_ids, positions, prev_hidden, slots, real)
    if out is None:
        record = torch.full((1,), NO_BAD_ROW, dtype=torch.int64, device=input_ids.device)
        return _ops_step_guard(*args, record, vocab_size, max_positions)  # type: ignore[no-any-return]
    ok, ids, pos, slot, rec = out
    _ops_step_guard_out(
        *args, vocab_size, max_positions,
        ok=ok, ids_out=ids, positions_out=pos, slots_out=slot, record=rec,
    )  # fmt: skip
    return ok, ids, pos, slot, rec


def _step_guard_plan(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    vocab_size: int,
    max_positions: int,
    batch_invariant: bool,
    out: _Outs | None,
) -> tuple[()]:
    """Every check of step_guard's arguments (metadata only: no host sync)."""
    check_dtype("input_ids", input_ids, (torch.int64,))
    check_shape("input_ids", input_ids, (None,))
    B = input_ids.shape[0]
    check_dtype("positions", positions, (torch.int64,))
    check_shape("positions", positions, (B,))
    check_kernel_dtype("prev_hidden", prev_hidden)
    check_shape("prev_hidden", prev_hidden, (B, None))
    check_dtype("slots", slots, (torch.int64,))
    check_shape("slots", slots, (B,))
    check_dtype("real", real, (torch.bool,))
    check_shape("real", real, (B,))
    check_int("vocab_size", vocab_size, 1)
    check_int("max_positions", max_positions, 1)
    check_instance("batch_invariant", batch_invariant, bool)
    dev = check_device(
        [("input_ids", input_ids), ("positions", positions), ("prev_hidden", prev_hidden),
         ("slots", slots), ("real", real)]
    )  # fmt: skip
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 5:
            raise InputError("out: expected a 5-tuple (ok, ids, positions, slots, record)")
        want = ((B,), torch.bool), ((B,), torch.int64), ((B,), torch.int64), ((B,), torch.int64)
        for i, (o, (shape, dt)) in enumerate(zip(out, (*want, ((1,), torch.int64)), strict=True)):
            check_out(f"out[{i}]", o, shape, dt, dev)
    return ()
