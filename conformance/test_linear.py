"""The dense linears (``linear``, ``grouped_linear``, and ``eh_proj``, the layer's two input
projections and their broadcast sum): packing, the FP8 block decode, schedules, batch
invariance, errors, non-finite inputs and the operators.

The generated contract (test_contract.py) draws cases against the float64 oracle; these tests
pin what it cannot: pack/dequantize bit for bit against the core, a block scale that must land on
its own K block, ragged K splits, the reference's grouped form, and typed errors.  CPU shapes
are small (the kernel runs in the interpreter); the gpu tests take V4-Flash's shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import dsv4mtp.optimized as opt
import dsv4mtp.reference as ref
from dsv4mtp.checkpoint.weights import QuantizedWeight, stack_rows
from dsv4mtp.conformance.differential import compare
from dsv4mtp.conformance.inputs import LINEAR_SHAPES, linear_weight
from dsv4mtp.conformance.registry import pairs_for
from dsv4mtp.errors import InputError
from dsv4mtp.formats import decode_e8m0
from dsv4mtp.quant import ACT_QUANT_BLOCK
from dsv4mtp.reference.quant_sim import fp8_block_roundtrip

BF16, FP32 = torch.bfloat16, torch.float32
_PAIRS = {p.name: p for p in pairs_for("linear")}


def _x(*shape: int, dtype: torch.dtype = BF16, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _check(op: str, got: torch.Tensor, x: torch.Tensor, w: object, **kw: object) -> None:
    """got against the float64 reference under the pair's declared tolerance."""
    fn = ref.grouped_linear if op == "grouped_linear" else ref.linear
    oracle = fn(x.double(), w, **kw)
    preset = "official" if kw.get("act_quant") else "math"
    tol = _PAIRS[op].tolerance(x.dtype, preset if x.dtype == BF16 else "math")
    rep = compare(got, oracle)
    assert rep.within(tol), f"{op} {tuple(x.shape)}: {rep} exceeds {tol}"


# ------------------------------------------------------------------------------ packing
@pytest.mark.parametrize("fmt", ["fp8_e8m0", "fp8_f32", "bf16"])
def test_pack_dequantizes_bit_for_bit_as_the_core(fmt: str, device: str) -> None:
    qw = linear_weight(1, 192, 384, fmt, seed=3)
    pack = opt.pack_linear(qw, device)
    assert pack.fmt == ("bf16" if fmt == "bf16" else "fp8") and pack.groups == 1
    for dt in (BF16, FP32):
        assert torch.equal(pack.dequantize(dt).cpu(), qw.dequantize(dt))
    grouped = opt.pack_linear(linear_weight(2, 128, 256, fmt, seed=4), device, groups=2)
    assert grouped.grouped and tuple(grouped.weight.shape) == (2, 128, 256)
    want = linear_weight(2, 128, 256, fmt, seed=4).dequantize(BF16).view(2, 128, 256)
    assert torch.equal(grouped.dequantize(BF16).cpu(), want)


# ------------------------------------------------------------------------------ values
@pytest.mark.parametrize("fmt", ["fp8_e8m0", "fp8_f32", "bf16"])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_linear_matches_the_reference(fmt: str, dtype: torch.dtype, device: str) -> None:
    """Rows 0, 1, odd and 65 (past the one-M-block decode schedule), act_quant off and on."""
    qw = linear_weight(1, 192, 384, fmt, seed=1)
    pack = opt.pack_linear(qw, device)
    for rows, act_quant in ((0, False), (1, True), (7, False), (65, dtype == BF16)):
        x = _x(rows, 384, dtype=dtype, device=device, seed=rows)
        got = opt.linear(x, pack, act_quant=act_quant)
        assert got.dtype == dtype and tuple(got.shape) == (rows, 192)
        _check("linear", got.cpu(), x.cpu(), qw, act_quant=act_quant)
    # leading dims are kept, as the reference's (..., K)
    x3 = _x(2, 3, 384, dtype=dtype, device=device)
    assert tuple(opt.linear(x3, pack).shape) == (2, 3, 192)


def test_grouped_linear_matches_the_reference(device: str) -> None:
    qw = linear_weight(3, 128, 256, "fp8_f32", seed=2)
    pack = opt.pack_linear(qw, device, groups=3)
    for rows in (1, 9):
        x = _x(rows, 3, 256, device=device, seed=rows)
        _check("grouped_linear", opt.grouped_linear(x, pack).cpu(), x.cpu(), qw)
    dense = qw.dequantize(FP32).view(3, 128, 256).to(device)
    x = _x(4, 3, 256, dtype=FP32, device=device)
    _check("grouped_linear", opt.grouped_linear(x, dense).cpu(), x.cpu(), dense.cpu())


def test_reference_grouped_linear_is_the_loop_over_groups() -> None:
    x, w = _x(5, 3, 64, dtype=FP32), _x(3, 16, 64, dtype=FP32, seed=1)
    want = torch.stack([ref.linear(x[:, g], w[g]) for g in range(3)], dim=1)
    assert torch.equal(ref.grouped_linear(x, w), want)


