"""mHC and hc_head: properties of the reference, then tests of the optimized kernels beyond the
generated op contract (conformance/test_contract.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsv4mtp.conformance.pairs  # noqa: F401  (declares the pairs REGISTRY holds)
import dsv4mtp.optimized as opt
from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.conformance.registry import REGISTRY
from dsv4mtp.errors import ConfigError
from dsv4mtp.optimized.mhc import HEAD_AUTO_BACKEND, PRE_AUTO_BACKEND
from dsv4mtp.reference import InputError, hc_head, hc_post, hc_pre, sinkhorn

EPS = 1e-6
F64 = torch.float64


def _rand(*shape: int, seed: int, dtype: torch.dtype = F64, std: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=F64) * std).to(dtype)


def _pre_params(n: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    M = (2 + n) * n
    return (
        _rand(M, n * D, seed=seed, std=0.05),
        _rand(3, seed=seed + 1) + 1,
        _rand(M, seed=seed + 2),
    )


def _run_pre(x: torch.Tensor, fn, scale, base, iters: int = 20):
    return hc_pre(x, fn, scale, base, rms_norm_eps=EPS, hc_eps=EPS, sinkhorn_iters=iters)


# ------------------------------------------------------------------------------ Sinkhorn
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 6), spread=st.sampled_from([0.1, 1.0, 5.0]))
def test_sinkhorn_columns_sum_to_one_rows_close(seed: int, n: int, spread: float) -> None:
    p = sinkhorn(_rand(16, n, n, seed=seed, std=spread), iters=20, eps=EPS)
    # The schedule ends on a column normalization: column sums are S/(S+eps) = 1 - O(eps).
    assert torch.allclose(p.sum(-2), torch.ones(16, n, dtype=F64), atol=1e-5, rtol=0)
    # Rows are only as balanced as 20 iterations make them.  Measured worst over 50 seeds x 16
    # matrices: 6.2e-3 at logit spread <= 1 (n = 2) and 6.6e-2 at spread 5 (sharp softmax, slow
    # convergence); the bounds below leave ~1.6x / 2x headroom over those.
    row_tol = 1e-2 if spread <= 1.0 else 0.15
    assert torch.allclose(p.sum(-1), torch.ones(16, n, dtype=F64), atol=row_tol, rtol=0)
    assert bool((p > 0).all())


def test_sinkhorn_uniform_logits_known_answer() -> None:
    """Zero logits: every entry follows the scalar recurrence p <- p / (n p + eps) (by hand)."""
    n, iters = 4, 20
    p_hand = 1.0 / n + EPS  # softmax of zeros, + eps
    p_hand = p_hand / (n * p_hand + EPS)  # first column normalization
    for _ in range(iters - 1):
        p_hand = p_hand / (n * p_hand + EPS)  # rows
        p_hand = p_hand / (n * p_hand + EPS)  # columns
    got = sinkhorn(torch.zeros(1, n, n, dtype=F64), iters=iters, eps=EPS)
    assert torch.allclose(got, torch.full((1, n, n), p_hand, dtype=F64), rtol=1e-14, atol=0)


def test_sinkhorn_rejects_bad_input() -> None:
    with pytest.raises(InputError, match="logits"):
        sinkhorn(torch.zeros(2, 3, 4), iters=20, eps=EPS)
    with pytest.raises(InputError, match="iters"):
        sinkhorn(torch.zeros(2, 3, 3), iters=0, eps=EPS)


# ------------------------------------------------------------------------------ hc_pre
def test_hc_pre_zero_params_known_answer() -> None:
    """fn = 0, base = 0: pre = sigmoid(0) + eps, post = 2 sigmoid(0) = 1, comb uniform."""
    T, n, D = 3, 4, 8
    x = _rand(T, n, D, seed=0)
    M = (2 + n) * n
    li, post, comb = _run_pre(
        x, torch.zeros(M, n * D, dtype=F64), torch.ones(3, dtype=F64), torch.zeros(M, dtype=F64)
    )
    assert torch.allclose(li, (0.5 + EPS) * x.sum(1), rtol=1e-15, atol=1e-15)
    assert torch.equal(post, torch.ones(T, n, dtype=F64))
    ref = sinkhorn(torch.zeros(T, n, n, dtype=F64), iters=20, eps=EPS)
    assert torch.equal(comb, ref)


@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([2, 3, 4]), perm_seed=st.integers(0, 1000))
def test_hc_pre_stream_permutation_equivariance(seed: int, n: int, perm_seed: int) -> None:
    """Relabelling streams (x, fn column blocks, pre/post rows, comb rows and columns) leaves the
    layer input unchanged and permutes post and comb the same way.  float64; 1e-12 relative
    covers summation-order changes only."""
    T, D = 5, 8
    x = _rand(T, n, D, seed=seed)
    fn, scale, base = _pre_params(n, D, seed)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(perm_seed))
    # Row index of fn for (pre i) = i, (post i) = n + i, (comb j,k) = 2n + j n + k.
    comb_rows = (2 * n + perm[:, None] * n + perm[None, :]).reshape(-1)
    rows = torch.cat([perm, n + perm, comb_rows])
    cols = (perm[:, None] * D + torch.arange(D)[None, :]).reshape(-1)
    li, post, comb = _run_pre(x, fn, scale, base)
    li_p, post_p, comb_p = _run_pre(x[:, perm], fn[rows][:, cols], scale, base[rows])
    assert torch.allclose(li_p, li, rtol=1e-12, atol=1e-12)
    assert torch.allclose(post_p, post[:, perm], rtol=1e-12, atol=0)
    assert torch.allclose(comb_p, comb[:, perm][:, :, perm], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_hc_pre_dtype_rules_and_empty(dtype: torch.dtype) -> None:
    n, D = 4, 16
    fn, scale, base = (t.float() for t in _pre_params(n, D, 1))
    cd = torch.promote_types(dtype, torch.float32)
    for T in (0, 1, 3):
        li, post, comb = _run_pre(_rand(T, n, D, seed=2, dtype=dtype), fn, scale, base)
        assert (li.shape, li.dtype) == ((T, D), dtype)
        assert (post.shape, post.dtype) == ((T, n), cd)
        assert (comb.shape, comb.dtype) == ((T, n, n), cd)


def test_hc_pre_rejects_bad_shapes() -> None:
    x = _rand(2, 4, 8, seed=0)
    fn, scale, base = _pre_params(4, 8, 0)
    with pytest.raises(InputError, match=r"fn: expected shape \(24, 32\)"):
        _run_pre(x, fn[:, :-1], scale, base)
    with pytest.raises(InputError, match="scale"):
        _run_pre(x, fn, scale[:2], base)
    with pytest.raises(InputError, match="base"):
        _run_pre(x, fn, scale, base[:5])
    with pytest.raises(InputError, match="x: expected 3 dimensions"):
        _run_pre(x[0], fn, scale, base)
    with pytest.raises(InputError, match="x: expected dtype"):
        _run_pre(x.to(torch.int32), fn, scale, base)


# ------------------------------------------------------------------------------ hc_post
def test_hc_post_identity_comb_known_answer() -> None:
    T, n, D = 2, 4, 8
    f, res = _rand(T, D, seed=0), _rand(T, n, D, seed=1)
    post = torch.zeros(T, n, dtype=F64)
    post[:, 0] = 1
    out = hc_post(f, res, post, torch.eye(n, dtype=F64).expand(T, n, n))
    expect = res.clone()
    expect[:, 0] += f
    assert torch.equal(out, expect)


def test_hc_post_comb_is_source_destination() -> None:
    """comb[j, k] moves source stream j into destination k: a single 1 at [0, 2] copies stream 0
    into stream 2 and leaves the other destinations empty."""
    T, n, D = 1, 4, 8
    res = _rand(T, n, D, seed=3)
    comb = torch.zeros(T, n, n, dtype=F64)
    comb[:, 0, 2] = 1
    out = hc_post(torch.zeros(T, D, dtype=F64), res, torch.zeros(T, n, dtype=F64), comb)
    assert torch.equal(out[:, 2], res[:, 0])
    assert torch.equal(out[:, [0, 1, 3]], torch.zeros(T, 3, D, dtype=F64))


@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([2, 3, 4]), perm_seed=st.integers(0, 1000))
def test_hc_post_stream_permutation_equivariance(seed: int, n: int, perm_seed: int) -> None:
    T, D = 3, 8
    f, res = _rand(T, D, seed=seed), _rand(T, n, D, seed=seed + 1)
    post, comb = _rand(T, n, seed=seed + 2), _rand(T, n, n, seed=seed + 3)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(perm_seed))
    out = hc_post(f, res, post, comb)
    out_p = hc_post(f, res[:, perm], post[:, perm], comb[:, perm][:, :, perm])
    assert torch.allclose(out_p, out[:, perm], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_hc_post_dtype_and_empty(dtype: torch.dtype) -> None:
    n, D = 4, 8
    for T in (0, 2):
        out = hc_post(
            _rand(T, D, seed=0, dtype=dtype),
            _rand(T, n, D, seed=1, dtype=dtype),
            torch.rand(T, n),
            torch.rand(T, n, n),
        )
        assert (out.shape, out.dtype) == ((T, n, D), dtype)


def test_hc_post_rejects_bad_shapes() -> None:
    f, res = _rand(2, 8, seed=0), _rand(2, 4, 8, seed=1)
    with pytest.raises(InputError, match=r"comb: expected shape \(2, 4, 4\)"):
        hc_post(f, res, torch.rand(2, 4, dtype=F64), torch.rand(2, 4, 3, dtype=F64))
    with pytest.raises(InputError, match=r"f: expected shape \(2, 8\)"):
        hc_post(f[:, :4], res, torch.rand(2, 4, dtype=F64), torch.rand(2, 4, 4, dtype=F64))


# ------------------------------------------------------------------------------ hc_head
def test_hc_head_zero_params_known_answer() -> None:
    """fn = 0, base = 0: every gate is sigmoid(0) + eps, so y = (0.5 + eps) * sum of streams."""
    T, n, D = 3, 4, 8
    x = _rand(T, n, D, seed=5)
    y = hc_head(
        x,
        torch.zeros(n, n * D, dtype=F64),
        torch.ones(1, dtype=F64),
        torch.zeros(n, dtype=F64),
        rms_norm_eps=EPS,
        hc_eps=EPS,
    )
    assert torch.allclose(y, (0.5 + EPS) * x.sum(1), rtol=1e-15, atol=1e-15)


def test_hc_head_single_stream_gate_by_hand() -> None:
    """One token, n = 2, D = 2, fn selects x[0,0]: mix = x00 * r, gate by the formula."""
    x = torch.tensor([[[3.0, 0.0], [0.0, 4.0]]], dtype=F64)  # mean square = 25/4
    fn = torch.zeros(2, 4, dtype=F64)
    fn[1, 0] = 1.0
    r = 1.0 / (25.0 / 4.0 + EPS) ** 0.5
    g0 = 0.5 + EPS
    g1 = 1.0 / (1.0 + math.exp(-(3.0 * r * 2.0 + 0.25))) + EPS
    y = hc_head(
        x,
        fn,
        torch.tensor([2.0], dtype=F64),
        torch.tensor([0.0, 0.25], dtype=F64),
        rms_norm_eps=EPS,
        hc_eps=EPS,
    )
    assert torch.allclose(y, torch.tensor([[g0 * 3.0, g1 * 4.0]], dtype=F64), rtol=1e-15, atol=0)


@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([2, 3, 4]), perm_seed=st.integers(0, 1000))
def test_hc_head_stream_permutation_invariance(seed: int, n: int, perm_seed: int) -> None:
    T, D = 4, 8
    x = _rand(T, n, D, seed=seed)
    fn, base, scale = (
        _rand(n, n * D, seed=seed + 1, std=0.05),
        _rand(n, seed=seed + 2),
        _rand(1, seed=seed + 3),
    )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(perm_seed))
    cols = (perm[:, None] * D + torch.arange(D)[None, :]).reshape(-1)
    y = hc_head(x, fn, scale, base, rms_norm_eps=EPS, hc_eps=EPS)
    y_p = hc_head(x[:, perm], fn[perm][:, cols], scale, base[perm], rms_norm_eps=EPS, hc_eps=EPS)
    assert torch.allclose(y_p, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_hc_head_dtype_and_empty(dtype: torch.dtype) -> None:
    n, D = 4, 8
    fn = _rand(n, n * D, seed=0, std=0.05).float()
    for T in (0, 1):
        y = hc_head(
            _rand(T, n, D, seed=1, dtype=dtype),
            fn,
            torch.ones(1),
            torch.zeros(n),
            rms_norm_eps=EPS,
            hc_eps=EPS,
        )
        assert (y.shape, y.dtype) == ((T, D), dtype)


def test_hc_head_rejects_bad_shapes() -> None:
    x = _rand(2, 4, 8, seed=0)
    with pytest.raises(InputError, match=r"fn: expected shape \(4, 32\)"):
        hc_head(
            x,
            torch.zeros(24, 32, dtype=F64),
            torch.ones(1, dtype=F64),
            torch.zeros(4, dtype=F64),
            rms_norm_eps=EPS,
            hc_eps=EPS,
        )
    with pytest.raises(InputError, match=r"scale: expected shape \(1,\)"):
        hc_head(
            x,
            torch.zeros(4, 32, dtype=F64),
            torch.ones(3, dtype=F64),
            torch.zeros(4, dtype=F64),
            rms_norm_eps=EPS,
            hc_eps=EPS,
        )


# ---- optimized-specific tests ----
# dsv4mtp.optimized beyond the generated contract (conformance/test_contract.py: differential,
# T = 0, out=, batch invariance, graph replay and a typed error for every backend): agreement of
# its FlashInfer and Triton paths, the generic n != 4 path, very long batches, the collapse's
# fused form, schedules and diagnostics, and validation beyond the contract's typed error.
# GPU-only tests carry the `gpu` marker.


def _opt_inputs(op: str, T: int, n: int, D: int, dtype: torch.dtype, device: str, seed: int):
    """(args, kwargs) for one optimized mHC op, from the shared builder."""
    return op_inputs(op, T, D, seed, n=n, dtype=dtype, device=device)


def _call(op: str, args, kwargs, **extra):
    out = getattr(opt, op)(*args, **kwargs, **extra)
    return tuple(out) if isinstance(out, tuple) else (out,)


_GPU_OPS = ["hc_pre", "hc_head", "hc_post"]
_REF = {"hc_pre": hc_pre, "hc_head": hc_head, "hc_post": hc_post}


def _reference_f64(op: str, args, kw) -> tuple[torch.Tensor, ...]:
    ref = _REF[op](*(a.double() for a in args), **kw)
    return tuple(ref) if isinstance(ref, tuple) else (ref,)


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the bf16 spacing at |b| (2^-7 relative, at least 2^-133)."""
    a, b = a.double(), b.double()
    spacing = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2.0**-126))) - 7)
    return float(((a - b).abs() / spacing).max()) if a.numel() else 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("D", [4096, 7168])
