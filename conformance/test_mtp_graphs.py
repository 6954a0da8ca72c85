"""The optimized layer's decode step with a device KV cache and CUDA graphs
(``MTPLayer.capture_decode``, :class:`~dsv4mtp.optimized.mtp.DecodeGraphs`).

On the tiny config from a synthetic checkpoint (MXFP4 experts, ``math``): the graph-backed
``draft`` against the reference's (teacher forcing, logits per step within the optimized
layer's tolerance); a step padded to its bucket against the same rows without filler (filler
rows write no KV and change no real row); bad rows inside a step (non-finite ``prev_hidden``,
out-of-range ids) poisoned and reported at :meth:`DecodeGraphs.check`.  The captured prefill
(:class:`~dsv4mtp.optimized.mtp.PrefillGraphs`): chunks of several sequences against the
eager ``forward`` with host lengths, bad rows and failed ring checks turning their sequence
into padding.  Without CUDA the steps run eagerly (``capture=False``, the same code the graphs
capture); the GPU tier adds capture and replay, which must equal the eager step at the padded
size bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from dsv4mtp.checkpoint.load import load_mtp_checkpoint
from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint
from dsv4mtp.config import DSV4Config
from dsv4mtp.conformance._routing import draft_steps_kept, record_moe_inputs
from dsv4mtp.errors import InputError
from dsv4mtp.optimized import MTPLayer as OptLayer
from dsv4mtp.optimized.mtp import DecodeGraphs, PrefillGraphs
from dsv4mtp.reference import MTPLayer as RefLayer

BF16 = torch.bfloat16
CFG = DSV4Config.tiny()
# as conformance/test_mtp_optimized.py (the same layer; the device cache changes no arithmetic)
TOL = 2e-2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all(), "NaN/inf in the optimized output"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return load_mtp_checkpoint(make_synthetic_checkpoint(root / "mx", CFG, expert_format="mxfp4"))


def layers(loaded, device: str) -> tuple[RefLayer, OptLayer]:
    ref = RefLayer.from_loaded(loaded, dtype=BF16)
    opt = OptLayer.from_loaded(loaded, dtype=BF16, device=device, max_num_tokens=32, max_batch=8)
    return ref, opt


def eager_graphs(opt: OptLayer, buckets=(1, 2, 4, 8)) -> list[DecodeGraphs]:
    return [
        DecodeGraphs(opt, opt.new_device_cache(), spec_step=i, buckets=buckets, capture=False)
        for i in range(len(opt.layers))
    ]


def prefix(seed: int, lens: list[int], device: str):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    ids = torch.randint(0, CFG.vocab_size, (T,), generator=g)
    prev = torch.randn(T, CFG.hc_dim, generator=g).to(BF16)
    pos = torch.cat([torch.arange(3 * b, 3 * b + n) for b, n in enumerate(lens)])
    return ids.to(device), pos.to(device), prev.to(device), torch.tensor(lens).to(device)


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_graph_draft_matches_the_reference(loaded, device, capture) -> None:
    """Teacher-forced draft through the device cache and the eager decode steps against the
    reference's host loop: logits per step within the layer's tolerance (steps after a moved
    expert selection excused, conformance/_routing.py); with the reference's greedy picks forced,
    the returned ids are those picks; free-running greedy ids equal the forced ones wherever the
    reference has no near-tie.  With ``capture`` the same draft through the captured graphs
    equals the eager one bit for bit (the same bucket)."""
    ref, opt = layers(loaded, device)
    opt.graphs = eager_graphs(opt)
    ids, pos, prev, lens = prefix(1, [5, 7, 2], device)
    k = 4
    forced = dict(seq_lens=lens, num_tokens=k, return_logits=True)
    with record_moe_inputs(ref, opt) as moe_in:
        tr, lr = ref.draft(
            ids.cpu(), pos.cpu(), prev.cpu(), seq_lens=lens.cpu(), num_tokens=k, return_logits=True
        )
        to, lo = opt.draft(ids, pos, prev, **forced, forced_tokens=tr.to(device))
    clear = draft_steps_kept(moe_in, lens.cpu().cumsum(0) - 1)
    if capture:
        opt.capture_decode(buckets=(1, 2, 4, 8))
        tc, lc = opt.draft(ids, pos, prev, **forced, forced_tokens=tr.to(device))
        assert torch.equal(tc, to) and torch.equal(lc, lo)
    assert torch.equal(to.cpu(), tr)
    for s in range(k):
        kept = clear[:, s]
        assert rel_err(lo.cpu()[kept, s], lr[kept, s]) < TOL, s
    greedy = opt.draft(ids, pos, prev, seq_lens=lens, num_tokens=k).cpu()
    top2 = lr.topk(2, dim=-1).values
    clear_top = (top2[..., 0] - top2[..., 1]) > TOL * lr.norm(dim=-1) / CFG.vocab_size**0.5
    for b in range(3):
        n = int((clear_top[b] & clear[b]).long().cumprod(0).sum())  # steps before a near-tie
        assert torch.equal(greedy[b, :n], tr[b, :n]), b


def _two_caches(opt: OptLayer, device: str):
    """A device cache with three sequences prefilled (slots 0, 2, 5), and its clone."""
    cache = opt.new_device_cache()
    ids, pos, prev, lens = prefix(2, [4, 6, 3], device)
    slots = torch.tensor([0, 2, 5], device=device)
    opt.forward(ids, pos, prev, seq_lens=lens, kv_cache=cache, cache_slots=slots)
    twin = opt.new_device_cache()
    twin.kv.copy_(cache.kv)
    twin.pos.copy_(cache.pos)
    return cache, twin, slots, pos[lens.cumsum(0) - 1] + 1


def _step_inputs(next_pos: torch.Tensor, device: str, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    B = next_pos.shape[0]
    ids = torch.randint(0, CFG.vocab_size, (B,), generator=g).to(device)
    prev = torch.randn(B, CFG.hc_dim, generator=g).to(BF16).to(device)
    return ids, next_pos, prev


def test_padded_step_writes_only_its_rows(loaded, device) -> None:
    """Three sequences in bucket 4: the real rows match a forward of the same rows through the
    layer (within tolerance: another T, another schedule), their new KV rows land in their
    slots, and no other slot changes."""
    _, opt = layers(loaded, device)
    cache, twin, slots, next_pos = _two_caches(opt, device)
    graph = DecodeGraphs(opt, cache, buckets=(1, 4), capture=False)
    ids, pos, prev = _step_inputs(next_pos, device)
    tok, hidden, logits = graph.step(ids, pos, prev, slots)
    want = opt.forward(ids, pos, prev, seq_lens=torch.ones(3, dtype=torch.int64, device=device),
                       kv_cache=twin, cache_slots=slots)  # fmt: skip
    assert rel_err(hidden, want) < TOL
    assert torch.equal(tok, logits.argmax(-1))
    others = [s for s in range(cache.num_seqs) if s not in (0, 2, 5)]
    assert torch.equal(cache.pos[others], twin.pos[others])
    assert torch.equal(cache.pos, twin.pos)  # the same rows written, at the same places
    assert rel_err(cache.kv[[0, 2, 5]].float(), twin.kv[[0, 2, 5]].float()) < TOL
    graph.check()  # nothing recorded


def test_bad_rows_are_poisoned_and_reported(loaded, device) -> None:
    """A non-finite prev_hidden row and an out-of-range id inside a step: their ids are -1, they
    write no KV, the other row is unchanged, and check() raises the lowest one (then clears)."""
    _, opt = layers(loaded, device)
    cache, twin, slots, next_pos = _two_caches(opt, device)
    graph = DecodeGraphs(opt, cache, buckets=(4,), capture=False)
    ids, pos, prev = _step_inputs(next_pos, device)
    clean = DecodeGraphs(opt, twin, buckets=(4,), capture=False).step(ids, pos, prev, slots)
    prev = prev.clone()
    prev[1, 5] = float("nan")
    ids = ids.clone()
    ids[2] = CFG.vocab_size
    before = cache.pos.clone()
    tok, hidden, _ = graph.step(ids, pos, prev, slots)
    assert tok.tolist()[1:] == [-1, -1] and int(tok[0]) == int(clean[0][0])
    assert torch.equal(hidden[0], clean[1][0])
    assert torch.equal(cache.pos[[2, 5]], before[[2, 5]])  # bad rows wrote nothing
    with pytest.raises(InputError, match=r"prev_hidden: non-finite value in row 1"):
        graph.check()
    graph.check()  # cleared


def test_check_reports_the_lowest_bad_row_since_the_last_check(loaded, device) -> None:
    """The record keeps the lowest-indexed bad row (and its reason) over the steps since the
    last check(), not the first step's: row 2's bad id, then row 1's bad position, then row 2's
    NaN (three steps at successive positions) report row 1's position, once."""
    _, opt = layers(loaded, device)
    cache, _, slots, next_pos = _two_caches(opt, device)
    graph = DecodeGraphs(opt, cache, buckets=(4,), capture=False)
    ids, pos, prev = _step_inputs(next_pos, device)
    bad_id = ids.clone()
    bad_id[2] = -1
    graph.step(bad_id, pos, prev, slots)
    bad_pos = pos + 1
    bad_pos[1] = CFG.max_position_embeddings
    graph.step(ids, bad_pos, prev, slots)
    nan = prev.clone()
    nan[2, 0] = float("nan")
    graph.step(ids, pos + 2, nan, slots)
    with pytest.raises(InputError, match=r"^positions: position outside .* in row 1 "):
        graph.check()
    graph.check()  # cleared


