"""The device ring KV cache (``dsv4mtp.optimized.DeviceKVCache``) and the attention sublayer
over it.

Tiny config (D 256, H 4 x Dh 128 with 64 rope dims, window 16).  Every tensor that reaches an
optimized op lives on the ``device`` fixture's device (CUDA when present, else the CPU under the
Triton interpreter), so the same tests run on the GPU tier.  Covered: ring writes and reads
against the host :class:`KVCache` past wraparound; decode through ``attention(kv_cache=
DeviceKVCache)`` bitwise equal to the host-cache optimized path (contiguous positions) and within
the layer's declared tolerance of the reference (gapped positions); rollback then re-decode
bitwise equal to recomputation at the tightest capacity; padding rows; batch invariance; typed
errors; the operators (opcheck); and (gpu) a captured decode step replayed on new inputs.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from dsv4mtp.config import DSV4Config
from dsv4mtp.conformance import test_attention_layer as layer_tests
from dsv4mtp.conformance._mtp_random import random_attention_params
from dsv4mtp.errors import ConfigError, DSV4Error, InputError
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.optimized import DeviceKVCache, pack_attention
from dsv4mtp.optimized import attention as opt_attention
from dsv4mtp.optimized import sink_attention_cache as opt_cache_attention
from dsv4mtp.params import AttentionParams
from dsv4mtp.reference import attention as ref_attention
from dsv4mtp.reference import sink_attention_cache as ref_cache_attention

BF16, FP32 = torch.bfloat16, torch.float32
CFG = DSV4Config.tiny()
D, W, Dh = CFG.hidden_size, CFG.sliding_window, CFG.head_dim
OFFICIAL = dict(fp8_kv=True, act_quant=True, norm_order="official")


def layer_params(dtype: torch.dtype, seed: int = 0) -> AttentionParams:
    """Random params as a layer keeps them: linears in the activation dtype, norms and sinks
    in fp32."""
    p = random_attention_params(CFG, torch.Generator().manual_seed(seed))
    lin = {"wq_a", "wq_b", "wkv", "wo_a", "wo_b"}
    return AttentionParams(
        **{
            f.name: getattr(p, f.name).to(dtype if f.name in lin else FP32)
            for f in dataclasses.fields(p)
        }
    )


def _slots(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _rows(g: torch.Generator, T: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(T, D, generator=g).to(dtype).to(device)


def _assert_same_cache(got: KVCache, want: KVCache, what: str) -> None:
    assert got.positions is not None and want.positions is not None, what
    assert torch.equal(got.positions.cpu(), want.positions.cpu()), what
    assert got.kv is not None and want.kv is not None
    assert torch.equal(got.kv.cpu(), want.kv.cpu()), what


# ------------------------------------------------------------------------------ the ring alone
def test_ring_writes_read_back_as_the_host_cache_past_wraparound(device: str) -> None:
    """Rows written one call at a time (a 5-row prefill, then 40 single rows, some position
    gaps, the ring of 16 rows wrapping around several times) read back through ``to_host``
    exactly as a host KVCache fed the same rows keeps them; ``load`` round-trips."""
    cache = DeviceKVCache(CFG, num_seqs=2, max_draft=0, dtype=BF16, device=device)
    assert cache.capacity == 16 and cache.nbytes == 2 * 16 * (Dh * 2 + 4)
    host = KVCache(W)
    g = torch.Generator().manual_seed(1)
    steps = [torch.arange(300, 305)]
    last = 304
    for i in range(40):
        last += 1 + (i % 7 == 3) * 2  # gaps of 2 now and then
        steps.append(torch.tensor([last]))
    for pos in steps:
        rows = torch.randn(pos.shape[0], Dh, generator=g).to(BF16)
        cache.write(rows.to(device), pos.to(device), torch.ones_like(pos, device=device))
        host.append(rows, pos)
        _assert_same_cache(cache.to_host(1), host, f"after position {int(pos[-1])}")
        ring = torch.arange(cache.capacity, device=device)
        assert bool(((cache.pos < 0) | (cache.pos % cache.capacity == ring)).all()), "layout"
    assert len(cache.to_host(0)) == 0, "slot 0 was never written"
    cache.load(0, host)
    _assert_same_cache(cache.to_host(0), host, "load")
    cache.reset(_slots([1], device))
    assert len(cache.to_host(1)) == 0 and len(cache.to_host(0)) == len(host)
    cache.reset()
    assert int(cache.pos.max()) == -1


# ------------------------------------------------------------------------------ decode
def test_decode_is_bitwise_the_host_cache_path(device: str) -> None:
    """A prefill of two sequences (slots 2 and 0 of 3), then decode steps (T = 2, seq_lens
    None) until the ring of 16 rows has wrapped: every output bitwise equal to the optimized
    host-KVCache path, and the caches too.

    Bitwise, not within a tolerance: the rows are the same ops' outputs, the prefill runs the
    same varlen launch over the same keys, and with contiguous positions the ring kernel walks
    the visible keys in the same blocks and lanes as the varlen kernel (kernels/
    sink_attention.py).  Official preset (fp8_kv rows), the ring's kv poisoned with NaN first:
    a row never written is never read."""
    pack = pack_attention(layer_params(BF16), device)
    cache = DeviceKVCache(CFG, num_seqs=3, max_draft=0, dtype=BF16, device=device)
    cache.kv.fill_(float("nan"))
    hosts = [KVCache(W), KVCache(W)]
    slots = _slots([2, 0], device)
    g = torch.Generator().manual_seed(2)
    pos = torch.cat([torch.arange(40, 54), torch.arange(0, 5)]).to(device)
    x = _rows(g, 19, BF16, device)
    got = opt_attention(x, pos, pack, CFG, seq_lens=[14, 5], kv_cache=cache, cache_slots=slots,
                        **OFFICIAL)  # fmt: skip
    want = opt_attention(x, pos, pack, CFG, seq_lens=[14, 5], kv_cache=hosts, **OFFICIAL)
    assert torch.equal(got, want), "prefill"
    last = [53, 4]  # the next five positions of slot 2 overwrite rows of 38..42
    for step in range(5):
        last = [p + 1 for p in last]
        x, pos = _rows(g, 2, BF16, device), torch.tensor(last, device=device)
        got = opt_attention(x, pos, pack, CFG, kv_cache=cache, cache_slots=slots, **OFFICIAL)
        want = opt_attention(x, pos, pack, CFG, seq_lens=[1, 1], kv_cache=hosts, **OFFICIAL)
        assert torch.isfinite(got).all()
        assert torch.equal(got, want), f"decode step {step}"
    for slot, host in zip((2, 0), hosts, strict=True):
        _assert_same_cache(cache.to_host(slot), host, f"slot {slot}")
    assert len(cache.to_host(1)) == 0


def test_prefill_against_filled_rings_is_bitwise_the_host_cache_path(device: str) -> None:
    """Multi-row calls against rings that already hold rows (a chunked prefill, a verify step):
    a batch of a 3-row chunk, a decode row, an empty sequence, a padding sequence and a chunk
    of 40 rows (more than the ring's 32: only the last 32 are written), after a first prefill.
    Bitwise the host-KVCache path without the padding sequence (the same varlen launch over
    the same keys; batch_invariant=True, the two calls differ in T), caches too; the padding
    sequence's output rows are zero."""
    pack = pack_attention(layer_params(BF16), device)
    cache = DeviceKVCache(CFG, num_seqs=5, dtype=BF16, device=device)
    hosts = [KVCache(W) for _ in range(4)]
    g = torch.Generator().manual_seed(10)
    first_lens = [20, 6, 2, 9]
    pos = torch.cat([torch.arange(20), torch.arange(50, 56), torch.arange(7, 9), torch.arange(9)])
    x = _rows(g, 37, BF16, device)
    pos = pos.to(device)
    slots = _slots([3, 0, 4, 1], device)
    got = opt_attention(x, pos, pack, CFG, seq_lens=first_lens, kv_cache=cache, cache_slots=slots)
    want = opt_attention(x, pos, pack, CFG, seq_lens=first_lens, kv_cache=hosts)
    assert torch.equal(got, want), "first prefill"
    lens = [3, 1, 0, 2, 40]
    pos = torch.cat([torch.arange(20, 23), torch.tensor([56]), torch.tensor([0, 1]),
                     torch.arange(9, 49)]).to(device)  # fmt: skip
    x = _rows(g, 46, BF16, device)
    slots = _slots([3, 0, 4, -1, 1], device)
    got = opt_attention(x, pos, pack, CFG, seq_lens=lens, kv_cache=cache, cache_slots=slots,
                        batch_invariant=True)  # fmt: skip
    host_lens, rows = [3, 1, 0, 40], torch.cat([torch.arange(4), torch.arange(6, 46)])
    want = opt_attention(x[rows.to(device)], pos[rows.to(device)], pack, CFG, seq_lens=host_lens,
                         kv_cache=hosts, batch_invariant=True)  # fmt: skip
    assert torch.equal(got[rows.to(device)], want)
    assert got[4:6].abs().max() == 0, "padding rows"
    for slot, host in zip((3, 0, 4, 1), hosts, strict=True):
        _assert_same_cache(cache.to_host(slot), host, f"slot {slot}")
    assert len(cache.to_host(2)) == 0


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_decode_with_position_gaps_is_within_the_layer_tolerance(
    dtype: torch.dtype, device: str
) -> None:
    """Gaps in the positions (one wider than the window): the ring kernel's blocks start at the
    first visible position, the varlen kernel's at the first visible key, so the fp32 sums
    differ in order; the outputs stay within the sublayer's declared tolerance of the reference
    (``TOL`` of test_attention_layer.py)."""
    params = layer_params(dtype)
    pack = pack_attention(params, device)
    cache = DeviceKVCache(CFG, num_seqs=2, max_draft=0, dtype=dtype, device=device)
    refs = [KVCache(W), KVCache(W)]
    slots = _slots([1, 0], device)
    g = torch.Generator().manual_seed(3)
    pos = torch.tensor([0, 2, 3, 7, 100, 101, 104])
    x = torch.randn(7, D, generator=g).to(dtype)
    lens = [4, 3]
    got = opt_attention(x.to(device), pos.to(device), pack, CFG, seq_lens=lens, kv_cache=cache,
                        cache_slots=slots)  # fmt: skip
    want = ref_attention(x, pos, params, CFG, seq_lens=lens, kv_cache=refs)
    assert layer_tests.rel_err(got.cpu(), want) < layer_tests.TOL[dtype], "prefill"
    last = [7, 104]
    for step, gap in enumerate((1, 3, 2, W + 1, 1, 2)):
        last = [last[0] + gap, last[1] + 1 + step % 2]
        x, pos = torch.randn(2, D, generator=g).to(dtype), torch.tensor(last)
        got = opt_attention(x.to(device), pos.to(device), pack, CFG, kv_cache=cache,
                            cache_slots=slots)  # fmt: skip
        want = ref_attention(x, pos, params, CFG, seq_lens=[1, 1], kv_cache=refs)
        assert layer_tests.rel_err(got.cpu(), want) < layer_tests.TOL[dtype], f"step {step}"


def test_rollback_then_decode_equals_recomputation(device: str) -> None:
    """At the tightest ring (C = window + max_draft - 1 = 18 for three draft steps, through
    ``from_tensors``): after a prefill and a decode step, three draft steps; rollback keeps
    none of sequence 0's drafts and two of sequence 1's.  Three more decode steps then give
    bitwise the outputs (and rings) of a fresh cache that never saw the rejected drafts
    (sequence 1's accepted drafts fed to it with sequence 0 as a padding row)."""
    pack = pack_attention(layer_params(BF16), device)
    C = W + 3 - 1
    g = torch.Generator().manual_seed(4)
    slots = _slots([0, 1], device)
    prefill_x = _rows(g, 37, BF16, device)  # more rows than the ring holds: drafts overwrite
    prefill_pos = torch.cat([torch.arange(20), torch.arange(500, 517)]).to(device)
    accepted = [_rows(g, 2, BF16, device)]
    drafts = [_rows(g, 2, BF16, device) for _ in range(3)]
    after = [_rows(g, 2, BF16, device) for _ in range(3)]

    def step(cache: DeviceKVCache, x: torch.Tensor, pos: list[int], sl: torch.Tensor):
        return opt_attention(x, torch.tensor(pos, device=device), pack, CFG, kv_cache=cache,
                             cache_slots=sl, batch_invariant=True)  # fmt: skip

    def run(rollback: bool) -> tuple[list[torch.Tensor], list[KVCache]]:
        kv = torch.full((2, C, Dh), float("nan"), dtype=BF16, device=device)
        pos = torch.full((2, C), -1, dtype=torch.int32, device=device)
        cache = DeviceKVCache.from_tensors(kv, pos, W)
        opt_attention(prefill_x, prefill_pos, pack, CFG, seq_lens=[20, 17], kv_cache=cache,
                      cache_slots=slots, batch_invariant=True)  # fmt: skip
        step(cache, accepted[0], [20, 517], slots)
        if rollback:  # positions 21..23 and 518..520 overwrite 3..5 and 500..502
            for i, x in enumerate(drafts):
                step(cache, x, [21 + i, 518 + i], slots)
            cache.rollback(slots, torch.tensor([20, 519], device=device))
        else:
            for i, x in enumerate(drafts[:2]):
                step(cache, x, [0, 518 + i], _slots([-1, 1], device))
        outs = [step(cache, x, [21 + i, 520 + i], slots) for i, x in enumerate(after)]
        return outs, [cache.to_host(0), cache.to_host(1)]

    drafted, drafted_rings = run(rollback=True)
    recomputed, recomputed_rings = run(rollback=False)
    for i, (a, b) in enumerate(zip(drafted, recomputed, strict=True)):
        assert torch.equal(a, b), f"decode step {i} after the rollback"
    for s in (0, 1):
        _assert_same_cache(drafted_rings[s], recomputed_rings[s], f"slot {s}")


def test_padding_rows_write_nothing_and_change_no_other_row(device: str) -> None:
    """A padding row (slot -1) among real ones: the real rows' outputs are bitwise those of the
    same call without it, the rings are bitwise those it leaves, and its own output is zero."""
    pack = pack_attention(layer_params(BF16), device)
    g = torch.Generator().manual_seed(5)
    x = _rows(g, 3, BF16, device)
    pos = torch.tensor([20, 7, 31], device=device)
    base = torch.randn(3, Dh, generator=g).to(BF16).to(device)
    caches = []
    for slots, rows in (([0, -1, 1], [0, 1, 2]), ([0, 1], [0, 2])):
        cache = DeviceKVCache(CFG, num_seqs=3, dtype=BF16, device=device)
        cache.write(base, torch.tensor([18, 19, 6], device=device), _slots([0, 0, 1], device))
        r = torch.tensor(rows, device=device)
        out = opt_attention(x[r], pos[r], pack, CFG, kv_cache=cache,
                            cache_slots=_slots(slots, device), batch_invariant=True)  # fmt: skip
        caches.append((cache, out))
    (padded, with_pad), (plain, without) = caches
    assert torch.equal(with_pad[[0, 2]], without)
    assert with_pad[1].abs().max() == 0
    assert torch.equal(padded.pos, plain.pos) and torch.equal(padded.kv, plain.kv)
    assert int((padded.pos[2] >= 0).sum()) == 0, "slot 2 written"


def test_batch_invariant_rows_are_bitwise_the_same_alone(device: str) -> None:
    """batch_invariant=True: each decode row of a three-sequence step equals the same row
    computed alone (its own slot, T = 1)."""
    pack = pack_attention(layer_params(BF16), device)
    g = torch.Generator().manual_seed(6)
    base = torch.randn(9, Dh, generator=g).to(BF16).to(device)
    base_pos = torch.tensor([0, 1, 2, 3, 40, 41, 42, 43, 44], device=device)
    base_slots = _slots([0, 0, 0, 0, 2, 2, 2, 2, 2], device)
    x = _rows(g, 2, BF16, device)
    pos = torch.tensor([4, 45], device=device)

    def run(rows: list[int], slots: list[int]) -> torch.Tensor:
        cache = DeviceKVCache(CFG, num_seqs=3, dtype=BF16, device=device)
        cache.write(base, base_pos, base_slots)
        r = torch.tensor(rows, device=device)
        return opt_attention(x[r], pos[r], pack, CFG, kv_cache=cache,
                             cache_slots=_slots(slots, device), batch_invariant=True)  # fmt: skip

    both = run([0, 1], [0, 2])
    assert torch.equal(both[0:1], run([0], [0]))
    assert torch.equal(both[1:2], run([1], [2]))


# ------------------------------------------------------------------------------ the core op
def test_cache_op_matches_the_reference_on_hand_built_rings(device: str) -> None:
    """A ring with a stale newer row, one wrapped around, an empty one and a padding row, NaN in
    the empty rows: the optimized op within the attention core's fp32 tolerance of the float64
    reference; a query past its window sees nothing (0)."""
    import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs)
    from dsv4mtp.conformance.registry import REGISTRY

    g = torch.Generator().manual_seed(7)
    H, C, S, w = 4, 16, 3, 8
    kv = torch.randn(S, C, 64, generator=g)
    pos = torch.full((S, C), -1, dtype=torch.int32)
    for s, (start, n) in enumerate([(10, 21), (0, 3)]):
        for p in range(start, start + n):
            pos[s, p % C] = p
    kv[pos < 0] = float("nan")
    q = torch.randn(6, H, 64, generator=g)
    q_pos = torch.tensor([29, 2, 5, 27, 3, 60])  # row 3: stale rows 28..30 not visible
    slots = torch.tensor([0, 1, 2, 0, -1, 0])
    sink = torch.randn(H, generator=g)
    kw = dict(window=w, scale=0.125)
    want = ref_cache_attention(q.double(), q_pos, kv.double(), pos, slots, sink.double(), **kw)
    got = opt_cache_attention(*(t.to(device) for t in (q, q_pos, kv, pos, slots, sink)), **kw)
    tol = REGISTRY["sink_attention_cache"].tolerance(FP32)
    rel = float((got.cpu().double() - want).norm() / want.norm())
    assert rel < tol.rel
    assert all(got[b].abs().max() == 0 for b in (2, 4, 5)) and got[0].abs().max() > 0


