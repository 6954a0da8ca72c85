"""MoE of the MTP layer (spec 7): router, clamped SwiGLU experts, shared expert, packed experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from dsv4mtp.conformance._mtp_random import random_moe_params
from dsv4mtp.reference import DSV4Config, InputError
from dsv4mtp.reference.moe import (
    DenseExperts,
    MoEParams,
    fused_experts,
    moe,
    route,
    swiglu_expert,
)

F64, BF16 = torch.float64, torch.bfloat16
CFG = DSV4Config.tiny()  # 8 experts, top-2, intermediate 128, swiglu_limit 10, scale 1.5

# Against the float64 dense-over-all-experts oracle:
#  float64: different summation order only; 1e-12 relative.
#  bf16: x and the three projections' outputs are rounded to bf16 (2^-8) and the bf16 weights
#        differ from the float64 ones by 2^-9 relative; ~1e-2 expected, 3e-2 bound.
TOL_REL = {F64: 1e-12, BF16: 3e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "NaN/inf in output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def scores64(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Unbiased sqrtsoftplus router scores in float64 (spec 7.1): (T, E)."""
    return torch.sqrt(F.softplus(x.double() @ gate_weight.double().T))


def oracle(
    x: torch.Tensor, p: MoEParams, cfg: DSV4Config, *, shared_clamp: bool = True
) -> torch.Tensor:
    """Every expert on every token in float64, weighted by a dense (T, E) routing matrix."""
    x = x.double()
    L = cfg.swiglu_limit
    s = scores64(x, p.gate_weight)
    sel = torch.topk(s + p.gate_bias.double(), cfg.num_experts_per_tok).indices
    dense_w = torch.zeros_like(s).scatter(1, sel, s.gather(1, sel))
    dense_w = dense_w / dense_w.sum(-1, keepdim=True) * cfg.routed_scaling_factor  # (T, E)

    def ffn(w1, w3, w2, limit):
        g, u = x @ w1.double().T, x @ w3.double().T
        if limit > 0:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return F.silu(g) * u, w2.double()

    out = torch.zeros_like(x)
    for e in range(cfg.n_routed_experts):
        h, w2 = ffn(p.experts.w1[e], p.experts.w3[e], p.experts.w2[e], L)
        out += (dense_w[:, e : e + 1] * h) @ w2.T
    h, w2 = ffn(p.shared_w1, p.shared_w3, p.shared_w2, L if shared_clamp else 0.0)
    return out + h @ w2.T


def cast_params(p: MoEParams, dtype: torch.dtype) -> MoEParams:
    ex = p.experts
    return MoEParams(
        gate_weight=p.gate_weight.to(dtype),
        gate_bias=p.gate_bias,
        shared_w1=p.shared_w1.to(dtype),
        shared_w3=p.shared_w3.to(dtype),
        shared_w2=p.shared_w2.to(dtype),
        experts=DenseExperts(ex.w1.to(dtype), ex.w3.to(dtype), ex.w2.to(dtype)),
        shared_quantized=False,
    )