def test_step_argument_errors(loaded, device) -> None:
    _, opt = layers(loaded, device)
    graph = DecodeGraphs(opt, opt.new_device_cache(), buckets=(1, 2), capture=False)
    ids, pos, prev = _step_inputs(torch.tensor([4, 9], device=device), device)
    slots = torch.tensor([0, 1], device=device)
    with pytest.raises(InputError, match="exceed the largest bucket 2"):
        graph.step(ids.repeat(2), pos.repeat(2), prev.repeat(2, 1), slots.repeat(2))
    with pytest.raises(InputError, match="prev_hidden"):
        graph.step(ids, pos, prev.float(), slots)
    with pytest.raises(InputError, match="slots"):
        graph.step(ids, pos, prev, slots[:1])
    with pytest.raises(InputError, match="buckets"):
        DecodeGraphs(opt, opt.new_device_cache(), buckets=(0,), capture=False)
    if device == "cpu":
        with pytest.raises(InputError, match="CUDA"):
            opt.capture_decode()


@pytest.mark.parametrize(
    ("T", "B", "b", "S", "H", "itype"),
    [(3, 3, 4, 4, 48, torch.int64), (5, 2, 8, 9, 40, torch.int32), (4, 4, 4, 4, 16, torch.int64),
     (2, 1, 2, 4, 24, torch.int32), (5, 2, 8, 3, 40, torch.int32), (0, 0, 2, 2, 16, torch.int64),
     (3, 3, 3, 3, 20000, torch.int64)],
)  # fmt: skip
def test_stage_inputs_copies_rows_pads_and_leaves_the_rest(device, T, B, b, S, H, itype) -> None:
    """The steps' one-launch input staging (optimized/kernels/step_inputs.py) against the
    equivalent torch ops: T rows copied (ids, positions and slots widened to int64, negative
    slots kept, strided inputs read through their strides), rows T..b-1 zeros and not real,
    slot entries B..S-1 -1; nothing written past row b or entry S (the rows of a larger bucket
    keep what they held), also with more rows than slot entries (a prefill's bucket) and for an
    empty step.  The last case's rows take several BLOCK_H pieces."""
    from dsv4mtp.optimized.kernels.step_inputs import stage_inputs_triton

    g = torch.Generator().manual_seed(T * 100 + H)
    ids_in = torch.randint(0, 100, (2 * T,), dtype=itype, generator=g)[::2].to(device)
    pos_in = torch.randint(0, 100, (3 * T,), dtype=itype, generator=g).to(device)[::3]
    prev_in = torch.randn(T, H + 3, generator=g).to(BF16).to(device)[:, :H]
    slots_in = torch.randint(-2, 9, (2 * B,), dtype=itype, generator=g).to(device)[::2]
    n = 10
    ids, pos, slots = (torch.full((n,), 77, dtype=torch.int64, device=device) for _ in range(3))
    prev = torch.full((n, H), float("nan"), dtype=BF16, device=device)
    real = torch.ones(n, dtype=torch.bool, device=device)
    stage_inputs_triton(ids_in, pos_in, prev_in, slots_in, ids, pos, prev, real, slots, b, S)
    want_prev = torch.zeros(b, H, dtype=BF16, device=device)
    want_prev[:T] = prev_in
    assert torch.equal(prev[:b], want_prev) and torch.isnan(prev[b:].float()).all()
    for got, src in ((ids, ids_in), (pos, pos_in)):
        want = torch.zeros(b, dtype=torch.int64, device=device)
        want[:T] = src
        assert torch.equal(got[:b], want) and (got[b:] == 77).all()
    assert torch.equal(real[:b], torch.arange(b, device=device) < T) and real[b:].all()
    want_slots = torch.full((S,), -1, dtype=torch.int64, device=device)
    want_slots[:B] = slots_in
    assert torch.equal(slots[:S], want_slots) and (slots[S:] == 77).all()


