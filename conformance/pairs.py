"""Every optimized op, declared once: strategy for valid inputs and tolerance per dtype (why).

Shapes: on CPU the optimized Triton kernels run in the interpreter, so D stays small; on CUDA the
strategies draw the real V4 widths (D 4096 / 7168) and T up to ``max_tokens``.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from dsv4mtp.conformance.registry import Case, OpPair, Tolerance, register

# --------------------------------------------------------------------------- input building

# Token counts that matter: empty, single, odd, and (on GPU) large.
_CPU_T = st.one_of(st.sampled_from([0, 1, 2, 3, 7]), st.integers(0, 33))


def _tokens(device: str, max_tokens: int) -> st.SearchStrategy[int]:
    if device == "cpu":
        return _CPU_T
    return st.one_of(st.sampled_from([0, 1, 7, 64, 513]), st.integers(0, max_tokens))


def _hidden(device: str) -> st.SearchStrategy[int]:
    return st.sampled_from([64, 128, 256]) if device == "cpu" else st.sampled_from([4096, 7168])


@st.composite
def _activations(draw, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Gaussian activations at a drawn magnitude, with some all-zero rows."""
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 30.0, 1e3]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32) * magnitude
    if shape[0] > 0 and draw(st.booleans()):
        rows = torch.rand(shape[0], generator=g) < 0.25
        x[rows] = 0
    return x.to(dtype).to(device)


def _params(
    shape: tuple[int, ...], std: float, seed: int, device: str, mean: float = 0.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * std + mean).to(device)


# --------------------------------------------------------------------------- rms_norm
@st.composite
def rms_norm_case(draw, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    T = draw(_tokens(device, max_tokens))
    D = draw(
        st.sampled_from([64, 128, 256, 512])
        if device == "cpu"
        else st.sampled_from([512, 1024, 4096, 7168])
    )
    x = draw(_activations((T, D), dtype, device))
    seed = draw(st.integers(0, 2**31 - 1))
    w = _params((D,), 0.5, seed, device, mean=1.0).to(dtype)
    return Case((x, w, 1e-6), label=f"T={T} D={D}")


register(
    OpPair(
        name="rms_norm",
        concept="norm",
        strategy=rms_norm_case,
        tolerances={
            # One rounding of the bf16 output: <= 2^-9 relative per element (half an ulp);
            # the fp32 statistics differ from float64 by ~1e-7.
            torch.bfloat16: Tolerance(
                4e-3, 8e-3, "bf16 output: half a bf16 ulp (2^-9) per element"
            ),
            # fp32 output, different reduction order: a few fp32 ulps.
            torch.float32: Tolerance(2e-6, 1e-5, "fp32 output: reduction-order rounding only"),
        },
    )
)


# --------------------------------------------------------------------------- mHC
@st.composite
def _streams_case(draw, dtype: torch.dtype, device: str, max_tokens: int, rows_fn):
    T = draw(_tokens(device, max_tokens))
    n = draw(st.sampled_from([4, 4, 4, 2, 3])) if device == "cpu" else 4
    D = draw(_hidden(device))
    x = draw(_activations((T, n, D), dtype, device))
    seed = draw(st.integers(0, 2**31 - 1))
    M = rows_fn(n)
    fn = _params((M, n * D), 0.02, seed, device)  # spec 12.3: hc fn ~ N(0, 0.02^2), fp32
    base = _params((M,), 0.5, seed + 1, device)
    return T, n, D, x, fn, base, seed


@st.composite
def hc_pre_case(draw, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    T, n, D, x, fn, base, seed = draw(
        _streams_case(dtype, device, max_tokens, lambda n: (2 + n) * n)
    )
    scale = _params((3,), 0.3, seed + 2, device, mean=1.0)
    kw = dict(rms_norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, post_mult=2.0)
    return Case((x, fn, scale, base), kw, label=f"T={T} n={n} D={D}")


@st.composite
def hc_post_case(draw, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    T, n, D, residual, _, _, seed = draw(_streams_case(dtype, device, max_tokens, lambda n: n))
    f = draw(_activations((T, D), dtype, device))
    g = torch.Generator().manual_seed(seed + 3)
    post = (2 * torch.rand(T, n, generator=g)).to(device)  # 2 * sigmoid(.) in (0, 2)
    comb = torch.softmax(torch.randn(T, n, n, generator=g), dim=-2).to(device)  # columns sum to 1
    return Case((f, residual, post, comb), label=f"T={T} n={n} D={D}")


@st.composite
def hc_head_case(draw, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    T, n, D, x, fn, base, seed = draw(_streams_case(dtype, device, max_tokens, lambda n: n))
    scale = _params((1,), 0.3, seed + 2, device, mean=1.0)
    return Case(
        (x, fn, scale, base), dict(rms_norm_eps=1e-6, hc_eps=1e-6), label=f"T={T} n={n} D={D}"
    )


# bf16 outputs are judged on a bf16-ulp scale: one rounding of the result (2^-9 relative) plus
# fp32 accumulation-order noise; the gate/mix path may use TF32 (10-bit mantissa, ~5e-4 relative
# per product, ~1e-3 on the mix), which moves gates by < 1e-3 relative.
_BF16_OUT = Tolerance(6e-3, 1.6e-2, "bf16 output (2^-9 per rounding) + TF32 gate mix (~1e-3)")
_TF32_MIX = Tolerance(3e-3, 6e-3, "fp32 outputs behind a TF32 mix GEMM: ~1e-3 relative on the mix")

register(
    OpPair(
        name="hc_pre",
        concept="mhc",
        strategy=hc_pre_case,
        outputs=("layer_input", "post", "comb"),
        tolerances={torch.bfloat16: _BF16_OUT, torch.float32: _TF32_MIX},
    )
)
register(
    OpPair(
        name="hc_post",
        concept="mhc",
        strategy=hc_post_case,
        tolerances={
            torch.bfloat16: Tolerance(
                4e-3, 8e-3, "bf16 output: one rounding (2^-9) of an fp32 sum"
            ),
            torch.float32: Tolerance(2e-6, 1e-5, "fp32: five-term sums in a different order"),
        },
    )
)
register(
    OpPair(
        name="hc_head",
        concept="mhc",
        strategy=hc_head_case,
        tolerances={torch.bfloat16: _BF16_OUT, torch.float32: _TF32_MIX},
    )
)
