"""A captured step's inputs copied into its graph's static buffers in one launch.

A CUDA graph reads its inputs from the addresses it was captured with, so ``DecodeGraphs.step``
and ``PrefillGraphs.step`` (optimized/mtp.py) first copy the caller's tensors into static
buffers and fill the padding rows of the bucket.  As separate torch ops that is up to ten
launches (five copies, five fills), each 10-25 us of host time on the H200 machine while the
GPU waits for the replay: 0.5-0.8 ms in front of a 2.8 ms prefill replay.  One launch does it
all here.

``stage_inputs_kernel``: grid (max(b, S),); program r, for r < b (the bucket's rows), copies
row r of the caller's ids, positions and prev_hidden (H values, in BLOCK_H pieces) when r < T
and writes zeros when r >= T (padding), and writes ``real[r] = r < T``; for r < S (the slot
entries: one per row in a decode step, ``max_seqs + 1`` sequences in a prefill) it writes
``slots[r]`` = the caller's slot r when r < B, else -1.  ids, positions and slots are stored as
int64 whatever the caller's integer type.

Shapes: ids_in, pos_in (T,), slots_in (B,) int32 / int64 with any stride; prev_in (T, H) with
unit stride along H; ids, pos (>= b,) int64, prev (>= b, H) contiguous, real (>= b,) bool,
slots (>= S,) int64.  Bytes: 2 * b * H * itemsize (the rows in and out, zeros out for
padding), about 2 * 8 * (b + S) of scalars.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._launch import next_pow2, triton_launch
from .moe_common import jit_loop_bounds

__all__ = ["stage_inputs_triton"]

# prev_hidden values per loop step (V4-Flash's 16384-value row in two steps at 8 warps).
_BLOCK_H = 8192


@jit_loop_bounds("H")
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
        token = tl.load(ids_in + row * s_ids).to(tl.int64)
        p = tl.load(pos_in + row * s_pos).to(tl.int64)
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
        slot = tl.load(slots_in + tl.where(has, r, 0) * s_slots).to(tl.int64)
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
    devices (``_check_step_inputs``), and T >= 1, B >= 1, b >= T, S >= B."""
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