def test_each_block_scale_lands_on_its_own_block(device: str) -> None:
    """Scales 2^(3 kb - 2 nb) differ by 8x between neighbouring K blocks and 4x between row
    blocks, so a scale read from another block moves whole 128-wide partials by 2x or more
    (far outside the tolerance); K 640 (5 blocks) also exercises a ragged K split below."""
    N, K = 256, 640
    codes = linear_weight(1, N, K, "fp8_f32", seed=5).data
    kb = torch.arange(5, dtype=FP32)
    nb = torch.arange(2, dtype=FP32)
    scale = torch.exp2(3 * kb[None, :] - 2 * nb[:, None]) / (48 * K**0.5)
    qw = QuantizedWeight("fp8_f32", codes, scale, (N, K))
    pack = opt.pack_linear(qw, device)
    x = _x(3, K, device=device, seed=6)
    _check("linear", opt.linear(x, pack).cpu(), x.cpu(), qw)


def test_ragged_k_split_and_the_reduce(device: str) -> None:
    """A 2-way split of 5 K blocks (3 + 2) with the fp32 partials summed by each tile's last
    split: within tolerance, and equal to the unsplit sum up to fp32 reassociation."""
    from dsv4mtp.optimized.kernels.linear import FMT_FP8, LinearSchedule, linear_triton

    qw = linear_weight(1, 192, 640, "fp8_e8m0", seed=7)
    pack = opt.pack_linear(qw, device)
    x = _x(5, 1, 640, dtype=FP32, device=device, seed=8)
    outs = []
    for split in (1, 2, 4):
        y = torch.full((5, 1, 192), float("nan"), device=device)
        linear_triton(
            x, pack.weight, pack.scale, y, fmt=FMT_FP8, sched=LinearSchedule(16, 64, split)
        )
        _check("linear", y[:, 0].cpu(), x[:, 0].cpu(), qw)
        outs.append(y)
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert torch.allclose(outs[0], outs[2], rtol=1e-5, atol=1e-6)


def _in_split_order(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reduce's arithmetic in torch: fp32 zeros plus the partials part[0], part[1], ... in
    that order, then one rounding to ``dtype`` (round to nearest even)."""
    total = torch.zeros_like(part[0])
    for p in part:
        total = total + p
    return total.to(dtype)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_split_k_sums_the_partials_in_split_order_in_one_launch(
    dtype: torch.dtype, device: str
) -> None:
    """Split-K without a second launch: every split stores its fp32 partial and counts itself on
    its output tile; the last to arrive adds part[0..S-1] in split order and rounds once.  y is
    bit for bit that in-order sum of the partials the kernel left in its workspace (the
    arithmetic of a separate reduce launch), the pack's counters are zero again after each call,
    and a second call (reusing them) gives the same bits.  S 2, 3 and 4 over 5 K blocks (ragged;
    with S 4 the last split has no K block), 19 rows (two M blocks of 16), 3 N tiles."""
    from dsv4mtp.optimized.kernels._launch import workspace
    from dsv4mtp.optimized.kernels.linear import FMT_FP8, LinearSchedule, linear_triton

    R, N, K = 19, 192, 640
    qw = linear_weight(1, N, K, "fp8_f32", seed=17)
    pack = opt.pack_linear(qw, device)
    x = _x(R, 1, K, dtype=dtype, device=device, seed=18)
    for split in (2, 3, 4):
        sched = LinearSchedule(16, 64, split)
        first = None
        for _ in range(2):
            y = torch.full((R, 1, N), float("nan"), dtype=dtype, device=device)
            linear_triton(
                x, pack.weight, pack.scale, y, fmt=FMT_FP8, sched=sched, counters=pack.counters
            )
            part = workspace("linear_part", (split * R * N,), FP32, x.device).view(split, R, 1, N)
            assert torch.equal(y, _in_split_order(part, dtype)), f"split {split}"
            assert not pack.counters.any(), f"split {split}: counters not reset"
            if first is None:
                first = y
                _check("linear", y[:, 0].cpu(), x[:, 0].cpu(), qw)
            else:
                assert torch.equal(y, first), f"split {split}: a second call differs"


def test_split_k_rows_past_the_counters_run_in_launches_of_whole_m_blocks(device: str) -> None:
    """Counters for one M block's tiles: 130 rows (three M blocks of 64, the batch-invariant
    schedule) run in three launches, bit for bit the one launch on the stream's counters (each
    tile is computed alone), through the operator too; counters end zero.  Counters that are not
    int32 are an InputError naming them."""
    from dsv4mtp.optimized.kernels.linear import FMT_FP8, linear_schedule, linear_triton

    R, N, K = 130, 128, 512
    qw = linear_weight(1, N, K, "fp8_e8m0", seed=19)
    pack = opt.pack_linear(qw, device)
    x = _x(R, 1, K, device=device, seed=20)
    sched = linear_schedule(R, N, K, 1, True)
    assert (sched.block_m, sched.block_n, sched.split_k) == (64, 64, 2)
    ys = []
    for counters in (None, torch.zeros(2, dtype=torch.int32, device=device)):
        y = torch.full((R, 1, N), float("nan"), dtype=BF16, device=device)
        linear_triton(x, pack.weight, pack.scale, y, fmt=FMT_FP8, sched=sched, counters=counters)
        ys.append(y)
        assert counters is None or not counters.any()
    assert torch.equal(ys[0], ys[1])
    small = dataclasses.replace(pack, counters=torch.zeros(2, dtype=torch.int32, device=device))
    got = opt.linear(x[:, 0], small, batch_invariant=True)
    assert torch.equal(got, ys[0][:, 0]) and not small.counters.any()
    assert torch.equal(opt.linear(x[:, 0], pack, batch_invariant=True), got)
    args = (x[:, 0], pack.weight, pack.scale, pack.fmt, False, False)
    bad = pack.counters.to(torch.int64)
    with pytest.raises(InputError, match=r"^counters: expected a contiguous 1-D int32 tensor"):
        torch.ops.dsv4mtp.linear.default(*args, counters=bad)


def test_fused_wqa_wkv_rows_split_into_the_two_linears(device: str) -> None:
    """The fused wq_a + wkv weight (row_splits) gives both outputs from one product."""
    a, b = (
        linear_weight(1, 256, 256, "fp8_e8m0", seed=9),
        linear_weight(1, 128, 256, "fp8_e8m0", 10),
    )
    fused = opt.pack_linear(stack_rows([a, b], "fused_wqa_wkv"), device)
    assert fused.row_splits == (256, 128)
    x = _x(3, 256, device=device)
    qr, kv = opt.linear(x, fused).split(list(fused.row_splits), dim=-1)
    _check("linear", qr.cpu(), x.cpu(), a)
    _check("linear", kv.cpu(), x.cpu(), b)


# ------------------------------------------------------------------------------ prefill path
def _fp8_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes (G, N, K) uint8 times their (G, ceil(N/128), ceil(K/128)) block scales, in fp32."""
    N, K = codes.shape[1:]
    full = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :K]
    return codes.view(torch.float8_e4m3fn).to(FP32) * full


