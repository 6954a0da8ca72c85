"""The FP8 LM head's error against the bf16 head, on the CPU, at V4-Flash's head shape.

What ``pack_head(head, format="fp8")`` changes (optimized/lm_head.py): the head's bf16 values
rounded to e4m3 with one power-of-two scale per 128x128 block.  This measures, on a synthetic
head drawn as the synthetic checkpoint draws it (N(0, 1/D) in bf16, dsv4mtp/checkpoint/synthetic.py)
and rows y drawn as the head sees them (N(0, 1) rows scaled to rms 1 times the norm weight
1 + N(0, 0.1^2), in bf16), the logits' relative and absolute error, top-1 agreement and top-5
overlap of the FP8 head against the bf16 head, for the 128x128 blocks pack_head uses and, for
comparison, per-row 1x128 blocks (one power-of-two scale per row and 128 columns).

Logits are fp32 products of the bf16 / decoded values (exact) summed in fp32 (the same values
the kernels compute up to summation order, ~1e-7 relative: far below the FP8 error).  The head
is processed in V chunks of whole 128-row blocks to bound memory (~1 GB at the defaults).
Random heads have no structure: their logits are ~N(0, 1) with close runners-up (the top-2 gap
is ~0.1-0.2 at V 129280), which makes this a pessimistic proxy; draft acceptance with an FP8
head needs the real weights.

    python bench/head_fp8_error.py                     # V 129280, D 4096, 2048 rows
    python bench/head_fp8_error.py --rows 256 --out /tmp/head-fp8.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch

from dsv4mtp import formats
from dsv4mtp.quant import pow2_scale

BLOCK = formats.FP8_BLOCK


def fp8_128x128(w: torch.Tensor) -> torch.Tensor:
    """w (n, D) -> its 128x128-block e4m3 values with ue8m0 scales, decoded to fp32 (what
    pack_head(format="fp8") stores: the core's quantize_fp8_block)."""
    q, s = formats.quantize_fp8_block(w, scale_fmt="e8m0")
    return formats.dequantize_fp8_block(q, s)


def fp8_1x128(w: torch.Tensor) -> torch.Tensor:
    """w (n, D) -> e4m3 with one power-of-two scale per row and 128 columns (the core's
    pow2_scale rule, as activations are quantized), decoded to fp32."""
    n, D = w.shape
    blocks = w.float().view(n, D // BLOCK, BLOCK)
    scale = pow2_scale(blocks.abs().amax(-1, keepdim=True))  # (n, D/128, 1)
    codes = formats.encode_e4m3(blocks / scale)
    return (formats.decode_e4m3(codes) * scale).view(n, D)


class Stats:
    """Running error sums and per-row top-5 of one head variant against the bf16 head."""

    def __init__(self, rows: int) -> None:
        self.sq_err = 0.0
        self.max_abs = 0.0
        self.top_v = torch.full((rows, 5), -math.inf)
        self.top_i = torch.zeros((rows, 5), dtype=torch.int64)

    def add(self, logits: torch.Tensor, ref: torch.Tensor | None, v0: int) -> None:
        if ref is not None:
            d = (logits - ref).double()
            self.sq_err += float(d.square().sum())
            self.max_abs = max(self.max_abs, float(d.abs().max()))
        v, i = logits.topk(5, dim=-1)
        allv = torch.cat([self.top_v, v], 1)
        alli = torch.cat([self.top_i, i + v0], 1)
        # stable: at equal values the earlier (lower-index) chunk stays first
        order = torch.argsort(allv, dim=1, descending=True, stable=True)
        self.top_v = allv.gather(1, order)[:, :5]
        self.top_i = alli.gather(1, order)[:, :5]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=129280)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=8192, help="head rows per step (multiple of 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/head-fp8.json", help="JSON file ('' = none)")
    args = p.parse_args()
    if args.chunk % BLOCK:
        raise SystemExit(f"--chunk must be a multiple of {BLOCK}")
    t0 = time.time()
    T, V, D = args.rows, args.vocab, args.hidden
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(T, D, generator=g)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16)
    y = (x.to(torch.bfloat16) * norm_w).float()  # (T, D), bf16 values, as the head sees them
    base = Stats(T)
    variants = {"fp8_128x128": Stats(T), "fp8_1x128": Stats(T)}
    ref_sq = 0.0
    ref_max = 0.0
    for v0 in range(0, V, args.chunk):
        n = min(args.chunk, V - v0)
        w = (torch.randn(n, D, generator=g) * D**-0.5).to(torch.bfloat16)  # (n, D) head rows
        ref = y @ w.float().T  # (T, n)
        ref_sq += float(ref.double().square().sum())
        ref_max = max(ref_max, float(ref.abs().max()))
        base.add(ref, None, v0)
        for name, quant in (("fp8_128x128", fp8_128x128), ("fp8_1x128", fp8_1x128)):
            variants[name].add(y @ quant(w).T, ref, v0)
        print(f"  head rows {v0 + n:>6d} / {V}  ({time.time() - t0:.0f} s)", flush=True)
    gaps = base.top_v[:, 0] - base.top_v[:, 1]  # (T,) bf16 head's top-1 minus top-2 logit
    gap_hist = [float(q) for q in torch.quantile(gaps, torch.tensor([0.1, 0.5, 0.9]))]
    result: dict[str, object] = {
        "command": "python bench/head_fp8_error.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} (CPU)",
        "rows": T,
        "vocab": V,
        "hidden": D,
        "logit_rms": math.sqrt(ref_sq / (T * V)),
        "logit_max_abs": ref_max,
        "bf16_top2_gap_p10_p50_p90": gap_hist,
        "seconds": round(time.time() - t0, 1),
    }
    top1_base = base.top_i[:, 0]
    for name, st in variants.items():
        top1 = (st.top_i[:, 0] == top1_base).float().mean().item()
        overlap = torch.tensor(
            [
                len(set(a.tolist()) & set(b.tolist())) / 5
                for a, b in zip(st.top_i, base.top_i, strict=True)
            ]
        )
        in_top5 = (st.top_i[:, :1] == base.top_i).any(-1).float().mean().item()
        result[name] = {
            "logit_rel_err": math.sqrt(st.sq_err / ref_sq),  # ||fp8 - bf16|| / ||bf16||
            "logit_rms_abs_err": math.sqrt(st.sq_err / (T * V)),
            "logit_max_abs_err": st.max_abs,
            "top1_agreement": top1,
            "top5_overlap": float(overlap.mean()),
            "top1_in_bf16_top5": in_top5,
        }
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
