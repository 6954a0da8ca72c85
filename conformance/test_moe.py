"""MoE of the MTP layer (spec 7): router, clamped SwiGLU experts, shared expert, packed experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from dsv4mtp.conformance._mtp_random import random_moe_params
from dsv4mtp.reference import DSV4Config
from dsv4mtp.reference.moe import DenseExperts, MoEParams, moe, route, swiglu_expert

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
