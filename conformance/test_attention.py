"""MTP attention (spec 6): sliding window with sinks, RoPE, KV cache, FP8 simulation."""

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
