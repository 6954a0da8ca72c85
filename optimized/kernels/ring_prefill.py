"""The index and the keys of a prefill against the device ring cache, in two launches.

A prefill of B sequences against a :class:`~dsv4mtp.optimized.kv_cache.DeviceKVCache` attends
each sequence's visible cached rows in position order, then its new rows, through one varlen
launch (docs/semantics.md, "The device ring cache").  Built from tensor ops, that key list
takes some seventy small ops, each a dispatch and a launch on the host: about 2 ms of a 512-token
eager prefill on the H200's host, where the attention's kernels take 0.2 ms
(bench/results/mtp-h200.md, "Prefill host time").  Here it is two kernels and one host read of
3 x B ints.

``ring_index_kernel``, grid (B,), program b (C ring rows, ``BLOCK_C`` = next power of two):

* the checks of the reference, as one flag: the slot below S and not repeated by an earlier
  sequence (negative: padding, unchecked), the rows' positions in [0, 2^31) and rising, the
  first past the ring's newest row;
* the ring rows visible to the sequence's first row (``p >= 0`` and ``p > first - window``),
  ranked by (position, ring row) with a ``BLOCK_C`` x ``BLOCK_C`` comparison in
  ``BLOCK_I``-row slices (C is the window plus the draft rows rounded up to 16, 144 at V4-Flash:
  256 x 256 lanes per program); ``order[b, r]``
  is the ring row of rank r and ``key_pos[b, r]`` its position; a flag when two visible rows
  hold one position (the keys would not rise: the varlen launch then checks them);
* ``stats[b] = (seen, key rows, flags)``: visible rows (0 unless live), seen + new rows for a
  live sequence (0 otherwise), bit 0 a failed check, bit 1 a repeated position.  ``KILL``
  (runtime): the flags that make a sequence dead, as a padding one (no keys, no ring write,
  output zero).  The eager prefill passes 0: it reads the flags on the host and raises before
  any key is built.  The device-offset prefill (``attention(query_start_loc=...)``), which
  never reads the host, passes 3: a sequence that fails a check, or whose ring repeats a
  position (its keys would not rise, and no launch may check them on the host), reads and
  writes nothing, and the caller reads the flags later.

``ring_keys_kernel``, grid (B, row blocks): sequence b's key rows ``[cu_k[b], cu_k[b+1])``,
the visible ring rows by rank then the new rows, each ``Dh`` wide (1 KiB in bf16 at Dh 512),
with their positions; and ``owners`` (T,): the ring each new row is written to, its sequence's
slot for the last C positions of a live sequence (earlier ones would be overwritten by the same
call), -1 otherwise.  Bytes: the keys twice (read, written) plus the index, 2 x Tk x Dh x 2 B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, next_pow2, triton_launch
from .moe_common import jit_loop_bounds

__all__ = ["ring_index_triton", "ring_keys_triton"]

BLOCK_I = 16  # ring rows compared per slice of the rank computation
BLOCK_T = 512  # new rows checked per loop step
BLOCK_B = 64  # other sequences' slots compared per loop step
BLOCK_R = 16  # key rows per program of the keys kernel


@triton.jit
def _any(mask):
    return tl.max(mask.to(tl.int32), axis=0) > 0


@jit_loop_bounds("B", "MAX_N")
def ring_index_kernel(
    pos_ptr,
    cu_q_ptr,
    slot_ptr,
    cpos_ptr,
    order_ptr,
    kpos_ptr,
    stats_ptr,
    B,
    MAX_N,
    S,
    C,
    W,
    KILL,
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_q_ptr + b).to(tl.int64)
    n = tl.load(cu_q_ptr + b + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + b).to(tl.int64)
    used = slot >= 0
    ring = tl.minimum(tl.maximum(slot, 0), S - 1)
    bad = used & (slot >= S)
    # distinct slots: a used slot that an earlier sequence names too
    for b0 in range(0, B, BLOCK_B):
        ob = b0 + tl.arange(0, BLOCK_B)
        other = tl.load(slot_ptr + ob, mask=ob < b, other=-1).to(tl.int64)
        bad = bad | (used & _any((ob < b) & (other == slot)))
    # the new rows: positions in [0, 2^31), strictly rising
    for t0 in range(0, MAX_N, BLOCK_T):
        i = t0 + tl.arange(0, BLOCK_T)
        m = i < n
        p = tl.load(pos_ptr + start + i, mask=m, other=0).to(tl.int64)
        prev = tl.load(pos_ptr + start + i - 1, mask=m & (i > 0), other=-1).to(tl.int64)
        wrong = (p < 0) | (p >= 2**31) | ((i > 0) & (p <= prev))
        bad = bad | (used & _any(m & wrong))
    live = used & (n > 0)
    first = tl.load(pos_ptr + start, mask=n > 0, other=0).to(tl.int64)
    j = tl.arange(0, BLOCK_C)
    jm = j < C
    rp = tl.load(cpos_ptr + ring * C + j, mask=jm, other=-1).to(tl.int64)
    newest = tl.max(rp, axis=0)
    bad = bad | (live & (newest >= 0) & (first <= newest))
    vis = jm & (rp >= 0) & (rp > first - W) & live
    # rank of each visible row by (position, ring row); a repeated position among them
    rank = tl.zeros([BLOCK_C], dtype=tl.int32)
    dup = live & False
    for i0 in range(0, BLOCK_C, BLOCK_I):
        ii = i0 + tl.arange(0, BLOCK_I)
        ri = tl.load(cpos_ptr + ring * C + ii, mask=ii < C, other=-1).to(tl.int64)
        vi = (ii < C) & (ri >= 0) & (ri > first - W) & live
        lower = (ri[:, None] < rp[None, :]) | (
            (ri[:, None] == rp[None, :]) & (ii[:, None] < j[None, :])
        )
        rank += tl.sum((vi[:, None] & lower).to(tl.int32), axis=0)
        same = (ri[:, None] == rp[None, :]) & (ii[:, None] != j[None, :])
        dup = dup | _any(tl.reshape(vi[:, None] & vis[None, :] & same, [BLOCK_I * BLOCK_C]))
    flags = bad.to(tl.int64) | (dup.to(tl.int64) << 1)
    live = live & ((flags & KILL) == 0)
    seen = tl.where(live, tl.sum(vis.to(tl.int64), axis=0), 0)
    tl.store(order_ptr + b * C + rank, j, mask=vis)
    tl.store(kpos_ptr + b * C + rank, rp, mask=vis)
    tl.store(stats_ptr + b * 3, seen)
    tl.store(stats_ptr + b * 3 + 1, tl.where(live, seen + n, 0))
    tl.store(stats_ptr + b * 3 + 2, flags)


@triton.jit
def ring_keys_kernel(
    kv_ptr,
    pos_ptr,
    cu_q_ptr,
    cu_k_ptr,
    slot_ptr,
    order_ptr,
    kpos_ptr,
    stats_ptr,
    cache_kv_ptr,
    keys_ptr,
    keys_pos_ptr,
    owners_ptr,
    S,
    C,
    DH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    start = tl.load(cu_q_ptr + b).to(tl.int64)
    n = tl.load(cu_q_ptr + b + 1).to(tl.int64) - start
    k0 = tl.load(cu_k_ptr + b).to(tl.int64)
    rows = tl.load(cu_k_ptr + b + 1).to(tl.int64) - k0  # 0 unless live
    seen = tl.load(stats_ptr + b * 3)
    ring = tl.minimum(tl.maximum(tl.load(slot_ptr + b).to(tl.int64), 0), S - 1)
    # key rows: the visible ring rows by rank, then the new rows
    km = r < rows
    cached = km & (r < seen)
    new = km & (r >= seen)
    t = start + r - seen
    src = tl.load(order_ptr + b * C + r, mask=cached, other=0).to(tl.int64)
    kp = tl.where(
        cached,
        tl.load(kpos_ptr + b * C + r, mask=cached, other=0),
        tl.load(pos_ptr + t, mask=new, other=0).to(tl.int64),
    )
    tl.store(keys_pos_ptr + k0 + r, kp, mask=km)
    for d0 in tl.static_range(0, DH, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < DH
        from_ring = tl.load(
            cache_kv_ptr + (ring * C + src)[:, None] * DH + d[None, :],
            mask=cached[:, None] & dm[None, :],
        )
        from_new = tl.load(kv_ptr + t[:, None] * DH + d[None, :], mask=new[:, None] & dm[None, :])
        tl.store(
            keys_ptr + (k0 + r)[:, None] * DH + d[None, :],
            tl.where(cached[:, None], from_ring, from_new),
            mask=km[:, None] & dm[None, :],
        )
    # the ring each new row is written to (-1: none)
    rm = r < n
    p = tl.load(pos_ptr + start + r, mask=rm, other=0).to(tl.int64)
    last = tl.load(pos_ptr + start + n - 1, mask=n > 0, other=0).to(tl.int64)
    owner = tl.where((rows > 0) & (p > last - C), ring, -1)
    tl.store(owners_ptr + start + r, owner.to(tl.int32), mask=rm)


def ring_index_triton(
    positions: torch.Tensor,
    cu_q: torch.Tensor,
    slots: torch.Tensor,
    cache_pos: torch.Tensor,
    window: int,
    max_n: int,
    kill: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions (T,) int, cu_q (B+1,) int32 row offsets, slots (B,) int, cache_pos (S, C)
    int32, ``max_n`` the most rows of one sequence (an upper bound will do: the loop stops at
    each sequence's own length), ``kill`` the flags that make a sequence dead -> (order (B, C)
    int32, key_pos (B, C) int64, stats (B, 3) int64); see the module doc.  Entries of order /
    key_pos past a sequence's ``seen`` are not written."""
    B = slots.shape[0]
    S, C = cache_pos.shape
    dev = positions.device
    order = torch.empty((B, C), dtype=torch.int32, device=dev)
    key_pos = torch.empty((B, C), dtype=torch.int64, device=dev)
    stats = torch.empty((B, 3), dtype=torch.int64, device=dev)
    if B:
        launch = triton_launch(
            ring_index_kernel, BLOCK_C=next_pow2(C), BLOCK_I=BLOCK_I, BLOCK_T=BLOCK_T,
            BLOCK_B=BLOCK_B, num_warps=4, num_stages=1,
        )  # fmt: skip
        launch(
            (B,), positions, cu_q, slots, cache_pos, order, key_pos, stats, B, max_n, S, C,
            window, kill,
        )  # fmt: skip
    return order, key_pos, stats


