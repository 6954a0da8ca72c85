"""The shared expert at prefill sizes: the Triton kernels against cuBLAS on the bf16 weight.

V4-Flash's shared expert (D 4096, I 2048) as FP8 codes with power-of-two 128x128 block scales
(V4-Flash's e8m0 scales) and as bf16 weights, T tokens of bf16 x, the clamp at 10.  Each form
runs through ``_ops._shared_expert`` as the moe calls it: the format "fp8_exact" / bf16 takes
cuBLAS from 256 rows (kernels/moe_gemm.py, ``shared_expert_mm``), "fp8" / ``batch_invariant``
the Triton kernels.  Time: CUDA-graph replay of 10 back-to-back calls (median of 10 replays) per
call; error: max |out - oracle| / max |oracle| against a float64 product of the same weights
with the kernels' rounding points (gate, up, h and the output rounded to bf16).

    python3 bench/diag/shared_expert_ab.py [--tokens 256,512,1024,4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h200_mhc import graph_time_us

from dsv4mtp import formats
from dsv4mtp.optimized import _ops
from dsv4mtp.optimized.kernels.moe_schedule import moe_config

D, INTER, LIMIT = 4096, 2048, 10.0


def _fp8(g: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, n, k) e4m3 codes (no NaN) and (1, n/128, k/128) power-of-two fp32 scales."""
    codes = torch.randint(0, 0x7E, (1, n, k), dtype=torch.uint8, device="cuda", generator=g)
    sign = torch.randint(0, 2, (1, n, k), dtype=torch.uint8, device="cuda", generator=g) << 7
    exps = torch.randint(-13, -10, (1, n // 128, k // 128), device="cuda", generator=g)
    return (codes | sign).contiguous(), torch.exp2(exps.float()).contiguous()


def _dequant(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    w = formats.decode_e4m3(codes[0], dtype=torch.float64)
    return w * scale[0].double().repeat_interleave(128, 0).repeat_interleave(128, 1)


def _oracle(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    def bf(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).double()

    gu = bf(x.double() @ w13.T)
    g, u = gu[:, :INTER].clamp(max=LIMIT), gu[:, INTER:].clamp(-LIMIT, LIMIT)
    h = bf(g * torch.sigmoid(g) * u)
    return bf(h @ w2.T)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="256,512,1024,4096")
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    c13, s13 = _fp8(g, 2 * INTER, D)
    c2, s2 = _fp8(g, D, INTER)
    w13, w2 = _dequant(c13, s13), _dequant(c2, s2)
    b13, b2 = w13.to(torch.bfloat16)[None], w2.to(torch.bfloat16)[None]  # exact
    empty = torch.empty(0, device="cuda")
    forms = {
        "fp8, Triton": (c13, s13, c2, s2, "fp8", False),
        "fp8, cuBLAS": (c13, s13, c2, s2, "fp8_exact", False),
        "bf16, Triton": (b13, empty, b2, empty, "bf16", True),
        "bf16, cuBLAS": (b13, empty, b2, empty, "bf16", False),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; D {D}, I {INTER}")
    print(f"{'T':>5s} {'form':14s} {'us':>8s} {'TFLOP/s':>8s} {'rel err':>9s}")
    for T in (int(t) for t in a.tokens.split(",")):
        x = (torch.randn(T, D, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
        want = _oracle(x, w13, w2)
        flop = 2.0 * T * D * 3 * INTER
        sched = moe_config(T, batch_invariant=False, fmt="mxfp4_tiles_fold")
        for name, (w_13, s_13, w_2, s_2, fmt, bi) in forms.items():
            args = (x, w_13, s_13, w_2, s_2, fmt, LIMIT, False, sched, bi)

            def call(args: tuple = args) -> torch.Tensor:
                return _ops._shared_expert(*args)

            out = call()
            out = out.sum(0) if out.dim() == 3 else out  # fp32 split partials, if any
            err = float((out.double() - want).abs().max() / want.abs().max())
            us = graph_time_us([call], 10, 10)
            print(f"{T:5d} {name:14s} {us:8.1f} {flop / us / 1e6:8.1f} {err:9.2e}")


if __name__ == "__main__":
    main()
