"""NVFP4 gate/up alpha folding, the FlashInfer moe_ep pack contract, the padding preprocess.

The fold's acceptance is checked against an independent oracle (ml_dtypes' float8_e4m3fn
round-trip in numpy), and its effect on the decoded weights against the unfolded per-shard
decoding: within 1 float32 ulp always, bit-exact when up/gate is a power of two.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from dsv4mtp.checkpoint.nvfp4 import (
    MoEWeightPackSpec,
    check_moe_weight_pack,
    nvfp4_moe_weight_pack,
    to_flashinfer_weight_pack,
)
from dsv4mtp.reference import (
    DSV4Config,
    FoldError,
    InputError,
    apply_routing_padding_mask,
    fold_nvfp4_experts,
    fold_nvfp4_gate_up_scales,
    formats,
    load_mtp_checkpoint,
    make_synthetic_checkpoint,
)

E4M3 = torch.float8_e4m3fn


def _e4m3(values, shape=None) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    q = t.to(E4M3)
    assert torch.equal(q.float(), t), "test data must be exact e4m3 values"
    return q if shape is None else q.reshape(shape)


def _fold(gate: float, up: float, up_scales: list[float], w2: float = 1.0):
    """One expert, I = len(up_scales) rows per half, one 16-block per row; gate half = 1.0."""
    I = len(up_scales)
    sf = _e4m3([1.0] * I + up_scales, (1, 2 * I, 1))
    s2 = torch.tensor([[gate, up]], dtype=torch.float32)
    return fold_nvfp4_gate_up_scales(sf, s2, torch.tensor([w2]), intermediate_size=I)


# ----------------------------------------------------------------------------- worked examples
# Research notes 3.3 (each verified there with ml_dtypes): (g, u, up block scales, folded or None).
F32 = np.float32
FOLD_EXAMPLES = [
    ("equal scales", 2.0**-10, 2.0**-10, [0.5, 448.0], [0.5, 448.0]),
    ("power-of-two ratio", 2.0**-10, 2.0**-9, [0.5, 1, 96, 224], [1, 2, 192, 448]),
    ("exact non-power-of-two", 1.0, 1.5, [2, 4, 0], [3, 6, 0]),
    ("ratio 0.75", 2.0**-9, 0.75 * 2.0**-9, [1, 2, 1.25], [0.75, 1.5, 0.9375]),
    ("overflow", 2.0**-10, 2.0**-9, [256], None),
    ("mantissa loss", 1.0, 1.5, [1.375], None),
    ("ratio 0.75 top of range", 2.0**-9, 0.75 * 2.0**-9, [448], None),
    ("subnormal loss", 1.0, 0.25, [0.017578125], None),
    ("subnormal ok", 1.0, 0.25, [0.0234375], [0.005859375]),
    ("decimal ratio", 0.003, 0.001, [1, 2, 0.5], None),
    ("nearly equal", 0.0025, 0.0026, [1, 2, 0.5], None),
    (
        "calibrated PTQ",
        float(F32(0.37) / F32(2688)),
        float(F32(0.41) / F32(2688)),
        [1, 448, 96],
        None,
    ),
    ("decimals that happen to be exact", 0.002, 0.003, [2, 1], [3, 1.5]),
]


@pytest.mark.parametrize(
    ("case", "g", "u", "up", "want"), FOLD_EXAMPLES, ids=[c[0] for c in FOLD_EXAMPLES]
)
def test_fold_worked_examples(case: str, g: float, u: float, up: list, want: list | None) -> None:
    if want is None:
        with pytest.raises(FoldError, match="not exactly representable in float8_e4m3fn"):
            _fold(g, u, up)
        return
    folded, fc1, fc2 = _fold(g, u, up, w2=0.5)
    I = len(up)
    assert folded[0, I:, 0].float().tolist() == want
    assert folded[0, :I, 0].float().tolist() == [1.0] * I  # gate half untouched
    assert fc1.tolist() == [float(F32(g))] and fc2.tolist() == [0.5]
    assert fc1.dtype == fc2.dtype == torch.float32 and fc1.is_contiguous()


def test_fold_rescales_every_expert_when_any_differs() -> None:
    # Expert 0 has equal scales (ratio 1, unchanged), expert 1 ratio 2.
    sf = _e4m3([1, 2, 3, 4] * 2, (2, 4, 1))
    s2 = torch.tensor([[1.0, 1.0], [0.5, 1.0]])
    folded, fc1, _ = fold_nvfp4_gate_up_scales(sf, s2, torch.ones(2), intermediate_size=2)
    assert folded[0].float().flatten().tolist() == [1, 2, 3, 4]
    assert folded[1].float().flatten().tolist() == [1, 2, 6, 8]
    assert fc1.tolist() == [1.0, 0.5]


@pytest.mark.parametrize(
    ("s2", "w2", "who"),
    [
        ([[0.0, 1.0]], 1.0, "gate"),
        ([[1.0, -2.0]], 1.0, "up"),
        ([[1.0, 1.0]], 0.0, "w2"),
        ([[float("nan"), 1.0]], 1.0, "gate"),
        ([[1.0, float("inf")]], 1.0, "up"),
        ([[1.0, 1.0]], float("nan"), "w2"),
    ],
)
def test_fold_rejects_non_positive_or_non_finite_scales(s2, w2, who: str) -> None:
    sf = _e4m3([1.0, 1.0], (1, 2, 1))
    with pytest.raises(
        FoldError, match=rf"^{who}.*weight_scale_2: expected finite positive values"
    ):
        fold_nvfp4_gate_up_scales(sf, torch.tensor(s2), torch.tensor([w2]), intermediate_size=1)


def test_fold_refuses_a_second_fold() -> None:
    sf = _e4m3([1.0, 1.0], (1, 2, 1))
    s2 = torch.tensor([[1.0, 2.0]])
    folded, _, _ = fold_nvfp4_gate_up_scales(sf, s2, torch.ones(1), intermediate_size=1)
    with pytest.raises(FoldError, match="already folded"):
        fold_nvfp4_gate_up_scales(folded, s2, torch.ones(1), intermediate_size=1)
    # The input is never modified (nor marked).
    assert sf.float().flatten().tolist() == [1.0, 1.0]
    fold_nvfp4_gate_up_scales(sf, s2, torch.ones(1), intermediate_size=1)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            (torch.ones(1, 2, 1), torch.ones(1, 2), torch.ones(1)),
            "w13_weight_scale: expected dtype",
        ),
        (
            (_e4m3([1.0] * 4, (1, 4, 1)), torch.ones(1, 2), torch.ones(1)),
            r"w13_weight_scale: expected shape \(1, 2, \*\)",
        ),
        (
            (_e4m3([1.0] * 2, (1, 2, 1)), torch.ones(2, 2), torch.ones(1)),
            "w13_weight_scale_2: expected shape",
        ),
        (
            (_e4m3([1.0] * 2, (1, 2, 1)), torch.ones(1, 2), torch.ones(1, dtype=torch.float64)),
            "w2_weight_scale_2: expected dtype",
        ),
    ],
)
def test_fold_checks_its_arguments(args, match: str) -> None:
    with pytest.raises(InputError, match=match):
        fold_nvfp4_gate_up_scales(*args, intermediate_size=1)


# ----------------------------------------------------------------------------- property
# e4m3 block-scale bytes that matter: subnormals, powers of two, the top of the range, anything
# positive and finite (0x7F is NaN).
_SUBNORMAL = st.integers(1, 7)
_POW2 = st.integers(0, 15).map(lambda k: (k + 0) << 3 if k else 0x01)
_TOP = st.integers(0x70, 0x7E)
_ANY = st.integers(0, 0x7E)
_SCALE_BYTE = st.one_of(_SUBNORMAL, _POW2, _TOP, _ANY)
# Ratios up/gate: powers of two above and below 1, simple exact ratios, and arbitrary floats.
_RATIO = st.one_of(
    st.integers(-6, 6).map(lambda k: 2.0**k),
    st.sampled_from([1.5, 0.75, 3.0, 1.25, 0.625, 1 / 3, 1.04]),
    st.floats(0.01, 100.0),
)
_GATE = st.one_of(st.integers(-14, 2).map(lambda k: 2.0**k), st.floats(1e-5, 10.0))


def _f32_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in float32 units in the last place (same-sign finite values)."""
    ia = a.contiguous().view(torch.int32).to(torch.int64)
    ib = b.contiguous().view(torch.int32).to(torch.int64)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _oracle_exact(up_scales: torch.Tensor, ratio: np.float32) -> bool:
    """ml_dtypes: is every float32(up * ratio) an e4m3 value (no rounding, no overflow)?"""
    rescaled = up_scales.numpy().astype(np.float32) * ratio
    back = rescaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return bool(np.array_equal(back, rescaled))


