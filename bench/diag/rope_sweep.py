"""Tiles of the q / kv norm + RoPE kernel and the output's inverse rotation on the H200.

``norm_rope_kernel`` (kernels/rope.py) at V4-Flash shapes (64 query heads of 512, the last 64
rotary; the kv latent 512), T rows: q's per-head norm + RoPE (T, 64, 512), kv's RMSNorm + RoPE
(T, 1, 512), and the inverse rotation of the attention output's rope dims in place (a
(T, 64, 64) view of (T, 64, 512)).  Each :class:`RopeSchedule` is timed by CUDA-graph replay
of 10 back-to-back calls (median of 10 replays, per call) and checked bit for bit against the
default's output (every schedule computes the same function up to the fp32 order of the norm's
sum of squares, which the tile fixes).  GB/s: the bytes read and written once.

    python3 bench/diag/rope_sweep.py [--tokens 64,512,4096] [--cases q,kv,out]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import graph_time_us

from dsv4mtp.optimized.kernels.rope import (
    NORM_HEAD,
    NORM_NONE,
    NORM_RMS,
    RopeSchedule,
    norm_rope_triton,
    rope_schedule,
)

H, D, DR = 64, 512, 64
# fmt: off
SCHEDULES = {
    "q": [
        (1, 8, 4), (1, 8, 8), (1, 16, 8), (1, 4, 4), (1, 4, 2), (2, 8, 8), (1, 2, 2), (1, 1, 1),
        (1, 2, 1), (1, 4, 1), (2, 1, 1), (1, 1, 2),
    ],
    "kv": [(4, 1, 8), (2, 1, 8), (1, 1, 4), (1, 1, 2), (8, 1, 8)],
    "out": [(1, 64, 4), (1, 64, 8), (1, 32, 4), (2, 64, 8), (4, 64, 8), (1, 16, 2)],
}
# fmt: on


def _rope(src, weight, pos, freqs, dst, norm, inverse, sched) -> torch.Tensor:
    norm_rope_triton(
        src, weight, pos, freqs, dst, rope_dim=DR, norm=norm, eps=1e-6, inverse=inverse,
        schedule=sched,
    )  # fmt: skip
    return dst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="64,512,4096")
    p.add_argument("--cases", default="q,kv,out", help="which of q, kv, out")
    a = p.parse_args()
    unknown = set(a.cases.split(",")) - set(SCHEDULES)
    if unknown:
        p.error(f"--cases: expected names among q, kv, out, got {sorted(unknown)}")
    g = torch.Generator(device="cuda").manual_seed(0)
    freqs = (10000.0 ** (-torch.arange(0, DR, 2, device="cuda") / DR)).float()
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).float()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| case | T | schedule (block_t, block_h, warps) | us | GB/s | equal to default |")
    print("|---|---|---|---|---|---|")
    for T in (int(t) for t in a.tokens.split(",")):
        pos = torch.arange(T, device="cuda") + 1000
        q = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
        kv = torch.randn(T, 1, D, device="cuda", generator=g).to(torch.bfloat16)
        o = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
        for name in a.cases.split(","):
            if name == "out":  # in place on the rope dims of a copy of the whole output
                nbytes = 2 * T * H * DR * 2

                def args(sched, o=o, pos=pos, norm=NORM_NONE) -> tuple:
                    view = o.clone()[..., D - DR :]
                    return view, None, pos, freqs, view, norm, True, sched

            else:
                x, weight, norm = (q, None, NORM_HEAD) if name == "q" else (kv, w, NORM_RMS)
                nbytes = 2 * x.numel() * 2

                def args(sched, x=x, weight=weight, norm=norm, pos=pos) -> tuple:
                    return x, weight, pos, freqs, torch.empty_like(x), norm, False, sched

            default = rope_schedule(H if name != "kv" else 1, D if name != "out" else DR)
            want = _rope(*args(default)).clone()
            for bt, bh, nw in SCHEDULES[name]:
                sched = RopeSchedule(bt, bh, nw)
                same = torch.equal(_rope(*args(sched)), want)
                us = graph_time_us([functools.partial(_rope, *args(sched))], 10, 10)
                mark = " (default)" if sched == default else ""
                print(
                    f"| {name} | {T} | ({bt}, {bh}, {nw}){mark} | {us:.1f} | "
                    f"{nbytes / us / 1e3:.0f} | {same} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
