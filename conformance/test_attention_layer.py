"""The optimized attention sublayer (``dsv4mtp.optimized.attention``, a composition of the
optimized linear, norm, RoPE and attention-core ops) against the reference ``attention``.

Tiny config (D 256, H 4 x Dh 128 with 64 rope dims, window 16, 2 output groups): prefill of one
and of several sequences (an empty one among them), position gaps, decode steps against
:class:`KVCache` s (each implementation with its own caches, fed the same tokens, compared at
every step, caches too), the two presets' switches (math; official: fp8_kv, act_quant and the
official norm order), FP8 packs (core ``QuantizedWeight`` params and a loaded checkpoint's fused
wq_a + wkv), NaN propagation, ``out=``, the pack cache and bad inputs.  Inputs are drawn on the
CPU; the optimized side runs on the suite's ``device`` (CUDA in the GPU tier, else the CPU, where
the Triton kernels run in the interpreter) through :func:`opt_attention` below.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from dsv4mtp import formats
from dsv4mtp.checkpoint.weights import QuantizedWeight
from dsv4mtp.config import DSV4Config
from dsv4mtp.conformance._mtp_random import random_attention_params
from dsv4mtp.errors import DSV4Error, InputError
from dsv4mtp.kv_cache import KVCache
from dsv4mtp.optimized import attention as _opt_attention
from dsv4mtp.optimized import pack_attention, pack_attention_weights
from dsv4mtp.params import AttentionParams
from dsv4mtp.reference import attention as ref_attention

BF16, FP32 = torch.bfloat16, torch.float32
CFG = DSV4Config.tiny()
D, W = CFG.hidden_size, CFG.sliding_window

# Tolerance: relative Frobenius error of the (T, D) output (and of the cached rows), per
# activation dtype, both presets.  Both sides compute the same math in fp32 with the same
# roundings to the activation dtype; they differ in fp32 summation order (tiled GEMM K blocks, the
# attention kernel's online softmax vs the reference's two-pass one).  fp32: a few ulps per op over
# ~8 ops, measured <= 4.2e-7; 2e-5 bounds it.  bf16: after each of ~8 projections / norms /
# rotations, one bf16 rounding (2^-9) lands on the other side for a few elements, and with the
# official switches an e4m3 rounding boundary (act_quant, fp8_kv) crossed by such an element moves
# it by one e4m3 step (2^-4), spread over its row by the next GEMM.  Measured <= 3.7e-3 (math) and
# <= 1.2e-2 (official); 3e-2 bounds both.
TOL = {FP32: 2e-5, BF16: 3e-2}

PRESETS = {
    "math": dict(fp8_kv=False, act_quant=False, norm_order="vllm"),
    "official": dict(fp8_kv=True, act_quant=True, norm_order="official"),
}


DEV = "cpu"  # the optimized side's device: set per test from the plugin's ``device`` fixture


@pytest.fixture(autouse=True)
def _optimized_device(device: str) -> None:
    global DEV
    DEV = device


def opt_attention(x: torch.Tensor, pos: torch.Tensor, params, cfg, **kw) -> torch.Tensor:
    """The optimized sublayer on :data:`DEV`: x, positions and ``out`` moved there, the result
    back on the CPU (its caches then hold device tensors: compare them with ``.cpu()``)."""
    if isinstance(kw.get("out"), torch.Tensor):
        kw["out"] = kw["out"].to(DEV)
    return _opt_attention(x.to(DEV), pos.to(DEV), params, cfg, **kw).cpu()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "NaN/inf in the optimized output"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def layer_params(dtype: torch.dtype, seed: int = 0) -> AttentionParams:
    """Random params as a layer keeps them: linears in the activation dtype, norms and sinks in
    fp32 (the compute dtype)."""
    p = random_attention_params(CFG, torch.Generator().manual_seed(seed))
    lin = {"wq_a", "wq_b", "wkv", "wo_a", "wo_b"}
    return AttentionParams(
        **{
            f.name: getattr(p, f.name).to(dtype if f.name in lin else FP32)
            for f in dataclasses.fields(p)
        }
    )


def gapped_positions(lens: list[int], g: torch.Generator, start: int = 0) -> torch.Tensor:
    """Strictly increasing positions per sequence with gaps of 1..3 (and one past the window)."""
    out = []
    for n in lens:
        steps = torch.randint(1, 4, (n,), generator=g)
        if n > 4:
            steps[n // 2] = W + 2  # a gap wider than the window: earlier keys all drop out
        out.append(start + torch.cumsum(steps, 0) - 1)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def both(x, pos, params, **kw):
    return ref_attention(x, pos, params, CFG, **kw), opt_attention(x, pos, params, CFG, **kw)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("lens", [[24], [7, 0, 13]], ids=["one", "three"])
def test_prefill(dtype: torch.dtype, preset: str, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(1)
    params = layer_params(dtype)
    T = sum(lens)
    x = torch.randn(T, D, generator=g).to(dtype)
    pos = gapped_positions(lens, g)
    want, got = both(x, pos, params, seq_lens=lens, **PRESETS[preset])
    assert got.dtype == dtype and got.shape == (T, D)
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_prefill_then_decode_with_caches(dtype: torch.dtype, preset: str) -> None:
    """A prefill of two sequences, then decode steps of one token each (one step's gap wider
    than the window); each side keeps its own caches.  Every step's output and the caches."""
    g = torch.Generator().manual_seed(2)
    params = layer_params(dtype)
    kw = PRESETS[preset]
    ref_caches, opt_caches = [KVCache(W), KVCache(W)], [KVCache(W), KVCache(W)]
    lens = [5, 9]
    pos = gapped_positions(lens, g)
    last = [int(pos[lens[0] - 1]), int(pos[-1])]
    steps = [(lens, pos)]
    for gap in (1, 3, W + 1):
        last = [p + gap for p in last]
        steps.append(([1, 1], torch.tensor(last)))
    for i, (step_lens, step_pos) in enumerate(steps):
        x = torch.randn(sum(step_lens), D, generator=g).to(dtype)
        want = ref_attention(
            x, step_pos, params, CFG, seq_lens=step_lens, kv_cache=ref_caches, **kw
        )
        got = opt_attention(x, step_pos, params, CFG, seq_lens=step_lens, kv_cache=opt_caches, **kw)
        assert rel_err(got, want) < TOL[dtype], f"step {i}"
        for b, (rc, oc) in enumerate(zip(ref_caches, opt_caches, strict=True)):
            assert rc.positions is not None and oc.positions is not None and oc.kv is not None
            assert torch.equal(oc.positions.cpu(), rc.positions), f"step {i} cache {b}"
            assert oc.kv.dtype == dtype
            assert rel_err(oc.kv.cpu(), rc.kv) < TOL[dtype], f"step {i} cache {b}"


