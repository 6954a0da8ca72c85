"""Non-default MoE schedules (optimized/kernels/moe_schedule.py) compute the declared function.

Every knob the H200 sweep (bench/diag/moe_sweep.py) may pick runs here through the kernels
(under the interpreter on CPU, the tiny shape): K splits with their ordered partial sums, the
grouped launch order, swapped dots, the integer-only decode and the interleaved FP4 dot, against
the float64 reference within the pairs' tolerance (conformance/pairs.py).  The knobs documented
as value-preserving (decode, group_m, the sort's chunk and warps) are checked bitwise against
the default, and a split schedule for batch invariance.  The router's schedules
(optimized/kernels/moe_route.py, :class:`RouteSchedule`) likewise: against float64 logits on
shapes no tile divides, against each other, and bitwise across T where the schedule is fixed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from dsv4mtp import formats
from dsv4mtp.conformance.differential import compare, to_float64
from dsv4mtp.conformance.inputs import moe_inputs
from dsv4mtp.conformance.registry import Case, pairs_for
from dsv4mtp.errors import ConfigError, InputError
from dsv4mtp.params import MoEParams, PackedExperts

pytest.importorskip("triton")

import triton
import triton.language as tl

from dsv4mtp.optimized.kernels import moe_gemm as moe_gemm_module
from dsv4mtp.optimized.kernels._launch import INTERPRET
from dsv4mtp.optimized.kernels.decode import _e2m1_pair_bf16, _e4m3_bf16
from dsv4mtp.optimized.kernels.moe_gemm import (
    FMT_FP8,
    FMT_MXFP4,
    _decode_for,
    moe_down_triton,
    moe_reduce_triton,
)
from dsv4mtp.optimized.kernels.moe_gemm_gluon import gluon_applies, gluon_tile_ok, uses_wgmma
from dsv4mtp.optimized.kernels.moe_route import RouteSchedule, route_config, route_triton
from dsv4mtp.optimized.kernels.moe_schedule import (
    schedule_from_fields,
    schedule_to_fields,
)
from dsv4mtp.optimized.moe import (
    GemmTile,
    MoESchedule,
    moe,
    moe_config,
    mx_rows,
    mx_tiles,
    pack_moe,
    route,
)

PAIRS = {p.name: p for p in pairs_for("moe")}
_T = GemmTile
# Schedules valid at the tiny shape (D 256, I 128) and the reduced one (D 1024, I 512).
SCHEDULES = {
    "split_group_swap_bits": MoESchedule(
        32, _T(64, 64, split_k=2, group_m=2), _T(32, 32, split_k=4, swap_ab=True),
        16, _T(16, 128, split_k=2, swap_ab=True), _T(32, 64, split_k=2, group_m=1),
        decode="bits", align_chunk=32,
    ),
    "join_swap": MoESchedule(
        16, _T(32, 64, swap_ab=True), _T(16, 128, group_m=3),
        32, _T(64, 32), _T(16, 128, swap_ab=True), fp4_join=True,
    ),
    "m64_split2": MoESchedule(
        64, _T(128, 128, split_k=2), _T(64, 64, split_k=2, swap_ab=True),
        64, _T(32, 64, split_k=4), _T(64, 32, split_k=4), decode="bits", fp4_join=True,
    ),
    # group-scaled dot_scaled GEMMs: 8-row blocks (the token side of a swapped dot), a split
    # gate/up; the unswapped orientation at 16 rows.  The FP8 shared expert falls back to "asm".
    "mxdot_m8_swap": MoESchedule(
        8, _T(64, 128, split_k=2, swap_ab=True), _T(128, 128, swap_ab=True),
        16, _T(64, 128), _T(64, 64, split_k=2), decode="mxdot", fp4_join=True,
    ),
    "mxdot_m16": MoESchedule(
        16, _T(32, 128, split_k=2), _T(64, 128, group_m=2),
        16, _T(64, 128, swap_ab=True), _T(64, 128), decode="mxdot",
    ),
}  # fmt: skip


def _check(op: str, got: torch.Tensor, args: tuple, kwargs: dict, preset: str = "math") -> None:
    pair = PAIRS[op]
    oracle = pair.reference_fn()(*to_float64(args), **to_float64(kwargs))
    if pair.canonical is not None:
        (got,), (oracle,), _ = pair.canonical(Case(args, kwargs), (got,), (oracle,))
    rep = compare(got, oracle)
    assert rep.within(pair.tolerance(torch.bfloat16, preset)), rep


def _shape(device: str) -> str:
    return "tiny" if device == "cpu" else "reduced"


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("split_group_swap_bits", "mxfp4"),
        ("join_swap", "nvfp4"),
        ("m64_split2", "fp8"),
        ("split_group_swap_bits", "nvfp4_folded"),
        ("mxdot_m8_swap", "mxfp4"),
        ("mxdot_m16", "mxfp4"),
        ("mxdot_m8_swap", "fp8"),
    ],
)
def test_moe_schedule_matches_the_reference(name: str, fmt: str, device: str) -> None:
    """The whole moe (router, routed experts, shared expert) under a non-default schedule."""
    args, kw = moe_inputs("moe", 9, 21, shape=_shape(device), fmt=fmt, device=device, magnitude=8.0)
    got = moe(*args, **kw, schedule=SCHEDULES[name])
    _check("moe", got, args, kw)


@pytest.mark.parametrize(("name", "fmt"), [("m64_split2", "mxfp4"), ("join_swap", "bf16")])
def test_fused_experts_schedule_matches_the_reference(name: str, fmt: str, device: str) -> None:
    """Caller routing with padding slots and an expert map (split partials of -1 slots and
    off-rank experts must contribute nothing)."""
    pair = PAIRS["fused_experts"]
    args, kw = moe_inputs(
        "fused_experts", 7, 4, shape=_shape(device), fmt=fmt, device=device, padding=0.25, ep=True
    )
    oargs, okw = pair.optimized_call(args, kw)
    got = pair.optimized_fn()(*oargs, **okw, schedule=SCHEDULES[name])
    _check("fused_experts", got, args, kw)


@pytest.mark.parametrize("decode", ["bits", "asm"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
def test_value_preserving_knobs_are_bitwise(fmt: str, decode: str, device: str) -> None:
    """decode, group_m and the sort's chunk / warps change no output bit (same dot operands,
    same sums); the rest of the schedule is the default.  T 12 (24 slots at top-2): the 16-slot
    chunk takes the sort's chunked path where the default chunk sorts in one program."""
    args, kw = moe_inputs("moe", 12, 8, shape=_shape(device), fmt=fmt, device=device)
    base = moe_config(12, batch_invariant=False)
    want = moe(*args, **kw, schedule=replace(base, decode="f16"))
    other = MoESchedule(
        base.block_m,
        GemmTile(**{**base.gate_up.__dict__, "group_m": 2}),
        GemmTile(**{**base.down.__dict__, "group_m": 1}),
        base.shared_block_m, base.shared_gate_up, base.shared_down,
        decode=decode, fp4_join=base.fp4_join, align_chunk=16, align_warps=2,
    )  # fmt: skip
    assert torch.equal(moe(*args, **kw, schedule=other), want)


@triton.jit
def _decode_all_kernel(c_ptr, s_ptr, e4m3_ptr, lo_ptr, hi_ptr, INTERP: tl.constexpr):
    r = tl.arange(0, 64)[:, None] * 64 + tl.arange(0, 64)[None, :]
    c = tl.load(c_ptr + r)
    tl.store(e4m3_ptr + r, _e4m3_bf16(c, INTERP))
    lo, hi = _e2m1_pair_bf16(c, tl.load(s_ptr + r), INTERP)
    tl.store(lo_ptr + r, lo)
    tl.store(hi_ptr + r, hi)


