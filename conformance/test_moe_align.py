"""The MoE token -> expert sort (optimized/kernels/moe_align.py) against its contract.

:func:`align_contract` is the contract in plain torch (a stable argsort of the slots by local
expert, rows padded per expert to whole blocks).  Both kernel paths, one program (S <= chunk)
and the chunked count / scan / place launches (S > chunk), must give it bit for bit: padding
ids, expert maps with off-rank experts, a local expert count that is no power of two, every
slot on one expert, no valid slot, S of 0, 1 and odd sizes, every block size.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4mtp.errors import ConfigError

pytest.importorskip("triton")

from dsv4mtp.optimized.kernels import moe_align
from dsv4mtp.optimized.kernels.moe_align import max_blocks, moe_align_triton, small_align
from dsv4mtp.optimized.moe import MoESchedule, moe_config


def align_contract(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, e_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slot, block_expert) as the module doc of moe_align.py defines them."""
    flat = topk_ids.reshape(-1).long()
    S, dev = flat.numel(), flat.device
    e_global = expert_map.numel() if expert_map is not None else e_local
    ok = (flat >= 0) & (flat < e_global)
    loc = torch.where(ok, flat, 0)
    if expert_map is not None and e_global > 0:
        loc = expert_map.long()[loc]
    ok &= (loc >= 0) & (loc < e_local)
    key = torch.where(ok, loc, e_local)  # dropped slots sort last
    slots = torch.argsort(key, stable=True)[: int(ok.sum())]
    experts = key[slots]
    counts = torch.bincount(experts, minlength=e_local)
    nblk = (counts + block_m - 1) // block_m
    first_row = (torch.cumsum(nblk, 0) - nblk) * block_m
    rank = torch.arange(slots.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[experts]
    nb = -(-S // block_m) + min(e_local, S)
    sorted_slot = torch.full((nb * block_m,), -1, dtype=torch.int32, device=dev)
    sorted_slot[first_row[experts] + rank] = slots.to(torch.int32)
    block_expert = torch.full((nb,), -1, dtype=torch.int32, device=dev)
    used = int(nblk.sum())
    block_expert[:used] = torch.repeat_interleave(torch.arange(e_local, device=dev), nblk).int()
    return sorted_slot, block_expert


def _ids(kind: str, T: int, K: int, e_global: int, g: torch.Generator) -> torch.Tensor:
    if kind == "one_expert":
        return torch.full((T, K), e_global // 2, dtype=torch.int64)
    if kind == "whole_blocks":  # runs of 16 slots per expert, experts in decreasing id
        s = torch.arange(T * K).reshape(T, K)
        return e_global - 1 - (s // 16) % e_global
    if kind == "all_padding":
        return torch.full((T, K), -1, dtype=torch.int64)
    ids = torch.randint(0, e_global, (T, K), generator=g)
    return torch.where(torch.rand((T, K), generator=g) < 0.2, -1, ids)  # ~20% padding slots


def _map(e_global: int, e_local: int, g: torch.Generator) -> torch.Tensor:
    """A rank's map: e_local of the global experts, scattered, the rest -1."""
    m = torch.full((e_global,), -1, dtype=torch.int32)
    m[torch.randperm(e_global, generator=g)[:e_local]] = torch.arange(e_local, dtype=torch.int32)
    return m


def _check_both_paths(
    ids: torch.Tensor, emap: torch.Tensor | None, e_local: int, block_m: int, device: str
) -> None:
    want = align_contract(ids, emap, e_local, block_m)
    S = ids.numel()
    d_ids = ids.to(device)
    d_map = emap.to(device) if emap is not None else None
    # chunk 128: the single program where S <= 128, else 128-slot chunks; 16 / 256: chunks.
    # Warps: the chunked path's num_warps 1 / 4, the single program's own 1 / 16 (patched).
    default_warps = moe_align._small_warps
    for chunk in (128, 16, 256) if S > 128 else (128, 16):
        path = "single" if min(chunk, 128) >= S else "chunked"
        for warps in (1, 16) if path == "single" else (1, 4):
            if path == "single":
                moe_align._small_warps = lambda sb, w=warps: w
            try:
                srt, blk = moe_align_triton(
                    d_ids, d_map, e_local, block_m, chunk=chunk, num_warps=warps
                )
            finally:
                moe_align._small_warps = default_warps
            assert srt.shape == (max_blocks(S, e_local, block_m) * block_m,)
            assert torch.equal(srt.cpu(), want[0]), (path, chunk, warps, srt, want[0])
            assert torch.equal(blk.cpu(), want[1]), (path, chunk, warps, blk, want[1])


CASES = [
    # (kind, T, K, e_global, e_local or None for no map, block_m)
    ("random", 1, 6, 256, None, 16),  # V4-Flash decode: S 6, NB_MAX 7
    ("random", 1, 1, 4, None, 32),  # S 1
    ("random", 7, 3, 37, None, 64),  # odd S 21, E not a power of two
    ("random", 11, 6, 24, 10, 16),  # expert map, 10 local of 24
    ("random", 5, 8, 300, 3, 128),  # most slots off-rank
    ("one_expert", 9, 6, 40, None, 16),  # 54 slots, one expert, several blocks
    ("one_expert", 9, 6, 40, 40, 128),
    ("one_expert", 16, 8, 40, None, 32),  # 128 slots: exactly 4 full blocks
    ("whole_blocks", 12, 8, 5, None, 16),  # counts multiples of the block: no padding rows
    ("whole_blocks", 12, 8, 5, 5, 32),
    ("all_padding", 6, 6, 40, None, 32),  # every expert empty: all rows and blocks -1
    ("random", 40, 6, 256, None, 16),  # S 240: 15 chunks of 16, the full 256-bin histogram
    ("random", 43, 7, 48, 20, 32),  # S 301: single program impossible, ragged last chunk
]


@pytest.mark.parametrize(("kind", "T", "K", "e_global", "e_local", "block_m"), CASES)
def test_align_matches_contract_on_both_paths(
    kind: str, T: int, K: int, e_global: int, e_local: int | None, block_m: int, device: str
) -> None:
    g = torch.Generator().manual_seed(T * 1000 + K * 10 + block_m)
    ids = _ids(kind, T, K, e_global, g)
    emap = _map(e_global, e_local, g) if e_local is not None else None
    _check_both_paths(ids, emap, e_local if e_local is not None else e_global, block_m, device)


def test_single_program_warps_cover_every_slot_tile() -> None:
    """Every slot tile the one program can get (SB 16 .. 128) has its warp count."""
    tiles = {small_align(S, 256, 16, 128)[1] for S in range(1, 129)}  # type: ignore[index]
    assert tiles == {16, 32, 64, 128}
    assert [moe_align._small_warps(sb) for sb in sorted(tiles)] == [4, 8, 16, 8]
    assert small_align(129, 256, 16, 128) is None


def test_align_of_no_slots(device: str) -> None:
    srt, blk = moe_align_triton(torch.empty((0, 6), dtype=torch.int64, device=device), None, 8, 16)
    assert srt.numel() == 0 and blk.numel() == 0


def test_align_int32_ids_and_out_of_range(device: str) -> None:
    """int32 ids; ids >= E_global (without a map: >= E_local) are dropped like -1."""
    ids = torch.tensor([[3, 9, -1], [0, 3, 12], [7, 1, 3]], dtype=torch.int32)
    _check_both_paths(ids, None, 8, 16, device)
    emap = torch.tensor([2, -1, 0, 1, -1, 3, 4, 5, 6, 7], dtype=torch.int32)
    _check_both_paths(ids, emap, 8, 16, device)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    T=st.integers(1, 24),
    K=st.integers(1, 8),
    e_global=st.integers(1, 70),
    local=st.one_of(st.none(), st.integers(1, 70)),
    block_m=st.sampled_from([16, 32, 64, 128]),
)
def test_align_random(
    seed: int, T: int, K: int, e_global: int, local: int | None, block_m: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = _ids("random", T, K, e_global, g)
    e_local = e_global if local is None else min(local, e_global)
    emap = _map(e_global, e_local, g) if local is not None else None
    _check_both_paths(ids, emap, e_local, block_m, "cuda" if torch.cuda.is_available() else "cpu")


def test_align_chunk_validation() -> None:
    """The chunk x chunk rank compare bounds align_chunk at 256."""
    s = moe_config(1, batch_invariant=False)
    with pytest.raises(ConfigError, match="align_chunk"):
        MoESchedule(16, s.gate_up, s.down, 16, s.shared_gate_up, s.shared_down, align_chunk=512)
    with pytest.raises(ConfigError, match="align_chunk"):
        MoESchedule(16, s.gate_up, s.down, 16, s.shared_gate_up, s.shared_down, align_chunk=8)


@pytest.mark.parametrize("T", [1, 2, 5, 8, 9])
@pytest.mark.parametrize("mapped", [False, True], ids=["all_local", "expert_map"])
def test_router_program_sorts_the_slots_as_the_align(
    T: int, mapped: bool, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``route_triton(align=...)`` (kernels/moe_route.py): up to ``FUSED_ALIGN_MAX_T`` tokens
    (the default 1, here raised to 8 so that several rows share the program) the router's
    top-k runs as one program that also sorts its slots; its ids and weights are bitwise the
    router's alone and its (sorted_slot, block_expert) the contract's and
    ``moe_align_triton``'s, with padding rows (row_mask False: ids -1), an expert map with
    off-rank experts and 8- and 16-row blocks.  A call ``fused_align`` refuses (more tokens
    than the bound, or more slots than the sort's one program takes: chunk 32 against T*K 30
    and 48) raises a ConfigError instead of leaving the outputs unwritten."""
    from dsv4mtp.optimized.kernels import moe_route

    monkeypatch.setattr(moe_route, "FUSED_ALIGN_MAX_T", 8)
    g = torch.Generator().manual_seed(T)
    E, D, K = 32, 128, 6
    x = torch.randn(T, D, generator=g).to(device)
    w = (torch.randn(E, D, generator=g) / D**0.5).to(device)
    b = (torch.randn(E, generator=g) / 10).to(device)
    mask = (torch.arange(T) % 3 != 1).to(device)
    emap = None
    e_local = E
    if mapped:  # experts 8..23 on this rank
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[8:24] = torch.arange(16, dtype=torch.int32)
        emap, e_local = emap.to(device), 16
    for bm, chunk in ((8, 128), (16, 128), (8, 32)):
        w0 = torch.empty(T, K, device=device)
        i0 = torch.empty(T, K, dtype=torch.int32, device=device)
        moe_route.route_triton(x, w, b, K, 1.5, w0, i0, row_mask=mask)
        assert bool((i0[~mask] == -1).all())
        small = moe_route.fused_align(T, K, e_local, bm, chunk)
        assert (small is None) == (T > 8 or chunk < T * K), (bm, chunk)
        nb = max_blocks(T * K, e_local, bm)
        align = moe_route.RouteAlign(
            emap, e_local, bm, chunk, torch.full((nb * bm,), 7, dtype=torch.int32, device=device),
            torch.full((nb,), 7, dtype=torch.int32, device=device),
        )  # fmt: skip
        w1, i1 = torch.empty_like(w0), torch.empty_like(i0)
        if small is None:
            with pytest.raises(ConfigError, match=r"^align: "):
                moe_route.route_triton(x, w, b, K, 1.5, w1, i1, row_mask=mask, align=align)
            continue
        moe_route.route_triton(x, w, b, K, 1.5, w1, i1, row_mask=mask, align=align)
        assert torch.equal(w1, w0) and torch.equal(i1, i0)
        want = align_contract(i0.cpu(), None if emap is None else emap.cpu(), e_local, bm)
        got = (align.sorted_slot.cpu(), align.block_expert.cpu())
        assert all(torch.equal(a, c) for a, c in zip(got, want, strict=True)), bm
        kernel = moe_align_triton(i0, emap, e_local, bm)
        assert all(torch.equal(a.cpu(), c) for a, c in zip(kernel, got, strict=True)), bm