def test_dequant_kernel_is_the_exact_weight(device: str) -> None:
    """The prefill path's Triton dequant: every one of the 254 finite e4m3 codes (each byte but
    the NaNs 0x7F, 0xFF, in every scale block) times power-of-two scales from 2^-100 to 2^100
    is written as exactly ``code * scale`` (the fp32 product, which bf16 holds exactly: 4
    significant bits); with fp32 scales, the product rounded once to bf16, as the core's
    dequantization.  Ragged N 200 and K 300 (partial 128x128 blocks), 2 groups."""
    from dsv4mtp.optimized.kernels.linear import dequant_bf16_triton

    G, N, K = 2, 200, 300
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    g = torch.Generator().manual_seed(21)
    codes = finite[torch.randint(0, 254, (G, N, K), generator=g)]
    codes[:, :, :254] = finite  # every code in every (group, row): every block sees all of them
    exps = torch.tensor([[[-100, 100, -7], [3, 0, -60]], [[99, -99, 1], [-1, 50, -13]]])
    pow2 = torch.exp2(exps.to(FP32))
    f32 = pow2 * torch.rand(exps.shape, generator=g, dtype=FP32).add(0.5)  # not powers of two
    for scale in (pow2, f32):
        out = torch.full((G, N, K), float("nan"), dtype=BF16, device=device)
        dequant_bf16_triton(codes.to(device), scale.to(device), out)
        want = _fp8_values(codes, scale)
        assert torch.equal(out.cpu(), want.to(BF16))
        if scale is pow2:
            assert torch.equal(out.cpu().to(FP32), want)  # exact: no rounding at all


def test_pack_decides_once_whether_the_weight_is_exact_in_bf16(device: str) -> None:
    """``exact_bf16`` (and the operators' format "fp8_exact"): e8m0 scales in range; fp32
    scales only when each is a power of two from 2^-100 to 2^100; never for bf16 weights."""
    e8m0 = linear_weight(1, 256, 256, "fp8_e8m0", seed=22)
    assert opt.pack_linear(e8m0, device).exact_bf16
    assert opt.pack_linear(e8m0, device).op_fmt == "fp8_exact"
    f32 = linear_weight(1, 256, 256, "fp8_f32", seed=22)
    assert not opt.pack_linear(f32, device).exact_bf16
    assert opt.pack_linear(f32, device).op_fmt == "fp8"
    assert not opt.pack_linear(linear_weight(1, 128, 256, "bf16", seed=22), device).exact_bf16
    assert e8m0.scale is not None
    for exp, exact in ((100, True), (-100, True), (101, False), (-101, False)):
        scale = e8m0.scale.clone()
        scale[1, 0] = 127 + exp
        qw = dataclasses.replace(e8m0, scale=scale)
        assert opt.pack_linear(qw, device).exact_bf16 == exact, exp
        fp32_scale = decode_e8m0(scale, dtype=FP32)
        pow2 = QuantizedWeight("fp8_f32", e8m0.data, fp32_scale, e8m0.shape)
        assert opt.pack_linear(pow2, device).exact_bf16 == exact, exp
    half = QuantizedWeight("fp8_f32", e8m0.data, torch.full((2, 2), 0.75), e8m0.shape)
    assert not opt.pack_linear(half, device).exact_bf16


def test_dequant_mm_selection() -> None:
    """The prefill path needs all four: DEQUANT_MM_MIN_ROWS rows or more, an exact-bf16 pack,
    bf16 x, not batch-invariant.  fp32 x, fp32 (non-power-of-two) scales and batch-invariant
    calls keep the Triton kernel at any row count."""
    from dsv4mtp.optimized.kernels.linear import DEQUANT_MM_MIN_ROWS, dequant_mm_selected

    assert DEQUANT_MM_MIN_ROWS == 256
    assert dequant_mm_selected(256, True, BF16, False)
    assert dequant_mm_selected(65536, True, BF16, False)
    assert not dequant_mm_selected(255, True, BF16, False)
    assert not dequant_mm_selected(4096, False, BF16, False)  # fp8_f32 scales / bf16 weight
    assert not dequant_mm_selected(4096, True, FP32, False)
    assert not dequant_mm_selected(4096, True, BF16, True)


