"""The routed MXFP4 gate/up GEMM of a 4096-token prefill in the wgmma kernel, variants timed alone.

V4-Flash experts (E 256, N 4096 interleaved gate/up rows, K 4096) in the tiles layout with
foldable scales, T tokens routed uniformly (top-6), the align kernel's 128- or 64-row blocks;
each variant of ``moe_mx_wgmma_kernel`` (warps: 64 or 128 weight rows per program; stages)
writes the same fp32 partials, checked bit for bit against the first
and, for two M blocks, against an fp64 product of the decoded weights.  CUDA-event time of
one launch (median of 10), TFLOP/s of the real rows.

    python3 bench/diag/moe_wgmma_probe.py [--tokens 4096] [--block-m 128]
"""

from __future__ import annotations

import argparse

import torch

from dsv4mtp import formats
from dsv4mtp.optimized.kernels._launch import triton_launch
from dsv4mtp.optimized.kernels.moe_align import moe_align_triton
from dsv4mtp.optimized.kernels.moe_gemm_gluon import moe_mx_wgmma_kernel
from dsv4mtp.optimized.moe import mx_tiles


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--experts", type=int, default=256)
    a = p.parse_args()
    torch.manual_seed(0)
    E, N, K, T, top = a.experts, 4096, 4096, a.tokens, 6
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda")
    sc = torch.randint(117, 123, (E, N, K // 32), dtype=torch.uint8, device="cuda")
    tc, ts = mx_tiles(codes, sc, interleaved=False)
    x = (torch.randn(T, K, device="cuda") * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:top] for _ in range(T)]).int()
    bm = a.block_m
    sorted_slot, block_expert = moe_align_triton(ids, None, E, bm, chunk=128, num_warps=8)
    nb = block_expert.numel()
    w32, s32 = tc.view(torch.int32), ts.view(torch.int32)
    real = int((sorted_slot >= 0).sum())
    flop = 2.0 * real * N * K

    def run(part, stages, warps):
        triton_launch(
            moe_mx_wgmma_kernel, GATHER=True, BLOCK_T=bm, SPLIT_K=1, STAGES=stages,
            NUM_WARPS=warps, num_warps=warps,
        )(
            (N // (16 * warps), nb, 1), x, w32, s32, sorted_slot, block_expert, part,
            K, N, top, w32[0].numel(), s32[0].numel(), part.shape[1],
        )  # fmt: skip

    variants = [
        ("8 warps, 4 stages", (4, 8)),
        ("8 warps, 3 stages", (3, 8)),
        ("8 warps, 5 stages", (5, 8)),
        ("4 warps, 4 stages", (4, 4)),
        ("4 warps, 3 stages", (3, 4)),
    ]
    first = None
    print(f"T {T}, block_m {bm}, {nb} blocks, {real} rows, {flop / 1e12:.3f} TFLOP")
    for name, v in variants:
        part = torch.full((1, nb * bm, N), float("nan"), device="cuda")
        try:
            run(part, *v)
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"{name:28s} FAILED {type(exc).__name__}: {str(exc)[:300]}")
            continue
        valid = (sorted_slot >= 0).view(1, -1, 1).expand_as(part)
        ok = bool(torch.isfinite(part[valid]).all())
        same = "first" if first is None else str(torch.equal(part[valid], first[valid]))
        if first is None:
            first = part.clone()
        ts_ = []
        for _ in range(10):
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record()
            run(part, *v)
            s1.record()
            torch.cuda.synchronize()
            ts_.append(s0.elapsed_time(s1) * 1e3)
        us = sorted(ts_)[len(ts_) // 2]
        print(f"{name:28s} {us:9.1f} us  {flop / us / 1e6:6.1f} TFLOP/s  finite {ok}  equal {same}")
    # fp64 check of two blocks against the decoded weights
    assert first is not None
    worst = 0.0
    for b in (0, nb // 2):
        e = int(block_expert[b])
        if e < 0:
            continue
        rows = sorted_slot[b * bm : (b + 1) * bm]
        keep = rows >= 0
        xr = x[(rows[keep] // top).long()].double()
        c = codes[e]
        w = torch.stack(
            [formats.decode_e2m1(c & 15, dtype=torch.float64),
             formats.decode_e2m1(c >> 4, dtype=torch.float64)], -1
        ).reshape(N, K)  # fmt: skip
        w = w * formats.decode_e8m0(sc[e], dtype=torch.float64).repeat_interleave(32, dim=1)
        want = xr @ w.T
        got = first[0, b * bm : (b + 1) * bm][keep].double()
        # the partials' columns: [gate ; up] of interleaved rows (row 2c -> c, 2c + 1 -> I + c)
        idx = torch.arange(N, device="cuda")
        col = (idx % 2) * (N // 2) + idx // 2
        got = got[:, col]
        err = float((got - want).abs().max() / (xr.abs() @ w.abs().T).max())
        worst = max(worst, err)
    print(f"fp64 check of two blocks: max |err| / max(|x| @ |W|^T) = {worst:.2e}")


if __name__ == "__main__":
    main()
