"""Every optimized op, declared once: strategy for valid inputs and tolerance per dtype and preset.

Inputs come from the one builder, ``conformance/inputs.py`` (the GPU tests and bench/ use it
too); the strategies draw its arguments (T, n, D, seed, magnitude, zero rows).  On CPU the
optimized Triton kernels run in the interpreter, so D stays small; on CUDA the strategies draw
the real V4 widths (D 4096 / 7168) and T up to ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from dsv4mtp.conformance.contract import MAX_TOKENS
from dsv4mtp.conformance.inputs import evict_oldest, op_inputs
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

_NORM_TOLERANCES = {
    (BF16, "math"): _NORM_BF16,
    (FP32, "math"): _NORM_FP32,
    (BF16, "vllm"): _NORM_BF16_VLLM,
    (FP32, "vllm"): _NORM_FP32,
}

register(
    OpPair(
        name="rms_norm",
        concept="norm",
        strategy=rms_norm_case,
        build=partial(_build, "rms_norm"),
        facts=_norm_facts,
        switches=lambda s: {"order": s.norm_order},
        tolerances=_NORM_TOLERANCES,
    )
)


# --------------------------------------------------------------------------- embed_norms
@st.composite
def embed_norms_case(draw: Any, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    T = draw(_tokens(device, max_tokens))
    n = draw(st.sampled_from([4, 4, 1, 3]))
    return draw(_drawn("embed_norms", dtype, device, T, n, draw(_hidden(device))))


def _embed_facts(case: Case) -> Facts:
    ids, _, embed, prev = case.args[:4]
    return Facts(ids.device, (embed.dtype, prev.dtype), n=prev.shape[1], D=embed.shape[1])


# Each output row is one rms_norm row (the gathered, maybe zeroed, embedding row or one hidden
# row) computed by rms_norm's Triton row body: rms_norm's bounds and their reasons apply as
# they are.  The vllm preset turns mask_pos0 on as well as its norm order.
register(
    OpPair(
        name="embed_norms",
        concept="norm",
        strategy=embed_norms_case,
        build=partial(_build, "embed_norms"),
        facts=_embed_facts,
        switches=lambda s: {"order": s.norm_order, "mask_pos0": s.mask_pos0},
        outputs=("e", "h"),
        tolerances=_NORM_TOLERANCES,
    )
)


# --------------------------------------------------------------------------- mHC
#: The ops that end in the next RMSNorm when given its weight (``norm_weight``, ``norm_order``).
_NORM_ENDED = ("hc_pre", "hc_head", "hc_post_pre", "hc_post_head")


def _streams_case(op: str):
    @st.composite
    def case(draw: Any, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
        T = draw(_tokens(device, max_tokens))
        n = draw(st.sampled_from([4, 4, 4, 2, 3])) if device == "cpu" else 4
        D = draw(_hidden(device))
        drawn = draw(_drawn(op, dtype, device, T, n, D))
        if op in _NORM_ENDED and draw(st.booleans()):
            # half the cases end in the norm: its weight N(1, 0.3^2) in bf16 or fp32
            g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
            w_dtype = draw(st.sampled_from([BF16, FP32]))
            w = (1.0 + 0.3 * torch.randn(D, generator=g)).to(w_dtype).to(device)
            order = draw(st.sampled_from(["official", "vllm"]))
            drawn.kwargs.update(norm_weight=w, norm_order=order)
            drawn.label += f" norm={order}/{str(w_dtype).removeprefix('torch.')}"
        return drawn

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
# per product, ~1e-3 on the mix), which moves gates by < 1e-3 relative.  A case that ends in the
# next RMSNorm (half of hc_pre's, hc_head's and the fused pairs') compares the normalized rows:
# the norm divides out the rows' scale, so their relative error carries through unchanged, plus
# the norm's own rounding (two in the vllm order, within the same ~3 half ulps the bounds allow).
_BF16_OUT = Tolerance(6e-3, 1.6e-2, "bf16 output (2^-9 per rounding) + TF32 gate mix (~1e-3)")
_TF32_MIX = Tolerance(3e-3, 6e-3, "fp32 outputs behind a TF32 mix GEMM: ~1e-3 relative on the mix")
# hc_pre and hc_head run their mix and Sinkhorn kernels under the interpreter at ~0.3-0.8 s a
# case: 12 drawn cases per test on the CPU (the GPU tier draws the profile's 40), beside the
# fixed-shape and property tests of test_mhc.py; the CPU tier has 20 minutes for everything.
_MHC_CPU_EXAMPLES = 12

register(
    OpPair(
        name="hc_pre",
        concept="mhc",
        cpu_examples=_MHC_CPU_EXAMPLES,
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
        cpu_examples=_MHC_CPU_EXAMPLES,
        strategy=_streams_case("hc_head"),
        build=partial(_build, "hc_head"),
        facts=_streams_facts,
        tolerances={(BF16, "math"): _BF16_OUT, (FP32, "math"): _TF32_MIX},
    )
)


def _fused_facts(case: Case) -> Facts:
    """hc_post_pre / hc_post_head: the sublayer output and the streams, the two eps."""
    f, x = case.args[:2]
    _, n, D = x.shape
    eps = (case.kwargs["rms_norm_eps"], case.kwargs["hc_eps"])
    return Facts(x.device, (f.dtype, x.dtype), n=n, D=D, eps=eps)


# The fused pairs compute hc_post then hc_pre / hc_head.  x_new is hc_post's output (one
# rounding: within hc_post's bounds, which the looser hc_pre / hc_head bounds contain); the
# second op reads x_new rounded to x.dtype where the float64 oracle reads it exact, an input
# error of half an ulp per element (2^-9 in bf16, 2^-24 in fp32) that the weighted sum and the
# mix carry through at most at that size: the second op's own rounding plus this one stays
# within hc_pre's / hc_head's bf16 bound (6e-3 / 1.6e-2 allow about three half ulps), and in
# fp32 it is far below the mix's ~1e-3 bound.  So hc_pre's / hc_head's tolerances serve.
# On the CPU 12 examples per test: each pair is also checked bitwise against the composition of
# the two ops (test_mhc.py), whose own contract tests draw more.
for _name in ("hc_post_pre", "hc_post_head"):
    register(
        OpPair(
            name=_name,
            concept="mhc",
            cpu_examples=12,
            strategy=_streams_case(_name),
            build=partial(_build, _name),
            facts=_fused_facts,
            outputs=(
                ("x_new", "layer_input", "post", "comb")
                if _name == "hc_post_pre"
                else ("x_new", "head_input")
            ),
            tolerances={
                (BF16, "math"): replace(
                    _BF16_OUT, why=_BF16_OUT.why + "; x_new rounded to bf16 before the second op"
                ),
                (FP32, "math"): _TF32_MIX,
            },
        )
    )


# --------------------------------------------------------------------------- MoE
# Inputs: conformance/inputs.py, moe_inputs (shapes, formats, skews, magnitudes there).  On CPU
# the tiny shape (E 8, top-2, I 128, D 256) with few examples: the Triton kernels run in the
# interpreter and the CPU tier's MoE budget is 3 minutes.  On CUDA the reduced shape (E 64,
# top-6, I 512, D 1024) with T up to 512; full V4-Flash / V4-Pro shapes run in the contract's
# graph and batch-invariance tests (D 4096 / 7168) and in test_moe_gpu.py's fixed cases.

#: Router near-tie: the reference's K-th and (K+1)-th biased scores closer than this.  The
#: scores are O(1) (sqrt(softplus) of N(0, 1) logits, bias N(0, 0.1^2), or +-100 under a skew);
#: an fp32 logit over D <= 7168 products of O(1/sqrt(D)) terms is off by well under 1e-6, so a
#: selection that differs from float64's at a gap above 2e-5 is a bug (a TF32 logit, ~1e-3, is
#: caught), and below it is excused: only that row is left out of the comparison.
ROUTE_SCORE_TOL = 2e-5


def _near_ties(x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor, k: int):
    """(T,) bool on CPU: rows whose reference top-k boundary is a near-tie."""
    logits = x.double().cpu() @ gate_weight.double().cpu().T  # (T, E)
    biased = torch.sqrt(F.softplus(logits)) + gate_bias.double().cpu()
    if biased.shape[1] <= k:
        return torch.zeros(x.shape[0], dtype=torch.bool)
    top = biased.topk(k + 1, dim=-1).values  # (T, K + 1) descending
    return (top[:, k - 1] - top[:, k]) <= ROUTE_SCORE_TOL


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (weights, ids) ordered by id, on CPU: the selection as a set."""
    ids = ids.long().cpu()
    order = ids.argsort(-1)
    return weights.cpu().gather(1, order), ids.gather(1, order)