def make(seed: int, T: int, *, x_gain: float = 1.0, up_gain: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    p = random_moe_params(CFG, g, up_gain=up_gain)
    x = x_gain * torch.randn(T, CFG.hidden_size, generator=g, dtype=F64)
    return x, p


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_moe_equals_all_experts_oracle(dtype) -> None:
    x, p = make(0, 33, x_gain=6.0)  # gain 6: a good share of gate/up values pass the limit
    pd = cast_params(p, dtype)
    out = moe(x.to(dtype), pd, CFG)
    assert out.dtype == dtype and out.shape == x.shape
    ref = oracle(x.to(dtype), pd, CFG)
    assert rel_err(out, ref) < TOL_REL[dtype]


def test_router_bias_selects_but_does_not_weight() -> None:
    x, p = make(1, 20)
    w, _ids = route(x, p.gate_weight, p.gate_bias, CFG)
    assert torch.allclose(
        w.sum(-1), torch.full((20,), CFG.routed_scaling_factor, dtype=F64), rtol=1e-14
    )
    bias = p.gate_bias.clone()
    bias[3] = 100.0  # always selected, yet its weight comes from its unbiased score
    w2, ids2 = route(x, p.gate_weight, bias, CFG)
    assert (ids2 == 3).any(-1).all()
    raw = scores64(x, p.gate_weight).gather(1, ids2)
    assert torch.allclose(
        w2, raw / raw.sum(-1, keepdim=True) * CFG.routed_scaling_factor, rtol=1e-14
    )


def test_swiglu_clamp_known_answer() -> None:
    """Up is clamped both ways, gate from above only; identity-like weights expose the values."""
    x = torch.tensor([[30.0, -30.0], [-30.0, 30.0]], dtype=F64)
    eye = torch.eye(2, dtype=F64)
    out = swiglu_expert(x, eye, eye, eye, limit=10.0)  # gate = up = x
    gate, up = x.clamp(max=10.0), x.clamp(-10.0, 10.0)
    expect = F.silu(gate) * up  # row 0: silu(10)*10, silu(-30)*-10
    assert torch.equal(out, expect)
    assert out[0, 1] > 0  # the gate was NOT clamped from below: silu(-30) * -10 > 0 tiny
    assert torch.equal(swiglu_expert(x, eye, eye, eye, limit=0.0), F.silu(x) * x)  # <= 0: off


def test_shared_clamp_switch() -> None:
    x, p = make(2, 16, x_gain=8.0, up_gain=2.0)
    on, off = moe(x, p, CFG, shared_clamp=True), moe(x, p, CFG, shared_clamp=False)
    assert rel_err(on, oracle(x, p, CFG, shared_clamp=True)) < 1e-12
    assert rel_err(off, oracle(x, p, CFG, shared_clamp=False)) < 1e-12
    assert rel_err(on, off) > 1e-2


class CountingExperts:
    """An ExpertSource that records which experts were decoded."""

    def __init__(self, inner: DenseExperts) -> None:
        self.inner, self.num_experts, self.quantized, self.calls = (
            inner,
            inner.num_experts,
            False,
            [],
        )

    def __call__(self, e: int, dtype: torch.dtype):
        self.calls.append(e)
        return self.inner(e, dtype)


def test_only_routed_experts_are_decoded_once_each() -> None:
    x, p = make(3, 3)
    counting = CountingExperts(p.experts)
    out = moe(x, MoEParams(**{**p.__dict__, "experts": counting}), CFG)
    _, ids = route(x, p.gate_weight, p.gate_bias, CFG)
    assert sorted(counting.calls) == sorted(set(ids.flatten().tolist()))
    assert len(counting.calls) < CFG.n_routed_experts  # 3 tokens x top-2 cannot cover 8
    assert torch.equal(out, moe(x, p, CFG))


# Permuting tokens may move a row between the SIMD body and the scalar tail of torch's CPU
# elementwise kernels, whose exp / log1p differ in the last ulp (seen on the H200 host: AVX-512,
# torch 2.11, seed 255, T 3: route weights 1.4e-14 apart in float64; bench/diag/
# moe_perm_probe.py).  So the reference promises no cross-token coupling, not bitwise position
# invariance: the same experts, and values within a few ulps of the compute dtype (bf16
# output: one rounding of a value that may sit on a rounding boundary).
_PERM_TOL = {F64: (1e-12, 1e-12), BF16: (2**-7, 2**-7)}  # (rtol, atol of the output's scale)


@given(seed=st.integers(0, 2**16), T=st.integers(1, 24))
@example(seed=255, T=3)  # differed in the last ulp on the H200 host (see above)
def test_tokens_are_independent(seed, T) -> None:
    """Permuting tokens permutes the routing exactly and the output to last-ulp differences
    (no cross-token coupling), in float64 and bf16."""
    x, p = make(seed, T, x_gain=4.0)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(seed))
    for dtype in (F64, BF16):
        pd, xd = cast_params(p, dtype), x.to(dtype)
        _, ids_p = route(xd[perm], pd.gate_weight, pd.gate_bias, CFG)
        _, ids = route(xd, pd.gate_weight, pd.gate_bias, CFG)
        biased = (
            (scores64(xd, pd.gate_weight) + pd.gate_bias.double())
            .sort(dim=-1, descending=True)
            .values
        )
        k = CFG.num_experts_per_tok
        near_tie = (biased[:, k - 1] - biased[:, k]) < 1e-6 * biased[:, 0].abs()  # (T,)
        same = (ids_p.sort(-1).values == ids[perm].sort(-1).values).all(-1)
        assert bool((same | near_tie[perm]).all()), "routing depends on the token's position"
        got, want = moe(xd[perm], pd, CFG).double(), moe(xd, pd, CFG)[perm].double()
        rtol, atol = _PERM_TOL[dtype]
        rows = same & ~near_tie[perm]
        scale = float(want[rows].abs().max()) if bool(rows.any()) else 1.0
        assert torch.allclose(got[rows], want[rows], rtol=rtol, atol=atol * scale)