def _summation_order_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far two correct bf16 results of x (R, K) @ w (N, K)^T may lie apart when both sum the
    exact products in fp32 (in different orders) and round once to bf16: each fp32 sum is off by
    at most K * 2^-24 * sum_k |x w| from the exact one (float64 here), and the two roundings to
    nearest apart by at most one bf16 ulp (2^-7 relative, added by the caller)."""
    return x.abs().double() @ w.abs().double().T * (x.shape[-1] * 2.0**-23)


def _agree_to_summation_order(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    a, b = got.double(), want.double()
    assert not torch.isnan(a).any()
    assert bool((a - b).abs().le(2.0**-7 * torch.maximum(a.abs(), b.abs()) + bound).all())


# official (act_quant) puts the activation rounding in front of the same dequant + GEMM path: a
# minute under the interpreter, so the GPU tier runs it.  On the CPU tier the path is [math]'s
# and the rounding kernel is the linear contracts' under the official preset.
@pytest.mark.parametrize(
    "act_quant", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["math", "official"]
)
def test_prefill_path_matches_the_reference_and_the_kernel(act_quant: bool, device: str) -> None:
    """bf16 x with 256 and 300 rows on an e8m0 pack (the dequantize + cuBLAS path): within the
    declared tolerance against the float64 oracle, and within the fp32 summation-order bound of
    the Triton kernel on the same pack (the operator with format "fp8" runs the kernel at any
    row count).  ``act_quant`` rounds x first, the same rounding in both."""
    qw = linear_weight(1, 192, 384, "fp8_e8m0", seed=23)
    pack = opt.pack_linear(qw, device)
    assert pack.exact_bf16
    w = pack.dequantize(BF16)
    for rows in (256, 300):
        x = _x(rows, 384, device=device, seed=rows)
        got = opt.linear(x, pack, act_quant=act_quant)
        _check("linear", got.cpu(), x.cpu(), qw, act_quant=act_quant)
        args = (x, pack.weight, pack.scale, "fp8", act_quant, False)
        kernel = torch.ops.dsv4mtp.linear.default(*args, counters=pack.counters)
        xq = fp8_block_roundtrip(x, ACT_QUANT_BLOCK) if act_quant else x
        _agree_to_summation_order(got, kernel, _summation_order_bound(xq, w))
        out = torch.full_like(got, float("nan"))
        assert opt.linear(x, pack, act_quant=act_quant, out=out) is out
        assert torch.equal(out, got)


def test_grouped_prefill_path_matches_the_reference_and_the_kernel(device: str) -> None:
    """grouped_linear with 256 rows of 3 groups on an e8m0 pack: ``torch.bmm`` over the groups
    writing the strided (T, G, N) output; against the oracle and the kernel, as the plain op."""
    qw = linear_weight(3, 128, 256, "fp8_e8m0", seed=24)
    pack = opt.pack_linear(qw, device, groups=3)
    assert pack.exact_bf16
    x = _x(256, 3, 256, device=device, seed=25)
    got = opt.grouped_linear(x, pack)
    _check("grouped_linear", got.cpu(), x.cpu(), qw)
    args = (x, pack.weight, pack.scale, "fp8", False, False)
    kernel = torch.ops.dsv4mtp.grouped_linear.default(*args, counters=pack.counters)
    w = pack.dequantize(BF16)
    for g in range(3):
        _agree_to_summation_order(got[:, g], kernel[:, g], _summation_order_bound(x[:, g], w[g]))
    out = torch.full_like(got, float("nan"))
    opt.grouped_linear(x, pack, out=out)
    assert torch.equal(out, got)


def test_fp32_reduction_clears_and_restores_the_cublas_flag() -> None:
    """The cuBLAS GEMM runs with bf16 reduced-precision reductions off (a second rounding of the
    split-K partials) and the process-wide flag is back as it was afterwards, also when the
    block raises.  Only the flag is touched: no CUDA device is needed."""
    from dsv4mtp.optimized.kernels.linear import fp32_reduction

    get = torch._C._get_cublas_allow_bf16_reduced_precision_reduction
    matmul = torch.backends.cuda.matmul
    saved = get()
    try:
        for before in ((True, True), (False, True), (False, False)):  # torch's valid pairs
            matmul.allow_bf16_reduced_precision_reduction = before
            with fp32_reduction(torch.device("cuda")):
                assert get() == (False, before[1])
            assert get() == before
            with pytest.raises(RuntimeError), fp32_reduction(torch.device("cuda")):
                raise RuntimeError
            assert get() == before
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved


# ------------------------------------------------------------------------------ invariance
@pytest.mark.parametrize("K", [384, 512])
@pytest.mark.parametrize("op", ["linear", "grouped_linear"])
def test_batch_invariant_rows_are_bitwise_the_same_alone(op: str, K: int, device: str) -> None:
    """67 rows (two M blocks of 64) against each row alone; K 384 has no K split, K 512 splits
    K in two (4 K blocks), summed in the kernel by each tile's last split."""
    grouped = op == "grouped_linear"
    qw = linear_weight(2 if grouped else 1, 128, K, "fp8_f32", seed=11)
    pack = opt.pack_linear(qw, device, groups=2 if grouped else None)
    fn = opt.grouped_linear if grouped else opt.linear
    x = _x(*((67, 2, K) if grouped else (67, K)), device=device, seed=12)
    full = fn(x, pack, batch_invariant=True)
    for t in (0, 33, 66):
        alone = fn(x[t : t + 1], pack, batch_invariant=True)
        assert torch.equal(full[t : t + 1], alone), f"{op}: row {t} differs alone"


