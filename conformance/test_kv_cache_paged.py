"""The paged KV cache (``dsv4mtp.optimized.PagedKVCache``: an engine's block pool, block table
and slot mapping in vLLM's convention), ``sink_attention_paged`` and the attention sublayer
over it.

Tiny config (D 256, H 4 x Dh 128, window 16), blocks of 4 rows, handed out from a shuffled free
list (the tables are scattered, never in order).  Tensors live on the ``device`` fixture's
device (CUDA when present, else the CPU under the Triton interpreter).  Covered: decode and
prefill through ``attention(kv_cache=PagedKVCache)`` bitwise equal to the ring cache path
(position gaps included: both kernels walk the window's positions in the same blocks and lanes)
and to the host-cache path (contiguous positions); the op bitwise equal to
``sink_attention_cache`` over a ring holding the same rows and within the attention core's
declared fp32 tolerance of the float64 reference; prefix blocks shared by two sequences;
-1 table entries; slot mapping -1; rejected drafts needing no rollback; batch invariance;
typed errors; opcheck; and (gpu) a captured decode step replayed on new inputs.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from dsv4mtp.config import DSV4Config
from dsv4mtp.conformance.test_kv_cache import layer_params
from dsv4mtp.errors import ConfigError, DSV4Error, InputError
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.optimized import DeviceKVCache, PagedKVCache, pack_attention
from dsv4mtp.optimized import attention as opt_attention
from dsv4mtp.optimized import sink_attention_cache as opt_cache_attention
from dsv4mtp.optimized import sink_attention_paged as opt_paged_attention
from dsv4mtp.reference import sink_attention_paged as ref_paged_attention

BF16, FP32 = torch.bfloat16, torch.float32
CFG = DSV4Config.tiny()
D, W, Dh = CFG.hidden_size, CFG.sliding_window, CFG.head_dim
BS = 4
OFFICIAL = dict(fp8_kv=True, act_quant=True, norm_order="official")


class _Engine:
    """A toy engine: per-sequence block tables filled on demand from a shuffled free list."""

    def __init__(self, cache: PagedKVCache, num_seqs: int, max_blocks: int, seed: int) -> None:
        self.cache = cache
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(cache.num_blocks, generator=g).tolist()
        self.table = torch.full((num_seqs, max_blocks), -1, dtype=torch.int32)

    def rows(self, seqs: list[int], positions: list[int], lens: list[int] | None = None):
        """(block_table (B, M), slot_mapping (T,)) of a call, allocating the blocks its new
        positions need; a negative sequence is padding (table row -1, slots -1)."""
        lens = lens or [1] * len(seqs)
        owner = [s for s, n in zip(seqs, lens, strict=True) for _ in range(n)]
        for s, p in zip(owner, positions, strict=True):
            if s >= 0 and self.table[s, p // BS] < 0:
                self.table[s, p // BS] = self.free.pop()
        dev = self.cache.device
        table = torch.stack([self.table[s] if s >= 0 else self.table[0] * 0 - 1 for s in seqs])
        per_row = torch.stack([table[i] for i, n in enumerate(lens) for _ in range(n)])
        pos = torch.tensor(positions, device=dev)
        return table.to(dev), self.cache.slots(per_row.to(dev), pos)


def _rows(g: torch.Generator, T: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(T, D, generator=g).to(dtype).to(device)


def _slots(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# ------------------------------------------------------------------------------ the sublayer
def test_decode_is_bitwise_the_ring_and_host_cache_paths(device: str) -> None:
    """Two sequences prefilled (contiguous positions, one longer than the window), then decode
    steps with position gaps (one wider than the window) and a padding row: every output
    bitwise equal to the ring cache path (both kernels walk the window's positions in the same
    blocks and lanes, gaps or not); the prefill and the gap-free steps also bitwise the
    host-KVCache path.  The pool is poisoned with NaN first (a row never written is never
    read), its blocks scattered."""
    pack = pack_attention(layer_params(BF16), device)
    kv = torch.full((40, BS, Dh), float("nan"), dtype=BF16, device=device)
    pool = PagedKVCache.from_tensors(kv, torch.full((40, BS), -1, dtype=torch.int32,
                                                    device=device), W)  # fmt: skip
    engine = _Engine(pool, 2, 40, seed=0)
    ring = DeviceKVCache(CFG, num_seqs=3, max_draft=0, dtype=BF16, device=device)
    hosts = [KVCache(W), KVCache(W)]
    g = torch.Generator().manual_seed(1)
    pos = list(range(30, 50)) + list(range(0, 5))
    x = _rows(g, 25, BF16, device)
    table, slots = engine.rows([1, 0], pos, [20, 5])
    p = torch.tensor(pos, device=device)
    got = opt_attention(x, p, pack, CFG, seq_lens=[20, 5], kv_cache=pool, block_table=table,
                        slot_mapping=slots, **OFFICIAL)  # fmt: skip
    want = opt_attention(x, p, pack, CFG, seq_lens=[20, 5], kv_cache=ring,
                         cache_slots=_slots([2, 0], device), **OFFICIAL)  # fmt: skip
    assert torch.equal(got, want), "prefill vs ring"
    host = opt_attention(x, p, pack, CFG, seq_lens=[20, 5], kv_cache=hosts, **OFFICIAL)
    assert torch.equal(got, host), "prefill vs host caches"
    last = [49, 4]
    for step, gaps in enumerate([(1, 1), (1, 3), (W + 2, 1), (1, 1), (2, 1)]):
        last = [last[0] + gaps[0], last[1] + gaps[1]]
        x = _rows(g, 3, BF16, device)
        table, slots = engine.rows([1, -1, 0], [last[0], 0, last[1]])
        p = torch.tensor([last[0], 0, last[1]], device=device)
        got = opt_attention(x, p, pack, CFG, kv_cache=pool, block_table=table,
                            slot_mapping=slots, **OFFICIAL)  # fmt: skip
        want = opt_attention(x, p, pack, CFG, kv_cache=ring,
                             cache_slots=_slots([2, -1, 0], device), **OFFICIAL)  # fmt: skip
        assert torch.isfinite(got).all()
        assert got[1].abs().max() == 0, "padding row"
        assert torch.equal(got, want), f"decode step {step} vs ring"
        if step == 0:
            r = torch.tensor([0, 2], device=device)
            host = opt_attention(x[r], p[r], pack, CFG, seq_lens=[1, 1], kv_cache=hosts,
                                 **OFFICIAL)  # fmt: skip
            assert torch.equal(got[r], host), "gap-free decode vs host caches"


def test_shared_prefix_blocks_are_read_only(device: str) -> None:
    """Sequence B lists sequence A's first two blocks (a shared prefix of 8 positions) and
    prefills only its own positions 8..13 (slot mapping -1 never needed: its rows go to its own
    blocks).  B's outputs are bitwise the host-KVCache path holding A's first 8 rows; A's
    blocks are unchanged, and A's next decode step is bitwise the same as without B."""
    pack = pack_attention(layer_params(BF16), device)
    g = torch.Generator().manual_seed(2)
    xa = _rows(g, 11, BF16, device)
    xb = _rows(g, 6, BF16, device)
    xd = _rows(g, 1, BF16, device)

    def run(with_b: bool) -> tuple[torch.Tensor, torch.Tensor | None, PagedKVCache, KVCache]:
        pool = PagedKVCache(CFG, num_blocks=12, block_size=BS, dtype=BF16, device=device)
        engine = _Engine(pool, 2, 8, seed=3)
        table, slots = engine.rows([0], list(range(11)), [11])
        pa = torch.arange(11, device=device)
        opt_attention(xa, pa, pack, CFG, seq_lens=[11], kv_cache=pool, block_table=table,
                      slot_mapping=slots)  # fmt: skip
        host = KVCache(W)
        host.append(pool.kv.view(-1, Dh)[slots[:8]], pa[:8])  # A's first 8 rows, as stored
        out_b = None
        if with_b:
            engine.table[1, :2] = engine.table[0, :2]  # the shared prefix
            before = pool.kv.clone(), pool.pos.clone()
            table, slots = engine.rows([1], list(range(8, 14)), [6])
            pb = torch.arange(8, 14, device=device)
            out_b = opt_attention(xb, pb, pack, CFG, seq_lens=[6], kv_cache=pool,
                                  block_table=table, slot_mapping=slots)  # fmt: skip
            shared = engine.table[0, :2].long().to(device)
            assert torch.equal(pool.pos[shared], before[1][shared])
            assert torch.equal(pool.kv[shared], before[0][shared])
        table, slots = engine.rows([0], [11])
        out_a = opt_attention(xd, torch.tensor([11], device=device), pack, CFG, kv_cache=pool,
                              block_table=table, slot_mapping=slots)  # fmt: skip
        return out_a, out_b, pool, host

    alone, _, _, _ = run(False)
    shared, out_b, _, host = run(True)
    assert torch.equal(alone, shared), "A's decode changed by B"
    want = opt_attention(xb, torch.arange(8, 14, device=device), pack, CFG, seq_lens=[6],
                         kv_cache=[host])  # fmt: skip
    assert out_b is not None and torch.equal(out_b, want)


