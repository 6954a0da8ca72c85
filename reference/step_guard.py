"""The decode step's input guard (docs/semantics.md, "The decode step's input guard").

A captured decode step cannot raise: its inputs are checked on the device.  A row is ok when it
is real (not a bucket's filler), its prev_hidden row is finite and its id and position are in
range; a row that is not ok runs as filler (id 0, position 0, slot -1: no KV read or written,
no routed expert).  A real row that is not ok is bad, with reason 1 (non-finite prev_hidden),
else 2 (id out of range), else 3 (position out of range); the record holds ``row * 4 + reason``
of the lowest bad row, or :data:`NO_BAD_ROW` when there is none.
"""

from __future__ import annotations

import torch

from dsv4mtp.checks import check_dtype, check_int, check_shape

__all__ = ["NO_BAD_ROW", "REASONS", "step_guard"]

#: The record's value when no row is bad: the identity of min (a later step lowers it).
NO_BAD_ROW = torch.iinfo(torch.int64).max

#: The bad-row reasons, by code.
REASONS = {1: "non-finite prev_hidden", 2: "id out of range", 3: "position out of range"}


def step_guard(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    vocab_size: int,
    max_positions: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (ok (B,) bool, ids (B,) int64, positions (B,) int64, slots (B,) int64, record (1,)
    int64).

    input_ids, positions, slots: (B,) int64; prev_hidden: (B, H) float; real: (B,) bool.
    ok = real & all(isfinite(prev_hidden row)) & 0 <= id < vocab_size & 0 <= position <
    max_positions; ids / positions are the inputs where ok, else 0; slots the input where ok,
    else -1; record: ``row * 4 + reason`` of the lowest real row that is not ok, else
    :data:`NO_BAD_ROW`.
    """
    _check(input_ids, positions, prev_hidden, slots, real, vocab_size, max_positions)
    finite = torch.isfinite(prev_hidden).all(-1)  # (B,)
    id_ok = (input_ids >= 0) & (input_ids < vocab_size)  # (B,)
    pos_ok = (positions >= 0) & (positions < max_positions)  # (B,)
    ok = real & finite & id_ok & pos_ok  # (B,)
    reason = torch.where(~finite, 1, torch.where(~id_ok, 2, 3))  # (B,)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)  # (B,)
    keys = torch.where(real & ~ok, rows * 4 + reason, NO_BAD_ROW)  # (B,)
    none = torch.full((1,), NO_BAD_ROW, dtype=torch.int64, device=input_ids.device)
    record = torch.cat([keys, none]).min().reshape(1)  # (1,)
    return (
        ok,
        torch.where(ok, input_ids, 0),
        torch.where(ok, positions, 0),
        torch.where(ok, slots, -1),
        record,
    )


def _check(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    vocab_size: int,
    max_positions: int,
) -> None:
    check_dtype("input_ids", input_ids, (torch.int64,))
    check_shape("input_ids", input_ids, (None,))
    B = input_ids.shape[0]
    check_dtype("positions", positions, (torch.int64,))
    check_shape("positions", positions, (B,))
    check_dtype(
        "prev_hidden", prev_hidden, (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    )
    check_shape("prev_hidden", prev_hidden, (B, None))
    check_dtype("slots", slots, (torch.int64,))
    check_shape("slots", slots, (B,))
    check_dtype("real", real, (torch.bool,))
    check_shape("real", real, (B,))
    check_int("vocab_size", vocab_size, 1)
    check_int("max_positions", max_positions, 1)
