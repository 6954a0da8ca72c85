"""Token -> expert sort and block alignment on the device (no host sync, CUDA-graph capturable).

Input: topk_ids (T, K) int (global ids, -1 = padding), optional expert_map (E_global,) int32
(global -> local, -1 = not on this rank).  S = T*K slots, slot s = token * K + k.

Outputs: ``sorted_slot (NB_MAX*BLOCK_M,)`` int32 (the slot of each row, -1 on padding rows),
``block_expert (NB_MAX,)`` int32 (the local expert of each M block, -1 for the unused tail of the
NB_MAX blocks the grouped GEMM grids launch).  NB_MAX = cdiv(S, BLOCK_M) + min(E_local, S)
bounds the padded block count (every expert wastes less than one block).  Rows: the experts in
increasing local id, each expert's slots in slot order (a stable sort), padded to whole BLOCK_M
blocks.  Slots whose id is -1, out of range, or mapped to -1 appear nowhere.  The output is a
function of the input alone, so both paths below give it bit for bit.

A slot's row is ``start[e] * BLOCK_M + (slots of e before it)`` where ``start[e]`` is the
block-padded prefix of the expert counts.  Two paths, chosen on the host by S (= T*K, known
without a sync):

* S <= min(chunk, 128): one program (``_align_small_kernel``), everything in slot space, no
  E-sized work.  With SB = next_pow2(S) (>= 16): SB x SB compare-reductions give each slot its
  rank among the earlier slots of its expert, its expert's count, and its expert's first block
  (the block counts of the smaller experts, summed over their first slots).  Then per 64 blocks
  an (NB_B x SB) compare against the first slots gives each block's expert and valid row count;
  the program writes ``block_expert`` and -1 to exactly the padding rows (disjoint from the
  slot rows, so scatter and fill need no ordering).  Warps by SB (:func:`_small_warps`): 4 /
  8 / 16 / 8 at SB 16 / 32 / 64 / 128.  At V4-Flash top-6 decode (T <= 21) that is a few SB x
  SB compares (SB 16 at T 1-2) and at most NB_MAX*BLOCK_M int32 stores (448 B at T 1, BLOCK_M
  16).  Past SB 128 the compares no longer fit in registers (sm_90 compile: SB 128 at 8 warps
  uses 255 registers, SB 256 spills KBs).
* larger S: three launches over NC = cdiv(S, chunk) chunks, a counting sort.
  (a) ``_align_count_kernel``, NC programs: each chunk's histogram over the local experts ->
  ``counts (NC, BLOCK_E)`` int32 (BLOCK_E = next_pow2(E_local)).
  (b) ``_align_scan_kernel``, one program: each expert's total, first and end block
  (``experts (3, BLOCK_E)``), and ``base[c, e]`` = first row of e + the slots of e in chunks
  before c: a column scan of ``counts`` in tiles of 8 K counts (reads the table twice, writes
  it once: 3 x NC x BLOCK_E x 4 B, 590 KB at S 24576, chunk 128, E 256).
  (c) ``_align_place_kernel``, NC + cdiv(NB_MAX, 64) programs: a chunk program ranks its slots
  among the earlier slots of the same expert in the chunk (a chunk x chunk compare) and stores
  each slot at ``base[c, e] + rank``; a block program finds the expert of each of its 64
  blocks (a 64 x BLOCK_E compare against the end blocks) and writes ``block_expert`` and -1 to
  the padding rows of its blocks.
  Within a launch no program waits for another; the launch order is the only dependency.
  Every value is an integer count or sum, the same in any order (no global atomics).  At S
  24576, chunk 128: 192 chunk programs of 16 K compares each over the SMs.

``chunk`` (a power of two <= 256; the rank compare is chunk x chunk) and ``num_warps`` are
schedule knobs (MoESchedule.align_chunk / align_warps).  bench/diag/align_h200.py times both
paths alone, bench/diag/moe_sweep.py the align inside the MoE.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, TritonLaunch, cdiv, next_pow2, triton_launch, workspace
from .moe_common import jit_loop_bounds

__all__ = ["align_small", "max_blocks", "moe_align_triton", "small_align"]

# Blocks per block program of the multi-program path (and per step of the single program).
_NB_B = 64
# The single program's SB x SB compares stay in registers up to SB 128 (sm_90 compile: 255
# registers at 8 warps, no spill; SB 256 spills kilobytes), so larger S take the chunked path.
_SINGLE_MAX = 128


@triton.jit
def _local_ids(ids_ptr, map_ptr, s, S, E_GLOBAL, E_LOCAL, HAS_MAP: tl.constexpr):
    g = tl.load(ids_ptr + s, mask=s < S, other=-1).to(tl.int32)
    ok = (s < S) & (g >= 0) & (g < E_GLOBAL)
    loc = tl.load(map_ptr + g, mask=ok, other=-1).to(tl.int32) if HAS_MAP else g
    ok = ok & (loc >= 0) & (loc < E_LOCAL)
    return tl.where(ok, loc, -1), ok


@triton.jit
def _rank_in_chunk(loc, ok, N: tl.constexpr):
    """(N,): for each position i, the valid positions j < i with the same expert."""
    i = tl.arange(0, N)
    same = (loc[:, None] == loc[None, :]) & (i[None, :] < i[:, None]) & ok[None, :]
    return tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def _fill_blocks(sorted_ptr, block_expert_ptr, b, e_b, valid_b, NB_MAX, BLOCK_M: tl.constexpr):
    """block_expert[b] = e_b; -1 on rows valid_b.. of each block b (< NB_MAX)."""
    inb = b < NB_MAX
    tl.store(block_expert_ptr + b, e_b, mask=inb)
    m = tl.arange(0, BLOCK_M)
    pad = (m[None, :] >= valid_b[:, None]) & inb[:, None]
    rows = b[:, None] * BLOCK_M + m[None, :]
    tl.store(sorted_ptr + rows, tl.zeros_like(rows) - 1, mask=pad)


@jit_loop_bounds("NB_MAX")
def _align_small_kernel(
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
    SB: tl.constexpr,
    NB_B: tl.constexpr,
):
    align_small(
        ids_ptr, map_ptr, sorted_ptr, block_expert_ptr, S, E_GLOBAL, E_LOCAL, NB_MAX, HAS_MAP,
        BLOCK_M, SB, NB_B,
    )  # fmt: skip


@triton.jit
def align_small(
    ids_ptr, map_ptr, sorted_ptr, block_expert_ptr, S, E_GLOBAL, E_LOCAL, NB_MAX,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, SB: tl.constexpr, NB_B: tl.constexpr,
):  # fmt: skip
    """The one-program path (module doc) in the calling program: its own launch, or the
    router's top-k program right after it stored the ids (kernels/moe_route.py, ``ALIGN``)."""
    s = tl.arange(0, SB)
    loc, ok = _local_ids(ids_ptr, map_ptr, s, S, E_GLOBAL, E_LOCAL, HAS_MAP)
    rank = _rank_in_chunk(loc, ok, SB)
    same = (loc[:, None] == loc[None, :]) & ok[None, :]
    cnt = tl.sum(same.to(tl.int32), axis=1)  # slots of the expert of slot i
    first = ok & (rank == 0)  # one representative slot per present expert
    nblk = tl.where(first, (cnt + BLOCK_M - 1) // BLOCK_M, 0)
    lower = (loc[None, :] < loc[:, None]) & first[None, :]
    start = tl.sum(tl.where(lower, nblk[None, :], 0), axis=1)  # first block of slot i's expert
    tl.store(sorted_ptr + start * BLOCK_M + rank, s, mask=ok)
    # blocks: block b belongs to the first slot j with start_j <= b < start_j + nblk_j
    end = start + nblk
    used = tl.sum(nblk, axis=0)
    bi = tl.arange(0, NB_B)
    for b0 in range(0, NB_MAX, NB_B):
        b = b0 + bi
        cover = (start[None, :] <= b[:, None]) & (b[:, None] < end[None, :]) & first[None, :]
        e_b = tl.sum(tl.where(cover, loc[None, :], 0), axis=1)
        left = cnt[None, :] - (b[:, None] - start[None, :]) * BLOCK_M  # rows of e from block b on
        valid = tl.minimum(tl.sum(tl.where(cover, left, 0), axis=1), BLOCK_M)
        _fill_blocks(sorted_ptr, block_expert_ptr, b, tl.where(b < used, e_b, -1), valid,
                     NB_MAX, BLOCK_M)  # fmt: skip


@triton.jit
def _align_count_kernel(
    ids_ptr,
    map_ptr,
    counts_ptr,
    S,
    E_GLOBAL,
    E_LOCAL,
    HAS_MAP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    c = tl.program_id(0)
    s = c * CHUNK + tl.arange(0, CHUNK)
    loc, ok = _local_ids(ids_ptr, map_ptr, s, S, E_GLOBAL, E_LOCAL, HAS_MAP)
    h = tl.histogram(tl.where(ok, loc, 0), BLOCK_E, mask=ok)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), h)