# ------------------------------------------------------------------ packed NVFP4, folded or not
@pytest.fixture(scope="module")
def nvfp4_experts(tmp_path_factory):
    from dsv4mtp.checkpoint.load import load_mtp_checkpoint
    from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint

    path = make_synthetic_checkpoint(
        tmp_path_factory.mktemp("nvfp4"), expert_format="nvfp4", seed=2
    )
    ck = load_mtp_checkpoint(path)
    return ck.layers[0].experts, ck.config


def test_nvfp4_folded_equals_unfolded_near_the_clamp_limit(nvfp4_experts) -> None:
    """The folded pack (up block scales x 2, one fc1_alpha = gate's global scale) must give the
    unfolded MoE output with gate/up driven around +-swiglu_limit.  The ratio is a power of two,
    so the decoded weights are identical and the outputs must be bitwise equal (float64)."""
    from dsv4mtp.checkpoint.nvfp4 import fold_nvfp4_experts
    from dsv4mtp.reference.moe import PackedExperts

    experts, cfg = nvfp4_experts
    folded = fold_nvfp4_experts(experts)
    assert folded.nvfp4_folded and not torch.equal(
        folded.w13_weight_scale_2, experts.w13_weight_scale_2
    )
    g = torch.Generator().manual_seed(0)
    x = 12.0 * torch.randn(
        64, cfg.hidden_size, generator=g, dtype=F64
    )  # preact std ~12 vs limit 10
    base = random_moe_params(cfg, g)
    outs = {}
    for name, pack in (("unfolded", experts), ("folded", folded)):
        p = MoEParams(**{**base.__dict__, "experts": PackedExperts(pack)})
        outs[name] = moe(x, p, cfg)
    # the inputs really reach the clamp: a good share of up values beyond the limit, some inside
    w13, _ = experts.dequantize_expert(0, F64)
    up = x @ w13[cfg.moe_intermediate_size :].T
    beyond = (up.abs() > cfg.swiglu_limit).double().mean()
    assert 0.1 < beyond < 0.9
    assert torch.equal(outs["folded"], outs["unfolded"])

    # Negative control: a kernel that clamps the raw folded accumulator (before multiplying by
    # fc1_alpha) computes something else; this test would catch it.
    alpha = float(folded.w13_weight_scale_2[0, 0])
    w13f, _ = folded.dequantize_expert(0, F64)
    raw_gate, raw_up = x @ (w13f[: cfg.moe_intermediate_size] / alpha).T, up / alpha
    L = cfg.swiglu_limit
    wrong = F.silu(raw_gate.clamp(max=L) * alpha) * (raw_up.clamp(-L, L) * alpha)
    right = F.silu((raw_gate * alpha).clamp(max=L)) * (raw_up * alpha).clamp(-L, L)
    assert rel_err(wrong, right) > 1e-2


