"""The decode step's input guard in one launch (docs/semantics.md, "The decode step's input
guard").

One program per row b of the step: it reads the row's id, position, slot and ``real`` flag and
its prev_hidden (H values, in BLOCK_H pieces), writes ``ok[b]`` and the masked id, position and
slot, and, for a real row that is not ok, lowers the record to ``b * 4 + reason`` with an
atomic min.  Min is order-independent, so the record does not depend on which program runs
first; every other write belongs to one program, so the kernel is batch invariant.

The kernel heads the captured decode step, so every other kernel waits for it: it is built for
latency.  The four scalar loads are issued first, and V4's whole row (H = hc_mult * D: 16384 /
28672) is one piece of BLOCK_H = next_pow2(H) over 16 warps, so the program waits for memory
once.  A loop over 4096-wide pieces (its bound H is a runtime value) would wait once per piece,
and scalars loaded after it once more: five dependent round trips at V4-Flash's 16384 in the
sm_90 SASS.  Rows past 32768 values loop over 32768-wide pieces.

Shapes: ids, positions, slots (B,) int64; real and ok (B,) bool; prev_hidden (B, H) bf16 / fp32
with unit stride along H (rows ``stride`` apart); record (1,) int64.  Bytes: B * H * itemsize
read from prev_hidden, B * (3 * 8 + 1) read and B * (3 * 8 + 1) written, one 8-byte atomic per
bad real row.  Grid (B,).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._launch import TritonLaunch, next_pow2, triton_launch
from .moe_common import jit_loop_bounds

__all__ = ["guard_schedule", "step_guard_triton"]

# Elements of prev_hidden per loop step: up to 32768 (V4-Pro's 28672 in one step: 64 values
# per thread at 16 warps, 32 at V4-Flash's 16384).
_MAX_BLOCK_H = 32768


def guard_schedule(H: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for rows of H values: the whole row in one piece up to
    ``_MAX_BLOCK_H``, BLOCK_H / 1024 warps clamped to 4..16 (16 at V4's rows: 32 / 64 values
    per thread)."""
    block_h = min(_MAX_BLOCK_H, next_pow2(H))
    return block_h, max(4, min(16, block_h // 1024))


@jit_loop_bounds("H")
def step_guard_kernel(
    ids_ptr,
    pos_ptr,
    prev_ptr,
    slots_ptr,
    real_ptr,
    ok_ptr,
    ids_out_ptr,
    pos_out_ptr,
    slots_out_ptr,
    record_ptr,
    H,
    stride,
    vocab_size,
    max_positions,
    BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    # the scalars first: their loads are in flight while the row's are issued
    real = tl.load(real_ptr + b) != 0
    token = tl.load(ids_ptr + b)
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slots_ptr + b)
    offs = tl.arange(0, BLOCK_H)
    row = prev_ptr + b * stride
    # 1 where a value is NaN or +-inf (|x| < inf is false for both); masked lanes read 0
    nonfinite = tl.zeros([BLOCK_H], dtype=tl.int32)
    for h0 in range(0, H, BLOCK_H):
        x = tl.load(row + h0 + offs, mask=h0 + offs < H, other=0.0).to(tl.float32)
        nonfinite = nonfinite | (tl.abs(x) < float("inf")).to(tl.int32) ^ 1
    finite = tl.max(nonfinite, 0) == 0
    id_ok = (token >= 0) & (token < vocab_size)
    pos_ok = (pos >= 0) & (pos < max_positions)
    ok = real & finite & id_ok & pos_ok
    tl.store(ok_ptr + b, ok)
    tl.store(ids_out_ptr + b, tl.where(ok, token, 0))
    tl.store(pos_out_ptr + b, tl.where(ok, pos, 0))
    tl.store(slots_out_ptr + b, tl.where(ok, slot, -1))
    reason = tl.where(finite, tl.where(id_ok, 3, 2), 1).to(tl.int64)
    tl.atomic_min(record_ptr, b * 4 + reason, mask=real & (ok == 0))


_LAUNCHES: dict[tuple[int, int], TritonLaunch] = {}


def step_guard_triton(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    vocab_size: int,
    max_positions: int,
    ok: torch.Tensor,
    ids_out: torch.Tensor,
    pos_out: torch.Tensor,
    slots_out: torch.Tensor,
    record: torch.Tensor,
) -> None:
    """Launch :func:`step_guard_kernel` (validated by the caller: 1-D tensors contiguous,
    prev_hidden with unit stride along H; the outputs and the record written in place)."""
    B, H = prev_hidden.shape
    if B == 0:
        return
    key = guard_schedule(H)
    launch = _LAUNCHES.get(key)
    if launch is None:
        block_h, warps = key
        launch = _LAUNCHES[key] = triton_launch(step_guard_kernel, BLOCK_H=block_h, num_warps=warps)
    launch(
        (B,), input_ids, positions, prev_hidden, slots, real, ok, ids_out, pos_out, slots_out,
        record, H, prev_hidden.stride(0), vocab_size, max_positions,
    )  # fmt: skip