@pytest.mark.parametrize("T", [1, 77, 4096])
def test_optimized_hc_pre_backends_agree(T: int, D: int) -> None:
    """The three hc_pre consumers compute one function from the same kind of producer: post /
    comb to the mix-rounding level (the K splits differ: 64 / 16 / 1), layer_input within one
    bf16 rounding of its scale."""
    args, kw = _opt_inputs("hc_pre", T, 4, D, torch.bfloat16, "cuda", seed=T)
    res = {
        b: _call("hc_pre", args, kw, backend=b)
        for b in ("triton", "flashinfer", "flashinfer_prenorm")
    }
    li_t, post_t, comb_t = res["triton"]
    for b in ("flashinfer", "flashinfer_prenorm"):
        li, post, comb = res[b]
        # Different K splits of the same fp32-accumulated mix: ~1e-6 relative on the mix.
        assert torch.allclose(post, post_t, rtol=2e-3, atol=1e-5), b
        assert torch.allclose(comb, comb_t, rtol=2e-3, atol=1e-5), b
        # Scaled max-abs: the weighted sum cancels, so ulps at tiny outputs mean nothing.
        scaled = (li.double() - li_t.double()).abs().max() / li_t.double().abs().max()
        assert float(scaled) <= 2.0**-7, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [4, 3])
