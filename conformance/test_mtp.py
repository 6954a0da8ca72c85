"""The MTP layer end to end: presets, forward, KV cache, logits, drafting, errors, checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4mtp.conformance._mtp_random import random_mtp_layer
from dsv4mtp.reference import (
    PRESETS,
    ConfigError,
    DSV4Config,
    InputError,
    MTPLayer,
    resolve_semantics,
)

F64, BF16 = torch.float64, torch.bfloat16
CFG = DSV4Config.tiny()

# Incremental decoding vs full recomputation of the whole layer:
#  float64: every product and reduction of the reference is row-independent (rowwise matmuls,
#           explicit sums), but torch's CPU transcendental kernels (sigmoid, exp) take a SIMD
#           path for full vector chunks and a scalar one for the tail, so the same element can
#           round differently (~1 ulp) depending on how many tokens share the call; 1e-13
#           relative bounds the propagated difference (observed ~1e-16).
#  bf16:    the same 1-ulp differences occasionally flip a bf16 rounding (2^-8), which then
#           propagates through 2 sublayers; observed ~3e-3, bound 2e-2.
TOL_INCREMENTAL = {F64: 1e-13, BF16: 2e-2}
# bf16 reference vs the float64 oracle on the same (bf16-representable) weights: ~10 chained
# bf16 roundings of 2^-8 each plus routing near-ties; relative error on logits bound 5e-2.
TOL_BF16_VS_F64 = 5e-2

_LAYERS: dict[tuple, MTPLayer] = {}


def layer(
    dtype: torch.dtype = F64, preset: str = "math", seed: int = 0, cfg: DSV4Config = CFG, **sw
) -> MTPLayer:
    key = (dtype, preset, seed, cfg, tuple(sorted(sw.items())))
    if key not in _LAYERS:
        _LAYERS[key] = random_mtp_layer(cfg, dtype=dtype, seed=seed, preset=preset, **sw)
    return _LAYERS[key]


def inputs(T: int, dtype: torch.dtype, *, seed: int = 1, start: int = 3, cfg: DSV4Config = CFG):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    prev = torch.randn(T, cfg.hc_dim, generator=g, dtype=F64).to(dtype)
    return ids, torch.arange(start, start + T), prev


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "NaN/inf in output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


# ------------------------------------------------------------------ presets
def test_presets_match_the_documented_table() -> None:
    """PRESETS, row by row, against the table in docs/semantics.md ("Presets and switches")."""
    expect = {
        "mask_pos0": (False, False, True),
        "rope_mode": ("plain", "plain", "yarn"),
        "norm_order": ("official", "official", "vllm"),
        "shared_clamp": (True, True, True),
        "fp8_kv": (False, True, True),
        "act_quant": (False, True, True),
    }
    assert list(PRESETS) == ["math", "official", "vllm"]
    for name, values in expect.items():
        assert tuple(getattr(PRESETS[p], name) for p in PRESETS) == values, name
    assert {f.name for f in dataclasses.fields(PRESETS["math"])} == set(expect)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "semantics.md").read_text()
    section = doc.split("\n## Presets and switches\n", 1)[1].split("\n## ", 1)[0]
    for name in expect:  # the section's markdown table has a row for every switch
        assert f"\n| `{name}`" in section, name


def test_switches_override_presets_and_reject_nonsense() -> None:
    assert resolve_semantics("vllm", mask_pos0=False).mask_pos0 is False
    assert resolve_semantics("official", rope_mode="yarn").rope_mode == "yarn"
    with pytest.raises(ConfigError, match="preset"):
        resolve_semantics("fast")
    with pytest.raises(ConfigError, match="fp8kv"):
        resolve_semantics("math", fp8kv=True)
    with pytest.raises(ConfigError, match="rope_mode"):
        resolve_semantics("math", rope_mode="neox")
    with pytest.raises(ConfigError, match="act_quant"):
        resolve_semantics("math", act_quant=1)
    with pytest.raises(ConfigError, match="preset"):
        resolve_semantics(["vllm"])  # type: ignore[arg-type]


# ------------------------------------------------------------------ forward
@pytest.mark.parametrize("dtype", [F64, BF16])
def test_incremental_decode_equals_full_recomputation(dtype) -> None:
    L = layer(dtype)
    ids, pos, prev = inputs(30, dtype)
    full = L.forward(ids, pos, prev)
    cache, outs, s = L.new_kv_cache(), [], 0
    for n in (5, 1, 1, 9, 1, 13):
        outs.append(L.forward(ids[s : s + n], pos[s : s + n], prev[s : s + n], kv_cache=cache))
        s += n
    assert rel_err(torch.cat(outs), full) < TOL_INCREMENTAL[dtype]


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_two_sequences_in_one_call_equal_two_calls(dtype) -> None:
    """Same tolerance as incremental decoding: the only cross-row effect is BLAS rounding in hc_*."""
    L = layer(dtype)
    ids, _, prev = inputs(21, dtype)
    pos = torch.cat([torch.arange(0, 9), torch.arange(40, 52)])
    both = L.forward(ids, pos, prev, seq_lens=torch.tensor([9, 12]))
    sep = torch.cat([L.forward(ids[:9], pos[:9], prev[:9]), L.forward(ids[9:], pos[9:], prev[9:])])
    assert rel_err(both, sep) < TOL_INCREMENTAL[dtype]


@given(
    data=st.data(),
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    shift=st.integers(1, 3000),
)
def test_hypothesis_ids_positions_splits(data, lens, shift) -> None:
    """Float64 math preset: any split into sequences equals separate calls, and (no position-0
    mask, RoPE relative) shifting a sequence's positions changes nothing beyond angle rounding
    (1e-9 relative: angles up to ~5000 rad carry ~1e-12 absolute error, amplified by the layer)."""
    L = layer(F64)
    T = sum(lens)
    ids = torch.tensor(
        data.draw(st.lists(st.integers(0, CFG.vocab_size - 1), min_size=T, max_size=T))
    )
    starts = data.draw(st.lists(st.integers(1, 2000), min_size=len(lens), max_size=len(lens)))
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    prev = torch.randn(T, CFG.hc_dim, generator=torch.Generator().manual_seed(T), dtype=F64)
    out = L.forward(ids, pos, prev, seq_lens=torch.tensor(lens))
    s = 0
    for n in lens:
        sl = slice(s, s + n)
        assert rel_err(out[sl], L.forward(ids[sl], pos[sl], prev[sl])) < TOL_INCREMENTAL[F64]
        s += n
    shifted = L.forward(ids, pos + shift, prev, seq_lens=torch.tensor(lens))
    assert rel_err(shifted, out) < 1e-9


def test_mask_pos0_zeroes_the_embedding_at_position_zero() -> None:
    """With mask_pos0 the row at position 0 ignores its token; other rows keep theirs."""
    L = layer(F64, "math", mask_pos0=True)
    ids, _, prev = inputs(4, F64)
    pos = torch.arange(4)
    other = ids.clone()
    other[0] = (ids[0] + 1) % CFG.vocab_size
    a, b = L.forward(ids, pos, prev), L.forward(other, pos, prev)
    assert torch.equal(a, b)
    assert not torch.equal(layer(F64).forward(ids, pos, prev), layer(F64).forward(other, pos, prev))


def test_presets_differ_by_small_amounts() -> None:
    """Each switch alone moves the output (positions from 1, so mask_pos0 is tested above); the
    rounding switches stay within e4m3 precision of the exact math in float64 (3 mantissa bits:
    2^-5 relative rms per rounded value; bound 0.2 after propagation through the layer)."""
    ids, pos, prev = inputs(20, F64, start=1)
    base = layer(F64).forward(ids, pos, prev)
    for switch, value, bound in [
        ("fp8_kv", True, 0.2),
        ("act_quant", True, 0.2),
        ("rope_mode", "yarn", 0.2),
        ("norm_order", "vllm", 1e-12),  # shared_clamp: see test_moe (needs |u| > limit)
    ]:
        err = rel_err(layer(F64, "math", **{switch: value}).forward(ids, pos, prev), base)
        # the norm order only matters when the cast rounds: in float64 it is the identity
        assert (err < bound) if switch == "norm_order" else (1e-5 < err < bound), (switch, err)
    for preset in ("official", "vllm"):
        assert 1e-4 < rel_err(layer(F64, preset).forward(ids, pos, prev), base) < 0.2


def test_t_zero_returns_empty() -> None:
    L = layer(BF16)
    ids, pos, prev = inputs(0, BF16)
    out = L.forward(ids, pos, prev)
    assert out.shape == (0, CFG.hc_dim) and out.dtype == BF16
    assert L.compute_logits(out).shape == (0, CFG.vocab_size)


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        (lambda i, p, h: (torch.tensor([0, CFG.vocab_size, 1]), p, h), "input_ids"),
        (lambda i, p, h: (i.clamp(max=-1), p, h), "input_ids"),
        (lambda i, p, h: (i, p - 5, h), "positions"),
        (lambda i, p, h: (i, p, h[:, :-1]), "prev_hidden"),
        (lambda i, p, h: (i, p, h.float()), "prev_hidden"),
        (lambda i, p, h: (i.int(), p, h), "input_ids"),
        (lambda i, p, h: (i, p.float(), h), "positions"),
        (lambda i, p, h: (i, p[:2], h), "positions"),
    ],
)
def test_bad_inputs_raise_input_error_naming_the_argument(change, argument) -> None:
    L = layer(BF16)
    ids, pos, prev = change(*inputs(3, BF16))
    with pytest.raises(InputError, match=argument):
        L.forward(ids, pos, prev)


def test_bad_seq_lens_and_caches() -> None:
    L = layer(BF16)
    ids, pos, prev = inputs(5, BF16)
    with pytest.raises(InputError, match="seq_lens"):
        L.forward(ids, pos, prev, seq_lens=torch.tensor([2, 2]))
    with pytest.raises(InputError, match="seq_lens"):
        L.forward(ids, pos, prev, seq_lens=torch.tensor([2, 3], dtype=torch.int32))
    with pytest.raises(InputError, match="kv_cache"):
        L.forward(ids, pos, prev, seq_lens=torch.tensor([2, 3]), kv_cache=[L.new_kv_cache()])
    with pytest.raises(InputError, match="hidden"):
        L.compute_logits(prev.float())
    with pytest.raises(InputError, match="num_tokens"):
        L.draft(ids, pos, prev, num_tokens=0)


# ------------------------------------------------------------------ logits and drafting
def test_draft_equals_a_manual_loop() -> None:
    """draft() = step 0 over all rows, then per sequence: argmax token, position + 1, own residual,
    with a KV cache holding the earlier rows (float64; the same calls, so bitwise)."""
    L = layer(F64)
    ids, _, prev = inputs(11, F64)
    pos = torch.cat([torch.arange(5, 10), torch.arange(0, 6)])
    lens = torch.tensor([5, 6])
    tokens, logits = L.draft(ids, pos, prev, seq_lens=lens, num_tokens=3, return_logits=True)
    assert tokens.shape == (2, 3) and logits.shape == (2, 3, CFG.vocab_size)
    for b, (lo, hi) in enumerate([(0, 5), (5, 11)]):
        cache = L.new_kv_cache()
        h = L.forward(ids[lo:hi], pos[lo:hi], prev[lo:hi], kv_cache=cache)[-1:]
        p = pos[hi - 1 : hi]
        for k in range(3):
            lg = L.compute_logits(h)
            assert torch.allclose(lg[0], logits[b, k], rtol=1e-12, atol=1e-12)
            tok = lg.argmax(-1)
            assert int(tok) == int(tokens[b, k])
            p = p + 1
            h = L.forward(tok, p, h, kv_cache=cache)


def test_draft_uses_layer_step_mod_num_layers() -> None:
    """With 2 MTP layers, step k runs layer k % 2 for forward and logits, each with its own cache."""
    cfg = CFG.replace(num_nextn_predict_layers=2, compress_ratios=(0, 0, 0, 0))
    L = random_mtp_layer(cfg, dtype=F64, seed=3)
    ids, pos, prev = inputs(6, F64, cfg=cfg)
    _tokens, logits = L.draft(ids, pos, prev, num_tokens=3, return_logits=True)
    caches = [L.new_kv_cache(), L.new_kv_cache()]
    h = L.forward(ids, pos, prev, kv_cache=caches[0], spec_step=0)[-1:]
    p = pos[-1:]
    for k in range(3):
        lg = L.compute_logits(h, spec_step=k)
        assert torch.allclose(lg[0], logits[0, k], rtol=1e-12, atol=1e-12)
        tok = lg.argmax(-1)
        assert int(tok) == int(_tokens[0, k])
        p = p + 1
        h = L.forward(tok, p, h, kv_cache=caches[(k + 1) % 2], spec_step=k + 1)
    # and the second layer matters
    same = random_mtp_layer(cfg, dtype=F64, seed=3)
    same.layers[1] = same.layers[0]
    assert not torch.equal(same.draft(ids, pos, prev, num_tokens=3, return_logits=True)[1], logits)


def test_sampling_is_reproducible_with_a_generator() -> None:
    L = layer(F64)
    ids, pos, prev = inputs(4, F64)

    def draw():
        return L.draft(
            ids,
            pos,
            prev,
            num_tokens=4,
            greedy=False,
            temperature=0.7,
            generator=torch.Generator().manual_seed(9),
        )

    assert torch.equal(draw(), draw())
    with pytest.raises(InputError, match="temperature"):
        L.draft(ids, pos, prev, num_tokens=1, greedy=False, temperature=0.0)


def test_bf16_agrees_with_the_float64_oracle() -> None:
    """Same weights (bf16-representable), same inputs: logits within TOL_BF16_VS_F64 relative and
    the greedy token agrees on at least 90 % of rows (the rest are near-ties)."""
    lb = random_mtp_layer(CFG, dtype=BF16, seed=0)
    ids, pos, prev16 = inputs(32, BF16)
    out16 = lb.forward(ids, pos, prev16)
    lg16 = lb.compute_logits(out16)
    l64b = _as_float64(lb)
    lg64 = l64b.compute_logits(l64b.forward(ids, pos, prev16.double()))
    assert lg16.dtype == torch.float32 and lg64.dtype == F64
    assert rel_err(lg16, lg64) < TOL_BF16_VS_F64
    agree = (lg16.argmax(-1) == lg64.argmax(-1)).double().mean()
    assert agree >= 0.9


def _as_float64(lb: MTPLayer) -> MTPLayer:
    """The same layer with every (bf16-valued) tensor widened to float64."""

    def widen(obj):
        if isinstance(obj, torch.Tensor):
            return obj.double() if obj.is_floating_point() else obj
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return type(obj)(
                **{f.name: widen(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            )
        return obj

    return MTPLayer(
        lb.config,
        [widen(p) for p in lb.layers],
        lb.embed.double(),
        semantics=lb.semantics,
        dtype=F64,
    )


# ------------------------------------------------------------------ synthetic checkpoints
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {
        fmt: make_synthetic_checkpoint(root / fmt, CFG, expert_format=fmt, seed=0)
        for fmt in ("mxfp4", "fp8", "nvfp4", "bf16")
    }


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_formats_give_the_same_draft_tokens(checkpoints, dtype) -> None:
    """The synthetic generator writes the same decoded expert (and dense) weights in every format,
    so MXFP4, FP8 (float32 scales), NVFP4 and bf16 checkpoints must draft the same tokens and,
    since only the decode path differs, the same logits bit for bit."""
    ids, pos, prev = inputs(24, dtype, start=2)
    lens = torch.tensor([10, 14])
    results = {}
    for fmt, path in checkpoints.items():
        L = MTPLayer.from_checkpoint(path, dtype=dtype)
        assert L.info["expert_formats"] == ({"fp8": "fp8_f32"}.get(fmt, fmt),)
        results[fmt] = L.draft(ids, pos, prev, seq_lens=lens, num_tokens=3, return_logits=True)
    tokens, logits = results["mxfp4"]
    for fmt, (t, lg) in results.items():
        assert torch.equal(t, tokens), fmt
        assert torch.equal(lg, logits), fmt


def test_routed_experts_stay_packed(checkpoints) -> None:
    L = MTPLayer.from_checkpoint(checkpoints["mxfp4"], dtype=BF16)
    packed = L.layers[0].ffn.experts.packed
    assert packed.w13_weight.dtype in (torch.uint8, torch.int8)
    assert packed.w13_weight.shape[-1] == CFG.hidden_size // 2  # two e2m1 per byte


class _Counting:
    def __init__(self, inner) -> None:
        self.inner, self.num_experts, self.quantized, self.seen = (
            inner,
            inner.num_experts,
            inner.quantized,
            set(),
        )

    def __call__(self, e: int, dtype: torch.dtype):
        self.seen.add(e)
        return self.inner(e, dtype)


def test_synthetic_checkpoint_realism(checkpoints) -> None:
    """Issue 4's measurable realism on the synthetic mxfp4 checkpoint (float64 math):
    every routed expert is selected over 256 random tokens; the sinks change the output by more
    than 1e-3 relative; the residual and the logits have std in [0.1, 100]."""
    L = MTPLayer.from_checkpoint(checkpoints["mxfp4"], dtype=F64)
    ids, pos, prev = inputs(256, F64, start=1, seed=7)
    lens = torch.full((16,), 16)  # 16 sequences of one window each
    counting = _Counting(L.layers[0].ffn.experts)
    L.layers[0].ffn.experts = counting
    out = L.forward(ids, pos, prev, seq_lens=lens)
    assert counting.seen == set(range(CFG.n_routed_experts))
    logits = L.compute_logits(out)
    assert 0.1 <= float(out.std()) <= 100 and 0.1 <= float(logits.std()) <= 100
    sink = L.layers[0].attn.attn_sink
    L.layers[0].attn.attn_sink = torch.full_like(sink, float("-inf"))
    try:
        no_sink = L.forward(ids, pos, prev, seq_lens=lens)
    finally:
        L.layers[0].attn.attn_sink = sink
    assert rel_err(no_sink, out) > 1e-3


def test_from_checkpoint_presets_and_errors(checkpoints) -> None:
    ids, pos, prev = inputs(8, BF16, start=0)
    for preset in PRESETS:
        L = MTPLayer.from_checkpoint(checkpoints["nvfp4"], preset=preset, dtype=BF16)
        assert L.semantics == PRESETS[preset]
        assert torch.isfinite(L.compute_logits(L.forward(ids, pos, prev))).all()
    with pytest.raises(ConfigError, match="fp8kv"):
        MTPLayer.from_checkpoint(checkpoints["nvfp4"], fp8kv=True)
    from dsv4mtp.checkpoint.load import load_mtp_checkpoint

    ck = load_mtp_checkpoint(checkpoints["mxfp4"], ep_rank=0, ep_size=2)
    with pytest.raises(ConfigError, match="ep_size"):
        MTPLayer.from_loaded(ck)


def test_demo_report() -> None:
    """The demo's report data on a synthetic NVFP4 checkpoint (no console, CPU)."""
    from dsv4mtp.tools.demo import run_demo

    r = run_demo(None, expert_format="nvfp4", num_tokens=2, batch=2, seed=1, device="cpu")
    assert r["formats"]["routed_experts"] == ["nvfp4"] and r["tensors_loaded"] > 0
    assert len(r["draft_tokens"]["reference_bf16"]) == 2 and len(r["timings"]["step_ms"]) == 2
    a = r["agreement"]["reference_bf16"]
    assert a["top1_agreement"] >= 0.5 and a["rel_logit_error"] < TOL_BF16_VS_F64
    assert r["optimized"].startswith("skipped")


def test_draft_forced_tokens_teacher_forcing() -> None:
    """Forcing the layer's own greedy picks reproduces its free-running draft bit for bit;
    forcing other tokens changes the later logits but not step 0's; a bad shape is refused."""
    L = layer(F64)
    ids, pos, prev = inputs(12, F64)
    tokens, logits = L.draft(ids, pos, prev, num_tokens=3, return_logits=True)
    same_t, same_l = L.draft(ids, pos, prev, num_tokens=3, return_logits=True, forced_tokens=tokens)
    assert torch.equal(same_t, tokens) and torch.equal(same_l, logits)
    other = (tokens + 1) % CFG.vocab_size
    _, forced_l = L.draft(ids, pos, prev, num_tokens=3, return_logits=True, forced_tokens=other)
    assert torch.equal(forced_l[:, 0], logits[:, 0]) and not torch.equal(
        forced_l[:, 1:], logits[:, 1:]
    )
    with pytest.raises(InputError, match=r"forced_tokens: expected shape \(1, 3\)"):
        L.draft(ids, pos, prev, num_tokens=3, forced_tokens=tokens[:, :2])