@given(
    I=st.integers(1, 3),
    blocks=st.integers(1, 2),
    data=st.data(),
    gate=_GATE,
    ratio=_RATIO,
)
def test_fold_property(I: int, blocks: int, data, gate: float, ratio: float) -> None:
    E = data.draw(st.integers(1, 2), label="E")
    n_scale = E * 2 * I * blocks
    scale_bytes = data.draw(
        st.lists(_SCALE_BYTE, min_size=n_scale, max_size=n_scale), label="scales"
    )
    sf = torch.tensor(scale_bytes, dtype=torch.uint8).view(E4M3).reshape(E, 2 * I, blocks)
    g = torch.full((E,), gate, dtype=torch.float32)
    u = (g.double() * ratio).float()
    if not bool((u > 0).all()) or not bool(torch.isfinite(u).all()):
        return
    s2 = torch.stack([g, u], 1)
    w2 = torch.ones(E)
    r = u / g  # the fold's own fp32 ratio
    oracle = torch.equal(g, u) or all(
        _oracle_exact(sf[e, I:].float(), r[e].numpy()) for e in range(E)
    )
    try:
        folded, fc1, fc2 = fold_nvfp4_gate_up_scales(sf, s2, w2, intermediate_size=I)
    except FoldError:
        assert not oracle, "fold refused although every rescaled scale is exact in e4m3"
        event("refused")
        return
    event("accepted")
    assert oracle, "fold accepted although a rescaled scale is not exact in e4m3"
    assert torch.equal(fc1, g) and torch.equal(fc2, w2)
    # Decode the whole w13 both ways with the same packed codes.
    g_codes = torch.Generator().manual_seed(len(scale_bytes))
    packed = torch.randint(0, 256, (E, 2 * I, blocks * 8), dtype=torch.uint8, generator=g_codes)
    ref_gate = formats.dequantize_nvfp4(packed[:, :I], sf[:, :I], g)
    ref_up = formats.dequantize_nvfp4(packed[:, I:], sf[:, I:], u)
    got = formats.dequantize_nvfp4(packed, folded, fc1)  # one alpha for all 2I rows
    assert torch.equal(got[:, :I], ref_gate)
    dist = _f32_ulp_distance(got[:, I:], ref_up)
    assert dist <= 1
    for e in range(E):
        rk = float(r[e])
        power_of_two = math.frexp(rk)[0] == 0.5
        exact_ratio = float(r[e]) * float(g[e]) == float(u[e])
        if power_of_two or exact_ratio:
            event("accepted, exact ratio")
            assert torch.equal(got[e, I:], ref_up[e]), f"expert {e}: ratio {rk} must fold exactly"