def test_incremental_decode_reproduces_prefill() -> None:
    """With batch_invariant=True every op's schedule is independent of the row count, so decoding
    token by token against a cache gives each token the bits of the full prefill."""
    g = torch.Generator().manual_seed(3)
    params = layer_params(BF16)
    x = torch.randn(8, D, generator=g).to(BF16)
    pos = torch.tensor([0, 1, 2, 4, 5, 9, 10, 11])
    full = opt_attention(x, pos, params, CFG, batch_invariant=True)
    cache = KVCache(W)
    first = opt_attention(x[:5], pos[:5], params, CFG, kv_cache=[cache], batch_invariant=True)
    rest = [
        opt_attention(x[t : t + 1], pos[t : t + 1], params, CFG, kv_cache=[cache],
                      batch_invariant=True)
        for t in range(5, 8)
    ]  # fmt: skip
    assert torch.equal(torch.cat([first, *rest]), full)


def _fp8(w: torch.Tensor) -> QuantizedWeight:
    q, s = formats.quantize_fp8_block(w.float())
    return QuantizedWeight("fp8_e8m0", q, s, tuple(w.shape))  # type: ignore[arg-type]


def test_fp8_params_pack_as_fp8() -> None:
    """QuantizedWeight linears in the params are packed as FP8 codes; the reference gets the same
    weights dequantized (exact: e4m3 codes times power-of-two scales)."""
    g = torch.Generator().manual_seed(4)
    dense = layer_params(FP32)
    lin = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
    quant = dataclasses.replace(dense, **{n: _fp8(getattr(dense, n)) for n in lin})
    exact = dataclasses.replace(
        dense, **{n: getattr(quant, n).dequantize(FP32) for n in lin}
    )  # fmt: skip
    pack = pack_attention(quant, DEV)  # type: ignore[arg-type]
    assert {getattr(pack, n).fmt for n in lin} == {"fp8"} and pack.wo_a.groups == CFG.o_groups
    x = torch.randn(20, D, generator=g).to(BF16)
    pos = torch.arange(20)
    kw = PRESETS["official"]
    want = ref_attention(x, pos, exact, CFG, **kw)
    assert rel_err(opt_attention(x, pos, pack, CFG, **kw), want) < TOL[BF16]


