"""RoPE and the elementwise q / kv paths of attention (docs/semantics.md, "Attention with sinks"):
``rope_frequencies`` in both modes, the reference's ``apply_rope`` against an independent complex
rotation, and the optimized ``apply_rope``, ``q_head_norm_rope`` and ``kv_norm_rope`` against the
reference: both rope modes, inverse undoing forward, positions up to 2**20, bf16 and fp32, fp8_kv
on and off, non-finite inputs, typed errors, bitwise batch invariance and the operators.

The generated contract (test_contract.py) runs the drawn differential cases of the three pairs
(conformance/pairs.py); these are the focused cases.  On CPU the kernel runs in the interpreter
(tiny shape: H 4, Dh 64, rope 16); the GPU tier adds V4-Flash shapes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import dsv4mtp.reference as ref
from dsv4mtp.config import DSV4Config
from dsv4mtp.conformance.inputs import rope_inputs
from dsv4mtp.errors import ConfigError, InputError

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
H, DH, DR = 4, 64, 16  # the CPU tier's shape (inputs.ROPE_SHAPES["tiny"])
EPS = 1e-6
YARN = DSV4Config.flash().rope_scaling


def _opt():  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    import dsv4mtp.optimized as opt

    return opt


def _complex_rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, inverse: bool = False):
    """An independent float64 rotation: pairs (x[2i], x[2i+1]) as complex numbers times
    exp(+-i pos f_i)."""
    angle = pos.double()[:, None] * freqs.double()[None, :]  # (T, Dr/2)
    return _rotated(x, -angle if inverse else angle)


def _rotated(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """x (T, ..., Dr) with pair i of row t rotated by angle (T, Dr/2), in float64."""
    angle = angle.double()
    rot = torch.polar(torch.ones_like(angle), angle)
    rot = rot.view(x.shape[0], *([1] * (x.dim() - 2)), -1)
    c = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(c * rot).flatten(-2)


def _scaled_max(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in units of max |want| (NaN never passes)."""
    d = (got.double() - want.double()).abs()
    assert not bool(torch.isnan(d).any()), "NaN in the comparison"
    return float(d.max() / want.double().abs().max().clamp_min(1e-30)) if d.numel() else 0.0


# ------------------------------------------------------------------------------ frequencies
def test_plain_frequencies_and_interleaved_pairs() -> None:
    """plain: f_i = theta^(-2i/Dr); the rotation is on interleaved pairs (x[2i], x[2i+1]), the
    independent complex rotation's, not on half-split pairs (x[i], x[i + Dr/2])."""
    f = ref.rope_frequencies(DR, 10000.0, dtype=F64)
    assert torch.allclose(f, 10000.0 ** (-torch.arange(0, DR, 2, dtype=F64) / DR), rtol=1e-15)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, DR, generator=g, dtype=F64)
    pos = torch.randint(0, 5000, (7,), generator=g)
    assert torch.allclose(ref.apply_rope(x, pos, f), _complex_rope(x, pos, f), atol=1e-12)
    # one non-zero element 2i moves only within its pair (2i, 2i+1)
    e = torch.zeros(1, DR, dtype=F64)
    e[0, 6] = 1.0
    moved = ref.apply_rope(e, torch.tensor([3]), f).abs() > 0
    assert moved.nonzero()[:, 1].tolist() == [6, 7]