def test_unfoldable_nvfp4_is_refused_by_the_fold_but_runs_unfolded(tmp_path) -> None:
    from dsv4mtp.checkpoint.load import load_mtp_checkpoint
    from dsv4mtp.checkpoint.nvfp4 import fold_nvfp4_experts
    from dsv4mtp.checkpoint.synthetic import make_synthetic_checkpoint
    from dsv4mtp.reference import FoldError
    from dsv4mtp.reference.moe import PackedExperts

    path = make_synthetic_checkpoint(tmp_path, expert_format="nvfp4", seed=3, nvfp4_unfoldable=True)
    ck = load_mtp_checkpoint(path)
    experts = ck.layers[0].experts
    with pytest.raises(FoldError):
        fold_nvfp4_experts(experts)
    x, p = make(4, 16, x_gain=4.0)
    out = moe(x, MoEParams(**{**p.__dict__, "experts": PackedExperts(experts)}), ck.config)
    assert torch.isfinite(out).all() and out.abs().max() > 0


# ------------------------------------------------------------------ fused_experts (given routing)
def shared_only(x: torch.Tensor, p: MoEParams, cfg: DSV4Config) -> torch.Tensor:
    return swiglu_expert(x, p.shared_w1, p.shared_w3, p.shared_w2, limit=cfg.swiglu_limit)


def test_fused_experts_with_the_routers_ids_is_moe_without_the_shared_expert() -> None:
    x, p = make(5, 17, x_gain=6.0)
    w, ids = route(x, p.gate_weight, p.gate_bias, CFG)
    got = fused_experts(x, p.experts, ids, w, limit=CFG.swiglu_limit)
    want = moe(x, p, CFG) - shared_only(x, p, CFG)
    assert got.dtype == F64 and rel_err(got, want) < 1e-13
    # int32 ids (what the optimized router returns) give the same bits
    assert torch.equal(fused_experts(x, p.experts, ids.int(), w, limit=CFG.swiglu_limit), got)
    # bf16: the routed sum is rounded once (as in moe, before the shared expert is added)
    pb, xb = cast_params(p, BF16), x.to(BF16)
    wb, idb = route(xb, pb.gate_weight, pb.gate_bias, CFG)
    gotb = fused_experts(xb, pb.experts, idb, wb, limit=CFG.swiglu_limit)
    assert gotb.dtype == BF16 and rel_err(gotb, oracle(xb, pb, CFG) - oracle_shared(xb, pb)) < 3e-2


def oracle_shared(x: torch.Tensor, p: MoEParams) -> torch.Tensor:
    x = x.double()
    g, u = x @ p.shared_w1.double().T, x @ p.shared_w3.double().T
    L = CFG.swiglu_limit
    return (F.silu(g.clamp(max=L)) * u.clamp(-L, L)) @ p.shared_w2.double().T


def test_fused_experts_padding_slots_touch_nothing() -> None:
    x, p = make(6, 9, x_gain=3.0)
    w, ids = route(x, p.gate_weight, p.gate_bias, CFG)
    padded = ids.clone()
    padded[2] = -1  # a whole padding row (apply_routing_padding_mask)
    padded[5, 1] = -1  # one padding slot
    counting = CountingExperts(p.experts)
    got = fused_experts(x, counting, padded, w, limit=CFG.swiglu_limit)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    # a padded slot equals a zero routing weight on that slot
    w0 = w.clone()
    w0[2], w0[5, 1] = 0.0, 0.0
    want = fused_experts(x, p.experts, ids, w0, limit=CFG.swiglu_limit)
    assert rel_err(got, want) < 1e-13
    assert -1 not in counting.calls and sorted(counting.calls) == sorted(set(counting.calls))


