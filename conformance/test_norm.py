"""RMSNorm: properties of the reference, then optimized-vs-reference differential tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.differential import make_differential_test
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


# ------------------------------------------------------------------------------ differential
test_differential = make_differential_test("norm")