def test_optimized_hc_pre_fma_agrees_with_the_collapse(
    n: int, dtype: torch.dtype, device: str
) -> None:
    """hc_pre's small-batch kernel (fp32 FMA mix, kernels/mhc_pre_small.py) and the collapse
    (bf16 hi/lo tensor-core mix) compute one function: both within the registry's tolerance of
    the float64 oracle; post and comb, formed by the same reduce code from mixes that differ by
    the collapse's split of fn (~2^-17 per product: ~2e-5 on a mix of K = 28672 terms), agree
    to 5e-4; layer_input within one rounding
    of its scale.  n = 3 leaves the last group of fn rows partly empty (M = 15 of 16).  A
    schedule is refused by the FMA backend, which has none."""
    from dsv4mtp.conformance.differential import compare

    shapes = [(1, 4096), (77, 7168), (300, 4096)] if device == "cuda" else [(1, 96), (37, 160)]
    tol = REGISTRY["hc_pre"].tolerance(dtype)
    for T, D in shapes:
        args, kw = _opt_inputs("hc_pre", T, n, D, dtype, device, seed=T + n)
        oracle = _reference_f64("hc_pre", args, kw)
        fma = _call("hc_pre", args, kw, backend="triton_fma")
        mma = _call("hc_pre", args, kw, backend="triton")
        for name, got in (("triton_fma", fma), ("triton", mma)):
            for g, r, what in zip(got, oracle, ("layer_input", "post", "comb"), strict=True):
                rep = compare(g, r)
                assert rep.within(tol), f"hc_pre {name} {what} T={T} D={D} {dtype}: {rep}"
        for g, r in zip(fma[1:], mma[1:], strict=True):
            assert torch.allclose(g, r, rtol=5e-4, atol=1e-5), f"T={T} D={D}"
        scaled = (fma[0].double() - mma[0].double()).abs().max() / mma[0].double().abs().max()
        assert float(scaled) <= 2.0**-7, f"T={T} D={D}: backends differ by {float(scaled):.2e}"
    with pytest.raises(InputError, match="schedule: the 'triton_fma' backend takes none"):
        opt.hc_pre(*args, **kw, backend="triton_fma", schedule=opt.CollapseSchedule())


def test_optimized_hc_pre_fma_schedules_compute_one_function(device: str) -> None:
    """Other schedules of the small-batch hc_pre kernel (fewer fn rows per program, other token
    blocks, slices, reducer and apply tiles, warps) change only the order of fp32 sums: post and
    comb agree to 1e-5, layer_input within one rounding of its scale.  A schedule that is not
    all powers of two is a ConfigError naming the field."""
    from dsv4mtp.optimized.kernels.mhc_pre_small import PreFmaConfig, mhc_pre_fma, pre_fma_config

    T, D = (70, 4096) if device == "cuda" else (19, 96)
    (x, fn, scale, base), kw = _opt_inputs("hc_pre", T, 4, D, torch.bfloat16, device, seed=3)
    default = pre_fma_config(4, D)
    others = [PreFmaConfig(4, 4, 16, 1, 2, 16, 4), PreFmaConfig(16, 8, 32, 4, 8, 64, 2)]

    def run(cfg: PreFmaConfig) -> list[torch.Tensor]:
        outs = [torch.full((T, D), float("nan"), dtype=x.dtype, device=device),
                torch.full((T, 4), float("nan"), device=device),
                torch.full((T, 4, 4), float("nan"), device=device)]  # fmt: skip
        mhc_pre_fma(x, fn, scale.float(), base.float(), *outs, cfg=cfg, **kw)
        return outs

    want = run(default)
    for cfg in others:
        got = run(cfg)
        assert not any(g.isnan().any() for g in got), cfg
        for g, w in zip(got[1:], want[1:], strict=True):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), cfg
        scaled = (got[0].double() - want[0].double()).abs().max() / want[0].double().abs().max()
        assert float(scaled) <= 2.0**-7, cfg
    with pytest.raises(ConfigError, match=r"PreFmaConfig\.block_d: expected a power of two"):
        PreFmaConfig(8, 16, 48, 2, 4, 256, 4)