@pytest.mark.parametrize("variant", ["", "_out"])
@pytest.mark.parametrize("op", ["sink_attention_cache", "kv_cache_write"])
def test_cache_opcheck(op: str, variant: str, device: str) -> None:
    """Schema, fake kernel and AOT dispatch of the operators (torch.library.opcheck)."""
    from dsv4mtp.conformance.inputs import cache_attention_inputs

    dtype = BF16 if device == "cuda" else FP32
    args, kw = cache_attention_inputs(3, 0, shape="tiny", dtype=dtype, device=device)
    if op == "sink_attention_cache":
        call: tuple[object, ...] = (*args, kw["window"], kw["scale"], "triton", [])
        outs = {"out": torch.empty_like(args[0])} if variant else {}
    else:
        cache_kv, cache_pos = args[2], args[3]
        new = torch.randn(2, cache_kv.shape[2], device=device).to(dtype)
        call = (new, torch.tensor([2000, 7], device=device), _slots([1, -1], device))
        cache_kv = torch.nan_to_num(cache_kv)  # opcheck compares outputs: no NaN
        tensors = (cache_kv.clone(), cache_pos.clone())
        if variant:
            outs = {"cache_kv": tensors[0], "cache_pos": tensors[1]}
        else:
            call, outs = (*call, *tensors), {}
    torch.library.opcheck(getattr(torch.ops.dsv4mtp, op + variant).default, call, outs)