# ------------------------------------------------------------------------------ non-finite
def test_non_finite_x_propagates_like_the_reference(device: str) -> None:
    qw = linear_weight(1, 128, 256, "fp8_e8m0", seed=13)
    pack = opt.pack_linear(qw, device)
    x = _x(4, 256, dtype=FP32, device=device)
    x[1, 7] = float("nan")
    x[2, 200] = float("inf")
    got = opt.linear(x, pack).cpu()
    want = ref.linear(x.cpu(), qw)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert bool(torch.isnan(got[1]).all()) and bool(torch.isfinite(got[[0, 3]]).all())


# ------------------------------------------------------------------------------ errors
def _bad_calls(device: str):
    qw = linear_weight(2, 128, 256, "fp8_e8m0", seed=14)
    pack = opt.pack_linear(qw, device)
    gpack = opt.pack_linear(qw, device, groups=2)
    x = _x(3, 256, device=device)
    mx = QuantizedWeight("mxfp4", torch.zeros(4, 128, dtype=torch.uint8), None, (4, 256))
    bad_scale = QuantizedWeight("fp8_e8m0", qw.data, qw.scale[:1], qw.shape)  # type: ignore[index]
    return [
        (lambda: opt.linear(x.double(), pack), r"^x: expected dtype"),
        (lambda: opt.linear(x[:, :-1], pack), r"^x: expected shape \(\.\.\., 256\)"),
        (lambda: opt.linear(x, qw), r"^weight: a QuantizedWeight is packed once"),
        (lambda: opt.linear(x, gpack), r"^weight: expected a plain pack"),
        (lambda: opt.grouped_linear(x, gpack), r"^x: expected shape \(\*, 2, 256\)"),
        (lambda: opt.grouped_linear(x[:, None].expand(3, 2, 256), pack), r"^weight: expected a grouped"),
        (lambda: opt.linear(x, pack, out=torch.empty(3, 255, device=device)), r"^out: expected shape"),
        (lambda: opt.linear(x, pack, out=torch.empty(3, 256, device=device)), r"^out: expected dtype"),
        (lambda: opt.linear(x, pack, act_quant=1), r"^act_quant: expected a bool"),
        (lambda: opt.pack_linear(mx), r"^weight: format 'mxfp4' is not a dense linear's"),
        (lambda: opt.pack_linear(bad_scale), r"^weight.scale: expected shape \(2, 2\)"),
        (lambda: opt.pack_linear(qw, groups=3), r"^groups: 3 groups do not divide"),
        (lambda: opt.pack_linear(qw, groups=4), r"^groups: FP8 groups must be whole 128-row"),
        (lambda: opt.pack_linear(torch.zeros(2, 3, 4, 5)), r"^weight: expected shape \(N, K\)"),
        (lambda: opt.pack_linear(torch.zeros(4, 8, dtype=torch.int32)), r"^weight: expected a floating"),
        (lambda: ref.linear(x.float(), torch.zeros(4, 255)), r"^x: expected last dim 255"),
        (lambda: ref.grouped_linear(x.float()[:, None], torch.zeros(2, 4, 256)), r"^x: expected shape"),
    ]  # fmt: skip


def test_bad_inputs_raise_input_errors_naming_the_tensor(device: str) -> None:
    for call, match in _bad_calls(device):
        with pytest.raises(InputError, match=match):
            call()


@pytest.mark.parametrize("fmt", ["fp8_e8m0", "fp8_f32"])
def test_pack_refuses_nan_codes_and_scales_naming_the_tensor(fmt: str, device: str) -> None:
    """The kernels' e4m3 decode has no NaN (kernels/decode.py): a NaN code would compute as
    +-480 where the reference gives NaN.  pack_linear refuses e4m3 NaN codes (0x7F, 0xFF; as
    float8_e4m3fn or uint8 codes), a NaN e8m0 scale byte and a non-finite fp32 scale, naming the
    tensor, its checkpoint name and the first bad index; the same weight without them packs."""
    qw = linear_weight(2, 128, 256, fmt, seed=14)
    assert qw.scale is not None
    opt.pack_linear(qw, device, groups=2)
    for byte, dtype in ((0x7F, torch.float8_e4m3fn), (0xFF, torch.uint8)):
        codes = qw.data.view(torch.uint8).clone()
        codes[130, 7] = byte
        bad = dataclasses.replace(qw, data=codes.view(dtype))
        want = r"^weight.data \(linear\): expected finite float8_e4m3fn codes, found 1 NaN"
        with pytest.raises(InputError, match=want + rf".*index \(130, 7\): e4m3 byte 0x{byte:02X}"):
            opt.pack_linear(bad, device, groups=2)
    scale = qw.scale.clone()
    scale[1, 0] = 0xFF if fmt == "fp8_e8m0" else float("inf")
    code = "e8m0 byte 0xFF" if fmt == "fp8_e8m0" else "inf"
    with pytest.raises(
        InputError, match=rf"^weight.scale \(linear\): expected finite scales.*\(1, 0\): {code}"
    ):
        opt.pack_linear(dataclasses.replace(qw, scale=scale), device)