@pytest.mark.gpu
def test_prefill_offsets_survive_reuse_of_their_pinned_buffers(loaded) -> None:
    """Ten captured prefill steps queued behind a long GPU sleep, so that no copy has run when
    the host sends the next offsets: the ring of four pinned buffers must wait before it
    rewrites one (its event), or a step would read a later step's offsets.  Each step, each
    with its own lengths, equals the same step run eagerly."""
    opt = OptLayer.from_loaded(loaded, dtype=BF16, device="cuda", max_num_tokens=32,
                               max_batch=8, batch_invariant=True)  # fmt: skip
    graphs = _prefill_graphs(opt, opt.new_device_cache(), True)
    eager = _prefill_graphs(opt, opt.new_device_cache(), False)
    g = torch.Generator().manual_seed(11)
    slots = torch.tensor([0, 1, 2, 3], device="cuda")
    steps = []
    for i in range(10):
        lens = [1 + (i + j) % 4 for j in range(1 + i % 4)]
        T = sum(lens)
        ids = torch.randint(0, CFG.vocab_size, (T,), generator=g).cuda()
        prev = torch.randn(T, CFG.hc_dim, generator=g).to(BF16).cuda()
        pos = torch.cat([torch.arange(4 * i, 4 * i + n) for n in lens]).cuda()
        steps.append((ids, pos, prev, lens, slots[: len(lens)]))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time in front of every step below
    got = [[t.clone() for t in graphs.step(*step)] for step in steps]
    for step, out in zip(steps, got, strict=True):
        want = eager.step(*step)
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b)
    graphs.check()


