"""MoE op pairs beyond the generated contract: folded NVFP4 against the unfolded reference, and
the GPU tier's fixed full-shape cases (V4-Flash and V4-Pro experts, T in {1, 64, 4096}).

The contract (test_contract.py) draws the tiny (CPU) or reduced (GPU) shapes; these cases pin
the shapes the kernels are built for.  Tolerances are the pairs' (conformance/pairs.py).
"""

from __future__ import annotations

import pytest
import torch

from dsv4mtp.conformance.differential import check_pair, compare, to_float64
from dsv4mtp.conformance.inputs import EXPERT_FORMATS, moe_inputs
from dsv4mtp.conformance.registry import REGISTRY, Case, pairs_for
from dsv4mtp.errors import InputError

PAIRS = {p.name: p for p in pairs_for("moe")}


@pytest.mark.parametrize("op", ["fused_experts", "moe"])
def test_folded_nvfp4_equals_the_reference_on_unfolded_scales(op: str, device: str) -> None:
    """The optimized op on folded NVFP4 experts (one fc1_alpha per expert) against the float64
    reference on the same experts with their own gate and up weight_scale_2: the fold is exact
    (ratio 2), so the math tolerance holds."""
    pair = REGISTRY[op]
    shape = "tiny" if device == "cpu" else "flash"
    kw = dict(shape=shape, device=device, magnitude=8.0)
    folded = moe_inputs(op, 9, 3, fmt="nvfp4_folded", **kw)
    unfolded = moe_inputs(op, 9, 3, fmt="nvfp4", **kw)
    args, kwargs = pair.optimized_call(*folded)
    got = pair.optimized_fn()(*args, **kwargs)
    oracle = pair.reference_fn()(*to_float64(unfolded[0]), **to_float64(unfolded[1]))
    if pair.canonical is not None:
        (got,), (oracle,), _ = pair.canonical(Case(*unfolded), (got,), (oracle,))
    rep = compare(got, oracle)
    assert rep.within(pair.tolerance(torch.bfloat16)), rep


_FULL = [
    pytest.param(op, shape, fmt, T, id=f"{op}-{shape}-{fmt}-T{T}")
    for op in ("fused_experts", "moe")
    for shape in ("flash", "pro")
    for fmt in EXPERT_FORMATS
    if not (shape == "pro" and fmt == "bf16")  # 50 GB of bf16 experts: not a V4-Pro format
    for T in (1, 64, 4096)
]


@pytest.mark.gpu
@pytest.mark.parametrize(("op", "shape", "fmt", "T"), _FULL)
@pytest.mark.parametrize("preset", ["math", "official"])
def test_full_shape(op: str, shape: str, fmt: str, T: int, preset: str) -> None:
    pair = PAIRS[op]
    args, kw = moe_inputs(op, T, 11, shape=shape, fmt=fmt, device="cuda", magnitude=8.0)
    case = Case(args, {**kw, **pair.preset_kwargs(preset)}, label=f"{shape} {fmt} T={T}")
    check_pair(pair, case, torch.bfloat16, preset=preset)


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_pack_moe_decode_equals_the_core_decode(fmt: str, device: str) -> None:
    """``MoEPack.decode_expert`` (codes x block scales, rounded once to bf16) is the core's
    decode of the same expert: bitwise for MXFP4, FP8 and bf16; for NVFP4 (folded or not) the
    core also applies the per-expert global scales, so those are applied here in fp32 and the
    two agree to fp32 rounding."""
    from dsv4mtp.conformance.inputs import moe_params
    from dsv4mtp.optimized import pack_moe

    params = moe_params("tiny", fmt, device)[0]
    pack = pack_moe(params, device)
    core = params.experts.packed
    for e in range(core.num_local_experts):
        w13, w2 = pack.decode_expert(e)
        want13, want2 = core.dequantize_expert(e, torch.float32)
        if not fmt.startswith("nvfp4"):
            assert torch.equal(w13, want13.to(torch.bfloat16)), (fmt, e)
            assert torch.equal(w2, want2.to(torch.bfloat16)), (fmt, e)
            continue
        inter = core.intermediate_size
        g13 = core.w13_weight_scale_2[e].float().repeat_interleave(inter)[:, None]  # (2I, 1)
        g2 = core.w2_weight_scale_2[e].float()
        torch.testing.assert_close(w13.float() * g13, want13, rtol=2e-7, atol=0)
        torch.testing.assert_close(w2.float() * g2, want2, rtol=2e-7, atol=0)


def test_moe_packs_a_params_object_once_and_forgets_it_with_the_object(device: str) -> None:
    """``moe(x, MoEParams, ...)`` packs on first use and reuses the pack for that object; the
    cache holds the params weakly, so a dropped layer's packed weights are freed, and a new
    object at the same address is packed anew."""
    import gc
    import sys

    from dsv4mtp.conformance.inputs import moe_params

    moe_mod = sys.modules["dsv4mtp.optimized.moe"]
    packs = sys.modules["dsv4mtp.optimized._packs"].PACKS

    params = moe_params("tiny", "mxfp4", device)[0]
    fresh = type(params)(**{f: getattr(params, f) for f in params.__dataclass_fields__})
    dev = torch.device(device)
    pack = moe_mod._pack_for(fresh, dev)
    assert moe_mod._pack_for(fresh, dev) is pack
    key = (id(fresh), dev)
    assert key in packs
    del fresh
    gc.collect()
    assert key not in packs


def test_row_mask_pads_rows_without_touching_the_real_ones(device: str) -> None:
    """``moe(..., row_mask=...)``: the real rows get the bits of a call without the filler rows
    (batch-invariant schedules), a filler row gets the shared expert alone (its routed picks are
    dropped), which differs from its unmasked result."""
    from dsv4mtp.optimized import moe

    shape = "tiny" if device == "cpu" else "flash"
    (x, params, cfg), _ = moe_inputs("moe", 6, 21, shape=shape, device=device, magnitude=4.0)
    mask = torch.tensor([True, True, False, True, False, False], device=device)
    kw = dict(batch_invariant=True)
    got = moe(x, params, cfg, row_mask=mask, **kw)
    assert torch.equal(got[mask], moe(x[mask], params, cfg, **kw))
    shared_only = moe(
        x[~mask], params, cfg, row_mask=torch.zeros(3, dtype=torch.bool, device=device), **kw
    )
    assert torch.equal(got[~mask], shared_only)
    assert not torch.equal(shared_only, moe(x[~mask], params, cfg, **kw))
    with pytest.raises(InputError, match="row_mask"):
        moe(x, params, cfg, row_mask=mask[:5])
    with pytest.raises(InputError, match="row_mask"):
        moe(x, params, cfg, row_mask=mask.int())