def test_checkpoint_pack_fused_wqa_wkv(tmp_path) -> None:
    """A loaded checkpoint's attention packed as stored (the fused wq_a + wkv FP8 weight) against
    the reference on the layer's dense params."""
    from dsv4mtp.checkpoint.load import load_mtp_checkpoint
    from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint
    from dsv4mtp.params import build_layer_params

    ck = load_mtp_checkpoint(make_synthetic_checkpoint(tmp_path / "ck", CFG), scan=False)
    w = ck.layers[0]
    pack = pack_attention_weights(w, DEV)
    assert pack.wqa_wkv is not None and pack.wqa_wkv.fmt == "fp8" and pack.wq_a is None
    dense = build_layer_params(w, BF16, torch.device("cpu")).attn
    g = torch.Generator().manual_seed(5)
    x = torch.randn(18, D, generator=g).to(BF16)
    pos = gapped_positions([18], g)
    want, got = ref_attention(x, pos, dense, CFG), opt_attention(x, pos, pack, CFG)
    assert rel_err(got, want) < TOL[BF16]


def test_nan_propagates_like_the_reference() -> None:
    g = torch.Generator().manual_seed(6)
    params = layer_params(BF16)
    x = torch.randn(12, D, generator=g).to(BF16)
    x[3, 17] = float("nan")
    pos = torch.arange(12)
    want, got = both(x, pos, params, seq_lens=[6, 6])
    assert torch.equal(got.isnan(), want.isnan())
    assert want.isnan().any() and not want[6:].isnan().any()  # the other sequence is clean


def test_out_and_pack_cache() -> None:
    g = torch.Generator().manual_seed(7)
    params = layer_params(BF16)
    x = torch.randn(5, D, generator=g).to(BF16)
    pos = torch.arange(5)
    x, pos = x.to(DEV), pos.to(DEV)
    y = _opt_attention(x, pos, params, CFG)
    out = torch.full((5, D), float("nan"), dtype=BF16, device=DEV)  # poisoned
    assert _opt_attention(x, pos, params, CFG, out=out) is out
    assert torch.equal(out, y)
    assert torch.equal(_opt_attention(x, pos, pack_attention(params, DEV), CFG), y)
    x, pos = x.cpu(), pos.cpu()
    ref_out = torch.full((5, D), float("nan"), dtype=BF16)
    assert ref_attention(x, pos, params, CFG, out=ref_out) is ref_out
    assert torch.equal(ref_out, ref_attention(x, pos, params, CFG))