def test_yarn_frequencies() -> None:
    """V4's YaRN on theta 10000, Dr 64 (docs/semantics.md, "RoPE"): pairs 0..20 keep their
    frequency, 21..31 are interpolated towards f / 16 without reaching it; factor <= 1 and an
    unknown mode are ConfigErrors."""
    f = ref.rope_frequencies(64, 10000.0, dtype=F64)
    y = ref.rope_frequencies(64, 10000.0, mode="yarn", rope_scaling=YARN, dtype=F64)
    assert torch.equal(y[:21], f[:21])
    assert bool((y[21:] < f[21:]).all()) and bool((y[21:] > f[21:] / 16).all())
    ramp = (f[21:] - y[21:]) / (f[21:] - f[21:] / 16)  # (i - 20) / 13
    assert torch.allclose(ramp, (torch.arange(21, 32, dtype=F64) - 20) / 13, atol=1e-12)
    with pytest.raises(ConfigError, match=r"^rope_scaling"):
        ref.rope_frequencies(64, 10000.0, mode="yarn", rope_scaling={"factor": 1.0})
    with pytest.raises(ConfigError, match=r"^rope_mode"):
        ref.rope_frequencies(64, 10000.0, mode="ntk")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ optimized ops
def _call(opt: Any, op: str, args: tuple, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(optimized, reference) on the same arguments."""
    return getattr(opt, op)(*args, **kw), getattr(ref, op)(*args, **kw)


# Against the reference in the same dtype: bf16 may differ by one bf16 rounding here and there
# (the norm's fp32 sum in another order, cos / sin / FMA by an fp32 ulp), fp32 by a few ulps.
_SAME_DTYPE = {BF16: 8e-3, F32: 2e-6}


@pytest.mark.parametrize("mode", ["plain", "yarn"])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("op", ["apply_rope", "q_head_norm_rope", "kv_norm_rope"])
def test_optimized_matches_the_reference_in_both_modes(op: str, dtype, mode: str, device) -> None:
    opt = _opt()
    args, kw = rope_inputs(op, 23, 3, dtype=dtype, device=device, mode=mode)
    got, want = _call(opt, op, args, kw)
    assert got.dtype == dtype and got.shape == want.shape
    assert _scaled_max(got, want) <= _SAME_DTYPE[dtype]
    if op != "apply_rope" and dtype == BF16:
        # The non-rope dims involve no cos / sin: they follow the reference's rounding sequence
        # bit for bit, but where the fp32 sum of squares in another order rounds the bf16 mean
        # the other way (rare).  A norm rounded only at the end (vLLM's q norm) differs in many.
        nope = (got[..., : DH - DR] == want[..., : DH - DR]).double().mean()
        assert nope >= 0.99, f"only {float(nope):.1%} of the non-rope values are the reference's"


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_inverse_undoes_forward(dtype, device) -> None:
    """apply_rope(inverse=True) after apply_rope gives x back: exactly up to two roundings of
    the output (bf16: 2^-8 of the element's pair; fp32: a few ulps)."""
    opt = _opt()
    (x, pos, freqs), _ = rope_inputs("apply_rope", 31, 4, dtype=dtype, device=device, mode="yarn")
    back = opt.apply_rope(opt.apply_rope(x, pos, freqs), pos, freqs, inverse=True)
    assert _scaled_max(back, x) <= (2.0**-7 if dtype == BF16 else 1e-6)
    # the forward rotation alone moves the rope dims
    assert _scaled_max(opt.apply_rope(x, pos, freqs), x) > 0.1


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_apply_rope_in_place_on_the_output_view(dtype, device) -> None:
    """The attention output's inverse rotation: ``out=`` the strided view ``o[..., Dn:]``
    itself rotates it in place, bitwise the out-of-place result, and leaves ``o[..., :Dn]``
    alone; an out without unit stride along the rotated dim is refused.  (torch.compile refuses
    a strided out=: the attention sublayer then assigns the rotated copy instead.)"""
    opt = _opt()
    (view, pos, freqs), _ = rope_inputs("apply_rope", 9, 5, dtype=dtype, device=device)
    o = view._base  # the builder's output o (T, H, Dh); view = o[..., Dn:]
    assert o is not None and o.shape == (9, H, DH) and not view.is_contiguous()
    want = opt.apply_rope(view, pos, freqs, inverse=True)
    nope = o[..., : DH - DR].clone()
    got = opt.apply_rope(view, pos, freqs, inverse=True, out=view)
    assert got.data_ptr() == view.data_ptr()
    assert torch.equal(o[..., DH - DR :], want) and torch.equal(o[..., : DH - DR], nope)
    cols = torch.empty(9, H, 2 * DR, dtype=dtype, device=device)[..., ::2]  # stride 2 along Dr
    with pytest.raises(InputError, match=r"^out: expected a contiguous tensor"):
        opt.apply_rope(view, pos, freqs, inverse=True, out=cols)
    with pytest.raises(InputError, match=r"^out: expected shape \(9, 4, 16\), got \(9, 3, 16\)"):
        opt.apply_rope(view, pos, freqs, inverse=True, out=view[:, :3])
    shared = torch.zeros(9, 1, DR, dtype=dtype, device=device).expand(9, H, DR)  # one row
    with pytest.raises(InputError, match=r"^out: expected rows that do not overlap"):
        opt.apply_rope(view, pos, freqs, inverse=True, out=shared)
    with pytest.raises(InputError, match=r"^out: expected a torch.Tensor"):
        opt.apply_rope(view, pos, freqs, out=[1, 2])  # type: ignore[arg-type]


def test_rope_kernel_in_place_over_many_programs(device) -> None:
    """One token and one head per program (the interpreter otherwise runs one program): the
    in-place rotation of o[..., Dn:] over 36 programs is bitwise the out-of-place one."""
    _opt()
    from dsv4mtp.optimized.kernels.rope import RopeSchedule, norm_rope_triton

    (view, pos, freqs), _ = rope_inputs("apply_rope", 9, 6, dtype=BF16, device=device)
    kw = {"rope_dim": DR, "inverse": True, "schedule": RopeSchedule(1, 1)}
    want = norm_rope_triton(view, None, pos, freqs, torch.empty_like(view.contiguous()), **kw)
    got = norm_rope_triton(view, None, pos, freqs, view, **kw)
    assert got is view and torch.equal(view, want)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_positions_up_to_2_pow_20(dtype, device) -> None:
    """Positions near 2**20 (V4's 1M context): the angle is fp32(pos) * f rounded to fp32 in
    both implementations, so they agree as at small positions (an exact angle would be off by up
    to 2^-24 * 2^20 = 0.06 rad); and both are the exact rotation of that fp32 angle."""
    opt = _opt()
    (x, _, freqs), _ = rope_inputs("apply_rope", 40, 5, dtype=dtype, device=device)
    pos = torch.cat([torch.tensor([2**20, 2**20 - 1, 2**24 - 1]), torch.arange(2**20 - 37, 2**20)])
    pos = pos.to(device)
    got, want = _call(opt, "apply_rope", (x, pos, freqs), {})
    assert _scaled_max(got, want) <= _SAME_DTYPE[dtype]
    angle32 = pos.float()[:, None] * freqs.float()[None, :]  # the fp32 angle, rotated exactly
    assert _scaled_max(got, _rotated(x, angle32)) <= (2.0**-8 if dtype == BF16 else 2e-6)
    q_args, kw = rope_inputs("q_head_norm_rope", 40, 6, dtype=dtype, device=device)
    got, want = _call(opt, "q_head_norm_rope", (q_args[0], pos, q_args[2]), kw)
    assert _scaled_max(got, want) <= _SAME_DTYPE[dtype]


@pytest.mark.parametrize("norm_order", ["official", "vllm"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fp8_kv_rounds_the_nope_dims_only(dtype, norm_order: str, device) -> None:
    """fp8_kv: the non-rope dims are on the e4m3 grid of their 64-block's power-of-two scale
    (rounding them again changes nothing) and match the reference's (a rare one-step flip
    allowed, see pairs._KV_FLIPS); the rope dims are bitwise those of fp8_kv=False."""
    opt = _opt()
    args, kw = rope_inputs("kv_norm_rope", 40, 7, dtype=dtype, device=device, magnitude=3.0)
    kw["norm_order"] = norm_order
    plain = opt.kv_norm_rope(*args, **kw)
    got, want = _call(opt, "kv_norm_rope", args, {**kw, "fp8_kv": True})
    Dn = DH - DR
    assert torch.equal(got[:, Dn:], plain[:, Dn:])
    assert torch.equal(ref.fp8_block_roundtrip(got[:, :Dn], 64), got[:, :Dn])
    assert not torch.equal(got[:, :Dn], plain[:, :Dn])
    differ = int((got[:, :Dn] != want[:, :Dn]).sum())
    assert differ <= 0.01 * got[:, :Dn].numel() + 2, f"{differ} non-rope values differ"
    assert _scaled_max(got, want) <= 0.13  # a flip is one e4m3 step: <= 1/8 of the element


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("op", ["apply_rope", "q_head_norm_rope", "kv_norm_rope"])
def test_non_finite_inputs_propagate_like_the_reference(op: str, dtype, device) -> None:
    """NaN and +-inf in a few rows (rope and non-rope columns): the same elements come out NaN /
    inf as in the reference, and the other rows are untouched and finite."""
    opt = _opt()
    args, kw = rope_inputs(op, 9, 8, dtype=dtype, device=device)
    x = args[0].clone()
    last = x.shape[-1] - 1
    x[1, ..., 0] = float("nan")
    x[3, ..., last] = float("inf")
    x[5, ..., 2] = -float("inf")
    x[5, ..., last - 1] = float("inf")
    args = (x, *args[1:])
    for extra in ({}, {"fp8_kv": True}) if op == "kv_norm_rope" else ({},):
        got, want = _call(opt, op, args, {**kw, **extra})
        for name, test in (("nan", torch.isnan), ("inf", torch.isinf)):
            assert torch.equal(test(got), test(want)), f"{name} pattern differs {extra}"
        clean = [0, 2, 4, 6, 7, 8]
        assert bool(torch.isfinite(got[clean]).all())
        ok = torch.isfinite(want)
        bound = 0.13 if extra else _SAME_DTYPE[dtype]
        assert _scaled_max(got[ok], want[ok]) <= bound


def _bad_calls(device: str) -> list[tuple[str, str, tuple, dict]]:
    """(op, the argument the message must name, args, kwargs) for each rejected call."""
    (x, pos, freqs), _ = rope_inputs("apply_rope", 5, 0, dtype=F32, device=device)
    (q, _, _), kq = rope_inputs("q_head_norm_rope", 5, 0, dtype=F32, device=device)
    (kv, w, _, _), kk = rope_inputs("kv_norm_rope", 5, 0, dtype=F32, device=device)
    return [
        ("apply_rope", "x", (x[..., :-1], pos, freqs[:-1]), {}),  # odd rope dims
        ("apply_rope", "freqs", (x, pos, freqs[:-1]), {}),
        ("apply_rope", "positions", (x, pos[:-1], freqs), {}),
        ("apply_rope", "positions", (x, pos.float(), freqs), {}),
        ("apply_rope", "out", (x, pos, freqs), {"out": torch.empty(5, H, DR + 2)}),
        ("q_head_norm_rope", "q", (q[0], pos, freqs), kq),
        ("q_head_norm_rope", "q", (q.half(), pos, freqs), kq),
        ("q_head_norm_rope", "rope_dim", (q, pos, freqs), {**kq, "rope_dim": 15}),
        ("q_head_norm_rope", "rope_dim", (q, pos, freqs), {**kq, "rope_dim": 2 * DH}),
        ("q_head_norm_rope", "freqs", (q, pos, freqs[:-1]), kq),
        ("q_head_norm_rope", "eps", (q, pos, freqs), {**kq, "eps": -1.0}),
        ("kv_norm_rope", "kv", (kv[None], w, pos, freqs), kk),
        ("kv_norm_rope", "kv_norm_weight", (kv, w[:-1], pos, freqs), kk),
        ("kv_norm_rope", "positions", (kv, w, pos[:3], freqs), kk),
        ("kv_norm_rope", "norm_order", (kv, w, pos, freqs), {**kk, "norm_order": "neox"}),
        ("kv_norm_rope", "fp8_kv", (kv, w, pos, freqs), {**kk, "fp8_kv": 1}),
    ]


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_bad_inputs_raise_input_error_naming_the_tensor(impl: str, device) -> None:
    lib = ref if impl == "reference" else _opt()
    for op, name, args, kw in _bad_calls(device):
        if impl == "reference" and (name == "out" or args[0].dtype == torch.float16):
            continue  # the reference takes float16 too, and writes any out of the right shape
        with pytest.raises(InputError, match=rf"^{name}: "):
            getattr(lib, op)(*args, **kw)


# ------------------------------------------------------------------------------ batch invariance
@pytest.mark.parametrize("op", ["apply_rope", "q_head_norm_rope", "kv_norm_rope"])
def test_rows_are_bitwise_the_same_alone_and_in_a_batch(op: str, device) -> None:
    from dsv4mtp.conformance.inputs import token_rows

    opt = _opt()
    T = 37
    args, kw = rope_inputs(op, T, 9, dtype=BF16, device=device, mode="yarn")
    if op == "kv_norm_rope":
        kw["fp8_kv"] = True
    full = getattr(opt, op)(*args, **kw, batch_invariant=True)
    for t in (0, 17, T - 1):
        alone = getattr(opt, op)(*token_rows(op, args, slice(t, t + 1)), **kw, batch_invariant=True)
        assert torch.equal(full[t : t + 1], alone), f"{op}: token {t} differs alone"


@pytest.mark.parametrize("heads", [64, 5])
def test_q_one_warp_tile_keeps_each_row_alone_and_in_a_batch(heads: int, device) -> None:
    """The tile ``rope_schedule`` gives wide q rows on the GPU (two heads of one token per one-warp
    program; V4-Flash's 64 heads of 512) at Dh 512, rope 64: each token's rows give the same bits
    alone and in a batch of 37 (5 tokens of at most 16 heads under the interpreter); an odd head
    count leaves the last program one masked head.  On CUDA the default schedule is that tile (the
    interpreter keeps its one-program tiles, so the tile is passed there); its values stay within a
    bf16 rounding of the four-warp tile it replaced (another fp32 order of the per-head sum of
    squares)."""
    _opt()
    from dsv4mtp.optimized.kernels.rope import (
        NORM_HEAD,
        RopeSchedule,
        norm_rope_triton,
        rope_schedule,
    )

    one_warp = RopeSchedule(1, 2, 1)
    if device == "cuda":
        assert rope_schedule(heads, 512) == one_warp
    # the interpreter runs ~30 ms per program: fewer tokens and at most 16 heads there
    T = 37 if device == "cuda" else 5
    heads = heads if device == "cuda" else min(heads, 16)
    (q, pos, freqs), kw = rope_inputs(
        "q_head_norm_rope", T, 21, shape="flash", dtype=BF16, device=device, mode="yarn"
    )
    q = q[:, :heads].contiguous()

    def run(x: torch.Tensor, p: torch.Tensor, sched: RopeSchedule) -> torch.Tensor:
        return norm_rope_triton(
            x, None, p, freqs, torch.empty_like(x), rope_dim=kw["rope_dim"], norm=NORM_HEAD,
            eps=kw["eps"], schedule=sched,
        )  # fmt: skip

    full = run(q, pos, one_warp)
    for t in (0, 2, T - 1):
        alone = run(q[t : t + 1].contiguous(), pos[t : t + 1], one_warp)
        assert torch.equal(full[t : t + 1], alone), f"token {t} differs alone"
    four_warps = run(q, pos, RopeSchedule(1, 8, 4))
    torch.testing.assert_close(full.float(), four_warps.float(), rtol=2**-7, atol=2**-7)


# ------------------------------------------------------------------------------ operators
@pytest.mark.parametrize("variant", ["", "_out"])
@pytest.mark.parametrize("op", ["apply_rope", "q_head_norm_rope", "kv_norm_rope"])
def test_rope_opcheck(op: str, variant: str, device) -> None:
    """Schema, fake kernel and AOT dispatch of the operators (torch.library.opcheck)."""
    _opt()
    dtype = BF16 if device == "cuda" else F32
    args, _ = rope_inputs(op, 5, 10, dtype=dtype, device=device)
    if op == "apply_rope":
        call: tuple = (*args, True, "triton")
    elif op == "q_head_norm_rope":
        call = (*args, EPS, "triton")
    else:
        call = (*args, EPS, True, "vllm", "triton")
    outs = {"out": torch.empty(args[0].shape, dtype=dtype, device=device)} if variant else {}
    torch.library.opcheck(getattr(torch.ops.dsv4mtp, op + variant).default, call, outs)


def test_compiled_q_and_kv_paths_have_no_graph_breaks(device) -> None:
    """torch.compile(fullgraph=True) traces the three public functions (checks, backend
    choice) into dsv4mtp operators; the compiled function gives eager's bits."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    opt = _opt()
    (q, pos, freqs), kw = rope_inputs("q_head_norm_rope", 5, 11, dtype=F32, device=device)
    (kv, w, _, _), _ = rope_inputs("kv_norm_rope", 5, 12, dtype=F32, device=device)

    def paths(q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qo = opt.q_head_norm_rope(q, pos, freqs, **kw)
        ko = opt.kv_norm_rope(kv, w, pos, freqs, **kw, fp8_kv=True)
        return qo, ko, opt.apply_rope(qo[..., DH - DR :], pos, freqs, inverse=True)

    eager = paths(q, kv)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(paths, fullgraph=True, backend="aot_eager")
    got = compiled(q, kv)
    assert dict(counters["graph_break"]) == {}
    assert all(torch.equal(g, e) for g, e in zip(got, eager, strict=True))
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ GPU tier
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4096])
@pytest.mark.parametrize("op", ["apply_rope", "q_head_norm_rope", "kv_norm_rope"])
def test_optimized_v4_flash_shapes(op: str, T: int) -> None:
    """V4-Flash (H 64, Dh 512, rope 64), bf16, positions up to 2**20, yarn frequencies and
    fp8_kv: against the reference in bf16 on the same device, and captured in a CUDA graph."""
    opt = _opt()
    args, kw = rope_inputs(
        op, T, 13, shape="flash", dtype=BF16, device="cuda", mode="yarn", max_position=2**20
    )
    if op == "kv_norm_rope":
        kw["fp8_kv"] = True
    got, want = _call(opt, op, args, kw)
    bound = 0.13 if op == "kv_norm_rope" else _SAME_DTYPE[BF16]
    assert _scaled_max(got, want) <= bound
    out = torch.empty_like(got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        getattr(opt, op)(*args, **kw, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
    assert math.isfinite(float(out.float().abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_in_place_inverse_rotation_at_v4_flash_shapes(T: int) -> None:
    """The attention output's in-place inverse rotation (out= the view o[..., 448:] itself) at
    V4-Flash shapes: bitwise the out-of-place rotation, eagerly and replayed in a CUDA graph."""
    opt = _opt()
    (view, pos, freqs), _ = rope_inputs(
        "apply_rope", T, 17, shape="flash", dtype=BF16, device="cuda", mode="yarn"
    )
    want = opt.apply_rope(view, pos, freqs, inverse=True)
    before = view.clone()
    opt.apply_rope(view, pos, freqs, inverse=True, out=view)
    assert torch.equal(view, want)
    view.copy_(before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.apply_rope(view, pos, freqs, inverse=True, out=view)
    view.copy_(before)  # the capture ran nothing; start from the input again
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(view, want)