# ------------------------------------------------------------------------------ operators
@pytest.mark.parametrize("rows", [3, 256])
@pytest.mark.parametrize("op", ["linear", "grouped_linear"])
@pytest.mark.parametrize("variant", ["", "_out"])
def test_linear_opcheck(op: str, variant: str, rows: int, device: str) -> None:
    """Schema, fake kernel and AOT dispatch of the operators (torch.library.opcheck): 3 rows on
    a split-K schedule (K 512: 4 K blocks, 2 splits), so the written ``counters`` are used; 256
    rows with the format "fp8_exact" on the dequantize + cuBLAS path."""
    grouped = op == "grouped_linear"
    qw = linear_weight(2 if grouped else 1, 128, 512, "fp8_e8m0", seed=15)
    pack = opt.pack_linear(qw, device, groups=2 if grouped else None)
    x = _x(*((rows, 2, 512) if grouped else (rows, 512)), device=device)
    args = (x, pack.weight, pack.scale, pack.op_fmt if rows > 3 else "fp8", False, False)
    kw: dict[str, torch.Tensor] = {"counters": pack.counters}
    if variant:
        kw["out"] = x.new_empty((rows, 2, 128) if grouped else (rows, 128))
    torch.library.opcheck(getattr(torch.ops.dsv4mtp, op + variant).default, args, kw)


# ------------------------------------------------------------------------------ eh_proj
def _eh(
    T: int, n: int, fmt: str, device: str, N: int = 192, K: int = 1024, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, QuantizedWeight, QuantizedWeight]:
    """e (T, K), h (T, n, K) and two (N, K) weights; K 1024 (8 K blocks) gives the decode
    schedules a 4-way K split at N 192."""
    e, h = _x(T, K, device=device, seed=seed), _x(T, n, K, device=device, seed=seed + 1)
    we, wh = (linear_weight(1, N, K, fmt, seed=s, device=device) for s in (31, 32))
    return e, h, we, wh


# (T, n, batch_invariant): h's 4 / 15 / 64 rows on split-K schedules (K 1024), 280 rows on the
# prefill path (batch_invariant off) or the batch-invariant split schedule (K 384 there: the
# interpreter's time grows with K and the split is what K 1024 is for)
_EH_CASES = [(1, 4, False), (1, 4, True), (5, 3, False), (16, 4, False), (70, 4, False),
             (70, 4, True)]  # fmt: skip


@pytest.mark.parametrize(("T", "n", "batch_invariant"), _EH_CASES)
def test_eh_proj_is_the_two_linears_and_their_sum_bit_for_bit(
    T: int, n: int, batch_invariant: bool, device: str
) -> None:
    """eh_proj adds e's projection in the epilogue of h's (the split-K schedules' last split
    at 4-64 rows, the batch-invariant schedules) or, from 256 rows (T 70 x 4 streams), after
    the prefill path's cuBLAS GEMM: bitwise the two ``linear`` calls and torch's broadcast add,
    out= included (poisoned first), with act_quant too at up to 15 rows."""
    from dsv4mtp.optimized.kernels.linear import linear_schedule

    K = 1024 if T * n <= 64 else 384
    e, h, we, wh = _eh(T, n, "fp8_e8m0", device, K=K)
    pe, ph = opt.pack_linear(we, device), opt.pack_linear(wh, device)
    if T * n <= 64:  # the epilogue under test is a split's
        assert linear_schedule(T * n, 192, K, 1, batch_invariant).split_k > 1
    for act_quant in (False, True) if T * n <= 15 else (False,):
        kw = dict(act_quant=act_quant, batch_invariant=batch_invariant)
        want = opt.linear(h, ph, **kw) + opt.linear(e, pe, **kw)[:, None, :]
        got = opt.eh_proj(e, h, pe, ph, **kw)
        assert torch.equal(got, want), f"act_quant={act_quant}"
        out = torch.full_like(want, float("nan"))
        assert opt.eh_proj(e, h, pe, ph, **kw, out=out) is out and torch.equal(out, want)
    assert not pe.counters.any() and not ph.counters.any()  # left zeroed