def test_fused_experts_expert_map_splits_the_sum_over_ranks() -> None:
    """Two expert-parallel ranks holding scattered halves of the experts: each rank's output is
    its own experts' share, and the two shares add up to the single-rank result."""
    x, p = make(7, 12, x_gain=4.0)
    w, ids = route(x, p.gate_weight, p.gate_bias, CFG)
    full = fused_experts(x, p.experts, ids, w, limit=CFG.swiglu_limit)
    perm = torch.randperm(CFG.n_routed_experts, generator=torch.Generator().manual_seed(0))
    total = torch.zeros_like(full)
    for owned in (perm[:4], perm[4:]):
        emap = torch.full((CFG.n_routed_experts,), -1, dtype=torch.int32)
        emap[owned] = torch.arange(len(owned), dtype=torch.int32)
        ex = p.experts
        local = DenseExperts(ex.w1[owned], ex.w3[owned], ex.w2[owned], quantized=True)
        part = fused_experts(x, local, ids, w, limit=CFG.swiglu_limit, expert_map=emap)
        mine = torch.isin(ids, owned)
        w_mine = torch.where(mine, w, torch.zeros_like(w))
        assert (
            rel_err(part, fused_experts(x, p.experts, ids, w_mine, limit=CFG.swiglu_limit)) < 1e-13
        )
        total += part
    assert rel_err(total, full) < 1e-13


def test_out_buffers_and_flags() -> None:
    x, p = make(8, 5)
    w, ids = route(x, p.gate_weight, p.gate_bias, CFG)
    wb, ib = torch.full_like(w, float("nan")), torch.zeros(ids.shape, dtype=torch.int32)
    got = route(x, p.gate_weight, p.gate_bias, CFG, out=(wb, ib), batch_invariant=True)
    assert got[0] is wb and got[1] is ib and torch.equal(wb, w) and torch.equal(ib.long(), ids)
    ob = torch.full_like(x, float("nan"))
    assert moe(x, p, CFG, out=ob, batch_invariant=True) is ob and torch.equal(ob, moe(x, p, CFG))
    fb = torch.full_like(x, float("nan"))
    res = fused_experts(x, p.experts, ids, w, limit=CFG.swiglu_limit, out=fb, batch_invariant=True)
    assert res is fb and torch.equal(
        fb, fused_experts(x, p.experts, ids, w, limit=CFG.swiglu_limit)
    )
    with pytest.raises(InputError, match=r"^out: expected dtype"):
        moe(x, p, CFG, out=torch.empty_like(x, dtype=torch.float32))
    with pytest.raises(InputError, match=r"^out: expected shape"):
        fused_experts(x, p.experts, ids, w, limit=CFG.swiglu_limit, out=x[:-1].clone())
    with pytest.raises(InputError, match=r"^out\[1\]: expected dtype"):
        route(x, p.gate_weight, p.gate_bias, CFG, out=(wb, ib.float()))
    with pytest.raises(InputError, match=r"^batch_invariant: expected a bool"):
        moe(x, p, CFG, batch_invariant=1)


@pytest.mark.parametrize(
    ("ids", "emap", "message"),
    [
        ([[0, 8]], None, r"^topk_ids: expected ids in \[-1, 8\)"),
        ([[0, -2]], None, r"^topk_ids: expected ids in \[-1, 8\)"),
        ([[0, 1]], [0, 8, -1], r"^expert_map: expected ids in \[-1, 8\)"),
        ([[0, 3]], [0, 1, -1], r"^topk_ids: expected ids in \[-1, 3\)"),
    ],
    ids=["id-too-large", "id-below-minus-one", "map-beyond-local", "id-beyond-map"],
)
def test_fused_experts_rejects_ids_out_of_range(ids, emap, message) -> None:
    x, p = make(9, 1)
    t_ids = torch.tensor(ids, dtype=torch.int32)
    w = torch.ones(t_ids.shape, dtype=F64)
    emap_t = None if emap is None else torch.tensor(emap, dtype=torch.int32)
    with pytest.raises(InputError, match=message):
        fused_experts(x, p.experts, t_ids, w, limit=10.0, expert_map=emap_t)