def _route_canonical(case: Case, got: tuple, oracle: tuple):
    x, gate_weight, gate_bias, config = case.args[:4]
    near = _near_ties(x, gate_weight, gate_bias, config.num_experts_per_tok)
    gw, gi = _by_id(*got)
    ow, oi = _by_id(*oracle)
    keep = (gi == oi).all(-1) | ~near  # a different set is excused only at a near-tie
    note = f"{int((~keep).sum())} of {len(keep)} rows excused at a router near-tie"
    return (gw[keep], gi[keep]), (ow[keep], oi[keep]), note


def _moe_canonical(case: Case, got: tuple, oracle: tuple):
    x, params, config = case.args[:3]
    near = _near_ties(x, params.gate_weight, params.gate_bias, config.num_experts_per_tok)
    keep = ~near  # which experts the optimized router picked there is not observable
    note = f"{int(near.sum())} of {len(keep)} rows excused at a router near-tie"
    return (got[0].cpu()[keep],), (oracle[0].cpu()[keep],), note


# The optimized fused_experts takes the packed experts (pack_moe's MoEPack), the reference the
# core's ExpertSource: pack each source once (keyed by identity; the source is kept alive with
# its pack, and moe_inputs caches sources, so the contract's many calls share one pack).  A
# full-size stack (V4-Flash: 2.1 G weights per matrix; with its pack and expert-parallel half
# 10-40 GB) is kept alone, as moe_inputs keeps its own full-size sources: an entry held here
# keeps its source alive after moe_inputs dropped it, and five of them filled the H200.
_PACKS: dict[int, tuple[Any, Any]] = {}
_FULL_SIZE_WEIGHTS = 1 << 28  # E * I * D from which a stack counts as full size


def _packed_experts(args: tuple[Any, ...], kwargs: dict[str, Any]):
    from dsv4mtp.optimized import pack_moe  # type: ignore[attr-defined]
    from dsv4mtp.params import MoEParams

    x, experts = args[0], args[1]
    if id(experts) not in _PACKS:
        w1 = experts(0, torch.float32)[0]  # (I, D): the shapes only
        (I, D), E = w1.shape, experts.num_experts
        dev = x.device
        zeros = partial(torch.zeros, dtype=torch.bfloat16, device=dev)
        # Router and shared expert are not used by fused_experts: zeros of the right shapes.
        params = MoEParams(
            torch.zeros(E, D, device=dev), torch.zeros(E, device=dev),
            zeros(I, D), zeros(I, D), zeros(D, I), experts=experts,
        )  # fmt: skip
        evict_oldest(_PACKS, 16, E * I * D >= _FULL_SIZE_WEIGHTS)
        _PACKS[id(experts)] = (experts, pack_moe(params, dev, max_tokens=MAX_TOKENS["cuda"]))
    return (x, _PACKS[id(experts)][1], *args[2:]), kwargs


def _moe_shape(device: str) -> st.SearchStrategy[str]:
    return st.just("tiny") if device == "cpu" else st.just("reduced")


def _moe_tokens(device: str, max_tokens: int) -> st.SearchStrategy[int]:
    if device == "cpu":
        return st.one_of(st.sampled_from([0, 1, 5]), st.integers(0, 12))
    return st.one_of(st.sampled_from([0, 1, 64, 512]), st.integers(0, min(512, max_tokens)))