def test_code_decodes_are_exact_for_every_code(device: str) -> None:
    """The ``decode="asm"`` helpers (PTX on the GPU, integer ops in the interpreter) against the
    core's code tables, for all 256 bytes: e4m3 (subnormals and the largest code included) and
    both e2m1 nibbles times bf16 group scales from 2**-125 to 2**8 and e4m3 values (products
    below bf16's normal range, i.e. e8m0 scale bytes 0 and 1, are not claimed exact)."""
    codes = torch.arange(256, dtype=torch.int32).repeat(16).to(torch.uint8)  # (4096,)
    scale_set = torch.cat(
        [
            formats.decode_e8m0(torch.tensor([2, 50, 100, 119, 127, 135], dtype=torch.uint8)),
            formats.decode_e4m3(torch.tensor([1, 7, 8, 0x38, 0x7E, 0xB9], dtype=torch.uint8)),
            torch.tensor([1.0, 0.5, 2.0**-20, 0.75]),
        ]
    )  # (16,)
    scale = scale_set.repeat_interleave(256).to(torch.bfloat16)  # every code with every scale
    assert bool((scale.float() == scale_set.repeat_interleave(256)).all())  # exact in bf16
    dev = torch.device(device)
    out = [torch.empty(4096, dtype=torch.bfloat16, device=dev) for _ in range(3)]
    _decode_all_kernel[(1,)](codes.to(dev), scale.to(dev), *out, INTERP=INTERPRET)
    e4m3, lo, hi = (o.cpu() for o in out)
    s64 = scale.double()
    want_e4m3 = formats.decode_e4m3(codes, dtype=torch.float64)
    want_lo = formats.decode_e2m1(codes & 15, dtype=torch.float64) * s64
    want_hi = formats.decode_e2m1(codes >> 4, dtype=torch.float64) * s64
    finite = ~torch.isnan(want_e4m3)  # 0x7f / 0xff are e4m3's NaN: refused at load time
    assert torch.equal(e4m3.double()[finite], want_e4m3[finite])
    assert torch.equal(lo.double(), want_lo)
    assert torch.equal(hi.double(), want_hi)