def test_prefill_with_a_padding_sequence(device: str) -> None:
    """A prefill batch of a real sequence and a padding one (table row all -1, slots -1,
    positions all 0): the padding rows are zero and write nothing, the real rows bitwise the
    host-KVCache path of the real sequence alone (batch_invariant=True)."""
    pack = pack_attention(layer_params(BF16), device)
    g = torch.Generator().manual_seed(12)
    x = _rows(g, 5, BF16, device)
    pool = PagedKVCache(CFG, num_blocks=6, block_size=BS, dtype=BF16, device=device)
    engine = _Engine(pool, 1, 4, seed=13)
    table, slots = engine.rows([0, -1], [4, 5, 6, 0, 0], [3, 2])
    pos = torch.tensor([4, 5, 6, 0, 0], device=device)
    got = opt_attention(x, pos, pack, CFG, seq_lens=[3, 2], kv_cache=pool, block_table=table,
                        slot_mapping=slots, batch_invariant=True)  # fmt: skip
    want = opt_attention(x[:3], pos[:3], pack, CFG, kv_cache=[KVCache(W)],
                         batch_invariant=True)  # fmt: skip
    assert torch.equal(got[:3], want) and got[3:].abs().max() == 0
    assert int((pool.pos >= 0).sum()) == 3