# ----------------------------------------------------------------------------- on loaded experts
@pytest.fixture(scope="module")
def nvfp4_experts(tmp_path_factory):
    path = make_synthetic_checkpoint(
        tmp_path_factory.mktemp("nv"), DSV4Config.tiny(), expert_format="nvfp4"
    )
    return load_mtp_checkpoint(path).layers[0].experts


def test_folded_experts_decode_exactly_like_unfolded(nvfp4_experts) -> None:
    ex = nvfp4_experts
    assert not torch.equal(ex.w13_weight_scale_2[:, 0], ex.w13_weight_scale_2[:, 1])
    folded = fold_nvfp4_experts(ex)
    assert folded.nvfp4_folded and not ex.nvfp4_folded
    assert torch.equal(folded.w13_weight_scale_2[:, 0], folded.w13_weight_scale_2[:, 1])
    for e in range(ex.num_local_experts):  # ratio 2 (a power of two): bit-exact
        for a, b in zip(ex.dequantize_expert(e), folded.dequantize_expert(e), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(FoldError, match="already folded"):
        fold_nvfp4_experts(folded)


def test_unfoldable_experts_still_load_and_decode_per_shard(tmp_path) -> None:
    path = make_synthetic_checkpoint(
        tmp_path, DSV4Config.tiny(), expert_format="nvfp4", nvfp4_unfoldable=True
    )
    ex = load_mtp_checkpoint(path).layers[0].experts
    _gate, up, _down = ex(0, torch.float32)
    assert torch.isfinite(up).all() and float(up.abs().max()) > 0
    with pytest.raises(FoldError, match="cannot be merged into one fc1_alpha"):
        fold_nvfp4_experts(ex)


def test_fold_rejects_non_nvfp4_experts(tmp_path) -> None:
    path = make_synthetic_checkpoint(tmp_path, DSV4Config.tiny(), expert_format="mxfp4")
    with pytest.raises(FoldError, match="only NVFP4 experts are folded, got mxfp4"):
        fold_nvfp4_experts(load_mtp_checkpoint(path).layers[0].experts)


# ----------------------------------------------------------------------------- moe_ep pack
def test_moe_weight_pack_contract(nvfp4_experts) -> None:
    ex = nvfp4_experts
    pack = nvfp4_moe_weight_pack(ex)
    E, H, I = ex.num_local_experts, ex.hidden_size, ex.intermediate_size
    assert [f.name for f in dataclasses.fields(pack)] == [
        "w13",
        "w2",
        "w13_scale",
        "w2_scale",
        "fc1_alpha",
        "fc2_alpha",
    ]
    assert (pack.w13.shape, pack.w13.dtype) == ((E, 2 * I, H // 2), torch.uint8)
    assert (pack.w2.shape, pack.w2.dtype) == ((E, H, I // 2), torch.uint8)
    assert (pack.w13_scale.shape, pack.w13_scale.dtype) == ((E, 2 * I, H // 16), E4M3)
    assert (pack.w2_scale.shape, pack.w2_scale.dtype) == ((E, H, I // 16), E4M3)
    assert torch.equal(pack.fc1_alpha, ex.w13_weight_scale_2[:, 0])
    assert torch.equal(pack.fc2_alpha, ex.w2_weight_scale_2)
    # vLLM's rule: the pack is the loaded bytes; only the up half's block scales change.
    assert torch.equal(pack.w13, ex.w13_weight) and torch.equal(
        pack.w2_scale.view(torch.uint8), ex.w2_weight_scale.view(torch.uint8)
    )
    assert torch.equal(
        pack.w13_scale[:, :I].view(torch.uint8), ex.w13_weight_scale[:, :I].view(torch.uint8)
    )


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("w13", lambda t: t.view(torch.int8), r"pack\.w13: expected dtype in \(uint8\), got int8"),
        ("w2_scale", lambda t: t[:, :, :-1], r"pack\.w2_scale: expected shape"),
        ("fc1_alpha", lambda t: t.double(), r"pack\.fc1_alpha: expected dtype"),
        (
            "w13_scale",
            lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
            r"pack\.w13_scale: expected a contiguous",
        ),
    ],
)
def test_moe_weight_pack_contract_violations(nvfp4_experts, field, value, match) -> None:
    ex = nvfp4_experts
    pack = nvfp4_moe_weight_pack(ex)
    bad = dataclasses.replace(pack, **{field: value(getattr(pack, field))})
    with pytest.raises(InputError, match=match):
        check_moe_weight_pack(
            bad,
            num_local_experts=ex.num_local_experts,
            hidden_size=ex.hidden_size,
            intermediate_size=ex.intermediate_size,
        )


def test_moe_weight_pack_needs_multiples_of_16(nvfp4_experts) -> None:
    pack = nvfp4_moe_weight_pack(nvfp4_experts)
    with pytest.raises(InputError, match="multiples of 16"):
        check_moe_weight_pack(pack, num_local_experts=8, hidden_size=256, intermediate_size=120)


def test_real_flashinfer_moe_weight_pack(nvfp4_experts) -> None:
    pytest.importorskip(
        "flashinfer.moe_ep", reason="flashinfer is not installed (optional [gpu] dependency)"
    )
    pack = nvfp4_moe_weight_pack(nvfp4_experts)
    fi = to_flashinfer_weight_pack(pack)
    from flashinfer.moe_ep.weights import PrequantizedMoEWeights

    assert isinstance(fi, PrequantizedMoEWeights)


def test_pack_spec_is_frozen(nvfp4_experts) -> None:
    pack = nvfp4_moe_weight_pack(nvfp4_experts)
    assert isinstance(pack, MoEWeightPackSpec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pack.w13 = pack.w2  # type: ignore[misc]


# ----------------------------------------------------------------------------- padding rows
def test_padding_rows_route_nowhere() -> None:
    ids = torch.tensor([[3, 7], [1, 2], [5, 6], [0, 4]])
    pad = torch.tensor([False, False, True, True])
    assert apply_routing_padding_mask(ids, pad).tolist() == [[3, 7], [1, 2], [-1, -1], [-1, -1]]
    assert ids.tolist()[2] == [5, 6]  # input untouched
    ids32 = ids.int()
    out = apply_routing_padding_mask(ids32, torch.ones(4, dtype=torch.bool))
    assert out.dtype == torch.int32 and out.tolist() == [[-1, -1]] * 4
    assert apply_routing_padding_mask(ids, None) is ids
    assert (
        apply_routing_padding_mask(ids, torch.zeros(4, dtype=torch.bool)).tolist() == ids.tolist()
    )


@pytest.mark.parametrize(
    ("ids", "pad", "match"),
    [
        (
            torch.zeros(4, 2, dtype=torch.int64),
            torch.zeros(3, dtype=torch.bool),
            r"is_padding: expected shape \(4,\), got \(3,\)",
        ),
        (torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4), "is_padding: expected dtype"),
        (
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(4, dtype=torch.bool),
            r"topk_ids: expected shape \(T, K\)",
        ),
        (torch.zeros(4, 2), torch.zeros(4, dtype=torch.bool), "topk_ids: expected dtype"),
    ],
)
def test_padding_mask_bad_inputs(ids, pad, match: str) -> None:
    with pytest.raises(InputError, match=match):
        apply_routing_padding_mask(ids, pad)
