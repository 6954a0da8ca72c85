"""Decode-sized FP8 linears on the H200: the split-K schedules of ``linear_triton``, weights cold.

For each V4-Flash dense linear at T tokens (h_proj at 4T rows: it runs on the hc_mult streams)
up to ``DECODE_MAX_ROWS`` rows, times the default schedule and candidates over BLOCK_N (32, 64,
128), the number of programs the K split aims at (132, 264, 528, 1056: ``_split`` doubles the
split up to it, each split keeping two K blocks or more), and (warps, stages).  BLOCK_M is the
default's (one M block holds every row).

Timing: one CUDA graph of back-to-back calls cycling over enough copies of the weight (>= 192
MB in all) that no call finds its weight in the 60 MB L2, as in the layer's step, where seven
other weights pass between two calls of one linear; us per call is the graph's median replay
time (10 replays, bench/h200_mhc.py's ``graph_time_us``) over its calls.  Each candidate's output is checked against the default's
(finite, rel. Frobenius error <= 2e-3: only the split's summation order differs); a failing
candidate is printed and never picked.  Prints one row per (linear, rows): default and best
schedule, us, GB/s of codes, then per T the sum over the six linears (the step's linear time).

    python3 bench/diag/linear_decode_sweep.py [--tokens 1,8,64] [--cap-s 300]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import graph_time_us
from linear_sweep import SHAPES

from dsv4mtp.optimized.kernels.linear import (
    BLOCK_K,
    DECODE_MAX_ROWS,
    FMT_FP8,
    LinearSchedule,
    _split,
    linear_schedule,
    linear_triton,
)

BLOCK_NS = (32, 64, 128)
TARGETS = (132, 264, 528, 1056)
WARPS_STAGES = ((4, 4), (4, 6), (8, 4), (2, 4), (4, 3))
COLD_BYTES = 192 << 20


def candidates(rows: int, N: int, K: int, G: int) -> list[LinearSchedule]:
    """Phase one: BLOCK_N x split target at the default's warps and stages."""
    d = linear_schedule(rows, N, K, G, False)
    kb = math.ceil(K / BLOCK_K)
    out = [d]
    for bn in BLOCK_NS:
        nt = math.ceil(N / bn) * G
        for target in TARGETS:
            c = LinearSchedule(d.block_m, bn, _split(nt, kb, target), d.num_warps, d.num_stages)
            if c not in out:
                out.append(c)
    return out


def refinements(best: list[LinearSchedule]) -> list[LinearSchedule]:
    """Phase two: (warps, stages) around phase one's two best tiles."""
    return [
        LinearSchedule(c.block_m, c.block_n, c.split_k, num_warps=nw, num_stages=ns)
        for c in best
        for nw, ns in WARPS_STAGES
    ]


def label(c: LinearSchedule) -> str:
    return f"{c.block_m}x{c.block_n} split {c.split_k} w{c.num_warps} s{c.num_stages}"


def cold_weights(N: int, K: int, G: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``copies`` random FP8 weights (G, N, K): finite e4m3 codes of both signs and e8m0-like
    block scales 2^-9 .. 2^-6, on the GPU."""
    out = []
    for _ in range(copies):
        w = torch.randint(0, 126, (G, N, K), dtype=torch.uint8, device="cuda")
        w |= torch.randint(0, 2, w.shape, dtype=torch.uint8, device="cuda") << 7
        e = torch.randint(118, 122, (G, math.ceil(N / 128), math.ceil(K / 128)), device="cuda")
        out.append((w, torch.exp2(e.float() - 127)))
    return out


def sweep(name: str, N: int, K: int, G: int, rows: int, deadline: float) -> tuple[float, float]:
    nbytes = G * N * K
    copies = max(2, math.ceil(COLD_BYTES / nbytes))
    ws = cold_weights(N, K, G, copies)
    x = torch.randn(rows, G, K, device="cuda").to(torch.bfloat16)
    ys = [torch.empty(rows, G, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
    want: list[torch.Tensor] = []
    results: list[tuple[float, LinearSchedule]] = []

    def run(c: LinearSchedule) -> None:
        calls = [
            lambda w=w, s=s, y=y: linear_triton(x, w, s, y, fmt=FMT_FP8, sched=c)
            for (w, s), y in zip(ws, ys, strict=True)
        ]
        try:
            for f in calls:
                f()
            torch.cuda.synchronize()
        except Exception as exc:  # a schedule that does not fit (shared memory, registers)
            print(f"| {name} | {rows} | {label(c)} | failed: {type(exc).__name__} | | | | |")
            return
        if not want:
            want.extend(y.float().clone() for y in ys)
        err = max(float((y.float() - r).norm() / r.norm()) for y, r in zip(ys, want, strict=True))
        if not (err <= 2e-3):
            print(f"| {name} | {rows} | {label(c)} | wrong: rel {err:.1e} | | | | |")
            return
        results.append((graph_time_us(calls, len(calls), 10), c))

    cands = candidates(rows, N, K, G)
    d = cands[0]
    for phase in (1, 2):
        if phase == 2:
            top = [c for _, c in sorted(results, key=lambda r: r[0])[:2]]
            cands = [c for c in refinements(top) if all(c != r for _, r in results)]
        for c in cands:
            if time.monotonic() > deadline:
                break
            run(c)
    if not any(c == d for _, c in results):
        print(f"| {name} | {rows} | time cap reached | | | | | |")
        return 0.0, 0.0
    t_def = next(us for us, c in results if c == d)
    us_best, best = min(results, key=lambda r: r[0])
    gbs = nbytes / us_best / 1e3
    print(
        f"| {name} | {rows} | {label(d)} | {t_def:.1f} | {label(best)} | {us_best:.1f} | "
        f"{gbs:.0f} | {len(results)} |"
    )
    top = sorted(results, key=lambda r: r[0])[:4]
    print(
        "|  |  | next: " + "; ".join(f"{label(c)} {us:.1f}" for us, c in top[1:]) + " | | | | | |"
    )
    return t_def, us_best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--cap-s", type=float, default=300.0)
    args = ap.parse_args()
    deadline = time.monotonic() + args.cap_s
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| linear | rows | default | us | best | us | GB/s (codes) | schedules timed |")
    print("|---|---|---|---|---|---|---|---|")
    totals = {}
    for T in (int(t) for t in args.tokens.split(",")):
        tot_d = tot_b = 0.0
        for name, N, K, G, per in SHAPES:
            rows = T * per
            if rows > DECODE_MAX_ROWS:
                continue
            td, tb = sweep(name, N, K, G, rows, deadline)
            tot_d, tot_b = tot_d + td, tot_b + tb
        totals[T] = (tot_d, tot_b)
    for T, (td, tb) in totals.items():
        print(f"T {T}: linears up to {DECODE_MAX_ROWS} rows, default {td:.1f} us, best {tb:.1f} us")


if __name__ == "__main__":
    main()
