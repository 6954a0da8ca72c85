"""Token -> expert sort and block alignment on the device (no host sync, CUDA-graph capturable).

Input: topk_ids (T, K) int (global ids, -1 = padding), optional expert_map (E_global,) int32
(global -> local, -1 = not on this rank).  S = T*K slots, slot s = token * K + k.

One program (``moe_align_kernel``), three passes over the slots in chunks of CHUNK:

1. counts per local expert (``tl.histogram`` of the valid slots);
2. every expert's rows padded to whole BLOCK_M blocks; ``block_expert[b]`` = the local expert of
   M block b (-1 for the unused tail of the NB_MAX blocks the grids launch);
3. a stable sort: the slot at chunk position i goes to row offset[e] + (slots of e in earlier
   chunks) + (slots of e earlier in this chunk), found with a CHUNK x CHUNK compare.

Outputs: ``sorted_slot (NB_MAX*BLOCK_M,)`` int32 (the slot of each row, -1 on padding rows),
``block_expert (NB_MAX,)`` int32.  NB_MAX = cdiv(S, BLOCK_M) + min(E_local, S) bounds the padded
block count (every expert wastes less than one block).  Deterministic: rows of an expert keep
slot order.  Slots whose id is -1 or maps to -1 appear nowhere.

Cost: one program (one SM) for the whole call, serial over cdiv(S, CHUNK) chunks in each pass;
the sort pass does a CHUNK x E_local one-hot and a CHUNK x CHUNK compare per chunk (48 K element
ops at CHUNK 128, E 256), the padding pass NB_MAX*BLOCK_M/CHUNK stores.  At V4-Flash (top-6) S
is 6 / 48 / 384 / 3072 / 24576 at T 1 / 8 / 64 / 512 / 4096: one chunk up to T 16, 192 chunks
(~9 M element ops on one SM, a few hundred us) at T 4096; bench/diag/moe_sweep.py times it
alone.  ``chunk`` and ``num_warps`` are schedule knobs (MoESchedule.align_chunk / align_warps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, next_pow2
from .moe_common import jit_loop_bounds

__all__ = ["max_blocks", "moe_align_triton"]


@triton.jit
def _local_ids(ids_ptr, map_ptr, s, S, E_GLOBAL, E_LOCAL, HAS_MAP: tl.constexpr):
    g = tl.load(ids_ptr + s, mask=s < S, other=-1).to(tl.int32)
    ok = (s < S) & (g >= 0) & (g < E_GLOBAL)
    loc = tl.load(map_ptr + g, mask=ok, other=-1).to(tl.int32) if HAS_MAP else g
    ok = ok & (loc >= 0) & (loc < E_LOCAL)
    return tl.where(ok, loc, -1), ok


@jit_loop_bounds("S", "NB_MAX")
def moe_align_kernel(
    ids_ptr,
    map_ptr,
    sorted_ptr,
    block_expert_ptr,
    S,
    E_GLOBAL,
    E_LOCAL,
    NB_MAX,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNK_B: tl.constexpr,
):
    ev = tl.arange(0, BLOCK_E)
    ci = tl.arange(0, CHUNK)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, S, CHUNK):
        loc, ok = _local_ids(ids_ptr, map_ptr, c0 + ci, S, E_GLOBAL, E_LOCAL, HAS_MAP)
        counts += tl.histogram(tl.where(ok, loc, 0), BLOCK_E, mask=ok)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, axis=0)  # inclusive
    blk_start = blk_end - nblk
    used = tl.sum(nblk, axis=0)
    # block -> expert
    bi = tl.arange(0, CHUNK_B)
    for b0 in range(0, NB_MAX, CHUNK_B):
        b = b0 + bi
        e_of_b = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        e_of_b = tl.where(b < used, e_of_b, -1)
        tl.store(block_expert_ptr + b, e_of_b, mask=b < NB_MAX)
    # padding rows first (-1), then the sorted slots
    for r0 in range(0, NB_MAX * BLOCK_M, CHUNK):
        r = r0 + ci
        tl.store(sorted_ptr + r, tl.full((CHUNK,), -1, tl.int32), mask=r < NB_MAX * BLOCK_M)
    tl.debug_barrier()
    row_start = blk_start * BLOCK_M
    seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
    lower = ci[None, :] < ci[:, None]  # (i, j): j earlier than i
    for c0 in range(0, S, CHUNK):
        s = c0 + ci
        loc, ok = _local_ids(ids_ptr, map_ptr, s, S, E_GLOBAL, E_LOCAL, HAS_MAP)
        onehot = (loc[:, None] == ev[None, :]) & ok[:, None]  # (CHUNK, BLOCK_E)
        base = tl.sum(tl.where(onehot, (row_start + seen)[None, :], 0), axis=1)
        same = (loc[:, None] == loc[None, :]) & lower & ok[None, :]
        rank = tl.sum(same.to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, s, mask=ok)
        seen += tl.sum(onehot.to(tl.int32), axis=0)


def max_blocks(S: int, e_local: int, block_m: int) -> int:
    """NB_MAX: the padded M-block count bound for S slots over e_local experts."""
    return triton.cdiv(S, block_m) + min(e_local, S)


def moe_align_triton(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    e_local: int,
    block_m: int,
    *,
    chunk: int = 64 if INTERPRET else 128,
    num_warps: int = 4 if INTERPRET else 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slot (NB_MAX*block_m,) int32, block_expert (NB_MAX,) int32); see the module doc.
    ``chunk``: slots per step of the passes (the sort's compare is chunk x chunk)."""
    S = topk_ids.numel()
    nb = max_blocks(S, e_local, block_m)
    dev = topk_ids.device
    sorted_slot = torch.empty((nb * block_m,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((nb,), dtype=torch.int32, device=dev)
    if nb == 0:
        return sorted_slot, block_expert
    ids = topk_ids.reshape(-1)
    e_global = expert_map.numel() if expert_map is not None else e_local
    moe_align_kernel[(1,)](
        ids, expert_map if expert_map is not None else ids, sorted_slot, block_expert,
        S, e_global, e_local, nb,
        HAS_MAP=expert_map is not None, BLOCK_M=block_m, BLOCK_E=next_pow2(max(e_local, 2)),
        CHUNK=chunk, CHUNK_B=64, num_warps=num_warps,
    )  # fmt: skip
    return sorted_slot, block_expert