def ring_keys_triton(
    kv: torch.Tensor,
    positions: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    slots: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cache_kv: torch.Tensor,
    num_keys: int,
    max_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (keys (num_keys, Dh) in kv's dtype, their positions (num_keys,) int64, owners (T,)
    int32); ``index``: :func:`ring_index_triton`'s result, cu_k (B+1,) int32 the key offsets,
    ``max_rows`` the most key rows or new rows of one sequence (the grid covers both, so
    every row of ``owners`` is written)."""
    T, Dh = kv.shape
    S, C = cache_kv.shape[:2]
    dev = kv.device
    keys = kv.new_empty((num_keys, Dh))
    keys_pos = torch.empty(num_keys, dtype=torch.int64, device=dev)
    owners = torch.empty(T, dtype=torch.int32, device=dev)  # every row: rows <= max_rows
    order, key_pos, stats = index
    B = slots.shape[0]
    if B and max_rows:
        launch = triton_launch(
            ring_keys_kernel, DH=Dh, BLOCK_D=min(512, next_pow2(Dh)), BLOCK_R=BLOCK_R,
            num_warps=4, num_stages=1,
        )  # fmt: skip
        launch(
            (B, cdiv(max_rows, BLOCK_R)), kv, positions, cu_q, cu_k, slots, order, key_pos,
            stats, cache_kv, keys, keys_pos, owners, S, C,
        )  # fmt: skip
    return keys, keys_pos, owners
