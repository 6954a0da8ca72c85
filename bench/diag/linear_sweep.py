"""Prefill-sized FP8 linears on the H200: the Triton kernel's tile schedules against cuBLAS.

For each V4-Flash dense linear at T rows (h_proj at 4T: it runs on the hc_mult streams) times
``linear_triton`` under several (BLOCK_M, BLOCK_N, warps, stages) schedules without a K split,
and, as the speed of light, cuBLAS bf16 on the dequantized weight (``torch.mm``, fp32
accumulation), plus the dequantization itself (e4m3 codes x e8m0 scales -> bf16, exact).
Prints one table: us per call (CUDA-graph replay, weights past the L2), TFLOP/s, and each
schedule's rel. error against the default's output.  Then the prefill path the ops take from
``DEQUANT_MM_MIN_ROWS`` rows (kernels/linear.py, ``linear_dequant_mm``): the Triton dequant
alone, and dequant + cuBLAS as one call.

    python3 bench/diag/linear_sweep.py [--tokens 512,4096] [--rows 128,256,512,4096] [--quick]

``--rows``: these row counts for every linear (instead of tokens x rows per token);
``--quick``: only the default schedule of the Triton kernel, no sweep.
"""

from __future__ import annotations

import argparse

import torch

from dsv4mtp.optimized.kernels.linear import (
    FMT_FP8,
    LinearSchedule,
    dequant_bf16_triton,
    linear_dequant_mm,
    linear_schedule,
    linear_triton,
)

# (name, N, K, groups, rows per token)
SHAPES = [
    ("e_proj", 4096, 4096, 1, 1),
    ("h_proj", 4096, 4096, 1, 4),
    ("wq_a+wkv", 1536, 4096, 1, 1),
    ("wq_b", 32768, 1024, 1, 1),
    ("wo_a (G 8)", 1024, 4096, 8, 1),
    ("wo_b", 4096, 8192, 1, 1),
]
SCHEDULES = [
    (64, 128, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 4, 3),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
    (64, 256, 8, 3),
    (128, 64, 4, 4),
    (256, 128, 8, 3),
]


def graph_us(fn, reps: int = 10) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


def run_shape(name: str, N: int, K: int, G: int, R: int, quick: bool) -> None:
    w = torch.randint(0, 126, (G, N, K), dtype=torch.uint8, device="cuda")
    w |= torch.randint(0, 2, w.shape, dtype=torch.uint8, device="cuda") << 7
    e = torch.randint(118, 122, (G, N // 128, K // 128), device="cuda")
    s = torch.exp2(e.float() - 127)
    x = torch.randn(R, G, K, device="cuda").to(torch.bfloat16)
    y = torch.empty(R, G, N, device="cuda", dtype=torch.bfloat16)
    flops = 2 * R * G * N * K
    d = linear_schedule(R, N, K, G, False)
    linear_triton(x, w, s, y, fmt=FMT_FP8, sched=d)
    want = y.float().clone()
    for bm, bn, nw, ns in [] if quick else SCHEDULES:
        sched = LinearSchedule(bm, bn, 1, num_warps=nw, num_stages=ns)
        try:
            us = graph_us(lambda sched=sched: linear_triton(x, w, s, y, fmt=FMT_FP8, sched=sched))
        except Exception as exc:  # a schedule that does not fit (shared memory)
            print(f"| {name} | {R} | {bm}x{bn} w{nw} s{ns} | failed: {type(exc).__name__} | | |")
            continue
        err = float((y.float() - want).norm() / want.norm())
        mark = " (default)" if sched == d else ""
        print(f"| {name} | {R} | {bm}x{bn} w{nw} s{ns}{mark} | {us:.1f} | "
              f"{flops / us / 1e6:.0f} | {err:.1e} |")  # fmt: skip
    # cuBLAS on the exactly dequantized weight, and the dequantization itself
    sx = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :K]

    def deq() -> torch.Tensor:
        return (w.view(torch.float8_e4m3fn).to(torch.bfloat16) * sx).to(torch.bfloat16)

    wb = deq()
    us_deq = graph_us(deq, reps=5)
    yb = torch.empty(G, R, N, device="cuda", dtype=torch.bfloat16)
    xt = x.transpose(0, 1)
    us_mm = graph_us(lambda: torch.bmm(xt, wb.transpose(1, 2), out=yb))
    err = float((yb.transpose(0, 1).float() - want).norm() / want.norm())
    print(f"| {name} | {R} | cuBLAS bf16 (dequantized weight) | {us_mm:.1f} | "
          f"{flops / us_mm / 1e6:.0f} | {err:.1e} |")  # fmt: skip
    print(f"| {name} | {R} | dequantize e4m3 x e8m0 -> bf16 (torch ops) | {us_deq:.1f} | | |")
    # the ops' prefill path: Triton dequant into a bf16 workspace, then one cuBLAS GEMM
    wt = torch.empty(G, N, K, device="cuda", dtype=torch.bfloat16)
    dequant_bf16_triton(w, s, wt)
    exact = torch.equal(wt, wb)
    us_tdeq = graph_us(lambda: dequant_bf16_triton(w, s, wt))
    gbps = G * N * K * 3 / us_tdeq / 1e3
    print(f"| {name} | {R} | dequantize (Triton kernel) | {us_tdeq:.1f} | {gbps:.0f} GB/s | "
          f"exact: {exact} |")  # fmt: skip
    us_path = graph_us(lambda: linear_dequant_mm(x, w, s, y))
    err = float((y.float() - want).norm() / want.norm())
    print(f"| {name} | {R} | prefill path: dequant + cuBLAS | {us_path:.1f} | "
          f"{flops / us_path / 1e6:.0f} | {err:.1e} |")  # fmt: skip
    if quick:
        us_def = graph_us(lambda: linear_triton(x, w, s, y, fmt=FMT_FP8, sched=d))
        print(f"| {name} | {R} | Triton default {d.block_m}x{d.block_n} split {d.split_k} | "
              f"{us_def:.1f} | {flops / us_def / 1e6:.0f} | |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--rows", default="", help="row counts for every linear (overrides --tokens)")
    ap.add_argument("--quick", action="store_true", help="no schedule sweep")
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    print("| linear | rows | schedule | us | TFLOP/s | rel. err vs default |")
    print("|---|---|---|---|---|---|")
    if args.rows:
        for R in (int(r) for r in args.rows.split(",")):
            for name, N, K, G, _ in SHAPES:
                run_shape(name, N, K, G, R, args.quick)
        return
    for T in (int(t) for t in args.tokens.split(",")):
        for name, N, K, G, per in SHAPES:
            run_shape(name, N, K, G, T * per, args.quick)


if __name__ == "__main__":
    main()