def test_optimized_hc_pre_token_block_follows_t_outside_batch_invariant_mode(device: str) -> None:
    """The small-batch hc_pre's token block: 16 under batch_invariant=True at every T; without
    it, the next power of two >= T below 16.  hc_pre and hc_post_pre (fused, and composed
    through hc_pre's operator) at T 3 ask for the schedule of 3 tokens only without batch
    invariance; hc_pre within the float64 reference's tolerance, the two hc_post_pre forms
    within fp32 rounding of each other.  The kept plans are dropped before each call, so that
    each call builds its plan and asks for its schedule."""
    from dsv4mtp.optimized.kernels import _launch
    from dsv4mtp.optimized.kernels import mhc_pre_small as small

    blocks = {T: small.pre_fma_config(4, 4096, T).block_t for T in (1, 2, 3, 5, 8, 9, 64)}
    assert blocks == {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 9: 16, 64: 16}
    assert small.pre_fma_config(4, 4096).block_t == small.BLOCK_T == 16
    T, D = 3, 64
    (x, fn, scale, base), kw = _opt_inputs("hc_pre", T, 4, D, torch.float32, device, seed=4)
    pargs, pkw = _opt_inputs("hc_post_pre", T, 4, D, torch.float32, device, seed=5)
    asked: list[int | None] = []
    config = small.pre_fma_config

    def spy(n: int, D: int, tokens: int | None = None) -> object:
        asked.append(tokens)
        return config(n, D, tokens)

    def fresh(op, *args, **kwargs):  # type: ignore[no-untyped-def]
        _launch._PLANS.clear()
        return op(*args, **kwargs)

    small.pre_fma_config = spy  # type: ignore[assignment]
    try:
        for bi in (False, True):
            got = fresh(opt.hc_pre, x, fn, scale, base, **kw, backend="triton_fma",
                        batch_invariant=bi)  # fmt: skip
            want = hc_pre(*(t.cpu().double() for t in (x, fn, scale, base)), **kw)
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g.cpu().double(), w, rtol=1e-5, atol=1e-6), bi
            assert asked[-1] == (None if bi else T), asked
            pair = [
                fresh(opt.hc_post_pre, *pargs, **pkw, backend=b, batch_invariant=bi)
                for b in ("triton_fma", "composed")
            ]
            assert asked[-2:] == [None if bi else T] * 2, (bi, asked)
            for f, c in zip(*pair, strict=True):
                assert torch.allclose(f, c, rtol=1e-5, atol=1e-6), bi
    finally:
        small.pre_fma_config = config  # type: ignore[assignment]
    assert len(asked) == 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_optimized_hc_head_backends_agree(dtype: torch.dtype, device: str) -> None:
    """hc_head's two kernels (fp32 FMA mix; bf16 hi/lo tensor-core mix) compute one function:
    both within the registry's tolerance of the float64 oracle, outputs within one rounding of
    each other's scale.  A schedule is refused by the backend that has none."""
    from dsv4mtp.conformance.differential import compare

    shapes = [(1, 4096), (77, 7168), (700, 4096)] if device == "cuda" else [(1, 96), (37, 160)]
    tol = REGISTRY["hc_head"].tolerance(dtype)
    for T, D in shapes:
        args, kw = _opt_inputs("hc_head", T, 4, D, dtype, device, seed=T)
        (oracle,) = _reference_f64("hc_head", args, kw)
        fma = opt.hc_head(*args, **kw, backend="triton_fma")
        mma = opt.hc_head(*args, **kw, backend="triton_mma")
        for name, got in (("triton_fma", fma), ("triton_mma", mma)):
            rep = compare(got, oracle)
            assert rep.within(tol), f"hc_head {name} T={T} D={D} {dtype}: {rep}"
        scaled = (fma.double() - mma.double()).abs().max() / mma.double().abs().max()
        assert float(scaled) <= 2.0**-7, f"T={T} D={D}: backends differ by {float(scaled):.2e}"
    with pytest.raises(InputError, match="schedule: only the 'triton_mma' backend"):
        opt.hc_head(*args, **kw, backend="triton_fma", schedule=opt.CollapseSchedule())


@pytest.mark.parametrize(
    ("tiles", "message"),
    [
        ((48, 256, 64, 64), "block_t: expected a power of two, got 48"),
        ((64, 256, 0, 64), "block_k: expected a power of two, got 0"),
        ((64, 64, 128, 64), r"block_k \(128\) and apply_d \(64\) must not exceed d_slice \(64\)"),
        ((64, 64, 64, 128), r"apply_d \(128\) must not exceed d_slice \(64\)"),
        ((64, 256, 64, 64, 16), r"max_registers: expected None or 24\.\.255, got 16"),
        ((64, 256, 64, 64, 256), r"max_registers: expected None or 24\.\.255, got 256"),
    ],
)
def test_collapse_config_rejects_unusable_tiles(tiles: tuple[int, ...], message: str) -> None:
    """A hand-made collapse schedule with tiles the kernel cannot run (tl.arange needs powers
    of two; the mix and apply step through a slice) or a register cap ptxas refuses is refused
    when it is built, naming the field, before anything is compiled."""
    from dsv4mtp.errors import ConfigError
    from dsv4mtp.optimized.kernels.mhc_collapse import CollapseConfig

    block_t, d_slice, block_k, apply_d, *cap = tiles
    with pytest.raises(ConfigError, match=message):
        CollapseConfig(block_t, d_slice, block_k, apply_d, num_warps=4, num_stages=3, fused=True,
                       max_registers=cap[0] if cap else None)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("D", [4096, 7168])
