"""The routed MXFP4 GEMMs of a prefill in the Gluon kernels, variants timed alone.

V4-Flash experts (E 256; gate/up: N 4096 interleaved gate and up rows, K 4096; down: N 4096,
K 2048) in the tiles layout with foldable scales, T tokens routed uniformly (top-6), the align
kernel's blocks of each variant's row count.  A variant is a kernel and its tile:

* ``wg:BM:WARPS:STAGES``: ``moe_mx_wgmma_kernel`` on BM-row blocks (wgmma's N; 16 to 128),
  16 x WARPS weight rows per program, its fp32 partials (no SwiGLU epilogue);
* ``v2:BM:WARPS``: ``moe_mx_gluon_kernel`` (mma_v2) on BM-row blocks (8 to 32), 128 weight
  rows per program (the decode-size default's tile).

Every variant writes fp32 partials into a NaN-poisoned buffer; its real rows must be finite, and
for two M blocks they are checked against an fp64 product of the decoded weights, and the
partials of a wgmma variant against the first wgmma variant's on the same block rows (the
same chain of MMAs: bit for bit).  CUDA-event time of one launch (median of 10), TFLOP/s of
the real rows (padding rows excluded).

    python3 bench/diag/moe_wgmma_probe.py [--tokens 512,1024] [--gemm gate_up,down]
        [--variants v2:16:4,wg:16:8:4,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import _median_event_ms as median_event_ms

from dsv4mtp import formats
from dsv4mtp.optimized.kernels._launch import triton_launch
from dsv4mtp.optimized.kernels.moe_align import moe_align_triton
from dsv4mtp.optimized.kernels.moe_gemm_gluon import moe_mx_gluon, moe_mx_wgmma_kernel
from dsv4mtp.optimized.kernels.moe_schedule import GemmTile
from dsv4mtp.optimized.moe import mx_tiles

DEFAULT_VARIANTS = "v2:16:4,v2:32:4,wg:16:8:4,wg:32:8:4,wg:16:4:4,wg:32:4:4,wg:64:8:4"


def _parse(spec: str) -> tuple[str, int, int, int]:
    kind, *nums = spec.split(":")
    if kind == "wg" and len(nums) == 3:
        return kind, int(nums[0]), int(nums[1]), int(nums[2])
    if kind == "v2" and len(nums) == 2:
        return kind, int(nums[0]), int(nums[1]), 3
    raise SystemExit(f"--variants: expected wg:BM:WARPS:STAGES or v2:BM:WARPS, got {spec!r}")


def _runner(kind, bm, warps, stages, gate_up, top, x, tc, ts, sorted_slot, block_expert, part):
    """One launch of the variant's kernel over these inputs."""
    N, nb = tc.shape[1], block_expert.numel()
    w32, s32 = tc.view(torch.int32), ts.view(torch.int32)
    K = x.shape[1]
    if kind == "wg":
        launch = triton_launch(
            moe_mx_wgmma_kernel, GATHER=gate_up, BLOCK_T=bm, SPLIT_K=1, STAGES=stages,
            NUM_WARPS=warps, SWIGLU=False, num_warps=warps,
        )  # fmt: skip
        return lambda: launch(
            (N // (16 * warps), nb, 1), x, w32, s32, sorted_slot, block_expert, part,
            part, part, part, K, N, top, w32[0].numel(), s32[0].numel(), part.shape[1], 0.0,
        )  # fmt: skip
    tile = GemmTile(block_n=128, block_k=128, num_warps=warps, num_stages=3)
    return lambda: moe_mx_gluon(
        x, tc, ts, sorted_slot, block_expert, part, gather=gate_up, top_k=top, tile=tile,
        block_m=bm, fold=True,
    )  # fmt: skip


def probe(T: int, gemm: str, variants: list[str], E: int, top: int) -> None:
    gate_up = gemm == "gate_up"
    N, K = 4096, 4096 if gate_up else 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda", generator=g)
    sc = torch.randint(117, 123, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=g)
    tc, ts = mx_tiles(codes, sc, interleaved=False)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:top] for _ in range(T)])
    ids = ids.int()
    # gate/up reads x at the slots' tokens; down reads one h row per M-block row, made per
    # variant (its rows follow the blocks) from one h row per slot
    x_tok = (torch.randn(T, K, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    h_slot = (torch.randn(T * top, K, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    real = T * top
    flop = 2.0 * real * N * K
    print(f"\n{gemm}, T {T}: N {N}, K {K}, {real} routed rows, {flop / 1e12:.3f} TFLOP")
    print(f"{'variant':14s} {'blocks':>6s} {'us':>9s} {'TFLOP/s':>8s}  fp64 check")
    first_wg: dict[int, tuple[str, torch.Tensor]] = {}  # block rows -> first wgmma variant
    for spec in variants:
        kind, bm, warps, stages = _parse(spec)
        sorted_slot, block_expert = moe_align_triton(ids, None, E, bm, chunk=128, num_warps=8)
        nb = block_expert.numel()
        slots = sorted_slot.long()
        if gate_up:
            x = x_tok
            part = torch.full((1, nb * bm, N), float("nan"), device="cuda")
        else:
            x = h_slot[slots.clamp(min=0)].contiguous()  # (nb * bm, K): block rows
            part = torch.full((1, real, N), float("nan"), device="cuda")

        run = _runner(
            kind, bm, warps, stages, gate_up, top, x, tc, ts, sorted_slot, block_expert, part
        )
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # a variant that does not compile or launch is reported
            print(f"{spec:14s} FAILED {type(exc).__name__}: {str(exc)[:300]}")
            continue
        us = median_event_ms(run, 10) * 1e3
        # the rows of part that hold real results, and the slot behind each
        got_rows = part[0][sorted_slot >= 0] if gate_up else part[0]
        finite = bool(torch.isfinite(got_rows).all())
        worst = 0.0
        idx = torch.arange(N, device="cuda")
        col = (idx % 2) * (N // 2) + idx // 2 if gate_up else idx
        for b in (0, nb // 2):
            e = int(block_expert[b])
            if e < 0:
                continue
            blk = sorted_slot[b * bm : (b + 1) * bm]
            keep = blk >= 0
            rows = blk[keep].long()
            xr = (x_tok[rows // top] if gate_up else h_slot[rows]).double()
            c = codes[e]
            w = torch.stack(
                [formats.decode_e2m1(c & 15, dtype=torch.float64),
                 formats.decode_e2m1(c >> 4, dtype=torch.float64)], -1
            ).reshape(N, K)  # fmt: skip
            w = w * formats.decode_e8m0(sc[e], dtype=torch.float64).repeat_interleave(32, dim=1)
            want = xr @ w.T
            if gate_up:
                got = part[0, b * bm : (b + 1) * bm][keep].double()[:, col]
            else:
                got = part[0][rows].double()
            err = float((got - want).abs().max() / (xr.abs() @ w.abs().T).max())
            worst = max(worst, err)
        same = ""
        if kind == "wg":
            if bm in first_wg:
                ref_spec, ref = first_wg[bm]
                eq = (part == ref) | (part.isnan() & ref.isnan())  # unwritten rows stay NaN
                same = f", bits of {ref_spec}: {bool(eq.all())}"
            else:
                first_wg[bm] = (spec, part.clone())
        print(
            f"{spec:14s} {nb:6d} {us:9.1f} {flop / us / 1e6:8.1f}  finite {finite}, "
            f"max |err| / max(|x| @ |W|^T) = {worst:.1e}{same}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="512,1024")
    p.add_argument("--gemm", default="gate_up,down")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--experts", type=int, default=256)
    a = p.parse_args()
    variants = a.variants.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for gemm in a.gemm.split(","):
        for T in (int(t) for t in a.tokens.split(",")):
            probe(T, gemm, variants, a.experts, 6)


if __name__ == "__main__":
    main()
