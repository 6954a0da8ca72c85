"""Every optimized op, declared once: strategy for valid inputs and tolerance per dtype and preset.

Inputs come from the one builder, ``conformance/inputs.py`` (the GPU tests and bench/ use it
too); the strategies draw its arguments (T, n, D, seed, magnitude, zero rows).  On CPU the
optimized Triton kernels run in the interpreter, so D stays small; on CUDA the strategies draw
the real V4 widths (D 4096 / 7168) and T up to ``max_tokens``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from hypothesis import strategies as st

from dsv4mtp.conformance.inputs import op_inputs
from dsv4mtp.conformance.registry import Case, OpPair, Tolerance, register
from dsv4mtp.optimized._dispatch import Facts

BF16, FP32 = torch.bfloat16, torch.float32

# --------------------------------------------------------------------------- input drawing

# Token counts that matter: empty, single, odd, and (on GPU) large.
_CPU_T = st.one_of(st.sampled_from([0, 1, 2, 3, 7]), st.integers(0, 33))


def _tokens(device: str, max_tokens: int) -> st.SearchStrategy[int]:
    if device == "cpu":
        return _CPU_T
    return st.one_of(st.sampled_from([0, 1, 7, 64, 513]), st.integers(0, max_tokens))


def _hidden(device: str) -> st.SearchStrategy[int]:
    return st.sampled_from([64, 128, 256]) if device == "cpu" else st.sampled_from([4096, 7168])


@st.composite
def _drawn(draw: Any, op: str, dtype: torch.dtype, device: str, T: int, n: int, D: int) -> Case:
    """The builder's call at a drawn seed and activation magnitude, some rows zero or none."""
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 30.0, 1e3]))
    zero_rows = 0.25 if draw(st.booleans()) else 0.0
    args, kw = op_inputs(
        op, T, D, seed, n=n, dtype=dtype, device=device, magnitude=magnitude, zero_rows=zero_rows
    )
    label = f"T={T} D={D}" if op == "rms_norm" else f"T={T} n={n} D={D}"
    return Case(args, kw, label=f"{label} seed={seed} magnitude={magnitude:g}")


def _build(op: str, T: int, D: int, dtype: torch.dtype, device: str, seed: int):
    return op_inputs(op, T, D, seed, dtype=dtype, device=device)


# --------------------------------------------------------------------------- rms_norm
@st.composite
def rms_norm_case(draw: Any, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    T = draw(_tokens(device, max_tokens))
    D = draw(
        st.sampled_from([64, 128, 256, 512])
        if device == "cpu"
        else st.sampled_from([512, 1024, 4096, 7168])
    )
    return draw(_drawn("rms_norm", dtype, device, T, 1, D))


def _norm_facts(case: Case) -> Facts:
    x, w = case.args[:2]
    eps = case.kwargs.get("eps", case.args[2] if len(case.args) > 2 else None)
    return Facts(
        x.device,
        (x.dtype,) if w is None else (x.dtype, w.dtype),
        eps=(eps,),
        order=case.kwargs.get("order", "official"),
        has_weight=w is not None,
    )


# One rounding of the bf16 output: <= 2^-9 relative per element (half an ulp); the fp32
# statistics differ from float64 by ~1e-7.  vLLM's order rounds twice (x * rsqrt to bf16, then
# times the bf16 weight): one more half ulp.
_NORM_BF16 = Tolerance(4e-3, 8e-3, "bf16 output: half a bf16 ulp (2^-9) per element")
_NORM_BF16_VLLM = Tolerance(
    6e-3, 1.6e-2, "vllm order: two bf16 roundings (normalized x, then times the weight)"
)
# fp32 output, different reduction order: a few fp32 ulps (in either order).
_NORM_FP32 = Tolerance(2e-6, 1e-5, "fp32 output: reduction-order rounding only")

register(
    OpPair(
        name="rms_norm",
        concept="norm",
        strategy=rms_norm_case,
        build=partial(_build, "rms_norm"),
        facts=_norm_facts,
        switches=lambda s: {"order": s.norm_order},
        tolerances={
            (BF16, "math"): _NORM_BF16,
            (FP32, "math"): _NORM_FP32,
            (BF16, "vllm"): _NORM_BF16_VLLM,
            (FP32, "vllm"): _NORM_FP32,
        },
    )
)


# --------------------------------------------------------------------------- mHC
def _streams_case(op: str):
    @st.composite
    def case(draw: Any, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
        T = draw(_tokens(device, max_tokens))
        n = draw(st.sampled_from([4, 4, 4, 2, 3])) if device == "cpu" else 4
        return draw(_drawn(op, dtype, device, T, n, draw(_hidden(device))))

    case.__name__ = f"{op}_case"
    return case


def _streams_facts(case: Case) -> Facts:
    """hc_pre / hc_head: x (T, n, D) and the two eps."""
    x = case.args[0]
    _, n, D = x.shape
    eps = (case.kwargs["rms_norm_eps"], case.kwargs["hc_eps"])
    return Facts(x.device, (x.dtype,), n=n, D=D, eps=eps)


def _post_facts(case: Case) -> Facts:
    f, residual = case.args[:2]
    _, n, D = residual.shape
    return Facts(residual.device, (f.dtype, residual.dtype), n=n, D=D)


# bf16 outputs are judged on a bf16-ulp scale: one rounding of the result (2^-9 relative) plus
# fp32 accumulation-order noise; the gate/mix path may use TF32 (10-bit mantissa, ~5e-4 relative
# per product, ~1e-3 on the mix), which moves gates by < 1e-3 relative.
_BF16_OUT = Tolerance(6e-3, 1.6e-2, "bf16 output (2^-9 per rounding) + TF32 gate mix (~1e-3)")
_TF32_MIX = Tolerance(3e-3, 6e-3, "fp32 outputs behind a TF32 mix GEMM: ~1e-3 relative on the mix")

register(
    OpPair(
        name="hc_pre",
        concept="mhc",
        strategy=_streams_case("hc_pre"),
        build=partial(_build, "hc_pre"),
        facts=_streams_facts,
        outputs=("layer_input", "post", "comb"),
        tolerances={(BF16, "math"): _BF16_OUT, (FP32, "math"): _TF32_MIX},
    )
)
register(
    OpPair(
        name="hc_post",
        concept="mhc",
        strategy=_streams_case("hc_post"),
        build=partial(_build, "hc_post"),
        facts=_post_facts,
        tolerances={
            (BF16, "math"): Tolerance(
                4e-3, 8e-3, "bf16 output: one rounding (2^-9) of an fp32 sum"
            ),
            (FP32, "math"): Tolerance(2e-6, 1e-5, "fp32: five-term sums in a different order"),
        },
    )
)
register(
    OpPair(
        name="hc_head",
        concept="mhc",
        strategy=_streams_case("hc_head"),
        build=partial(_build, "hc_head"),
        facts=_streams_facts,
        tolerances={(BF16, "math"): _BF16_OUT, (FP32, "math"): _TF32_MIX},
    )
)