@pytest.mark.parametrize("T", [1, 100, 4096])
def test_optimized_hc_post_backends_agree(T: int, D: int) -> None:
    """FlashInfer mhc_post and the Triton kernel run the same FMA chain: at most one bf16 ulp
    apart (FMA contraction may differ) and both within tolerance of the float64 oracle."""
    args, _ = _opt_inputs("hc_post", T, 4, D, torch.bfloat16, "cuda", seed=T)
    fi = opt.hc_post(*args, backend="flashinfer")
    tr = opt.hc_post(*args, backend="triton")
    assert _ulps_bf16(fi, tr) <= 1.0
    oracle = hc_post(*(a.double() for a in args))
    for got in (fi, tr):
        assert float((got.double() - oracle).norm() / oracle.norm()) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize(("op", "n", "D"), [
    ("hc_pre", 2, 4096), ("hc_pre", 3, 1024), ("hc_pre", 6, 512),
    ("hc_head", 2, 7168), ("hc_head", 3, 1024), ("hc_head", 8, 512),
    ("hc_post", 3, 4096), ("hc_post", 6, 512),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_optimized_generic_n_path(op: str, n: int, D: int, dtype: torch.dtype) -> None:
    """n != 4 (no FlashInfer kernel) and fp32 run the Triton kernels; compared with the float64
    reference under the registry's tolerance for the op and dtype."""
    from dsv4mtp.conformance.differential import compare

    tol = REGISTRY[op].tolerance(dtype)
    for T in (1, 37, 300):
        args, kw = _opt_inputs(op, T, n, D, dtype, "cuda", seed=n * T)
        got = _call(op, args, kw)
        for g, r in zip(got, _reference_f64(op, args, kw), strict=True):
            rep = compare(g, r)
            assert rep.within(tol), f"{op} n={n} D={D} T={T} {dtype}: {rep}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", _GPU_OPS)
def test_optimized_very_long_batch(op: str) -> None:
    """T = 65537 (beyond one grid row of 65535 blocks, odd): finite, within tolerance."""
    from dsv4mtp.conformance.differential import compare

    T, D = 65537, 1024
    args, kw = _opt_inputs(op, T, 4, D, torch.bfloat16, "cuda", seed=5)
    got = _call(op, args, kw)
    for g, r in zip(got, _reference_f64(op, args, kw), strict=True):
        rep = compare(g, r)
        assert rep.within(REGISTRY[op].tolerance(torch.bfloat16)), f"{op}: {rep}"


def test_optimized_mhc_rejects_bad_input(device: str) -> None:
    """Typed errors naming the argument: unsupported dtypes point to the reference; out= must
    match exactly; backends that cannot run say why."""
    args, kw = _opt_inputs("hc_pre", 2, 4, 64, torch.float32, device, seed=0)
    x, fn, scale, base = args
    for bad in (torch.float64, torch.float16):
        with pytest.raises(InputError, match=r"x: expected dtype .*dsv4mtp.reference"):
            opt.hc_pre(x.to(bad), fn, scale, base, **kw)
    with pytest.raises(InputError, match="fn: expected dtype"):
        opt.hc_pre(x, fn.double(), scale, base, **kw)
    with pytest.raises(InputError, match=r"fn: expected shape \(24, 256\)"):
        opt.hc_pre(x, fn[:, :-1], scale, base, **kw)
    with pytest.raises(InputError, match="out: expected a 3-tuple"):
        opt.hc_pre(x, fn, scale, base, **kw, out=torch.empty(2, 64, device=device))
    li = torch.empty(2, 64, device=device)
    post, comb = torch.empty(2, 4, device=device), torch.empty(2, 4, 4, device=device)
    with pytest.raises(InputError, match=r"out\[1\]: expected shape \(2, 4\)"):
        opt.hc_pre(x, fn, scale, base, **kw, out=(li, post[:, :3], comb))
    with pytest.raises(InputError, match=r"out\[0\]: expected dtype bfloat16"):
        opt.hc_pre(x.bfloat16(), fn, scale, base, **kw, out=(li, post, comb))
    with pytest.raises(InputError, match="sinkhorn_iters"):
        opt.hc_pre(x, fn, scale, base, **{**kw, "sinkhorn_iters": 0})
    with pytest.raises(InputError, match="backend"):
        opt.hc_pre(x, fn, scale, base, **kw, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="flashinfer"):  # fp32 has no FlashInfer path
        opt.hc_pre(x, fn, scale, base, **kw, backend="flashinfer")

    (f, res, p, c), _ = _opt_inputs("hc_post", 2, 4, 64, torch.bfloat16, device, seed=0)
    with pytest.raises(InputError, match="residual: expected dtype"):
        opt.hc_post(f, res.double(), p, c)
    with pytest.raises(InputError, match="out: expected a contiguous tensor"):
        opt.hc_post(
            f, res, p, c, out=torch.empty(2, 64, 4, dtype=res.dtype, device=device).transpose(1, 2)
        )
    with pytest.raises(InputError, match=r"comb: expected shape \(2, 4, 4\)"):
        opt.hc_post(f, res, p, c[:, :3])

    (xh, fnh, sh, bh), hkw = _opt_inputs("hc_head", 2, 4, 64, torch.bfloat16, device, seed=0)
    with pytest.raises(InputError, match=r"out: expected shape \(2, 64\)"):
        opt.hc_head(xh, fnh, sh, bh, **hkw, out=torch.empty(2, 63, dtype=xh.dtype, device=device))
    if device == "cuda":
        with pytest.raises(InputError, match="fn: expected device"):
            opt.hc_head(xh, fnh.cpu(), sh, bh, **hkw)


def test_optimized_auto_backends_are_declared() -> None:
    assert PRE_AUTO_BACKEND in ("triton", "triton_fma", "flashinfer", "flashinfer_prenorm")
    assert HEAD_AUTO_BACKEND in ("triton_fma", "triton_mma")


# (T, D): several token blocks and slices each way; on the GPU the real widths and a T with
# thousands of programs (more than one wave), on the CPU what the interpreter runs fast.
_ONE_LAUNCH_SHAPES = (
    [(1, 4096), (77, 7168), (3000, 4096)] if torch.cuda.is_available() else [(1, 64), (37, 96)]
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("T", "D"), _ONE_LAUNCH_SHAPES)
@pytest.mark.parametrize("op", ["hc_pre", "hc_head", "hc_head_fma"])
def test_optimized_one_launch_collapse_equals_split_launches(
    op: str, T: int, D: int, dtype: torch.dtype, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-launch kernels (roles by ticket, in-kernel waits on lower tickets, apply
    re-reading from L2) and their split forms (one launch per phase) run the same arithmetic:
    equal bitwise.  A missed release/acquire, a wrong role for a ticket or counters not left
    zeroed for the next launch would show here as stale partials, stale gates or unwritten (NaN)
    output.  The launches share one counter buffer, which must be all zero after each."""
    from dsv4mtp.optimized.kernels import _sync
    from dsv4mtp.optimized.kernels import mhc_collapse as collapse_mod
    from dsv4mtp.optimized.kernels import mhc_head as head_mod
    from dsv4mtp.optimized.kernels.mhc_collapse import collapse_config, mhc_collapse
    from dsv4mtp.optimized.kernels.mhc_head import mhc_head_fma

    shared = torch.zeros(4096, dtype=torch.int32, device=device)

    def one_buffer(dev: torch.device, n: int) -> torch.Tensor:
        assert n <= shared.numel()
        return shared

    for mod in (_sync, collapse_mod, head_mod):
        if hasattr(mod, "counters"):
            monkeypatch.setattr(mod, "counters", one_buffer)
    base_op = "hc_pre" if op == "hc_pre" else "hc_head"
    (x, fn, scale, base), kw = _opt_inputs(base_op, T, 4, D, dtype, device, seed=T + 1)
    scale, base = scale.float(), base.float()
    eps = dict(rms_norm_eps=kw["rms_norm_eps"], hc_eps=kw["hc_eps"])

    def run(one: bool) -> list[torch.Tensor]:
        outs = [torch.full((T, D), float("nan"), dtype=x.dtype, device=device)]
        if op == "hc_head_fma":
            mhc_head_fma(x, fn, scale, base, outs[0], one_launch=one, **eps)
            return outs
        cfg = dataclasses.replace(collapse_config(4, D, with_post_comb=op == "hc_pre"), fused=one)
        pc: dict = {}
        if op == "hc_pre":
            pc = dict(post=torch.full((T, 4), float("nan"), device=device),
                      comb=torch.full((T, 4, 4), float("nan"), device=device),
                      post_mult=kw["post_mult"], sinkhorn_iters=kw["sinkhorn_iters"])  # fmt: skip
            outs += [pc["post"], pc["comb"]]
        mhc_collapse(x, fn, scale, base, outs[0], cfg=cfg, **eps, **pc)
        return outs

    for _ in range(3 if device == "cuda" else 2):  # repeated: a race would not show every time
        one, split = run(True), run(False)
        assert int(shared.count_nonzero()) == 0, "the counters were not left zeroed"
        for a, b in zip(one, split, strict=True):
            assert not a.isnan().any(), f"{op} {dtype} T={T} D={D}: output not written"
            assert torch.equal(a, b), f"{op} {dtype} T={T} D={D}: one launch != split launches"


@pytest.mark.gpu
def test_one_launch_kernel_replays_with_counters_from_a_capture_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Captured inside ``capture_arena`` (as the layer's graphs are), a one-launch kernel takes
    its counters from the arena, not a memset node: every replay (input changed, output
    poisoned in between) gives the split launches' bits, and leaves the arena zeroed."""
    from dsv4mtp.optimized.kernels import _sync
    from dsv4mtp.optimized.kernels._launch import arena_piece, capture_arena
    from dsv4mtp.optimized.kernels.mhc_head import mhc_head_fma

    pieces: list[torch.Tensor] = []

    def recorded(device: torch.device, n: int) -> torch.Tensor | None:
        piece = arena_piece(device, n)
        if piece is not None:
            pieces.append(piece)
        return piece

    monkeypatch.setattr(_sync, "arena_piece", recorded)
    T, D = 77, 4096
    (x, fn, scale, base), kw = _opt_inputs("hc_head", T, 4, D, torch.bfloat16, "cuda", seed=3)
    scale, base = scale.float(), base.float()
    eps = dict(rms_norm_eps=kw["rms_norm_eps"], hc_eps=kw["hc_eps"])
    static, out = x.clone(), torch.empty(T, D, dtype=x.dtype, device="cuda")
    mhc_head_fma(static, fn, scale, base, out, one_launch=True, **eps)  # compiled outside
    torch.cuda.synchronize()
    assert not pieces  # eager launches keep the stream's counters
    arena = torch.zeros(1024, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), capture_arena(arena):
        mhc_head_fma(static, fn, scale, base, out, one_launch=True, **eps)
    assert len(pieces) == 1 and pieces[0].data_ptr() == arena.data_ptr()
    for s in (1.0, -0.5, 2.0):
        static.copy_(x * s)
        out.fill_(float("nan"))
        graph.replay()
        want = torch.full_like(out, float("nan"))
        mhc_head_fma(static, fn, scale, base, want, one_launch=False, **eps)
        torch.cuda.synchronize()
        assert torch.equal(out, want), s
        assert not arena.any(), s


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["hc_pre", "hc_head"])
def test_optimized_collapse_trace_is_a_pure_observer(op: str) -> None:
    """The collapse's diagnostics (``trace=``, read by bench/h200_trace.py) change no output
    bit, and its stamps are ordered: each program's six phase stamps never decrease and it
    ends after it starts on the global timer."""
    from dsv4mtp.optimized.kernels.mhc_collapse import (
        TRACE_WIDTH,
        collapse_config,
        collapse_grid,
        mhc_collapse,
    )

    T, D = 300, 4096
    (x, fn, scale, base), kw = _opt_inputs(op, T, 4, D, torch.bfloat16, "cuda", seed=5)
    cfg = collapse_config(4, D, with_post_comb=op == "hc_pre")
    outs = []
    trace = torch.zeros(collapse_grid(T, D, cfg), TRACE_WIDTH, dtype=torch.int64, device="cuda")
    for tr in (None, trace):
        out = torch.full((T, D), float("nan"), dtype=x.dtype, device="cuda")
        pc = {}
        if op == "hc_pre":
            pc = dict(
                post=torch.full((T, 4), float("nan"), device="cuda"),
                comb=torch.full((T, 4, 4), float("nan"), device="cuda"),
                post_mult=kw["post_mult"],
                sinkhorn_iters=kw["sinkhorn_iters"],
            )
        mhc_collapse(x, fn, scale.float(), base.float(), out, rms_norm_eps=kw["rms_norm_eps"],
                     hc_eps=kw["hc_eps"], cfg=cfg, trace=tr, **pc)  # fmt: skip
        outs.append([out, *(v for v in pc.values() if isinstance(v, torch.Tensor))])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    t = trace.cpu()
    assert bool((t[:, 1:6] >= t[:, 0:5]).all()), "phase stamps out of order"
    assert bool((t[:, 8] >= t[:, 7]).all()) and bool((t[:, 7] > 0).all())
    with pytest.raises(ValueError, match="trace"):
        mhc_collapse(x, fn, scale.float(), base.float(), out, rms_norm_eps=1e-6, hc_eps=1e-6,
                     cfg=dataclasses.replace(cfg, fused=False), trace=trace)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_optimized_mix_producer_is_exact_to_fp32_accumulation(
    dtype: torch.dtype, device: str
) -> None:
    """The producer's bf16 hi/lo split of fn (and of fp32 x) keeps ~16 mantissa bits: its
    partial mixes summed over the splits match a float64 x @ fn^T to ~1e-5 of the row scale
    (TF32 would be ~1e-3), and its square sums match to fp32 accumulation (~1e-6)."""
    from dsv4mtp.optimized.kernels.mhc_mix import mhc_mix_splitk, mix_config

    g = torch.Generator(device=device).manual_seed(3)
    T, K, M = 37, 4 * 96, 24
    x = torch.randn(T, K, generator=g, device=device).to(dtype)
    fn = torch.randn(M, K, generator=g, device=device) * 0.02
    cfg = mix_config(M, K)
    mix, sq = mhc_mix_splitk(x, fn, cfg)
    assert mix.shape == (cfg.num_splits, T, M) and sq.shape == (cfg.num_splits, T)
    want = x.double() @ fn.double().T
    scale = (x.double().abs() @ fn.double().abs().T).clamp_min(1e-30)
    err = float(((mix.double().sum(0) - want).abs() / scale).max())
    assert err < 3e-5, f"mix error {err:.2e} of |x| @ |fn|"
    sq_want = (x.double() ** 2).sum(1)
    assert float(((sq.double().sum(0) - sq_want).abs() / sq_want).max()) < 1e-5


# ------------------------------------------------------------------------------ fused pairs
# hc_post_pre / hc_post_head: the generated contract judges them against the float64 composition;
# here the fused kernels are held to the bits of the optimized composition they replace.
_SECOND = {"hc_post_pre": "hc_pre", "hc_post_head": "hc_head"}
_FUSED_SHAPES = (
    [(1, 4096), (8, 4096), (64, 4096), (33, 7168)]
    if torch.cuda.is_available()
    else [(1, 64), (5, 48), (19, 96)]
)


def _composed(op: str, args, kw, post_backend: str, second_backend: str):
    """hc_post then hc_pre / hc_head, as two optimized ops with the given backends."""
    f, x, post, comb, *params = args
    x_new = opt.hc_post(f, x, post, comb, backend=post_backend)  # type: ignore[arg-type]
    return (x_new, *_call(_SECOND[op], (x_new, *params), kw, backend=second_backend))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("op", ["hc_post_pre", "hc_post_head"])
def test_optimized_fused_pair_is_bitwise_the_composition(
    op: str, n: int, dtype: torch.dtype, device: str
) -> None:
    """Backend "triton_fma" gives the bits of hc_post (Triton; on CUDA in bf16 at n = 4 FlashInfer's
    mhc_post too, which runs the same FMA chain) followed by the second op's "triton_fma":
    the same op order, hc_post's result rounded once and mixed from registers; "composed" gives
    those of the two ops' "auto" choices."""
    for T, D in _FUSED_SHAPES:
        args, kw = _opt_inputs(op, T, n, D, dtype, device, seed=T + n)
        fused = _call(op, args, kw, backend="triton_fma")
        post_backends = ["triton"]
        if device == "cuda" and dtype == torch.bfloat16 and n == 4:
            post_backends.append("flashinfer")
        for pb in post_backends:
            want = _composed(op, args, kw, pb, "triton_fma")
            for i, (g, w) in enumerate(zip(fused, want, strict=True)):
                assert torch.equal(g, w), f"{op} output {i} T={T} D={D}: not hc_post({pb}) + fma"
        composed = _call(op, args, kw, backend="composed")
        for i, (g, w) in enumerate(zip(composed, _composed(op, args, kw, "auto", "auto"),
                                       strict=True)):  # fmt: skip
            assert torch.equal(g, w), f"{op} composed output {i} T={T} D={D}"


def test_optimized_fused_pairs_fuse_where_the_small_batch_kernels_run() -> None:
    """auto: "triton_fma" wherever the second op's auto runs its small-batch kernel (and at
    every T under batch_invariant), "composed" elsewhere."""
    from dsv4mtp.optimized import _dispatch as d

    cpu = torch.device("cpu")
    for T in (1, 64, 65, 512, 4096):
        for D in (4096, 7168):
            facts = d.Facts(cpu, (torch.bfloat16,) * 2, n=4, D=D, eps=(EPS, EPS), T=T)
            pre = d.select("hc_pre", "auto", facts)
            head = d.select("hc_head", "auto", facts)
            assert d.select("hc_post_pre", "auto", facts) == (
                "triton_fma" if pre == "triton_fma" else "composed"
            )
            assert d.select("hc_post_head", "auto", facts) == (
                "triton_fma" if head == "triton_fma" else "composed"
            )
    invariant = d.Facts(cpu, (torch.bfloat16,) * 2, n=4, D=4096, eps=(EPS, EPS))
    assert d.select("hc_post_pre", "auto", invariant) == "triton_fma"
    assert d.select("hc_post_head", "auto", invariant) == "triton_fma"


@pytest.mark.parametrize("op", ["hc_post_pre", "hc_post_head"])
@pytest.mark.parametrize("backend", ["triton_fma", "composed"])
@pytest.mark.parametrize("variant", ["", "_out"])
def test_optimized_fused_operators_pass_opcheck(
    op: str, backend: str, variant: str, device: str
) -> None:
    """The operators behind the fused pairs: schema, fake kernel and AOT dispatch."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    args, _ = _opt_inputs(op, 5, 4, 32, dtype, device, seed=0)
    x = args[1]
    T, n, D = x.shape
    post_backend = "flashinfer" if device == "cuda" else "triton"
    eps = (EPS, EPS)
    # the functional variant ends in the next norm, the out variant has none
    norm = (torch.linspace(0.5, 1.5, D).to(x), "official") if not variant else (None, "")
    if op == "hc_post_pre":
        call = (*args, *eps, 3, 2.0, backend, post_backend, "triton_fma", False, *norm)
        outs = dict(
            x_out=torch.empty_like(x), layer_input=x.new_empty((T, D)),
            post_out=x.new_empty((T, n), dtype=torch.float32),
            comb_out=x.new_empty((T, n, n), dtype=torch.float32),
        )  # fmt: skip
    else:
        call = (*args, *eps, backend, post_backend, "triton_fma", *norm)
        outs = dict(x_out=torch.empty_like(x), head_input=x.new_empty((T, D)))
    operator = getattr(torch.ops.dsv4mtp, op + variant).default
    torch.library.opcheck(operator, call, outs if variant else {})


def test_optimized_fused_pairs_reject_bad_input(device: str) -> None:
    args, kw = _opt_inputs("hc_post_pre", 2, 4, 64, torch.float32, device, seed=0)
    a, x, post, comb, fn, scale, base = args
    with pytest.raises(InputError, match="out: expected a 4-tuple"):
        opt.hc_post_pre(*args, **kw, out=(torch.empty_like(x),))
    with pytest.raises(InputError, match=r"out\[0\]: expected shape \(2, 4, 64\)"):
        outs = (torch.empty(2, 3, 64), torch.empty(2, 64), torch.empty(2, 4), torch.empty(2, 4, 4))
        opt.hc_post_pre(*args, **kw, out=tuple(o.to(device) for o in outs))  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"comb: expected shape \(2, 4, 4\)"):
        opt.hc_post_pre(a, x, post, comb[:, :3], fn, scale, base, **kw)
    with pytest.raises(InputError, match="backend"):
        opt.hc_post_pre(*args, **kw, backend="triton")  # type: ignore[arg-type]
    hargs, hkw = _opt_inputs("hc_post_head", 2, 4, 64, torch.float32, device, seed=0)
    with pytest.raises(InputError, match=r"head_fn: expected shape \(4, 256\)"):
        opt.hc_post_head(*hargs[:4], hargs[4][:, :-1], *hargs[5:], **hkw)
    with pytest.raises(InputError, match="out: expected a 2-tuple"):
        opt.hc_post_head(*hargs, **hkw, out=hargs[1])  # type: ignore[arg-type]


def test_reference_fused_pairs_are_the_composition() -> None:
    """The reference pairs are hc_post followed by hc_pre / hc_head, nothing else."""
    from dsv4mtp.reference import hc_post_head, hc_post_pre

    for op, fused in (("hc_post_pre", hc_post_pre), ("hc_post_head", hc_post_head)):
        args, kw = op_inputs(op, 6, 32, 7, n=4, dtype=F64, device="cpu")
        f, x, post, comb, *params = args
        x_new = hc_post(f, x, post, comb)
        second = (
            hc_pre(x_new, *params, **kw) if op == "hc_post_pre" else hc_head(x_new, *params, **kw)
        )
        want = (x_new, *(second if isinstance(second, tuple) else (second,)))
        got = fused(*args, **kw)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


# ------------------------------------------------------------------------------ trailing norm
# hc_pre, hc_head and the fused pairs end in the next RMSNorm when given its weight.  On the
# small-batch kernels the norm runs in their apply launch (one whole-row program per token);
# here that is held to the bits of the same op without the weight followed by the Triton
# rms_norm kernel at the FMA kernels' 4 warps, and to the two-launch setting (_ops.FUSE_NORM).
_NORM_OPS = ("hc_pre", "hc_head", "hc_post_pre", "hc_post_head")
_NORMED = {"hc_pre": 0, "hc_head": 0, "hc_post_pre": 1, "hc_post_head": 1}  # which output


def _norm_weight(D: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(device)


@pytest.mark.parametrize("order", ["official", "vllm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", _NORM_OPS)
def test_optimized_trailing_norm_is_bitwise_the_norm_after_the_op(
    op: str, dtype: torch.dtype, order: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsv4mtp.optimized import _ops
    from dsv4mtp.optimized.kernels.rms_norm import rms_norm_triton

    for T, D in _FUSED_SHAPES:
        args, kw = _opt_inputs(op, T, 4, D, dtype, device, seed=3 * T + 1)
        w = _norm_weight(D, dtype, device, seed=T)
        plain = _call(op, args, kw, backend="triton_fma")
        k = _NORMED[op]
        want = torch.empty_like(plain[k])
        rms_norm_triton(plain[k], w, EPS, want, order == "vllm", num_warps=4)
        got = _call(op, args, kw, backend="triton_fma", norm_weight=w, norm_order=order)
        for i, (g, p) in enumerate(zip(got, plain, strict=True)):
            expected = want if i == k else p
            assert torch.equal(g, expected), f"{op} output {i} T={T} D={D} {order}"
        monkeypatch.setattr(_ops, "FUSE_NORM", False)  # the norm as its own launch: same bits
        apart = _call(op, args, kw, backend="triton_fma", norm_weight=w, norm_order=order)
        monkeypatch.setattr(_ops, "FUSE_NORM", True)
        for i, (g, a) in enumerate(zip(got, apart, strict=True)):
            assert torch.equal(g, a), f"{op} output {i} T={T} D={D}: fused vs two launches"
        # the T-independent schedule, and a weight in the other float dtype
        w2 = w.float() if dtype == torch.bfloat16 else w.to(torch.bfloat16)
        bi = dict(batch_invariant=True)
        plain = _call(op, args, kw, backend="triton_fma", **bi)
        want = torch.empty_like(plain[k])
        rms_norm_triton(plain[k], w2, EPS, want, order == "vllm", num_warps=4)
        got = _call(op, args, kw, backend="triton_fma", norm_weight=w2, norm_order=order, **bi)
        assert torch.equal(got[k], want), f"{op} T={T} D={D} batch-invariant, {w2.dtype} weight"


@pytest.mark.parametrize("op", _NORM_OPS)
def test_optimized_trailing_norm_on_other_backends_is_rms_norm_after_them(
    op: str, device: str
) -> None:
    """Where the FMA kernels do not run (hc_pre's collapse, hc_head's tensor-core collapse, and
    the pairs' "composed" over them, called through the operators so that the second op's
    backend is that one), the norm is the public rms_norm of the op's output."""
    T, D = (5, 4096) if device == "cuda" else (5, 64)
    args, kw = _opt_inputs(op, T, 4, D, torch.bfloat16, device, seed=11)
    w = _norm_weight(D, torch.bfloat16, device, seed=12)
    k = _NORMED[op]
    if op in ("hc_pre", "hc_head"):
        backend = {"hc_pre": "triton", "hc_head": "triton_mma"}[op]
        plain = _call(op, args, kw, backend=backend)
        got = _call(op, args, kw, backend=backend, norm_weight=w, norm_order="vllm")
    else:
        eps = (kw["rms_norm_eps"], kw["hc_eps"])
        post_backend = "flashinfer" if device == "cuda" else "triton"
        if op == "hc_post_pre":
            head = (*eps, kw["sinkhorn_iters"], kw["post_mult"], "composed", post_backend,
                    "triton")  # fmt: skip
            tail: tuple = (False,)
        else:
            head = (*eps, "composed", post_backend, "triton_mma")
            tail = ()
        operator = getattr(torch.ops.dsv4mtp, op).default
        plain = operator(*args, *head, *tail, None, "official")
        got = operator(*args, *head, *tail, w, "vllm")
    assert torch.equal(got[k], opt.rms_norm(plain[k], w, EPS, order="vllm"))
    for i, (g, p) in enumerate(zip(got, plain, strict=True)):
        if i != k:
            assert torch.equal(g, p), f"{op} output {i}"


def test_trailing_norm_arguments_are_checked(device: str) -> None:
    args, kw = _opt_inputs("hc_pre", 2, 4, 64, torch.float32, device, seed=0)
    for f in (opt.hc_pre, hc_pre):
        with pytest.raises(InputError, match=r"norm_weight: expected shape \(64,\)"):
            f(*args, **kw, norm_weight=torch.ones(63, device=device))  # type: ignore[operator]
        with pytest.raises(InputError, match="norm_order: expected 'official' or 'vllm'"):
            f(*args, **kw, norm_order="other")  # type: ignore[operator]
    hargs, hkw = _opt_inputs("hc_post_head", 2, 4, 64, torch.float32, device, seed=0)
    with pytest.raises(InputError, match="norm_weight: expected"):
        opt.hc_post_head(*hargs, **hkw, norm_weight=torch.ones(64, dtype=torch.int32))


def test_reference_trailing_norm_is_rms_norm_after_the_op() -> None:
    from dsv4mtp.reference import hc_post_head, hc_post_pre, rms_norm

    ops = {"hc_pre": hc_pre, "hc_head": hc_head, "hc_post_pre": hc_post_pre,
           "hc_post_head": hc_post_head}  # fmt: skip
    for op, f in ops.items():
        args, kw = op_inputs(op, 6, 32, 5, n=4, dtype=F64, device="cpu")
        w = _norm_weight(32, F64, "cpu", seed=1)
        plain = f(*args, **kw)
        plain = plain if isinstance(plain, tuple) else (plain,)
        got = f(*args, **kw, norm_weight=w, norm_order="vllm")
        got = got if isinstance(got, tuple) else (got,)
        k = _NORMED[op]
        assert torch.equal(got[k], rms_norm(plain[k], w, EPS, order="vllm"))