def test_eh_proj_in_one_launch_is_its_two_launch_form_bit_for_bit(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At decode sizes both products run in one launch (kernels/linear.py, ``eh_linear_kernel``:
    the tile's last of its 2 * SPLIT_K programs rounds each product and their sum) wherever
    e's and h's default schedules differ in BLOCK_M at most: bitwise the two launches of
    ``linear_kernel`` (``EH_ONE_LAUNCH`` off), FP8 and bf16 weights, h on 16- and 32-row
    blocks (e on 16), counters left zeroed; the one launch counted; refused for unlike weights
    and beyond 64 rows of h; the raw operator's bad arguments named on both paths."""
    from dsv4mtp.optimized import _ops
    from dsv4mtp.optimized.kernels import linear as lk

    assert lk.eh_one_launch(2, 8, 192, 1024, True, False) is not None
    assert lk.eh_one_launch(2, 8, 192, 1024, False, False) is None  # unlike weights
    assert lk.eh_one_launch(17, 68, 192, 1024, True, False) is None  # past decode sizes
    launches: list[int] = []
    real = _ops.eh_linear_triton

    def counted(*args: Any, **kwargs: Any) -> None:
        launches.append(kwargs["sched"].block_m)
        real(*args, **kwargs)

    monkeypatch.setattr(_ops, "eh_linear_triton", counted)
    for fmt, T in (("fp8_e8m0", 2), ("bf16", 2), ("fp8_e8m0", 8)):
        e, h, we, wh = _eh(T, 4, fmt, device, seed=3)
        pe, ph = opt.pack_linear(we, device), opt.pack_linear(wh, device)
        launches.clear()
        one = opt.eh_proj(e, h, pe, ph)
        assert launches == [max(16, 4 * T)], (fmt, T)
        with monkeypatch.context() as m:
            m.setattr(lk, "EH_ONE_LAUNCH", False)
            two = opt.eh_proj(e, h, pe, ph)
        assert launches == [max(16, 4 * T)], "the switch off takes the two launches"
        assert torch.equal(one, two), (fmt, T)
        assert not pe.counters.any() and not ph.counters.any()
    args = (e, h, pe.weight, pe.scale, pe.op_fmt, ph.weight, ph.scale, ph.op_fmt, False, False)
    bad = ph.counters.to(torch.int64)
    for switch in (True, False):
        monkeypatch.setattr(lk, "EH_ONE_LAUNCH", switch)
        with pytest.raises(InputError, match=r"^h_counters: expected a contiguous 1-D int32"):
            torch.ops.dsv4mtp.eh_proj.default(*args, e_counters=pe.counters, h_counters=bad)
        with pytest.raises(InputError, match=r"^e_fmt: expected one of"):
            torch.ops.dsv4mtp.eh_proj.default(
                *args[:4], "fp4", *args[5:7], "fp4", *args[8:], e_counters=pe.counters,
                h_counters=ph.counters,
            )  # fmt: skip


def test_eh_proj_rows_past_the_counters_add_each_launch_its_own_rows(device: str) -> None:
    """With counters for one M block, h's 80 rows (T 20 x 4, batch-invariant 64-row blocks)
    run as two launches of the split schedule: the second's rows start at 64 and must add
    e's rows 16-19, bitwise the composition."""
    e, h, we, wh = _eh(20, 4, "fp8_e8m0", device)
    pe, ph = opt.pack_linear(we, device), opt.pack_linear(wh, device)
    tiles = ph.counters.numel() // 16  # the pack's counters hold 16 M blocks of N tiles
    ph = dataclasses.replace(ph, counters=torch.zeros(tiles, dtype=torch.int32, device=device))
    kw = dict(batch_invariant=True)
    want = opt.linear(h, ph, **kw) + opt.linear(e, pe, **kw)[:, None, :]
    assert torch.equal(opt.eh_proj(e, h, pe, ph, **kw), want)
    assert not ph.counters.any()


def test_eh_proj_matches_the_reference(device: str) -> None:
    """fp32 scales (the kernel path at every row count) and bf16 weights, against the float64
    reference's eh_proj under the pair's tolerance; the reference is its own linears' sum."""
    for fmt in ("fp8_f32", "bf16"):
        e, h, we, wh = _eh(9, 4, fmt, device)
        got = opt.eh_proj(e, h, opt.pack_linear(we, device), opt.pack_linear(wh, device))
        oracle = ref.eh_proj(e.double(), h.double(), we, wh)
        rep = compare(got, oracle)
        tol = _PAIRS["eh_proj"].tolerance(BF16, "math")
        assert rep.within(tol), f"{fmt}: {rep} exceeds {tol}"
    e, h, we, wh = _eh(3, 2, "fp8_e8m0", "cpu")
    want = ref.linear(h, wh) + ref.linear(e, we)[:, None, :]
    assert torch.equal(ref.eh_proj(e, h, we, wh), want)


def test_eh_proj_bad_inputs_raise_input_errors_naming_the_tensor(device: str) -> None:
    e, h, we, wh = _eh(2, 4, "fp8_e8m0", device)
    pe, ph = opt.pack_linear(we, device), opt.pack_linear(wh, device)
    w_other = linear_weight(1, 128, 1024, "fp8_e8m0", seed=33, device=device)
    other = opt.pack_linear(w_other, device)
    cases = [
        (lambda: opt.eh_proj(e, h, pe, other), r"^h_proj: expected 192 output features"),
        (lambda: opt.eh_proj(e, h[:1], pe, ph), r"^h: expected shape \(2, \*, 1024\)"),
        (lambda: opt.eh_proj(e[0], h, pe, ph), r"^e: expected"),
        (lambda: opt.eh_proj(e, h.float(), pe, ph), r"^h: expected dtype"),
        (lambda: opt.eh_proj(e, h, pe, ph, out=h.new_empty(2, 4, 191)), r"^out: expected"),
        (lambda: opt.eh_proj(e, h, pe, pe), r"^h_proj: expected its own pack"),
        (lambda: opt.eh_proj(e, h, we, ph), r"^e_proj: a QuantizedWeight is packed once"),
        (lambda: opt.eh_proj(e, h, pe, "w"), r"^h_proj: expected a LinearPack"),
        (lambda: opt.eh_proj(e, h, pe, wh.data), r"^h_proj: expected"),  # uint8 codes
    ]
    for call, match in cases:
        with pytest.raises(InputError, match=match):
            call()
    # out over h's own memory (a square weight makes the shapes agree): refused, never a
    # result computed from rows the kernel has already overwritten
    sq_e, sq_h = (
        opt.pack_linear(linear_weight(1, 1024, 1024, "fp8_e8m0", seed=s, device=device), device)
        for s in (34, 35)
    )
    with pytest.raises(InputError, match=r"^out: expected memory apart from h's"):
        opt.eh_proj(e, h, sq_e, sq_h, out=h)
    opt.eh_proj(e, h, sq_e, sq_h, out=torch.empty_like(h))  # apart: accepted
    with pytest.raises(InputError, match=r"^h: expected"):
        ref.eh_proj(e.cpu(), h[:1].cpu(), we, wh)
    with pytest.raises(InputError, match=r"^e: expected shape \(T, 1024\)"):
        ref.eh_proj(e[:, :512].cpu(), h.cpu(), we, wh)
    with pytest.raises(InputError, match=r"^h_proj: expected 192 output features"):
        ref.eh_proj(e.cpu(), h.cpu(), we, w_other)


@pytest.mark.parametrize("rows", [2, 70])
@pytest.mark.parametrize("variant", ["", "_out"])
def test_eh_proj_opcheck(variant: str, rows: int, device: str) -> None:
    """Schema, fake kernel and AOT dispatch (torch.library.opcheck): 2 tokens x 4 streams in
    the one split-K launch (h's counters written), 70 x 4 rows on the prefill path."""
    e, h, we, wh = _eh(rows, 4, "fp8_e8m0", device, N=128, K=512)
    pe, ph = opt.pack_linear(we, device), opt.pack_linear(wh, device)
    args = (e, h, pe.weight, pe.scale, pe.op_fmt, ph.weight, ph.scale, ph.op_fmt, False, False)
    kw: dict[str, torch.Tensor] = {"e_counters": pe.counters, "h_counters": ph.counters}
    if variant:
        kw["out"] = h.new_empty((rows, 4, 128))
    torch.library.opcheck(getattr(torch.ops.dsv4mtp, "eh_proj" + variant).default, args, kw)


# ------------------------------------------------------------------------------ gpu tier
# V4-Flash's linears: (name, rows per token) with h_proj on the 4 mHC streams.
_FLASH = [("e_proj", 1), ("e_proj", 4), ("wqa_wkv", 1), ("wq_b", 1), ("wo_b", 1), ("wo_a", 1)]


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "per_token"), _FLASH, ids=[f"{s}x{p}" for s, p in _FLASH])
@pytest.mark.parametrize("fmt", ["fp8_e8m0", "fp8_f32"])
def test_flash_linears_on_the_gpu(shape: str, per_token: int, fmt: str) -> None:
    """Every V4-Flash dense linear at T 1, 4, 64, 65 and 513 (the decode schedules, the tiled
    one), bf16 against the float64 oracle, act_quant off and on; batch-invariant rows alone."""
    G, N, K = LINEAR_SHAPES[shape]
    qw = linear_weight(max(G, 1), N, K, fmt, seed=16, device="cuda")
    op = "grouped_linear" if G else "linear"
    pack = opt.pack_linear(qw, "cuda", groups=G or None)
    fn = opt.grouped_linear if G else opt.linear
    for T in (1, 4, 64, 65, 513):
        rows = T * per_token
        x = _x(*((rows, G, K) if G else (rows, K)), device="cuda", seed=T)
        for act_quant in (False, True):
            _check(op, fn(x, pack, act_quant=act_quant), x, qw, act_quant=act_quant)
        full = fn(x, pack, batch_invariant=True)
        assert torch.equal(full[-1:], fn(x[-1:], pack, batch_invariant=True))


