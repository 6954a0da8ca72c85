"""mHC and hc_head: properties of the reference, then optimized-vs-reference differential tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.differential import make_differential_test
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


# ------------------------------------------------------------------------------ differential
test_differential = make_differential_test("mhc")
