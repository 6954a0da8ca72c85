"""RMSNorm: properties of the reference, then tests of the optimized kernel beyond the generated
op contract (conformance/test_contract.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsv4mtp.optimized as opt
from dsv4mtp.conformance.inputs import norm_inputs
from dsv4mtp.reference import InputError, rms_norm

F64 = torch.float64


def test_rms_norm_constant_row_known_answer() -> None:
    """A constant row c has mean square c^2: y = w c / sqrt(c^2 + eps)."""
    c, eps = 3.0, 1e-6
    x = torch.full((2, 8), c, dtype=F64)
    w = torch.linspace(0.5, 2.0, 8, dtype=F64)
    expect = w * c / (c * c + eps) ** 0.5
    assert torch.allclose(rms_norm(x, w, eps), expect.expand(2, 8), rtol=1e-15, atol=0)


@given(seed=st.integers(0, 2**31 - 1), a=st.floats(1.0, 1e3))
def test_rms_norm_scale_invariant(seed: int, a: float) -> None:
    """rms_norm(a x) = rms_norm(x) for a >= 1 up to eps / (2 ms(x)) ~ 1e-6 relative (ms of 64
    standard normals stays above ~0.4); below a = 1 eps starts to matter, by design."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed), dtype=F64)
    w = torch.ones(64, dtype=F64)
    assert torch.allclose(rms_norm(a * x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-8)


def test_rms_norm_orders_agree_in_float64_differ_in_bf16() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g, dtype=F64), torch.randn(256, generator=g, dtype=F64)
    assert torch.equal(rms_norm(x, w, 1e-6, order="official"), rms_norm(x, w, 1e-6, order="vllm"))
    xb, wb = x.bfloat16(), w.bfloat16()
    a, b = rms_norm(xb, wb, 1e-6, order="official"), rms_norm(xb, wb, 1e-6, order="vllm")
    # vLLM's order rounds twice; the official once.  They must differ somewhere (else the switch
    # would be untested), and only by about a bf16 ulp.
    assert not torch.equal(a, b)
    assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) < 2**-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_rms_norm_dtype_and_empty(dtype: torch.dtype) -> None:
    for T in (0, 1, 5):
        y = rms_norm(torch.randn(T, 16).to(dtype), torch.ones(16), 1e-6)
        assert (y.shape, y.dtype) == ((T, 16), dtype)
    assert rms_norm(torch.randn(3, 16).to(dtype), None, 1e-6).dtype == dtype


def test_rms_norm_zero_row_is_zero() -> None:
    assert torch.equal(rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6), torch.zeros(2, 8))


def test_rms_norm_rejects_bad_input() -> None:
    with pytest.raises(InputError, match=r"weight: expected shape \(16,\)"):
        rms_norm(torch.randn(2, 16), torch.ones(8), 1e-6)
    with pytest.raises(InputError, match="x: expected dtype"):
        rms_norm(torch.ones(2, 16, dtype=torch.int64), torch.ones(16), 1e-6)
    with pytest.raises(InputError, match="order"):
        rms_norm(torch.randn(2, 16), torch.ones(16), 1e-6, order="other")  # type: ignore[arg-type]


# ---- optimized-specific tests ----
# dsv4mtp.optimized.rms_norm beyond the generated contract (conformance/test_contract.py:
# differential in both orders, T = 0, out=, batch invariance, graph replay, typed error for every
# backend): FlashInfer vs Triton agreement, no weight, any leading shape, validation.


def _norm_inputs(T: int, D: int, dtype: torch.dtype, device: str, seed: int):
    (x, w), _ = norm_inputs(T, D, dtype, device, seed)
    return x, w


@pytest.mark.gpu
@pytest.mark.parametrize("D", [512, 4096, 7168])
def test_optimized_rms_norm_flashinfer_matches_triton(D: int) -> None:
    """Both round once from fp32 with the weight applied in fp32: at most one bf16 ulp apart
    (different reduction trees move the fp32 statistic by a few fp32 ulps)."""
    x, w = _norm_inputs(1000, D, torch.bfloat16, "cuda", seed=D)
    fi = opt.rms_norm(x, w, 1e-6, backend="flashinfer").double()
    tr = opt.rms_norm(x, w, 1e-6, backend="triton").double()
    spacing = torch.exp2(torch.floor(torch.log2(tr.abs().clamp_min(2.0**-126))) - 7)
    assert float(((fi - tr).abs() / spacing).max()) <= 1.0


def test_optimized_rms_norm_vllm_order_and_no_weight(device: str) -> None:
    """order='vllm' and weight=None run the Triton kernel: within one bf16 ulp of the bf16
    reference (same roundings in the same order; only the fp32 statistic's summation differs)."""
    x, w = _norm_inputs(9, 256, torch.bfloat16, device, seed=3)
    for order in ("official", "vllm"):
        got = opt.rms_norm(x, w, 1e-6, order=order, backend="triton")
        ref = rms_norm(x.cpu(), w.cpu(), 1e-6, order=order)
        diff = (got.cpu().double() - ref.double()).abs().max()
        assert float(diff) <= float(ref.double().abs().max()) * 2**-7, order
    got = opt.rms_norm(x.float(), None, 1e-6)
    ref = rms_norm(x.float().cpu(), None, 1e-6)
    assert torch.allclose(got.cpu(), ref, rtol=1e-6, atol=1e-6)
    y3 = opt.rms_norm(x.view(3, 3, 256), w, 1e-6)  # any leading shape
    assert y3.shape == (3, 3, 256)


def test_optimized_rms_norm_rejects_bad_input(device: str) -> None:
    x, w = _norm_inputs(2, 64, torch.float32, device, seed=0)
    for bad in (torch.float64, torch.float16):
        with pytest.raises(InputError, match=r"x: expected dtype .*dsv4mtp.reference"):
            opt.rms_norm(x.to(bad), w, 1e-6)
    with pytest.raises(InputError, match=r"weight: expected shape \(64,\)"):
        opt.rms_norm(x, w[:5], 1e-6)
    with pytest.raises(InputError, match=r"out: expected shape \(2, 64\)"):
        opt.rms_norm(x, w, 1e-6, out=torch.empty(2, 65, device=device))
    with pytest.raises(InputError, match="out: expected dtype float32"):
        opt.rms_norm(x, w, 1e-6, out=torch.empty(2, 64, dtype=torch.bfloat16, device=device))
    with pytest.raises(InputError, match="order"):
        opt.rms_norm(x, w, 1e-6, order="other")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="flashinfer"):  # fp32 has no FlashInfer path
        opt.rms_norm(x, w, 1e-6, backend="flashinfer")
    buf = torch.full_like(x, float("nan"))
    assert opt.rms_norm(x, w, 1e-6, out=buf).data_ptr() == buf.data_ptr()
    assert not bool(torch.isnan(buf).any())