_PREFILL = ["e_proj", "wqa_wkv", "wq_b", "wo_b", "wo_a"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _PREFILL)
def test_flash_prefill_path_on_the_gpu(shape: str) -> None:
    """V4-Flash's e8m0 linears at 256 and 1024 rows (the dequantize + cuBLAS path): within the
    fp32 summation-order bound of the Triton kernel (format "fp8"), the cuBLAS reduced-precision
    flag as it was after the call, and a CUDA graph of the call (its workspace and cuBLAS
    captured) replays it."""
    G, N, K = LINEAR_SHAPES[shape]
    qw = linear_weight(max(G, 1), N, K, "fp8_e8m0", seed=26, device="cuda")
    pack = opt.pack_linear(qw, "cuda", groups=G or None)
    assert pack.exact_bf16
    fn = opt.grouped_linear if G else opt.linear
    op = torch.ops.dsv4mtp.grouped_linear.default if G else torch.ops.dsv4mtp.linear.default
    w = pack.dequantize(BF16)
    flag = torch._C._get_cublas_allow_bf16_reduced_precision_reduction()
    for rows in (256, 1024):
        x = _x(*((rows, G, K) if G else (rows, K)), device="cuda", seed=rows)
        got = fn(x, pack)
        assert torch._C._get_cublas_allow_bf16_reduced_precision_reduction() == flag
        kernel = op(x, pack.weight, pack.scale, "fp8", False, False, counters=pack.counters)
        for g in range(max(G, 1)):
            xs, ws = (x[:, g], w[g]) if G else (x, w)
            gs, ks = (got[:, g], kernel[:, g]) if G else (got, kernel)
            _agree_to_summation_order(gs, ks, _summation_order_bound(xs, ws))
        out = torch.full_like(got, float("nan"))
        fn(x, pack, out=out)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(x, pack, out=out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # cuBLAS may pick another algorithm on the capture stream: same math, so the bound
        for g in range(max(G, 1)):
            xs, ws = (x[:, g], w[g]) if G else (x, w)
            os_, gs = (out[:, g], got[:, g]) if G else (out, got)
            _agree_to_summation_order(os_, gs, _summation_order_bound(xs, ws))
