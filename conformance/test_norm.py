"""RMSNorm and the layer's entry norms (embed_norms): properties of the reference, then tests of the
optimized kernels beyond the generated op contract (conformance/test_contract.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsv4mtp.optimized as opt
from dsv4mtp.conformance.inputs import embed_norms_inputs, norm_inputs
from dsv4mtp.reference import InputError, embed_norms, rms_norm

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


def test_optimized_rms_norm_reads_rows_through_their_stride(device: str) -> None:
    """A 2-D x that is a column slice of a wider tensor (the attention's q rows of the fused
    wq_a + wkv output) is read in place, with the bits of its contiguous copy, in both orders and
    into ``out``; the slice right of it too (a row start off the tensor's start)."""
    x, w = _norm_inputs(7, 96, torch.bfloat16, device, seed=5)
    wide = torch.cat([x, x.flip(0)[:, :32]], dim=1)  # (7, 128)
    for part in (wide[:, :96], wide[:, 32:]):
        assert part.stride() == (128, 1) and part.shape == (7, 96)
        for order in ("official", "vllm"):
            want = opt.rms_norm(part.contiguous(), w, 1e-6, order=order)
            assert torch.equal(opt.rms_norm(part, w, 1e-6, order=order), want), order
            out = torch.full_like(want, float("nan"))
            opt.rms_norm(part, w, 1e-6, order=order, out=out)
            assert torch.equal(out, want)


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


# --------------------------------------------------------------------------- embed_norms
# The contract (differential against float64 under both presets, T = 0, out=, batch
# invariance, graph replay, typed errors) comes from the registry; here the op-pair property
# (bitwise the composition it replaces), the rows a gather can get wrong, and the operators.
def _composed(
    args: tuple[torch.Tensor, ...], order: str, mask_pos0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the layer ran before the pair: the gather, the mask's where, two optimized norms."""
    ids, pos, embed, prev, enorm, hnorm = args
    e = embed[ids]
    if mask_pos0:
        e = torch.where(pos[:, None] == 0, torch.zeros_like(e), e)
    return (
        opt.rms_norm(e, enorm, 1e-6, order=order),  # type: ignore[arg-type]
        opt.rms_norm(prev, hnorm, 1e-6, order=order),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("order", "mask_pos0"), [("official", False), ("vllm", True)])
def test_embed_norms_is_bitwise_the_composition(
    dtype: torch.dtype, order: str, mask_pos0: bool, device: str
) -> None:
    """Each row runs rms_norm's Triton row body with its chunk and warps: e and h are bitwise
    the gather, the mask and two rms_norm calls (zero rows, repeated ids and, on CUDA, V4's
    widths and a 1000-row batch included)."""
    shapes = [(7, 4, 64), (1, 4, 256)] if device == "cpu" else [(1, 4, 4096), (1000, 4, 7168)]
    for T, n, D in shapes:
        args, _ = embed_norms_inputs(T, D, dtype, device, seed=T, n=n, zero_rows=0.3)
        args[2][args[0][:1]] = 0  # one gathered row all zeros, mask or not
        kw = {"order": order, "mask_pos0": mask_pos0}
        got = opt.embed_norms(*args, 1e-6, **kw)
        want = _composed(args, order, mask_pos0)
        for name, g, w in zip(("e", "h"), got, want, strict=True):
            assert torch.equal(g, w), f"{name} at T={T} D={D}"


def test_embed_norms_masks_position_zero_and_poisons_bad_ids(device: str) -> None:
    """mask_pos0 zeroes exactly the rows at position 0; an id outside [0, V) gives a NaN row of
    e (the kernel reads nothing for it) and leaves every other row as it was; the reference
    refuses that id with an InputError."""
    args, _ = embed_norms_inputs(6, 64, torch.float32, device, seed=5, vocab=50)
    ids, pos = args[0], args[1]
    pos.copy_(torch.tensor([0, 1, 0, 2, 1, 1]))
    e, h = opt.embed_norms(*args, 1e-6, mask_pos0=True)
    zero = (e == 0).all(dim=1).cpu().tolist()
    assert zero == [True, False, True, False, False, False]
    ids[3], ids[4] = 50, -1
    e2, h2 = opt.embed_norms(*args, 1e-6, mask_pos0=True)
    assert torch.isnan(e2).all(dim=1).cpu().tolist() == [False] * 3 + [True] * 2 + [False]
    keep = [0, 1, 2, 5]
    assert torch.equal(e2[keep], e[keep]) and torch.equal(h2, h)
    with pytest.raises(InputError, match=r"^input_ids: expected ids in \[0, 50\), got 50"):
        embed_norms(*(a.cpu() for a in args), 1e-6)


def test_embed_norms_reads_the_embedding_through_its_row_stride(device: str) -> None:
    """An embedding that is a column slice of a wider table (row stride > D) is read in place,
    with the same bits as its contiguous copy."""
    args, _ = embed_norms_inputs(5, 64, torch.bfloat16, device, seed=2)
    wide = torch.cat([args[2], args[2].flip(0)], dim=1)[:, :64]  # (V, 64), row stride 128
    assert wide.stride() == (128, 1)
    got = opt.embed_norms(args[0], args[1], wide, *args[3:], 1e-6)
    want = opt.embed_norms(args[0], args[1], wide.contiguous(), *args[3:], 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_embed_norms_rejects_bad_input(device: str) -> None:
    args, _ = embed_norms_inputs(3, 64, torch.float32, device, seed=0)
    ids, pos, embed, prev, enorm, hnorm = args
    bad = {
        r"^input_ids: expected dtype": (ids.int(), pos, embed, prev, enorm, hnorm),
        r"^positions: expected shape \(3,\)": (ids, pos[:2], embed, prev, enorm, hnorm),
        r"^embed: expected dtype .*dsv4mtp.reference": (ids, pos, embed.double(), prev, enorm,
                                                        hnorm),
        r"^prev_hidden: expected shape \(3, \*, 64\)": (ids, pos, embed, prev[..., :32], enorm,
                                                       hnorm),
        r"^enorm: expected shape \(64,\)": (ids, pos, embed, prev, enorm[:5], hnorm),
    }  # fmt: skip
    for match, call in bad.items():
        with pytest.raises(InputError, match=match):
            opt.embed_norms(*call, 1e-6)
    with pytest.raises(InputError, match=r"^order"):
        opt.embed_norms(*args, 1e-6, order="other")  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^mask_pos0: expected a bool"):
        opt.embed_norms(*args, 1e-6, mask_pos0=1)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^out\[1\]: expected shape \(3, 4, 64\)"):
        opt.embed_norms(*args, 1e-6, out=(torch.empty_like(prev[:, 0]), torch.empty_like(prev[0])))
    with pytest.raises(InputError, match=r"^out: expected a 2-tuple"):
        opt.embed_norms(*args, 1e-6, out=torch.empty_like(prev))  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", ["", "_out"])
@pytest.mark.parametrize("order", ["official", "vllm"])
def test_embed_norms_opcheck(variant: str, order: str, device: str) -> None:
    """Schema (no undeclared mutation or aliasing), fake kernel vs real outputs and AOT
    dispatch, for the functional and the out operator."""
    args, _ = embed_norms_inputs(5, 32, torch.bfloat16, device, seed=1, n=4)
    call = (*args, 1e-6, order, order == "vllm")
    ops = torch.ops.dsv4mtp
    if variant:
        outs = {"e_out": torch.empty_like(args[3][:, 0]), "h_out": torch.empty_like(args[3])}
        torch.library.opcheck(ops.embed_norms_out.default, call, outs)
    else:
        torch.library.opcheck(ops.embed_norms.default, call, {})