# ------------------------------------------------------------------------------ errors
def test_bad_arguments_raise_typed_errors(device: str) -> None:
    with pytest.raises(InputError, match=r"^num_seqs"):
        DeviceKVCache(CFG, num_seqs=0, dtype=BF16, device=device)
    with pytest.raises(InputError, match=r"^max_draft"):
        DeviceKVCache(CFG, num_seqs=1, max_draft=-1, dtype=BF16, device=device)
    with pytest.raises(InputError, match=r"^dtype"):
        DeviceKVCache(CFG, num_seqs=1, dtype=torch.float64, device=device)
    with pytest.raises(InputError, match=r"^device"):
        DeviceKVCache(CFG, num_seqs=1, dtype=BF16, device="tpu")
    with pytest.raises(InputError, match=r"^config"):
        DeviceKVCache(object(), num_seqs=1, dtype=BF16, device=device)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^head_dim"):
        DeviceKVCache(CFG.replace(head_dim=120), num_seqs=1, dtype=BF16, device=device)
    kv = torch.zeros(2, 20, Dh, dtype=BF16, device=device)
    pos32 = torch.full((2, 20), -1, dtype=torch.int32, device=device)
    with pytest.raises(InputError, match=r"^pos: expected an int32"):
        DeviceKVCache.from_tensors(kv, pos32.long(), W)
    with pytest.raises(InputError, match=r"^pos: expected shape"):
        DeviceKVCache.from_tensors(kv, pos32[:, :10], W)
    with pytest.raises(InputError, match=r"^kv: expected a capacity"):
        DeviceKVCache.from_tensors(kv, pos32, 21)
    cache = DeviceKVCache.from_tensors(kv, pos32, W)
    with pytest.raises(InputError, match=r"^last_kept"):
        cache.rollback(_slots([0, 1], device), _slots([3], device))
    with pytest.raises(InputError, match=r"^slots: expected slot indices < num_seqs=2"):
        cache.rollback(_slots([0, 2], device), _slots([3, 3], device))
    with pytest.raises(InputError, match=r"^kv: expected"):
        cache.write(kv[0, :2].float(), torch.arange(2, device=device), _slots([0, 0], device))
    with pytest.raises(InputError, match=r"^slot"):
        cache.to_host(2)


