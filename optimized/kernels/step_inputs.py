"""A captured step's inputs copied into its graph's static buffers in one launch.

A CUDA graph reads its inputs from the addresses it was captured with, so ``DecodeGraphs.step``
and ``PrefillGraphs.step`` (optimized/mtp.py) first copy the caller's tensors into static
buffers and fill the padding rows of the bucket.  As separate torch ops that is up to ten
launches (five copies, five fills), 10-25 us of host time each, during which the GPU waits for
the replay.  One launch does it all here: 28-105 us less per decode ``step`` and 38-124 us
less per prefill ``step`` on the H200 (bench/results/mtp-h200.md, "What changed").

``stage_inputs_kernel``: grid (max(b, S),); program r, for r < b (the bucket's rows), copies
row r of the caller's ids, positions and prev_hidden (H values, in BLOCK_H pieces) when r < T
and writes zeros when r >= T (padding), and writes ``real[r] = r < T``; for r < S (the slot
entries: one per row in a decode step, ``max_seqs + 1`` sequences in a prefill) it writes
``slots[r]`` = the caller's slot r when r < B, else -1.  ids, positions and slots are stored as
int64 whatever the caller's integer type.

Shapes: ids_in, pos_in (T,), slots_in (B,) int32 / int64 with any stride; prev_in (T, H) with
unit stride along H; ids, pos (>= b,) int64, prev (>= b, H) contiguous, real (>= b,) bool,
slots (>= S,) int64.  Bytes: (T + b) * H * itemsize (T rows in, b rows out), about
2 * 8 * (b + S) of scalars.  T = 0 and B = 0 (an empty decode step) load nothing.

The int arguments T, B, b and S change from call to call and are not specialized on (Triton
would compile a variant for a value of 1 or a multiple of 16 the first time one came up, in
the middle of serving).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._launch import next_pow2, triton_launch
from .moe_common import jit_loop_bounds

__all__ = ["stage_inputs_triton"]

# prev_hidden values per loop step (V4-Flash's 16384-value row in two steps at 8 warps).
_BLOCK_H = 8192


@jit_loop_bounds("H", do_not_specialize=("T", "B", "b", "S"))
def stage_inputs_kernel(
    ids_in,
    pos_in,
    prev_in,
    slots_in,
    ids,
    pos,
    prev,
    real,
    slots,
    T,
    B,
    b,
    S,
    H,
    s_ids,
    s_pos,
    s_prev,
    s_slots,
    BLOCK_H: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    if r < b:
        live = r < T
        row = tl.where(live, r, 0)
        token = tl.load(ids_in + row * s_ids, mask=live, other=0).to(tl.int64)
        p = tl.load(pos_in + row * s_pos, mask=live, other=0).to(tl.int64)
        tl.store(ids + r, tl.where(live, token, 0))
        tl.store(pos + r, tl.where(live, p, 0))
        tl.store(real + r, live)
        offs = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            m = h0 + offs < H
            x = tl.load(prev_in + row * s_prev + h0 + offs, mask=m & live, other=0.0)
            tl.store(prev + r * H + h0 + offs, x, mask=m)
    if r < S:
        has = r < B
        slot = tl.load(slots_in + tl.where(has, r, 0) * s_slots, mask=has, other=0).to(tl.int64)
        tl.store(slots + r, tl.where(has, slot, -1))


def stage_inputs_triton(
    ids_in: torch.Tensor,
    pos_in: torch.Tensor,
    prev_in: torch.Tensor,
    slots_in: torch.Tensor,
    ids: torch.Tensor,
    pos: torch.Tensor,
    prev: torch.Tensor,
    real: torch.Tensor,
    slots: torch.Tensor,
    b: int,
    S: int,
) -> None:
    """Copy T = len(ids_in) rows and B = len(slots_in) slots into the static buffers, padding
    rows T..b-1 and slot entries B..S-1 (module doc).  The caller checked shapes, dtypes and
    devices (``_check_step_inputs``), and b >= T, S >= B (T or B may be 0)."""
    T, H = prev_in.shape
    if prev_in.stride(1) != 1:
        prev_in = prev_in.contiguous()
    block_h = min(_BLOCK_H, next_pow2(H))
    launch = triton_launch(
        stage_inputs_kernel, BLOCK_H=block_h, num_warps=8 if block_h > 2048 else 4
    )
    launch(
        (max(b, S),), ids_in, pos_in, prev_in, slots_in, ids, pos, prev, real, slots,
        T, slots_in.shape[0], b, S, H, ids_in.stride(0), pos_in.stride(0), prev_in.stride(0),
        slots_in.stride(0),
    )  # fmt: skip
