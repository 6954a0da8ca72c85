"""MTP attention (spec 6): sliding window with sinks, RoPE, KV cache, FP8 simulation; and the
optimized attention core (``sink_attention``, ``sink_attention_varlen``) against the reference:
decode against caches of 0 .. window+ keys with position gaps, prefill, varlen batches, non-finite
inputs, queries that see no key, position checks, batch invariance, the operators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4mtp.conformance._mtp_random import random_attention_params
from dsv4mtp.reference import DSV4Config, InputError
from dsv4mtp.reference.attention import AttentionParams, KVCache, attention
from dsv4mtp.reference.quant_sim import fp8_block_roundtrip
from dsv4mtp.reference.rope import apply_rope, rope_frequencies

F64, BF16 = torch.float64, torch.bfloat16
CFG = DSV4Config.tiny()  # window 16, 4 heads of 128 (64 rope), 2 output groups

# Tolerances against the independent dense float64 implementation below, per dtype.
#  float64: the two implementations order sums differently; 1e-12 relative is ~1e4 ulps, far
#           below any semantic slip (a missing sink or wrong rope pair moves the output by >1e-2).
#  bf16:    the layer rounds to bf16 (2^-8 relative) after each of ~8 projections / norms / rope;
#           the oracle rounds nowhere, so ~1e-2 relative is the expected distance; 3e-2 bounds it.
TOL_REL = {F64: 1e-12, BF16: 3e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "NaN/inf in output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def params_as(p: AttentionParams, dtype: torch.dtype) -> AttentionParams:
    """Linear weights in ``dtype`` (as the layer stores them); norms and sinks stay float64."""
    lin = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
    return AttentionParams(
        **{
            k: (getattr(p, k).to(dtype) if k in lin else getattr(p, k))
            for k in p.__dataclass_fields__
        }
    )


def dense_attention_oracle(
    x, positions, p: AttentionParams, cfg: DSV4Config, *, window: int | None = None
):
    """Appendix A's dense formulation, written independently, in float64: a full (T, T) mask,
    RoPE as a complex multiply, the sink as an extra softmax column that is then dropped."""
    T, H, Dh, Dr = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    eps = cfg.rms_norm_eps
    x = x.double()
    w = {k: getattr(p, k).double() for k in p.__dataclass_fields__}

    def norm(v, weight=None):
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        return v if weight is None else v * weight

    def rope(v, inverse=False):  # v (T, ..., Dr)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, Dr, 2, dtype=F64) / Dr)
        ang = positions.double()[:, None] * inv[None]
        rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang)
        rot = rot.view(T, *([1] * (v.dim() - 2)), Dr // 2)
        c = torch.view_as_complex(v.reshape(*v.shape[:-1], Dr // 2, 2).contiguous())
        return torch.view_as_real(c * rot).reshape(v.shape)

    q = (norm(x @ w["wq_a"].T, w["q_norm"]) @ w["wq_b"].T).view(T, H, Dh)
    q = norm(q)
    q = torch.cat([q[..., : Dh - Dr], rope(q[..., Dh - Dr :])], -1)
    kv = norm(x @ w["wkv"].T, w["kv_norm"])
    kv = torch.cat([kv[:, : Dh - Dr], rope(kv[:, Dh - Dr :])], -1)
    s = torch.einsum("thd,jd->htj", q, kv) / math.sqrt(Dh)  # (H, T, T)
    t, j = positions[:, None], positions[None, :]
    allowed = j <= t
    if window is not None:
        allowed &= (t - j) < window
    s = s.masked_fill(~allowed, float("-inf"))
    sink = w["attn_sink"].view(H, 1, 1).expand(H, T, 1)
    prob = torch.softmax(torch.cat([s, sink], -1), -1)[..., :T]  # drop the sink column
    o = torch.einsum("htj,jd->thd", prob, kv)
    o = torch.cat([o[..., : Dh - Dr], rope(o[..., Dh - Dr :], inverse=True)], -1)
    G, Ro = cfg.o_groups, cfg.o_lora_rank
    z = torch.einsum("tgc,grc->tgr", o.reshape(T, G, -1), w["wo_a"].view(G, Ro, -1))
    return z.reshape(T, G * Ro) @ w["wo_b"].T


def make(seed: int, T: int, dtype: torch.dtype, start: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = random_attention_params(CFG, g)
    x = torch.randn(T, CFG.hidden_size, generator=g, dtype=F64)
    return x.to(dtype), torch.arange(start, start + T), params_as(p, dtype), p


@pytest.mark.parametrize("dtype", [F64, BF16])
@pytest.mark.parametrize("T", [1, 7, 16])
def test_short_sequence_equals_dense_causal_attention(dtype, T) -> None:
    """T <= window: the window never binds, so the layer equals dense causal attention + sinks."""
    x, pos, p, p64 = make(T, T, dtype, start=5)
    out = attention(x, pos, p, CFG)
    ref = dense_attention_oracle(x, pos, p64, CFG)
    assert out.dtype == dtype and out.shape == (T, CFG.hidden_size)
    assert rel_err(out, ref) < TOL_REL[dtype]


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_long_sequence_equals_dense_windowed_attention(dtype) -> None:
    """T = 2.5 W: each query sees exactly the W most recent keys (itself included)."""
    T = 40
    x, pos, p, p64 = make(1, T, dtype, start=3)
    out = attention(x, pos, p, CFG)
    assert (
        rel_err(out, dense_attention_oracle(x, pos, p64, CFG, window=CFG.sliding_window))
        < TOL_REL[dtype]
    )
    # ...and the window matters: plain causal attention differs on the rows past W
    causal = dense_attention_oracle(x, pos, p64, CFG)
    assert rel_err(out[20:], causal[20:]) > 1e-2


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_incremental_decode_equals_full_recomputation_bitwise(dtype) -> None:
    """Chunks of 5, 1, 1, 9, 1, 13 with a KV cache == one call over the 30 rows, bit for bit:
    every projection is row-independent and each query reduces over the same W window slots."""
    T = 30
    x, pos, p, _ = make(2, T, dtype, start=11)
    full = attention(x, pos, p, CFG)
    cache, outs, start = KVCache(CFG.sliding_window), [], 0
    for n in (5, 1, 1, 9, 1, 13):
        outs.append(
            attention(x[start : start + n], pos[start : start + n], p, CFG, kv_cache=[cache])
        )
        start += n
        assert len(cache) <= CFG.sliding_window - 1  # window-bounded
    assert torch.equal(torch.cat(outs), full)


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_two_sequences_in_one_call_equal_two_calls(dtype) -> None:
    x, _, p, _ = make(3, 25, dtype)
    pos = torch.cat([torch.arange(7, 17), torch.arange(0, 15)])
    both = attention(x, pos, p, CFG, seq_lens=[10, 15])
    one = attention(x[:10], pos[:10], p, CFG)
    two = attention(x[10:], pos[10:], p, CFG)
    assert torch.equal(both, torch.cat([one, two]))


@given(
    seed=st.integers(0, 2**16),
    lens=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    starts=st.lists(st.integers(0, 5000), min_size=3, max_size=3),
    shift=st.integers(1, 10000),
)
def test_split_and_position_shift_properties(seed, lens, starts, shift) -> None:
    """Float64: (a) sequences never see each other; (b) RoPE is relative, so shifting every
    position of a sequence by a constant changes the output only by angle rounding (positions up
    to 15000 x frequency 1 lose ~1e-12 absolute of angle; tolerance 1e-9 relative)."""
    T = sum(lens)
    g = torch.Generator().manual_seed(seed)
    p = random_attention_params(CFG, g)
    x = torch.randn(T, CFG.hidden_size, generator=g, dtype=F64)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=False)])
    out = attention(x, pos, p, CFG, seq_lens=lens)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        assert torch.equal(out[sl], attention(x[sl], pos[sl], p, CFG))
        start += n
    assert rel_err(attention(x, pos + shift, p, CFG, seq_lens=lens), out) < 1e-9


def test_sinks_only_enter_the_denominator() -> None:
    """A sink of -inf removes it (plain softmax); a very large sink drives the output to what
    wo_b maps a zero attention output to, i.e. 0."""
    x, pos, p, _ = make(4, 12, F64)
    base = attention(x, pos, p, CFG)
    none = AttentionParams(
        **{**p.__dict__, "attn_sink": torch.full_like(p.attn_sink, float("-inf"))}
    )
    huge = AttentionParams(**{**p.__dict__, "attn_sink": torch.full_like(p.attn_sink, 1e4)})
    out_none = attention(x, pos, none, CFG)
    assert rel_err(base, out_none) > 1e-3  # the sinks matter
    assert torch.isfinite(out_none).all()
    assert attention(x, pos, huge, CFG).abs().max() == 0


def test_rope_inverse_and_yarn_frequencies() -> None:
    g = torch.Generator().manual_seed(5)
    v = torch.randn(9, 4, 64, generator=g, dtype=F64)
    pos = torch.randint(0, 100000, (9,), generator=g)
    f = rope_frequencies(64, 10000.0, dtype=F64)
    back = apply_rope(apply_rope(v, pos, f), pos, f, inverse=True)
    assert rel_err(back, v) < 1e-12
    # Flash's YaRN on base 10000: pairs 0..20 keep their frequency, 21..31 are interpolated
    # towards f / 16 (spec 6.4: lo = 20, hi = 33), and the last pair is not fully divided.
    yarn = rope_frequencies(64, 10000.0, mode="yarn", rope_scaling=CFG.rope_scaling, dtype=F64)
    assert torch.equal(yarn[:21], f[:21])
    assert (yarn[21:] < f[21:]).all() and (yarn[21:] > f[21:] / 16).all()
    x, pos2, p, _ = make(6, 16, F64, start=40)
    assert rel_err(attention(x, pos2, p, CFG, rope_mode="yarn"), attention(x, pos2, p, CFG)) > 1e-6


def test_fp8_kv_rounds_only_the_nope_dims() -> None:
    """fp8_kv changes the output (by ~e4m3 precision, 2^-4 relative per value, averaged down)
    and the rounding is a projection: rounding twice equals rounding once."""
    x, pos, p, _ = make(7, 16, F64)
    exact, rounded = attention(x, pos, p, CFG), attention(x, pos, p, CFG, fp8_kv=True)
    assert 1e-4 < rel_err(rounded, exact) < 5e-2
    v = torch.randn(5, 64, dtype=F64) * 3
    once = fp8_block_roundtrip(v, 64)
    assert torch.equal(fp8_block_roundtrip(once, 64), once)
    # known answer: amax 448 * 2^-3 -> scale 2^-3 exactly; 1.0 / 2^-3 = 8 is on the e4m3 grid
    known = torch.tensor([[56.0, 1.0, -0.3]], dtype=F64)
    s = 2.0**-3
    expect = torch.tensor([[56.0, 1.0, -0.3 / s]], dtype=torch.float64)
    expect[0, 2] = float(torch.tensor(-0.3 / s).to(torch.float8_e4m3fn).double()) * s
    assert torch.equal(fp8_block_roundtrip(known, 64), expect)


def test_bad_inputs_raise_input_error() -> None:
    x, pos, p, _ = make(8, 6, F64)
    with pytest.raises(InputError, match="seq_lens"):
        attention(x, pos, p, CFG, seq_lens=[2, 3])
    with pytest.raises(InputError, match="kv_cache"):
        attention(x, pos, p, CFG, seq_lens=[3, 3], kv_cache=[KVCache(16)])
    with pytest.raises(InputError, match="positions"):
        attention(x, pos.flip(0), p, CFG)
    cache = KVCache(16)
    attention(x, pos, p, CFG, kv_cache=[cache])
    with pytest.raises(InputError, match="positions"):  # does not continue past the cache
        attention(x, pos, p, CFG, kv_cache=[cache])
    assert attention(x[:0], pos[:0], p, CFG).shape == (0, CFG.hidden_size)


# ================================================================ the optimized attention core
# Shapes come from the one builder (conformance/inputs.py, attention_inputs); tolerances are the
# pairs' (conformance/pairs.py).  On CPU the Triton kernel runs in the interpreter.
def _opt():  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    import dsv4mtp.optimized as opt

    return opt


def _varlen(
    lens: list[int],
    caches: list[int],
    dtype: torch.dtype,
    device: str,
    *,
    shape: str = "small",
    seed: int = 0,
    gap: float = 0.4,
):  # type: ignore[no-untyped-def]
    from dsv4mtp.conformance.inputs import attention_inputs

    return attention_inputs(
        "sink_attention_varlen", sum(lens), seed, shape=shape, dtype=dtype, device=device,
        lens=lens, caches=caches, gap=gap,
    )  # fmt: skip


def _check(op: str, args, kw, dtype: torch.dtype, label: str) -> None:  # type: ignore[no-untyped-def]
    import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs)
    from dsv4mtp.conformance.differential import check_pair
    from dsv4mtp.conformance.registry import REGISTRY, Case

    check_pair(REGISTRY[op], Case(args, kw, label=label), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_optimized_decode_against_caches_of_every_length(dtype, device) -> None:
    """Decode: one query per sequence against 0, 1, W-1, W, W+1 and 2W+3 cached keys (plus its
    own), positions with gaps, in one varlen launch and one sequence at a time."""
    _opt()
    W = 16
    caches = [0, 1, W - 1, W, W + 1, 2 * W + 3]
    args, kw = _varlen([1] * len(caches), caches, dtype, device, seed=1)
    _check("sink_attention_varlen", args, kw, dtype, f"decode caches={caches}")
    cu_q, cu_k = args[5].tolist(), args[6].tolist()
    for b in (0, 3, 5):
        q_rows, k_rows = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = (args[0][q_rows], args[1][q_rows], args[2][k_rows], args[3][k_rows], args[4])
        _check("sink_attention", one, kw, dtype, f"decode cache={caches[b]}")


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_optimized_prefill_and_mixed_batches(dtype, device) -> None:
    """Prefill: Tq = Tk = 3W under the causal window (no cache), then a batch mixing a prefill
    with a cache, decodes and an empty sequence."""
    _opt()
    W = 16
    args, kw = _varlen([3 * W], [0], dtype, device, seed=2)
    _check("sink_attention", args[:5], kw, dtype, "prefill 3W")
    args, kw = _varlen([20, 1, 0, 1, 7], [5, W - 1, 3, 0, 2 * W], dtype, device, seed=3)
    _check("sink_attention_varlen", args, kw, dtype, "mixed batch")


def test_optimized_decode_gives_the_bits_of_the_prefill_row(device) -> None:
    """A prefill row and a decode of the same query against the keys up to its own are bitwise
    equal (blocks start at each row's first visible key, whatever else is in the call)."""
    opt = _opt()
    args, kw = _varlen([40], [0], BF16, device, seed=4)
    q, q_pos, kv, k_pos, sink = args[:5]
    full = opt.sink_attention(q, q_pos, kv, k_pos, sink, **kw, batch_invariant=True)
    for t in (0, 5, 17, 39):
        one = opt.sink_attention(
            q[t : t + 1], q_pos[t : t + 1], kv[: t + 1], k_pos[: t + 1], sink, **kw,
            batch_invariant=True,
        )  # fmt: skip
        assert torch.equal(one, full[t : t + 1]), f"row {t}"


def test_optimized_sequence_is_bitwise_the_same_alone_and_batched(device) -> None:
    opt = _opt()
    lens, caches = [9, 1, 14], [3, 16, 0]
    args, kw = _varlen(lens, caches, BF16, device, seed=5)
    q, q_pos, kv, k_pos, sink, cu_q, cu_k = args
    both = opt.sink_attention_varlen(*args, **kw, batch_invariant=True)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        alone = opt.sink_attention(
            q[rows], q_pos[rows], kv[keys], k_pos[keys], sink, **kw, batch_invariant=True
        )
        assert torch.equal(alone, both[rows]), f"sequence {b}"


def _nonfinite_pattern(out: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(out.double())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("where", ["q", "kv_seen", "kv_unseen", "sink_inf", "sink_nan"])
def test_optimized_non_finite_inputs_propagate_as_the_reference(where: str, device) -> None:
    """A NaN / inf input reaches exactly the outputs the reference's reaches: q[t, h] only its
    own (t, h); a key the queries that see it (all heads) and no other, also when it sits next to
    visible keys; a sink its head.  The finite outputs stay within the fp32 tolerance."""
    from dsv4mtp.reference.attention import sink_attention_varlen as ref_varlen

    opt = _opt()
    # sequence 0: 20 cached keys then 12 queries at consecutive positions (window 16), so the
    # first query sees keys 5 .. 20 and the last one keys 16 .. 31; sequence 1: one decode
    args, kw = _varlen([12, 1], [20, 9], torch.float32, device, seed=6, gap=0.0)
    q, q_pos, kv, k_pos, sink, cu_q, cu_k = (a.clone() for a in args)
    if where == "q":
        q[3, 2, 5] = float("nan")
    elif where == "kv_seen":
        kv[31] = float("inf")  # seen by the last query of sequence 0 only
    elif where == "kv_unseen":
        kv[4] = float("nan")  # next to the first query's first visible key, seen by none
    elif where == "sink_inf":
        sink[1] = float("inf")
    else:
        sink[2] = float("nan")
    call = (q, q_pos, kv, k_pos, sink, cu_q, cu_k)
    got = opt.sink_attention_varlen(*call, **kw)
    want = ref_varlen(*call, **kw)
    bad = _nonfinite_pattern(want)
    expected_rows = {"q": 1, "kv_seen": 1, "kv_unseen": 0, "sink_inf": 13, "sink_nan": 13}
    assert int(bad.any(-1).any(-1).sum()) == expected_rows[where], where
    assert torch.equal(_nonfinite_pattern(got), bad), where
    rel = float((got.double() - want.double())[~bad].norm() / want.double()[~bad].norm())
    assert rel < 2e-6, f"{where}: finite outputs off by {rel:.2e}"


def test_a_query_that_sees_no_key_returns_zero(device) -> None:
    """All the weight on the sink: no cached key in the window, or no key at all."""
    from dsv4mtp.reference.attention import sink_attention as ref_attention

    opt = _opt()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 64, generator=g).to(device)
    kv = torch.randn(5, 64, generator=g).to(device)
    sink = torch.randn(4, generator=g).to(device)
    k_pos = torch.tensor([0, 1, 2, 30, 31], device=device)
    q_pos = torch.tensor([20, 2, 29], device=device)  # row 0 sees nothing, row 2 nothing
    kw = dict(window=8, scale=0.125)
    for fn in (ref_attention, opt.sink_attention):
        out = fn(q, q_pos, kv, k_pos, sink, **kw)
        assert out[0].abs().max() == 0 and out[2].abs().max() == 0 and out[1].abs().max() > 0
        empty = fn(q, q_pos, kv[:0], k_pos[:0], sink, **kw)
        assert empty.shape == q.shape and empty.abs().max() == 0


def test_optimized_rejects_bad_positions_and_offsets_as_the_reference(device) -> None:
    import dsv4mtp.reference as ref

    opt = _opt()
    args, kw = _varlen([3, 2], [2, 1], torch.float32, device, seed=8)
    q, q_pos, kv, k_pos, sink, cu_q, cu_k = args
    bad_k = k_pos.clone()
    bad_k[1] = bad_k[0]
    bad_cu = cu_q.clone()
    bad_cu[1] = 9
    short = cu_k.clone()
    short[-1] -= 1
    for fn in (ref.sink_attention_varlen, opt.sink_attention_varlen):
        with pytest.raises(InputError, match=r"^k_pos: expected strictly increasing"):
            fn(q, q_pos, kv, bad_k, sink, cu_q, cu_k, **kw)
        with pytest.raises(InputError, match=r"^cu_q: expected non-decreasing prefix offsets"):
            fn(q, q_pos, kv, k_pos, sink, bad_cu, cu_k, **kw)
        with pytest.raises(InputError, match=r"^cu_k: expected non-decreasing prefix offsets"):
            fn(q, q_pos, kv, k_pos, sink, cu_q, short, **kw)
    for fn in (ref.sink_attention, opt.sink_attention):
        with pytest.raises(InputError, match=r"^k_pos: expected strictly increasing"):
            fn(q, q_pos, kv, k_pos.flip(0), sink, **kw)
    with pytest.raises(InputError, match=r"^kv: expected dtype"):
        opt.sink_attention(q, q_pos, kv.to(BF16), k_pos, sink, **kw)


def test_optimized_schedules_agree(device) -> None:
    """A non-default schedule (16 heads, 16 keys, 16-wide Dh chunks, 32-wide output slices,
    4-value search steps) computes the same function."""
    opt = _opt()
    from dsv4mtp.optimized.kernels.sink_attention import AttentionSchedule

    args, kw = _varlen([17, 1], [20, 3], torch.float32, device, seed=9)
    sched = AttentionSchedule(16, 16, 16, 32, search=4)
    got = opt.sink_attention_varlen(*args, **kw, schedule=sched)
    want = opt.sink_attention_varlen(*args, **kw)
    assert float((got - want).norm() / want.norm()) < 2e-6
    with pytest.raises(InputError, match=r"^schedule"):
        opt.sink_attention_varlen(*args, **kw, schedule=AttentionSchedule(16, 24, 16, 32))


def test_the_default_schedule_reads_the_row_count_only_outside_batch_invariant_mode() -> None:
    """From WIDE_ROWS rows the bf16 default splits the output into 256-wide slices over 8 warps
    with three pipeline stages; from WHOLE_ROWS rows at Dh 512 it takes the whole row per
    program (Dh in one chunk, the 512-wide output, 8 warps, three stages; two in the
    ring-cache and paged kernels); each with two stages on a device with less shared memory
    per block.  The heads, key blocks and search (what sets the reduction order over keys)
    never change.  Other Dh from 256 stop at the 256-wide slices; fp32, a Dh without a
    256-wide slice and the T-independent default (``rows=None``, what
    ``batch_invariant=True`` pins) keep the narrow tiles."""
    pytest.importorskip("triton")
    from dsv4mtp.optimized.attention import _schedule_fields
    from dsv4mtp.optimized.kernels.sink_attention import (
        WHOLE_3_STAGE_SMEM,
        WHOLE_ROWS,
        WIDE_3_STAGE_SMEM,
        WIDE_ROWS,
        AttentionSchedule,
        attention_schedule,
    )

    def sched(rows: int | None, Dh: int = 512, max_smem: int | None = None) -> AttentionSchedule:
        return attention_schedule(64, Dh, 128, rows=rows, max_smem=max_smem)

    narrow, wide, whole = sched(None), sched(WIDE_ROWS), sched(WHOLE_ROWS)
    assert sched(WIDE_ROWS - 1) == narrow and sched(1) == narrow
    assert sched(WHOLE_ROWS - 1) == wide and sched(1 << 20) == whole
    assert attention_schedule(128, 512, 128, rows=WHOLE_ROWS).fields() == whole.fields()  # Pro
    tiles = lambda s: (s.block_d, s.block_dv, s.num_warps, s.num_stages)  # noqa: E731
    assert tiles(narrow) == (64, 128, 4, 2)
    assert tiles(wide) == (64, 256, 8, 3)
    assert tiles(whole) == (512, 512, 8, 3)
    for f in ("block_h", "block_n", "search"):  # the reduction order over keys
        assert getattr(wide, f) == getattr(narrow, f) == getattr(whole, f), f
    # the ring-cache and paged kernels take the whole row with two stages, nothing else differs
    cached = attention_schedule(64, 512, 128, rows=WHOLE_ROWS, cached=True)
    assert cached.num_stages == 2 and cached.fields()[:6] == whole.fields()[:6]
    for rows in (None, 1, WIDE_ROWS):
        assert attention_schedule(64, 512, 128, rows=rows, cached=True) == sched(rows)
    assert tiles(sched(WHOLE_ROWS, Dh=256))[:3] == (64, 256, 8)  # the whole row at 512 only
    assert sched(WIDE_ROWS - 1, Dh=256) == sched(None, Dh=256)
    assert attention_schedule(64, 512, 128, True, rows=4096) == attention_schedule(
        64, 512, 128, True
    )
    assert attention_schedule(4, 64, 16, rows=4096) == attention_schedule(4, 64, 16)
    # three stages need 208 KiB (256-wide slices) / 160 KiB (the whole row) of shared memory
    # per block: two where the device holds less, the same tiles otherwise
    from dsv4mtp.optimized._ops import _smem_per_block

    for rows, smem, full in ((WIDE_ROWS, WIDE_3_STAGE_SMEM, wide),
                             (WHOLE_ROWS, WHOLE_3_STAGE_SMEM, whole)):  # fmt: skip
        small = sched(rows, max_smem=smem - 1)
        assert small.num_stages == 2 and small.fields()[:6] == full.fields()[:6]
        assert sched(rows, max_smem=smem) == full == sched(rows, max_smem=232448)
    assert _smem_per_block(torch.device("cpu")) is None
    assert _schedule_fields(None, 64, 512, 128, BF16, False) == []  # the op picks by its rows
    assert _schedule_fields(None, 64, 512, 128, BF16, True) == narrow.fields()


def _default_tiles() -> dict[str, object]:
    """The bf16 default's three schedules at V4-Flash shapes, by name."""
    from dsv4mtp.optimized.kernels.sink_attention import (
        WHOLE_ROWS,
        WIDE_ROWS,
        attention_schedule,
    )

    return {
        "narrow": attention_schedule(64, 512, 128),
        "wide": attention_schedule(64, 512, 128, rows=WIDE_ROWS),
        "whole": attention_schedule(64, 512, 128, rows=WHOLE_ROWS),
        # the ring-cache and paged kernels' own (two stages)
        "whole_cached": attention_schedule(64, 512, 128, rows=WHOLE_ROWS, cached=True),
    }


@pytest.mark.gpu
def test_the_wide_and_narrow_schedules_give_the_same_bits() -> None:
    """The default's bf16 schedules at V4-Flash shapes (the narrow tiles, the 256-wide slices,
    the whole row with three stages and the cached kernels' two), in the contiguous kernel on
    a 200-row prefill and on 64 decode rows against full windows, and in the ring-cache and
    paged kernels: bitwise equal outputs (so a decode row keeps the bits of the same row inside
    a prefill whatever the two calls' row counts)."""
    from dsv4mtp.conformance.inputs import attention_inputs

    opt = _opt()
    op, W = "sink_attention_varlen", 128
    tiles = _default_tiles()
    for lens, caches in (([200], [0]), ([1] * 64, [W - 1] * 64)):
        args, kw = attention_inputs(
            op, sum(lens), 21, shape="flash", dtype=BF16, device="cuda", lens=lens, caches=caches
        )
        outs = {n: opt.sink_attention_varlen(*args, **kw, schedule=t) for n, t in tiles.items()}
        assert torch.isfinite(outs["whole"]).all()
        for name in tiles:
            assert torch.equal(outs[name], outs["narrow"]), f"{name} lens {lens[:2]}"
        if lens == [200]:  # the op's own default at 200 rows is the whole row
            assert torch.equal(opt.sink_attention_varlen(*args, **kw), outs["narrow"])
    _ring_and_paged_tiles_agree(tiles)


def _ring_and_paged_tiles_agree(tiles: dict[str, object]) -> None:
    """The ring-cache and paged kernels (what a captured decode and an engine's cache run) at
    64 decode rows, each row's 128-row window in its own ring / its own eight 16-row blocks:
    every schedule gives the same bits, and the contiguous kernel's."""
    from dsv4mtp.optimized.kernels.sink_attention import (
        sink_attention_cache_triton,
        sink_attention_paged_triton,
        sink_attention_triton,
    )

    B, H, Dh, W, BS = 64, 64, 512, 128, 16
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(B, H, Dh, device="cuda", generator=g).to(BF16)
    kv = torch.randn(B, W, Dh, device="cuda", generator=g).to(BF16)
    sink = torch.randn(H, device="cuda", generator=g) * 2
    pos = torch.arange(W, device="cuda", dtype=torch.int32).repeat(B, 1)  # full windows
    q_pos = torch.full((B,), W - 1, device="cuda")
    table = torch.arange(B * (W // BS), device="cuda", dtype=torch.int32).view(B, W // BS)
    scale = Dh**-0.5
    outs = {}
    for name, sched in tiles.items():
        ring = torch.full_like(q, float("nan"))  # poisoned: a skipped row shows
        sink_attention_cache_triton(
            q, q_pos, kv, pos, torch.arange(B, device="cuda"), sink, ring, W, scale, sched
        )
        paged = torch.full_like(q, float("nan"))
        sink_attention_paged_triton(
            q, q_pos, kv.view(-1, BS, Dh), pos.view(-1, BS), table, sink, paged, W, scale, sched
        )
        assert torch.isfinite(ring).all() and torch.isfinite(paged).all(), name
        outs[name] = (ring, paged)
    for name, (ring, paged) in outs.items():
        assert torch.equal(ring, outs["narrow"][0]), f"ring {name}"
        assert torch.equal(paged, outs["narrow"][0]), f"paged {name}"
    for b in (0, B - 1):  # the contiguous kernel on one row's keys
        flat = torch.full_like(q[b : b + 1], float("nan"))
        sink_attention_triton(
            q[b : b + 1], q_pos[b : b + 1], kv[b], pos[b], sink, None, None, flat, W, scale,
            tiles["narrow"],
        )  # fmt: skip
        assert torch.equal(outs["narrow"][0][b : b + 1], flat), f"row {b}"


@pytest.mark.parametrize("variant", ["", "_out"])
@pytest.mark.parametrize("op", ["sink_attention", "sink_attention_varlen"])
def test_attention_opcheck(op: str, variant: str, device) -> None:
    """Schema, fake kernel and AOT dispatch of the operators (torch.library.opcheck)."""
    _opt()
    args, kw = _varlen([3, 1], [2, 5], BF16 if device == "cuda" else torch.float32, device)
    tensors = args if op.endswith("varlen") else args[:5]
    call = (*tensors, kw["window"], kw["scale"], "triton", [])
    outs = {"out": torch.empty_like(args[0])} if variant else {}
    torch.library.opcheck(getattr(torch.ops.dsv4mtp, op + variant).default, call, outs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["flash", "pro"])
def test_optimized_full_shapes_decode_and_prefill(shape: str) -> None:
    """V4-Flash / V4-Pro (H 64 / 128, Dh 512, window 128), bf16: 32 decodes against full caches,
    then a 1024-row prefill batched with a decode, and the varlen decode captured in a CUDA
    graph and replayed on another split of the same sizes."""
    from dsv4mtp.conformance.inputs import attention_inputs

    opt = _opt()
    op = "sink_attention_varlen"
    W = 128
    for lens, caches in (([1] * 32, [W - 1] * 32), ([1024, 1], [0, W - 1])):
        args, kw = attention_inputs(
            op, sum(lens), 11, shape=shape, dtype=BF16, device="cuda", lens=lens, caches=caches
        )
        _check(op, args, kw, BF16, f"{shape} lens={lens[:2]} caches={caches[:2]}")
    lens, caches = [1] * 8, [W - 1, 0, 5, W - 1, 2 * W, 1, W - 1, 3]
    args, kw = attention_inputs(
        op, 8, 12, shape=shape, dtype=BF16, device="cuda", lens=lens, caches=caches
    )
    out = opt.sink_attention_varlen(*args, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.sink_attention_varlen(*args, **kw, out=out)
    moved = caches[::-1]  # the same Tk split another way
    fresh, _ = attention_inputs(
        op, 8, 13, shape=shape, dtype=BF16, device="cuda", lens=lens, caches=moved
    )
    for dst, src in zip(args, fresh, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, opt.sink_attention_varlen(*fresh, **kw))