@pytest.mark.gpu
def test_replay_equals_the_eager_step_bitwise(loaded, monkeypatch) -> None:
    """Each bucket's replay against the eager step at the same padded size, from identical
    caches: ids, hidden, logits and the caches bit for bit; then a second replay with other
    inputs (the static buffers really are re-read).  The launches' ticket counters: every one
    asked for while capturing is a piece of the graphs' arena (none fell back to a memset),
    and the arena is all zero after every replay (each launch leaves its piece zeroed)."""
    from dsv4mtp.optimized.kernels import _sync
    from dsv4mtp.optimized.kernels._launch import arena_piece

    asked: list[torch.Tensor | None] = []

    def recorded(device: torch.device, n: int) -> torch.Tensor | None:
        asked.append(arena_piece(device, n))
        return asked[-1]

    monkeypatch.setattr(_sync, "arena_piece", recorded)
    _, opt = layers(loaded, "cuda")
    cache, twin, slots, next_pos = _two_caches(opt, "cuda")
    graph = DecodeGraphs(opt, cache, buckets=(4, 8))
    assert all(piece is not None for piece in asked), asked
    arenas = {id(g.counters): g.counters for g in graph.graphs.values()}
    assert len(arenas) == 1  # one arena for the capture's buckets
    eager = DecodeGraphs(opt, twin, buckets=(4, 8), capture=False)
    for seed, (s, p) in enumerate([(slots, next_pos), (slots, next_pos + 1)]):
        ids, pos, prev = _step_inputs(p, "cuda", seed=10 + seed)
        got = [t.clone() for t in graph.step(ids, pos, prev, s)]
        want = eager.step(ids, pos, prev, s)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), seed
        assert torch.equal(cache.kv, twin.kv) and torch.equal(cache.pos, twin.pos)
        assert not any(bool(a.any()) for a in arenas.values()), seed


