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