def test_attention_with_a_device_cache_rejects_bad_calls(device: str) -> None:
    pack = pack_attention(layer_params(BF16), device)
    cache = DeviceKVCache(CFG, num_seqs=2, dtype=BF16, device=device)
    cache.write(torch.zeros(1, Dh, dtype=BF16, device=device), torch.tensor([9], device=device),
                _slots([0], device))  # fmt: skip
    x = torch.zeros(2, D, dtype=BF16, device=device)
    pos = torch.tensor([10, 3], device=device)

    def slots(*v: int) -> dict[str, object]:
        return dict(kv_cache=cache, cache_slots=_slots(list(v), device))

    fp32_cache = DeviceKVCache(CFG, num_seqs=2, dtype=FP32, device=device)
    cases = [
        ("cache_slots: expected a 1-D", dict(kv_cache=cache)),
        ("cache_slots: expected shape", slots(0)),
        ("cache_slots: expected distinct", slots(0, 0)),
        ("cache_slots: expected distinct", slots(0, 2)),
        ("cache_slots: expected None", dict(kv_cache=[KVCache(W)] * 2, seq_lens=[1, 1],
                                            cache_slots=_slots([0, 1], device))),
        ("positions: sequence 0 starts at 9", slots(0, 1)),
        ("positions: expected positions in", slots(1, 0)),
        ("kv_cache: expected a DeviceKVCache", dict(kv_cache=fp32_cache,
                                                    cache_slots=_slots([0, 1], device))),
    ]  # fmt: skip
    bad_pos = {
        "positions: sequence 0 starts at 9": [9, 3],
        "positions: expected positions in": [10, -1],
    }
    for message, kw in cases:
        p = torch.tensor(bad_pos[message], device=device) if message in bad_pos else pos
        with pytest.raises(InputError, match="^" + message):
            opt_attention(x, p, pack, CFG, **kw)  # type: ignore[arg-type]
    assert int((cache.pos >= 0).sum()) == 1, "a refused call wrote the cache"