def test_logit_free_steps_give_the_greedy_ids(loaded, device) -> None:
    """Steps captured with ``logits=False`` (greedy ids from ``lm_head_argmax``, no (B, V)
    logits) draft the ids the logits steps draft; a draft that needs logits falls back to the
    host loop rather than failing."""
    _, opt = layers(loaded, device)
    ids, pos, prev, lens = prefix(4, [3, 6], device)
    opt.graphs = eager_graphs(opt)
    want = opt.draft(ids, pos, prev, seq_lens=lens, num_tokens=2)
    opt.graphs = [
        DecodeGraphs(opt, opt.new_device_cache(), buckets=(1, 2), capture=False, logits=False)
    ]
    assert torch.equal(opt.draft(ids, pos, prev, seq_lens=lens, num_tokens=2), want)
    tokens, logits = opt.draft(ids, pos, prev, seq_lens=lens, num_tokens=2, return_logits=True)
    assert torch.equal(tokens, want) and logits.shape == (2, 2, CFG.vocab_size)


def test_fp8_head_switch(loaded, device) -> None:
    """``head_format="fp8"``: the head packed as e4m3 with 128x128 ue8m0 blocks (half the bytes);
    logits within the FP8 head's error of the bf16 head's (measured ~2.7e-2 rel. at V4-Flash's
    head shape, bench/results/head-fp8.md; 6e-2 bounds it here); never the default."""
    from dsv4mtp.errors import ConfigError

    _, opt = layers(loaded, device)
    fp8 = OptLayer.from_loaded(loaded, dtype=BF16, device=device, max_num_tokens=32,
                               head_format="fp8")  # fmt: skip
    assert opt.head_format == "bf16" and fp8.heads[0].format == "fp8"
    ids, pos, prev, _ = prefix(5, [6], device)
    h = opt.forward(ids, pos, prev)
    assert rel_err(fp8.compute_logits(h), opt.compute_logits(h)) < 6e-2
    # the FP8 head's greedy path is its logits' argmax (the bf16 head's argmax kernel is
    # compared with the reference, near-ties excused, in test_lm_head.py)
    assert torch.equal(fp8._greedy(h, 0), fp8.compute_logits(h).argmax(-1))
    with pytest.raises(ConfigError, match="head_format"):
        OptLayer.from_loaded(loaded, device=device, head_format="mxfp4")


@pytest.fixture(scope="module")
def loaded_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_fp8")
    return load_mtp_checkpoint(make_synthetic_checkpoint(root / "fp8", CFG, expert_format="fp8"))


# Without capture this is a minute under the interpreter, and the CPU tier has its parts: the
# draft through eager graphs (test_graph_draft_matches_the_reference), the official layer
# (test_mtp_optimized.py, fp8-official) and the FP8 ring (test_kv_cache.py).
@pytest.mark.parametrize(
    "capture",
    [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.gpu)],
)
def test_graph_draft_under_the_official_preset(loaded_fp8, device, capture) -> None:
    """FP8 experts with the ``official`` preset (act_quant, fp8_kv: the ring stores FP8-rounded
    rows, mask_pos0, the official norm order): the draft through the device cache and the
    decode steps gives the bits of the same layer's host loop (host KVCaches, one `_run` per
    step at the same T: the ring decode reads the same keys in the same lanes as the host
    path's, and a bucket equal to B adds no filler rows).  The host loop's distance to the
    reference is test_mtp_optimized.py's (where this data would meet a routing near-tie: one
    row's 2nd and 3rd expert scores 1.5e-3 apart in float64, which bf16 rounding flips)."""
    opt = OptLayer.from_loaded(loaded_fp8, preset="official", dtype=BF16, device=device,
                               max_num_tokens=32, max_batch=8)  # fmt: skip
    ids, pos, prev, lens = prefix(6, [4, 7], device)
    pos = pos - pos[0]  # the first sequence starts at position 0 (mask_pos0)
    kw = dict(seq_lens=lens, num_tokens=3, return_logits=True)
    want_ids, want = opt.draft(ids, pos, prev, **kw)
    if capture:
        opt.capture_decode(buckets=(1, 2, 4))
    else:
        opt.graphs = eager_graphs(opt, buckets=(1, 2, 4))
    got_ids, got = opt.draft(ids, pos, prev, **kw)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got, want)