@pytest.mark.parametrize("swap", [True, False])
def test_mxdot_values_are_exact_for_every_code_and_scale(swap: bool, device: str) -> None:
    """``decode="mxdot"`` (``dot_scaled`` on the GPU, the integer decode in the interpreter)
    through the down GEMM with one-hot rows: y[t, n] is then the weight (n, t) times its e8m0
    group scale, exact in fp32 and in bf16, for all 256 code bytes and scale bytes 0..250 (the
    products stay finite; byte 0 is 2**-127: the group scale is applied in fp32, so the
    subnormal products of bytes 0 and 1 are exact too).  The interpreter's fp32 -> bf16
    conversion flushes some subnormal results to zero, so on the CPU those products (under 1 %)
    are left out and the GPU run checks them."""
    N, K = 256, 128  # 256 rows of 64 code bytes: every byte 64 times; 1024 groups: every scale
    dev = torch.device(device)
    codes = (torch.arange(N * K // 2) % 256).to(torch.uint8).reshape(1, N, K // 2)
    scales = (torch.arange(N * K // 32) % 251).to(torch.uint8).reshape(1, N, K // 32)
    h = torch.eye(K, dtype=torch.bfloat16)  # token t = column t
    tile = GemmTile(128, 128, swap_ab=swap)
    y = moe_down_triton(
        h.to(dev), codes.to(dev), scales.to(dev), torch.ones(1, 3, device=dev), None, None,
        fmt=FMT_MXFP4, T=K, D=N, inter=K, rows_out=K, num_m_blocks=K // 8 if swap else K // 16,
        block_m=8 if swap else 16, tile=tile, decode="mxdot",
    ).cpu()  # fmt: skip
    c = codes[0]
    lo = formats.decode_e2m1(c & 15, dtype=torch.float64)
    hi = formats.decode_e2m1(c >> 4, dtype=torch.float64)
    w = torch.stack([lo, hi], -1).reshape(N, K)  # low nibble = even column
    w = w * formats.decode_e8m0(scales[0], dtype=torch.float64).repeat_interleave(32, dim=1)
    keep = (w == 0) | (w.abs() >= 2.0**-126) if INTERPRET else torch.ones_like(w, dtype=torch.bool)
    assert int(keep.sum()) > 0.9 * keep.numel()
    assert torch.equal(y.double().T[keep], w[keep])


@pytest.mark.parametrize("tiled", [False, True])
def test_mxstep_values_are_exact_for_every_code_and_scale(tiled: bool, device: str) -> None:
    """``decode="mxstep"`` (the K step's codes loaded at once, split into the scale groups in
    registers), on the checkpoint's rows and on the tiles layout (:func:`mx_tiles`), gives the
    same bits as ``"mxdot"`` on the rows: one-hot rows through the down GEMM, every code byte
    and scale byte 0..250 as in the test above."""
    N, K = 256, 128
    dev = torch.device(device)
    codes = (torch.arange(N * K // 2) % 256).to(torch.uint8).reshape(1, N, K // 2)
    scales = (torch.arange(N * K // 32) % 251).to(torch.uint8).reshape(1, N, K // 32)
    h = torch.eye(K, dtype=torch.bfloat16).to(dev)
    tile = GemmTile(128, 128, swap_ab=True)
    common = dict(fmt=FMT_MXFP4, T=K, D=N, inter=K, rows_out=K, num_m_blocks=K // 8, block_m=8,
                  tile=tile)  # fmt: skip
    ones = torch.ones(1, 3, device=dev)
    want = moe_down_triton(h, codes.to(dev), scales.to(dev), ones, None, None, **common,
                           decode="mxdot")  # fmt: skip
    if tiled:
        codes, scales = mx_tiles(codes, scales, interleaved=False)
    got = moe_down_triton(h, codes.to(dev), scales.to(dev), ones, None, None, **common,
                          decode="mxstep", tiled=tiled)  # fmt: skip
    assert torch.equal(got, want)


def test_tiles_layout_round_trips_and_interleaves_gate_and_up() -> None:
    """:func:`mx_tiles` puts byte (row r, byte b) of each expert at ((r // 128) * K/128 + b // 64)
    * 8192 + (r % 128) * 64 + b % 64 (scales: ... * 512 + (r % 128) * 4 + group), w13's row
    2c being gate column c and 2c + 1 up column c; :func:`mx_rows` inverts it."""
    E, I, K = 3, 128, 512
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (E, 2 * I, K // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (E, 2 * I, K // 32), dtype=torch.uint8, generator=g)
    tc, ts = mx_tiles(codes, scales, interleaved=True)
    assert tc.shape == codes.shape and ts.shape == scales.shape
    flat_c, flat_s = tc.reshape(E, -1), ts.reshape(E, -1)
    for e, r, b in ((0, 0, 0), (1, 5, 63), (2, 200, 100), (0, 255, 255), (1, 131, 64)):
        c, half = r // 2, r % 2  # packed row r holds gate (half 0) or up (half 1) column c
        src = c + half * I
        at = ((r // 128) * (K // 128) + b // 64) * 8192 + (r % 128) * 64 + b % 64
        assert flat_c[e, at] == codes[e, src, b]
        grp = b // 16
        at_s = ((r // 128) * (K // 128) + grp // 4) * 512 + (r % 128) * 4 + grp % 4
        assert flat_s[e, at_s] == scales[e, src, grp]
    back_c, back_s = mx_rows(tc, ts, interleaved=True)
    assert torch.equal(back_c, codes) and torch.equal(back_s, scales)
    rc, rs = mx_rows(*mx_tiles(codes, scales, interleaved=False), interleaved=False)
    assert torch.equal(rc, codes) and torch.equal(rs, scales)


@pytest.mark.parametrize("T", [3, 12])
def test_tiles_layout_matches_rows_layout(T: int, device: str) -> None:
    """The whole moe on a tiles pack against a rows pack of the same MXFP4 experts, under each
    pack's default schedule and under shared non-default ones (split K, unswapped 16-row blocks,
    the PTX decode, 64-wide K steps): within the pairs' tolerance of the float64 reference, and
    bitwise equal to the rows pack wherever the schedule is the same (the interpreter's fp32
    dots; the GPU's tensor-core order is not assumed here, though the H200 sweep found the two
    layouts' defaults bitwise equal too: bench/results/moe-h200.md, "The tiles layout")."""
    (x, params, cfg), kw = moe_inputs(
        "moe", T, 31, shape=_shape(device), fmt="mxfp4", device=device, magnitude=8.0
    )
    rows = pack_moe(params, device, mxfp4_layout="rows")
    tiles = pack_moe(params, device)
    assert (rows.layout, tiles.layout, tiles.kernel_fmt) == ("rows", "tiles", "mxfp4_tiles_fold")
    for e in range(rows.num_local_experts):
        a, b = rows.decode_expert(e), tiles.decode_expert(e)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    got = moe(x, tiles, cfg, **kw)
    _check("moe", got, (x, params, cfg), kw)
    base = moe_config(T, batch_invariant=False, fmt="mxfp4_tiles")
    for s in (
        replace(base, gate_up=replace(base.gate_up, split_k=2)),
        replace(
            base,
            block_m=16,
            gate_up=replace(base.gate_up, swap_ab=False),
            down=replace(base.down, swap_ab=False, block_n=64),
        ),
        replace(base, decode="asm", gate_up=replace(base.gate_up, block_k=64)),
        moe_config(T, batch_invariant=True, fmt="mxfp4_tiles"),
    ):
        got = moe(x, tiles, cfg, **kw, schedule=s)
        _check("moe", got, (x, params, cfg), kw)
        if INTERPRET:
            assert torch.equal(got, moe(x, rows, cfg, **kw, schedule=s)), s


def _private_experts(params: MoEParams) -> MoEParams:
    """``params`` with its own copy of the routed experts' tensors (the builder's params are
    cached and shared between tests: an in-place repack must not reach them)."""
    ex = params.experts.packed
    mine = {
        name: getattr(ex, name).clone()
        for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    }
    return replace(params, experts=PackedExperts(replace(ex, **mine)))


def test_tiles_repack_copies_unless_told_to_reuse(device: str) -> None:
    """By default the tiles are a copy and the params' expert tensors keep the checkpoint's
    rows; ``reuse_expert_memory=True`` reorders those tensors in place (the pack holds the
    same storage, no second copy) and gives the same pack bit for bit."""
    (x, shared_params, cfg), kw = moe_inputs(
        "moe", 4, 2, shape=_shape(device), fmt="mxfp4", device=device
    )
    params = _private_experts(shared_params)
    ex = params.experts.packed
    before = [t.clone() for t in (ex.w13_weight, ex.w13_weight_scale, ex.w2_weight)]
    copied = pack_moe(params, device)
    after = (ex.w13_weight, ex.w13_weight_scale, ex.w2_weight)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    want = moe(x, copied, cfg, **kw)
    reused = pack_moe(params, device, reuse_expert_memory=True)
    assert reused.w13.untyped_storage().data_ptr() == ex.w13_weight.untyped_storage().data_ptr()
    assert reused.s2.untyped_storage().data_ptr() == ex.w2_weight_scale.untyped_storage().data_ptr()
    for name in ("w13", "s13", "w2", "s2"):
        assert torch.equal(getattr(reused, name), getattr(copied, name)), name
    assert torch.equal(moe(x, reused, cfg, **kw), want)
    shared_ex = shared_params.experts.packed  # the cached params kept their rows
    assert torch.equal(shared_ex.w13_weight, before[0]) and torch.equal(
        shared_ex.w13_weight_scale, before[1]
    )


def test_tiles_in_place_over_several_chunks() -> None:
    """The in-place reorder works a chunk of experts at a time: with more experts than one
    chunk (and a last, partial one) it gives the copy's bytes."""
    g = torch.Generator().manual_seed(1)
    E, N, K = 37, 256, 256  # chunks of 16: 16, 16, 5
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (E, N, K // 32), dtype=torch.uint8, generator=g)
    want = mx_tiles(codes, scales, interleaved=True)
    c, s = codes.clone(), scales.clone()
    got = mx_tiles(c, s, interleaved=True, in_place=True)
    assert got[0].data_ptr() == c.data_ptr() and got[1].data_ptr() == s.data_ptr()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(InputError, match="contiguous"):
        mx_tiles(codes.transpose(1, 2), scales, interleaved=False)


def test_tiles_layout_validation(device: str) -> None:
    """An unknown layout, and K steps wider than a tile block, are refused by name."""
    (x, params, cfg), kw = moe_inputs("moe", 2, 1, shape=_shape(device), fmt="mxfp4", device=device)
    with pytest.raises(InputError, match="mxfp4_layout"):
        pack_moe(params, device, mxfp4_layout="columns")
    pack = pack_moe(params, device)
    base = moe_config(2, batch_invariant=False, fmt=pack.kernel_fmt)
    wide = replace(base, gate_up=replace(base.gate_up, block_k=256, split_k=1))  # K = D = 256
    with pytest.raises(ConfigError, match="tiles layout need block_k <= 128"):
        moe(x, pack, cfg, **kw, schedule=wide)
    # FP8 experts keep their rows whatever the layout asked for
    fp8 = moe_inputs("moe", 2, 1, shape=_shape(device), fmt="fp8", device=device)[0][1]
    assert pack_moe(fp8, device, mxfp4_layout="tiles").layout == "rows"


def test_tiles_fold_flag_follows_the_scale_bytes(device: str) -> None:
    """``MoEPack.mx_fold`` (the Gluon GEMMs may apply the e8m0 scales in their bf16 decode) is
    set exactly when every routed scale byte is <= 128: the test experts' (scales far below
    1), not after one w2 byte is raised to 129; never for the rows layout; and a pack that
    claims it on rows is refused."""
    (x, shared_params, cfg), kw = moe_inputs(
        "moe", 2, 1, shape=_shape(device), fmt="mxfp4", device=device
    )
    pack = pack_moe(shared_params, device)
    assert pack.mx_fold and pack.kernel_fmt == "mxfp4_tiles_fold"
    rows = pack_moe(shared_params, device, mxfp4_layout="rows")
    assert not rows.mx_fold and rows.kernel_fmt == "mxfp4"
    params = _private_experts(shared_params)
    params.experts.packed.w2_weight_scale.view(-1)[-1] = 129
    big = pack_moe(params, device)
    assert not big.mx_fold and big.kernel_fmt == "mxfp4_tiles"
    _check("moe", moe(x, big, cfg, **kw), (x, params, cfg), kw)
    with pytest.raises(InputError, match="mx_fold"):
        replace(rows, mx_fold=True)
    with pytest.raises(InputError, match="above 128"):
        replace(big, mx_fold=True)


def _with_fp8_shared(params: MoEParams, kind: str) -> MoEParams:
    """``params`` with an FP8 shared expert stored as 128x128 blocks (``kind`` "fp8_e8m0":
    power-of-two scales; "fp8_f32": any fp32 scales), its dense copies (the reference's input)
    the codes' exact decode."""
    import dataclasses

    from dsv4mtp.conformance.inputs import linear_weight

    inter, D = params.shared_w1.shape
    shared = (
        linear_weight(1, inter, D, kind, seed=5),
        linear_weight(1, inter, D, kind, seed=6),
        linear_weight(1, D, inter, kind, seed=7),
    )
    dev = params.shared_w1.device
    dense = [q.dequantize(torch.bfloat16).to(dev) for q in shared]
    return dataclasses.replace(
        params, shared_w1=dense[0], shared_w3=dense[1], shared_w2=dense[2],
        shared_fp8=tuple(q.to(dev) for q in shared),
    )  # fmt: skip


def test_shared_expert_on_cublas_from_256_rows(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared expert runs on cuBLAS over bf16 weights (kernels/moe_gemm.py,
    ``shared_expert_mm``) from ``DEQUANT_MM_MIN_ROWS`` (256) rows, not batch invariant, bf16
    activations, when its weights are bf16 or FP8 codes whose block scales are powers of two
    (``MoEPack.shared_exact_bf16``: the bf16 weight is then exact).  The rule; the pack's flag
    (set for e8m0 scales, not for fp32 ones, refused when claimed wrongly); and the whole moe
    within the moe tolerance of the float64 reference through the path (counted: two GEMMs per
    call), with the threshold lowered to 8 rows so the interpreter runs a small case, while the
    batch-invariant call, the fp32-scale pack and a call below the threshold keep the Triton
    kernels; under the ``math`` and the ``official`` preset (e4m3-rounded activations)."""
    from dsv4mtp.optimized.kernels import linear as linear_module
    from dsv4mtp.optimized.kernels.moe_gemm import shared_mm_selected

    bf16, fp32 = torch.bfloat16, torch.float32
    assert shared_mm_selected(256, True, bf16, False)
    assert not shared_mm_selected(255, True, bf16, False)
    assert not shared_mm_selected(4096, False, bf16, False)  # fp32 block scales
    assert not shared_mm_selected(4096, True, fp32, False)
    assert not shared_mm_selected(4096, True, bf16, True)

    (x, params, cfg), kw = moe_inputs(
        "moe", 12, 4, shape=_shape(device), fmt="mxfp4", device=device
    )
    exact = _with_fp8_shared(params, "fp8_e8m0")
    inexact = _with_fp8_shared(params, "fp8_f32")
    pack, pack_f32, pack_bf16 = (pack_moe(p, device) for p in (exact, inexact, params))
    assert pack.shared_fmt == "fp8" and pack.shared_exact_bf16
    assert pack.shared_op_fmt == "fp8_exact"
    assert pack_f32.shared_fmt == "fp8" and not pack_f32.shared_exact_bf16
    assert pack_bf16.shared_fmt == "bf16" and not pack_bf16.shared_exact_bf16
    for wrong in (pack_f32, pack_bf16):
        with pytest.raises(InputError, match="shared_exact_bf16"):
            replace(wrong, shared_exact_bf16=True)

    gemms: list[int] = []
    real = moe_gemm_module._dense_mm

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        gemms.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_gemm_module, "_dense_mm", spy)
    monkeypatch.setattr(linear_module, "DEQUANT_MM_MIN_ROWS", 8)
    # the official preset: e4m3-rounded activations (x, and h between the two GEMMs)
    official = PAIRS["moe"].preset_kwargs("official")
    assert official["act_quant"], official
    for pk, p in ((pack, exact), (pack_bf16, params)):
        for extra, preset in (({}, "math"), (official, "official")):
            gemms.clear()
            kwp = {**kw, **extra}
            got = moe(x, pk, cfg, **kwp)
            _check("moe", got, (x, p, cfg), kwp, preset)
            assert gemms == [12, 12], (preset, gemms)
            # against the Triton kernels on the same pack: the same roundings in another fp32
            # order (on the CPU, where both sum in order, the same bits); an e4m3 rounding of
            # h left out differs by 7e-3 to 2e-2 here, more than the tolerance check sees
            monkeypatch.setattr(linear_module, "DEQUANT_MM_MIN_ROWS", 256)
            want = moe(x, pk, cfg, **kwp)
            monkeypatch.setattr(linear_module, "DEQUANT_MM_MIN_ROWS", 8)
            if device == "cpu":
                assert torch.equal(got, want), preset
            else:
                rel = float((got.double() - want.double()).norm() / want.double().norm())
                assert rel < 2e-3, (preset, rel)
    for pk, p, call in (
        (pack, exact, dict(batch_invariant=True)),
        (pack_f32, inexact, {}),
        (pack, exact, dict(rows=7)),
    ):
        gemms.clear()
        rows = call.pop("rows", 12)
        xr = x[:rows].contiguous()
        _check("moe", moe(xr, pk, cfg, **kw, **call), (xr, p, cfg), {**kw, **call})
        assert gemms == [], (call, gemms)


def test_shared_fork_default_by_the_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared expert forks onto its side stream after the sort up to 8 rows and after the
    router above (measured: bench/results/moe-h200.md, "Where the shared expert forks");
    ``SHARED_FORK`` overrides it for every T, and a name it does not know is an InputError."""
    from dsv4mtp.optimized import _ops

    assert [_ops.shared_fork(T) for T in (1, 2, 8, 9, 64, 4096)] == (["align"] * 3 + ["router"] * 3)
    monkeypatch.setattr(_ops, "SHARED_FORK", "gate_up")
    assert {_ops.shared_fork(T) for T in (1, 64)} == {"gate_up"}
    monkeypatch.setattr(_ops, "SHARED_FORK", "down")
    with pytest.raises(InputError, match="SHARED_FORK"):
        _ops.shared_fork(1)


@pytest.mark.gpu
@pytest.mark.parametrize("fork", ["router", "align", "gate_up"])
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_shared_expert_side_stream_changes_no_bit(
    T: int, fork: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shared_stream`` (the default: the shared expert on a side stream, joined before the
    reduce) against the shared expert in order, at V4-Flash experts (MXFP4 tiles, the FP8
    shared expert), forking at each point of the routed chain (``SHARED_FORK``): bitwise equal
    eagerly and from a captured CUDA graph's replays, with the input changed between replays
    (so a missing join would read a stale or partial row)."""
    from dsv4mtp.optimized import _ops

    monkeypatch.setattr(_ops, "SHARED_FORK", fork)
    (x, params, cfg), kw = moe_inputs("moe", T, 3, shape="flash", fmt="mxfp4", device="cuda")
    pack = pack_moe(params, "cuda")
    default = moe_config(T, batch_invariant=False, fmt=pack.kernel_fmt)
    assert default.shared_stream == (T <= 64)  # the default: the side stream at decode sizes
    s = replace(default, shared_stream=True)
    in_order = replace(s, shared_stream=False)
    want = moe(x, pack, cfg, **kw, schedule=in_order)
    assert torch.equal(moe(x, pack, cfg, **kw, schedule=s), want)
    static = x.clone()
    out = torch.empty_like(x)
    moe(static, pack, cfg, **kw, schedule=s, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe(static, pack, cfg, **kw, schedule=s, out=out)
    for scale in (1.0, -0.5, 2.0):
        static.copy_(x * scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe(static, pack, cfg, **kw, schedule=in_order)), scale


def test_mxdot_falls_back_where_it_does_not_apply() -> None:
    """``"mxdot"`` runs for MXFP4 codes, bf16 activations, 128-wide K steps and 4-byte aligned
    scale rows; anything else (the FP8 shared expert, fp32 activations, other steps, a scale
    view at an odd offset) takes ``"asm"`` rather than failing or reading misaligned words."""
    s = torch.zeros(2, 64, 8, dtype=torch.uint8)
    bf = torch.bfloat16
    assert _decode_for("mxdot", FMT_MXFP4, bf, s, 128, False) == "mxdot"
    assert _decode_for("mxdot", FMT_FP8, bf, s, 128, False) == "asm"
    assert _decode_for("mxdot", FMT_MXFP4, torch.float32, s, 128, False) == "asm"
    assert _decode_for("mxdot", FMT_MXFP4, bf, s, 64, False) == "asm"
    odd = torch.zeros(2 * 64 * 8 + 1, dtype=torch.uint8)[1:].view(2, 64, 8)
    assert _decode_for("mxdot", FMT_MXFP4, bf, odd, 128, False) == "asm"
    assert _decode_for("mxstep", FMT_MXFP4, bf, s, 128, True) == "mxstep"
    assert _decode_for("mxstep", FMT_FP8, bf, s, 128, False) == "asm"
    assert _decode_for("bits", FMT_MXFP4, bf, s, 128, False) == "bits"
    # "gluon": compiled launches on the tiles layout only (no interpreter), else "mxstep" and
    # its own fallbacks (the FP8 shared expert of a gluon schedule takes "asm")
    assert _decode_for("gluon", FMT_MXFP4, bf, s, 128, True) == ("mxstep" if INTERPRET else "gluon")
    assert _decode_for("gluon", FMT_MXFP4, bf, s, 128, False) == "mxstep"
    assert _decode_for("gluon", FMT_FP8, bf, s, 128, False) == "asm"
    assert _decode_for("gluon", FMT_MXFP4, torch.float32, s, 128, True) == "asm"
    assert _decode_for("gluon", FMT_MXFP4, bf, odd, 128, True) == "asm"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rows", "tiles"])
@pytest.mark.parametrize("T", [1, 64, 128, 300, 700, 1024])
def test_mxdot_defaults_at_v4_flash_shapes(T: int, layout: str) -> None:
    """The default's group-scaled GEMMs at V4-Flash experts (D 4096, I 2048, E 256, top-6),
    MXFP4, in both ``pack_moe`` layouts (``"mxdot"`` on the checkpoint's rows, the Gluon GEMMs
    on the tiles), within the moe tolerance of the float64 reference: 8-row blocks with K
    splits (T 1), without (T 64, 128), 16-row blocks (T 300, 700; at T 1024 on the tiles the
    wgmma kernel on 32-row blocks, the scales of these experts folding); on the rows above T 768
    the PTX decode on 64-row blocks (T 1024)."""
    (x, params, cfg), kw = moe_inputs("moe", T, 7, shape="flash", fmt="mxfp4", device="cuda")
    pack = pack_moe(params, "cuda", mxfp4_layout=layout)
    s = moe_config(T, batch_invariant=False, fmt=pack.kernel_fmt)
    group_scaled, last = ("mxdot", 768) if layout == "rows" else ("gluon", 1024)
    assert s.decode == (group_scaled if last >= T else "asm")
    _check("moe", moe(x, pack, cfg, **kw, schedule=s), (x, params, cfg), kw)


def _count_wgmma_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the ``block_m`` of every Gluon GEMM launched on the wgmma kernel
    (``uses_wgmma``): a call that fell back to ``"mxstep"`` or ran mma_v2 records nothing."""
    seen: list[int] = []
    real = moe_gemm_module.moe_mx_gluon

    def spy(*args: Any, **kwargs: Any) -> None:
        if uses_wgmma(kwargs["tile"], kwargs["block_m"], kwargs["fold"]):
            seen.append(kwargs["block_m"])
        real(*args, **kwargs)

    monkeypatch.setattr(moe_gemm_module, "moe_mx_gluon", spy)
    return seen


@pytest.mark.gpu
def test_gluon_values_are_exact_for_every_code_and_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode="gluon"`` (kernels/moe_gemm_gluon.py) through the down GEMM with one-hot rows,
    every code byte and scale byte 0..250 as in the tests above: each unscaled fp32 partial is
    one weight times its e8m0 group scale, exact (the group's MMA sums one non-zero product;
    the scale multiplies in fp32, byte 0 as 2**-127).  With ``fold`` (scale bytes 0..128, a
    pack's ``mx_fold``) the scale is applied in the bf16 decode, exact too (bytes 0 and 1 give
    bf16 subnormals, which the MMA keeps).  Also two K splits (the partials of the other split
    are zero), 64-row programs and 16- and 32-row M blocks; with ``fold``, the wgmma kernel on
    32-, 64- and 128-row M blocks (its launches counted: no fallback passes for it)."""
    wgmma = _count_wgmma_launches(monkeypatch)
    N, K = 256, 256
    codes = (torch.arange(N * K // 2) % 256).to(torch.uint8).reshape(1, N, K // 2)
    c = codes[0]
    lo = formats.decode_e2m1(c & 15, dtype=torch.float64)
    hi = formats.decode_e2m1(c >> 4, dtype=torch.float64)
    w = torch.stack([lo, hi], -1).reshape(N, K)
    h = torch.eye(K, dtype=torch.bfloat16, device="cuda")
    # slot of row r: the reverse order, so the partial rows are scattered as the kernel must
    sorted_slot = torch.arange(K - 1, -1, -1, dtype=torch.int32, device="cuda")
    block_expert = torch.zeros(K // 8, dtype=torch.int32, device="cuda")
    ones = torch.ones(1, 3, device="cuda")
    # fold: the scale in the bf16 decode, for scale bytes 0..128 only (a pack's mx_fold)
    for fold, top in ((False, 251), (True, 129)):
        sc = (torch.arange(N * K // 32) % top).to(torch.uint8).reshape(1, N, K // 32)
        tc, ts = (t.cuda() for t in mx_tiles(codes, sc, interleaved=False))
        want = w * formats.decode_e8m0(sc[0], dtype=torch.float64).repeat_interleave(32, dim=1)
        for tile, bm in (
            (GemmTile(128, 128, swap_ab=True), 8),
            (GemmTile(64, 128, split_k=2), 16),
            (GemmTile(128, 128), 32),
            # the wgmma kernel (32-, 64- and 128-row blocks) folds the scales only
            *(
                (
                    (GemmTile(128, 128, num_warps=8), 128),
                    (GemmTile(64, 128, split_k=2), 64),
                    (GemmTile(128, 128, num_warps=8, num_stages=4), 32),
                    (GemmTile(64, 128), 32),
                )
                if fold
                else ()
            ),
        ):
            y = moe_down_triton(
                h, tc, ts, ones, sorted_slot, block_expert[: K // bm], fmt=FMT_MXFP4, T=K, D=N,
                inter=K, rows_out=K, num_m_blocks=K // bm, block_m=bm, tile=tile,
                decode="gluon", tiled=True, fold=fold,
            )  # fmt: skip
            assert y.dtype == torch.float32 and y.shape == (tile.split_k, K, N)
            got = y.double().sum(0).flip(0).T.cpu()  # (N, K): weight (n, k) at row K-1-k
            assert torch.equal(got, want), (fold, tile)
    assert wgmma == [128, 64, 32, 32]


def _replay_equals_eager(x: torch.Tensor, pack: Any, cfg: Any, kw: dict[str, Any]) -> bool:
    """The default moe captured on a copy of x, replayed on x's rows reversed: asserts the
    replay equals the eager call on the same rows, and returns whether it changed from the
    first input's output (it must, unless the rows are all alike)."""
    x_static = x.clone()
    out = moe(x_static, pack, cfg, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(x_static, pack, cfg, **kw)
    x_static.copy_(x.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, moe(x_static, pack, cfg, **kw))
    return not torch.equal(captured, out)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 200, 512])
def test_gluon_gemms_at_v4_flash_shapes(T: int) -> None:
    """The Gluon routed GEMMs at V4-Flash experts (D 4096, I 2048, E 256, top-6), MXFP4
    tiles: within the moe tolerance of the float64 reference under the default and with
    another split, 64- / 256-row programs and 16- and 32-row M blocks; each row's bits the same in
    a batch of one (batch invariant for a fixed schedule); a CUDA-graph replay equal to the
    eager call."""
    (x, params, cfg), kw = moe_inputs("moe", T, 11, shape="flash", fmt="mxfp4", device="cuda")
    pack = pack_moe(params, "cuda")
    d = moe_config(T, batch_invariant=False, fmt=pack.kernel_fmt)
    assert d.decode == "gluon" and pack.mx_fold
    split = d.gate_up.split_k
    # the fold (scales in the decode: this pack's bytes are <= 128) and the fp32 scale rule
    for pk in (pack, replace(pack, mx_fold=False)):
        for s in (
            d,
            replace(d, gate_up=replace(d.gate_up, split_k=2 * split),
                    down=replace(d.down, block_n=64)),
            replace(d, gate_up=replace(d.gate_up, block_n=256), down=replace(d.down, block_n=256)),
            replace(d, block_m=16),
            replace(d, block_m=32),
        ):  # fmt: skip
            _check("moe", moe(x, pk, cfg, **kw, schedule=s), (x, params, cfg), kw)
            # the router's batch-invariant schedule, so that only the experts' could differ
            full = moe(x, pk, cfg, **kw, schedule=s, batch_invariant=True)
            one = moe(x[-1:].clone(), pk, cfg, **kw, schedule=s, batch_invariant=True)
            assert torch.equal(full[-1:], one)
    assert _replay_equals_eager(x, pack, cfg, kw) or T == 1


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1024, 1500, 4096])
def test_wgmma_gemms_at_v4_flash_shapes(T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon wgmma GEMMs (the default for a pack whose scales fold: 32-row M blocks from T
    768 to 1024, 64-row blocks above) at V4-Flash experts (D 4096, I 2048, E 256, top-6):
    within the moe tolerance of the float64 reference under the default and with 32- and
    128-row blocks, one warpgroup (64 weight rows), three or five stages and a K split of 2;
    every schedule gives each row the bits of the default (the same chain of MMAs, whatever
    the MMA's N) and of the same row in a batch of one; a
    CUDA-graph replay equals the eager call.  Each schedule's two routed GEMMs are counted as
    wgmma launches (a fallback would pass the value checks).  A pack whose scales do not fold
    keeps the mma_v2 GEMMs on 16-row blocks up to T 1024 and the PTX decode above."""
    wgmma = _count_wgmma_launches(monkeypatch)
    (x, params, cfg), kw = moe_inputs("moe", T, 11, shape="flash", fmt="mxfp4", device="cuda")
    pack = pack_moe(params, "cuda")
    d = moe_config(T, batch_invariant=False, fmt=pack.kernel_fmt)
    assert d.decode == "gluon" and d.block_m == (32 if T <= 1024 else 64) and pack.mx_fold
    assert uses_wgmma(d.gate_up, d.block_m, True) and uses_wgmma(d.down, d.block_m, True)
    # without the fold: the mma_v2 GEMMs on 16-row blocks up to T 1024, the PTX decode above
    nofold = moe_config(T, batch_invariant=False, fmt="mxfp4_tiles")
    assert (nofold.decode, nofold.block_m) == (("gluon", 16) if T <= 1024 else ("asm", 64))
    want = moe(x, pack, cfg, **kw, schedule=d)
    _check("moe", want, (x, params, cfg), kw)
    assert wgmma == [d.block_m] * 2
    one_wg = GemmTile(64, 128, num_warps=4, num_stages=4)
    for s in (
        replace(d, block_m=128),
        replace(d, block_m=64),
        replace(d, block_m=32),
        replace(d, block_m=32, gate_up=one_wg),
        replace(d, gate_up=replace(d.gate_up, num_stages=3), down=replace(d.down, num_stages=5)),
        replace(d, gate_up=one_wg, down=one_wg),
        replace(d, block_m=128, gate_up=replace(d.gate_up, split_k=2)),
    ):
        wgmma.clear()
        got = moe(x, pack, cfg, **kw, schedule=s)
        assert wgmma == [s.block_m] * 2, s
        if s.gate_up.split_k == 1:
            assert torch.equal(got, want), s
        else:  # two fp32 partials summed: another order
            _check("moe", got, (x, params, cfg), kw)
        full = moe(x, pack, cfg, **kw, schedule=s, batch_invariant=True)
        one = moe(x[-1:].clone(), pack, cfg, **kw, schedule=s, batch_invariant=True)
        assert torch.equal(full[-1:], one)
    assert _replay_equals_eager(x, pack, cfg, kw)


def _count_swiglu_launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, per Gluon GEMM launch of the moe, whether it was asked to write the SwiGLU
    rows itself (its ``swiglu`` argument)."""
    fused: list[bool] = []
    real = moe_gemm_module.moe_mx_gluon

    def spy(*args: Any, **kwargs: Any) -> None:
        fused.append(kwargs.get("swiglu") is not None)
        real(*args, **kwargs)

    monkeypatch.setattr(moe_gemm_module, "moe_mx_gluon", spy)
    return fused


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1024, 4096])
def test_wgmma_swiglu_epilogue_gives_the_bits_of_the_swiglu_pass(
    T: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wgmma gate/up GEMM with one K split applies the SwiGLU in its epilogue
    (``WGMMA_SWIGLU_EPILOGUE``, kernels/moe_gemm_gluon.py ``_store_swiglu``): the whole moe at
    V4-Flash experts with inputs of magnitude 8 (a good share of gate and up past the clamp)
    gives the bits of the same GEMM's fp32 partials finished by ``moe_swiglu_kernel``, under the
    default (32-row blocks at T 1024, 64 at 4096) and on 128-row blocks, and stays within the
    moe tolerance of the float64 reference.  The fused launches are counted (gate/up fused,
    down not; none with the switch off)."""
    fused = _count_swiglu_launches(monkeypatch)
    (x, params, cfg), kw = moe_inputs(
        "moe", T, 5, shape="flash", fmt="mxfp4", device="cuda", magnitude=8.0
    )
    pack = pack_moe(params, "cuda")
    d = moe_config(T, batch_invariant=False, fmt=pack.kernel_fmt)
    for s in (d, replace(d, block_m=128)):
        fused.clear()
        got = moe(x, pack, cfg, **kw, schedule=s)
        assert fused == [True, False], s
        monkeypatch.setattr(moe_gemm_module, "WGMMA_SWIGLU_EPILOGUE", False)
        fused.clear()
        want = moe(x, pack, cfg, **kw, schedule=s)
        monkeypatch.setattr(moe_gemm_module, "WGMMA_SWIGLU_EPILOGUE", True)
        assert fused == [False, False], s
        assert torch.equal(got, want), s
        _check("moe", got, (x, params, cfg), kw)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 8, 64, 512])
def test_gluon_swiglu_tail_gives_the_bits_of_the_swiglu_pass(
    T: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mma_v2 gate/up GEMM finishes the SwiGLU in its own launch (``GLUON_SWIGLU_TAIL``,
    kernels/moe_gemm_gluon.py ``_swiglu_after_splits``: each tile's last K split, by ticket):
    the whole moe at V4-Flash experts with inputs of magnitude 8 (gate and up past the clamp)
    gives the bits of the same partials finished by ``moe_swiglu_kernel``, under the default
    (K split 4 / 2 / 2 / 1 / 1 at T 1 / 3 / 8 / 64 / 512, 8- and 16-row blocks), with the
    split doubled and halved, and without the fold; a CUDA-graph replay (its counters zeroed
    inside the graph) equals the eager call.  The fused launches are counted."""
    fused = _count_swiglu_launches(monkeypatch)
    (x, params, cfg), kw = moe_inputs(
        "moe", T, 6, shape="flash", fmt="mxfp4", device="cuda", magnitude=8.0
    )
    pack = pack_moe(params, "cuda")
    d = moe_config(T, batch_invariant=False, fmt=pack.kernel_fmt)
    assert d.decode == "gluon" and not uses_wgmma(d.gate_up, d.block_m, pack.mx_fold)
    k = d.gate_up.split_k
    splits = {k, 2 * k, max(1, k // 2)}
    for pk in (pack, replace(pack, mx_fold=False)):
        for split in sorted(splits):
            s = replace(d, gate_up=replace(d.gate_up, split_k=split))
            fused.clear()
            got = moe(x, pk, cfg, **kw, schedule=s)
            assert fused == [True, False], (split, pk.mx_fold)
            monkeypatch.setattr(moe_gemm_module, "GLUON_SWIGLU_TAIL", False)
            fused.clear()
            want = moe(x, pk, cfg, **kw, schedule=s)
            monkeypatch.setattr(moe_gemm_module, "GLUON_SWIGLU_TAIL", True)
            assert fused == [False, False], (split, pk.mx_fold)
            assert torch.equal(got, want), (split, pk.mx_fold)
    _check("moe", got, (x, params, cfg), kw)
    # replay == eager is asserted inside; one row reversed is the same input, so the output
    # changes only from 2 rows on
    assert _replay_equals_eager(x, pack, cfg, kw) or T == 1


@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_default_schedule_fits_small_k(T: int, device: str) -> None:
    """The default schedule's K splits (GPU: 4-way at T <= 2, 2-way at T <= 8) on the tiny
    shape, whose K (D 256, I 128) cannot be split four ways in 128-wide steps: the launchers
    split less instead of reading misaligned slices (which returned NaN and garbage before)."""
    for fmt in ("mxfp4", "fp8"):
        args, kw = moe_inputs("moe", T, 5, shape="tiny", fmt=fmt, device=device, magnitude=4.0)
        _check("moe", moe(*args, **kw), args, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 8])
def test_default_split_schedules_at_v4_flash_shapes(T: int) -> None:
    """The default's K-split schedules (4-way at T 1, 2-way at T 5 and 8) at V4-Flash experts
    (D 4096, I 2048, E 256, top-6), MXFP4: within the moe tolerance of the float64 reference."""
    args, kw = moe_inputs("moe", T, 7, shape="flash", fmt="mxfp4", device="cuda")
    _check("moe", moe(*args, **kw), args, kw)


def test_split_schedule_is_batch_invariant(device: str) -> None:
    (x, params, cfg), _ = moe_inputs("moe", 9, 13, shape=_shape(device), fmt="fp8", device=device)
    s = SCHEDULES["split_group_swap_bits"]
    full = moe(x, params, cfg, schedule=s)
    one = moe(x[4:5].clone(), params, cfg, schedule=s)
    assert torch.equal(full[4:5], one)


def test_schedule_validation() -> None:
    with pytest.raises(ConfigError, match="block_m"):
        MoESchedule(
            48, GemmTile(64, 128), GemmTile(64, 128), 16, GemmTile(64, 128), GemmTile(64, 128)
        )
    with pytest.raises(ConfigError, match="block_k"):
        GemmTile(64, 16)
    with pytest.raises(ConfigError, match="split_k"):
        GemmTile(64, 128, split_k=3)
    with pytest.raises(ConfigError, match="decode"):
        s = moe_config(1, batch_invariant=True)
        MoESchedule(16, s.gate_up, s.down, 16, s.shared_gate_up, s.shared_down, decode="lut")
    in_order = replace(moe_config(1, batch_invariant=False), shared_stream=False)
    gluon = replace(in_order, decode="gluon", block_m=32)
    for s in (*SCHEDULES.values(), moe_config(1, batch_invariant=False), in_order, gluon):
        assert schedule_from_fields(tuple(schedule_to_fields(s))) == s
    with pytest.raises(ConfigError, match="shared_stream"):
        replace(in_order, shared_stream=1)
    b = moe_config(4096, batch_invariant=True)
    assert all(moe_config(t, batch_invariant=True) == b for t in (1, 8, 64, 512))


def _word_view(x: torch.Tensor) -> torch.Tensor:
    """A copy of x at a 4-byte but not 16-byte aligned address."""
    buf = torch.zeros(x.numel() + 8, dtype=x.dtype)
    out = buf[2 : 2 + x.numel()].view(x.shape)
    out.copy_(x)
    return out


def test_gluon_applies_only_where_the_kernel_can_run() -> None:
    """The Gluon GEMMs take a call only at their shapes (8-, 16- or 32-row blocks, 128-wide K
    steps, 16 x (1, 2, 4) x warps weight rows per program dividing N, K a multiple of 128 x
    split; the wgmma kernel's 64- and 128-row blocks, and 32-row blocks with folded scales and
    a wgmma tile: 16 x warps rows, three or more stages) and with x and the codes contiguous
    at 4-byte aligned addresses (they
    are read as int32 words; 16-byte aligned x for the wgmma kernel's copies); anything else
    runs as ``"mxstep"`` (checked here without a GPU: the launchers decide on these
    predicates before any launch)."""
    x = torch.zeros(8, 512, dtype=torch.bfloat16)
    codes = torch.zeros(2, 256, 256, dtype=torch.uint8)
    ok = GemmTile(128, 128)
    assert gluon_applies(x, codes, ok, 8)
    assert gluon_applies(x, codes, GemmTile(64, 128, split_k=4), 16)
    assert gluon_applies(x, codes, GemmTile(256, 128, num_warps=4), 32)
    assert not gluon_applies(x, codes, ok, 64)  # 64-row blocks: 16 weight rows per warp
    assert not gluon_applies(x, codes, GemmTile(128, 64), 8)  # K step
    assert not gluon_applies(x, codes, GemmTile(32, 128), 8)  # half an MMA tile per warp
    assert not gluon_applies(x, codes, GemmTile(64, 128, num_warps=8), 8)
    assert not gluon_applies(x, codes, GemmTile(128, 128, split_k=8), 8)  # 512 / 8 < 128
    assert not gluon_applies(x, codes[:, :192], GemmTile(128, 128), 8)  # N % 128
    odd = torch.zeros(8 * 512 + 1, dtype=torch.bfloat16)[1:].view(8, 512)
    assert odd.is_contiguous() and not gluon_applies(odd, codes, ok, 8)
    assert not gluon_applies(x, codes.transpose(1, 2), ok, 8)
    assert gluon_tile_ok(ok, 8, 512, 256) and not gluon_tile_ok(ok, 8, 512, 192)
    # the wgmma kernel: 64- or 128-row blocks, 16 weight rows per warp (4 or 8 warps), at least
    # three stages, folded scales, x at a 16-byte aligned address
    wg = GemmTile(128, 128, num_warps=8)
    assert gluon_applies(x, codes, wg, 64) and gluon_applies(x, codes, wg, 128)
    # 32-row blocks: the wgmma kernel for a wgmma tile with folded scales, else mma_v2 (whose
    # tiles hold 1, 2 or 4 MMA tiles of 16 rows per warp)
    assert uses_wgmma(wg, 32, True) and uses_wgmma(GemmTile(64, 128), 32, True)
    assert not uses_wgmma(wg, 32, False) and not uses_wgmma(wg, 16, True)
    assert not uses_wgmma(ok, 32, True)  # 128 rows on 4 warps: an mma_v2 tile
    assert not uses_wgmma(GemmTile(128, 128, num_warps=8, num_stages=2), 32, True)
    assert uses_wgmma(GemmTile(128, 128, num_warps=8, num_stages=2), 64, True)
    assert gluon_applies(x, codes, wg, 32) and gluon_applies(x, codes, wg, 32, fold=False)
    assert gluon_applies(x, codes, ok, 32) and gluon_applies(x, codes, ok, 32, fold=False)
    assert not gluon_applies(_word_view(x), codes, wg, 32)
    assert gluon_applies(x, codes, GemmTile(64, 128), 64)
    assert not gluon_applies(x, codes, wg, 64, fold=False)
    assert not gluon_applies(x, codes, GemmTile(128, 128, num_warps=8, num_stages=2), 64)
    assert not gluon_applies(x, codes, GemmTile(256, 128, num_warps=8), 64)
    assert not gluon_applies(x, codes, GemmTile(32, 128, num_warps=2), 64)  # half a warpgroup
    # shared memory: 128-row blocks hold at most 5 stages of 41 KB
    assert gluon_applies(x, codes, GemmTile(128, 128, num_warps=8, num_stages=5), 128)
    assert not gluon_applies(x, codes, GemmTile(128, 128, num_warps=8, num_stages=6), 128)
    assert gluon_applies(x, codes, GemmTile(128, 128, num_warps=8, num_stages=6), 64)
    buf = torch.zeros(x.numel() + 8, dtype=torch.bfloat16)
    assert gluon_applies(buf[8:].view(x.shape), codes, wg, 64)  # a 16-byte offset
    word = buf[2 : 2 + x.numel()].view(x.shape)  # a 4-byte offset only
    assert gluon_applies(word, codes, ok, 8) and not gluon_applies(word, codes, wg, 64)
    assert _word_view(x).data_ptr() % 16 and gluon_applies(_word_view(x), codes, wg, 32, fold=False)


def test_reduce_takes_one_split_partials(device: str) -> None:
    """A 3-D down workspace is fp32 partials even with one split (the Gluon down GEMM's
    output): the reduce applies the down scale and rounds each slot's row as the unsplit down
    kernel does, then sums in slot order; a 2-D one is rows as the down kernel stored them.
    The shared expert's rows likewise (3-D: partials, rounded; 2-D: rows)."""
    T, K, D, E = 5, 3, 256, 4
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[1, 2] = -1  # a padding slot
    part = torch.randn(1, T * K, D, generator=g)
    gscale = torch.rand(E, 3, generator=g) + 0.5
    shared = torch.randn(T, D, generator=g)
    dev = torch.device(device)
    out3 = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
    moe_reduce_triton(
        part.to(dev), ids.to(dev), None, shared[None].to(dev), out3, E, gscale.to(dev)
    )
    # the rows the unsplit down kernel would have stored: partial x down scale, rounded
    rows = (part[0].view(T, K, D) * gscale[ids.clamp_min(0).long(), 2][..., None]).to(
        torch.bfloat16
    )
    out2 = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
    moe_reduce_triton(
        rows.reshape(T * K, D).to(dev), ids.to(dev), None,
        shared.to(torch.bfloat16).to(dev), out2, E, gscale.to(dev),
    )  # fmt: skip
    assert torch.equal(out3, out2)
    want = ((rows.float() * (ids >= 0)[..., None]).sum(1) + shared.to(torch.bfloat16).float()).to(
        torch.bfloat16
    )
    assert torch.equal(out3.cpu(), want)


def test_schedule_shape_rules_raise(device: str) -> None:
    """K not a multiple of block_k x split_k, and FP8 steps wider than a scale block."""
    args, kw = moe_inputs("moe", 2, 1, shape=_shape(device), fmt="fp8", device=device)
    base = moe_config(2, batch_invariant=False)
    too_split = MoESchedule(16, base.gate_up, GemmTile(32, 128, split_k=64), 16,
                            base.shared_gate_up, base.shared_down)  # fmt: skip
    with pytest.raises(ConfigError, match="split_k"):
        moe(*args, **kw, schedule=too_split)
    wide = MoESchedule(16, GemmTile(32, 256), base.down, 16, base.shared_gate_up,
                       base.shared_down)  # fmt: skip
    with pytest.raises(ConfigError, match="FP8"):
        moe(*args, **kw, schedule=wide)


# ------------------------------------------------------------------------------ router
_RS = RouteSchedule
ROUTE_SCHEDULES = {
    "one_slice": _RS(16, 16, 16, split=1),
    "split4_rows4": _RS(16, 16, 16, split=4, topk_rows=4),
    "split8_t32": _RS(32, 32, 32, split=8, topk_rows=2, num_warps=2),
    "split2_t64": _RS(64, 64, 64, split=2, num_stages=2),
    "split16_k16": _RS(16, 32, 16, split=16, topk_rows=8),
}
_ROUTE_TOL = 2e-5  # conformance/pairs.py, route: weights rel, and the near-tie score gap


def _route_problem(
    T: int, E: int, D: int, seed: int, device: str, x_dtype: torch.dtype, w_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, D, generator=g, device=device).to(x_dtype)  # (T, D)
    w = (torch.randn(E, D, generator=g, device=device) / D**0.5).to(w_dtype)  # (E, D)
    b = torch.randn(E, generator=g, device=device) * 0.1  # (E,)
    return x, w, b


def _route64(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 oracle: (weights (T, K), ids (T, K) in descending biased order, near-tie (T,))."""
    logits = x.double().cpu() @ w.double().cpu().T  # (T, E)
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    biased = scores + b.double().cpu()
    top = biased.topk(min(k + 1, biased.shape[1]), dim=-1)
    ids = top.indices[:, :k]
    near = (top.values[:, k - 1] - top.values[:, k]) <= _ROUTE_TOL  # (T,)
    sel = scores.gather(1, ids)
    return sel / sel.sum(-1, keepdim=True) * scaling, ids, near


def _run_route(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, k: int, scaling: float, **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    T = x.shape[0]
    wo = torch.full((T, k), float("nan"), dtype=torch.float32, device=x.device)
    io = torch.full((T, k), -7, dtype=torch.int32, device=x.device)
    route_triton(x, w, b, k, scaling, wo, io, **kw)  # type: ignore[arg-type]
    return wo, io


def _check_route(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """Away from near-ties: the same ids in the same (descending) order, weights within the
    route tolerance; every output written."""
    gw, gi = (t.cpu() for t in got)
    ww, wi, near = want
    assert torch.isfinite(gw).all() and bool((gi >= 0).all())
    keep = ~near
    assert torch.equal(gi[keep].long(), wi[keep])
    rel = (gw[keep].double() - ww[keep]).abs() / ww[keep]
    assert rel.numel() == 0 or float(rel.max()) <= _ROUTE_TOL, float(rel.max())


_ROUTE_DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("name", [*ROUTE_SCHEDULES, "default", "batch_invariant"])
@pytest.mark.parametrize(("x_dtype", "w_dtype"), _ROUTE_DTYPES, ids=["bf16", "fp32", "bf16_fp32"])
def test_route_schedule_matches_float64_logits(
    name: str, x_dtype: torch.dtype, w_dtype: torch.dtype, device: str
) -> None:
    """E 40 (no block_e divides it), D 208 (13 steps of 16: the last D slice is short, and no
    split of 3+ divides it), K 6: every output of T 1, 5 and 37 against float64.  Summing the
    split partials wrongly (one dropped, one twice) moves the logits by O(1): caught."""
    E, D, K, scaling = 40, 208, 6, 2.5
    for T in (1, 5, 37):
        x, w, b = _route_problem(T, E, D, 100 + T, device, x_dtype, w_dtype)
        kw: dict[str, object] = {"batch_invariant": name == "batch_invariant"}
        if name in ROUTE_SCHEDULES:
            kw["schedule"] = ROUTE_SCHEDULES[name]
        _check_route(_run_route(x, w, b, K, scaling, **kw), _route64(x, w, b, K, scaling))


def test_route_empty_batch_launches_nothing(device: str) -> None:
    x, w, b = _route_problem(0, 40, 208, 0, device, torch.bfloat16, torch.bfloat16)
    wo, io = _run_route(x, w, b, 6, 1.0, schedule=ROUTE_SCHEDULES["split8_t32"])
    assert wo.shape == (0, 6) and io.shape == (0, 6)


def test_route_schedules_agree(device: str) -> None:
    """At the pairs' MoE shape: one D slice against many, small against large tiles, every
    top-k row count: the same selections away from near-ties, weights within tolerance of each
    other and of float64."""
    (x, gw, gb, cfg), _ = moe_inputs("route", 37, 5, shape=_shape(device), device=device)
    k, rho = cfg.num_experts_per_tok, float(cfg.routed_scaling_factor)
    want = _route64(x, gw, gb, k, rho)
    base = _run_route(x, gw, gb, k, rho, schedule=ROUTE_SCHEDULES["one_slice"])
    _check_route(base, want)
    for s in ROUTE_SCHEDULES.values():
        got = _run_route(x, gw, gb, k, rho, schedule=s)
        _check_route(got, want)
        keep = ~want[2]
        assert torch.equal(got[1].cpu()[keep], base[1].cpu()[keep])
        assert torch.allclose(got[0][keep], base[0][keep], rtol=2 * _ROUTE_TOL, atol=0)


@pytest.mark.parametrize("name", ["split8_t32", "split2_t64", "batch_invariant"])
def test_route_fixed_schedule_is_batch_invariant(name: str, device: str) -> None:
    """A fixed schedule (and batch_invariant=True, through the public route): each row of a
    T 37 call is bitwise the row alone (T 1) and inside another batch (T 20, other position)."""
    (x, gw, gb, cfg), _ = moe_inputs("route", 37, 9, shape=_shape(device), device=device)

    def call(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name == "batch_invariant":
            return route(xs, gw, gb, cfg, batch_invariant=True)
        k, rho = cfg.num_experts_per_tok, float(cfg.routed_scaling_factor)
        return _run_route(xs, gw, gb, k, rho, schedule=ROUTE_SCHEDULES[name])

    full = call(x)
    for t in (0, 17, 36):
        for f, p in zip(full, call(x[t : t + 1].clone()), strict=True):
            assert torch.equal(f[t : t + 1], p), f"row {t} alone"
    inner = call(x[17:37].clone())
    for f, p in zip(full, inner, strict=True):
        assert torch.equal(f[17:37], p)


def test_route_flag_reaches_the_schedule(device: str) -> None:
    """The public route runs route_config's schedule for its T and flag (bitwise), and the
    default and batch_invariant schedules are distinct at decode sizes (so this can fail)."""
    (x, gw, gb, cfg), _ = moe_inputs("route", 5, 3, shape=_shape(device), device=device)
    k, rho = cfg.num_experts_per_tok, float(cfg.routed_scaling_factor)
    D, E = cfg.hidden_size, cfg.n_routed_experts
    assert route_config(5, D, E, batch_invariant=False) != route_config(5, D, E, True)
    for flag in (False, True):
        want = _run_route(x, gw, gb, k, rho, schedule=route_config(5, D, E, flag))
        got = route(x, gw, gb, cfg, batch_invariant=flag)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), flag


def test_route_value_preserving_knobs_are_bitwise(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """topk_rows (the top-k sums the selected weights one at a time, whatever its tile),
    num_stages and the top-k's warps (its reductions are exact) change no output bit."""
    from dsv4mtp.optimized.kernels import _launch, moe_route

    (x, gw, gb, cfg), _ = moe_inputs("route", 23, 4, shape=_shape(device), device=device)
    k, rho = cfg.num_experts_per_tok, float(cfg.routed_scaling_factor)
    base = RouteSchedule(32, 32, 32, split=4)
    want = _run_route(x, gw, gb, k, rho, schedule=base)
    for rows, stages in ((2, 3), (8, 2), (32, 4)):
        s = RouteSchedule(32, 32, 32, split=4, num_stages=stages, topk_rows=rows)
        got = _run_route(x, gw, gb, k, rho, schedule=s)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), s
    assert moe_route.topk_warps(1, 256) == 1 and moe_route.topk_warps(4, 256) == 4
    block_e = triton.next_power_of_2(gw.shape[0])
    warps = set()
    for per_warp in (1, block_e):  # always 4 warps; then 1, 2, 4 by the tile's rows
        monkeypatch.setattr(moe_route, "TOPK_SCORES_PER_WARP", per_warp)
        monkeypatch.setattr(_launch, "_PLANS", {})
        for rows in (1, 2, 32):
            warps.add((per_warp, moe_route.topk_warps(rows, block_e)))
            s = RouteSchedule(32, 32, 32, split=4, topk_rows=rows)
            got = _run_route(x, gw, gb, k, rho, schedule=s)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (per_warp, s)
    assert {w for _, w in warps} == {1, 2, 4}  # the warps the launches above ran on


def test_route_config_and_validation() -> None:
    b = route_config(4096, 4096, 256, batch_invariant=True)
    assert all(route_config(t, 4096, 256, batch_invariant=True) == b for t in (1, 8, 64, 512))
    with pytest.raises(ConfigError, match="block_t"):
        RouteSchedule(8, 32, 32, split=1)  # tl.dot needs >= 16 rows
    with pytest.raises(ConfigError, match="split"):
        RouteSchedule(16, 32, 32, split=3)
    with pytest.raises(ConfigError, match="num_stages"):
        RouteSchedule(16, 32, 32, split=1, num_stages=0)