def test_compiled_attention_has_no_graph_breaks() -> None:
    """torch.compile(fullgraph=True) traces the sublayer (its output's inverse rotation is
    then assigned, not written in place through a strided out=, which dynamo refuses) and
    gives eager's bits."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(7)
    pack = pack_attention(layer_params(BF16), DEV)
    x = torch.randn(5, D, generator=g).to(BF16).to(DEV)
    pos = torch.arange(5, device=DEV)

    def sublayer(x: torch.Tensor) -> torch.Tensor:
        return _opt_attention(x, pos, pack, CFG)

    eager = sublayer(x)
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(sublayer, fullgraph=True, backend="aot_eager")(x)
    assert dict(counters["graph_break"]) == {}
    assert torch.equal(got, eager)
    torch._dynamo.reset()


def test_empty_call_matches_reference() -> None:
    params = layer_params(BF16)
    x, pos = torch.zeros(0, D, dtype=BF16), torch.zeros(0, dtype=torch.int64)
    want, got = both(x, pos, params)
    assert got.shape == want.shape == (0, D)


def _bad_cases(params: AttentionParams):
    x, pos = torch.zeros(4, D, dtype=BF16), torch.arange(4)
    full = KVCache(W)
    full.append(torch.zeros(2, CFG.head_dim, dtype=BF16), torch.tensor([5, 6]))
    return [
        ("sum", (x, pos, params), dict(seq_lens=[2, 1])),
        ("order", (x, torch.tensor([0, 2, 3, 1]), params), dict(seq_lens=[2, 2])),
        ("repeat", (x, torch.tensor([0, 1, 1, 3]), params), {}),
        ("cache_count", (x, pos, params), dict(seq_lens=[2, 2], kv_cache=[KVCache(W)])),
        ("cache_type", (x, pos, params), dict(kv_cache=["cache"])),
        ("past_cache", (x, pos, params), dict(kv_cache=[full])),
        ("seq_lens_type", (x, pos, params), dict(seq_lens=[2.0, 2.0])),
        ("x_shape", (torch.zeros(4, D + 1, dtype=BF16), pos, params), {}),
        ("pos_shape", (x, torch.arange(3), params), {}),
        ("pos_dtype", (x, pos.float(), params), {}),
        ("batch_invariant", (x, pos, params), dict(batch_invariant=1)),
    ]


@pytest.mark.parametrize("case", range(11))
def test_bad_inputs_raise_the_reference_error(case: int) -> None:
    params = layer_params(BF16)
    name, args, kw = _bad_cases(params)[case]
    with pytest.raises(InputError) as want:
        ref_attention(*args, CFG, **kw)
    _, args, kw = _bad_cases(params)[case]  # fresh caches
    with pytest.raises(InputError) as got:
        opt_attention(*args, CFG, **kw)
    assert str(got.value) == str(want.value), name


def test_bad_params_and_dtypes() -> None:
    x, pos = torch.zeros(4, D, dtype=BF16), torch.arange(4)
    with pytest.raises(InputError, match="params"):
        opt_attention(x, pos, object(), CFG)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="x"):
        opt_attention(x.double(), pos, layer_params(BF16), CFG)
    wrong = dataclasses.replace(layer_params(BF16), wo_b=torch.zeros(D // 2, 256, dtype=BF16))
    with pytest.raises(DSV4Error, match="wo_b"):
        opt_attention(x, pos, wrong, CFG)
    with pytest.raises(InputError, match="out"):
        opt_attention(x, pos, layer_params(BF16), CFG, out=torch.zeros(4, D, dtype=FP32))


def test_signature_extends_the_reference() -> None:
    """The reference's parameters, in order, with the same kinds and defaults, then the
    optimized-only keywords: ``cache_slots`` (for a DeviceKVCache), ``block_table`` and
    ``slot_mapping`` (for a PagedKVCache), ``query_start_loc`` and ``seq_flags`` (a prefill
    with its offsets on the device); the sublayer has no backend of its own."""
    import inspect

    extra = ("cache_slots", "block_table", "slot_mapping", "query_start_loc", "seq_flags")
    ref = inspect.signature(ref_attention).parameters
    opt = inspect.signature(_opt_attention).parameters
    sig = [(p.name, p.kind, p.default) for p in opt.values()]
    n = len(sig) - len(extra)
    assert sig[:n] == [(p.name, p.kind, p.default) for p in ref.values()]
    assert sig[n:] == [(name, inspect.Parameter.KEYWORD_ONLY, None) for name in extra]


def test_sequence_checks_on_the_device_refuse_what_the_host_checks_refuse(device: str) -> None:
    """Random varlen calls without a cache or with host caches, positions valid or broken one
    way (falling within a sequence, a sequence starting at or before its cache's last
    position): the check (a device flag, one host read) raises exactly the host check's
    message, or nothing."""
    attn = importlib.import_module("dsv4mtp.optimized.attention")
    g = torch.Generator().manual_seed(51)
    broken = 0
    for case in range(40):
        B = int(torch.randint(1, 5, (1,), generator=g))
        lens = [int(n) for n in torch.randint(0, 9, (B,), generator=g)]
        caches: list[KVCache] | None = None
        pos: list[int] = []
        if case % 2:
            caches = [KVCache(W) for _ in range(B)]
            for c in caches[: B - 1]:  # the last one empty
                last = int(torch.randint(0, 30, (1,), generator=g))
                c.append(torch.zeros(1, 16), torch.tensor([last]))
        for b, n in enumerate(lens):
            held = caches[b].last_position if caches is not None else None
            start = (held if held is not None else -5) + int(torch.randint(1, 4, (1,), generator=g))
            pos += [start + int(d) for d in torch.randint(1, 3, (n,), generator=g).cumsum(0) - 1]
        positions = torch.tensor(pos, dtype=torch.int64, device=device)
        T = len(pos)
        if T and case % 3 == 1:
            t = int(torch.randint(0, T, (1,), generator=g))
            positions[t] -= int(torch.randint(1, 40, (1,), generator=g))
        want = "ok"
        try:
            attn._sequences_error(positions, lens, caches)
        except InputError as e:
            want = str(e)
        if want == "ok":
            attn._check_sequences(positions, lens, caches)
        else:
            with pytest.raises(InputError) as info:
                attn._check_sequences(positions, lens, caches)
            assert str(info.value) == want, case
            broken += 1
    assert 3 < broken < 40