@jit_loop_bounds("NC")
def _align_scan_kernel(
    counts_ptr,
    base_ptr,
    experts_ptr,
    NC,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    NC_B: tl.constexpr,
):
    ev = tl.arange(0, BLOCK_E)
    cr = tl.arange(0, NC_B)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, NC, NC_B):
        c = c0 + cr
        offs = c[:, None] * BLOCK_E + ev[None, :]
        total += tl.sum(tl.load(counts_ptr + offs, mask=(c < NC)[:, None], other=0), axis=0)
    nblk = (total + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(nblk, axis=0)  # inclusive: experts >= E_local have no slots, so end = used
    start = end - nblk
    tl.store(experts_ptr + ev, total)
    tl.store(experts_ptr + BLOCK_E + ev, start)
    tl.store(experts_ptr + 2 * BLOCK_E + ev, end)
    row = start * BLOCK_M  # first row of each expert's slots in the next chunk
    for c0 in range(0, NC, NC_B):
        c = c0 + cr
        offs = c[:, None] * BLOCK_E + ev[None, :]
        inc = (c < NC)[:, None]
        tile = tl.load(counts_ptr + offs, mask=inc, other=0)
        tl.store(base_ptr + offs, row[None, :] + tl.cumsum(tile, axis=0) - tile, mask=inc)
        row += tl.sum(tile, axis=0)


@triton.jit
def _align_place_kernel(
    ids_ptr,
    map_ptr,
    base_ptr,
    experts_ptr,
    sorted_ptr,
    block_expert_ptr,
    S,
    E_GLOBAL,
    E_LOCAL,
    NB_MAX,
    NC,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    NB_B: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < NC:
        s = pid * CHUNK + tl.arange(0, CHUNK)
        loc, ok = _local_ids(ids_ptr, map_ptr, s, S, E_GLOBAL, E_LOCAL, HAS_MAP)
        rank = _rank_in_chunk(loc, ok, CHUNK)
        row = tl.load(base_ptr + pid * BLOCK_E + loc, mask=ok, other=0) + rank
        tl.store(sorted_ptr + row, s, mask=ok)
    else:
        b = (pid - NC) * NB_B + tl.arange(0, NB_B)
        ev = tl.arange(0, BLOCK_E)
        end = tl.load(experts_ptr + 2 * BLOCK_E + ev)
        used = tl.max(end, axis=0)
        # the expert of block b: the experts ending at or before b, counted
        e_b = tl.sum((end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        live = b < used
        e_b = tl.where(live, e_b, -1)
        cnt = tl.load(experts_ptr + e_b, mask=live, other=0)
        start = tl.load(experts_ptr + BLOCK_E + e_b, mask=live, other=0)
        valid = tl.minimum(cnt - (b - start) * BLOCK_M, BLOCK_M)
        _fill_blocks(sorted_ptr, block_expert_ptr, b, e_b, valid, NB_MAX, BLOCK_M)


def max_blocks(S: int, e_local: int, block_m: int) -> int:
    """NB_MAX: the padded M-block count bound for S slots over e_local experts."""
    return cdiv(S, block_m) + min(e_local, S)


# The one program's warps by its slot tile SB (H200).  In the whole greedy step at T 8 (SB 64,
# one process, bench/diag/fusion_ab.py --align-warps): 592.5 / 589.2 / 586.7 us on 4 / 8 / 16
# warps, and 599.0 against 593.2 on 4 / 16 in a second run; the step shares the SMs with the
# shared expert's side stream there, where more warps win the sort more issue slots.  Elsewhere
# the fastest alone (bench/diag/align_h200.py --single-warps, BLOCK_M 16 / 64, us): SB 16 1.8 /
# 2.0 on 4 warps (2.1 / 2.9 on one, 1.7 / 2.0 on 8), SB 32 2.0 / 2.4 on 8 (2.2 / 2.5 on 4), SB
# 128 10.5 / 11.7 on 8 (10.8 / 12.1 on 16; 8 warps also keep its 255 registers per thread,
# which 16 warps would halve); moe-h200.md, "The one-program sort's warps".
_SMALL_WARPS = {16: 4, 32: 8, 64: 16, 128: 8}


def _small_warps(sb: int) -> int:
    """The one program's warps for an SB-slot tile (:data:`_SMALL_WARPS`)."""
    return _SMALL_WARPS[sb]


@functools.cache
def _small_launch(sb: int, nb_b: int, block_m: int, warps: int, has_map: bool) -> TritonLaunch:
    return triton_launch(
        _align_small_kernel, HAS_MAP=has_map, BLOCK_M=block_m, SB=sb, NB_B=nb_b, num_warps=warps
    )


@functools.cache
def _chunked_launches(
    block_e: int, nc_b: int, block_m: int, chunk: int, num_warps: int, has_map: bool
) -> tuple[TritonLaunch, TritonLaunch, TritonLaunch]:
    count = triton_launch(
        _align_count_kernel, HAS_MAP=has_map, BLOCK_E=block_e, CHUNK=chunk, num_warps=num_warps
    )
    scan = triton_launch(
        _align_scan_kernel, BLOCK_M=block_m, BLOCK_E=block_e, NC_B=nc_b, num_warps=num_warps
    )
    place = triton_launch(
        _align_place_kernel, HAS_MAP=has_map, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk,
        NB_B=_NB_B, num_warps=num_warps,
    )  # fmt: skip
    return count, scan, place


def small_align(S: int, e_local: int, block_m: int, chunk: int) -> tuple[int, int, int] | None:
    """(NB_MAX, SB, NB_B) of the one-program path for S slots, or None where S takes the
    chunked path (S > min(chunk, 128))."""
    if min(chunk, _SINGLE_MAX) < S:
        return None
    nb = max_blocks(S, e_local, block_m)
    return nb, max(16, next_pow2(S)), max(2, min(_NB_B, next_pow2(nb)))


def moe_align_triton(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    e_local: int,
    block_m: int,
    *,
    chunk: int = 64 if INTERPRET else 128,
    num_warps: int = 4 if INTERPRET else 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slot (NB_MAX*block_m,) int32, block_expert (NB_MAX,) int32); see the module doc.
    ``chunk``: the slots per program of the chunked path, taken for S > min(chunk, 128);
    ``num_warps``: that path's warps (the one program takes :func:`_small_warps`)."""
    S = topk_ids.numel()
    nb = max_blocks(S, e_local, block_m)
    dev = topk_ids.device
    sorted_slot = torch.empty((nb * block_m,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((nb,), dtype=torch.int32, device=dev)
    if nb == 0:
        return sorted_slot, block_expert
    ids = topk_ids.reshape(-1)
    has_map = expert_map is not None
    emap = expert_map if expert_map is not None else ids
    e_global = expert_map.numel() if expert_map is not None else e_local
    small = small_align(S, e_local, block_m, chunk)
    if small is not None:
        _, sb, nb_b = small
        launch = _small_launch(sb, nb_b, block_m, _small_warps(sb), has_map)
        launch((1,), ids, emap, sorted_slot, block_expert, S, e_global, e_local, nb)
        return sorted_slot, block_expert
    nc = cdiv(S, chunk)
    block_e = next_pow2(max(e_local, 2))
    nc_b = max(1, min(next_pow2(nc), 8192 // block_e))  # scan tiles of <= 8 K counts
    count, scan, place = _chunked_launches(block_e, nc_b, block_m, chunk, num_warps, has_map)
    table = nc * block_e  # a multiple of 16 elements whenever block_e >= 16
    pad = -(-table // 16) * 16
    ws = workspace("moe_align", (2 * pad + 3 * block_e,), torch.int32, dev)
    counts, base, experts = ws[:table], ws[pad : pad + table], ws[2 * pad :]
    count((nc,), ids, emap, counts, S, e_global, e_local)
    scan((1,), counts, base, experts, nc)
    place(
        (nc + cdiv(nb, _NB_B),), ids, emap, base, experts, sorted_slot, block_expert,
        S, e_global, e_local, nb, nc,
    )  # fmt: skip
    return sorted_slot, block_expert
