"""The one input builder of the public ops: the registry's strategies, the GPU tests and bench/.

``op_inputs(op, T, D, seed, ...)`` returns ``(args, kwargs)`` for one call of ``op`` in either
implementation.  Distributions (spec 12.3 magnitudes): activations ~ N(0, magnitude^2) in
``dtype``; mHC ``fn`` ~ N(0, 0.02^2), ``scale`` ~ N(1, 0.3^2), ``base`` ~ N(0, 0.5^2), fp32;
hc_post ``post`` = 2 U(0, 1) (what 2 sigmoid(.) spans) and ``comb`` a column softmax of N(0, 1)
logits, fp32; the RMSNorm weight ~ N(1, 0.5^2) in ``dtype``.

The draw order is fixed (bench/results/ record errors of these very tensors, so it stays): one
generator on ``device`` (drawing 8192 x 4 x 7168 on the host would dominate a GPU test) seeded
with ``seed``, activations first, then parameters in argument order (hc_post: residual, post,
comb, f).  ``zero_rows`` then zeroes each activation row with that probability, from the same
generator after every other draw, so it leaves the other values unchanged.

The MoE ops (``route``, ``fused_experts``, ``moe``): :func:`moe_inputs`; the attention core
(``sink_attention``, ``sink_attention_varlen``): :func:`attention_inputs`, and its decode over a
ring cache (``sink_attention_cache``): :func:`cache_attention_inputs`; the dense linears
(``linear``, ``grouped_linear``): :func:`linear_inputs`; RoPE and the q / kv paths
(``apply_rope``, ``q_head_norm_rope``, ``kv_norm_rope``): :func:`rope_inputs`; each described
there.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections import OrderedDict
from typing import Any

import torch

from dsv4mtp.checkpoint.nvfp4 import fold_nvfp4_experts
from dsv4mtp.checkpoint.weights import RoutedExperts
from dsv4mtp.config import DSV4Config
from dsv4mtp.params import MoEParams, PackedExperts

__all__ = [
    "ATTENTION_OPS",
    "ATTENTION_SHAPES",
    "CACHE_OPS",
    "EPS",
    "EXPERT_FORMATS",
    "LINEAR_FORMATS",
    "LINEAR_OPS",
    "LINEAR_SHAPES",
    "MHC_OPS",
    "MOE_OPS",
    "MOE_SHAPES",
    "OPS",
    "ROPE_OPS",
    "ROPE_SHAPES",
    "SKEWS",
    "attention_inputs",
    "attention_shape",
    "cache_attention_inputs",
    "eh_proj_inputs",
    "embed_norms_inputs",
    "linear_inputs",
    "linear_shape",
    "linear_weight",
    "mhc_inputs",
    "moe_inputs",
    "moe_params",
    "moe_shape",
    "norm_inputs",
    "op_inputs",
    "rope_inputs",
    "rope_shape",
    "token_rows",
]

EPS = 1e-6
MHC_OPS = ("hc_pre", "hc_post", "hc_head", "hc_post_pre", "hc_post_head")
MOE_OPS = ("route", "fused_experts", "moe")
ATTENTION_OPS = ("sink_attention", "sink_attention_varlen")
LINEAR_OPS = ("linear", "grouped_linear")
ROPE_OPS = ("apply_rope", "q_head_norm_rope", "kv_norm_rope")
CACHE_OPS = ("sink_attention_cache",)
OPS = (
    "rms_norm", "embed_norms", *MHC_OPS, *MOE_OPS, *ATTENTION_OPS, *LINEAR_OPS, "eh_proj",
    *ROPE_OPS, *CACHE_OPS,
)  # fmt: skip

Inputs = tuple[tuple[torch.Tensor, ...], dict[str, Any]]


class _Draw:
    def __init__(self, device: str | torch.device, seed: int) -> None:
        self.device = torch.device(device)
        self.g = torch.Generator(device=self.device).manual_seed(seed)

    def normal(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, device=self.device) * std + mean

    def uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, device=self.device)

    def zero_rows(self, t: torch.Tensor, p: float) -> torch.Tensor:
        if p > 0 and t.shape[0] > 0:
            t[self.uniform(t.shape[0]) < p] = 0
        return t


def norm_inputs(
    T: int,
    D: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    *,
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> Inputs:
    """``rms_norm(x, weight, eps=EPS)``: x (T, D) and weight (D,) in ``dtype``."""
    r = _Draw(device, seed)
    x = r.normal(T, D) * magnitude
    w = r.normal(D, std=0.5, mean=1.0).to(dtype)
    return (r.zero_rows(x, zero_rows).to(dtype), w), dict(eps=EPS)


#: The vocabulary of embed_norms' cases: the gather's offsets are the same code at V4's
#: 129280 rows (V * D < 2^31 at D 7168 too), and 1000 rows keep a GPU case at D 7168 small.
EMBED_VOCAB = 1000


def embed_norms_inputs(
    T: int,
    D: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    *,
    n: int = 4,
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
    vocab: int = EMBED_VOCAB,
) -> Inputs:
    """``embed_norms(input_ids, positions, embed, prev_hidden, enorm, hnorm, eps=EPS)``: ids in
    [0, vocab) (repeats likely at T > 30), positions in [0, 3) (a third at 0, where mask_pos0
    zeroes the row), embed (vocab, D) and prev_hidden (T, n, D) at ``magnitude``, some hidden
    tokens zero; weights N(1, 0.5^2); floats in ``dtype``."""
    r = _Draw(device, seed)
    ids = torch.randint(0, vocab, (T,), generator=r.g, device=r.device)
    positions = torch.randint(0, 3, (T,), generator=r.g, device=r.device)
    embed = (r.normal(vocab, D) * magnitude).to(dtype)
    prev = r.zero_rows(r.normal(T, n, D) * magnitude, zero_rows).to(dtype)
    enorm = r.normal(D, std=0.5, mean=1.0).to(dtype)
    hnorm = r.normal(D, std=0.5, mean=1.0).to(dtype)
    return (ids, positions, embed, prev, enorm, hnorm), dict(eps=EPS)


def mhc_inputs(
    op: str,
    T: int,
    n: int,
    D: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    *,
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> Inputs:
    """hc_pre / hc_head ``(x, fn, scale, base)``, hc_post ``(f, residual, post, comb)``;
    streams (T, n, D) and f (T, D) in ``dtype``, parameters fp32; kwargs as V4 calls them.
    The fused pairs hc_post_pre / hc_post_head: hc_post's four tensors at ``seed``, then
    hc_pre's / hc_head's parameters and kwargs as drawn at ``seed + 1``."""
    if op in ("hc_post_pre", "hc_post_head"):
        post_args, _ = mhc_inputs(
            "hc_post", T, n, D, dtype, device, seed, magnitude=magnitude, zero_rows=zero_rows
        )
        second = "hc_pre" if op == "hc_post_pre" else "hc_head"
        (_, *params), kw = mhc_inputs(second, 0, n, D, dtype, device, seed + 1)
        return (*post_args, *params), kw
    r = _Draw(device, seed)
    x = r.normal(T, n, D) * magnitude
    if op == "hc_pre":
        M = (2 + n) * n
        fn, scale = r.normal(M, n * D, std=0.02), r.normal(3, std=0.3, mean=1.0)
        base = r.normal(M, std=0.5)
        kw: dict[str, Any] = dict(rms_norm_eps=EPS, hc_eps=EPS, sinkhorn_iters=20, post_mult=2.0)
        return (r.zero_rows(x, zero_rows).to(dtype), fn, scale, base), kw
    if op == "hc_head":
        fn, scale = r.normal(n, n * D, std=0.02), r.normal(1, std=0.3, mean=1.0)
        base = r.normal(n, std=0.5)
        return (r.zero_rows(x, zero_rows).to(dtype), fn, scale, base), dict(
            rms_norm_eps=EPS, hc_eps=EPS
        )
    if op != "hc_post":
        raise ValueError(f"not an mHC op: {op!r}")
    post = 2 * r.uniform(T, n)
    comb = torch.softmax(r.normal(T, n, n), dim=-2)  # columns (over sources) sum to 1
    f = r.normal(T, D) * magnitude
    residual = r.zero_rows(x, zero_rows)
    return (r.zero_rows(f, zero_rows).to(dtype), residual.to(dtype), post, comb), {}


def op_inputs(
    op: str,
    T: int,
    D: int,
    seed: int,
    *,
    n: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> Inputs:
    """``(args, kwargs)`` of one call of any op in :data:`OPS` (defaults: V4's n = 4, bf16).
    MoE ops: D picks the shape (:func:`moe_shape`), the experts are MXFP4, routing uniform.
    Attention ops: D picks the shape (:func:`attention_shape`), T is the number of queries;
    RoPE ops: D picks the shape (:func:`rope_shape`)."""
    if op in MOE_OPS:
        return moe_inputs(
            op, T, seed, shape=moe_shape(D), dtype=dtype, device=device, magnitude=magnitude
        )
    if op in LINEAR_OPS:
        return linear_inputs(
            op, T, seed, shape=linear_shape(op, D), dtype=dtype, device=device,
            magnitude=magnitude, zero_rows=zero_rows,
        )  # fmt: skip
    if op == "eh_proj":
        return eh_proj_inputs(
            T, seed, shape="small" if D < 1024 else (0, D, D), n=n, dtype=dtype, device=device,
            magnitude=magnitude, zero_rows=zero_rows,
        )  # fmt: skip
    if op in ATTENTION_OPS:
        return attention_inputs(
            op, T, seed, shape=attention_shape(D), dtype=dtype, device=device, magnitude=magnitude
        )
    if op in CACHE_OPS:
        return cache_attention_inputs(
            T, seed, shape=attention_shape(D), dtype=dtype, device=device, magnitude=magnitude
        )
    if op in PAGED_OPS:
        return paged_attention_inputs(
            T, seed, shape=attention_shape(D), dtype=dtype, device=device, magnitude=magnitude
        )
    if op in ROPE_OPS:
        return rope_inputs(
            op, T, seed, shape=rope_shape(D), dtype=dtype, device=device, magnitude=magnitude,
            zero_rows=zero_rows,
        )  # fmt: skip
    if op == "rms_norm":
        return norm_inputs(T, D, dtype, device, seed, magnitude=magnitude, zero_rows=zero_rows)
    if op == "embed_norms":
        return embed_norms_inputs(
            T, D, dtype, device, seed, n=n, magnitude=magnitude, zero_rows=zero_rows
        )
    if op in LM_HEAD_OPS:
        return lm_head_inputs(
            op, T, seed, D=D, dtype=dtype, device=device, magnitude=magnitude, zero_rows=zero_rows
        )
    if op in GUARD_OPS:
        return step_guard_inputs(T, seed, H=D, dtype=dtype, device=device, magnitude=magnitude)
    return mhc_inputs(op, T, n, D, dtype, device, seed, magnitude=magnitude, zero_rows=zero_rows)


def token_rows(op: str, args: tuple[torch.Tensor, ...], index: Any) -> tuple[torch.Tensor, ...]:
    """The same call restricted to tokens ``index`` (a slice or index tensor); per-token
    arguments are indexed along dim 0, parameters are shared and left alone."""
    if op in ("hc_post", "hc_post_pre", "hc_post_head"):  # f, residual, post, comb; parameters
        return (*(a[index] for a in args[:4]), *args[4:])
    if op == "fused_experts":  # x, experts, topk_ids, topk_weights
        return (args[0][index], args[1], args[2][index], args[3][index])
    if op == "sink_attention":  # q, q_pos, kv, k_pos, attn_sink: the queries only
        return (args[0][index], args[1][index], *args[2:])
    if op == "sink_attention_varlen":
        return _varlen_rows(args, index)
    if op == "sink_attention_cache":  # q, q_pos, cache_kv, cache_pos, slots, attn_sink
        return (args[0][index], args[1][index], args[2], args[3], args[4][index], args[5])
    if op == "sink_attention_paged":  # q, q_pos, cache_kv, cache_pos, block_table, attn_sink
        return (args[0][index], args[1][index], args[2], args[3], args[4][index], args[5])
    if op in ("apply_rope", "q_head_norm_rope"):  # x, positions, freqs
        return (args[0][index], args[1][index], args[2])
    if op == "kv_norm_rope":  # kv, kv_norm_weight, positions, freqs
        return (args[0][index], args[1], args[2][index], args[3])
    if op in GUARD_OPS:  # ids, positions, prev_hidden, slots, real, vocab_size, max_positions
        return (*(a[index] for a in args[:5]), *args[5:])
    if op == "embed_norms":  # ids, positions, embed, prev_hidden, enorm, hnorm
        return (args[0][index], args[1][index], args[2], args[3][index], *args[4:])
    if op == "eh_proj":  # e, h, e_proj, h_proj
        return (args[0][index], args[1][index], *args[2:])
    return (args[0][index], *args[1:])


# ==================================================================================== MoE
#: Shapes of the MoE inputs by name.  ``tiny`` is the CPU tier's (the Triton kernels run in the
#: interpreter); ``reduced`` the GPU tier's hypothesis shape; ``flash`` and ``pro`` the real
#: V4-Flash (E 256, top-6, I 2048, D 4096) and V4-Pro (E 384, top-6, I 3072, D 7168) experts.
MOE_SHAPES: dict[str, DSV4Config] = {
    "tiny": DSV4Config.tiny(),  # E 8, top-2, I 128, D 256
    "reduced": DSV4Config.tiny().replace(
        hidden_size=1024, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=512
    ),
    "flash": DSV4Config.flash(),
    "pro": DSV4Config.pro(),
}
_SHAPE_BY_D = {c.hidden_size: name for name, c in MOE_SHAPES.items()}

#: Routed-expert formats: the core's RoutedExperts tags, plus NVFP4 after the gate/up fold.
EXPERT_FORMATS = ("mxfp4", "nvfp4", "nvfp4_folded", "fp8", "bf16")

#: Routing skews.  fused_experts takes the ids directly, so all four are exact there; route and
#: moe reach the first three through the router bias (+-100 dominates every score).
SKEWS = ("uniform", "one_expert", "empty_experts", "one_per_expert")


def moe_shape(D: int) -> str:
    """The :data:`MOE_SHAPES` name of hidden size D (256, 1024, 4096, 7168)."""
    if D not in _SHAPE_BY_D:
        raise ValueError(f"no MoE shape has hidden size {D}; expected one of {sorted(_SHAPE_BY_D)}")
    return _SHAPE_BY_D[D]


# Decoded magnitudes.  Every linear weight is drawn so that its decoded values have rms about
# 1/sqrt(K) (K = its input width), as N(0, 1/fan_in) would, so with x ~ N(0, 1) every projection
# is O(1) and magnitude 8 drives a good share of gate/up past swiglu_limit (10).
#  * e2m1 codes uniform over the 16 codes: rms 2.93 (E2M1_RMS).  MXFP4: e8m0 block exponent
#    round(log2(1 / (2.93 sqrt(K)))) + {-1, 0, 1}.  NVFP4: e4m3 block scales 2^U(0, 3) (rms 3.9,
#    all exact in e4m3, <= 8 so that the fold's x2 stays exact), weight_scale_2 per expert
#    1 / (2.93 * 3.9 * sqrt(K)) * 2^U(-1/2, 1/2) (an arbitrary fp32 value, as ModelOpt's amax /
#    2688 is); up's weight_scale_2 is twice gate's and its block scales 2^U(-1, 2), so the fold
#    (ratio 2) is exact and up keeps gate's magnitude.
#  * FP8 experts: e4m3 codes of N(0, 48^2) clamped to +-448 (rms ~48) with fp32 (not power of
#    two) 128x128 block scales 1 / (48 sqrt(K)) * U(1/2, 3/2), like V4-Flash-Base.  The shared
#    expert: the same codes with e8m0 block scales 2^(round(log2(1 / (48 sqrt(K)))) + {-1, 0, 1})
#    (the checkpoint's dense FP8), decoded exactly to bf16.
#  * bf16 experts: N(0, 1/K) rounded to bf16.  Router: gate_weight N(0, 1/D) fp32 (logits
#    N(0, 1)), gate_bias N(0, 0.1^2) fp32, as the synthetic checkpoint.
# Codes and scales are drawn directly (random bytes, torch casts), never through the reference
# quantizers, so full V4 shapes are built on the GPU in well under a second per format.
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # 2.93
_NV_SCALE_RMS = 3.9
_FP8_CODE_STD = 48.0


class _Gen:
    """One generator on ``device``; every draw goes through it in a fixed order."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.g = torch.Generator(device=device).manual_seed(seed)

    def bytes(self, *shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=self.g, device=self.device, dtype=torch.uint8)

    def ints(self, lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=self.g, device=self.device)

    def uniform(self, lo: float, hi: float, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, device=self.device) * (hi - lo) + lo

    def normal(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, device=self.device) * std


def _pow2_exponent(x: float) -> int:
    return round(math.log2(x))


def _fp4_linear(r: _Gen, E: int, N: int, K: int, fmt: str, up_rows: int = 0):
    """One stacked FP4 weight (E, N, K): (codes (E, N, K/2), block scales, weight_scale_2)."""
    codes = r.bytes(E, N, K // 2)  # two uniform e2m1 codes per byte
    if fmt == "mxfp4":
        base = _pow2_exponent(1 / (E2M1_RMS * math.sqrt(K)))
        return codes, (127 + base + r.ints(-1, 2, E, N, K // 32)).to(torch.uint8), None
    # nvfp4: rows [0, N - up_rows) gate-like, the last up_rows rows up (x2 global, /2 blocks)
    exps = r.uniform(0.0, 3.0, E, N, K // 16)
    if up_rows:
        exps[:, N - up_rows :] -= 1.0
    block = torch.exp2(exps).to(torch.float8_e4m3fn)
    s2 = (1 / (E2M1_RMS * _NV_SCALE_RMS * math.sqrt(K))) * torch.exp2(r.uniform(-0.5, 0.5, E))
    return codes, block, s2.float()


def _fp8_codes(r: _Gen, *shape: int) -> torch.Tensor:
    """e4m3 codes of N(0, 48^2) clamped to +-448.  A stack whose fp32 draw would pass 4 GiB (a
    V4-Pro FP8 w13: 384 x 6144 x 7168, 63 GiB in fp32) is drawn one leading index at a time."""
    if len(shape) < 2 or math.prod(shape) * 4 <= 4 << 30:
        return r.normal(*shape, std=_FP8_CODE_STD).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=r.device)
    for i in range(shape[0]):
        out[i] = _fp8_codes(r, *shape[1:])
    return out


def _fp8_linear(r: _Gen, E: int, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (E, N, K) e4m3, fp32 block scales (E, N/128, K/128))."""
    scale = r.uniform(0.5, 1.5, E, -(-N // 128), -(-K // 128)) / (_FP8_CODE_STD * math.sqrt(K))
    return _fp8_codes(r, E, N, K), scale


def _routed_experts(cfg: DSV4Config, fmt: str, r: _Gen) -> RoutedExperts:
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    common = dict(
        num_experts=E,
        expert_start=0,
        num_local_experts=E,
        hidden_size=D,
        intermediate_size=I,
        name="moe_inputs.experts",
    )
    if fmt == "bf16":
        w13 = r.normal(E, 2 * I, D, std=D**-0.5).to(torch.bfloat16)
        w2 = r.normal(E, D, I, std=I**-0.5).to(torch.bfloat16)
        return RoutedExperts("bf16", w13, None, w2, None, **common)  # type: ignore[arg-type]
    if fmt == "fp8":
        (w13, s13), (w2, s2) = _fp8_linear(r, E, 2 * I, D), _fp8_linear(r, E, D, I)
        return RoutedExperts("fp8_f32", w13, s13, w2, s2, **common)  # type: ignore[arg-type]
    base = "mxfp4" if fmt == "mxfp4" else "nvfp4"
    w13, s13, g13 = _fp4_linear(r, E, 2 * I, D, base, up_rows=I)
    w2, s2, g2 = _fp4_linear(r, E, D, I, base)
    extra: dict[str, Any] = {}
    if base == "nvfp4":
        assert g13 is not None
        extra = dict(w13_weight_scale_2=torch.stack([g13, 2 * g13], 1), w2_weight_scale_2=g2)
    experts = RoutedExperts(base, w13, s13, w2, s2, **common, **extra)  # type: ignore[arg-type]
    return fold_nvfp4_experts(experts) if fmt == "nvfp4_folded" else experts


def _shared_linear(r: _Gen, N: int, K: int) -> torch.Tensor:
    """A dense FP8-block (e8m0) weight (N, K), decoded exactly to bf16."""
    base = _pow2_exponent(1 / (_FP8_CODE_STD * math.sqrt(K)))
    exps = base + r.ints(-1, 2, -(-N // 128), -(-K // 128))
    scale = torch.exp2(exps.float()).repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)
    return (_fp8_codes(r, N, K).float() * scale[:, :K]).to(torch.bfloat16)


def _local_experts(experts: RoutedExperts, owned: torch.Tensor) -> RoutedExperts:
    """The experts ``owned`` (global ids, in local order) as one rank's RoutedExperts."""

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[owned].contiguous()

    return dataclasses.replace(
        experts,
        w13_weight=pick(experts.w13_weight),
        w13_weight_scale=pick(experts.w13_weight_scale),
        w2_weight=pick(experts.w2_weight),
        w2_weight_scale=pick(experts.w2_weight_scale),
        w13_weight_scale_2=pick(experts.w13_weight_scale_2),
        w2_weight_scale_2=pick(experts.w2_weight_scale_2),
        num_local_experts=int(owned.numel()),
    )


_Params = tuple[MoEParams, PackedExperts | None, torch.Tensor | None]
# Built parameters by (shape, format, device, weight_seed, skew): the contract calls the builder
# for every drawn case, and a V4-Pro MXFP4 expert stack alone is 12 GB.  A full shape is built
# only after every cached entry is dropped; the small ones keep a few dozen.
_CACHE: OrderedDict[tuple[Any, ...], _Params] = OrderedDict()


def moe_params(
    shape: str,
    fmt: str,
    device: str | torch.device,
    *,
    weight_seed: int = 0,
    skew: str = "uniform",
) -> _Params:
    """``(MoEParams, local experts, expert_map)`` of one shape and expert format (cached).

    The routed experts are ``PackedExperts`` over a core ``RoutedExperts`` of format ``fmt``
    (:data:`EXPERT_FORMATS`; ``nvfp4_folded`` through ``fold_nvfp4_experts``); the shared expert
    is FP8-exact bf16 (``shared_quantized``).  ``skew`` moves the router bias: ``one_expert``
    +100 on one expert (every token selects it), ``empty_experts`` -100 on three quarters of
    them (never selected).  The local experts and ``expert_map`` (int32, E) model rank 0 of an
    expert-parallel split owning a scattered half of the experts, for ``fused_experts(...,
    expert_map=...)``.
    """
    dev = torch.device(device)
    key = (shape, fmt, str(dev), weight_seed, skew)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"fmt: expected one of {EXPERT_FORMATS}, got {fmt!r}")
    if skew not in SKEWS[:3]:
        raise ValueError(f"skew: the router reaches {SKEWS[:3]}, got {skew!r}")
    _make_room(shape in ("flash", "pro"))
    cfg = MOE_SHAPES[shape]
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    r = _Gen(dev, weight_seed)
    gate_weight = r.normal(E, D, std=D**-0.5)  # (E, D) fp32
    gate_bias = r.normal(E, std=0.1)  # (E,) fp32
    shared = [_shared_linear(r, I, D), _shared_linear(r, I, D), _shared_linear(r, D, I)]
    experts = _routed_experts(cfg, fmt, r)
    owned = torch.randperm(E, generator=r.g, device=dev)[: E // 2]  # scattered half, local order
    expert_map = torch.full((E,), -1, dtype=torch.int32, device=dev)
    expert_map[owned] = torch.arange(E // 2, dtype=torch.int32, device=dev)
    if skew == "one_expert":
        gate_bias[int(r.ints(0, E, 1))] += 100.0
    elif skew == "empty_experts":
        gate_bias[torch.randperm(E, generator=r.g, device=dev)[: E - E // 4]] -= 100.0
    params = MoEParams(gate_weight, gate_bias, *shared, experts=PackedExperts(experts))
    local = PackedExperts(_local_experts(experts, owned))
    _CACHE[key] = (params, local, expert_map)
    return params, local, expert_map


def _make_room(big: bool) -> None:
    """Evict before building: a full shape keeps no other entry (a V4-Pro FP8 stack with its
    expert-parallel half is 38 GB, and the optimized pack of the previous one may still be
    alive in a test's frame), and the freed blocks go back to the device."""
    evict_oldest(_CACHE, 48, big)


def evict_oldest(cache: dict[Any, Any], keep: int, full_size: bool) -> None:
    """Drop ``cache``'s oldest entries (insertion order) until it holds fewer than ``keep``, or
    all of them before a full-size entry is built; after a full-size eviction the freed blocks
    go back to the device (the conformance caches of built parameters and packs)."""
    evicted = False
    while cache and (len(cache) >= keep or full_size):
        cache.pop(next(iter(cache)))
        evicted = True
    if evicted and full_size and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def _topk_ids(r: _Gen, T: int, E: int, K: int, skew: str) -> torch.Tensor:
    """(T, K) int32 distinct expert ids per row, by skew (fused_experts)."""
    if skew == "one_per_expert":  # token t takes experts perm[tK .. tK + K - 1] (mod E)
        perm = torch.randperm(E, generator=r.g, device=r.device)
        slots = torch.arange(T * K, device=r.device).view(T, K) % E
        return perm[slots].int()
    keys = r.uniform(0.0, 1.0, T, E)
    if skew == "one_expert":
        keys[:, int(r.ints(0, E, 1))] = 2.0  # in every row
    elif skew == "empty_experts":
        keys[:, torch.randperm(E, generator=r.g, device=r.device)[: E - E // 4]] = -1.0
    elif skew != "uniform":
        raise ValueError(f"skew: expected one of {SKEWS}, got {skew!r}")
    return torch.topk(keys, K, dim=-1).indices.int()


def moe_inputs(
    op: str,
    T: int,
    seed: int,
    *,
    shape: str = "tiny",
    fmt: str = "mxfp4",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    skew: str = "uniform",
    padding: float = 0.0,
    ep: bool = False,
    magnitude: float = 1.0,
    weight_seed: int = 0,
) -> Inputs:
    """``(args, kwargs)`` of one MoE call; parameters from :func:`moe_params` (cached by
    ``weight_seed``, so calls differing only in ``seed`` share their weights).

    * ``route``: ``(x, gate_weight, gate_bias, config)``;
    * ``moe``: ``(x, params, config)``;
    * ``fused_experts``: ``(x, experts, topk_ids, topk_weights)``, kwargs ``limit``
      (``swiglu_limit``) and, with ``ep``, ``expert_map``: then ``experts`` holds half of the
      experts and the ids stay global.  ``topk_ids (T, K)`` int32 distinct per row, drawn by
      ``skew`` (:data:`SKEWS`); ``topk_weights (T, K)`` fp32, positive, each row summing to
      ``routed_scaling_factor``, like the router's.  ``padding``: that fraction of rows is all
      -1 (padding tokens) and that fraction of single slots -1.

    From one generator on ``device`` seeded with ``seed``: x ~ N(0, magnitude^2) (T, D) in
    ``dtype`` first, then ids, weights and padding.
    """
    if op not in MOE_OPS:
        raise ValueError(f"not a MoE op: {op!r}")
    cfg = MOE_SHAPES[shape]
    dev = torch.device(device)
    params, local, expert_map = moe_params(
        shape, fmt, dev, weight_seed=weight_seed, skew=skew if op != "fused_experts" else "uniform"
    )
    r = _Gen(dev, seed)
    x = (r.normal(T, cfg.hidden_size) * magnitude).to(dtype)  # (T, D)
    if op == "route":
        return (x, params.gate_weight, params.gate_bias, cfg), {}
    if op == "moe":
        return (x, params, cfg), {}
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    ids = _topk_ids(r, T, E, K, skew)  # (T, K) int32
    w = r.uniform(0.1, 1.0, T, K)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor  # (T, K) fp32
    if padding > 0 and T > 0:
        ids[r.uniform(0.0, 1.0, T) < padding] = -1
        ids[r.uniform(0.0, 1.0, T, K) < padding / K] = -1
    kw: dict[str, Any] = {"limit": cfg.swiglu_limit}
    experts = params.experts
    if ep:
        assert local is not None
        experts, kw["expert_map"] = local, expert_map
    return (x, experts, ids, w), kw


# ==================================================================================== attention
#: (H, Dh, window) of the attention inputs by name: ``tiny`` and ``small`` for the CPU tier (the
#: kernel runs in the interpreter), ``flash`` and ``pro`` the real V4-Flash / V4-Pro attention.
ATTENTION_SHAPES: dict[str, tuple[int, int, int]] = {
    "tiny": (4, 64, 8),
    "small": (8, 64, 16),
    "flash": (64, 512, 128),
    "pro": (128, 512, 128),
}
_ATTENTION_BY_D = {64: "tiny", 4096: "flash", 7168: "pro"}


def attention_shape(D: int) -> str:
    """The :data:`ATTENTION_SHAPES` name of a contract's hidden size D (64, 4096, 7168)."""
    if D not in _ATTENTION_BY_D:
        raise ValueError(
            f"no attention shape for hidden size {D}; expected one of {sorted(_ATTENTION_BY_D)}"
        )
    return _ATTENTION_BY_D[D]


def _split(T: int, B: int) -> list[int]:
    return [T // B + (b < T % B) for b in range(B)]


def attention_inputs(
    op: str,
    T: int,
    seed: int,
    *,
    shape: str = "tiny",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    lens: list[int] | None = None,
    caches: list[int] | None = None,
    gap: float = 0.25,
    magnitude: float = 1.0,
) -> Inputs:
    """``(args, kwargs)`` of one attention call with T queries, as the MTP layer makes them.

    Each sequence holds ``caches[b]`` cached keys followed by the keys of its own queries (a
    query's key is the last one it may see): decode is one query per sequence, prefill many.
    ``sink_attention``: one sequence, ``(q, q_pos, kv, k_pos, attn_sink)``, cache default
    ``window - 1`` (a full decode cache).  ``sink_attention_varlen``: ``lens`` queries per
    sequence (default T split over 3), caches default ``window - 1, 0, 2 * window`` in turn
    (the last longer than a real cache, so the window binds on cached keys too); args end with
    ``cu_q, cu_k`` int32.  The shapes depend on (op, T, shape, lens, caches) only, never on the
    seed, so a captured graph can replay other seeds' inputs.

    From one generator on ``device`` seeded with ``seed``: q ~ N(0, magnitude^2) (Tq, H, Dh)
    and kv ~ N(0, 1) (Tk, Dh) in ``dtype`` (unit rms like the layer's normed q and kv, so the
    scores are O(magnitude)), attn_sink ~ N(0, 1) fp32 (H,), then positions: each sequence
    starts at U[0, 1000) and steps by 1, or with probability ``gap`` by 2 .. window (skipped
    positions, as after a rejected draft), int64.  kwargs: ``window``, ``scale = Dh**-0.5``.
    """
    if op not in ATTENTION_OPS:
        raise ValueError(f"not an attention op: {op!r}")
    H, Dh, W = ATTENTION_SHAPES[shape]
    if op == "sink_attention":
        lens, caches = [T], [W - 1] if caches is None else caches[:1]
    else:
        lens = _split(T, 3) if lens is None else lens
        caches = [(W - 1, 0, 2 * W)[b % 3] for b in range(len(lens))] if caches is None else caches
    if sum(lens) != T or len(caches) != len(lens):
        raise ValueError(f"lens {lens} must sum to T={T} with one cache each, got {caches}")
    dev = torch.device(device)
    r = _Gen(dev, seed)
    Tk = sum(lens) + sum(caches)
    q = (r.normal(T, H, Dh) * magnitude).to(dtype)
    kv = r.normal(Tk, Dh).to(dtype)
    sink = r.normal(H)
    q_pos, k_pos = [], []
    for n, c in zip(lens, caches, strict=True):
        steps = torch.where(r.uniform(0.0, 1.0, n + c) < gap, r.ints(2, W + 1, n + c), 1)
        pos = r.ints(0, 1000, 1) + torch.cumsum(steps, 0) - 1  # (c + n,) strictly increasing
        k_pos.append(pos)
        q_pos.append(pos[c:])
    kw: dict[str, Any] = {"window": W, "scale": Dh**-0.5}
    args = (q, torch.cat(q_pos), kv, torch.cat(k_pos), sink)
    if op == "sink_attention":
        return args, kw
    keys = [n + c for n, c in zip(lens, caches, strict=True)]
    cu_q = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *keys], device=dev).cumsum(0).to(torch.int32)
    return (*args, cu_q, cu_k), kw


def _varlen_rows(args: tuple[Any, ...], index: Any) -> tuple[Any, ...]:
    """A varlen call restricted to the queries ``index``: each run of selected rows from one
    sequence becomes a sequence of its own, with a copy of that sequence's keys."""
    q, q_pos, kv, k_pos, sink, cu_q, cu_k = args
    rows = torch.arange(q.shape[0])[index.cpu() if isinstance(index, torch.Tensor) else index]
    bq, bk = cu_q.tolist(), cu_k.tolist()
    seq = [bisect.bisect_right(bq, int(t)) - 1 for t in rows]
    runs: list[tuple[int, int]] = []  # (sequence, rows in the run)
    for b in seq:
        if runs and runs[-1][0] == b:
            runs[-1] = (b, runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    pick = rows.to(q.device)
    key_rows = torch.cat([torch.arange(bk[b], bk[b + 1]) for b, _ in runs]).to(q.device)
    lens = [0] + [n for _, n in runs]
    sizes = [0] + [bk[b + 1] - bk[b] for b, _ in runs]
    new_cu_q = torch.tensor(lens, device=q.device).cumsum(0).to(cu_q.dtype)
    new_cu_k = torch.tensor(sizes, device=q.device).cumsum(0).to(cu_k.dtype)
    return (q[pick], q_pos[pick], kv[key_rows], k_pos[key_rows], sink, new_cu_q, new_cu_k)


# ==================================================================================== linear
#: The dense linears by name: (G, N, K) with G = 0 for a plain linear.  ``small`` / ``grouped``
#: are the CPU tier's (the Triton kernel runs in the interpreter; N 192 leaves a partial 128-row
#: FP8 block and a third 64-wide N tile); the rest are V4-Flash's (hidden 4096): e_proj / h_proj
#: 4096 -> 4096, the fused wq_a + wkv 4096 -> 1536, wq_b 1024 -> 32768, wo_b 8192 -> 4096 and the
#: grouped wo_a, 8 groups of 4096 -> 1024.
LINEAR_SHAPES: dict[str, tuple[int, int, int]] = {
    "small": (0, 192, 384),
    "grouped": (3, 128, 256),
    "e_proj": (0, 4096, 4096),
    "wqa_wkv": (0, 1536, 4096),
    "wq_b": (0, 32768, 1024),
    "wo_b": (0, 4096, 8192),
    "wo_a": (8, 1024, 4096),
}
#: Weight formats of the dense linears: the core's QuantizedWeight tags.
LINEAR_FORMATS = ("fp8_e8m0", "fp8_f32", "bf16")


def linear_shape(op: str, D: int) -> str:
    """The :data:`LINEAR_SHAPES` name the contract's hidden size D picks: the CPU shapes below
    1024, V4-Flash's e_proj (wo_a grouped) at 4096, wq_b (wo_a) at 7168."""
    grouped = op == "grouped_linear"
    if D < 1024:
        return "grouped" if grouped else "small"
    return "wo_a" if grouped else ("e_proj" if D == 4096 else "wq_b")


@functools.lru_cache(maxsize=16)
def linear_weight(
    G: int, N: int, K: int, fmt: str, seed: int, device: str | torch.device = "cpu"
) -> Any:
    """One (G*N, K) (G >= 1) dense-linear weight as the checkpoint stores it, a core
    ``QuantizedWeight``, decoded values with rms about 1/sqrt(K) (the magnitudes above): FP8
    codes of N(0, 48^2) with e8m0 block scales 2^(round(log2(1 / (48 sqrt(K)))) + {-1, 0, 1})
    (V4-Flash) or fp32 scales 1 / (48 sqrt(K)) * U(1/2, 3/2) (V4-Flash-Base); bf16: N(0, 1/K).
    Cached (the same object for the same arguments, as the MoE sources are), so a repeated
    build hands the optimized side the pack it already made; callers must not modify it."""
    from dsv4mtp.checkpoint.weights import QuantizedWeight

    r = _Gen(torch.device(device), seed)
    rows = G * N
    if fmt == "bf16":
        w = (r.normal(rows, K) / math.sqrt(K)).to(torch.bfloat16)
        return QuantizedWeight("bf16", w, None, (rows, K), name="linear")
    nb, kb = -(-rows // 128), -(-K // 128)
    codes = _fp8_codes(r, rows, K)
    if fmt == "fp8_f32":
        scale = r.uniform(0.5, 1.5, nb, kb) / (_FP8_CODE_STD * math.sqrt(K))
    elif fmt == "fp8_e8m0":
        base = _pow2_exponent(1 / (_FP8_CODE_STD * math.sqrt(K)))
        scale = (127 + base + r.ints(-1, 2, nb, kb)).to(torch.uint8)
    else:
        raise ValueError(f"fmt: expected one of {LINEAR_FORMATS}, got {fmt!r}")
    return QuantizedWeight(fmt, codes, scale, (rows, K), name="linear")


def linear_inputs(
    op: str,
    T: int,
    seed: int,
    *,
    shape: str | tuple[int, int, int],
    fmt: str = "fp8_e8m0",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(x, weight), {}`` of one :data:`LINEAR_OPS` call: x ~ N(0, magnitude^2) (T, K) or
    (T, G, K) in ``dtype``, then the weight (:func:`linear_weight`, seeded ``seed + 1``) as a
    core ``QuantizedWeight`` ((G*N, K) for the grouped op): the reference dequantizes it, the
    optimized op takes its ``pack_linear`` (conformance/pairs.py).  ``shape``: a
    :data:`LINEAR_SHAPES` name or its (G, N, K)."""
    G, N, K = LINEAR_SHAPES[shape] if isinstance(shape, str) else shape
    r = _Draw(device, seed)
    x = r.normal(T, G, K) if G else r.normal(T, K)
    x = r.zero_rows(x * magnitude, zero_rows).to(dtype)
    return (x, linear_weight(max(G, 1), N, K, fmt, seed + 1, device)), {}


def eh_proj_inputs(
    T: int,
    seed: int,
    *,
    shape: str | tuple[int, int, int],
    n: int = 4,
    fmt: str = "fp8_e8m0",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(e, h, e_proj, h_proj), {}`` of one ``eh_proj`` call: e (T, K) and h (T, n, K) ~
    N(0, magnitude^2) in ``dtype`` (a drawn fraction of tokens zeroed in both), the two weights
    as core ``QuantizedWeight`` s of one format (:func:`linear_weight`, seeded ``seed + 1`` and
    ``seed + 2``).  ``shape``: a plain :data:`LINEAR_SHAPES` name or its (0, N, K)."""
    G, N, K = LINEAR_SHAPES[shape] if isinstance(shape, str) else shape
    if G:
        raise ValueError(f"shape: eh_proj's linears are plain (G 0), got {shape!r}")
    r = _Draw(device, seed)
    e, h = r.normal(T, K) * magnitude, r.normal(T, n, K) * magnitude
    if zero_rows > 0 and T > 0:
        gone = r.uniform(T) < zero_rows
        e[gone], h[gone] = 0, 0
    weights = (linear_weight(1, N, K, fmt, seed + k, device) for k in (1, 2))
    return (e.to(dtype), h.to(dtype), *weights), {}


# ==================================================================================== RoPE
#: (H, Dh, rope_dim) of the RoPE / q / kv path inputs by name: ``tiny`` for the CPU tier (the
#: kernel runs in the interpreter), ``flash`` and ``pro`` the real V4-Flash / V4-Pro attention.
ROPE_SHAPES: dict[str, tuple[int, int, int]] = {
    "tiny": (4, 64, 16),
    "flash": (64, 512, 64),
    "pro": (128, 512, 64),
}
_ROPE_BY_D = {64: "tiny", 4096: "flash", 7168: "pro"}


def rope_shape(D: int) -> str:
    """The :data:`ROPE_SHAPES` name of a contract's hidden size D (64, 4096, 7168)."""
    if D not in _ROPE_BY_D:
        raise ValueError(f"no RoPE shape for hidden size {D}; expected one of {sorted(_ROPE_BY_D)}")
    return _ROPE_BY_D[D]


def rope_inputs(
    op: str,
    T: int,
    seed: int,
    *,
    shape: str = "tiny",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    mode: str = "plain",
    max_position: int = 4096,
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> Inputs:
    """``(args, kwargs)`` of one call of a RoPE op, as the attention sublayer makes it.

    * ``apply_rope``: ``(x, positions, freqs)``: x the rope dims ``o[..., Dn:]`` of an output
      o (T, H, Dh), a strided (T, H, Dr) view, as the output path rotates them back;
    * ``q_head_norm_rope``: ``(q, positions, freqs)``, q (T, H, Dh), kwargs ``eps``,
      ``rope_dim``;
    * ``kv_norm_rope``: ``(kv, kv_norm_weight, positions, freqs)``, kv (T, Dh), the weight
      (Dh,) ~ N(1, 0.5^2) in ``dtype``; kwargs ``eps``, ``rope_dim`` (``fp8_kv`` and
      ``norm_order`` come from the preset).

    From one generator on ``device`` seeded with ``seed``: the activation ~ N(0, magnitude^2)
    in ``dtype`` first (``zero_rows`` of its token rows zeroed afterwards), then the weight,
    then positions U[0, max_position) int64 (any order: every row is rotated on its own).
    freqs: ``rope_frequencies(rope_dim, 10000, mode=mode)`` in fp32 (``yarn`` with V4's
    rope_scaling), as the layer builds them for bf16 and fp32.
    """
    from dsv4mtp.reference import rope_frequencies

    if op not in ROPE_OPS:
        raise ValueError(f"not a RoPE op: {op!r}")
    H, Dh, Dr = ROPE_SHAPES[shape]
    dev = torch.device(device)
    r = _Draw(dev, seed)
    x = r.normal(*((T, Dh) if op == "kv_norm_rope" else (T, H, Dh))) * magnitude
    x = x.to(dtype)
    w = r.normal(Dh, std=0.5, mean=1.0).to(dtype) if op == "kv_norm_rope" else None
    positions = torch.randint(0, max_position, (T,), generator=r.g, device=dev)
    x = r.zero_rows(x, zero_rows)
    cfg = DSV4Config.flash()
    freqs = rope_frequencies(
        Dr,
        cfg.rope_theta,
        mode=mode,
        rope_scaling=cfg.rope_scaling,
        device=dev,  # type: ignore[arg-type]
    )
    kw: dict[str, Any] = {"eps": EPS, "rope_dim": Dr}
    if op == "apply_rope":
        return (x[..., Dh - Dr :], positions, freqs), {}
    if op == "q_head_norm_rope":
        return (x, positions, freqs), kw
    return (x, w, positions, freqs), kw


# ==================================================================================== ring cache
def cache_attention_inputs(
    T: int,
    seed: int,
    *,
    shape: str = "tiny",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    gap: float = 0.25,
    magnitude: float = 1.0,
    pad: float = 0.2,
    max_draft: int = 8,
) -> Inputs:
    """``(args, kwargs)`` of one ``sink_attention_cache`` call: T decode queries against a ring
    cache of S = T + 2 slots, ``(q, q_pos, cache_kv, cache_pos, slots, attn_sink)``.

    The capacity is the DeviceKVCache's, C = window + max_draft rounded up to 16.  Each slot's
    ring has had 0 .. 2 * window + C - 1 rows written in position order (so most rings have
    wrapped around), from U[0, 1000), stepping by 1 or, with probability ``gap``, by
    2 .. window; a row holds its latest position (``cache_pos[s, p % C] == p``), -1 where never
    written, and its kv is the dtype's largest value there (an empty row must never be read:
    one that is read overflows the scores to inf / NaN).  Query b reads slot U[0, S) (two
    queries may share one), or is padding (-1) with probability ``pad``; its
    position is the slot's newest, or 1 .. 3 before it (newer rows invisible: a draft not yet
    rolled back), or up to window after it (0 for an empty ring, clamped at 0).  Shapes depend
    on (T, shape) only, never on the seed, so a captured graph can replay other seeds' inputs.

    From one generator on ``device`` seeded with ``seed``: q ~ N(0, magnitude^2) (T, H, Dh) and
    cache_kv ~ N(0, 1) (S, C, Dh) in ``dtype``, attn_sink ~ N(0, 1) fp32 (H,), then the rings'
    counts, starts and steps, then the slots and query offsets.  cache_pos and slots int32,
    q_pos int64.  kwargs: ``window``, ``scale = Dh**-0.5``.
    """
    H, Dh, W = ATTENTION_SHAPES[shape]
    C = -(-(W + max_draft) // 16) * 16
    S, N = T + 2, 2 * W + C
    r = _Gen(torch.device(device), seed)
    q = (r.normal(T, H, Dh) * magnitude).to(dtype)
    cache_kv = r.normal(S, C, Dh)
    sink = r.normal(H)
    counts = r.ints(0, N, S, 1)  # rows written per ring
    starts = r.ints(0, 1000, S, 1)
    steps = torch.where(r.uniform(0.0, 1.0, S, N) < gap, r.ints(2, W + 1, S, N), 1)
    written = starts + torch.cumsum(steps, 1) - 1  # (S, N) increasing positions per ring
    live = torch.arange(N, device=q.device)[None, :] < counts
    rows = torch.arange(S, device=q.device)[:, None] * C + written % C
    ring = torch.full((S * C,), -1, dtype=torch.int64, device=q.device)
    ring.scatter_reduce_(0, rows[live], written[live], reduce="amax")  # the latest wins
    cache_pos = ring.view(S, C)
    cache_kv[cache_pos < 0] = torch.finfo(dtype).max  # finite (the builder's output compares
    # equal to itself), and overflows the scores of any query that reads it
    slots = r.ints(0, S, T)
    slots = torch.where(r.uniform(0.0, 1.0, T) < pad, -1, slots)
    offset = torch.where(r.uniform(0.0, 1.0, T) < 0.5, 0, r.ints(-W, 4, T))
    newest = cache_pos.max(dim=1).values.clamp(min=0)  # (S,)
    q_pos = (newest[slots.clamp(min=0)] - offset).clamp(min=0)
    args = (q, q_pos, cache_kv.to(dtype), cache_pos.to(torch.int32), slots.to(torch.int32), sink)
    return args, {"window": W, "scale": Dh**-0.5}


# ==================================================================================== LM head
#: The shared LM head's ops (greedy ids and logits).  V is a function of D: ``LM_HEAD_CPU_V``
#: below 1024 (the CPU tier: the argmax kernel runs in the interpreter; 1000 leaves a partial
#: V chunk), V4's vocabulary (129280, V4-Flash and V4-Pro alike) at the real widths.
LM_HEAD_OPS = ("lm_head_argmax", "lm_head_logits")
LM_HEAD_FORMATS = ("bf16", "fp8")
LM_HEAD_CPU_V = 1000
LM_HEAD_V = 129280


def lm_head_vocab(D: int) -> int:
    """The vocabulary size of the LM head inputs at hidden size D."""
    return LM_HEAD_CPU_V if D < 1024 else LM_HEAD_V


@functools.lru_cache(maxsize=4)
def lm_head_weight(
    V: int, D: int, fmt: str, dtype: torch.dtype, seed: int, device: str | torch.device = "cpu"
) -> Any:
    """The head (V, D) as the synthetic checkpoint draws it, N(0, 1/D), in ``dtype``
    (bf16 / fp32) for ``fmt`` "bf16"; ``fmt`` "fp8": that bf16 head quantized to a core
    ``QuantizedWeight`` (e4m3 codes, ue8m0 128x128 block scales, ``formats.quantize_fp8_block``),
    as ``pack_head(head, format="fp8")`` quantizes it.  Cached (the same object for the same
    arguments: the optimized side packs it once); callers must not modify it."""
    from dsv4mtp import formats
    from dsv4mtp.checkpoint.weights import QuantizedWeight

    r = _Gen(torch.device(device), seed)
    w = r.normal(V, D, std=D**-0.5)
    if fmt == "bf16":
        return w.to(dtype)
    if fmt != "fp8":
        raise ValueError(f"fmt: expected one of {LM_HEAD_FORMATS}, got {fmt!r}")
    codes, scale = formats.quantize_fp8_block(w.to(torch.bfloat16), scale_fmt="e8m0")
    return QuantizedWeight("fp8_e8m0", codes, scale, (V, D), name="head")


def lm_head_inputs(
    op: str,
    T: int,
    seed: int,
    *,
    D: int,
    V: int | None = None,
    fmt: str = "bf16",
    head_seed: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    magnitude: float = 1.0,
    zero_rows: float = 0.0,
) -> Inputs:
    """``(y, head), {}`` of one :data:`LM_HEAD_OPS` call.  y (T, D) in ``dtype``: the normed
    rows the head sees, N(0, 1) rows scaled to rms 1, times the norm weight 1 + N(0, 0.1^2)
    (the synthetic checkpoint's) and ``magnitude``, ``zero_rows`` of them zeroed.  head:
    :func:`lm_head_weight` (V default :func:`lm_head_vocab`, seeded ``head_seed``, default
    ``seed + 1``), a dense tensor in ``dtype`` or an FP8 ``QuantizedWeight``."""
    if op not in LM_HEAD_OPS:
        raise ValueError(f"not an LM head op: {op!r}")
    r = _Draw(device, seed)
    x = r.normal(T, D)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    y = x * r.normal(D, std=0.1, mean=1.0).to(torch.bfloat16).float() * magnitude
    y = r.zero_rows(y, zero_rows).to(dtype)
    V = lm_head_vocab(D) if V is None else V
    hs = seed + 1 if head_seed is None else head_seed
    return (y, lm_head_weight(V, D, fmt, dtype, hs, torch.device(device))), {}


# ==================================================================================== paged cache
PAGED_OPS = ("sink_attention_paged",)
OPS = (*OPS, *PAGED_OPS)
__all__ += ["PAGED_BLOCK_SIZE", "PAGED_OPS", "paged_attention_inputs"]

#: The pool's block size by attention shape: a window spans 2 (tiny, small) or 8 (flash, pro)
#: blocks plus the partial ones at its ends.
PAGED_BLOCK_SIZE = {"tiny": 4, "small": 8, "flash": 16, "pro": 16}


def paged_attention_inputs(
    T: int,
    seed: int,
    *,
    shape: str = "tiny",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    gap: float = 0.25,
    magnitude: float = 1.0,
    pad: float = 0.2,
) -> Inputs:
    """``(args, kwargs)`` of one ``sink_attention_paged`` call: T queries of S = T + 2
    sequences against one block pool, ``(q, q_pos, cache_kv, cache_pos, block_table,
    attn_sink)``.

    Block size bs = :data:`PAGED_BLOCK_SIZE`; span L = window + 2 * bs.  Sequence s has its
    newest position U[0, 8 * window) and K = (L + 3) // bs + 2 consecutive logical blocks from
    the one holding ``newest - L + 1``, each a distinct block of the pool (a random
    permutation: scattered, never in order) and left out of the table (-1) with probability
    0.1.  A position k of those blocks is held (``cache_pos == k`` at its slot, kv ~ N(0, 1))
    when ``first <= k <= newest`` (first: newest - U[0, 2L), clamped at 0) and it survives the
    gaps (dropped with probability ``gap / 2``; the newest always held), or k is one of the 3
    after newest (rejected drafts, held with probability 0.5).  Every other row of the pool
    holds -1 or, with probability 0.3, a position of another logical block at its offset (a
    block's earlier owner: ``k - bs * U{1, 2, 3}`` in the sequence's blocks, any in the spare
    ones); its kv is the dtype's largest value, so a read of it overflows the scores.  Query
    b reads sequence U[0, S) (two queries may share one, and so their blocks) or is padding
    (its table row all -1) with probability ``pad``; its position is its sequence's newest,
    or 1 .. 3 before it, or up to window after it (clamped at 0).  The table has
    M = 8 * window // bs + K + 1 columns: every position a query can see falls in it.  Shapes
    depend on (T, shape) only.

    From one generator on ``device`` seeded with ``seed``: q ~ N(0, magnitude^2) (T, H, Dh) in
    ``dtype``, attn_sink ~ N(0, 1) fp32 (H,), then the layout.  cache_pos and block_table
    int32, q_pos int64.  kwargs: ``window``, ``scale = Dh**-0.5``.
    """
    H, Dh, W = ATTENTION_SHAPES[shape]
    bs = PAGED_BLOCK_SIZE[shape]
    S, L, P = T + 2, W + 2 * bs, 8 * W
    K = (L + 3) // bs + 2
    M, NB = P // bs + K + 1, S * K + 2
    dev = torch.device(device)
    r = _Gen(dev, seed)
    q = (r.normal(T, H, Dh) * magnitude).to(dtype)
    sink = r.normal(H)
    newest = r.ints(0, P, S, 1)  # (S, 1)
    first = (newest - r.ints(0, 2 * L, S, 1)).clamp(min=0)
    j0 = (newest - L + 1).clamp(min=0) // bs  # (S, 1) the first logical block
    offs = torch.arange(K * bs, device=dev)[None, :]
    k = j0 * bs + offs  # (S, K * bs) the positions of the sequence's blocks
    kept = (r.uniform(0.0, 1.0, S, K * bs) >= gap / 2) | (k == newest)
    held = ((k >= first) & (k <= newest) & kept) | (
        (k > newest) & (k <= newest + 3) & (r.uniform(0.0, 1.0, S, K * bs) < 0.5)
    )
    phys = torch.randperm(NB, generator=r.g, device=dev)[: S * K].view(S, K)
    listed = r.uniform(0.0, 1.0, S, K) >= 0.1
    table = torch.full((S, M), -1, dtype=torch.int64, device=dev)
    cols = j0 + torch.arange(K, device=dev)[None, :]  # (S, K) < M
    table.scatter_(1, cols, torch.where(listed, phys, -1))
    # every row first: empty or an earlier owner's position at its offset, poisoned kv
    o = torch.arange(bs, device=dev)[None, :]
    other = r.ints(0, M, NB, bs) * bs + o
    pool_pos = torch.where(r.uniform(0.0, 1.0, NB, bs) < 0.3, other, -1)
    pool_kv = torch.full((NB, bs, Dh), torch.finfo(dtype).max, device=dev)
    rows = (phys[:, :, None] * bs + torch.arange(bs, device=dev)).view(S, K * bs)  # (S, K*bs)
    flat_pos, flat_kv = pool_pos.view(-1), pool_kv.view(-1, Dh)
    earlier = k - bs * r.ints(1, 4, S, K * bs)  # an earlier owner's position at this offset
    stale = (r.uniform(0.0, 1.0, S, K * bs) < 0.3) & (earlier >= 0)
    flat_pos[rows] = torch.where(held, k, torch.where(stale, earlier, -1))
    flat_kv[rows[held]] = r.normal(int(held.sum()), Dh)
    seq = r.ints(0, S, T)
    padding = r.uniform(0.0, 1.0, T) < pad
    block_table = torch.where(padding[:, None], -1, table[seq])
    offset = torch.where(r.uniform(0.0, 1.0, T) < 0.5, 0, r.ints(-W, 4, T))
    q_pos = (newest[seq, 0] - offset).clamp(min=0)
    args = (
        q, q_pos, pool_kv.to(dtype), pool_pos.to(torch.int32), block_table.to(torch.int32), sink,
    )  # fmt: skip
    return args, {"window": W, "scale": Dh**-0.5}


# ==================================================================================== step guard
GUARD_OPS = ("step_guard",)
OPS = (*OPS, *GUARD_OPS)
__all__ += ["GUARD_OPS", "step_guard_inputs"]

_INT64 = torch.iinfo(torch.int64)


def step_guard_inputs(
    T: int,
    seed: int,
    *,
    H: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    vocab_size: int = 1000,
    max_positions: int = 4096,
    bad: float = 0.3,
    filler: float = 0.25,
    magnitude: float = 1.0,
) -> Inputs:
    """``(input_ids, positions, prev_hidden, slots, real, vocab_size, max_positions), {}`` of
    one ``step_guard`` call over T rows.  In range: ids U[0, vocab_size), positions
    U[0, max_positions), slots U[0, 64), prev_hidden (T, H) N(0, magnitude^2) in ``dtype`` with
    the dtype's largest finite value (either sign) in one column of ~30 % of the rows (finite:
    such a row stays ok).  Then each of the three defects hits a row with probability ``bad``,
    independently (so some rows have two or three, and the reason's precedence counts): a NaN,
    +inf or -inf in one column (in two columns for half of those rows); an id below 0 or at /
    past vocab_size (-1, -vocab_size, int64 min, vocab_size, vocab_size + 7, int64 max); a
    position likewise against max_positions.  ``real`` is False with probability ``filler``:
    those rows carry defects as often, and must never be recorded."""
    r = _Draw(device, seed)
    dev = r.device
    prev = r.normal(T, H, std=magnitude).to(dtype)
    ids = (r.uniform(T) * vocab_size).long().clamp_max(vocab_size - 1)
    positions = (r.uniform(T) * max_positions).long().clamp_max(max_positions - 1)
    slots = (r.uniform(T) * 64).long()
    real = r.uniform(T) >= filler
    huge, defects, two = r.uniform(T) < 0.3, r.uniform(T, 3) < bad, r.uniform(T) < 0.5
    cols = (r.uniform(T, 3) * H).long().clamp(0, max(H - 1, 0))  # (T, 3)
    picks = (r.uniform(T, 4) * 6).long().clamp_max(5)  # (T, 4)
    if H > 0:
        big = torch.finfo(dtype).max
        sign = torch.where(picks[:, 3] % 2 == 0, big, -big).to(dtype)
        prev[huge, cols[huge, 2]] = sign[huge]
        nonfinite = torch.tensor([float("nan"), float("inf"), -float("inf")], device=dev)
        values = nonfinite[picks[:, :2] % 3].to(dtype)  # (T, 2)
        first, second = defects[:, 0], defects[:, 0] & two
        prev[first, cols[first, 0]] = values[first, 0]
        prev[second, cols[second, 1]] = values[second, 1]

    def out_of_range(limit: int) -> torch.Tensor:
        return torch.tensor([-1, -limit, _INT64.min, limit, limit + 7, _INT64.max], device=dev)

    ids = torch.where(defects[:, 1], out_of_range(vocab_size)[picks[:, 0]], ids)
    positions = torch.where(defects[:, 2], out_of_range(max_positions)[picks[:, 1]], positions)
    return (ids, positions, prev, slots, real, vocab_size, max_positions), {}