def test_cache_op_rejects_broken_rings_as_the_reference(device: str) -> None:
    from dsv4mtp.conformance.inputs import cache_attention_inputs

    args, kw = cache_attention_inputs(3, 1, shape="tiny", dtype=FP32, device=device)
    q, q_pos, cache_kv, cache_pos, slots, sink = args
    moved = cache_pos.clone()
    moved[0, 0] = 17  # position 17 belongs at row 1 of a 16-row ring
    far = slots.clone()
    far[1] = cache_kv.shape[0]
    for fn in (ref_cache_attention, opt_cache_attention):
        with pytest.raises(InputError, match=r"^cache_pos: expected -1 \(empty\) or the position"):
            fn(q, q_pos, cache_kv, moved, slots, sink, **kw)
        with pytest.raises(InputError, match=r"^slots: expected ring indices < S="):
            fn(q, q_pos, cache_kv, cache_pos, far, sink, **kw)
    with pytest.raises(DSV4Error, match=r"^cache_kv: expected dtype"):
        opt_cache_attention(q, q_pos, cache_kv.to(BF16), cache_pos, slots, sink, **kw)


# ------------------------------------------------------------------------------ CUDA graphs
@pytest.mark.gpu
def test_captured_decode_step_replays_as_eager() -> None:
    """V4-like bf16 decode through ``attention(kv_cache=DeviceKVCache, cache_slots=...)``
    captured in a CUDA graph (T = 4 with one padding row), replayed for five steps on new x,
    positions and slots copied into the captured buffers: outputs and rings bitwise those of
    the same steps run eagerly on a copy of the cache."""
    dev = "cuda"
    pack = pack_attention(layer_params(BF16), dev)
    g = torch.Generator().manual_seed(8)

    def prefilled() -> DeviceKVCache:
        cache = DeviceKVCache(CFG, num_seqs=6, dtype=BF16, device=dev)
        gp = torch.Generator().manual_seed(9)
        x = torch.randn(30, D, generator=gp).to(BF16).to(dev)
        pos = torch.cat([torch.arange(0, 10), torch.arange(100, 120)]).to(dev)
        opt_attention(x, pos, pack, CFG, seq_lens=[10, 20], kv_cache=cache,
                      cache_slots=_slots([1, 4], dev))  # fmt: skip
        return cache

    graphed, eager = prefilled(), prefilled()
    x_buf = torch.zeros(4, D, dtype=BF16, device=dev)
    pos_buf = torch.tensor([10, 120, 0, 0], device=dev)
    slot_buf = _slots([1, 4, -1, 3], dev)
    out = torch.empty(4, D, dtype=BF16, device=dev)
    scratch = prefilled()  # the warm-up call's writes go here
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt_attention(x_buf, pos_buf, pack, CFG, kv_cache=scratch, cache_slots=slot_buf, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_attention(x_buf, pos_buf, pack, CFG, kv_cache=graphed, cache_slots=slot_buf, out=out)
    last = {1: 9, 4: 119, 3: -1}
    for step in range(5):
        slots = [1, 4, -1, 3] if step % 2 == 0 else [4, -1, 1, 3]
        pos = [last[s] + 1 if s >= 0 else 0 for s in slots]
        for s in slots:
            if s >= 0:
                last[s] += 1
        x = torch.randn(4, D, generator=g).to(BF16).to(dev)
        x_buf.copy_(x)
        pos_buf.copy_(torch.tensor(pos, device=dev))
        slot_buf.copy_(_slots(slots, dev))
        graph.replay()
        want = opt_attention(x, torch.tensor(pos, device=dev), pack, CFG, kv_cache=eager,
                             cache_slots=_slots(slots, dev))  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"step {step}"
        assert torch.equal(graphed.pos, eager.pos) and torch.equal(graphed.kv, eager.kv)


@pytest.mark.gpu
@pytest.mark.parametrize("slow", [False, True], ids=["side", "slow_side"])
@pytest.mark.parametrize("fp8_kv", [False, True], ids=["math", "fp8_kv"])
def test_kv_path_on_the_side_stream_gives_the_in_line_bits(
    fp8_kv: bool, slow: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At decode the attention runs its kv path (norm + RoPE, ring write) on a side stream
    beside the q path: outputs and rings bitwise those of the same steps with the kv path in
    line (``KV_SIDE_STREAM`` off), over steps that wrap the ring, and the side stream was the
    one used.  ``slow``: the side stream first spins ~5 ms, so the q path runs well ahead of the
    kv path's reads: the kv rows must stay allocated until the join (freed at the fork, the q
    path's outputs would take their block and the kv path would read those instead)."""
    attention_module = importlib.import_module("dsv4mtp.optimized.attention")
    dev = "cuda"
    pack = pack_attention(layer_params(BF16), dev)
    caches = [DeviceKVCache(CFG, num_seqs=3, max_draft=0, dtype=BF16, device=dev) for _ in "ab"]
    slots = _slots([2, 0, -1], dev)
    g = torch.Generator().manual_seed(5)
    last = [30, 3, 0]
    spied: list[torch.cuda.Stream | None] = []
    side_stream = attention_module._kv_side_stream

    def spy(d: torch.device) -> torch.cuda.Stream | None:
        spied.append(side_stream(d))
        if slow and spied[-1] is not None:
            with torch.cuda.stream(spied[-1]):
                torch.cuda._sleep(10_000_000)  # ~5 ms of clock cycles before the kv path
        return spied[-1]

    monkeypatch.setattr(attention_module, "_kv_side_stream", spy)
    for step in range(W + 3):
        last = [last[0] + 1, last[1] + 1, 0]
        x, pos = _rows(g, 3, BF16, dev), torch.tensor(last, device=dev)
        outs = []
        for cache, on in zip(caches, (True, False), strict=True):
            monkeypatch.setattr(attention_module, "KV_SIDE_STREAM", on)
            outs.append(opt_attention(x, pos, pack, CFG, kv_cache=cache, cache_slots=slots,
                                      fp8_kv=fp8_kv))  # fmt: skip
        torch.cuda.synchronize()
        assert torch.isfinite(outs[0]).all()
        assert torch.equal(outs[0], outs[1]), f"step {step}"
        assert torch.equal(caches[0].kv, caches[1].kv) and torch.equal(caches[0].pos, caches[1].pos)
    assert spied[0] is not None and spied[1] is None  # the side stream, then in line


@pytest.mark.gpu
def test_captured_rollback_and_write_replay_as_eager() -> None:
    """``rollback`` and ``write`` captured in one CUDA graph, replayed on new slots, bounds,
    rows and positions: the rings bitwise those of the same calls run eagerly."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(11)

    def filled() -> DeviceKVCache:
        cache = DeviceKVCache(CFG, num_seqs=4, dtype=BF16, device=dev)
        pos = torch.arange(40, device=dev).repeat(4)
        slots = torch.arange(4, device=dev).repeat_interleave(40)
        keep = pos >= 40 - cache.capacity
        rows = torch.randn(
            160, Dh, device=dev, generator=torch.Generator(device=dev).manual_seed(12)
        )
        cache.write(rows[keep].to(BF16), pos[keep], slots[keep])
        return cache

    graphed, eager = filled(), filled()
    slot_buf, keep_buf = _slots([0, 2, -1], dev), torch.tensor([30, 35, 0], device=dev)
    rows_buf = torch.zeros(3, Dh, dtype=BF16, device=dev)
    pos_buf = torch.tensor([31, 36, 0], device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (JIT) on a scratch cache
        scratch = filled()
        scratch.rollback(slot_buf, keep_buf)
        scratch.write(rows_buf, pos_buf, slot_buf)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.rollback(slot_buf, keep_buf)
        graphed.write(rows_buf, pos_buf, slot_buf)
    for slots, keep in (([0, 2, -1], [30, 35, 0]), ([3, -1, 1], [20, 0, 38])):
        rows = torch.randn(3, Dh, device=dev, generator=g).to(BF16)
        pos = [k + 1 for k in keep]
        slot_buf.copy_(_slots(slots, dev))
        keep_buf.copy_(torch.tensor(keep, device=dev))
        rows_buf.copy_(rows)
        pos_buf.copy_(torch.tensor(pos, device=dev))
        graph.replay()
        eager.rollback(_slots(slots, dev), torch.tensor(keep, device=dev))
        eager.write(rows, torch.tensor(pos, device=dev), _slots(slots, dev))
        torch.cuda.synchronize()
        assert torch.equal(graphed.pos, eager.pos) and torch.equal(graphed.kv, eager.kv), slots


# ------------------------------------------------- the ring prefill's device-built bookkeeping
_attn = importlib.import_module("dsv4mtp.optimized.attention")


def _random_rings(g: torch.Generator, S: int, device: str) -> tuple[DeviceKVCache, list[int]]:
    """S rings of random rows at valid places (gaps, wraparound, some empty): -> (the cache,
    each ring's newest position, -1 for an empty one)."""
    cache = DeviceKVCache(CFG, num_seqs=S, dtype=BF16, device=device)
    C, newest = cache.capacity, []
    for s in range(S):
        if float(torch.rand(1, generator=g)) < 0.25:
            newest.append(-1)
            continue
        last = int(torch.randint(0, 90, (1,), generator=g))
        keep = torch.rand(C, generator=g) < 0.7
        ps = [
            p
            for i, p in enumerate(range(last - C + 1, last + 1))
            if p >= 0 and (keep[i] or p == last)
        ]
        rows = torch.randn(len(ps), Dh, generator=g).to(BF16).to(device)
        cache.write(rows, torch.tensor(ps, device=device), torch.full((len(ps),), s, device=device))
        newest.append(last)
    return cache, newest


def _random_ring_call(
    g: torch.Generator, device: str
) -> tuple[DeviceKVCache, list[int], torch.Tensor, torch.Tensor]:
    """A valid prefill against random rings: (cache, lens, positions, slots); lengths 0 to 40
    (past the ring's C = 32), distinct slots, some sequences padding (slot -1, any positions)."""
    S = 6
    cache, newest = _random_rings(g, S, device)
    B = int(torch.randint(1, S + 1, (1,), generator=g))
    slots = torch.randperm(S, generator=g)[:B]
    slots[torch.rand(B, generator=g) < 0.25] = -1
    lens = [int(n) for n in torch.randint(0, 41, (B,), generator=g)]
    lens[int(torch.randint(0, B, (1,), generator=g))] = max(lens[0], 2)  # some prefill
    pos: list[int] = []
    for b, n in enumerate(lens):
        if slots[b] < 0:  # padding: unchecked, any positions
            pos += [int(p) for p in torch.randint(-5, 50, (n,), generator=g)]
            continue
        start = newest[int(slots[b])] + 1 + int(torch.randint(0, 20, (1,), generator=g))
        steps = torch.randint(1, 4, (n,), generator=g).cumsum(0) - 1
        pos += [start + int(d) for d in steps]
    return cache, lens, torch.tensor(pos, device=device), slots.to(device)


def _host_ring_keys(
    kv: torch.Tensor, positions: torch.Tensor, lens: list[int], cache: DeviceKVCache,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, list[int], list[int], list[int]]:  # fmt: skip
    """The ring prefill's keys built row by row on the host: each live sequence's ring rows
    with p >= 0 and p > first - window in position order, then its new rows; the rows written
    (its slot for positions > last - C, else -1).  -> (keys, their positions, cu_k, owners)."""
    C, W = cache.capacity, cache.window
    slot, pos, rings = slots.tolist(), positions.tolist(), cache.pos.tolist()
    keys, key_pos, cu_k, owners = [], [], [0], [-1] * len(pos)
    start = 0
    for b, n in enumerate(lens):
        rows = range(start, start + n)
        start += n
        if slot[b] < 0 or n == 0:
            cu_k.append(cu_k[-1])
            continue
        first, last = pos[rows[0]], pos[rows[-1]]
        seen = sorted((p, r) for r, p in enumerate(rings[slot[b]]) if p >= 0 and p > first - W)
        keys += [cache.kv[slot[b], r] for _, r in seen] + [kv[t] for t in rows]
        key_pos += [p for p, _ in seen] + [pos[t] for t in rows]
        cu_k.append(cu_k[-1] + len(seen) + n)
        for t in rows:
            owners[t] = slot[b] if pos[t] > last - C else -1
    return (torch.stack(keys) if keys else kv[:0]), key_pos, cu_k, owners


def test_ring_prefill_keys_are_the_host_construction(device: str) -> None:
    """The device-built keys of a ring prefill (one host read of a few sizes) on random varlen
    calls: the same rows in the same places, the same positions, offsets and written rows as
    the row-by-row host construction."""
    g = torch.Generator().manual_seed(31)
    for case in range(40):
        cache, lens, pos, slots = _random_ring_call(g, device)
        kv = torch.randn(pos.shape[0], Dh, generator=g).to(BF16).to(device)
        plan = _attn._check_ring_sequences(pos, lens, cache, slots, True)
        assert plan is not None and plan.trusted
        keys, key_pos, owners = _attn._ring_keys(kv, pos, cache, plan)
        want_keys, want_pos, want_cu, want_owners = _host_ring_keys(kv, pos, lens, cache, slots)
        assert torch.equal(keys.cpu(), want_keys.cpu()), case
        assert key_pos.tolist() == want_pos, case
        assert plan.cu_k.tolist() == want_cu and plan.keys == want_cu[-1], case
        assert plan.cached == sum(want_cu[b + 1] - want_cu[b] - n for b, n in enumerate(lens)
                                  if want_cu[b + 1] > want_cu[b]), case  # fmt: skip
        assert owners.dtype == torch.int32 and owners.tolist() == want_owners, case


# What building a ring prefill's keys may run on the host besides its two launches: tensor
# allocations and the host-to-device copies of the row and key offsets (no compute).
_HOST_SIDE_OPS = {
    "aten.empty.memory_format", "aten.new_empty.default", "aten.lift_fresh.default",
    "aten._to_copy.default", "aten._pin_memory.default", "aten.copy_.default",
    "aten.is_pinned.default",
}  # fmt: skip


def test_ring_prefill_keys_take_two_launches_and_one_host_read(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks and keys of a ring prefill: the index and the keys kernels, one host read (the
    index's 3 x B ints, which also size the keys) and no tensor compute on the host side (each
    small tensor op costs a dispatch and a launch: tens of microseconds on the H200's host)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from dsv4mtp.optimized.kernels._launch import TritonLaunch

    g = torch.Generator().manual_seed(33)
    cache, lens, pos, slots = _random_ring_call(g, device)
    kv = torch.randn(pos.shape[0], Dh, generator=g).to(BF16).to(device)
    launches: list[str] = []
    run = TritonLaunch.__call__

    def counted(self: TritonLaunch, grid: tuple[int, ...], *args: Any) -> None:
        launches.append(self.jit.fn.__name__)
        with _disable_current_modes():  # the interpreter's own copies are the kernel's
            run(self, grid, *args)

    monkeypatch.setattr(TritonLaunch, "__call__", counted)
    reads = [0]
    for name in ("tolist", "item", "__int__", "__bool__", "__float__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            reads[0] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as mode:
        plan = _attn._check_ring_sequences(pos, lens, cache, slots, True)
        assert plan is not None
        _attn._ring_keys(kv, pos, cache, plan)
    assert launches == ["ring_index_kernel", "ring_keys_kernel"], launches
    assert reads[0] == 1, reads[0]
    assert set(mode.ops) <= _HOST_SIDE_OPS, sorted(set(mode.ops) - _HOST_SIDE_OPS)


def _outcome(fn: Any, *args: object) -> str:
    try:
        fn(*args)
    except InputError as e:
        return str(e)
    return "ok"


def test_ring_checks_on_the_device_flag_what_the_host_checks_refuse(device: str) -> None:
    """Random calls, valid or broken one way (a slot repeated or >= S, positions falling,
    negative, >= 2^31 or not past the ring's newest row): the device flag is set exactly when
    the host checks refuse the call, and a prefill's check raises the host checks' message."""
    g = torch.Generator().manual_seed(32)
    broken = 0
    for case in range(60):
        cache, lens, pos, slots = _random_ring_call(g, device)
        live = [b for b, s in enumerate(slots.tolist()) if s >= 0 and lens[b]]
        kind = case % 7
        bounds = [0, *itertools.accumulate(lens)]
        if kind == 1 and slots.shape[0] > 1:
            slots[1] = slots[0] if slots[0] >= 0 else 0
        elif kind == 2:
            slots[0] = cache.num_seqs + int(torch.randint(0, 3, (1,), generator=g))
        elif live and kind in (3, 4, 5, 6):
            b = live[int(torch.randint(0, len(live), (1,), generator=g))]
            t = bounds[b] + int(torch.randint(0, lens[b], (1,), generator=g))
            pos[t] = {3: pos[t] - 3, 4: -1, 5: 2**31, 6: 0}[kind]
        index = _attn._ring_index(pos, lens, cache, slots)
        want = _outcome(_attn._ring_sequences_host, pos, lens, cache, slots)
        assert bool(index.bad) == (want != "ok"), (case, want)
        assert _outcome(_attn._check_ring_sequences, pos, lens, cache, slots, True) == want, case
        broken += want != "ok"
    assert 20 < broken < 60


def test_ring_prefill_over_a_repeated_position_raises_the_varlen_check(device: str) -> None:
    """A ring (an engine's tensors) holding one position in two rows: the prefill's keys would
    repeat it, so its launch checks them and raises the varlen op's message, as it did when
    every prefill launch checked its keys."""
    pack = pack_attention(layer_params(BF16), device)
    cache = DeviceKVCache(CFG, num_seqs=1, dtype=BF16, device=device)
    cache.pos[0, 3], cache.pos[0, 4] = 3, 3
    x = torch.zeros(2, D, dtype=BF16, device=device)
    pos = torch.tensor([5, 6], device=device)
    with pytest.raises(InputError, match=r"^k_pos: expected strictly increasing positions within"):
        opt_attention(
            x, pos, pack, CFG, seq_lens=[2], kv_cache=cache, cache_slots=_slots([0], device)
        )


def test_device_offset_prefill_is_the_host_prefill_with_failed_sequences_as_padding(
    device: str,
) -> None:
    """``attention(query_start_loc=..., seq_flags=...)`` (offsets on the device, no host read,
    capturable) on random calls, valid or broken one way: each sequence's flags are the index's
    (bit 0 where the host checks refuse it), and the output and both rings are bit for bit the
    host-lens prefill's with every flagged sequence made padding (slot -1: nothing read or
    written, output zero).  Last, a ring holding one position twice: flagged (bit 1) and
    padding, where the host-lens prefill raises the varlen check."""
    g = torch.Generator().manual_seed(33)
    pack = pack_attention(layer_params(BF16), device)
    flagged = 0
    for case in range(6):
        cache, lens, pos, slots = _random_ring_call(g, device)
        live = [b for b, s in enumerate(slots.tolist()) if s >= 0 and lens[b]]
        bounds = [0, *itertools.accumulate(lens)]
        if case % 3 == 1 and live:  # positions falling inside a live sequence
            b = live[-1]
            pos[bounds[b + 1] - 1] = pos[bounds[b]] - 1
        elif case % 3 == 2:
            slots[0] = cache.num_seqs  # a slot past the cache
        twin = DeviceKVCache(CFG, num_seqs=cache.num_seqs, dtype=BF16, device=device)
        twin.kv.copy_(cache.kv)
        twin.pos.copy_(cache.pos)
        x = _rows(g, pos.shape[0], BF16, device) * 4
        B = slots.shape[0]
        flags = torch.full((B,), -7, dtype=torch.int64, device=device)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        got = opt_attention(
            x, pos, pack, CFG, kv_cache=cache, cache_slots=slots, query_start_loc=cu,
            seq_flags=flags,
        )  # fmt: skip
        want_flags = _attn._ring_index(pos, lens, twin, slots).stats[:, 2]
        assert torch.equal(flags, want_flags), case
        refused = _outcome(_attn._ring_sequences_host, pos, lens, twin, slots) != "ok"
        assert refused == bool((flags & 1).any()), case  # the host checks agree
        flagged += int((flags != 0).sum())
        padded = torch.where(flags != 0, -1, slots)
        want = opt_attention(x, pos, pack, CFG, seq_lens=lens, kv_cache=twin, cache_slots=padded)
        assert torch.equal(got, want), case
        assert torch.equal(cache.pos, twin.pos) and torch.equal(cache.kv, twin.kv), case
    assert flagged >= 2
    cache = DeviceKVCache(CFG, num_seqs=1, dtype=BF16, device=device)
    cache.pos[0, 3], cache.pos[0, 4] = 3, 3
    before = cache.pos.clone()
    flags = torch.empty(1, dtype=torch.int64, device=device)
    out = opt_attention(
        torch.ones(2, D, dtype=BF16, device=device), torch.tensor([5, 6], device=device), pack,
        CFG, kv_cache=cache, cache_slots=_slots([0], device),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device=device), seq_flags=flags,
    )  # fmt: skip
    assert flags.tolist() == [2] and torch.equal(cache.pos, before)
    assert not out.any()  # padding: wo_b(wo_a(0)) = 0


def test_device_offset_prefill_rejects_bad_metadata(device: str) -> None:
    """The offsets and the flags buffer are checked on the host: only with a DeviceKVCache and
    without seq_lens, (B+1,) int32 and (B,) int64 on x's device; eagerly the offsets' values
    too (0 first, T last, never falling), which a kernel would otherwise read past."""
    pack = pack_attention(layer_params(BF16), device)
    cache = DeviceKVCache(CFG, num_seqs=2, dtype=BF16, device=device)
    x = torch.zeros(3, D, dtype=BF16, device=device)
    pos = torch.arange(3, device=device)
    slots = _slots([0, 1], device)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    flags = torch.zeros(2, dtype=torch.int64, device=device)
    ok = dict(kv_cache=cache, cache_slots=slots, query_start_loc=cu, seq_flags=flags)
    for bad, match in (
        (dict(kv_cache=None, cache_slots=None), "query_start_loc: expected a DeviceKVCache"),
        (dict(seq_lens=[1, 2]), "seq_lens: expected None with query_start_loc"),
        (dict(query_start_loc=cu.long()), r"query_start_loc: expected a contiguous \(3,\)"),
        (dict(query_start_loc=cu[:2]), r"query_start_loc: expected a contiguous \(3,\)"),
        (dict(seq_flags=None), r"seq_flags: expected a contiguous \(2,\) torch.int64"),
        (dict(seq_flags=flags.int()), "seq_flags"),
        (dict(cache_slots=slots.float()), "cache_slots: expected a 1-D int64"),
        # the values, read eagerly: a row outside every sequence, a sequence past T, falling
        (dict(query_start_loc=cu.new_tensor([0, 1, 2])), r"from 0 to T=3, .*\[0, 1, 2\]"),
        (dict(query_start_loc=cu.new_tensor([0, 1, 4])), "query_start_loc: expected row offsets"),
        (dict(query_start_loc=cu.new_tensor([0, 3, 1])), "query_start_loc: expected row offsets"),
    ):
        with pytest.raises(InputError, match=match):
            opt_attention(x, pos, pack, CFG, **{**ok, **bad})