def test_consume_repacks_the_experts_in_place_to_the_same_packs(tmp_path, device) -> None:
    """``from_loaded(consume=True)`` (what ``from_checkpoint`` does with the checkpoint it
    loads) reorders the routed MXFP4 experts into ``pack_moe``'s tiles in the memory they are
    already in on the layer's device (on the CPU: the checkpoint's own tensors) instead of
    copying them again; the packs are those of a copying load, bit for bit."""
    path = make_synthetic_checkpoint(tmp_path / "mx", CFG, expert_format="mxfp4")
    kw = dict(dtype=BF16, device=device, max_num_tokens=32, max_batch=8)
    copied = OptLayer.from_loaded(load_mtp_checkpoint(path), **kw)
    ck = load_mtp_checkpoint(path)
    consumed = OptLayer.from_loaded(ck, consume=True, **kw)
    loaded_again = OptLayer.from_checkpoint(path, **kw)
    for a, b, c in zip(copied.layers, consumed.layers, loaded_again.layers, strict=True):
        assert a.ffn.layout == b.ffn.layout == c.ffn.layout == "tiles"
        for name in ("w13", "s13", "w2", "s2"):
            want = getattr(a.ffn, name)
            assert torch.equal(getattr(b.ffn, name), want), name
            assert torch.equal(getattr(c.ffn, name), want), name
    if device == "cpu":  # the checkpoint is on the layer's device: its tensors became the pack
        w13 = ck.layers[0].experts.w13_weight
        assert (
            w13.untyped_storage().data_ptr()
            == consumed.layers[0].ffn.w13.untyped_storage().data_ptr()
        )
    with pytest.raises(InputError, match="consume"):
        OptLayer.from_loaded(load_mtp_checkpoint(path), consume=1, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- captured prefill
def _prefill_graphs(opt: OptLayer, cache, capture: bool) -> PrefillGraphs:
    return PrefillGraphs(opt, cache, tokens=(8, 16), max_seqs=4, capture=capture)


def _chunks(device: str):
    """Two prefill chunks of three sequences: lens [5, 7, 2] from positions 0 / 3 / 6 into
    empty rings (slots 0, 2, 5), then [3, 4, 1] continuing each (the rings now hold rows)."""
    g = torch.Generator().manual_seed(7)
    slots = torch.tensor([0, 2, 5], device=device)
    out, start = [], [0, 3, 6]
    for lens in ([5, 7, 2], [3, 4, 1]):
        T = sum(lens)
        ids = torch.randint(0, CFG.vocab_size, (T,), generator=g).to(device)
        prev = torch.randn(T, CFG.hc_dim, generator=g).to(BF16).to(device)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start, lens, strict=True)])
        start = [s + n for s, n in zip(start, lens, strict=True)]
        out.append((ids, pos.to(device), prev, lens, slots))
    return out


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_prefill_graphs_give_the_eager_forward(loaded, device, capture) -> None:
    """Under ``batch_invariant`` two chunks through :class:`PrefillGraphs` (padded to the 16
    bucket, then 8: filler rows in a padding sequence) give the bits of the eager ``forward``
    with host lengths on a twin cache, and of ``compute_logits`` on each sequence's last row:
    hidden, logits, greedy ids and both caches.  With ``capture`` the replays equal the same
    steps run eagerly (``capture=False``) bit for bit, the default schedules included."""
    for bi in (True, False) if capture else (True,):
        opt = OptLayer.from_loaded(loaded, dtype=BF16, device=device, max_num_tokens=32,
                                   max_batch=8, batch_invariant=bi)  # fmt: skip
        cache, twin, eager_cache = (opt.new_device_cache() for _ in range(3))
        graphs = _prefill_graphs(opt, cache, capture)
        eager = _prefill_graphs(opt, eager_cache, False) if capture else None
        for ids, pos, prev, lens, slots in _chunks(device):
            tok, hidden, logits = (t.clone() for t in graphs.step(ids, pos, prev, lens, slots))
            last = torch.tensor(lens).cumsum(0).to(device) - 1
            if eager is not None:  # replay against the same step run eagerly
                want = eager.step(ids, pos, prev, lens, slots)
                for a, b in zip((tok, hidden, logits), want, strict=True):
                    assert torch.equal(a, b), bi
                assert torch.equal(cache.kv, eager_cache.kv)
                assert torch.equal(cache.pos, eager_cache.pos)
            if not bi:
                continue
            h = opt.forward(ids, pos, prev, seq_lens=torch.tensor(lens), kv_cache=twin,
                            cache_slots=slots)  # fmt: skip
            assert torch.equal(hidden, h)
            assert torch.equal(logits, opt.compute_logits(h[last]))
            assert torch.equal(tok, logits.argmax(-1))
            assert torch.equal(cache.kv, twin.kv) and torch.equal(cache.pos, twin.pos)
        graphs.check()  # nothing recorded