def test_rejected_drafts_need_no_rollback(device: str) -> None:
    """Three draft steps past position 20, then decoding again from 21 (all drafts rejected):
    bitwise the outputs of a pool that never saw the drafts (a rejected draft is past the next
    query and is overwritten at its slot when its position is decoded again)."""
    pack = pack_attention(layer_params(BF16), device)
    g = torch.Generator().manual_seed(4)
    prefill = _rows(g, 21, BF16, device)
    drafts = [_rows(g, 1, BF16, device) for _ in range(3)]
    after = [_rows(g, 1, BF16, device) for _ in range(3)]

    def run(draft: bool) -> list[torch.Tensor]:
        pool = PagedKVCache(CFG, num_blocks=16, block_size=BS, dtype=BF16, device=device)
        engine = _Engine(pool, 1, 16, seed=5)
        table, slots = engine.rows([0], list(range(21)), [21])
        opt_attention(prefill, torch.arange(21, device=device), pack, CFG, seq_lens=[21],
                      kv_cache=pool, block_table=table, slot_mapping=slots)  # fmt: skip
        steps = [(x, 21 + i) for i, x in enumerate(drafts)] if draft else []
        steps += [(x, 21 + i) for i, x in enumerate(after)]
        outs = []
        for x, p in steps:
            table, slots = engine.rows([0], [p])
            p_t = torch.tensor([p], device=device)
            outs.append(opt_attention(x, p_t, pack, CFG, kv_cache=pool, block_table=table,
                                      slot_mapping=slots))  # fmt: skip
        return outs[-3:]

    for i, (a, b) in enumerate(zip(run(True), run(False), strict=True)):
        assert torch.equal(a, b), f"decode step {i} after the rejected drafts"


def test_slot_mapping_minus_one_writes_nothing(device: str) -> None:
    """``write`` with -1 slots changes only the mapped rows; ``reset`` empties the listed
    blocks; ``slots`` gives -1 past the table and for -1 entries."""
    pool = PagedKVCache(CFG, num_blocks=4, block_size=BS, dtype=BF16, device=device)
    assert pool.nbytes == 4 * BS * (Dh * 2 + 4)
    rows = torch.randn(3, Dh).to(BF16).to(device)
    pool.write(rows, torch.tensor([5, 6, 7], device=device),
               torch.tensor([-1, 9, -1], device=device))  # fmt: skip
    want = torch.zeros_like(pool.kv)
    want[2, 1] = rows[1]
    assert int((pool.pos >= 0).sum()) == 1 and int(pool.pos[2, 1]) == 6
    assert torch.equal(pool.kv, want)
    table = torch.tensor([[3, -1], [3, -1], [3, -1]], dtype=torch.int32, device=device)
    got = pool.slots(table, torch.tensor([2, 5, 9], device=device))
    assert got.tolist() == [14, -1, -1]
    pool.reset(torch.tensor([-1, 2], device=device))
    assert int(pool.pos.max()) == -1