@st.composite
def _moe_case(draw: Any, op: str, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    from dsv4mtp.conformance.inputs import EXPERT_FORMATS, SKEWS, moe_inputs

    T = draw(_moe_tokens(device, max_tokens))
    shape = draw(_moe_shape(device))
    fmt = "mxfp4" if op == "route" else draw(st.sampled_from(EXPERT_FORMATS))
    skew = draw(st.sampled_from(SKEWS if op == "fused_experts" else SKEWS[:3]))
    magnitude = draw(st.sampled_from([1.0, 8.0]))  # 8: many gate/up values past swiglu_limit
    seed = draw(st.integers(0, 2**31 - 1))
    extra: dict[str, Any] = {}
    if op == "fused_experts":
        extra = dict(padding=draw(st.sampled_from([0.0, 0.25])), ep=draw(st.booleans()))
    args, kw = moe_inputs(
        op, T, seed, shape=shape, fmt=fmt, dtype=dtype, device=device, skew=skew,
        magnitude=magnitude, **extra,
    )  # fmt: skip
    flags = "".join(f" {k}={v}" for k, v in extra.items())
    label = f"T={T} {shape} {fmt} skew={skew} magnitude={magnitude:g}{flags} seed={seed}"
    return Case(args, kw, label=label)


def _moe_facts(case: Case) -> Facts:
    x = case.args[0]
    return Facts(x.device, (x.dtype,), D=x.shape[-1])


_MOE_COMMON: dict[str, Any] = dict(concept="moe", facts=_moe_facts, cpu_D=256)

# route: the weights are fp32 from fp32 logits; each is sigma_e / sum sigma * rho, a few fp32
# roundings (~1e-7) plus the logit's own fp32 error (~1e-6 relative at D 7168).
_ROUTE = Tolerance(2e-5, 4e-5, "fp32 logits over D products and a K-term renormalisation")
register(
    OpPair(
        name="route",
        strategy=partial(_moe_case, "route"),
        build=partial(_build, "route"),
        outputs=("weights", "ids"),
        result_dtypes={"ids": torch.int32},
        canonical=_route_canonical,
        exact=("ids",),
        cpu_examples=10,
        tolerances={(BF16, "math"): _ROUTE, (FP32, "math"): _ROUTE},
        **_MOE_COMMON,
    )
)

# fused_experts / moe, bf16 activations.  math: the weights decode exactly (FP4: e2m1 x scale
# fits bf16; FP8 and the global scales go to the fp32 accumulator), so the error is bf16
# rounding: the output (2^-9), the hidden activation fed to w2 (2^-9), and where an
# implementation rounds gate/up to bf16 (the reference does) 2^-9 more before the SwiGLU.
# Measured for the reference in bf16 against float64 on these inputs (every format and skew,
# magnitudes 1 and 8, T 33 tiny / T 64 reduced): rel <= 4.1e-3, scaled max-abs <= 8.5e-3.
_EXPERTS_MATH = Tolerance(
    1e-2, 2.5e-2, "bf16 output, hidden and gate/up roundings (2^-9 each); 2.5x the reference's own"
)
# official (act_quant): the expert inputs are rounded to e4m3 in 1x128 blocks.  x's rounding is
# the same in every implementation (same bf16 x, same power-of-two scale rule), but the hidden
# activation before w2 is computed in another order and precision than float64's, so a few %
# of its elements (2 x 2^-9 relative perturbation / 2^-3 e4m3 step ~ 3 %) land on the other
# side of an e4m3 rounding boundary and move by one e4m3 step (6-12 % of the element).  Each
# flip feeds a whole output row through w2, so it shows up as norm error, not elementwise
# (step_flips stays 0): rel ~ sqrt(3 %) x 9 % ~ 1.6e-2.  Measured for the reference in bf16:
# rel <= 2.4e-2, scaled max-abs <= 8.9e-2 at T 33 (bf16 experts: no act_quant, as math).  With
# few rows the flip count is a small random sample and the error heavy-tailed: over 2377 CPU-tier
# draws (tiny, T <= 12, every quantized format and skew) the reference in bf16 itself reached
# rel 1.3e-2 / 4.0e-2 / 6.5e-2 / 7.3e-2 (median / p99 / p99.9 / max), scaled max-abs 0.11.  So
# an output also passes within 2x the reference-in-bf16's own errors on the same case
# (own_factor; registry docstring): the Triton kernel under the interpreter matched the
# reference in bf16 within 0.1 % of rel on 600 such draws, 550 of them bitwise.
_EXPERTS_OFFICIAL = Tolerance(
    5e-2,
    0.2,
    "e4m3 flips of the hidden activation before w2 (~3 % of elements by one e4m3 step, "
    "spread over the row by w2): ~2x the reference-in-bf16's typical error, or 2x its own "
    "error on the case",
    own_factor=2.0,
)

register(
    OpPair(
        name="fused_experts",
        strategy=partial(_moe_case, "fused_experts"),
        build=partial(_build, "fused_experts"),
        switches=lambda s: {"act_quant": s.act_quant},
        optimized_args=_packed_experts,
        cpu_examples=4,
        tolerances={(BF16, "math"): _EXPERTS_MATH, (BF16, "official"): _EXPERTS_OFFICIAL},
        **_MOE_COMMON,
    )
)
register(
    OpPair(
        name="moe",
        strategy=partial(_moe_case, "moe"),
        build=partial(_build, "moe"),
        switches=lambda s: {"act_quant": s.act_quant, "shared_clamp": s.shared_clamp},
        canonical=_moe_canonical,
        cpu_examples=4,
        tolerances={(BF16, "math"): _EXPERTS_MATH, (BF16, "official"): _EXPERTS_OFFICIAL},
        **_MOE_COMMON,
    )
)


# --------------------------------------------------------------------------- attention
# Inputs: conformance/inputs.py, attention_inputs (a cache then each query's own key per
# sequence, position gaps).  On CPU the tiny / small shapes (H 4 / 8, Dh 64, window 8 / 16); on
# CUDA V4-Flash and V4-Pro (H 64 / 128, Dh 512, window 128) with up to 1024 queries (the float64
# reference gathers a (Tq, window, Dh) key tensor).
def _attention_shape(device: str) -> st.SearchStrategy[str]:
    return (
        st.sampled_from(["tiny", "small"]) if device == "cpu" else st.sampled_from(["flash", "pro"])
    )


@st.composite
def _attention_case(draw: Any, op: str, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    from dsv4mtp.conformance.inputs import ATTENTION_SHAPES, attention_inputs

    shape = draw(_attention_shape(device))
    W = ATTENTION_SHAPES[shape][2]
    cap = 3 * W if device == "cpu" else min(1024, max_tokens)
    cache = st.one_of(st.sampled_from([0, W - 1]), st.integers(0, 2 * W + 3))
    if op == "sink_attention":
        lens = [draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, cap)))]
    else:  # decode batches (one query each) or mixed prefill lengths
        B = draw(st.integers(1, 4))
        one = st.just(1) if draw(st.booleans()) else st.integers(0, cap // B)
        lens = [draw(one) for _ in range(B)]
    caches = [draw(cache) for _ in lens]
    gap = draw(st.sampled_from([0.0, 0.25, 0.9]))
    magnitude = draw(st.sampled_from([1.0, 0.1, 4.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    args, kw = attention_inputs(
        op, sum(lens), seed, shape=shape, dtype=dtype, device=device, lens=lens, caches=caches,
        gap=gap, magnitude=magnitude,
    )  # fmt: skip
    label = f"{shape} lens={lens} caches={caches} gap={gap} magnitude={magnitude:g} seed={seed}"
    return Case(args, kw, label=label)


def _attention_facts(case: Case) -> Facts:
    q, sink = case.args[0], case.args[4]
    return Facts(q.device, (q.dtype, sink.dtype))


# fp32: both compute in fp32; only the order of the sums over keys and Dh and exp2 of scores
# pre-multiplied by log2(e) differ from the float64 oracle: a few fp32 ulps (measured on the CPU
# tier's cases, 120 draws: rel <= 1.7e-7, scaled max-abs <= 4.3e-7).
_ATTN_FP32 = Tolerance(2e-6, 1e-5, "fp32 sums over keys and Dh in another order, exp2 vs exp")
# bf16: the inputs are exact in fp32, the scores and the softmax fp32, so the error is two bf16
# roundings: P before the PV dot (2^-9 per weight, as flash attention does) and the output
# (2^-9); each ~2^-9 / sqrt(3) rms, ~1.6e-3 rel together.  Measured on the CPU tier's cases
# (120 draws, the interpreter applies the same bf16 roundings): rel <= 2.1e-3, scaled max-abs
# <= 3.9e-3; the bounds leave ~3x.
_ATTN_BF16 = Tolerance(
    6e-3, 1.6e-2, "bf16 rounding of P before the PV dot and of the output (2^-9 each)"
)

for _op in ("sink_attention", "sink_attention_varlen"):
    register(
        OpPair(
            name=_op,
            concept="attention",
            strategy=partial(_attention_case, _op),
            build=partial(_build, _op),
            facts=_attention_facts,
            cpu_examples=12,
            tolerances={(BF16, "math"): _ATTN_BF16, (FP32, "math"): _ATTN_FP32},
        )
    )


# --------------------------------------------------------------------------- ring-cache decode
# Inputs: conformance/inputs.py, cache_attention_inputs (T decode queries against rings that
# have wrapped around, the dtype's max in never-written rows, padding rows, shared slots,
# queries before and after their ring's newest row).  Shapes as the attention core's: tiny /
# small on CPU, flash / pro on CUDA with up to 1024 queries (the reference gathers each query's
# ring on its own).
@st.composite
def _pool_case(draw: Any, inputs: str, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    """T decode queries against a device pool (``inputs``: the conformance.inputs builder of
    the ring cache or the paged pool)."""
    from dsv4mtp.conformance import inputs as builders

    shape = draw(_attention_shape(device))
    cap = 12 if device == "cpu" else min(1024, max_tokens)
    T = draw(st.one_of(st.sampled_from([0, 1, 4]), st.integers(0, cap)))
    gap = draw(st.sampled_from([0.0, 0.25, 0.9]))
    magnitude = draw(st.sampled_from([1.0, 0.1, 4.0]))
    pad = draw(st.sampled_from([0.0, 0.3]))
    seed = draw(st.integers(0, 2**31 - 1))
    args, kw = getattr(builders, inputs)(
        T, seed, shape=shape, dtype=dtype, device=device, gap=gap, magnitude=magnitude, pad=pad
    )
    label = f"{shape} T={T} gap={gap} magnitude={magnitude:g} pad={pad} seed={seed}"
    return Case(args, kw, label=label)


def _cache_facts(case: Case) -> Facts:
    q, sink = case.args[0], case.args[5]
    return Facts(q.device, (q.dtype, sink.dtype))


# The tolerances of the attention core, declared above: the ring-cache kernel runs the same
# key-block step (kernels/sink_attention.py, _rows_block) and sink merge over the same visible
# keys in position order, so it has the same two bf16 roundings (P, the output) and the same
# fp32 summation-order and exp2 differences from the float64 oracle.
register(
    OpPair(
        name="sink_attention_cache",
        concept="attention",
        strategy=partial(_pool_case, "cache_attention_inputs"),
        build=partial(_build, "sink_attention_cache"),
        facts=_cache_facts,
        cpu_examples=12,
        tolerances={(BF16, "math"): _ATTN_BF16, (FP32, "math"): _ATTN_FP32},
    )
)


# --------------------------------------------------------------------------- linear
# Inputs: conformance/inputs.py, linear_inputs: x and a checkpoint-format weight (the core's
# QuantizedWeight: FP8 with e8m0 or fp32 128x128 block scales, or bf16).  The reference
# dequantizes it into x's dtype (float64 for the oracle: the exact math on the stored codes and
# scales); the optimized op takes its pack_linear (below).  On CPU small shapes (K 256..512, N
# 128..384, 2-3 groups of 128, rows 0..70: one M block up to 64 rows, two past it); on CUDA
# V4-Flash's linears (e_proj, wq_a + wkv, wq_b, wo_b, the grouped wo_a) with up to 4096 rows.
_LINEAR_PACKS: dict[tuple[int, bool], tuple[Any, Any]] = {}


def _pack_once(weight: Any, device: torch.device, groups: int | None = None) -> Any:
    """The LinearPack of a QuantizedWeight, packed once per weight object (kept alive with its
    pack, so the id stays unique while cached)."""
    from dsv4mtp.optimized import pack_linear  # type: ignore[attr-defined]

    key = (id(weight), groups is not None)
    if key not in _LINEAR_PACKS:
        evict_oldest(_LINEAR_PACKS, 16, False)
        _LINEAR_PACKS[key] = (weight, pack_linear(weight, device, groups=groups))
    return _LINEAR_PACKS[key][1]


def _packed_linear(grouped: bool, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """(x, QuantizedWeight) -> (x, its LinearPack)."""
    x, weight = args[0], args[1]
    groups = x.shape[1] if grouped and x.dim() == 3 else None
    return (x, _pack_once(weight, x.device, groups), *args[2:]), kwargs


def _weight_draws(draw: Any) -> tuple[str, float, float, int]:
    """A linear case's weight format, input magnitude, zeroed-row fraction and seed."""
    from dsv4mtp.conformance.inputs import LINEAR_FORMATS

    fmt = draw(st.sampled_from(LINEAR_FORMATS))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 30.0]))
    zero_rows = 0.25 if draw(st.booleans()) else 0.0
    return fmt, magnitude, zero_rows, draw(st.integers(0, 2**31 - 1))


@st.composite
def _linear_case(draw: Any, op: str, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    from dsv4mtp.conformance.inputs import linear_inputs

    grouped = op == "grouped_linear"
    if device == "cpu":
        T = draw(st.one_of(st.sampled_from([0, 1, 2, 7, 65]), st.integers(0, 70)))
        K = draw(st.sampled_from([256, 384, 512]))
        dims = (draw(st.sampled_from([2, 3])), 128, K) if grouped else (
            0, draw(st.sampled_from([128, 192, 384])), K
        )  # fmt: skip
        shape: Any = dims
    else:
        T = draw(st.one_of(st.sampled_from([0, 1, 4, 64, 65, 513]), st.integers(0, 4096)))
        T = min(T, max_tokens)
        shape = "wo_a" if grouped else draw(st.sampled_from(["e_proj", "wqa_wkv", "wq_b", "wo_b"]))
    fmt, magnitude, zero_rows, seed = _weight_draws(draw)
    args, kw = linear_inputs(
        op, T, seed, shape=shape, fmt=fmt, dtype=dtype, device=device, magnitude=magnitude,
        zero_rows=zero_rows,
    )  # fmt: skip
    label = f"T={T} shape={shape} {fmt} magnitude={magnitude:g} zero_rows={zero_rows} seed={seed}"
    return Case(args, kw, label=label)


def _linear_facts(case: Case) -> Facts:
    x = case.args[0]
    return Facts(x.device, (x.dtype,))


# bf16 x: the output's one rounding (2^-9 relative per element) over fp32 sums; the FP8 kernel
# applies the fp32 block scale to each 128-wide fp32 partial, i.e. multiplies by the exact
# weight, where the reference layer multiplies by the weight rounded once to bf16 (identical
# for e8m0 scales, 2^-9 per weight for fp32 scales; the oracle is the exact weight).  From 256
# rows (CUDA tier only: the CPU tier draws at most 70; test_linear.py covers it on CPU) an
# e8m0-scaled pack runs cuBLAS on the exactly dequantized bf16 weight: the same bounds.
# Measured on the CPU tier's shapes (every format): rel <= 1.7e-3, scaled max-abs <= 3.5e-3.
_LINEAR_BF16 = Tolerance(
    4e-3, 8e-3, "bf16 output: one rounding (2^-9) of fp32 sums; exact weight (fp32 block scale)"
)
# fp32 x: fp32 products summed over K in another order than float64's, the block scale applied
# per 128-wide partial.  The rounding of a sum of K terms grows like sqrt(K) u, so the bound is
# set at the largest K drawn (wo_b, 8192; the CPU tier's K is 256-384).  Measured: CPU tier rel
# <= 2.1e-7, scaled max-abs <= 3.6e-7; H200 at the V4-Flash shapes (108 cases) rel <= 1.6e-6,
# scaled max-abs <= 4.4e-6.
_LINEAR_FP32 = Tolerance(
    5e-6, 1.2e-5, "fp32 sums over K (up to 8192) in another order, scale per K block"
)
# official (act_quant): x is rounded through e4m3 per 1x128 block before the product, by the
# same rule on the same input in both (power-of-two scale, correctly rounded e4m3, exact in
# bf16), so the rounded x is identical and no element flips: the math bounds hold.
_LINEAR_OFFICIAL = dataclasses.replace(
    _LINEAR_BF16, why="x's e4m3 rounding is identical in both; then as math: " + _LINEAR_BF16.why
)

for _op in ("linear", "grouped_linear"):
    register(
        OpPair(
            name=_op,
            concept="linear",
            strategy=partial(_linear_case, _op),
            build=partial(_build, _op),
            facts=_linear_facts,
            switches=lambda s: {"act_quant": s.act_quant},
            optimized_args=partial(_packed_linear, _op == "grouped_linear"),
            cpu_D=256,
            cpu_examples=4,
            tolerances={
                (BF16, "math"): _LINEAR_BF16,
                (FP32, "math"): _LINEAR_FP32,
                (BF16, "official"): _LINEAR_OFFICIAL,
            },
        )
    )


# --------------------------------------------------------------------------- eh_proj
# Inputs: conformance/inputs.py, eh_proj_inputs: e (T, K), h (T, n, K) and two checkpoint-format
# weights of one format.  On CPU the small shape (N 192, K 384) with n in {4, 1, 3} and rows
# 0..70 per stream (T*n past 256 reaches the prefill path's add pass); on CUDA V4-Flash's
# e_proj / h_proj (4096 x 4096), n 4, up to 1024 tokens: 4096 rows of h, the prefill path from
# 64 tokens on (the float64 oracle's row-by-row products over 4 x 4096 rows take minutes per
# generated test on the H200).
def _packed_eh(args: tuple[Any, ...], kwargs: dict[str, Any]):
    """(e, h, w_e, w_h) -> (e, h, pack_e, pack_h)."""
    e, h, *weights = args
    return (e, h, *(_pack_once(w, e.device) for w in weights)), kwargs


@st.composite
def _eh_case(draw: Any, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    from dsv4mtp.conformance.inputs import eh_proj_inputs

    if device == "cpu":
        T = draw(st.one_of(st.sampled_from([0, 1, 2, 7, 65]), st.integers(0, 70)))
        n = draw(st.sampled_from([4, 4, 1, 3]))
        shape: Any = "small"
    else:
        T = draw(st.one_of(st.sampled_from([0, 1, 8, 64, 65, 513]), st.integers(0, 1024)))
        T, n, shape = min(T, max_tokens), 4, "e_proj"
    fmt, magnitude, zero_rows, seed = _weight_draws(draw)
    args, kw = eh_proj_inputs(
        T, seed, shape=shape, n=n, fmt=fmt, dtype=dtype, device=device, magnitude=magnitude,
        zero_rows=zero_rows,
    )  # fmt: skip
    label = f"T={T} n={n} {fmt} magnitude={magnitude:g} zero_rows={zero_rows} seed={seed}"
    return Case(args, kw, label=label)


# Each product is linear's (the same kernel and paths, the same bounds per product); the sum
# of the two rounded products is rounded once more, by the same rule in both (the reference's
# bf16 add, the kernel's fp32 sum of the two rounded values).  Against the float64 oracle
# that is three roundings of 2^-9 where linear has one, on the drawn data (independent
# weights, no cancellation to speak of) about 1.3x linear's error: linear's bounds, widened.
_EH_BF16 = Tolerance(5e-3, 1e-2, "bf16: each product rounded once (2^-9), then their sum once more")
_EH_OFFICIAL = dataclasses.replace(
    _EH_BF16, why="e's and h's e4m3 rounding identical in both; then as math: " + _EH_BF16.why
)
register(
    OpPair(
        name="eh_proj",
        concept="linear",
        strategy=_eh_case,
        build=partial(_build, "eh_proj"),
        facts=_linear_facts,  # e's device and dtype
        switches=lambda s: {"act_quant": s.act_quant},
        optimized_args=_packed_eh,
        cpu_D=256,
        cpu_examples=4,
        tolerances={
            (BF16, "math"): _EH_BF16,
            (FP32, "math"): _LINEAR_FP32,
            (BF16, "official"): _EH_OFFICIAL,
        },
    )
)


# --------------------------------------------------------------------------- RoPE, q / kv paths
# Inputs: conformance/inputs.py, rope_inputs.  On CPU the tiny shape (H 4, Dh 64, rope 16) with
# T 0..40; on CUDA V4-Flash and V4-Pro (H 64 / 128, Dh 512, rope 64).  Positions U[0, 16) or
# U[0, 4096); plain and yarn frequencies.  Positions up to 2**20 are checked against the
# reference in the same dtype in test_rope.py (the float64 oracle forms a different angle).
@st.composite
def _rope_case(draw: Any, op: str, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    from dsv4mtp.conformance.inputs import rope_inputs

    if device == "cpu":
        T = draw(st.one_of(st.sampled_from([0, 1, 2, 17]), st.integers(0, 40)))
        shape = "tiny"
    else:
        T = draw(st.one_of(st.sampled_from([0, 1, 64, 4096]), st.integers(0, max_tokens)))
        shape = draw(st.sampled_from(["flash", "pro"]))
    mode = draw(st.sampled_from(["plain", "yarn"]))
    max_position = draw(st.sampled_from([16, 4096]))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 30.0]))
    zero_rows = 0.25 if draw(st.booleans()) else 0.0
    seed = draw(st.integers(0, 2**31 - 1))
    args, kw = rope_inputs(
        op, T, seed, shape=shape, dtype=dtype, device=device, mode=mode,
        max_position=max_position, magnitude=magnitude, zero_rows=zero_rows,
    )  # fmt: skip
    if op == "apply_rope":
        kw["inverse"] = draw(st.booleans())
    label = (
        f"T={T} {shape} {mode} positions<{max_position} magnitude={magnitude:g} "
        f"zero_rows={zero_rows} seed={seed}{' inverse' if kw.get('inverse') else ''}"
    )
    return Case(args, kw, label=label)


def _rope_facts(case: Case) -> Facts:
    """The floating tensors' dtypes in argument order, as optimized/rope.py builds its Facts."""
    floats = [a for a in case.args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return Facts(case.args[0].device, tuple(a.dtype for a in floats))


#: kv_norm_rope with fp8_kv: the largest fraction of non-rope elements that may sit one e4m3
#: step away from the float64 oracle's.  In bf16 the normalized value is rounded to bf16 before
#: the e4m3 rounding (as the reference does), the oracle rounds the exact value: e4m3 rounding
#: boundaries are 2^-3 apart relative, bf16's half ulp is 2^-8, so 2^-4 of the values lie close
#: enough to a boundary to cross it and about half of those do: ~3 % (measured on the CPU tier's
#: inputs, reference and kernel alike: 3.2 % of 115200 values).  fp32 activations are off by
#: ~2^-24: 1 of 115200 measured.
_KV_FLIPS = {BF16: 0.05, FP32: 0.001}


def _e4m3_flips(case: Case, got: tuple, oracle: tuple):
    """kv_norm_rope with ``fp8_kv``: the non-rope elements where the output and the oracle differ
    must be exactly one e4m3 step apart (at the block's coarser scale of the two) and at most
    ``_KV_FLIPS`` of them (plus a small-sample allowance); they are then excused (set to the
    oracle's value) and everything else is compared under the pair's tolerance."""
    from dsv4mtp.quant import KV_QUANT_BLOCK, pow2_scale

    if not case.kwargs.get("fp8_kv") or got[0].numel() == 0:
        return got, oracle, ""
    kv, rope_dim = case.args[0], case.kwargs["rope_dim"]
    Dn = kv.shape[1] - rope_dim
    g, o = got[0].detach().double().cpu().clone(), oracle[0].detach().double().cpu()
    gn, on = g[:, :Dn], o[:, :Dn]
    pad = (-Dn) % KV_QUANT_BLOCK

    def block_scale(v: torch.Tensor) -> torch.Tensor:
        blocks = torch.nn.functional.pad(v.abs(), (0, pad)).unflatten(-1, (-1, KV_QUANT_BLOCK))
        s = pow2_scale(blocks.amax(-1, keepdim=True)).expand_as(blocks)
        return s.flatten(-2)[..., :Dn]

    scale = torch.maximum(block_scale(gn), block_scale(on))
    # one e4m3 step at |v| / scale: 2^(floor(log2 |v|) - 3), subnormal step 2^-9
    mag = torch.maximum(gn.abs(), on.abs()) / scale
    step = torch.exp2(torch.floor(torch.log2(mag.clamp_min(2.0**-6))) - 3) * scale
    finite = torch.isfinite(gn) & torch.isfinite(on)
    differ = finite & (gn != on)
    too_far = differ & ((gn - on).abs() > step * (1 + 1e-9))
    n = differ.numel()
    rate = _KV_FLIPS[kv.dtype]
    allowed = rate * n + 3 * math.sqrt(rate * n) + 1
    flips = int(differ.sum())
    assert not bool(too_far.any()), (
        f"kv_norm_rope: {int(too_far.sum())} non-rope elements differ from the oracle by more "
        f"than one e4m3 step"
    )
    assert flips <= allowed, (
        f"kv_norm_rope: {flips} of {n} non-rope elements one e4m3 step off (at most "
        f"{allowed:.0f} allowed: {rate:.1%} plus a small-sample margin)"
    )
    gn[differ] = on[differ]
    return (g,), oracle, f"{flips} of {n} non-rope elements one e4m3 step off (excused)"


# apply_rope: one rotation in fp32 of inputs exact in fp32.
#  fp32: the angle fp32(pos * f) is off the oracle's exact angle by up to 2^-24 * pos * f
#  (f <= 1, pos < 4096: 2.4e-4 rad), which moves an output element by that times the pair's
#  norm; cos / sin and the two products add a few ulps.  bf16: the output's rounding (2^-9
#  relative) on top.
_ROPE_FP32 = Tolerance(2e-4, 6e-4, "fp32 angle pos*f rounded (2^-24 * pos * f, pos < 4096)")
_ROPE_BF16 = Tolerance(4e-3, 8e-3, "bf16 output: half a bf16 ulp (2^-9) per element")
# q_head_norm_rope in bf16 rounds after the square, the mean, the rsqrt and the product (the
# reference's sequence), then once more after the rotation (2^-9 each).  Measured on the CPU
# tier's inputs (100 draws, the reference in bf16 and the kernel alike): rel <= 3.0e-3, scaled
# max-abs <= 6.1e-3 (apply_rope: 2.1e-3 / 3.0e-3; kv_norm_rope: 2.3e-3 / 6.9e-3; fp32, all three:
# 1.0e-5 / 3.1e-5).
_Q_BF16 = Tolerance(
    6e-3, 1.6e-2, "bf16 roundings after square, mean, rsqrt, product and rotation (2^-9 each)"
)
# kv_norm_rope in bf16: one rounding after the norm (two in vllm order), one after the rotation.
_KV_BF16 = Tolerance(6e-3, 1.6e-2, "bf16 roundings after the norm (vllm: two) and the rotation")

register(
    OpPair(
        name="apply_rope",
        concept="rope",
        strategy=partial(_rope_case, "apply_rope"),
        build=partial(_build, "apply_rope"),
        facts=_rope_facts,
        cpu_examples=8,
        tolerances={(BF16, "math"): _ROPE_BF16, (FP32, "math"): _ROPE_FP32},
    )
)
register(
    OpPair(
        name="q_head_norm_rope",
        concept="rope",
        strategy=partial(_rope_case, "q_head_norm_rope"),
        build=partial(_build, "q_head_norm_rope"),
        facts=_rope_facts,
        cpu_examples=8,
        tolerances={(BF16, "math"): _Q_BF16, (FP32, "math"): _ROPE_FP32},
    )
)
register(
    OpPair(
        name="kv_norm_rope",
        concept="rope",
        strategy=partial(_rope_case, "kv_norm_rope"),
        build=partial(_build, "kv_norm_rope"),
        facts=_rope_facts,
        switches=lambda s: {"fp8_kv": s.fp8_kv, "norm_order": s.norm_order},
        canonical=_e4m3_flips,
        cpu_examples=6,
        tolerances={
            (BF16, "math"): _KV_BF16,
            (FP32, "math"): _ROPE_FP32,
            (BF16, "official"): replace(_KV_BF16, step_flips=_KV_FLIPS[BF16]),
            (BF16, "vllm"): replace(_KV_BF16, step_flips=_KV_FLIPS[BF16]),
        },
    )
)


# --------------------------------------------------------------------------- LM head
# Inputs: conformance/inputs.py, lm_head_inputs: y the normed rows (rms 1 times the norm
# weight, times a magnitude), the head N(0, 1/D) dense in the test dtype or quantized to FP8
# (a core QuantizedWeight with ue8m0 128x128 scales: the reference decodes it exactly, the
# optimized op takes its pack_head).  On CPU V 1000 and D 64..256 (the interpreter); on CUDA
# V4's V 129280 at D 4096 / 7168 with up to 256 rows (the draft step's batch).

#: Greedy-id near-tie: the float64 logits of the optimized id and of the reference's id closer
#: than this times the larger of their sum(|y| |w_v|) (the scale of a logit's rounding).  Both
#: ops sum D exact products (bf16 x bf16 or bf16 x e4m3 fit fp32; fp32 x fp32 rounds each once)
#: in fp32, whose error in practice is ~sqrt(D) 2^-24 of that scale (measured on the CPU tier:
#: ~1e-7 relative on the logits); 2e-5 leaves ~100x, and an id off by a TF32 product (~1e-3
#: relative) or a wrong chunk is caught.  Rows whose reference logits hold a NaN are never
#: excused: there the id must be torch.argmax's (the first NaN).
LM_HEAD_TIE_REL = 2e-5

_HEAD_PACKS: dict[int, tuple[Any, Any]] = {}


def _packed_head(args: tuple[Any, ...], kwargs: dict[str, Any]):
    """(y, QuantizedWeight) -> (y, its HeadPack), packed once per weight object (kept alive
    with its pack); a dense head tensor is passed as it is."""
    from dsv4mtp.checkpoint.weights import QuantizedWeight
    from dsv4mtp.optimized import pack_head  # type: ignore[attr-defined]

    y, head = args[0], args[1]
    if not isinstance(head, QuantizedWeight):
        return args, kwargs
    if id(head) not in _HEAD_PACKS:
        evict_oldest(_HEAD_PACKS, 4, False)
        _HEAD_PACKS[id(head)] = (head, pack_head(head, device=y.device))
    return (y, _HEAD_PACKS[id(head)][1], *args[2:]), kwargs


def lm_head_near_ties(
    y: torch.Tensor, head: Any, got: torch.Tensor, want: torch.Tensor
) -> torch.Tensor:
    """(T,) bool: rows where ``got`` differs from ``want`` (the float64 reference's ids) by a
    near-tie (:data:`LM_HEAD_TIE_REL`), on y's device."""
    from dsv4mtp.checkpoint.weights import QuantizedWeight

    w = head.dequantize(torch.float64) if isinstance(head, QuantizedWeight) else head.double()
    y64 = y.double()
    g, o = got.to(y.device).long(), want.to(y.device).long()
    wg, wo = w.to(y.device)[g], w.to(y.device)[o]  # (T, D) each: the two ids' head rows
    gap = ((y64 * wo).sum(-1) - (y64 * wg).sum(-1)).abs()  # float64 logits' difference
    scale = torch.maximum((y64.abs() * wg.abs()).sum(-1), (y64.abs() * wo.abs()).sum(-1))
    return (g != o) & (gap <= LM_HEAD_TIE_REL * scale)


def _lm_head_canonical(case: Case, got: tuple, oracle: tuple):
    """Ids: a different id is excused (replaced by the reference's) only at a near-tie."""
    y, head = case.args[:2]
    g, o = got[0].long().cpu(), oracle[0].long().cpu()
    if g.numel() == 0:
        return (g,), (o,), ""
    near = lm_head_near_ties(y, head, g, o).cpu()
    note = f"{int(near.sum())} of {len(g)} rows excused at a near-tie"
    return (torch.where(near, o, g),), (o,), note


@st.composite
def _lm_head_case(draw: Any, op: str, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    from dsv4mtp.conformance.inputs import LM_HEAD_FORMATS, lm_head_inputs

    if device == "cpu":
        T = draw(st.one_of(st.sampled_from([0, 1, 2, 17]), st.integers(0, 40)))
        D = draw(st.sampled_from([64, 128, 256]))
    else:
        T = min(
            max_tokens, draw(st.one_of(st.sampled_from([0, 1, 8, 64, 65]), st.integers(0, 256)))
        )
        D = draw(st.sampled_from([4096, 7168]))
    fmt = draw(st.sampled_from(LM_HEAD_FORMATS))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 30.0]))
    zero_rows = 0.25 if draw(st.booleans()) else 0.0
    seed = draw(st.integers(0, 2**31 - 1))
    head_seed = draw(st.integers(0, 1))  # few heads: each is drawn (and packed) once
    args, kw = lm_head_inputs(
        op, T, seed, D=D, fmt=fmt, head_seed=head_seed, dtype=dtype, device=device,
        magnitude=magnitude, zero_rows=zero_rows,
    )  # fmt: skip
    label = (
        f"T={T} D={D} V={args[1].shape[0]} {fmt} magnitude={magnitude:g} "
        f"zero_rows={zero_rows} seed={seed} head_seed={head_seed}"
    )
    return Case(args, kw, label=label)


def _lm_head_facts(case: Case) -> Facts:
    y, head = case.args[:2]
    dtypes = (y.dtype, head.dtype) if isinstance(head, torch.Tensor) else (y.dtype, torch.uint8)
    return Facts(y.device, dtypes)


_LM_HEAD_COMMON: dict[str, Any] = dict(
    concept="lm_head", facts=_lm_head_facts, optimized_args=_packed_head, cpu_D=128,
    cpu_examples=8,
)  # fmt: skip

# Greedy ids: compared exactly after near-ties are excused (LM_HEAD_TIE_REL); the tolerance
# below is the registry's required entry and reads no float output.
_IDS = Tolerance(1e-6, 1e-6, "integer ids, compared exactly (near-ties excused as sets)")
register(
    OpPair(
        name="lm_head_argmax",
        strategy=partial(_lm_head_case, "lm_head_argmax"),
        build=partial(_build, "lm_head_argmax"),
        outputs=("ids",),
        canonical=_lm_head_canonical,
        exact=("ids",),
        tolerances={(BF16, "math"): _IDS, (FP32, "math"): _IDS},
        **_LM_HEAD_COMMON,
    )
)

# Logits: fp32 from both inputs' exact products (bf16 x bf16 and bf16 x e4m3 fit fp32; the FP8
# head's power-of-two scale is exact) summed over D in another order than float64's; fp32 x
# fp32 products round once more; no output rounding.  The sum's error is at most
# ~D * 2^-24 * sum|y_k w_k| in the worst case and ~sqrt(D) * 2^-24 * ||y w|| for random signs.
# Measured: the CPU tier (both formats) rel <= 2.2e-7; the H200 (V 129280, cuBLAS
# with fp32 output for a bf16 head: Hopper's tensor cores align the products to the largest
# exponent of each group and truncate, and cuBLAS may split K) rel 7.9e-6, worst element
# 1.5e-5 of max|logit| over 21 cases; an fp32 head (fp32 FMA, another order) 1.5e-6 / 4.1e-6.
# Bounds: 4x the H200's worst; still 65x below a bf16 rounding of the logits (2^-9 rel.).
_LOGITS = Tolerance(
    3e-5, 6e-5, "fp32 sums over D of exact products, in another order (H200 tensor cores)"
)
register(
    OpPair(
        name="lm_head_logits",
        strategy=partial(_lm_head_case, "lm_head_logits"),
        build=partial(_build, "lm_head_logits"),
        outputs=("logits",),
        tolerances={(BF16, "math"): _LOGITS, (FP32, "math"): _LOGITS},
        **_LM_HEAD_COMMON,
    )
)


# --------------------------------------------------------------------------- paged-cache attention
# Inputs: _pool_case (above) with conformance/inputs.py's paged_attention_inputs (T queries
# against one block pool through scattered block tables: blocks left out (-1), rows of rejected
# drafts and of a block's earlier owner, the dtype's max in every row no query may read, padding
# rows, shared sequences).
# Shapes as the attention core's: tiny / small on CPU, flash / pro on CUDA with up to 1024
# queries.
#
# The attention core's tolerances, declared above: the paged kernel runs the ring kernel's
# blocks and lanes over the same visible keys (kernels/sink_attention.py, _rows_block), so it
# has the same two bf16 roundings (P, the output) and the same fp32 summation-order and exp2
# differences from the float64 oracle.
register(
    OpPair(
        name="sink_attention_paged",
        concept="attention",
        strategy=partial(_pool_case, "paged_attention_inputs"),
        build=partial(_build, "sink_attention_paged"),
        facts=_cache_facts,
        cpu_examples=12,
        tolerances={(BF16, "math"): _ATTN_BF16, (FP32, "math"): _ATTN_FP32},
    )
)


# --------------------------------------------------------------------------- decode step guard
# Inputs: conformance/inputs.py, step_guard_inputs: rows in range, rows with a non-finite
# prev_hidden value (NaN, +-inf, in random columns), ids and positions out of range (negative,
# at the limit, past it, the int64 extremes), several defects in one row, finite rows holding
# the dtype's largest value, and filler rows (real False) that are bad too.  The strategy also
# draws the fractions: no bad row, every row bad, all rows filler.  On CPU H up to 32800 (two
# of the kernel's 32768-wide steps); on CUDA V4's hc_mult * D (16384, 28672: one step) and
# small H.
@st.composite
def _guard_case(draw: Any, dtype: torch.dtype, device: str, max_tokens: int) -> Case:
    from dsv4mtp.conformance.inputs import step_guard_inputs

    if device == "cpu":
        T = draw(_CPU_T)
        H = draw(st.sampled_from([1, 3, 64, 300, 4100, 32800]))
    else:
        T = draw(st.one_of(st.sampled_from([0, 1, 8, 256]), st.integers(0, min(4096, max_tokens))))
        H = draw(st.sampled_from([1, 300, 16384, 28672]))
    bad = draw(st.sampled_from([0.0, 0.1, 0.3, 1.0]))
    filler = draw(st.sampled_from([0.0, 0.25, 1.0]))
    vocab_size = draw(st.sampled_from([1, 1000, 129280]))
    max_positions = draw(st.sampled_from([1, 16, 1 << 20]))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 1e3]))
    seed = draw(st.integers(0, 2**31 - 1))
    args, kw = step_guard_inputs(
        T, seed, H=H, dtype=dtype, device=device, vocab_size=vocab_size,
        max_positions=max_positions, bad=bad, filler=filler, magnitude=magnitude,
    )  # fmt: skip
    label = (
        f"T={T} H={H} bad={bad} filler={filler} vocab={vocab_size} max_positions={max_positions} "
        f"magnitude={magnitude:g} seed={seed}"
    )
    return Case(args, kw, label=label)


def _guard_facts(case: Case) -> Facts:
    prev = case.args[2]
    return Facts(prev.device, (prev.dtype,))


# Every output is a flag, an id or a row key: compared bitwise.  The entry below is the
# registry's required tolerance and reads no output.
_GUARD = Tolerance(1e-6, 1e-6, "bool / int64 outputs, compared exactly (no tolerance applies)")
register(
    OpPair(
        name="step_guard",
        concept="step_guard",
        strategy=_guard_case,
        build=partial(_build, "step_guard"),
        facts=_guard_facts,
        outputs=("ok", "ids", "positions", "slots", "record"),
        exact=("ok", "ids", "positions", "slots", "record"),
        reduced=("record",),
        tolerances={(BF16, "math"): _GUARD, (FP32, "math"): _GUARD},
    )
)