def test_prefill_bad_row_and_failed_check_make_their_sequence_padding(loaded, device) -> None:
    """Inside a prefill: a non-finite prev_hidden row (sequence 1) and positions that do not
    rise (sequence 2): those sequences' ids are -1 and their rings unchanged, sequence 0 gives
    the clean call's bits, and check() raises the bad row first, then (next check) nothing:
    one check clears both records.  A sequence prefilled twice at the same positions (not past
    its ring's newest row) is reported as a failed ring check."""
    opt = OptLayer.from_loaded(loaded, dtype=BF16, device=device, max_num_tokens=32,
                               max_batch=8, batch_invariant=True)  # fmt: skip
    (ids, pos, prev, lens, slots), _ = _chunks(device)
    clean_cache, cache = opt.new_device_cache(), opt.new_device_cache()
    clean_graphs = _prefill_graphs(opt, clean_cache, False)
    clean = [t.clone() for t in clean_graphs.step(ids, pos, prev, lens, slots)]
    graphs = _prefill_graphs(opt, cache, False)
    prev, pos = prev.clone(), pos.clone()
    prev[6, 3] = float("inf")  # row 6: sequence 1 (rows 5..11)
    pos[13] = pos[12]  # sequence 2 (rows 12, 13) does not rise
    tok, hidden, _ = graphs.step(ids, pos, prev, lens, slots)
    assert tok.tolist() == [int(clean[0][0]), -1, -1]
    assert torch.equal(hidden[:5], clean[1][:5])
    assert torch.equal(cache.pos[0], clean_cache.pos[0])
    assert (cache.pos[[2, 5]] == -1).all()  # nothing written for the bad sequences
    with pytest.raises(InputError, match=r"prev_hidden: non-finite value in row 6 .*prefill"):
        graphs.check()
    graphs.check()  # both records cleared
    (ids, pos, prev, lens, slots), _ = _chunks(device)
    graphs.step(ids[:5], pos[:5], prev[:5], [5], slots[:1])  # slot 0 again, positions 0..4
    with pytest.raises(InputError, match=r"sequence 0: a failed ring check"):
        graphs.check()