def test_batch_invariant_rows_are_bitwise_the_same_alone(device: str) -> None:
    """batch_invariant=True: each decode row of a two-sequence step equals the row alone."""
    pack = pack_attention(layer_params(BF16), device)
    g = torch.Generator().manual_seed(6)
    base = torch.randn(9, Dh, generator=g).to(BF16).to(device)
    x = _rows(g, 2, BF16, device)

    def run(rows: list[int]) -> torch.Tensor:
        pool = PagedKVCache(CFG, num_blocks=12, block_size=BS, dtype=BF16, device=device)
        engine = _Engine(pool, 2, 16, seed=7)
        pos = [0, 1, 2, 3, 40, 41, 42, 43, 44]
        _, slots = engine.rows([0, 1], pos, [4, 5])
        pool.write(base, torch.tensor(pos, device=device), slots)
        seqs, p = [[0, 1][r] for r in rows], [[4, 45][r] for r in rows]
        table, slots = engine.rows(seqs, p)
        return opt_attention(x[rows], torch.tensor(p, device=device), pack, CFG,
                             kv_cache=pool, block_table=table, slot_mapping=slots,
                             batch_invariant=True)  # fmt: skip

    both = run([0, 1])
    assert torch.equal(both[0:1], run([0])) and torch.equal(both[1:2], run([1]))


# ------------------------------------------------------------------------------ the core op
def _ring_and_pool(positions: list[list[int]], C: int, g: torch.Generator):
    """The same rows (per sequence, positions increasing) in a ring cache (S, C) and in a
    pool of scattered blocks; NaN in every other row of both."""
    S = len(positions)
    ring_kv = torch.full((S, C, 64), float("nan"))
    ring_pos = torch.full((S, C), -1, dtype=torch.int32)
    NB = 64
    pool_kv = torch.full((NB, BS, 64), float("nan"))
    pool_pos = torch.full((NB, BS), -1, dtype=torch.int32)
    free = torch.randperm(NB, generator=g).tolist()
    table = torch.full((S, 32), -1, dtype=torch.int32)
    for s, ps in enumerate(positions):
        for p in ps:
            row = torch.randn(64, generator=g)
            ring_kv[s, p % C], ring_pos[s, p % C] = row, p
            if table[s, p // BS] < 0:
                table[s, p // BS] = free.pop()
            b = int(table[s, p // BS])
            pool_kv[b, p % BS], pool_pos[b, p % BS] = row, p
    return (ring_kv, ring_pos), (pool_kv, pool_pos, table)


def test_paged_op_is_bitwise_the_ring_op_and_within_tolerance_of_the_reference(
    device: str,
) -> None:
    """Rows with position gaps in a ring and in scattered blocks: ``sink_attention_paged``
    bitwise equal to ``sink_attention_cache`` (fp32 and bf16), and within the attention core's
    fp32 tolerance of the float64 reference; a padding row (table all -1), a query that sees
    nothing and a -1 entry over a block whose pool row 0 holds the missing positions (NaN kv:
    a -1 read as block 0 would show) behave as the reference says."""
    import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs)
    from dsv4mtp.conformance.registry import REGISTRY

    g = torch.Generator().manual_seed(8)
    w = 8
    seqs = [list(range(10, 31)), [0, 1, 2, 5, 9, 10, 14, 20], list(range(3, 9))]
    (ring_kv, ring_pos), (pool_kv, pool_pos, table) = _ring_and_pool(seqs, 16, g)
    q = torch.randn(6, 4, 64, generator=g)
    q_pos = torch.tensor([30, 20, 11, 27, 3, 60])
    slots = torch.tensor([0, 1, 2, 0, -1, 0])
    tables = table[slots.clamp(min=0)]
    tables[4] = -1  # padding
    sink = torch.randn(4, generator=g)
    kw = dict(window=w, scale=0.125)
    results = {}
    for dtype in (FP32, BF16):
        args = [t.to(dtype) for t in (q, ring_kv, pool_kv)]
        ring = opt_cache_attention(*(t.to(device) for t in (args[0], q_pos, args[1], ring_pos,
                                                            slots, sink)), **kw)  # fmt: skip
        paged = opt_paged_attention(*(t.to(device) for t in (args[0], q_pos, args[2], pool_pos,
                                                             tables, sink)), **kw)  # fmt: skip
        assert torch.equal(ring, paged), dtype
        results[dtype] = paged
    want = ref_paged_attention(q.double(), q_pos, pool_kv.double(), pool_pos, tables,
                               sink.double(), **kw)  # fmt: skip
    got = opt_paged_attention(*(t.to(device) for t in (q, q_pos, pool_kv, pool_pos, tables,
                                                       sink)), **kw)  # fmt: skip
    tol = REGISTRY["sink_attention_paged"].tolerance(FP32)
    assert float((got.cpu().double() - want).norm() / want.norm()) < tol.rel
    assert all(got[b].abs().max() == 0 for b in (4, 5)) and got[2].abs().max() > 0
    # drop sequence 0's block of positions 24..27; the unused block 0 row holds them, NaN kv
    j = 24 // BS
    missing = tables.clone()
    spare = int(min(set(range(64)) - set(table.flatten().tolist())))
    pool_pos[spare] = torch.arange(24, 28, dtype=torch.int32)
    missing[missing == int(table[0, j])] = -1
    if spare != 0:  # a -1 entry must not read block 0 either: make block 0 the spare
        pool_kv[[0, spare]], pool_pos[[0, spare]] = pool_kv[[spare, 0]], pool_pos[[spare, 0]]
        missing = torch.where(missing == 0, spare, missing)
    want = ref_paged_attention(q.double(), q_pos, pool_kv.double(), pool_pos, missing,
                               sink.double(), **kw)  # fmt: skip
    got = opt_paged_attention(*(t.to(device) for t in (q, q_pos, pool_kv, pool_pos, missing,
                                                       sink)), **kw)  # fmt: skip
    assert torch.isfinite(got).all()
    assert float((got.cpu().double() - want).norm() / want.norm()) < tol.rel
    assert not torch.equal(got, results[FP32]), "the -1 entry changed nothing"


@pytest.mark.parametrize("variant", ["", "_out"])
def test_paged_opcheck(variant: str, device: str) -> None:
    """Schema, fake kernel and AOT dispatch of the operator (torch.library.opcheck)."""
    from dsv4mtp.conformance.inputs import paged_attention_inputs

    dtype = BF16 if device == "cuda" else FP32
    args, kw = paged_attention_inputs(3, 0, shape="tiny", dtype=dtype, device=device)
    call = (*args, kw["window"], kw["scale"], "triton", [])
    outs = {"out": torch.empty_like(args[0])} if variant else {}
    op = getattr(torch.ops.dsv4mtp, "sink_attention_paged" + variant).default
    torch.library.opcheck(op, call, outs)


def test_paged_write_opcheck(device: str) -> None:
    """The pool's write is ``kv_cache_write`` over the pool viewed as N * bs rings of one row:
    opcheck of both variants on that view (its writes themselves:
    test_slot_mapping_minus_one_writes_nothing)."""
    dtype = BF16 if device == "cuda" else FP32
    pool = PagedKVCache(CFG, num_blocks=3, block_size=BS, dtype=dtype, device=device)
    new = torch.randn(3, Dh, device=device).to(dtype)
    call = (new, torch.tensor([5, 6, -1], device=device), torch.tensor([9, -1, 2], device=device))
    rows = pool.num_blocks * BS
    views = (pool.kv.view(rows, 1, Dh), pool.pos.view(rows, 1))
    ops = torch.ops.dsv4mtp
    torch.library.opcheck(ops.kv_cache_write.default, (*call, *views), {})
    torch.library.opcheck(ops.kv_cache_write_out.default, call,
                          {"cache_kv": views[0], "cache_pos": views[1]})  # fmt: skip


# ------------------------------------------------------------------------------ errors
def test_bad_arguments_raise_typed_errors(device: str) -> None:
    with pytest.raises(InputError, match=r"^num_blocks"):
        PagedKVCache(CFG, num_blocks=0, dtype=BF16, device=device)
    with pytest.raises(InputError, match=r"^block_size"):
        PagedKVCache(CFG, num_blocks=1, block_size=0, dtype=BF16, device=device)
    with pytest.raises(InputError, match=r"^dtype"):
        PagedKVCache(CFG, num_blocks=1, dtype=torch.float64, device=device)
    with pytest.raises(ConfigError, match=r"^head_dim"):
        PagedKVCache(CFG.replace(head_dim=120), num_blocks=1, dtype=BF16, device=device)
    kv = torch.zeros(3, BS, Dh, dtype=BF16, device=device)
    pos = torch.full((3, BS), -1, dtype=torch.int32, device=device)
    with pytest.raises(InputError, match=r"^pos: expected an int32"):
        PagedKVCache.from_tensors(kv, pos.long(), W)
    with pytest.raises(InputError, match=r"^pos: expected shape"):
        PagedKVCache.from_tensors(kv, pos[:, :2], W)
    with pytest.raises(InputError, match=r"^kv: expected a \(N, bs, Dh\)"):
        PagedKVCache.from_tensors(kv[0], pos, W)
    pool = PagedKVCache.from_tensors(kv, pos, W)
    row = torch.zeros(1, Dh, dtype=BF16, device=device)
    one = torch.tensor([1], device=device)
    with pytest.raises(InputError, match=r"^slot_mapping: expected distinct slots < num_blocks"):
        pool.write(row, one, torch.tensor([12], device=device))
    with pytest.raises(InputError, match=r"^slot_mapping: expected distinct"):
        pool.write(row.repeat(2, 1), one.repeat(2), torch.tensor([3, 3], device=device))
    with pytest.raises(InputError, match=r"^kv: expected"):
        pool.write(row.float(), one, one)
    with pytest.raises(InputError, match=r"^blocks: expected block indices"):
        pool.reset(torch.tensor([3], device=device))
    with pytest.raises(InputError, match=r"^block_table: expected a \(1, M\)"):
        pool.slots(torch.zeros(2, 2, dtype=torch.int32, device=device), one)


def test_op_rejects_bad_tables_and_pools_as_the_reference(device: str) -> None:
    from dsv4mtp.conformance.inputs import paged_attention_inputs

    args, kw = paged_attention_inputs(3, 1, shape="tiny", dtype=FP32, device=device)
    q, q_pos, cache_kv, cache_pos, table, sink = args
    moved = cache_pos.clone()
    moved[0, 0] = 5  # position 5 belongs at offset 1 of a block of 4
    far = table.clone()
    far[1, 0] = cache_kv.shape[0]
    for fn in (ref_paged_attention, opt_paged_attention):
        with pytest.raises(InputError, match=r"^cache_pos: expected -1 \(empty\) or a position"):
            fn(q, q_pos, cache_kv, moved, table, sink, **kw)
        with pytest.raises(InputError, match=r"^block_table: expected block indices in \[-1, N="):
            fn(q, q_pos, cache_kv, cache_pos, far, sink, **kw)
        with pytest.raises(InputError, match=r"^block_table: expected a \(3, M\) int32"):
            fn(q, q_pos, cache_kv, cache_pos, table[:2], sink, **kw)
        with pytest.raises(InputError, match=r"^block_table: expected a \(3, M\) int32"):
            fn(q, q_pos, cache_kv, cache_pos, table.float(), sink, **kw)
    with pytest.raises(DSV4Error, match=r"^cache_kv: expected dtype"):
        opt_paged_attention(q, q_pos, cache_kv.to(BF16), cache_pos, table, sink, **kw)
    with pytest.raises(InputError, match=r"^cache_pos: expected an int32 / int64"):
        opt_paged_attention(q, q_pos, cache_kv, cache_pos.float(), table, sink, **kw)


def test_attention_with_a_paged_cache_rejects_bad_calls(device: str) -> None:
    pack = pack_attention(layer_params(BF16), device)
    pool = PagedKVCache(CFG, num_blocks=8, block_size=BS, dtype=BF16, device=device)
    table = torch.tensor([[5, 2, 7], [1, -1, -1]], dtype=torch.int32, device=device)
    x = torch.zeros(2, D, dtype=BF16, device=device)
    pos = torch.tensor([9, 3], device=device)
    good = torch.tensor([7 * BS + 1, 1 * BS + 3], device=device)  # blocks 7 and 1

    def kw(t: object = table, s: object = good) -> dict[str, object]:
        return dict(kv_cache=pool, block_table=t, slot_mapping=s)

    fp32_pool = PagedKVCache(CFG, num_blocks=8, block_size=BS, dtype=FP32, device=device)
    cases = [
        ("block_table: expected a \\(2, M\\)", kw(t=table[:1])),
        ("block_table: expected a \\(2, M\\)", kw(t=None)),
        ("slot_mapping: expected a 1-D", kw(s=None)),
        ("slot_mapping: expected -1 or the slot", kw(s=torch.tensor([29, 2], device=device))),
        ("slot_mapping: expected -1 or the slot", kw(s=torch.tensor([9, -1], device=device))),
        ("block_table: expected block indices", kw(t=table * 2)),
        ("block_table: expected None", dict(kv_cache=[KVCache(W)] * 2, seq_lens=[1, 1],
                                            block_table=table)),
        ("cache_slots: expected None", dict(kv_cache=pool, block_table=table, slot_mapping=good,
                                            cache_slots=_slots([0, 1], device))),
        ("kv_cache: expected a PagedKVCache", dict(kv_cache=fp32_pool, block_table=table,
                                                   slot_mapping=good)),
    ]  # fmt: skip
    for message, kwargs in cases:
        with pytest.raises(InputError, match="^" + message):
            opt_attention(x, pos, pack, CFG, **kwargs)  # type: ignore[arg-type]
    same = torch.tensor([[1, -1, -1], [1, -1, -1]], dtype=torch.int32, device=device)
    sevens = torch.tensor([7, 7], device=device)
    with pytest.raises(InputError, match=r"^slot_mapping: expected distinct"):
        opt_attention(x, torch.tensor([3, 3], device=device), pack, CFG, kv_cache=pool,
                      block_table=same, slot_mapping=sevens)  # fmt: skip
    assert int((pool.pos >= 0).sum()) == 0, "a refused call wrote the cache"


# ------------------------------------------------------------------------------ CUDA graphs
@pytest.mark.gpu
def test_captured_decode_step_replays_as_eager() -> None:
    """Decode through ``attention(kv_cache=PagedKVCache, block_table=, slot_mapping=)``
    captured in a CUDA graph (T = 3 with one padding row), replayed for five steps on new x,
    positions, tables and slots copied into the captured buffers: outputs and pool bitwise
    those of the same steps run eagerly on a copy of the pool."""
    dev = "cuda"
    pack = pack_attention(layer_params(BF16), dev)
    g = torch.Generator().manual_seed(9)

    def prefilled() -> tuple[PagedKVCache, _Engine]:
        pool = PagedKVCache(CFG, num_blocks=40, block_size=BS, dtype=BF16, device=dev)
        engine = _Engine(pool, 3, 12, seed=10)
        gp = torch.Generator().manual_seed(11)
        x = torch.randn(30, D, generator=gp).to(BF16).to(dev)
        pos = list(range(0, 10)) + list(range(20, 40))
        table, slots = engine.rows([0, 2], pos, [10, 20])
        opt_attention(x, torch.tensor(pos, device=dev), pack, CFG, seq_lens=[10, 20],
                      kv_cache=pool, block_table=table, slot_mapping=slots)  # fmt: skip
        return pool, engine

    (graphed, engine), (eager, eager_engine) = prefilled(), prefilled()
    scratch, scratch_engine = prefilled()
    x_buf = torch.zeros(3, D, dtype=BF16, device=dev)
    table, slots = scratch_engine.rows([0, 2, -1], [10, 40, 0])
    table_buf, slot_buf = table.clone(), slots.clone()
    pos_buf = torch.tensor([10, 40, 0], device=dev)
    out = torch.empty(3, D, dtype=BF16, device=dev)
    call = dict(kv_cache=scratch, block_table=table_buf, slot_mapping=slot_buf, out=out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt_attention(x_buf, pos_buf, pack, CFG, **call)  # type: ignore[arg-type]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    call["kv_cache"] = graphed
    with torch.cuda.graph(graph):
        opt_attention(x_buf, pos_buf, pack, CFG, **call)  # type: ignore[arg-type]
    last = {0: 9, 2: 39}
    for step in range(5):
        seqs = [0, 2, -1] if step % 2 == 0 else [2, -1, 0]
        pos = [last[s] + 1 if s >= 0 else 0 for s in seqs]
        for s in seqs:
            if s >= 0:
                last[s] += 1
        x = torch.randn(3, D, generator=g).to(BF16).to(dev)
        table, slots = engine.rows(seqs, pos)
        eager_table, eager_slots = eager_engine.rows(seqs, pos)
        x_buf.copy_(x)
        pos_buf.copy_(torch.tensor(pos, device=dev))
        table_buf.copy_(table)
        slot_buf.copy_(slots)
        graph.replay()
        want = opt_attention(x, torch.tensor(pos, device=dev), pack, CFG, kv_cache=eager,
                             block_table=eager_table, slot_mapping=eager_slots)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"step {step}"
        assert torch.equal(graphed.pos, eager.pos) and torch.equal(graphed.kv, eager.kv)


# -------------------------------------------------- the prefill checks, on the device, one read
_attn = importlib.import_module("dsv4mtp.optimized.attention")


def _random_paged_call(g: torch.Generator, device: str) -> tuple[object, ...]:
    """A valid paged prefill: (cache, lens, positions, block_table, slot_mapping); sequences of
    0 to 12 rows with gapped positions, one padding sequence (table row -1, slots -1, any
    positions), some rows not written (slot -1), a few pool rows already holding positions."""
    cache = PagedKVCache(CFG, num_blocks=40, block_size=BS, dtype=BF16, device=device)
    B = int(torch.randint(1, 5, (1,), generator=g))
    lens = [int(n) for n in torch.randint(0, 13, (B,), generator=g)]
    pos: list[int] = []
    for n in lens:
        start = int(torch.randint(0, 10, (1,), generator=g))
        pos += [start + int(d) for d in torch.randint(1, 3, (n,), generator=g).cumsum(0)]
    padding = int(torch.randint(0, B + 2, (1,), generator=g))  # B, B+1: none
    seqs = [-1 if b == padding else b for b in range(B)]
    engine = _Engine(cache, B, 10, int(torch.randint(0, 100, (1,), generator=g)))
    table, slot_mapping = engine.rows(seqs, pos, lens)
    positions = torch.tensor(pos, device=device)
    if padding < B:  # a padding sequence's positions are unchecked
        start = sum(lens[:padding])
        positions[start : start + lens[padding]] = torch.randint(
            -9, 9, (lens[padding],), generator=g
        ).to(device)
    slot_mapping[torch.rand(len(pos), generator=g).to(device) < 0.2] = -1
    for n in engine.free[:3]:  # rows an earlier call left
        cache.pos[n, 1] = 4 * int(torch.randint(0, 9, (1,), generator=g)) + 1
    return cache, lens, positions, table, slot_mapping


def test_paged_checks_on_the_device_refuse_what_the_host_checks_refuse(device: str) -> None:
    """Random paged prefills, valid or broken one way (a table entry < -1 or >= N, a pool row
    at the wrong offset, positions negative, >= 2^31 or falling, a slot not its position's, two
    rows on one slot): the call raises exactly the host checks' message, or nothing."""
    g = torch.Generator().manual_seed(41)
    broken = 0
    for case in range(60):
        cache, lens, pos, table, slot_mapping = _random_paged_call(g, device)
        assert isinstance(cache, PagedKVCache)
        kind, T = case % 8, pos.shape[0]
        t = int(torch.randint(0, max(T, 1), (1,), generator=g))
        if kind == 1:
            table[0, 0] = -2 if case % 16 == 1 else cache.num_blocks
        elif kind == 2:
            cache.pos[5, 2] = 5
        elif T and kind in (3, 4, 5):
            pos[t] = {3: -1, 4: 2**31, 5: pos[t] - 2}[kind]
        elif T and kind == 6:
            slot_mapping[t] = slot_mapping[t] + 1 if slot_mapping[t] >= 0 else 7
        elif T > 1 and kind == 7:
            slot_mapping[t], slot_mapping[(t + 1) % T] = 3, 3
        args = (pos, lens, cache, table, slot_mapping)
        want = _outcome(_attn._paged_sequences_error, *args)
        assert _outcome(_attn._check_paged_sequences, *args) == want, case
        broken += want != "ok"
    assert 20 < broken < 60
    # two sequences on one block, each row at its position's slot: the slots repeat
    cache = PagedKVCache(CFG, num_blocks=4, block_size=BS, dtype=BF16, device=device)
    table = torch.tensor([[2, -1], [2, -1]], dtype=torch.int32, device=device)
    args = (torch.tensor([1, 1], device=device), [1, 1], cache, table, _slots([9, 9], device))
    with pytest.raises(InputError, match=r"^slot_mapping: expected distinct slots"):
        _attn._check_paged_sequences(*args)


def _outcome(fn: Any, *args: object) -> str:
    try:
        fn(*args)
    except InputError as e:
        return str(e)
    return "ok"