def test_prefill_step_argument_errors(loaded, device) -> None:
    _, opt = layers(loaded, device)
    graphs = _prefill_graphs(opt, opt.new_device_cache(), False)
    (ids, pos, prev, lens, slots), _ = _chunks(device)
    for args, match in (
        ((ids, pos, prev, [5, 7, 1], slots), "seq_lens: expected 1..4 lengths >= 1 summing"),
        ((ids, pos, prev, [5, 0, 7, 2], slots), "seq_lens"),
        ((ids, pos, prev, [2, 3, 3, 3, 3], slots), "seq_lens: expected 1..4"),
        ((ids, pos, prev, lens, slots[:2]), r"slots: expected shape \(3,\)"),
        ((ids, pos, prev.float(), lens, slots), "prev_hidden: expected torch.bfloat16"),
        ((ids, pos[:3], prev, lens, slots), "positions"),
        ((ids.repeat(2), pos.repeat(2), prev.repeat(2, 1), lens * 2, slots.repeat(2)),
         "seq_lens: expected 1..4"),
        ((ids.repeat(2), pos.repeat(2), prev.repeat(2, 1), [14, 14], slots[:2]),
         "exceed the largest token bucket 16"),
        ((ids, pos, prev, "5,7,2", slots), "seq_lens"),
        ((ids.float(), pos, prev, lens, slots), "input_ids: expected torch.int64 or torch.int32"),
        ((ids, pos, prev, lens, slots.float()), "slots: expected torch.int64"),
    ):  # fmt: skip
        with pytest.raises(InputError, match=match):
            graphs.step(*args)
    with pytest.raises(InputError, match="tokens"):
        PrefillGraphs(opt, opt.new_device_cache(), tokens=(0,), capture=False)
    with pytest.raises(InputError, match="max_seqs"):
        PrefillGraphs(opt, opt.new_device_cache(), max_seqs=0, capture=False)
    if device == "cpu":
        with pytest.raises(InputError, match="CUDA"):
            opt.capture_prefill()


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_draft_replays_the_prefill_graphs_for_step_0(loaded, device, capture) -> None:
    """With prefill graphs over the decode graphs' cache, ``draft`` replays them for its step 0:
    under ``batch_invariant`` the drafted ids and logits are bit for bit those with an eager
    step 0 (greedy; with ``capture`` three steps, and teacher-forced too).  A call whose rows
    exceed the largest token bucket runs step 0 eagerly (the same drafts, no replay).  The CPU
    tier drafts one token (step 0 alone: the interpreter's time)."""
    opt = OptLayer.from_loaded(loaded, dtype=BF16, device=device, max_num_tokens=32,
                               max_batch=8, batch_invariant=True)  # fmt: skip
    ids, pos, prev, lens = prefix(1, [5, 7, 2], device)
    if capture:
        opt.capture_decode(buckets=(1, 2, 4))
    else:
        opt.graphs = eager_graphs(opt, buckets=(1, 2, 4))
    k = 3 if capture else 1
    greedy = dict(seq_lens=lens, num_tokens=k, return_logits=True)
    want = opt.draft(ids, pos, prev, **greedy)
    forced = dict(seq_lens=lens, num_tokens=k, forced_tokens=want[0].flip(0), return_logits=True)
    want_forced = opt.draft(ids, pos, prev, **forced) if capture else None
    calls = []
    for tokens, replays in (((16,), 1 + capture), ((8,), 0)):  # T = 14 fits 16, not 8
        if capture:
            opt.capture_prefill(tokens=tokens, max_seqs=4)
        else:
            opt.prefill_graphs = PrefillGraphs(
                opt, opt.graphs[0].cache, tokens=tokens, max_seqs=4, capture=False
            )
        pg = opt.prefill_graphs
        assert pg is not None
        step = pg.step
        pg.step = lambda *a, step=step: calls.append(1) or step(*a)  # type: ignore[method-assign]
        got = opt.draft(ids, pos, prev, **greedy)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), tokens
        if want_forced is not None and replays:
            got = opt.draft(ids, pos, prev, **forced)
            assert torch.equal(got[0], want_forced[0]) and torch.equal(got[1], want_forced[1])
        assert len(calls) == replays, tokens
        calls.clear()


def test_draft_raises_a_bad_prefill_sequence_once(loaded, device) -> None:
    """Positions that do not rise inside a sequence reach ``draft``'s replayed step 0 (the host
    checks of ``draft`` do not read them): the draft raises the prefill's failed ring check, not
    the decode step's report of the -1 id it fed on, and every record is cleared, so the next
    valid draft runs."""
    _, opt = layers(loaded, device)
    opt.graphs = eager_graphs(opt, buckets=(1, 2))
    opt.prefill_graphs = PrefillGraphs(opt, opt.graphs[0].cache, tokens=(8,), max_seqs=2,
                                       capture=False)  # fmt: skip
    ids, pos, prev, lens = prefix(2, [3, 2], device)
    bad = pos.clone()
    bad[4] = bad[3]
    with pytest.raises(InputError, match=r"^positions / cache_slots: sequence 1: a failed ring"):
        opt.draft(ids, bad, prev, seq_lens=lens, num_tokens=2)
    assert opt.draft(ids, pos, prev, seq_lens=lens, num_tokens=2).shape == (2, 2)
